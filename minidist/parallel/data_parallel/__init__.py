"""Data parallelism: a replica of the model on every rank, gradients averaged after backward.

Read in this order:

- ``ddp``         DistributedDataParallel: the same start, buckets in reverse order, the
                  all-reduce of each bucket overlapped with backward, ``no_sync``
- ``comm_hooks``  what a bucket sends: fp32 all-reduce, fp16/bf16, int8 and top-k with error
                  feedback (``register_comm_hook``, PyTorch's name)
- ``inference``   data-parallel evaluation: shard the test set, gather three integers per rank
- ``train``       the driver of ``train --strategy ddp``
"""
from minidist.parallel.data_parallel.ddp import DistributedDataParallel
from minidist.parallel.data_parallel.inference import evaluate
from minidist.parallel.data_parallel.train import train_ddp

__all__ = ["DistributedDataParallel", "evaluate", "train_ddp"]
