"""The pipeline's driver: ``train --strategy pipeline`` with a flushing schedule (GPipe, 1F1B,
interleaved 1F1B, zero bubble), alone or with data parallelism (``--dp``), for either workload
(:mod:`minidist.workloads`): the MLP cut into stages of whole Linear layers, or the GPT cut into
stages of whole blocks (the embeddings on the first stage, ``ln_f`` and the head on the last,
the tied token embedding kept equal on both: ``models.gpt_pipeline``). The layout checks, the
MLP and the gathering of the stages here serve PipeDream's driver too
(:mod:`minidist.parallel.pipeline.train_pipedream`, the schedules with no flush; MLP only).

Why a real run's bubble is larger than the simulator's here: the default MLP's stages compute
for tens of microseconds per micro-batch, about what one message costs in Python and MPI, and
on a laptop the ranks may outnumber the cores. The simulator counts neither, so the measured
bubble is larger and schedules with more, smaller pieces (more micro-batches, interleaving)
can even rank backwards. ``benchmarks/bench_pipeline.py`` trains stages long enough
(8 x 512-wide layers, batch 1024) for the formula (p - 1)/(m + p - 1) to show.
"""
from __future__ import annotations

import math

import numpy as np

from minidist import backend, data, nn, precision
from minidist.fault import Checkpointer
from minidist.models.gpt import Block
from minidist.models.gpt_pipeline import block_balance, gpt_sequential, tied_parameters
from minidist.parallel.pipeline import executor, schedules
from minidist.parallel.pipeline.elastic import PipelineLayout, check_global_batch_layout, reshard_pipeline
from minidist.parallel.pipeline.grid import ProcessGrid, check_grid
from minidist.parallel.pipeline.report import epoch_reporter
from minidist.parallel.pipeline.stage import split_model
from minidist.parallel.pipeline.step import PipelineStep
from minidist.train import (
    PIPEDREAM_SCHEDULES,
    PIPELINE_SCHEDULES,
    ParallelRun,
    TrainConfig,
    TrainResult,
    build_model,
    data_parallel_lr,
    global_batch,
    per_rank_config,
    train_parallel,
    workload_for,
)

# A flushing schedule's name -> (its per-rank actions (p, m, v), its executor class).
FLUSHING_SCHEDULES = {
    "gpipe": (lambda p, m, v: schedules.gpipe(p, m), executor.ScheduleGPipe),
    "1f1b": (lambda p, m, v: schedules.one_f_one_b(p, m), executor.Schedule1F1B),
    "interleaved": (schedules.interleaved_1f1b, executor.ScheduleInterleaved1F1B),
    "zero-bubble": (lambda p, m, v: schedules.zero_bubble(p, m), executor.ScheduleZeroBubble),
}


def pipeline_layout(world_size: int, config: TrainConfig) -> tuple[int, int, int]:
    """(D pipelines, S ranks per pipeline, V stages per rank) of ``config`` on ``world_size``
    ranks: D = ``config.dp``, S = world_size / D, V = ``config.stages_per_rank`` for the
    interleaved schedule and 1 otherwise. Call :func:`check_pipeline` first."""
    stages_per_rank = config.stages_per_rank if config.schedule == "interleaved" else 1
    return config.dp, world_size // config.dp, stages_per_rank


def check_pipeline(world_size: int, config: TrainConfig) -> None:
    """Raise ValueError, naming the fix, when ``config`` cannot run as a pipeline on
    ``world_size`` ranks: an unknown schedule, fewer than one micro-batch, ``dp`` not dividing
    the ranks, more stages than the MLP has Linear layers (each stage holds at least one;
    interleaved needs S x V), or more micro-batches than samples in a batch. With
    ``config.global_batch_size`` G (``elastic.check_global_batch_layout``): a PipeDream schedule, D
    not dividing G, or ``--microbatches`` not dividing G / D."""
    if config.schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"--schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, got {config.schedule!r}")
    for flag, value in (("--microbatches", config.microbatches), ("--stages-per-rank", config.stages_per_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag} must be a positive integer, got {value!r}")
    check_grid(world_size, config.dp)
    dp, pp, v = pipeline_layout(world_size, config)
    if getattr(config, "global_batch_size", None) is not None:
        check_global_batch_layout(world_size, config)
        config = per_rank_config(config, dp)  # each pipeline's batch: G / D
    num_stages, linear = pp * v, len(config.hidden) + 1
    if getattr(config, "model", "mlp") == "gpt":
        _check_gpt_pipeline(config, num_stages, dp, v)
    elif num_stages > linear:
        how = (f"--schedule interleaved puts --stages-per-rank {v} stages on each of the {pp} ranks of a pipeline: "
               f"{num_stages} stages" if v > 1 else
               f"{world_size} ranks in {dp} pipeline{'s' if dp > 1 else ''} make {num_stages} stages")
        example = " ".join(["128"] * (num_stages - 1))
        raise ValueError(f"{how}, but the MLP has only {linear} Linear layers (a stage holds at least one); give "
                         f"--hidden at least {num_stages - 1} sizes (e.g. --hidden {example})"
                         + (", or fewer --stages-per-rank" if v > 1 else ", or more --dp (fewer stages per pipeline)"))
    if config.microbatches > config.batch_size:  # (a gpt's batch: windows)
        raise ValueError(f"--microbatches {config.microbatches} exceeds --batch-size {config.batch_size} (per "
                         "pipeline): a micro-batch needs a sample at least; use fewer micro-batches or bigger batches")
    if config.schedule in PIPEDREAM_SCHEDULES and dp > 1:
        raise ValueError(f"--schedule {config.schedule} runs one pipeline; use --dp 1 (data x pipeline parallelism "
                         "is for the flushing schedules)")
    if config.schedule == "pipedream-2bw" and config.microbatches < pp:
        raise ValueError(f"--schedule pipedream-2bw accumulates --microbatches per update and needs at least as many "
                         f"as the {pp} stages (fewer would put three weight versions in flight); use --microbatches "
                         f"{pp} or more")
    if config.vertical_sync and not config.weight_stashing:
        raise ValueError("--vertical-sync needs weight stashing (a stage keeps the input stage's version to run on "
                         "it); drop --no-weight-stashing or --vertical-sync")


def _check_gpt_pipeline(config: TrainConfig, num_stages: int, dp: int, v: int) -> None:
    """The GPT's own layout rules: whole blocks per stage, and a schedule that flushes."""
    if config.schedule in PIPEDREAM_SCHEDULES:
        raise ValueError(f"--schedule {config.schedule} trains the MLP only; --model gpt runs the flushing schedules "
                         "(gpipe, 1f1b, interleaved, zero-bubble)")
    if num_stages > config.n_layer:
        how = (f"--schedule interleaved puts --stages-per-rank {v} stages on each rank" if v > 1 else
               f"the ranks in {dp} pipeline{'s' if dp > 1 else ''} make {num_stages} stages")
        raise ValueError(f"{how}, but the GPT has only {config.n_layer} blocks (a stage holds at least one); give "
                         f"--n-layer {num_stages} or more" + (", or fewer --stages-per-rank" if v > 1 else
                                                              ", or more --dp (fewer stages per pipeline)"))


def build_pipeline_model(config: TrainConfig, dataset: data.Dataset) -> nn.Sequential:
    """:func:`build_model`'s MLP, with He et al.'s initialisation ("Delving Deep into
    Rectifiers", ICCV 2015): weights normal with standard deviation sqrt(2 / in_features),
    biases zero, drawn from ``config.seed``. A pipeline wants a deep model, and the default
    (PyTorch's uniform +-1/sqrt(in_features)) shrinks a ReLU signal by about sqrt(6) per layer:
    measured on digits, the 8-Linear default MLP reaches 0.67 and 0.72 test accuracy (seeds 0
    and 1) after 20 epochs with it, 0.97 with He's."""
    model = build_model(config, dataset)
    rng = np.random.default_rng(config.seed)
    for layer in model:
        if isinstance(layer, nn.Linear):
            weight = rng.normal(0.0, math.sqrt(2.0 / layer.in_features), size=layer.weight.shape)
            layer.weight.data[...] = backend.to_device(weight.astype(layer.weight.dtype), config.device)
            if layer.bias is not None:
                layer.bias.data[...] = 0
    return model


def split_stages(model: nn.Sequential, num_stages: int) -> list:
    """``model`` cut into ``num_stages`` stages that each hold parameters: the cut of
    ``split_model(balance="parameters")`` (the smallest largest stage) when every stage holds
    some; else (a tiny layer beside a huge one, e.g. ``--hidden 1000 1 1`` on 4 stages, where
    the best cut leaves a stage of one ReLU) the same min-max cut over blocks of one layer with
    parameters and the parameter-free layers after it, so a stage never holds a lone
    activation. Raises ValueError when the model has fewer layers with parameters than
    ``num_stages`` (``check_pipeline`` refuses such a layout first, naming the fix)."""
    stages = split_model(model, num_stages, balance="parameters")
    if all(list(stage.parameters()) for stage in stages):
        return stages
    blocks = []  # each: a layer with parameters and the parameter-free layers after it
    for layer in model:
        if list(layer.parameters()) or not blocks:
            blocks.append([layer])
        else:
            blocks[-1].append(layer)
    cut = split_model(nn.Sequential(*[nn.Sequential(*block) for block in blocks]), num_stages, balance="parameters")
    return split_model(model, num_stages, balance=[sum(len(block) for block in stage) for stage in cut])


def model_stages(config: TrainConfig, model, num_stages: int) -> list:
    """``model`` cut into ``num_stages`` stages as the drivers cut it: the MLP by
    :func:`split_stages`; the GPT (or its tensor-parallel copy) as a chain
    (``gpt_pipeline.gpt_sequential``) of whole blocks spread evenly (``block_balance``). The
    stages hold the model's own layers. Raises ValueError for more stages than the model's
    layers with parameters (MLP) or blocks (GPT)."""
    if config.model == "gpt":
        return split_model(gpt_sequential(model), num_stages, balance=block_balance(config.n_layer, num_stages))
    return split_stages(model, num_stages)


def apply_pp(model, grid: ProcessGrid, num_stages: int, config: TrainConfig):
    """The pipeline step of a composition (torchtitan's ``pipeline_llama``): ``model`` (the MLP,
    the GPT, or the GPT's tensor-parallel copy) cut into ``num_stages`` stages
    (:func:`model_stages`) and this rank's :class:`~minidist.parallel.pipeline.executor.PipelineStage`
    objects over ``grid.pp_comm`` (stages ``pp_rank``, ``pp_rank + S``, ...; each waits at most
    ``config.timeout`` seconds). Returns (stage_modules, stages). Raises ValueError when the model
    has fewer layers (MLP: Linear layers; GPT: blocks) than stages."""
    stage_modules = model_stages(config, model, num_stages)
    stages = [executor.PipelineStage(stage_modules[s], s, num_stages, grid.pp_comm, timeout=config.timeout)
              for s in range(grid.pp_rank, num_stages, grid.pp_size)]
    return stage_modules, stages


def build_stages(work, config: TrainConfig, dataset, grid: ProcessGrid, num_stages: int):
    """This rank's part of the model of ``work`` (a workload, ``train.workload_for``): the whole
    model, the same on every rank (the MLP of :func:`build_pipeline_model`, or the GPT), cut by
    :func:`apply_pp`. Returns (model, stage_modules, stages); raises what apply_pp raises."""
    model = work.model() if config.model == "gpt" else build_pipeline_model(config, dataset)
    return (model, *apply_pp(model, grid, num_stages, config))


def describe_layout(config: TrainConfig, world_size: int, stage_modules: list, lr: float) -> str:
    """The line a pipeline run starts with: ranks, pipelines, stages (Linear layers, or GPT
    blocks, in each), schedule, micro-batches, global batch, lr, and what the degenerate
    layouts amount to."""
    dp, pp, _ = pipeline_layout(world_size, config)
    num_stages, m, b = len(stage_modules), config.microbatches, config.batch_size
    plural = lambda n, word, many=None: f"{n} {word if n == 1 else (many or word + 's')}"
    unit, kind = (Block, "GPT blocks") if config.model == "gpt" else (nn.Linear, "Linear layers")
    counts = [sum(isinstance(layer, unit) for layer in stage) for stage in stage_modules]
    return (f"pipeline: {plural(world_size, 'rank')} = {plural(dp, 'pipeline')} x {plural(pp, 'rank')}, "
            f"{plural(num_stages, 'stage')} ({kind} per stage: {','.join(map(str, counts))}), schedule "
            f"{config.schedule}, {plural(m, 'micro-batch', 'micro-batches')} per batch of {b}, global batch "
            f"{global_batch(config, dp)}, lr {lr:g}"
            + ("; one stage on one rank: plain sequential training" if num_stages == 1 else "")
            + ("; one micro-batch: naive model parallelism, one stage busy at a time" if m == 1 < num_stages else ""))


def train_pipeline(comm, config: TrainConfig, dataset) -> TrainResult | None:
    """Pipeline-parallel training over ``comm`` (e.g. ``mpi4py.MPI.COMM_WORLD``, P ranks):
    ``config.dp`` = D pipelines of S = P / D ranks (a ``pipeline.grid.ProcessGrid``), each a
    chain of S x V stages (V = ``config.stages_per_rank`` for the interleaved schedule, else 1)
    run by ``config.schedule`` (a flushing one; PipeDream's are
    :func:`~minidist.parallel.pipeline.train_pipedream.train_pipedream`'s) with
    ``config.microbatches`` micro-batches per step: :func:`~minidist.train.train_parallel` with
    :class:`PipelineRun`.

    Model (``config.model``'s workload, ``train.workload_for``): every rank builds the same
    model from ``config.seed`` (cheap here; a model too big for one device would be built stage
    by stage) and keeps its stages (:func:`build_stages`): for the MLP
    (:func:`build_pipeline_model`) the cut whose largest stage has the fewest parameters (the
    default 8-Linear MLP: 2 Linear layers per stage on 4 stages, 1 on 8); for the GPT whole
    blocks, evenly, the embeddings on the first stage and the head on the last, whose copies of
    the tied token embedding have their gradients summed after each backward
    (``PipelineStep``'s ``tied``), and the GPT's gradient clipping over the whole pipeline. Data
    (the workload's loader): pipeline d reads its share of each global batch (the MLP's
    ``DistributedSampler(n, D, d)`` shard, reshuffled each epoch, as ddp; the GPT's rows d of
    each step's windows) in batches of ``config.batch_size``; every rank of a pipeline reads
    the same batches, so they agree on their sizes; the global batch is D x batch_size, and for
    the MLP the lr is multiplied by D unless ``config.scale_lr`` is False (Goyal et al.'s rule,
    as ddp; the GPT only with ``scale_lr`` True). An MLP epoch's last batch is skipped when it
    has fewer samples than micro-batches (reshuffled, no sample is lost for good). With
    ``config.global_batch_size`` G (D dividing G, ``config.microbatches`` dividing G / D:
    ``elastic.check_global_batch_layout``) pipeline d reads its contiguous G / D of each global
    batch (the MLP's ``data.GlobalBatchSampler`` over D replicas, the GPT's
    ``data.TokenWindows(global_batch_size=G)``) at ``config.lr``: one process's step on G. Each
    step is a ``pipeline.step.PipelineStep``.
    With one rank and one stage this is plain sequential training through the same
    machinery; with ``microbatches=1`` it is naive model parallelism (one stage busy at a time).

    Each epoch's end (:func:`~minidist.parallel.pipeline.report.epoch_reporter`): the bubble (1
    - busy / step time from the executor's timelines, per rank over the epoch's steps, averaged
    over the ranks) and every stage's peak activation memory are gathered on rank 0; pipeline 0
    gathers its stages' parameters into rank 0's whole model, which rank 0 scores and logs (one
    line, with the bubble the simulator predicts for uniform stages beside the measured one, and
    after the first epoch :func:`bubble_note` when the two disagree). Every wait gives up after
    ``config.timeout`` seconds.

    Returns a TrainResult on rank 0 (figures: ranks, pipelines, stages, schedule,
    microbatches, global_batch, lr, bubble and simulated_bubble of the last epoch,
    peak_activation_bytes per stage, pipeline_bytes_sent by all stages) and None on the
    other ranks. Raises ValueError (naming the fix) for a layout :func:`check_pipeline`
    refuses or a PipeDream schedule, NonFiniteLossError on every rank when the loss diverges.

    Checkpoints (``config.checkpoint_dir``): a gathered :class:`~minidist.fault.Checkpointer`:
    at a checkpoint step every rank's stages (parameters, optimizer state, lr schedule,
    generators) and the position of its pipeline's sampler go to rank 0, which writes one file;
    ``config.resume`` sends each rank its part back; with G, a checkpoint of another layout
    (--dp, stages, stages per rank, flushing schedule, micro-batches) is cut again for this one
    (:func:`stage_resharder`, ``pipeline.elastic``). The flush at each step's end makes every
    step boundary a consistent cut (no micro-batch in flight). ``config.save_model``: rank 0
    writes the whole model (pipeline 0's stages) after the last epoch. Raises
    checkpoint_io.CheckpointError (every rank) for a checkpoint that cannot be resumed,
    fault.TrainingStopped after ``config.stop_after_steps``.
    """
    if config.schedule not in FLUSHING_SCHEDULES:
        raise ValueError(f"train_pipeline runs the flushing schedules {', '.join(FLUSHING_SCHEDULES)}; "
                         f"--schedule {config.schedule} is train_pipedream's")
    check_pipeline(comm.Get_size(), config)
    return train_parallel(PipelineRun, comm, config, dataset)


class PipelineRun(ParallelRun):
    """The pipeline's parallelize step and hooks (:func:`train_pipeline`): D pipelines of
    S ranks (``ProcessGrid``), the model cut into stages (:func:`build_stages`), this rank's
    stages the checkpointed model, the optimizer on their parameters (a tied one once). Every
    rank reports: the epoch's figures and pipeline 0's stages are gathered (collective)."""

    reports_everywhere = True

    def __init__(self, comm, config: TrainConfig, dataset):
        dp, pp, v = self.layout = pipeline_layout(comm.Get_size(), config)
        config = per_rank_config(config, dp)  # with G, each pipeline's batch is G / D
        work = workload_for(config, dataset)
        self.grid = ProcessGrid.create(comm, dp)
        self.whole, self.stage_modules, stages = build_stages(work, config, dataset, self.grid, pp * v)
        actions, schedule_class = FLUSHING_SCHEDULES[config.schedule]
        self.pipeline_schedule = schedule_class(stages if v > 1 else stages[0], config.microbatches, work.loss)
        self.actions = actions(pp, config.microbatches, v)
        lr = data_parallel_lr(work, config, dp)
        params = {id(p): p for st in stages for p in st.submodule.parameters()}  # a tied one once
        super().__init__(comm, config, work, nn.Sequential(*[st.submodule for st in stages]),
                         work.optimizer(list(params.values()), lr), lr, self.grid.dp_rank, dp)
        self.loader_options = {"min_batch": config.microbatches}

    def step(self):
        step = PipelineStep(self.pipeline_schedule, self.grid, self.optimizer, self.schedule,
                            precision=self.config.precision, scaler=self.scaler,
                            tied=tied_parameters(self.stage_modules[0], self.stage_modules[-1]),
                            grad_clip=self.work.grad_clip)
        self.on_epoch_end, self.last = epoch_reporter(self.comm, self.work, self.whole, self.grid, self.stage_modules,
                                                 step, self.scaler, self.log, self.actions)
        return step

    def report(self, epoch, loss, seconds):
        return self.on_epoch_end(epoch, loss, seconds)

    def describe(self) -> str:
        return describe_layout(self.config, self.comm.Get_size(), self.stage_modules, self.lr)

    def checkpoint_options(self) -> dict:
        dp, pp, v = self.layout
        return {"gathered": True, "reshard": stage_resharder(self.config, self.whole, (dp, pp, 1, v))}

    def finish(self, checkpointer):
        checkpointer.close()  # the folder's lock
        if self.comm.Get_rank() == 0 and self.config.save_model:  # pipeline 0's stages, gathered at the epoch's end
            Checkpointer(self.config, self.whole, None, metadata=self.work.metadata()).save_model()
        return self.whole

    def figures(self, step) -> dict | None:
        config, last, (dp, pp, v) = self.config, self.last, self.layout
        return {
            "ranks": self.comm.Get_size(), "pipelines": dp, "stages": pp * v, "schedule": config.schedule,
            "microbatches": config.microbatches, "global_batch": global_batch(config, dp), "lr": f"{self.lr:g}",
            "bubble": f"{last['bubble']:.3f}" if "bubble" in last else "nan",
            "simulated_bubble": f"{last['simulated']:.3f}",
            "peak_activation_bytes": ",".join(map(str, last.get("peaks", []))),
            "pipeline_bytes_sent": last.get("sent", 0),
            **precision.figures(config.precision, self.scaler),
        }

    def free(self) -> None:
        self.grid.free()


def stage_resharder(config: TrainConfig, model, layout: tuple):
    """The ``Checkpointer(reshard=...)`` of a pipeline or 3-D run of ``layout`` (dp, pp, tp, V)
    whose rank 0 holds ``model`` (the whole MLP or GPT, or its tensor-parallel copy):
    ``reshard(parts, world_size)`` cuts a checkpoint saved on another layout for this one
    (:func:`~minidist.parallel.pipeline.elastic.reshard_pipeline`); None without a global batch
    (``fault.is_elastic``: a checkpoint then resumes on its own layout only)."""
    if getattr(config, "global_batch_size", None) is None:
        return None
    here = PipelineLayout(*layout)
    return lambda parts, world_size: reshard_pipeline(parts, here, model, lambda n: model_stages(config, model, n),
                                                      config.n_head)
