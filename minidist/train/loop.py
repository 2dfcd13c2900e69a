"""The one training loop, :func:`fit`, and the step functions it drives (plain supervised,
sharded, a workload's), the log and deadline every driver uses."""
from __future__ import annotations

import contextlib
import itertools
import math
import sys
import time

from tqdm import tqdm

from minidist import backend, nn, p2p
from minidist.collectives import gather_objects
from minidist.functions import cross_entropy
from minidist.precision import autocast
from minidist.tensor import Tensor


class NonFiniteLossError(FloatingPointError):
    """The loss of a step was NaN or infinite: training diverged (most often the learning
    rate is too large). ``epoch`` and ``step`` count from 1 (``step`` within the epoch);
    ``loss`` is the value returned by the step function."""

    def __init__(self, epoch: int, step: int, loss: float):
        super().__init__(f"the loss became {loss} at epoch {epoch}, step {step}: training diverged "
                         "(the learning rate is probably too large)")
        self.epoch, self.step, self.loss = epoch, step, loss


# ---------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------


def fit(step_fn, loader, epochs: int, *, on_epoch_end=None, progress: bool = False, start: dict | None = None,
        on_step_end=None, bar_label=None) -> list[dict]:
    """Train for ``epochs`` passes over ``loader``, one ``step_fn(x, y)`` per mini-batch.

    Args:
        step_fn: ``step_fn(x, y) -> float``: one training step on the batch (forward,
            backward, update, and whatever communication the strategy needs); returns the
            step's loss (a Python float or anything ``float()`` accepts).
        loader: an iterable of ``(x, y)`` batches, iterated once per epoch. Before epoch e
            (counting from 0) ``loader.set_epoch(e)`` is called, or ``loader.sampler.set_epoch(e)``
            when only the sampler has one, so a shuffling (distributed) sampler draws a new
            order each epoch, as PyTorch's ``DistributedSampler`` needs.
        epochs: number of passes (>= 0).
        on_epoch_end: optional ``on_epoch_end(epoch, mean_loss, seconds) -> dict | None``
            after each epoch (epoch counts from 1; seconds is the epoch's training time,
            without the callback); a dict it returns is merged into that epoch's row.
        progress: show a tqdm bar (on stderr) over each epoch's batches; turn it on for one
            rank only.
        start: where to resume (a position ``on_step_end`` was given, e.g. from a checkpoint):
            ``{"epoch"`` (index from 0 of the epoch in progress), ``"step"`` (its batches already
            done: they are drawn from the loader again and skipped, so the loader must give the
            same batches for the same epoch), ``"loss_total"`` (the sum of their losses),
            ``"global_step"``, ``"history"`` (the rows of the epochs before)``}``. None: from the start.
        on_step_end: optional ``on_step_end(position)`` after each step, with the position
            (the dict ``start`` takes) reached after it; a checkpoint hook. It may raise to stop.
        bar_label: optional ``bar_label(epoch, epochs) -> str``, the progress bar's label
            (default ``epoch 3/20``).

    Returns one row per epoch: ``{"epoch", "loss" (mean over the epoch's steps; NaN for an
    empty epoch), "steps", "seconds"}`` plus what ``on_epoch_end`` returned.

    Raises NonFiniteLossError (naming the epoch and the step) as soon as a step's loss is
    NaN or infinite, before the next step runs.
    """
    set_epoch = getattr(loader, "set_epoch", None) or getattr(getattr(loader, "sampler", None), "set_epoch", None)
    start = start or {}
    history, first = list(start.get("history", [])), start.get("epoch", 0) + 1
    skip, total, global_step = start.get("step", 0), start.get("loss_total", 0.0), start.get("global_step", 0)
    for epoch in range(first, epochs + 1):
        if set_epoch is not None:
            set_epoch(epoch - 1)
        began, steps = time.perf_counter(), skip
        batches = itertools.islice(loader, skip, None) if skip else loader
        label = bar_label(epoch, epochs) if bar_label is not None else f"epoch {epoch}/{epochs}"
        bar = tqdm(batches, desc=label, leave=False, disable=not progress, file=sys.stderr,
                   dynamic_ncols=True, initial=skip, total=len(loader) if hasattr(loader, "__len__") else None)
        for x, y in bar:
            loss = float(step_fn(x, y))
            steps += 1
            global_step += 1
            if not math.isfinite(loss):
                bar.close()
                raise NonFiniteLossError(epoch, steps, loss)
            total += loss
            if on_step_end is not None:
                on_step_end({"epoch": epoch - 1, "step": steps, "loss_total": total, "global_step": global_step,
                             "history": history})
        row = {"epoch": epoch, "loss": total / steps if steps else float("nan"), "steps": steps,
               "seconds": time.perf_counter() - began}
        if on_epoch_end is not None:
            row.update(on_epoch_end(epoch, row["loss"], row["seconds"]) or {})
        history.append(row)
        skip, total = 0, 0.0
    return history


def supervised_step(model, optimizer, *, device: str = "cpu", lr_schedule=None, precision: str = "fp32",
                    scaler=None, loss_fn=None, grad_clip: float | None = None, loss_weight: float = 1.0):
    """The step function of plain supervised training: ``step_fn(x, y)`` zeroes the
    gradients, computes ``cross_entropy(model(x), y)`` (or ``loss_fn(x, y)``, a scalar Tensor),
    backpropagates, clips the gradients' global norm to ``grad_clip`` (None: no clipping;
    ``nn.utils.clip_grad_norm_``), advances ``lr_schedule`` (e.g. :class:`minidist.optim.WarmupLR`;
    may be None) and steps ``optimizer``; it returns the loss as a float. x (b, features) float
    array, y (b,) int array, moved to ``device``. ``model`` may be a ``DistributedDataParallel``.

    Mixed precision (:mod:`minidist.precision`, Micikevicius et al. 2018): forward and loss run
    under ``autocast(precision)``; with ``scaler`` (a ``GradScaler``) backward starts from the
    scaled loss, the gradients are unscaled before clipping, and ``scaler.step`` skips the update
    when a gradient overflowed (with DDP every rank sees the same averaged gradients, so all skip
    together). The returned loss is unscaled.

    ``loss_weight`` (:func:`loss_weight`: a data-parallel rank's part of an uneven global batch)
    multiplies the loss before backward, so the ranks' averaged gradients are the mean over
    the global batch; the returned loss is not weighted. 1.0 multiplies nothing (bit for bit)."""
    if loss_fn is None:
        def loss_fn(x, y):
            return cross_entropy(model(Tensor(x, device=device)), backend.to_device(y, device))

    def step_fn(x, y):
        optimizer.zero_grad()
        with autocast(precision, device=device):
            loss = loss_fn(x, y)
        weighted = loss if loss_weight == 1.0 else loss * loss_weight
        if scaler is None:
            weighted.backward()
        else:
            scaler.scale(weighted).backward()
        if grad_clip is not None:
            if scaler is not None:
                scaler.unscale_(optimizer)
            nn.clip_grad_norm_(optimizer.params, grad_clip)
        if lr_schedule is not None:
            lr_schedule.step()
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        return loss.item()

    return step_fn


def silent(line: str) -> None:
    """The log of ranks that do not report: nothing."""


def rank_logger(reports: bool, progress: bool):
    """The log function of one rank: ``tqdm.write`` on the reporting rank while a progress bar
    runs (so lines do not tear the bar), ``print`` on it otherwise, :func:`silent` elsewhere."""
    if not reports:
        return silent
    return tqdm.write if progress else print


@contextlib.contextmanager
def collective_deadline(seconds: float):
    """Within the block, every wait of :mod:`minidist.p2p` without a deadline of its own (the
    collectives, so ``DistributedDataParallel`` and ``inference.evaluate``; the pipeline
    executor; the parameter servers) gives up after ``seconds``;
    the previous deadline is restored after it."""
    previous = p2p.set_timeout(seconds)
    try:
        yield
    finally:
        p2p.set_timeout(previous)


def sharded_step(loss_of, optimizer, lr_schedule, clip_grad_norm=None, context=contextlib.nullcontext, *,
                 precision: str = "fp32", scaler=None, comm=None, device: str = "cpu", loss_weight: float = 1.0):
    """The step of a model whose parameters are split across the ranks (tensor parallelism,
    FSDP, ZeRO-1): ``step(x, y) -> loss`` (a float) that zeroes the gradients, computes
    ``loss_of(x, y)`` (a scalar Tensor) under ``autocast(precision)`` and its backward (from the
    scaled loss with ``scaler``, a ``precision.GradScaler``) inside ``context()``
    (``ddp.no_sync`` for ZeRO-1), unscales the gradients (the inf/NaN flag agreed over ``comm``:
    each rank holds other shards, and all must skip together), calls ``clip_grad_norm()`` when
    given (the split model's own norm, each parameter counted once across the ranks), advances
    ``lr_schedule`` (None: none) and steps ``optimizer`` (through the scaler, which skips a step
    with inf or NaN gradients): :func:`supervised_step`'s order. The parameters (the master
    shards) stay in float32. Collective when the model's ops are. ``loss_weight``: as
    :func:`supervised_step`'s (the backward starts from the weighted loss, the returned loss is
    not weighted)."""

    def step(x, y):
        optimizer.zero_grad()
        with context():
            with autocast(precision, device=device):
                loss = loss_of(x, y)
            weighted = loss if loss_weight == 1.0 else loss * loss_weight
            (weighted if scaler is None else scaler.scale(weighted)).backward()
        if scaler is not None:
            scaler.unscale_(optimizer, comm)
        if clip_grad_norm is not None:
            clip_grad_norm()
        if lr_schedule is not None:
            lr_schedule.step()
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer, comm)
            scaler.update()
        return float(loss.item())

    return step


class StepBytes:
    """Count the bytes a step function sends: ``StepBytes(step_fn, traffic)`` is a step
    function that runs ``step_fn`` and adds what ``traffic`` sent meanwhile, its calls to
    ``steps`` (so evaluations and checkpoints, which run between steps, are left out).

    traffic: one ``tracing.CountingComm``, or a dict name -> CountingComm (a 3-D run's "tp",
    "pp" and "dp" groups), each counted apart in ``bytes_by[name]``; ``bytes`` is their sum.
    ``per_step(comm)``: every rank's mean bytes per step (an int; with ``by_name=True`` a dict
    name -> int), in rank order, on rank 0 and None elsewhere (collective over ``comm``)."""

    def __init__(self, step_fn, traffic):
        self.step_fn = step_fn
        self.counters = dict(traffic) if isinstance(traffic, dict) else {"all": traffic}
        self.bytes_by = dict.fromkeys(self.counters, 0)
        self.steps = 0

    @property
    def bytes(self) -> int:
        return sum(self.bytes_by.values())

    def __call__(self, x, y):
        before = {name: counter.nbytes for name, counter in self.counters.items()}
        loss = self.step_fn(x, y)
        for name, counter in self.counters.items():
            self.bytes_by[name] += counter.nbytes - before[name]
        self.steps += 1
        return loss

    def per_step(self, comm, by_name: bool = False):
        steps = max(self.steps, 1)
        mine = {name: round(b / steps) for name, b in self.bytes_by.items()} if by_name else round(self.bytes / steps)
        return gather_objects(comm, mine)


def workload_step(work, model, optimizer, lr_schedule, scaler, loss_weight: float = 1.0):
    """:func:`supervised_step` for ``work``: its forward and loss on ``model`` (the model or its
    ``DistributedDataParallel``), its gradient clipping, the run's precision and ``scaler``
    (disabled: none), and ``loss_weight`` (:func:`loss_weight`: this rank's part of an uneven
    global batch)."""
    config = work.config
    return supervised_step(model, optimizer, device=config.device, lr_schedule=lr_schedule,
                           precision=config.precision, scaler=scaler if scaler.is_enabled() else None,
                           loss_fn=lambda x, y: work.loss(work.forward(model, x), y), grad_clip=work.grad_clip,
                           loss_weight=loss_weight)


def checkpoint_parts(work, loader, scaler) -> dict:
    """The Checkpointer's ``extra`` parts of a run: the workload's and the loss scaler (when on)."""
    return {**work.checkpoint_state(loader), **({"scaler": scaler} if scaler.is_enabled() else {})}
