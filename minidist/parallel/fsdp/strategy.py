"""``--strategy fsdp`` declares itself: its sharding strategy (torch's names), and what its runs
can do (a global batch, mixed precision, resuming on another number of ranks, one dense model
out of a checkpoint's shards)."""
from __future__ import annotations

from minidist.parallel.fsdp.train import check_fsdp, train_fsdp
from minidist.parallel.fsdp.unit import SHARDING_STRATEGIES
from minidist.resharding import consolidate
from minidist.strategy import Flag, Strategy

SHARDING_STRATEGY = Flag("--sharding-strategy", "sharding_strategy", dict(
    choices=SHARDING_STRATEGIES, help="fsdp: FULL_SHARD (ZeRO-3: parameters, gradients and optimizer state sharded), "
                                      "SHARD_GRAD_OP (ZeRO-2: parameters whole from a unit's forward to its "
                                      "backward) or NO_SHARD (as ddp) (default: FULL_SHARD)"))

STRATEGY = Strategy(
    name="fsdp", driver=train_fsdp, summary="fsdp (fully sharded data parallelism, ZeRO-2/3)",
    flags=(SHARDING_STRATEGY,), check=check_fsdp, global_batch=True, elastic=lambda config: True,
    consolidate=consolidate)
