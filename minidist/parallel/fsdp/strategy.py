"""``--strategy fsdp`` declares itself: its sharding strategy (torch's names), tensor parallelism
inside each replica (``--tp``, ``--sequence-parallel``: ``compose.parallelize`` applies tp, then
fsdp), and what its runs can do (a global batch, mixed precision without --tp, resuming on another
number of replicas, one dense model out of a checkpoint's shards)."""
from __future__ import annotations

from minidist.parallel.fsdp.compose import consolidate_fsdp
from minidist.parallel.fsdp.train import check_fsdp, train_fsdp
from minidist.parallel.fsdp.unit import SHARDING_STRATEGIES
from minidist.parallel.tensor_parallel.strategy import LAYOUT_NOTES, SEQUENCE_PARALLEL, TP
from minidist.strategy import Flag, Strategy

SHARDING_STRATEGY = Flag("--sharding-strategy", "sharding_strategy", dict(
    choices=SHARDING_STRATEGIES, help="fsdp: FULL_SHARD (ZeRO-3: parameters, gradients and optimizer state sharded), "
                                      "SHARD_GRAD_OP (ZeRO-2: parameters whole from a unit's forward to its "
                                      "backward), NO_SHARD (as ddp) or HYBRID_SHARD (FULL_SHARD in each node, the "
                                      "nodes replicas: the sim's or the machines' nodes, or MINIDIST_RANKS_PER_NODE) "
                                      "(default: FULL_SHARD)"))

STRATEGY = Strategy(
    name="fsdp", driver=train_fsdp, summary="fsdp (fully sharded data parallelism, ZeRO-2/3)",
    flags=(SHARDING_STRATEGY, TP, SEQUENCE_PARALLEL), check=check_fsdp, global_batch=True,
    replicas=lambda config, world_size: world_size // config.tp,
    mixed_precision=lambda config: "; --strategy fsdp with --tp trains in fp32" if config.tp > 1 else None,
    elastic=lambda config: config.sharding_strategy != "HYBRID_SHARD", layout_notes=LAYOUT_NOTES,
    resize_rule=lambda config: (f" (--strategy fsdp --tp {config.tp} needs a multiple of {config.tp})"
                                if config.tp > 1 else ""),
    consolidate=consolidate_fsdp)
