"""Fully sharded data parallelism (ZeRO-2/3; PyTorch's FSDP): parameters, gradients and
optimizer state each 1/P per rank, a unit's parameters gathered only while it runs.

- ``release``  letting a unit's gathered vector go between its forward and its backward
- ``unit``   :class:`FlatUnit`: one unit's padded flat vector, its gather, free and reduce-scatter
- ``fsdp``   :class:`FullyShardedDataParallel` (**contract**): units, hooks into forward and
             backward, forward prefetch, clipping, the full state dict
- ``train``  the driver of ``train --strategy fsdp [--sharding-strategy ...]``

Sources: Rajbhandari et al., "ZeRO" (SC 2020); Zhao et al., "PyTorch FSDP" (VLDB 2023).
"""
from minidist.parallel.fsdp.fsdp import FullyShardedDataParallel
from minidist.parallel.fsdp.train import train_fsdp
from minidist.parallel.fsdp.unit import SHARDING_STRATEGIES, FlatUnit

__all__ = ["FullyShardedDataParallel", "FlatUnit", "SHARDING_STRATEGIES", "train_fsdp"]
