"""``ddp --zero`` declares itself: a variant of ``--strategy ddp`` (the same flags, data and
reports) trained by ZeRO-1's driver, whose optimizer state is sharded over the ranks. The
``--zero`` flag is this wing's; ``--strategy 3d`` takes it too (ZeRO-1 over each dp group)."""
from __future__ import annotations

from minidist.parallel.zero.train import check_zero, train_zero
from minidist.resharding import consolidate
from minidist.strategy import Flag, Strategy

ZERO = Flag("--zero", "zero", dict(
    action="store_true", help="ddp: shard the optimizer's state over the ranks (ZeRO-1, ZeroRedundancyOptimizer): "
                              "each rank steps 1/N of the parameters and all-gathers the rest; 3d: the same over each "
                              "dp group"))

STRATEGY = Strategy(
    name="zero", driver=train_zero, label="ddp --zero", summary="ddp --zero",
    variant_of="ddp", when=lambda config: bool(config.zero), flags=(ZERO,), check=check_zero,
    global_batch=True, elastic=lambda config: True, consolidate=consolidate)
