"""ZeRO stage 1 (Rajbhandari et al., SC 2020): the optimizer's state sharded over the
data-parallel ranks, each rank stepping its shard and all-gathering the others.

- ``flat``       :class:`FlatParameter`: parameters laid end to end, padded so P ranks hold
                 equal shards (FSDP's units use it too)
- ``optimizer``  :class:`ZeroRedundancyOptimizer` (**contract**, torch's name)
- ``train``      the driver of ``train --strategy ddp --zero``
"""
from minidist.parallel.zero.flat import FlatParameter
from minidist.parallel.zero.optimizer import ZeroRedundancyOptimizer, optimizer_defaults
from minidist.parallel.zero.train import train_zero

__all__ = ["FlatParameter", "ZeroRedundancyOptimizer", "optimizer_defaults", "train_zero"]
