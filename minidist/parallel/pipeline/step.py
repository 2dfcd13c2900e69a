"""One training step of a pipeline (and of D pipelines side by side), as ``train.fit`` wants it.

``train.fit`` calls ``step_fn(x, y) -> loss`` once per mini-batch on every rank. For a
pipeline that call is, on each rank of it:

1. ``optimizer.zero_grad()``; run the schedule for the whole mini-batch: the rank of the
   first stage feeds ``x``, the rank of the last the target ``y`` (every rank iterates the
   same loader, so they agree on the batch; the others ignore what they do not need). After
   the flush each stage's ``.grad`` is the gradient of the mean micro-batch loss.
2. The loss (the mean of the micro-batch losses, known on the last stage) reaches every rank
   of the pipeline by one broadcast of one number (``collectives.broadcast``, binomial tree):
   ``fit`` checks it for NaN on every rank, so all stop at the same step, none is left waiting.
3. With D pipelines (:mod:`~minidist.parallel.pipeline.grid`) each stage averages its
   gradients over its data-parallel group, one all-reduce, with the loss in the same message
   (so every rank reports, and stops on, the loss of the global batch).
4. The learning-rate schedule and the optimizer step.

Mixed precision (:mod:`minidist.precision`): every stage's forward runs under ``autocast``, so
the activations and gradients between stages travel in float16/bfloat16 (half the bytes); the
last stage's loss is multiplied by the ``GradScaler``'s scale, the reported loss divided back;
the stages agree on skipping a step (one all-reduce of the overflow flag over the pipeline,
``GradScaler.unscale_(optimizer, comm)``): a stage that stepped while another skipped would
leave the model half updated.

It also measures what a pipeline is about: per step, the time this rank computed (the sum
of its actions, from the executor's timeline) against the step's time; the bubble is the
rest, ``1 - busy / step``. ``PipelineStep.measurements()`` gives the totals since the last
``reset_measurements()`` and each stage's peak activation memory (bytes held for backward,
``PipelineStage.peak_activation_bytes``).
"""
from __future__ import annotations

import numpy

from minidist import backend
from minidist.collectives import broadcast
from minidist.parallel.pipeline.grid import average_gradients
from minidist.precision import autocast


class PipelineStep:
    """``step_fn(x, y) -> loss`` for ``train.fit``: one schedule step, the loss shared, the
    gradients averaged over the data-parallel group, one optimizer step (module docstring).

    Args:
        schedule: this rank's ``PipelineSchedule`` (``ScheduleGPipe``, ...), built over
            ``grid.pp_comm``.
        grid: the ``ProcessGrid`` (``dp_size`` 1 for a single pipeline).
        optimizer: over this rank's stages' parameters.
        lr_schedule: optional, stepped before each optimizer step (e.g. ``optim.WarmupLR``).
        precision: "fp32", "fp16" or "bf16": the forward's autocast dtype.
        scaler: an optional ``precision.GradScaler`` (loss scaling; disabled: plain steps).

    Calling it: x (b, features) and y (b,) on every rank (only the first and last stage use
    them); b >= the number of micro-batches. Returns the loss as a float: the mean
    micro-batch loss of this pipeline, averaged over the D pipelines.
    Raises PipelineError / CollectiveTimeout when a neighbour or a replica stops answering.
    """

    def __init__(self, schedule, grid, optimizer, lr_schedule=None, *, precision: str = "fp32", scaler=None):
        self.schedule, self.grid, self.optimizer, self.lr_schedule = schedule, grid, optimizer, lr_schedule
        self.precision, self.scaler = precision, scaler if scaler is not None and scaler.is_enabled() else None
        if self.scaler is not None:  # the last stage's loss, scaled: backward starts from scale * loss
            loss_fn = schedule.loss_fn
            schedule.loss_fn = lambda out, target: self.scaler.scale(loss_fn(out, target))
        self.stages = [schedule.stages[s] for s in sorted(schedule.stages)]
        self.params = [p for stage in self.stages for p in stage.submodule.parameters()]
        self.has_first = 0 in schedule.stages
        self.has_last = schedule.num_stages - 1 in schedule.stages
        self.last_rank = (schedule.num_stages - 1) % grid.pp_size  # pp_rank of the last stage
        self.reset_measurements()

    def __call__(self, x, y):
        self.optimizer.zero_grad()
        losses = []
        args = (x,) if self.has_first else ()
        kwargs = {"target": y, "losses": losses} if self.has_last else {}
        device = backend.device_of(self.params[0].data) if self.params else "cpu"
        with autocast(self.precision, device=device):
            self.schedule.step(*args, **kwargs)
        loss = numpy.array([numpy.mean(losses) if self.has_last else 0.0])
        if self.scaler is not None:
            loss /= self.scaler.get_scale()  # the scale this step's losses were multiplied by
        if self.grid.pp_size > 1:
            loss = broadcast(self.grid.pp_comm, loss, root=self.last_rank, validate=False)
        loss = float(loss[0])
        if self.grid.dp_size > 1:
            loss = average_gradients(self.params, self.grid.dp_comm, extra=loss)
        if self.lr_schedule is not None:
            self.lr_schedule.step()
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer, comm=self.grid.pp_comm)
            self.scaler.update()
        self.busy_seconds += sum(e.end - e.start for e in self.schedule.timeline)
        self.step_seconds += self.schedule.step_seconds
        self.steps += 1
        return loss

    def reset_measurements(self):
        """Start counting busy and step time afresh (e.g. at each epoch)."""
        self.busy_seconds, self.step_seconds, self.steps = 0.0, 0.0, 0

    def measurements(self) -> numpy.ndarray:
        """This rank's figures as one float64 vector, the same length on every rank (to
        gather): [busy seconds, step seconds, steps (since the last reset), bytes its stages
        sent to their neighbours (since construction), peak activation bytes of each of its
        stages in stage order]."""
        sent = sum(stage.bytes_sent for stage in self.stages)
        peaks = [float(stage.peak_activation_bytes) for stage in self.stages]
        return numpy.array([self.busy_seconds, self.step_seconds, float(self.steps), float(sent), *peaks])

    @property
    def bubble(self) -> float:
        """This rank's bubble since the last reset: 1 - busy / step time (NaN before a step)."""
        return 1.0 - self.busy_seconds / self.step_seconds if self.step_seconds > 0 else float("nan")
