"""PipeDream's driver, pipelines with no flush: ``train --strategy pipeline --schedule pipedream``
or ``pipedream-2bw`` (weight stashing, vertical sync, 2BW). The model, its cut, the layout checks
and the gathering of the stages are the flushing driver's (:mod:`minidist.parallel.pipeline.train`).
"""
from __future__ import annotations

import math

import numpy as np

from minidist import data, optim
from minidist.collectives import broadcast, gather
from minidist.functions import cross_entropy
from minidist.parallel.pipeline import executor, pipedream
from minidist.parallel.pipeline.grid import ProcessGrid
from minidist.parallel.pipeline.report import gather_pipeline_model, measured_bubble
from minidist.parallel.pipeline.train import build_pipeline_model, check_pipeline, split_stages
from minidist.train import (
    PIPEDREAM_SCHEDULES,
    NonFiniteLossError,
    TrainConfig,
    TrainResult,
    accuracy,
    collective_deadline,
    fit,
    rank_logger,
    report_epoch,
    warmup_schedule,
)


class _EpochStreams:
    """A loader's epoch as streams: the epoch's batches (each of ``batch_size`` rows, the last
    short one dropped) concatenated into (x, y) pairs of at most ``step.batches_per_stream()``
    batches each, one PipeDream step per pair. ``set_epoch`` passes on to the loader
    (reshuffling) and tells the step that a new epoch starts (so it can name a batch)."""

    def __init__(self, loader, step):
        self.loader, self.step, self.batches = loader, step, step.batches_per_stream()

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)
        self.step.start_epoch(epoch)

    def __len__(self):
        return math.ceil(len(self.loader) / self.batches)

    def __iter__(self):
        xs, ys = [], []
        for x, y in self.loader:
            xs.append(x)
            ys.append(y)
            if len(xs) == self.batches:
                yield np.concatenate(xs), np.concatenate(ys)
                xs, ys = [], []
        if xs:
            yield np.concatenate(xs), np.concatenate(ys)


def train_pipedream(comm, config: TrainConfig, dataset: data.Dataset) -> TrainResult | None:
    """Pipeline training with no flush: ``--schedule pipedream`` (Narayanan et al., SOSP 2019)
    or ``pipedream-2bw`` (Narayanan et al., ICML 2021) on P ranks, one stage per rank
    (:mod:`minidist.parallel.pipeline.pipedream`).

    The model, its cut and the data are :func:`train_pipeline`'s (one pipeline, ``dp`` = 1).
    An epoch is one stream through the pipeline (several if it would need more message tags
    than MPI guarantees, each ending with a flush): with ``pipedream`` each batch of
    ``config.batch_size`` rows is one micro-batch and one update on every stage, with
    ``config.weight_stashing`` (default) and ``config.vertical_sync`` choosing the weights its
    passes run on; with ``pipedream-2bw`` each batch is cut into ``config.microbatches`` (m >= P)
    micro-batches whose gradients make one update, batch t running on version t - 1.

    Each epoch's end: rank 0 gathers the figures (the bubble as :func:`train_pipeline` measures
    it; per stage the peak weight versions held and the peak bytes of the stashed copies) and
    the stages' parameters, scores the model and logs one line. Returns a TrainResult on
    rank 0 (figures: ranks, stages, schedule, weight_stashing, vertical_sync, microbatches,
    lr, bubble, versions_per_stage, stashed_bytes_per_stage, parameter_bytes_per_stage) and
    None elsewhere. Raises ValueError for a layout :func:`check_pipeline` refuses,
    NonFiniteLossError on every rank naming the epoch and the first batch of it whose loss is
    not finite (a stream of many batches is one ``fit`` step, so fit alone would say "step 1").
    """
    if config.schedule not in PIPEDREAM_SCHEDULES:
        raise ValueError(f"train_pipedream runs {' and '.join(PIPEDREAM_SCHEDULES)}; --schedule {config.schedule} "
                         "flushes (train_pipeline)")
    world_size, rank = comm.Get_size(), comm.Get_rank()
    check_pipeline(world_size, config)
    p, b, two_bw = world_size, config.batch_size, config.schedule == "pipedream-2bw"
    with collective_deadline(config.timeout):
        grid = ProcessGrid.create(comm, 1)
        model = build_pipeline_model(config, dataset)
        stage_modules = split_stages(model, p)
        stage = pipedream.PipeDreamStage(stage_modules[rank], rank, p, comm, timeout=config.timeout)
        optimizer = optim.SGD(list(stage.submodule.parameters()), lr=config.lr, momentum=config.momentum,
                              weight_decay=config.weight_decay)
        sampler = data.DistributedSampler(len(dataset.X_train), 1, 0, shuffle=True, seed=config.seed)
        loader = data.DataLoader(dataset.X_train, dataset.y_train, batch_size=b, sampler=sampler, drop_last=True)
        step = StreamStep(comm, stage, optimizer, config, warmup_schedule(optimizer, config, len(loader)))
        log = rank_logger(rank == 0, False)
        variant = config.schedule if two_bw else (
            "pipedream" + ("" if config.weight_stashing else " without weight stashing")
            + (" with vertical sync" if config.vertical_sync else ""))
        unit = f"one update per batch of {b}" + (f" ({step.per_batch} micro-batches)" if two_bw else "")
        log(f"pipeline: {p} rank{'s' if p > 1 else ''}, {p} stage{'s' if p > 1 else ''}, schedule {variant}: no "
            f"flush, {unit}, lr {config.lr:g}, momentum {config.momentum:g}")
        on_epoch_end, last = _epoch_reporter(comm, config, dataset, model, grid, stage_modules, step, log)
        history = fit(step, _EpochStreams(loader, step), config.epochs,
                      on_epoch_end=on_epoch_end, progress=False)
        grid.free()
    if rank != 0:
        return None
    figures = {
        "ranks": p, "stages": p, "schedule": config.schedule, "weight_stashing": config.weight_stashing,
        "vertical_sync": config.vertical_sync, "microbatches": step.per_batch, "lr": f"{config.lr:g}",
        "bubble": f"{last['bubble']:.3f}" if last else "nan",
        "versions_per_stage": ",".join(map(str, last.get("versions", []))),
        "stashed_bytes_per_stage": ",".join(map(str, last.get("stashed", []))),
        "parameter_bytes_per_stage": ",".join(map(str, last.get("params", []))),
    }
    test_accuracy = history[-1]["test_accuracy"] if history else accuracy(model, dataset.X_test, dataset.y_test,
                                                                          device=config.device)
    return TrainResult(test_accuracy, history, figures, model)


class StreamStep:
    """PipeDream's step function for :func:`minidist.train.fit`: ``step(x, y)`` runs one stream
    (x: a whole number of batches of ``config.batch_size`` rows, concatenated) through the
    pipeline with no flush inside it, then a flush, and returns the stream's mean loss on
    every rank (broadcast from the last stage). ``per_batch``: micro-batches per batch (2BW's
    ``config.microbatches``; 1 for PipeDream). ``busy``/``step_seconds`` add up the compute time
    and the wall time of the streams since the last ``reset``. Raises NonFiniteLossError (every
    rank) naming the epoch and the batch within it (from 1) of the stream's first batch whose
    loss is NaN or infinite."""

    def __init__(self, comm, stage, optimizer, config: TrainConfig, lr_schedule):
        self.comm, self.stage, self.optimizer, self.config = comm, stage, optimizer, config
        self.lr_schedule = lr_schedule
        self.two_bw = config.schedule == "pipedream-2bw"
        self.per_batch = config.microbatches if self.two_bw else 1
        self.schedules = {}  # one schedule object per stream length (the last stream may be shorter)
        self.epoch, self.batches_done = 0, 0  # where the next stream starts: epoch (from 0), batches before it
        self.reset()

    def start_epoch(self, epoch: int) -> None:
        """A new epoch (from 0) begins: the next stream starts at its first batch."""
        self.epoch, self.batches_done = epoch, 0

    def reset(self) -> None:
        """Start counting compute and wall time afresh (each epoch)."""
        self.busy, self.step_seconds = 0.0, 0.0

    def batches_per_stream(self) -> int:
        """The most batches one stream may hold: its messages need distinct tags below
        ``executor.META_TAG`` (three per stage and micro-batch)."""
        return (executor.META_TAG - 2) // (3 * self.stage.num_stages) // self.per_batch

    def schedule_for(self, n: int):
        """The schedule of a stream of ``n`` micro-batches (made once per length)."""
        if n not in self.schedules:
            config, stage, optimizer = self.config, self.stage, self.optimizer
            if self.two_bw:
                self.schedules[n] = pipedream.SchedulePipeDream2BW(stage, n, cross_entropy, optimizer,
                                                                   accumulation=self.per_batch,
                                                                   lr_schedule=self.lr_schedule)
            else:
                self.schedules[n] = pipedream.SchedulePipeDream(
                    stage, n, cross_entropy, optimizer, weight_stashing=config.weight_stashing,
                    vertical_sync=config.vertical_sync, lr_schedule=self.lr_schedule)
        return self.schedules[n]

    def __call__(self, x, y) -> float:
        stage, p = self.stage, self.stage.num_stages
        batches = len(x) // self.config.batch_size
        schedule = self.schedule_for(batches * self.per_batch)
        losses = []
        args = (x,) if stage.is_first else ()
        kwargs = {"target": y, "losses": losses} if stage.is_last else {}
        schedule.step(*args, **kwargs)
        self.busy += sum(e.end - e.start for e in schedule.timeline)
        self.step_seconds += schedule.step_seconds
        # The last stage knows each batch's loss: [stream mean, first non-finite batch or -1, its loss].
        summary = np.array([0.0, -1.0, 0.0])
        if stage.is_last:
            per_batch = np.mean(np.reshape(losses, (batches, self.per_batch)), axis=1)
            bad = np.flatnonzero(~np.isfinite(per_batch))
            summary = np.array([np.mean(losses), bad[0] if bad.size else -1.0, per_batch[bad[0]] if bad.size else 0.0])
        if p > 1:
            summary = broadcast(self.comm, summary, root=p - 1, validate=False)
        if summary[1] >= 0:
            raise NonFiniteLossError(self.epoch + 1, self.batches_done + int(summary[1]) + 1, float(summary[2]))
        self.batches_done += batches
        return float(summary[0])


def _epoch_reporter(comm, config, dataset, model, grid, stage_modules, step: StreamStep, log):
    """:func:`train_pipedream`'s ``on_epoch_end`` (every rank: a gather of its figures and of
    the stages' parameters; rank 0 scores and logs) and the dict of the last epoch's figures."""
    stage, last = step.stage, {}

    def on_epoch_end(epoch, loss, seconds):
        stash = stage.stash
        mine = np.array([step.busy, step.step_seconds, stash.peak_versions, stash.peak_stashed_bytes,
                         sum(q.data.nbytes for q in stash.params)], dtype=np.float64)
        step.reset()
        gathered = gather(comm, mine, root=0) if comm.Get_size() > 1 else mine[None, :]
        gather_pipeline_model(grid, stage_modules)
        if comm.Get_rank() != 0:
            return None
        gathered = np.asarray(gathered)
        bubble = measured_bubble(gathered[:, 0], gathered[:, 1])
        versions, stashed = gathered[:, 2].astype(int).tolist(), gathered[:, 3].astype(int).tolist()
        last.update(bubble=bubble, versions=versions, stashed=stashed, params=gathered[:, 4].astype(int).tolist())
        extra = (f"  bubble={bubble:.3f}  versions_per_stage={','.join(map(str, versions))}  "
                 f"stashed_kib_per_stage={','.join(f'{v / 1024:.1f}' for v in stashed)}")
        row = report_epoch(model, dataset, config, epoch, loss, seconds, log, extra)
        row.update(bubble=bubble, versions=versions, stashed_bytes=stashed)
        return row

    return on_epoch_end, last
