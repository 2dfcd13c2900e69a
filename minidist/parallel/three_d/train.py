"""3-D parallelism's driver: ``train --model gpt --strategy 3d --dp D --tp T`` on P ranks.

The P ranks form a :class:`~minidist.parallel.mesh.DeviceMesh` of shape (D, S, T), names
("dp", "pp", "tp"), with S = P / (D T) pipeline stages (Narayanan et al., "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC 2021, the layout
they call PTD-P). The model is built as a composition of the wings' own steps, tp, then pp, then
dp (:func:`parallelize`: ``tensor_parallel.apply_tp``, ``pipeline.apply_pp``, ``zero.apply_zero``),
and trained on the pipeline's step. Each of the three groups does what its chapter taught, unchanged:

- **tp** (chapter 14): the T ranks of a group hold the shards of the same layers: the dense GPT
  is split by :func:`~minidist.parallel.tensor_parallel.parallelize_gpt` over the group (heads,
  MLP features, vocabulary rows; with ``--sequence-parallel`` the positions between the split
  layers too), then laid out as a chain (``models.gpt_pipeline.gpt_sequential``: embeddings,
  blocks, head). The last stage's loss is the vocabulary-parallel cross-entropy of its shard of
  the logits (``TensorParallelGPT.loss``).
- **pp** (chapters 7-8): the chain is cut into S stages of whole blocks, and each (dp, tp)
  coordinate runs its own pipeline of S ranks with the flushing schedule (``--schedule``,
  ``--microbatches``): rank (d, s, t) sends its shard's activations to rank (d, s + 1, t). With
  sequence parallelism those activations are this rank's block of positions, 1/T of the
  whole: what Megatron's "scatter/gather" optimisation sends. The tied token embedding's two
  copies (first and last stage) sum their gradients per tp shard.
- **dp** (chapter 5): the D pipelines read rows d of each step's windows and average their
  gradients per stage and shard (one all-reduce over the dp group, the loss in it).

Gradient clipping sees the whole model: each rank sums the squares of its shards
(:func:`~minidist.parallel.tensor_parallel.is_sharded`) and of its whole parameters apart, the
shards' sum is all-reduced over tp, both over pp, each parameter counted once
(:class:`ThreeDStep`). Every axis of size 1 leaves the simpler strategy: T = 1 is ``--strategy
pipeline --dp D`` (the dense model, bit for bit), D = S = 1 with one micro-batch is ``--strategy
tp`` (bit for bit), and the whole is the single-process run on the global batch D x b to
rounding.

Evaluation: pipeline 0's ranks send their shards to rank 0 (one ``gather_objects``), which
joins them (``tensor_parallel.join_shards``) into a dense GPT, scores it and logs one line with
the bubble and the bytes each group sent per training step (rank 0's). Checkpoints gather every
rank's part to rank 0 (resumed on the same mesh: dp, tp and the world size are checked).

With ``--global-batch-size G`` (D dividing G, ``--microbatches`` dividing G / D: every
micro-batch then holds as many windows, and the step's mean loss is the global batch's) each
pipeline reads G / D windows a step and the lr is ``--lr``; a checkpoint then resumes on
another mesh (dp, pp, tp, stages per rank, micro-batches, flushing schedule): rank 0 joins
pipeline 0's stages and tp shards into the dense GPT's state, AdamW's moments and step counts
with it, and cuts it for the new mesh (``pipeline.elastic.reshard_pipeline``). Not with
``--zero``, whose moments are ZeRO-1 shards of a flat vector over dp: on its own mesh only.
"""
from __future__ import annotations

import math

import numpy as np

from minidist import backend, nn
from minidist.collectives import all_reduce
from minidist.fault import Checkpointer
from minidist.models.gpt_pipeline import block_balance, tied_parameters
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.pipeline import schedules
from minidist.parallel.pipeline.grid import ProcessGrid
from minidist.parallel.pipeline.step import PipelineStep
from minidist.parallel.pipeline.train import (
    FLUSHING_SCHEDULES,
    apply_pp,
    check_pipeline,
    stage_resharder,
)
from minidist.parallel.tensor_parallel.gpt import (
    apply_tp,
    clip_to,
    even_split_sizes,
    is_sharded,
    squares_by_kind,
    uneven_split,
)
from minidist.parallel.three_d.report import gather_dense, interval_reporter, run_figures
from minidist.parallel.zero.optimizer import ZeroRedundancyOptimizer, apply_zero
from minidist.tracing import CountingComm
from minidist.train import (
    ParallelRun,
    StepBytes,
    TrainConfig,
    TrainResult,
    data_parallel_lr,
    global_batch,
    per_rank_config,
    train_parallel,
    workload_for,
)

MESH_NAMES = ("dp", "pp", "tp")


def layout_3d(world_size: int, config: TrainConfig) -> tuple[int, int, int, int]:
    """(D, S, T, V): data-parallel replicas ``config.dp``, pipeline ranks S = P / (D T),
    tensor-parallel ranks ``config.tp``, stages per rank V (``config.stages_per_rank`` for the
    interleaved schedule, else 1). Call :func:`check_3d` first."""
    v = config.stages_per_rank if config.schedule == "interleaved" else 1
    return config.dp, world_size // (config.dp * config.tp), config.tp, v


def check_3d(world_size: int, config: TrainConfig) -> None:
    """Raise ValueError, naming the fix, when ``config`` cannot train with ``--strategy 3d`` on
    ``world_size`` ranks: not the GPT; D x T not dividing the ranks; a GPT that T cannot split
    (n_head, 4 n_embd), dropout with T > 1, a ``--block-size`` that T does not divide under
    sequence parallelism; then the pipeline's own rules on the (D, S) grid
    (:func:`~minidist.parallel.pipeline.train.check_pipeline`: a flushing schedule, at least one
    block per stage, micro-batches no more than the batch). With ``config.global_batch_size`` G:
    G not divisible by D, or G / D (each pipeline's batch) by ``--microbatches``."""
    if getattr(config, "model", "mlp") != "gpt":
        raise ValueError("--strategy 3d trains the GPT (tensor parallelism splits its heads and MLP); use --model gpt")
    dp, tp = config.dp, config.tp
    for flag, value in (("--dp", dp), ("--tp", tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag} must be a positive integer, got {value!r}")
    if world_size % (dp * tp):
        fits = [d * t for d in range(1, world_size + 1) for t in range(1, world_size + 1)
                if world_size % (d * t) == 0 and d == dp]
        raise ValueError(f"--dp {dp} x --tp {tp} = {dp * tp} does not divide the {world_size} ranks into pipelines "
                         f"of whole stages (the pipeline size is ranks / (dp x tp)); run on a multiple of "
                         f"{dp * tp} ranks, or choose --tp among "
                         f"{sorted({f // dp for f in fits if world_size % f == 0})}")
    problem = uneven_split(config.n_head, config.n_embd, tp)
    if problem is not None:
        flag, n = ("--n-head", "4 x --n-embd")[problem[0]], problem[1]
        options = [t for t in even_split_sizes(config.n_head, config.n_embd) if world_size % (dp * t) == 0]
        raise ValueError(f"--tp {tp}: {flag} = {n} is not divisible by {tp} (each tensor-parallel rank holds the "
                         f"same number of heads and MLP features); use --tp among {options}, or change --n-head")
    if tp > 1 and config.dropout:
        raise ValueError(f"--strategy 3d with --tp {tp} needs --dropout 0 (got {config.dropout:g}): each rank would "
                         "draw its own dropout masks, and the split model would no longer compute the one-process "
                         "model")
    if config.precision != "fp32":
        raise ValueError(f"--strategy 3d trains in float32; leave out --precision {config.precision} (mixed precision "
                         "runs with single, ddp, pipeline and fsdp)")
    if config.sequence_parallel and config.block_size % tp:
        raise ValueError(f"--sequence-parallel cuts each window's {config.block_size} positions into --tp {tp} equal "
                         f"blocks; use a --block-size that {tp} divides, or leave out --sequence-parallel")
    g = config.global_batch_size
    if g is not None:
        if g % dp:
            raise ValueError(f"--global-batch-size {g} is not divisible by --dp {dp} (each pipeline reads G / dp "
                             f"windows a step); use a multiple of {dp}, or --dp among "
                             f"{[d for d in range(1, world_size + 1) if g % d == 0 and world_size % (d * tp) == 0]}")
        if (g // dp) % config.microbatches:
            raise ValueError(f"--global-batch-size {g} gives each of the {dp} pipelines {g // dp} windows a step, "
                             f"which --microbatches {config.microbatches} does not divide (equal micro-batches make "
                             f"the step's mean loss the global batch's); use --microbatches among "
                             f"{[m for m in range(1, g // dp + 1) if (g // dp) % m == 0]}, or another G")
        config = per_rank_config(config, dp)  # the pipeline's checks below see its batch, G / D
    try:
        check_pipeline(world_size // tp, config)
    except ValueError as error:
        raise ValueError(f"--strategy 3d with --tp {tp}: each group of {tp} tensor-parallel ranks is one rank of "
                         f"the pipeline grid ({world_size // tp} of them): {error}") from None


class ThreeDStep(PipelineStep):
    """A :class:`~minidist.parallel.pipeline.step.PipelineStep` whose stages hold tensor-parallel
    shards: the same step, with the gradient norm of the whole model. ``tp_comm``: the tensor-
    parallel group; ``sharded``: the Parameters cut across it (their squares are summed over
    it; the whole ones are the same on every rank of it and count once). The rest of the
    arguments are PipelineStep's.

    With a :class:`~minidist.parallel.zero.ZeroRedundancyOptimizer` over the dp group made with
    ``reduce_gradients=True`` (``--zero``: ZeRO-1 across the pipelines, what Megatron-LM calls
    its distributed optimizer) the step leaves the gradients to the optimizer, which
    reduce-scatters them over dp (only the loss is averaged here), and the clipping works on
    this rank's shard of the averaged gradient."""

    def __init__(self, *args, tp_comm, sharded, **kwargs):
        super().__init__(*args, **kwargs)
        self.tp_comm, self.sharded = tp_comm, {id(p) for p in sharded}
        self.zero = isinstance(self.optimizer, ZeroRedundancyOptimizer)
        if self.zero:  # which numbers of this rank's shard of the flat vector are cut over tp, which whole
            flat, counted = self.optimizer.flat, {id(p) for p in self.norm_params}
            start, stop = self.optimizer.start, self.optimizer.stop
            kind = lambda p, cut: float(id(p) in counted and (id(p) in self.sharded) == cut)
            self.shard_kinds = [flat.flatten([np.full(p.shape, kind(p, cut)) for p in flat.params],
                                             like=np.empty(0))[start:stop] for cut in (True, False)]

    def average_over_replicas(self, loss: float) -> float:
        """Without ZeRO, PipelineStep's (the gradients and the loss in one all-reduce); with it
        the loss alone (one float64), the gradients being the optimizer's to reduce-scatter."""
        if not self.zero:
            return super().average_over_replicas(loss)
        return float(all_reduce(self.grid.dp_comm, np.array([loss]), validate=False)[0]) / self.grid.dp_size

    def clip_grad_norm(self) -> float:
        """``nn.clip_grad_norm_`` of the dense model: squares summed in float64, this rank's
        shards all-reduced over tp (one number), then shards and whole parameters over the
        pipeline (two numbers); every gradient scaled by grad_clip / (norm + 1e-6) when the
        norm exceeds grad_clip (``TensorParallelGPT.clip_grad_norm_``'s arithmetic, so one
        stage computes it bit for bit). With ZeRO the squares are those of this rank's shard of
        the averaged gradient, first summed over dp (two numbers). Returns the norm before
        clipping. Collective."""
        if self.zero:
            self.optimizer.shard_gradient()  # reduce-scatter over dp, averaged
            squares = self.optimizer.shard.grad.astype(np.float64) ** 2
            sharded, whole = (float((squares * backend.to_device(kind, backend.device_of(squares))).sum())
                              for kind in self.shard_kinds)
            if self.grid.dp_size > 1:
                sharded, whole = all_reduce(self.grid.dp_comm, np.array([sharded, whole]), validate=False).tolist()
        else:
            sharded, whole = squares_by_kind(self.norm_params, self.sharded)
        if self.tp_comm.Get_size() > 1:
            sharded = float(all_reduce(self.tp_comm, np.array([sharded]), validate=False)[0])
        if self.grid.pp_size > 1:
            sharded, whole = all_reduce(self.grid.pp_comm, np.array([sharded, whole]), validate=False).tolist()
        norm = math.sqrt(sharded + whole)
        clip_to([self.optimizer.shard] if self.zero else self.params, self.grad_clip, norm)
        return norm


def parallelize(work, config: TrainConfig, grid: ProcessGrid, traffic: dict, num_stages: int, lr: float):
    """3-D parallelism as a composition of the wings' own steps over the (dp, pp, tp) mesh, applied
    in a fixed order (torchtitan composes the same way: ``pipeline_llama`` cuts the stages,
    ``parallelize_llama`` applies TP, then the data-parallel wrapping, to each stage's model):

    1. tp (``tensor_parallel.apply_tp``, over ``traffic["tp"]``): every layer of the dense GPT split
       over the tp group. First, because TP cuts each layer along its meaning (heads, MLP
       features, vocabulary rows) and needs the layers whole; and innermost in the mesh (tp fastest:
       neighbouring ranks, one node's NVLink), because it talks at every layer.
    2. pp (``pipeline.apply_pp``, over ``grid.pp_comm``): the chain of split layers cut into
       ``num_stages`` stages of whole blocks; this rank holds stages pp_rank, pp_rank + S, ...,
       each holding its tp shards. A stage sends activations once per micro-batch.
    3. dp (``grid.dp_comm``): the optimizer over this rank's parameters (a tied one once), at
       ``lr``; the replicas' gradients are averaged by the step's all-reduce over dp
       (:class:`ThreeDStep`), or, with ``config.zero``, the optimizer is ZeRO-1's over the dp group
       (``zero.apply_zero``), which reduce-scatters them itself. Once per step: the farthest links.

    Every rank builds the dense GPT from ``config.seed`` (the same on every rank). Returns (dense,
    model, loss_fn, stage_modules, stages, params, optimizer): ``model`` the GPT the stages are cut
    from (the dense one when the tp group has one rank), ``loss_fn(logits, targets)`` the last
    stage's loss (the workload's, or the vocabulary-parallel one)."""
    dense = work.model()
    model, loss_fn = dense, work.loss
    if traffic["tp"].Get_size() > 1:
        model = apply_tp(dense, traffic["tp"], config)
        loss_fn = model.loss
    stage_modules, stages = apply_pp(model, grid, num_stages, config)
    params = list({id(p): p for st in stages for p in st.submodule.parameters()}.values())  # a tied one once
    optimizer = work.optimizer(params, lr)
    if config.zero:  # ZeRO-1 over dp: each replica keeps 1/D of the optimizer's state
        optimizer = apply_zero(params, optimizer, traffic["dp"])
    return dense, model, loss_fn, stage_modules, stages, params, optimizer


def counted_grid(comm, dp: int, pp: int, tp: int):
    """The (dp, pp, tp) :class:`DeviceMesh` of ``comm``, each group wrapped in a
    ``tracing.CountingComm`` (to count its bytes) that names its ranks as the job numbers them
    (so a timeout names the silent rank: ``mesh.rank_names``), and the pipeline grid over the
    pp and dp groups. Collective. Returns (grid, traffic: name -> counted group)."""
    mesh = DeviceMesh(comm, (dp, pp, tp), MESH_NAMES)
    traffic = {name: CountingComm(mesh.get_group(name), allow_collectives=True, keep_messages=False)
               for name in MESH_NAMES}
    for name, group in traffic.items():
        group.rank_names = mesh.rank_names(name)
    grid = ProcessGrid(dp, pp, mesh.get_local_rank("dp"), mesh.get_local_rank("pp"), traffic["pp"], traffic["dp"],
                       mesh)
    return grid, traffic


def train_3d(comm, config: TrainConfig, dataset) -> TrainResult | None:
    """3-D parallel training of ``config``'s GPT over ``comm`` (module docstring): a (D, S, T)
    mesh, D = ``config.dp``, T = ``config.tp``, S = P / (D T) stages (V per rank with
    ``--schedule interleaved``), ``config.microbatches`` per step; global batch D x
    ``config.batch_size`` windows, lr scaled by D only with ``config.scale_lr``; or, with
    ``config.global_batch_size`` G, G windows (G / D per pipeline) at ``config.lr``. Every wait
    gives up after ``config.timeout`` seconds. The run is :func:`~minidist.train.train_parallel`'s,
    with :class:`ThreeDRun`, whose model is :func:`parallelize`'s composition.

    Returns a TrainResult on rank 0 (figures: ranks, dp, pp, tp, sequence_parallel, schedule,
    microbatches, global_batch, lr, bubble (the last interval's, averaged over the ranks),
    tp_bytes_per_step, pp_bytes_per_step, dp_bytes_per_step (each rank's mean over the training
    steps, rank order), tp_bytes, pp_bytes, dp_bytes (all ranks' bytes over the steps_counted
    training steps: what :mod:`~minidist.parallel.three_d.predict` predicts), parameter_bytes and
    optimizer_state_bytes (each rank's, rank order); ``model``: the dense GPT with the trained
    weights) and None elsewhere.
    Raises ValueError (naming the fix) for what :func:`check_3d` refuses, NonFiniteLossError on
    every rank when the loss diverges, checkpoint_io.CheckpointError for a checkpoint of another
    layout (without ``config.global_batch_size``, or with ``config.zero``),
    fault.TrainingStopped after ``config.stop_after_steps``.
    Sources: Narayanan et al., SC 2021; Shoeybi et al. 2019; Korthikanti et al., MLSys 2023.
    """
    check_3d(comm.Get_size(), config)
    return train_parallel(ThreeDRun, comm, config, dataset)


class ThreeDRun(ParallelRun):
    """3-D's parallelize step and hooks (:func:`train_3d`): the (dp, pp, tp) mesh of counted
    groups, the model composed by :func:`parallelize` (tp, then pp, then dp or ZeRO-1), this
    rank's stages the checkpointed model. Every rank reports (pipeline 0's shards joined on
    rank 0, the figures gathered: :func:`interval_reporter`)."""

    reports_everywhere = True

    def __init__(self, comm, config: TrainConfig, dataset):
        dp, pp, tp, v = self.layout = layout_3d(comm.Get_size(), config)
        config = per_rank_config(config, dp)  # with G, each pipeline's batch is G / D
        work = workload_for(config, dataset)
        self.grid, self.traffic = counted_grid(comm, dp, pp, tp)
        lr = data_parallel_lr(work, config, dp)
        (self.dense, self.split, self.loss_fn, self.stage_modules, stages, self.params,
         optimizer) = parallelize(work, config, self.grid, self.traffic, pp * v, lr)
        actions, schedule_class = FLUSHING_SCHEDULES[config.schedule]
        self.pipeline_schedule = schedule_class(stages if v > 1 else stages[0], config.microbatches, self.loss_fn)
        self.simulated = schedules.simulate(actions(pp, config.microbatches, v), 1.0, 1.0, 1.0).bubble_fraction
        super().__init__(comm, config, work, nn.Sequential(*[st.submodule for st in stages]), optimizer, lr,
                         self.grid.dp_rank, dp)
        self.loader_options = {"min_batch": config.microbatches}

    def step(self):
        tp = self.layout[2]
        sharded = [p for name, p in self.split.named_parameters() if tp > 1 and is_sharded(name)]
        step = StepBytes(ThreeDStep(self.pipeline_schedule, self.grid, self.optimizer, self.schedule,
                                    grad_clip=self.work.grad_clip,
                                    tied=tied_parameters(self.stage_modules[0], self.stage_modules[-1]),
                                    tp_comm=self.traffic["tp"], sharded=sharded),
                         {name: self.traffic[name] for name in ("tp", "pp", "dp")})
        self.on_epoch_end, self.last = interval_reporter(self.comm, self.work, self.grid, self.split, self.dense,
                                                         self.optimizer, step, self.log, self.simulated)
        return step

    def report(self, epoch, loss, seconds):
        return self.on_epoch_end(epoch, loss, seconds)

    def describe(self) -> str:
        config, (dp, pp, tp, v) = self.config, self.layout
        num_stages, m = pp * v, config.microbatches
        sp = f", sequence parallel ({config.block_size // tp} positions each)" if config.sequence_parallel else ""
        return (f"3d: {self.comm.Get_size()} ranks = dp {dp} x pp {pp} x tp {tp} (mesh ranks row-major, tp fastest), "
                f"{num_stages} stages of {','.join(map(str, block_balance(config.n_layer, num_stages)))} layers, "
                f"schedule {config.schedule}, {m} micro-batches per batch of {config.batch_size}, global batch "
                f"{global_batch(config, dp)}, lr {self.lr:g}{sp}{', ZeRO-1 over dp' if config.zero else ''}")

    def checkpoint_options(self) -> dict:
        reshard = None if self.config.zero else stage_resharder(self.config, self.split, self.layout)
        return {"gathered": True, "reshard": reshard}

    def finish(self, checkpointer):
        checkpointer.close()
        gather_dense(self.comm, self.grid, self.split, {id(p) for p in self.params}, self.dense)  # the last
        if self.comm.Get_rank() == 0 and self.config.save_model:  # interval may end unreported
            Checkpointer(self.config, self.dense, None, metadata=self.work.metadata()).save_model()
        return self.dense

    def figures(self, step) -> dict | None:
        return run_figures(self.config, self.comm.Get_size(), self.layout[:3], self.lr, self.last)

    def free(self) -> None:
        self.grid.free()
