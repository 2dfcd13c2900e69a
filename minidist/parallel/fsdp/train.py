"""FSDP's driver: ``train --strategy fsdp [--sharding-strategy FULL_SHARD|SHARD_GRAD_OP|NO_SHARD]``
for ``--model mlp`` (one unit) or ``gpt`` (a unit per block and the root), and with ``--tp T``
(``config.tp``) the GPT split by tensor parallelism inside each of P / T replicas
(:mod:`~minidist.parallel.fsdp.compose`: a (dp, tp) mesh, tp applied first, then FSDP over dp).

The run is ``train --strategy ddp``'s (each rank reads its share of the global batch, the same
lr scaling, schedule and clipping) with the model wrapped in ``FullyShardedDataParallel`` and
the workload's optimizer built on this rank's shards. What changes: the gradient norm is clipped
over the shards (``FullyShardedDataParallel.clip_grad_norm_``: one number all-reduced);
evaluation runs the sharded model, so every rank evaluates (rank 0 prints); a checkpoint
gathers every rank's shards and optimizer state into one file (``Checkpointer(...,
gathered=True)``; resuming needs the same sharding strategy, and the same number of ranks unless
``--global-batch-size`` is given: then the shards are cut again, ``minidist.resharding``); the sample,
``--save-model`` and the returned model are a dense copy loaded from ``full_state_dict``. The
figures add the bytes each rank sent per training step (ring: 3Ψ(P-1)/P for FULL_SHARD,
2Ψ(P-1)/P for the others, plus the clipping's number) and what rank 0 holds of the parameters
and of the optimizer state.

With T > 1 the same driver runs on the mesh: each dp coordinate reads its part of the global
batch (the T ranks of a tp group the same windows), the lr is scaled by the P / T replicas
alone, the clipping norm counts each parameter once over dp and tp, evaluation runs the split
and sharded GPT on every rank, and the dense model is joined over tp from each tp rank's full
state dict. The first log line and the figures add dp and tp (and the bytes per step of each
group); T = 1 prints what it always printed. A checkpoint under tp resumes with the same T;
with ``--global-batch-size`` on another number of replicas too (each tp coordinate's saved
pieces cut again over the new dp size: :func:`~minidist.parallel.fsdp.compose.reshard_replicas`),
but not with another T (refused by the checkpoint's fingerprint, naming tp: joining the tp shards
out of the flat pieces and cutting them again both ways is not written).
"""
from __future__ import annotations

import functools

from minidist import memory, precision
from minidist.fault import Checkpointer
from minidist.parallel.fsdp.compose import (
    CountedMesh,
    ReplicaShardLayout,
    clip_function,
    dense_state,
    evaluated_model,
    loss_function,
    parallelize,
    reshard_replicas,
)
from minidist.parallel.fsdp.unit import SHARDING_STRATEGIES
from minidist.parallel.tensor_parallel.gpt import even_split_sizes, uneven_split
from minidist.resharding import ShardLayout
from minidist.train import (
    ParallelRun,
    StepBytes,
    TrainConfig,
    TrainResult,
    batch_description,
    data_parallel_lr,
    global_batch,
    loss_weight,
    per_rank_config,
    sharded_step,
    train_parallel,
    workload_for,
)


def check_fsdp(world_size: int, config: TrainConfig) -> None:
    """Raise ValueError, naming the fix, for what ``--strategy fsdp`` cannot run: an unknown
    sharding strategy; ``--sequence-parallel`` without ``--tp`` above 1; and with ``config.tp``
    T > 1 (FSDP over P / T replicas, tensor parallelism inside: :mod:`.compose`): T not a
    positive integer, not the GPT, T not dividing the ranks, n_head or 4 n_embd not divisible
    by T (``tensor_parallel.gpt.uneven_split``, the one rule), dropout, mixed precision, a
    ``--block-size`` that T does not divide under sequence parallelism."""
    if config.sharding_strategy not in SHARDING_STRATEGIES:
        raise ValueError(f"--sharding-strategy {config.sharding_strategy} is not one of "
                         f"{', '.join(SHARDING_STRATEGIES)}")
    tp = config.tp
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"--tp must be a positive integer, got {tp!r}")
    if config.sharding_strategy == "HYBRID_SHARD" and tp > 1:
        raise ValueError(f"--sharding-strategy HYBRID_SHARD shards within each node and replicates across them, "
                         f"over all the ranks; with --tp {tp} use FULL_SHARD (FSDP over the replicas of tp groups), "
                         "or leave out --tp")
    if config.sequence_parallel and tp == 1:
        raise ValueError("--sequence-parallel cuts the positions over the tensor-parallel ranks; with --strategy "
                         "fsdp give --tp 2 or more, or leave out --sequence-parallel")
    if tp == 1:
        return
    if getattr(config, "model", "mlp") != "gpt":
        raise ValueError(f"--strategy fsdp --tp {tp} splits the GPT's layers (heads, MLP features) inside each "
                         "replica; use --model gpt, or leave out --tp")
    sizes = [t for t in even_split_sizes(config.n_head, config.n_embd) if world_size % t == 0]
    if world_size % tp:
        raise ValueError(f"--tp {tp} does not divide the {world_size} ranks (FSDP shards over ranks / tp replicas "
                         f"of tp ranks each); run on a multiple of {tp} ranks, or use --tp among {sizes}")
    problem = uneven_split(config.n_head, config.n_embd, tp)
    if problem is not None:
        flag, n = ("--n-head", "4 x --n-embd")[problem[0]], problem[1]
        raise ValueError(f"--tp {tp}: {flag} = {n} is not divisible by {tp} (each tensor-parallel rank holds the "
                         f"same number of heads and MLP features); use --tp among {sizes}, or change --n-head")
    if config.dropout:
        raise ValueError(f"--strategy fsdp with --tp {tp} needs --dropout 0 (got {config.dropout:g}): each "
                         "tensor-parallel rank would draw its own dropout masks, and the split model would no "
                         "longer compute the one-process model")
    if config.precision != "fp32":
        raise ValueError(f"--strategy fsdp with --tp {tp} trains in float32 (the tensor-parallel collectives send "
                         f"no bfloat16); leave out --precision {config.precision}, or --tp")
    if config.sequence_parallel and config.block_size % tp:
        raise ValueError(f"--sequence-parallel cuts each window's {config.block_size} positions into --tp {tp} "
                         f"equal blocks; use a --block-size that {tp} divides, or leave out --sequence-parallel")


def layout_line(config: TrainConfig, mesh, model, lr: float) -> str:
    """The run's first log line: the sharding strategy, the ranks (dp x tp under tp; nodes x
    ranks per node under HYBRID_SHARD), the batch, the lr, the units and the numbers each rank
    holds (under tp, of its tp shard)."""
    dp, tp = mesh.size("dp"), mesh.size("tp")
    ranks = f"{dp} ranks"
    if tp > 1:
        ranks = f"{dp * tp} ranks = dp {dp} x tp {tp} (tp fastest; the ranks of a tp group read the same windows)"
    elif model.replicate_comm is not None:  # HYBRID_SHARD: FULL_SHARD in each node, the nodes replicas
        nodes, l = model.replicate_comm.Get_size(), model.shard_comm.Get_size()
        ranks = f"{dp} ranks = {nodes} nodes x {l} (FULL_SHARD in a node, replicas across the nodes)"
    sp = f", sequence parallel ({config.block_size // tp} positions each)" if config.sequence_parallel else ""
    return (f"fsdp {config.sharding_strategy}: {ranks}, {batch_description(config, dp)}, lr {lr:g}{sp}, "
            f"{len(model.units)} units, "
            f"{sum(u.shard.size for u in model.units)} of {sum(u.flat.numel for u in model.units)} numbers per rank")


def run_figures(config: TrainConfig, mesh, model, optimizer, lr: float, step: StepBytes, everyone, scaler) -> dict:
    """:func:`train_fsdp`'s figures (its docstring); ``everyone``: ``step.per_step``'s list (rank
    0), and under tp a second list of each rank's bytes per step by group."""
    dp, tp = mesh.size("dp"), mesh.size("tp")
    totals, by_group = everyone
    layout = {} if tp == 1 else {"dp": dp, "tp": tp, "sequence_parallel": "on" if config.sequence_parallel else "off"}
    names = ("dp", "tp") if tp > 1 else ("node", "cross") if model.replicate_comm is not None else ()
    groups = {f"{name}_bytes_per_step": ",".join(str(r[name]) for r in by_group) for name in names}
    return {"ranks": dp * tp, **layout, "global_batch": global_batch(config, dp), "lr": f"{lr:g}",
            "sharding_strategy": config.sharding_strategy, "units": len(model.units),
            "bytes_per_step": ",".join(map(str, totals)), **groups, "bytes_communicated": step.bytes,
            "parameter_bytes": memory.parameter_bytes(model.parameters()),
            "optimizer_state_bytes": memory.optimizer_state_bytes(optimizer),
            **precision.figures(config.precision, scaler)}


def step_counters(model, mesh):
    """What a step's bytes are counted on: the dp group; under tp each group of the mesh apart;
    under HYBRID_SHARD the node and the cross-node groups apart (the broadcast at the start, on
    the dp group, is before any step)."""
    if mesh.size("tp") > 1:
        return mesh.traffic
    if model.replicate_comm is not None:
        return {"node": model.shard_comm, "cross": model.replicate_comm}
    return mesh.traffic["dp"]


def checkpoint_layout(model, mesh, config: TrainConfig) -> dict:
    """The Checkpointer's ``layout``: each unit's shard and its moments, their offsets saved
    beside each rank's part and cut again on another number of ranks (``minidist.resharding``).
    Under tp the offsets are this rank's in its dp group (:class:`.compose.ReplicaShardLayout`)
    and the ``reshard`` is each tp coordinate's parts cut again for another number of replicas
    (:func:`.compose.reshard_replicas`)."""
    pieces = [(unit.flat, unit.sharded) for unit in model.units]  # each unit's shard and its moments
    parts = dict(model={name: piece for (name, _), piece in zip(model.named_parameters(), pieces)},
                 optimizer=pieces, names=model.names)
    if mesh.size("tp") == 1:
        return {"layout": ShardLayout(**parts)}
    return {"layout": ReplicaShardLayout(mesh.get_local_rank("dp"), **parts),
            "reshard": functools.partial(reshard_replicas, tp=mesh.size("tp"),
                                         sharded=config.sharding_strategy != "NO_SHARD")}


def train_fsdp(comm, config: TrainConfig, dataset, *, checkpointer_class=Checkpointer) -> TrainResult | None:
    """Fully sharded data-parallel training of ``config``'s workload over ``comm`` with
    ``config.sharding_strategy``, with tensor parallelism inside when ``config.tp`` T > 1
    (module docstring; :func:`.compose.parallelize` on a (P / T, T) mesh):
    :func:`~minidist.train.train_parallel` with :class:`FSDPRun`. Every wait gives up
    after ``config.timeout`` seconds.

    Returns a TrainResult on rank 0 (figures: ranks, under tp dp, tp and sequence_parallel,
    global_batch, lr, sharding_strategy, units, bytes_per_step (each rank's mean over the
    training steps, rank order; under tp also dp_bytes_per_step and tp_bytes_per_step, by
    group), bytes_communicated (rank 0's in training steps), parameter_bytes and
    optimizer_state_bytes (rank 0's shards and state); ``model``: a dense model with the trained
    weights) and None elsewhere. Raises ValueError for what :func:`check_fsdp` refuses,
    NonFiniteLossError on a diverging run, checkpoint_io.CheckpointError for a checkpoint of
    another layout (another --tp; another number of ranks without ``config.global_batch_size``),
    TrainingStopped after
    ``config.stop_after_steps``. Sources: Rajbhandari et al., SC 2020; Zhao et al., VLDB 2023;
    Shoeybi et al. 2019; torchtitan's ``parallelize_llama`` for the composition.
    """
    check_fsdp(comm.Get_size(), config)
    return train_parallel(FSDPRun, comm, config, dataset, checkpointer_class=checkpointer_class)


class FSDPRun(ParallelRun):
    """FSDP's parallelize step and hooks (:func:`train_fsdp`): a (P / T, T) mesh of counted
    groups, the model laid out by :func:`.compose.parallelize` (tp first, then FSDP over dp),
    the workload's optimizer on this rank's shards. Evaluation runs the sharded model, so every
    rank reports (rank 0 prints)."""

    reports_everywhere = True

    def __init__(self, comm, config: TrainConfig, dataset):
        self.mesh = CountedMesh(comm, config.tp)
        dp_rank, dp = self.mesh.get_local_rank("dp"), self.mesh.size("dp")
        config = per_rank_config(config, dp, dp_rank)  # --global-batch-size: this replica's part of it
        work = workload_for(config, dataset)
        model = parallelize(work.model(), self.mesh, config)  # the ranks of a tp group read the same windows
        lr = data_parallel_lr(work, config, dp)
        super().__init__(comm, config, work, model, work.optimizer(model.parameters(), lr), lr, dp_rank, dp)
        self.evaluated = evaluated_model(model, self.mesh)

    def step(self):
        scaler = self.scaler  # fp32 master shards
        return StepBytes(sharded_step(loss_function(self.work, self.model, self.mesh), self.optimizer, self.schedule,
                                      clip_function(self.model, self.mesh, self.work.grad_clip),
                                      precision=self.config.precision,
                                      scaler=scaler if scaler.is_enabled() else None, comm=self.comm,
                                      device=self.config.device, loss_weight=loss_weight(self.config, self.dp,
                                                                                         self.dp_rank)),
                         step_counters(self.model, self.mesh))

    def describe(self) -> str:
        return layout_line(self.config, self.mesh, self.model, self.lr)

    def report(self, epoch, loss, seconds):  # every rank: the sharded forward is collective
        return self.work.report(self.evaluated, epoch, loss, seconds, self.log, world_size=self.dp)

    def checkpoint_options(self) -> dict:
        return {"gathered": True, **checkpoint_layout(self.model, self.mesh, self.config)}

    def finish(self, checkpointer):
        checkpointer.close()
        dense = self.work.model()
        dense.load_state_dict(dense_state(self.model, self.mesh))  # every rank takes part; rank 0 samples and saves
        if self.comm.Get_rank() == 0 and self.config.save_model:
            Checkpointer(self.config, dense, None, metadata=self.work.metadata()).save_model()
        return dense

    def figures(self, step) -> dict | None:
        everyone = step.per_step(self.comm), step.per_step(self.comm, by_name=True) if len(step.counters) > 1 else None
        if self.comm.Get_rank() != 0:
            return None
        return run_figures(self.config, self.mesh, self.model, self.optimizer, self.lr, step, everyone, self.scaler)

    def free(self) -> None:
        self.mesh.free()
