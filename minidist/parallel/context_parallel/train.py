"""The context-parallel driver: ``train --model gpt --strategy cp --cp-variant V [--dp D] [--tp T]`` (mpiexec).

The P ranks form a :class:`~minidist.parallel.mesh.DeviceMesh` of shape (D, C, T), names
("dp", "cp", "tp"), C = P / (D T), tp fastest, then cp: the T ranks of a tp group are
neighbours (four all-reduces a layer), then the C ranks of a cp group (one attention exchange a
layer, forward and backward); data parallelism once per step, so it may cross the slowest links.
Without ``--tp`` (T = 1)::

    P = 4, D = 2:   dp_rank 0  [0 1]     cp groups [0 1] [2 3]   (the parts of the same sequences)
                    dp_rank 1  [2 3]     dp groups [0 2] [1 3]

Each dp coordinate reads its part of the global batch (``--global-batch-size G``, or
``--batch-size`` windows per dp group), every rank of a cp x tp group the same windows, of
which it keeps its positions (:mod:`.gpt`: the model takes the whole (B, T) ids and cuts them).
The parallelize step (:func:`parallelize`) is torchtitan's order (``parallelize_llama`` in
``torchtitan/models/llama3/infra/parallelize.py``: apply_tp, then apply_cp_to_attention_module,
then apply_fsdp over a dp mesh that includes the cp ranks): the dense GPT is split over its tp
group (T > 1: ``tensor_parallel.apply_tp``, each rank its heads, MLP features and vocabulary
rows, with ``--sequence-parallel`` its block of positions between the split layers), laid out
over its cp group (:func:`.gpt.apply_cp`, or :func:`.compose.apply_cp_to_tp` on the split
model: attention over the cp group on each tp rank's heads), then wrapped in
``DistributedDataParallel`` over the D x C ranks that hold the same tp shards (all ranks
without tp), whose average is the one-process gradient (the cp loss's backward scales each
rank's part by C: :mod:`.gpt`). FSDP in place of DDP (sharding over dp x cp, torchtitan's
``dp_shard_cp``) is there at the model's level (``parallelize(..., sharding_strategy=)``), not
as a run yet: ``TrainConfig`` has no field that asks for it (``sharding_strategy`` defaults to
FULL_SHARD), so ``--sharding-strategy`` stays refused with ``--strategy cp`` by the command line.

What a run adds to the GPT's training: every rank evaluates (the cp model's forward is
collective over its cp group), rank 0 prints; the clipping norm is the dense one (after DDP's
average every rank holds the whole gradient, or under tp its shards' whole gradient, their
squares summed over tp once: ``TensorParallelGPT.clip_grad_norm_``); the sample and
``--save-model`` use a dense GPT with the trained weights (under tp joined from the shards).
A checkpoint resumes on the same mesh (under tp every rank's shards are gathered into it).
The figures add each rank's bytes per step inside its cp group (and its tp group) and the
chunk pairs of attention it computed per step (``blocks.BlockCounter``, all layers).
"""
from __future__ import annotations

from minidist.collectives import gather_objects
from minidist.fault import Checkpointer
from minidist.models.gpt import GPT
from minidist.parallel.context_parallel.blocks import BlockCounter
from minidist.parallel.context_parallel.compose import apply_cp_to_tp, apply_fsdp_over_dp_cp, dp_cp_group
from minidist.parallel.context_parallel.gpt import apply_cp
from minidist.parallel.context_parallel.layout import check_length, rank_chunks, shard_lengths
from minidist.parallel.context_parallel.ulysses import check_heads
from minidist.parallel.data_parallel.ddp import DistributedDataParallel
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.tensor_parallel.gpt import apply_tp, even_split_sizes, uneven_split
from minidist.tracing import CountingComm
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
    supervised_step,
    train_parallel,
    workload_for,
)

MESH_NAMES = ("dp", "cp", "tp")


def check_context_parallel(world_size: int, config: TrainConfig) -> None:
    """Raise ValueError, naming the fix, when ``config`` cannot train with ``--strategy cp`` on
    ``world_size`` ranks: not the GPT, ``--dp`` not dividing the ranks, ``--tp`` not dividing a
    dp group's ranks or not splitting the GPT evenly (n_head, 4 · n_embd), a context
    (``--block-size``) too short to cut over the cp ranks (zig-zag: 2 chunks per rank), Ulysses
    with a number of cp ranks that does not divide the heads a tp rank holds (n_head / tp),
    ``--sequence-parallel`` without ``--tp`` or with cp parts that tp does not divide,
    dropout, mixed precision."""
    if getattr(config, "model", "mlp") != "gpt":
        raise ValueError("--strategy cp cuts the GPT's sequences over the ranks; use --model gpt")
    dp, tp = config.dp, config.tp
    if world_size % dp:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(f"--dp {dp} does not divide the {world_size} ranks (each of the --dp groups holds ranks / "
                         f"dp cp ranks); use --dp among {divisors}")
    check_tensor_parallel_split(world_size // dp, config)
    cp, variant = world_size // (dp * tp), config.cp_variant
    try:
        check_length(config.block_size, cp, variant)
    except ValueError:
        need = 2 * cp if variant == "zigzag" else cp
        raise ValueError(f"--strategy cp --cp-variant {variant} cuts each window of --block-size "
                         f"{config.block_size} into {need} parts over {cp} cp ranks; use --block-size {need} or more, "
                         "or fewer cp ranks (a larger --dp)") from None
    if variant == "ulysses":
        try:
            check_heads(config.n_head // tp, cp)
        except ValueError as error:
            local = f" (--n-head {config.n_head} / --tp {tp}: the heads of one tp rank)" if tp > 1 else ""
            raise ValueError(f"--cp-variant ulysses on {cp} cp ranks{local}: {error}; or change --n-head / --dp"
                             f"{' / --tp' if tp > 1 else ''}") from None
    if config.sequence_parallel:
        lengths, multiple = shard_lengths(config.block_size, cp, variant), tp * cp * (2 if variant == "zigzag" else 1)
        if any(length % tp for length in lengths):
            raise ValueError(f"--sequence-parallel cuts each cp rank's part of the --block-size {config.block_size} "
                             f"positions ({variant} over {cp} cp ranks: {lengths}) into --tp {tp} equal blocks; use "
                             f"a --block-size whose cp parts {tp} divides (a multiple of {multiple}), or leave out "
                             "--sequence-parallel")
    if config.dropout:
        raise ValueError(f"--strategy cp needs --dropout 0 (got {config.dropout:g}): each rank would draw its own "
                         "dropout masks for its positions, and the run would no longer compute the one-process model")
    if config.precision != "fp32":
        raise ValueError(f"--strategy cp trains in float32 (the attention's blocks travel as float32); leave out "
                         f"--precision {config.precision}")


def check_tensor_parallel_split(group_size: int, config: TrainConfig) -> None:
    """The tp half of :func:`check_context_parallel`: ``config.tp`` must divide the
    ``group_size`` ranks of a dp group (the rest are cp ranks) and split the GPT evenly
    (``tensor_parallel.uneven_split``); ``--sequence-parallel`` needs tp > 1."""
    tp = config.tp
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"--tp must be a positive integer, got {tp!r}")
    if config.sequence_parallel and tp == 1:
        raise ValueError("--sequence-parallel cuts the positions over the tensor-parallel ranks; with --strategy cp "
                         "give --tp 2 or more, or leave out --sequence-parallel")
    fits = [t for t in even_split_sizes(config.n_head, config.n_embd) if group_size % t == 0]
    if group_size % tp:
        raise ValueError(f"--tp {tp} does not divide the {group_size} ranks of a dp group (each holds cp x tp ranks, "
                         f"cp = ranks / (dp x tp)); use --tp among {fits}, or another --dp")
    problem = uneven_split(config.n_head, config.n_embd, tp)
    if problem is not None:
        flag, n = ("--n-head", "4 x --n-embd")[problem[0]], problem[1]
        raise ValueError(f"--tp {tp}: {flag} = {n} is not divisible by {tp} (each tensor-parallel rank holds the "
                         f"same number of heads and MLP features); use --tp among {fits}, or change --n-head")


def parallelize(model, mesh, comm, config, counter=None, groups=None, sharding_strategy=None):
    """``model`` (the dense GPT, the same on every rank) split over ``mesh``'s tp group when it
    has more than one rank (``tensor_parallel.apply_tp``), laid out over its cp group (for the
    dense model :func:`.gpt.apply_cp`, for the split one :func:`.compose.apply_cp_to_tp`;
    ``counter``: a ``BlockCounter`` its attention adds to), then replicated by
    ``DistributedDataParallel`` over the ranks of ``comm`` that hold the same tp shards (all of
    them without tp; :func:`.compose.dp_cp_group`), or, with ``sharding_strategy`` (FSDP's:
    "FULL_SHARD", ...), sharded over them (:func:`.compose.apply_fsdp_over_dp_cp`). ``mesh``: a
    DeviceMesh with "cp" and "tp"; ``groups``: {"cp": ..., "tp": ...} communicators to use in
    their place (counting ones), or None. Returns ``(model, wrapper, dp_cp)``: the cp model, the
    DDP or FSDP wrapper, and the dp x cp group (to free; None when it is ``comm``). Collective
    over ``comm``."""
    # TP, then CP, then data parallelism: torchtitan's order. TP cuts each layer by heads and
    # features (it needs the dense matrices); CP only changes which positions a layer sees, so it
    # wraps whatever attention the layer has, here each tp rank's heads; data parallelism (DDP
    # or FSDP) comes last because it only needs the parameters as they are laid out.
    groups = groups or {name: mesh.get_group(name) for name in ("cp", "tp")}
    if mesh.size("tp") == 1:
        cp_model, dp_cp = apply_cp(model, groups["cp"], config, counter), None
    else:
        cp_model = apply_cp_to_tp(apply_tp(model, groups["tp"], config), groups["cp"], config, counter)
        dp_cp = dp_cp_group(comm, mesh)
    group = comm if dp_cp is None else dp_cp
    if sharding_strategy is not None:
        return cp_model, apply_fsdp_over_dp_cp(cp_model, group, sharding_strategy), dp_cp
    return cp_model, DistributedDataParallel(cp_model, group), dp_cp


def train_context_parallel(comm, config: TrainConfig, dataset, *, checkpointer_class=Checkpointer
                           ) -> TrainResult | None:
    """Context-parallel training of ``config``'s GPT over ``comm``, with tensor parallelism
    inside when ``config.tp`` > 1 (module docstring):
    :func:`~minidist.train.train_parallel` with :class:`ContextParallelRun`, every wait giving
    up after ``config.timeout`` seconds.

    Returns a TrainResult on rank 0 (figures: ranks, dp, cp, tp (when > 1), cp_variant, global_batch, lr,
    cp_bytes_per_step (each rank's bytes sent inside its cp group per training step, rank
    order; under tp also tp_bytes_per_step, inside its tp group, and sequence_parallel),
    dp_bytes_communicated (rank 0's gradient all-reduce bytes), block_pairs_per_step
    (each rank's attention chunk pairs per step, all layers, forward); ``model``: a dense GPT
    with the trained weights) and None elsewhere. Raises ValueError for a layout
    :func:`check_context_parallel` refuses, NonFiniteLossError, checkpoint_io.CheckpointError,
    fault.TrainingStopped after ``config.stop_after_steps``. Sources: Liu et al. 2023; Dubey et
    al. 2024; Jacobs et al. 2023; torchtitan's ``parallelize_llama`` for the composition."""
    check_context_parallel(comm.Get_size(), config)
    return train_parallel(ContextParallelRun, comm, config, dataset, checkpointer_class=checkpointer_class)


class ContextParallelRun(ParallelRun):
    """cp's parallelize step and hooks (:func:`train_context_parallel`): the (dp, cp, tp) mesh,
    the GPT split over the tp group (tp > 1), laid out over the cp group (both counted:
    ``tracing.CountingComm``) and replicated by DDP over the ranks holding the same tp shards,
    AdamW on this rank's parameters. Every rank reports (rank 0 prints)."""

    reports_everywhere = True

    def __init__(self, comm, config: TrainConfig, dataset):
        dp, tp = config.dp, config.tp
        self.mesh = DeviceMesh(comm, (dp, comm.Get_size() // (dp * tp), tp), MESH_NAMES)
        dp_rank = self.mesh.get_local_rank("dp")
        config = per_rank_config(config, dp, dp_rank)  # --global-batch-size: this dp group's part of it
        work = workload_for(config, dataset)
        self.traffic = {name: CountingComm(self.mesh.get_group(name), allow_collectives=True, keep_messages=False)
                        for name in ("cp", "tp")}
        self.counter, self.pairs = BlockCounter(), 0
        model, self.ddp, self.dp_cp = parallelize(work.model(), self.mesh, comm, config, self.counter, self.traffic)
        lr = data_parallel_lr(work, config, dp)
        super().__init__(comm, config, work, model, work.optimizer(self.ddp.parameters(), lr), lr, dp_rank, dp)

    def step(self):
        ddp, work, model = self.ddp, self.work, self.model
        weight = loss_weight(self.config, self.dp, self.dp_rank)
        if self.mesh.size("tp") == 1:
            step = supervised_step(ddp, self.optimizer, device=self.config.device, lr_schedule=self.schedule,
                                   loss_fn=lambda x, y: ddp(x, y)[1], grad_clip=work.grad_clip, loss_weight=weight)
        else:  # the clipping norm of the split model: each tp shard's squares summed over tp once
            clip = (lambda: model.clip_grad_norm_(work.grad_clip)) if work.grad_clip else None
            step = sharded_step(lambda x, y: ddp(x, y)[1], self.optimizer, self.schedule, clip, loss_weight=weight)

        def counted(x, y):
            before = self.counter.forward_pairs
            loss = step(x, y)
            self.pairs += self.counter.forward_pairs - before
            return loss

        return StepBytes(counted, self.traffic)

    def describe(self) -> str:
        config, cp, tp = self.config, self.mesh.size("cp"), self.mesh.size("tp")
        chunks = rank_chunks(config.block_size, cp, self.mesh.get_local_rank("cp"), config.cp_variant)
        held = " and ".join(f"{start}:{stop}" for start, stop in chunks)
        split = (f" x tp {tp} (tp fastest, then cp; each tp rank {config.n_head // tp} heads and "
                 f"{4 * config.n_embd // tp} MLP features{', sequence parallel' if config.sequence_parallel else ''}, "
                 "cp on its heads; " if tp > 1 else " (cp fastest; ")
        return (f"cp {config.cp_variant}: {self.mesh.size()} ranks = dp {self.dp} x cp {cp}{split}a cp group reads "
                f"the same windows, rank 0 holds positions {held} of {config.block_size}), "
                f"{batch_description(config, self.dp)}, lr {self.lr:g}")

    def report(self, epoch, loss, seconds):  # every rank: the cp model's forward is collective
        return self.work.report(self.model, epoch, loss, seconds, self.log, world_size=self.dp)

    def checkpoint_options(self) -> dict:
        # under tp each rank holds other shards: every rank's state goes into the checkpoint
        # (resumed on the same mesh); without tp every rank holds the same, rank 0 writes it
        return {"gathered": True} if self.mesh.size("tp") > 1 else {}

    def finish(self, checkpointer):
        self.ddp.verify_synced()
        if self.mesh.size("tp") == 1:
            checkpointer.save_model()  # the cp model's state dict is the dense model's
            dense = self.work.model()
            dense.load_state_dict(self.model.state_dict())
            return dense
        checkpointer.close()
        model = self.model
        dense = GPT(model.config, dtype=str(model.transformer.wte.weight.dtype), device=self.config.device)
        dense.load_state_dict(model.full_state_dict())  # joined over tp: every rank takes part
        if self.comm.Get_rank() == 0 and self.config.save_model:
            Checkpointer(self.config, dense, None, metadata=self.work.metadata()).save_model()
        return dense

    def figures(self, step) -> dict | None:
        steps = max(step.steps, 1)
        sent = step.per_step(self.comm, by_name=True)
        pairs = gather_objects(self.comm, round(self.pairs / steps))
        if self.comm.Get_rank() != 0:
            return None
        config, tp = self.config, self.mesh.size("tp")
        split = {"tp": tp} if tp > 1 else {}
        figures = {"ranks": self.mesh.size(), "dp": self.dp, "cp": self.mesh.size("cp"), **split,
                   "cp_variant": config.cp_variant, "global_batch": global_batch(config, self.dp),
                   "lr": f"{self.lr:g}", "cp_bytes_per_step": ",".join(str(rank["cp"]) for rank in sent)}
        if tp > 1:  # without tp the figures are cp's as they were
            figures["tp_bytes_per_step"] = ",".join(str(rank["tp"]) for rank in sent)
            figures["sequence_parallel"] = "on" if config.sequence_parallel else "off"
        figures.update(dp_bytes_communicated=self.ddp.stats.bytes_sent,
                       block_pairs_per_step=",".join(map(str, pairs)))
        return figures

    def free(self) -> None:
        if self.dp_cp is not None:
            self.dp_cp.Free()
        self.mesh.free()
