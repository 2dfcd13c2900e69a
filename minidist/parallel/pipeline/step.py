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
4. Weights tied between the first and the last stage (a GPT's token embedding, which is also
   its output layer: ``models.gpt_pipeline``) have a copy on each of the two ranks; each copy
   got only its own stage's part of the gradient, so the two ranks exchange them and both add
   first's + last's, in that order, so the copies stay equal to the bit (Megatron-LM's
   embedding group, Narayanan et al., SC 2021). When one rank holds both stages the copies
   are one Parameter and backward has summed its parts already.
5. Gradient clipping (optional): the global norm over every stage, each parameter once (the
   tied one on the first stage's rank), from one all-reduce of the ranks' sums of squares
   over the pipeline; every stage scales by the same factor (``nn.utils.clip_grad_norm_``'s).
6. The learning-rate schedule and the optimizer step.

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

import math

import numpy

from minidist import backend, p2p
from minidist.collectives import all_reduce, broadcast
from minidist.parallel.pipeline.grid import average_gradients
from minidist.precision import autocast

TIED_TAG = 29_999  # the tied gradients' exchange, after every message of the step has completed


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
        tied: the Parameters the first and last stage share (``models.gpt_pipeline.
            tied_parameters`` of the whole model's first and last stage: the same list on every
            rank); this rank's copies are exchanged when it holds one of the two stages only.
        grad_clip: the bound of the gradients' global norm (None: no clipping).

    Calling it: x (b, features) and y (b,) on every rank (only the first and last stage use
    them); b >= the number of micro-batches. Returns the loss as a float: the mean
    micro-batch loss of this pipeline, averaged over the D pipelines.
    Raises PipelineError / CollectiveTimeout when a neighbour or a replica stops answering.
    """

    def __init__(self, schedule, grid, optimizer, lr_schedule=None, *, precision: str = "fp32", scaler=None,
                 tied=(), grad_clip: float | None = None):
        self.schedule, self.grid, self.optimizer, self.lr_schedule = schedule, grid, optimizer, lr_schedule
        self.grad_clip = grad_clip
        self.precision, self.scaler = precision, scaler if scaler is not None and scaler.is_enabled() else None
        if self.scaler is not None:  # the last stage's loss, scaled: backward starts from scale * loss
            loss_fn = schedule.loss_fn
            schedule.loss_fn = lambda out, target: self.scaler.scale(loss_fn(out, target))
        self.stages = [schedule.stages[s] for s in sorted(schedule.stages)]
        unique = {id(p): p for stage in self.stages for p in stage.submodule.parameters()}
        self.params = list(unique.values())  # a Parameter of two stages on this rank (tied) once
        self.has_first = 0 in schedule.stages
        self.has_last = schedule.num_stages - 1 in schedule.stages
        self.last_rank = (schedule.num_stages - 1) % grid.pp_size  # pp_rank of the last stage
        # the tied copies to exchange: only on the two ranks of the ends, when they differ
        self.tied = [p for p in tied if id(p) in unique] if self.has_first != self.has_last else []
        self.tied_peer = self.last_rank if self.has_first else 0
        tied_here = {id(p) for p in self.tied} if self.has_last else set()  # counted by the first stage's rank
        self.norm_params = [p for p in self.params if id(p) not in tied_here]
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
            loss = self.average_over_replicas(loss)
        if self.tied:
            self._sum_tied_gradients()
        if self.grad_clip is not None:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer, comm=self.grid.pp_comm)
            self.clip_grad_norm()
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

    def average_over_replicas(self, loss: float) -> float:
        """Average this rank's gradients over its data-parallel group, the loss in the same
        message (:func:`~minidist.parallel.pipeline.grid.average_gradients`), and return the
        averaged loss. A sharded optimizer that reduce-scatters the gradients itself replaces it
        (the 3-D driver's ZeRO-1: ``three_d.train.ThreeDStep``). Collective over the dp group."""
        return average_gradients(self.params, self.grid.dp_comm, extra=loss)

    def _sum_tied_gradients(self):
        """Both ends' copies of the tied weights get first's + last's gradient (one exchange)."""
        comm = self.grid.pp_comm
        mine = numpy.concatenate([backend.to_numpy(p.grad).ravel() for p in self.tied])
        theirs = numpy.empty_like(mine)
        requests, peers, receives = p2p.post_exchange(comm, mine, self.tied_peer, theirs, self.tied_peer, TIED_TAG)
        p2p.wait_all(comm, requests, peers, f"the tied weights' gradients from rank {self.tied_peer}",
                     receives=receives)
        total = mine + theirs if self.has_first else theirs + mine  # the same order on both ranks
        offset = 0
        for p in self.tied:
            part = total[offset:offset + p.grad.size].reshape(p.grad.shape)
            p.grad = backend.to_device(part, backend.device_of(p.grad))
            offset += p.grad.size

    def clip_grad_norm(self) -> float:
        """Scale every stage's gradients so their global 2-norm is at most ``grad_clip``, as
        ``nn.utils.clip_grad_norm_`` would on the whole model (factor grad_clip / (norm +
        1e-6) when below 1); returns the norm before clipping. Collective over the pipeline."""
        squares = sum(float(backend.get_array_module(p.grad).vdot(p.grad.ravel(), p.grad.ravel()))
                      for p in self.norm_params if p.grad is not None)
        if self.grid.pp_size > 1:
            squares = float(all_reduce(self.grid.pp_comm, numpy.array([squares]), op="sum", validate=False)[0])
        total = math.sqrt(squares)
        coefficient = self.grad_clip / (total + 1e-6)
        if coefficient < 1:
            for p in self.params:
                if p.grad is not None:
                    p.grad *= p.grad.dtype.type(coefficient)
        return total

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
