"""The context-parallel driver: ``train --model gpt --strategy cp --cp-variant V [--dp D]`` under ``mpiexec -n P``.

The P ranks form a :class:`~minidist.parallel.mesh.DeviceMesh` of shape (D, P / D), names
("dp", "cp"), cp fastest: the P / D ranks of a cp group are neighbours (they talk at every
layer, forward and backward; data parallelism once per step), so they share a node's links::

    P = 4, D = 2:   dp_rank 0  [0 1]     cp groups [0 1] [2 3]   (the parts of the same sequences)
                    dp_rank 1  [2 3]     dp groups [0 2] [1 3]

Each dp coordinate reads its part of the global batch (``--global-batch-size G``, or
``--batch-size`` windows per dp group), every rank of a cp group the same windows, of which
it keeps its positions (:mod:`.gpt`: the model takes the whole (B, T) ids and cuts them).
The parallelize step (:func:`parallelize`) is torchtitan's order (``parallelize_llama`` in
``torchtitan/models/llama3/infra/parallelize.py``: apply_tp, then apply_cp_to_attention_module,
then apply_fsdp over the dp mesh, which there includes the cp ranks): here the dense GPT is laid
out over its cp group (:func:`.gpt.apply_cp`), then wrapped in ``DistributedDataParallel`` over
*all* ranks, whose average over dp x cp is the one-process gradient (the cp loss's backward
scales each rank's part by P / D's cp size: :mod:`.gpt`). Tensor parallelism inside the cp
groups, and FSDP instead of DDP, are not written yet: ``--tp`` and ``--sharding-strategy``
are refused by the command line (they are the flags of fsdp and 3d).

What a run adds to the GPT's training: every rank evaluates (the cp model's forward is
collective over its cp group), rank 0 prints; the clipping norm is the dense one (after DDP's
average every rank holds the whole gradient); the sample and ``--save-model`` use a dense GPT
with the trained weights. The figures add each rank's bytes per step inside its cp group and
the chunk pairs of attention it computed per step (``blocks.BlockCounter``, all layers).
"""
from __future__ import annotations

from minidist.collectives import gather_objects
from minidist.fault import Checkpointer
from minidist.parallel.context_parallel.blocks import BlockCounter
from minidist.parallel.context_parallel.gpt import apply_cp
from minidist.parallel.context_parallel.layout import check_length, rank_chunks
from minidist.parallel.context_parallel.ulysses import check_heads
from minidist.parallel.data_parallel.ddp import DistributedDataParallel
from minidist.parallel.mesh import DeviceMesh
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
    supervised_step,
    train_parallel,
    workload_for,
)

MESH_NAMES = ("dp", "cp")


def check_context_parallel(world_size: int, config: TrainConfig) -> None:
    """Raise ValueError, naming the fix, when ``config`` cannot train with ``--strategy cp`` on
    ``world_size`` ranks: not the GPT, ``--dp`` not dividing the ranks, a context
    (``--block-size``) too short to cut over the cp ranks (zig-zag: 2 chunks per rank), Ulysses
    with a number of cp ranks that does not divide ``--n-head``, dropout, mixed precision."""
    if getattr(config, "model", "mlp") != "gpt":
        raise ValueError("--strategy cp cuts the GPT's sequences over the ranks; use --model gpt")
    dp = config.dp
    if world_size % dp:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(f"--dp {dp} does not divide the {world_size} ranks (each of the --dp groups holds ranks / "
                         f"dp cp ranks); use --dp among {divisors}")
    cp, variant = world_size // dp, config.cp_variant
    try:
        check_length(config.block_size, cp, variant)
    except ValueError:
        need = 2 * cp if variant == "zigzag" else cp
        raise ValueError(f"--strategy cp --cp-variant {variant} cuts each window of --block-size "
                         f"{config.block_size} into {need} parts over {cp} cp ranks; use --block-size {need} or more, "
                         "or fewer cp ranks (a larger --dp)") from None
    if variant == "ulysses":
        try:
            check_heads(config.n_head, cp)
        except ValueError as error:
            raise ValueError(f"--cp-variant ulysses on {cp} cp ranks: {error}; or change --n-head / --dp") from None
    if config.dropout:
        raise ValueError(f"--strategy cp needs --dropout 0 (got {config.dropout:g}): each rank would draw its own "
                         "dropout masks for its positions, and the run would no longer compute the one-process model")
    if config.precision != "fp32":
        raise ValueError(f"--strategy cp trains in float32 (the attention's blocks travel as float32); leave out "
                         f"--precision {config.precision}")


def parallelize(model, cp_comm, comm, config, counter=None):
    """``model`` (the dense GPT, the same on every rank) laid out over the cp group ``cp_comm``
    (:func:`.gpt.apply_cp`; ``counter``: a ``BlockCounter`` its attention adds to), then
    replicated over every rank of ``comm`` by ``DistributedDataParallel`` (module docstring):
    returns ``(cp_model, ddp)``. Collective over ``comm``."""
    # TP, then CP, then data parallelism: torchtitan's order. TP would cut each layer by heads
    # and features (it needs the dense matrices); CP only changes which positions a layer sees,
    # so it wraps whatever attention the layer has; data parallelism (DDP here, FSDP there)
    # comes last because it only needs the parameters as they are laid out. (TP is not written
    # for cp yet.)
    cp_model = apply_cp(model, cp_comm, config, counter)
    return cp_model, DistributedDataParallel(cp_model, comm)


def train_context_parallel(comm, config: TrainConfig, dataset, *, checkpointer_class=Checkpointer
                           ) -> TrainResult | None:
    """Context-parallel training of ``config``'s GPT over ``comm`` (module docstring):
    :func:`~minidist.train.train_parallel` with :class:`ContextParallelRun`, every wait giving
    up after ``config.timeout`` seconds.

    Returns a TrainResult on rank 0 (figures: ranks, dp, cp, cp_variant, global_batch, lr,
    cp_bytes_per_step (each rank's bytes sent inside its cp group per training step, rank
    order), dp_bytes_communicated (rank 0's gradient all-reduce bytes), block_pairs_per_step
    (each rank's attention chunk pairs per step, all layers, forward); ``model``: a dense GPT
    with the trained weights) and None elsewhere. Raises ValueError for a layout
    :func:`check_context_parallel` refuses, NonFiniteLossError, checkpoint_io.CheckpointError,
    fault.TrainingStopped after ``config.stop_after_steps``. Sources: Liu et al. 2023; Dubey et
    al. 2024; Jacobs et al. 2023; torchtitan's ``parallelize_llama`` for the composition."""
    check_context_parallel(comm.Get_size(), config)
    return train_parallel(ContextParallelRun, comm, config, dataset, checkpointer_class=checkpointer_class)


class ContextParallelRun(ParallelRun):
    """cp's parallelize step and hooks (:func:`train_context_parallel`): the (dp, cp) mesh, the
    GPT laid out over the cp group (counted: ``tracing.CountingComm``) and replicated by DDP
    over every rank, AdamW on the (whole) parameters. Every rank reports (rank 0 prints)."""

    reports_everywhere = True

    def __init__(self, comm, config: TrainConfig, dataset):
        dp = config.dp
        self.mesh = DeviceMesh(comm, (dp, comm.Get_size() // dp), MESH_NAMES)
        dp_rank = self.mesh.get_local_rank("dp")
        config = per_rank_config(config, dp, dp_rank)  # --global-batch-size: this dp group's part of it
        work = workload_for(config, dataset)
        self.traffic = CountingComm(self.mesh.get_group("cp"), allow_collectives=True, keep_messages=False)
        self.counter, self.pairs = BlockCounter(), 0
        model, self.ddp = parallelize(work.model(), self.traffic, comm, config, self.counter)
        lr = data_parallel_lr(work, config, dp)
        super().__init__(comm, config, work, model, work.optimizer(self.ddp.parameters(), lr), lr, dp_rank, dp)

    def step(self):
        ddp, work = self.ddp, self.work
        step = supervised_step(ddp, self.optimizer, device=self.config.device, lr_schedule=self.schedule,
                               loss_fn=lambda x, y: ddp(x, y)[1], grad_clip=work.grad_clip,
                               loss_weight=loss_weight(self.config, self.dp, self.dp_rank))

        def counted(x, y):
            before = self.counter.forward_pairs
            loss = step(x, y)
            self.pairs += self.counter.forward_pairs - before
            return loss

        return StepBytes(counted, self.traffic)

    def describe(self) -> str:
        config, cp = self.config, self.mesh.size("cp")
        chunks = rank_chunks(config.block_size, cp, self.mesh.get_local_rank("cp"), config.cp_variant)
        held = " and ".join(f"{start}:{stop}" for start, stop in chunks)
        return (f"cp {config.cp_variant}: {self.mesh.size()} ranks = dp {self.dp} x cp {cp} (cp fastest; a cp group "
                f"reads the same windows, rank 0 holds positions {held} of {config.block_size}), "
                f"{batch_description(config, self.dp)}, lr {self.lr:g}")

    def report(self, epoch, loss, seconds):  # every rank: the cp model's forward is collective
        return self.work.report(self.model, epoch, loss, seconds, self.log, world_size=self.dp)

    def finish(self, checkpointer):
        self.ddp.verify_synced()
        checkpointer.save_model()  # the cp model's state dict is the dense model's
        dense = self.work.model()
        dense.load_state_dict(self.model.state_dict())
        return dense

    def figures(self, step) -> dict | None:
        steps = max(step.steps, 1)
        sent, pairs = step.per_step(self.comm), gather_objects(self.comm, round(self.pairs / steps))
        if self.comm.Get_rank() != 0:
            return None
        config = self.config
        return {"ranks": self.mesh.size(), "dp": self.dp, "cp": self.mesh.size("cp"), "cp_variant": config.cp_variant,
                "global_batch": global_batch(config, self.dp), "lr": f"{self.lr:g}",
                "cp_bytes_per_step": ",".join(map(str, sent)), "dp_bytes_communicated": self.ddp.stats.bytes_sent,
                "block_pairs_per_step": ",".join(map(str, pairs))}

    def free(self) -> None:
        self.mesh.free()

