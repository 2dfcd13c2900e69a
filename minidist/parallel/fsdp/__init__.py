"""Fully sharded data parallelism (ZeRO-2/3; PyTorch's FSDP): parameters, gradients and
optimizer state each 1/P per rank, a unit's parameters gathered only while it runs.

- ``release``  letting a unit's gathered vector go between its forward and its backward
- ``unit``   :class:`FlatUnit`: one unit's padded flat vector, its gather, free and reduce-scatter
- ``fsdp``   :class:`FullyShardedDataParallel` (**contract**): units, hooks into forward and
             backward, forward prefetch, clipping, the full state dict
- ``compose``  FSDP over the dp dimension of a (dp, tp) mesh with tensor parallelism inside:
             ``parallelize`` (apply_tp, then ``apply_fsdp``), the norm, loss and dense weights
- ``train``  the driver of ``train --strategy fsdp [--sharding-strategy ...] [--tp T]``

Sources: Rajbhandari et al., "ZeRO" (SC 2020); Zhao et al., "PyTorch FSDP" (VLDB 2023);
torchtitan's ``parallelize_llama`` for the composition.
"""
from minidist.parallel.fsdp.compose import apply_fsdp, parallelize
from minidist.parallel.fsdp.fsdp import FullyShardedDataParallel
from minidist.parallel.fsdp.train import check_fsdp, train_fsdp
from minidist.parallel.fsdp.unit import SHARDING_STRATEGIES, FlatUnit

__all__ = ["FullyShardedDataParallel", "FlatUnit", "SHARDING_STRATEGIES", "apply_fsdp", "check_fsdp", "parallelize",
           "train_fsdp"]
