"""Parallel training: one file per way of splitting the work.

- ``data_parallel``     DistributedDataParallel: replicas, bucketed gradient all-reduce
- ``parameter_server``  workers push gradients to sharded servers (sync, async, bounded staleness)
- ``inference``         data-parallel evaluation: shard the test set, gather once
- ``pipeline``          model split into stages; GPipe, 1F1B, interleaved, zero-bubble schedules
"""
from minidist.parallel import pipeline
from minidist.parallel.data_parallel import DistributedDataParallel
from minidist.parallel.inference import evaluate
from minidist.parallel.parameter_server import ParameterServer, Worker, train_parameter_server

__all__ = ["DistributedDataParallel", "evaluate", "ParameterServer", "Worker", "train_parameter_server", "pipeline"]
