"""Training: one loop, :func:`fit`, driven by each strategy's step function.

Every strategy trains the same way: for each epoch, for each mini-batch ``(x, y)`` of a
loader, do one step and note its loss. What a step *is* differs:

- ``single``: forward, loss, backward, optimizer step (:func:`supervised_step`);
- ``ddp``: the same on a :class:`~minidist.parallel.data_parallel.DistributedDataParallel`
  model, whose backward averages the gradients over the ranks;
- ``ps``: pull the parameters from the servers, forward and backward, push the gradient
  (``parameter_server.train_parameter_server``);
- a pipeline: a whole schedule of micro-batches per mini-batch.

So :func:`fit` takes the step as a function ``step_fn(x, y) -> loss`` and owns what is
common: the epoch loop (telling a distributed sampler the epoch, as PyTorch's
``DistributedSampler.set_epoch`` needs), the progress bar, the mean loss per epoch, a
per-epoch callback (evaluation, logging), and stopping with :class:`NonFiniteLossError`
when the loss becomes NaN or infinite, instead of training on garbage.

The drivers of ``python -m minidist train`` (**contract**) are here too and take a
:class:`TrainConfig`: :func:`train_single`, :func:`train_ddp`, :func:`train_ps`. Each
returns a :class:`TrainResult`; the command line (``minidist.cli``) parses the flags,
builds the config and prints the result (per-epoch lines, the strategy's figures, last
``final test_accuracy=0.xxxx``).
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from minidist import backend, data, nn, optim
from minidist.functions import cross_entropy
from minidist.tensor import Tensor, no_grad

STRATEGIES = ("single", "ddp", "ps")
PS_MODES = ("sync", "async", "ssp")


class NonFiniteLossError(FloatingPointError):
    """The loss of a step was NaN or infinite: training diverged (most often the learning
    rate is too large). ``epoch`` and ``step`` count from 1 (``step`` within the epoch);
    ``loss`` is the value returned by the step function."""

    def __init__(self, epoch: int, step: int, loss: float):
        super().__init__(f"the loss became {loss} at epoch {epoch}, step {step}: training diverged "
                         "(the learning rate is probably too large)")
        self.epoch, self.step, self.loss = epoch, step, loss


@dataclass
class TrainConfig:
    """What ``python -m minidist train`` trains, one field per flag (the defaults are the
    flags' defaults; ``minidist.cli`` checks the ranges before building one).

    strategy: one of STRATEGIES. epochs (>= 1), batch_size (>= 1, per rank).
    lr (> 0), momentum (in [0, 1)), weight_decay (>= 0): :class:`minidist.optim.SGD`.
    hidden: hidden layer sizes of the MLP. seed: data split, initialisation, shuffling.
    scale_lr: multiply lr by the number of data-parallel workers (Goyal et al. 2017);
    None means the strategy's default (on for ddp, off for ps).
    warmup_epochs (>= 0): ramp the lr up linearly over this many epochs of steps.
    ps_mode (one of PS_MODES), num_servers (>= 1), staleness (>= 0, ssp's bound): ps only.
    dataset: "digits" or "mnist" (then data_dir holds the IDX files). device: "cpu" or "cuda".
    progress: show a tqdm bar on the reporting rank. timeout: seconds every blocking wait
    of ddp and ps may take before it raises (a dead or stuck peer).
    """

    strategy: str = "single"
    epochs: int = 20
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    hidden: tuple = (128,)
    seed: int = 0
    scale_lr: bool | None = None
    warmup_epochs: float = 0.0
    ps_mode: str = "sync"
    num_servers: int = 1
    staleness: int = 2
    dataset: str = "digits"
    data_dir: str | None = None
    device: str = "cpu"
    progress: bool = True
    timeout: float = 300.0


@dataclass
class TrainResult:
    """What a strategy reports: the final test accuracy (fraction in [0, 1]), the
    per-epoch history (dicts with epoch, loss, train_accuracy, test_accuracy, seconds),
    strategy-specific figures (e.g. bytes sent, printed before the last line) and the
    trained model."""

    test_accuracy: float
    history: list = field(default_factory=list)
    figures: dict = field(default_factory=dict)
    model: object = None


# ---------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------


def fit(step_fn, loader, epochs: int, *, on_epoch_end=None, progress: bool = False) -> list[dict]:
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

    Returns one row per epoch: ``{"epoch", "loss" (mean over the epoch's steps; NaN for an
    empty epoch), "steps", "seconds"}`` plus what ``on_epoch_end`` returned.

    Raises NonFiniteLossError (naming the epoch and the step) as soon as a step's loss is
    NaN or infinite, before the next step runs.
    """
    set_epoch = getattr(loader, "set_epoch", None) or getattr(getattr(loader, "sampler", None), "set_epoch", None)
    history = []
    for epoch in range(1, epochs + 1):
        if set_epoch is not None:
            set_epoch(epoch - 1)
        start, total, steps = time.perf_counter(), 0.0, 0
        bar = tqdm(loader, desc=f"epoch {epoch}/{epochs}", leave=False, disable=not progress, file=sys.stderr,
                   dynamic_ncols=True)
        for x, y in bar:
            loss = float(step_fn(x, y))
            steps += 1
            if not math.isfinite(loss):
                bar.close()
                raise NonFiniteLossError(epoch, steps, loss)
            total += loss
        row = {"epoch": epoch, "loss": total / steps if steps else float("nan"), "steps": steps,
               "seconds": time.perf_counter() - start}
        if on_epoch_end is not None:
            row.update(on_epoch_end(epoch, row["loss"], row["seconds"]) or {})
        history.append(row)
    return history


def supervised_step(model, optimizer, *, device: str = "cpu", lr_schedule=None):
    """The step function of plain supervised training: ``step_fn(x, y)`` zeroes the
    gradients, computes ``cross_entropy(model(x), y)``, backpropagates, advances
    ``lr_schedule`` (e.g. :class:`minidist.optim.WarmupLR`; may be None) and steps
    ``optimizer``; it returns the loss as a float. x (b, features) float array, y (b,)
    int array, moved to ``device``. ``model`` may be a ``DistributedDataParallel``."""

    def step_fn(x, y):
        optimizer.zero_grad()
        loss = cross_entropy(model(Tensor(x, device=device)), backend.to_device(y, device))
        loss.backward()
        if lr_schedule is not None:
            lr_schedule.step()
        optimizer.step()
        return loss.item()

    return step_fn


# ---------------------------------------------------------------------------------------
# Scoring and reporting, shared by every strategy and by evaluate
# ---------------------------------------------------------------------------------------


def count_correct(model, X, y, batch_size: int = 1024, device: str = "cpu") -> int:
    """How many samples of (X, y) the model's argmax prediction gets right.
    X (n, features) float array, y (n,) int array. Runs under ``no_grad``."""
    correct = 0
    with no_grad():
        for start in range(0, len(X), batch_size):
            logits = model(Tensor(X[start : start + batch_size], device=device)).data
            predicted = backend.to_numpy(logits.argmax(axis=1))
            correct += int((predicted == np.asarray(y[start : start + batch_size])).sum())
    return correct


def accuracy(model, X, y, batch_size: int = 1024, device: str = "cpu") -> float:
    """Fraction of samples in (X, y) whose argmax prediction equals the label (NaN for
    an empty set). X (n, features) float array, y (n,) int array."""
    if len(X) == 0:
        return float("nan")
    return count_correct(model, X, y, batch_size, device) / len(X)


def report_epoch(model, dataset, config: TrainConfig, epoch, loss, seconds, log=print) -> dict:
    """Score the model after an epoch and log the line every strategy prints; returns the
    history row (epoch, loss, train_accuracy, test_accuracy, seconds)."""
    row = {
        "epoch": epoch,
        "loss": loss,
        "train_accuracy": accuracy(model, dataset.X_train, dataset.y_train, device=config.device),
        "test_accuracy": accuracy(model, dataset.X_test, dataset.y_test, device=config.device),
        "seconds": seconds,
    }
    log(f"epoch {epoch}/{config.epochs}  loss={loss:.4f}  train_accuracy={row['train_accuracy']:.4f}  "
        f"test_accuracy={row['test_accuracy']:.4f}  time={seconds:.2f}s")
    return row


def load_dataset(config: TrainConfig) -> data.Dataset:
    """The dataset named by ``config.dataset`` (``digits``, split by ``config.seed``, or
    ``mnist`` from ``config.data_dir``). Raises FileNotFoundError or ValueError for missing
    or malformed MNIST files."""
    if config.dataset == "mnist":
        return data.load_mnist(config.data_dir)
    return data.load_digits(seed=config.seed)


def build_model(config: TrainConfig, dataset: data.Dataset) -> nn.Sequential:
    """An MLP features -> hidden... -> classes, initialised from ``config.seed``."""
    sizes = [dataset.num_features, *config.hidden, dataset.num_classes]
    return nn.mlp(sizes, rng=config.seed, device=config.device)


def _warmup(optimizer, config: TrainConfig, steps_per_epoch: int):
    """The lr warm-up over ``config.warmup_epochs`` epochs of steps, or None."""
    if config.warmup_epochs <= 0:
        return None
    return optim.WarmupLR(optimizer, max(1, round(config.warmup_epochs * steps_per_epoch)))


def _quiet(line):
    """The log of ranks that do not report: nothing."""


# ---------------------------------------------------------------------------------------
# The strategies
# ---------------------------------------------------------------------------------------


def train_single(config: TrainConfig, dataset: data.Dataset, *, report: bool = True) -> TrainResult:
    """One process, one model: the reference every parallel strategy must match.

    SGD with ``config.lr`` (warmed up over ``config.warmup_epochs``), batches of
    ``config.batch_size`` reshuffled each epoch from ``config.seed``. With ``report`` the
    model is scored on the training and test sets after each epoch and one line printed;
    without, nothing is printed and only the final test accuracy is measured.
    Raises NonFiniteLossError when the loss becomes NaN or infinite."""
    model = build_model(config, dataset)
    optimizer = optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum,
                          weight_decay=config.weight_decay)
    loader = data.DataLoader(dataset.X_train, dataset.y_train, batch_size=config.batch_size, shuffle=True,
                             seed=config.seed)
    step_fn = supervised_step(model, optimizer, device=config.device,
                              lr_schedule=_warmup(optimizer, config, len(loader)))
    log = tqdm.write if config.progress else print

    def on_epoch_end(epoch, loss, seconds):
        return report_epoch(model, dataset, config, epoch, loss, seconds, log)

    history = fit(step_fn, loader, config.epochs, on_epoch_end=on_epoch_end if report else None,
                  progress=config.progress and report)
    test_accuracy = (history[-1]["test_accuracy"] if report and history
                     else accuracy(model, dataset.X_test, dataset.y_test, device=config.device))
    return TrainResult(test_accuracy, history, {"ranks": 1, "bytes_communicated": 0}, model)


@contextlib.contextmanager
def collective_deadline(seconds: float):
    """Within the block, every blocking wait of :mod:`minidist.collectives` (and so of
    ``DistributedDataParallel`` and ``inference.evaluate``) gives up after ``seconds``;
    the previous deadline is restored after it."""
    from minidist import collectives  # noqa: PLC0415

    if not hasattr(collectives, "set_timeout"):  # a collectives module without deadlines
        yield
        return
    previous = collectives.set_timeout(seconds)
    try:
        yield
    finally:
        collectives.set_timeout(previous)


def train_ddp(comm, config: TrainConfig, dataset: data.Dataset) -> TrainResult | None:
    """Synchronous data-parallel SGD over ``comm`` (e.g. ``mpi4py.MPI.COMM_WORLD``).

    Every rank builds the model from ``config.seed`` (rank 0's copy is broadcast anyway),
    reads its shard of the training set (``DistributedSampler``, reshuffled each epoch) in
    batches of ``config.batch_size`` (per rank; the global batch is that times the number
    of ranks) and averages gradients with ``DistributedDataParallel``. The learning rate is
    ``config.lr`` times the number of ranks (Goyal et al.'s linear scaling rule: the global
    batch is that many times larger, so there are that many times fewer steps per epoch)
    unless ``config.scale_lr`` is False, and ``config.warmup_epochs`` ramps it up linearly
    (``optim.WarmupLR``, stepped per batch). Every collective waits at most
    ``config.timeout`` seconds. Progress and per-epoch lines come from rank 0 only; the
    final test accuracy is computed data-parallel (``inference.evaluate``).

    Returns a TrainResult on rank 0 (figures: ranks, global_batch, lr, buckets,
    all_reduce_calls, bytes_communicated (sent by rank 0), comm_seconds, compute_seconds)
    and None on the other ranks. Raises NonFiniteLossError on a rank whose loss diverges.
    """
    from minidist.parallel.data_parallel import DistributedDataParallel  # noqa: PLC0415 (imports train)
    from minidist.parallel.inference import evaluate  # noqa: PLC0415

    with collective_deadline(config.timeout):
        rank, size = comm.Get_rank(), comm.Get_size()
        ddp = DistributedDataParallel(build_model(config, dataset), comm)
        sampler = data.DistributedSampler(len(dataset.X_train), size, rank, shuffle=True, seed=config.seed)
        loader = data.DataLoader(dataset.X_train, dataset.y_train, batch_size=config.batch_size, sampler=sampler)
        scale = True if config.scale_lr is None else config.scale_lr
        lr = optim.scale_lr(config.lr, config.batch_size * size, config.batch_size) if scale else config.lr
        optimizer = optim.SGD(ddp.parameters(), lr=lr, momentum=config.momentum, weight_decay=config.weight_decay)
        warmup = _warmup(optimizer, config, len(loader))
        progress = rank == 0 and config.progress
        log = (tqdm.write if progress else print) if rank == 0 else _quiet
        log(f"ddp: {size} ranks, per-rank batch {config.batch_size}, global batch {config.batch_size * size}, "
            f"lr {lr:g}{f', warm-up {warmup.warmup_steps} steps' if warmup else ''}, {len(ddp.buckets)} buckets")

        def report(epoch, loss, seconds):
            return report_epoch(ddp.module, dataset, config, epoch, loss, seconds, log)

        step_fn = supervised_step(ddp, optimizer, device=config.device, lr_schedule=warmup)
        history = fit(step_fn, loader, config.epochs, on_epoch_end=report if rank == 0 else None, progress=progress)
        ddp.verify_synced()
        test_accuracy = evaluate(ddp.module, dataset.X_test, dataset.y_test, comm, device=config.device)
    if rank != 0:
        return None
    stats = ddp.stats
    figures = {
        "ranks": size,
        "global_batch": config.batch_size * size,
        "lr": f"{lr:g}",
        "buckets": len(ddp.buckets),
        "all_reduce_calls": stats.all_reduce_calls,
        "bytes_communicated": stats.bytes_sent,
        "comm_seconds": f"{stats.comm_seconds:.3f}",
        "compute_seconds": f"{stats.compute_seconds:.3f}",
    }
    return TrainResult(test_accuracy, history, figures, ddp.module)


def train_ps(comm, config: TrainConfig, dataset: data.Dataset) -> TrainResult | None:
    """Parameter-server training over ``comm``: K = ``config.num_servers`` server ranks and
    the other N ranks as workers with ``config.batch_size`` each, in ``config.ps_mode``
    (``config.staleness`` bounds ssp). Every blocking wait gives up after ``config.timeout``
    seconds. The reporter (worker 0, rank K) prints the per-epoch lines.

    Learning rate: sync and ssp apply one update per clock with the average over N workers
    (global batch N x b), so ``config.scale_lr`` multiplies ``config.lr`` by N (Goyal et al.
    2017); async applies every worker's gradient as it comes (the batch of an update is b),
    so there is nothing to scale.

    Returns a TrainResult on the reporter (figures: ``parameter_server.figures``), None on
    the other ranks. Raises ValueError (naming the fix) for a world without room for the
    servers and a worker, NonFiniteLossError on a worker whose loss diverges.
    """
    from minidist.parallel import parameter_server as ps  # noqa: PLC0415

    ps.check_world(comm.Get_size(), config.num_servers, config.ps_mode, config.staleness)
    num_workers = comm.Get_size() - config.num_servers
    lr = config.lr * (num_workers if config.scale_lr and config.ps_mode != "async" else 1)
    history, log, start = [], (tqdm.write if config.progress else print), time.perf_counter()

    def on_epoch_end(epoch, loss, model):  # time: since the start, scoring included
        history.append(report_epoch(model, dataset, config, epoch, loss, time.perf_counter() - start, log))

    result = ps.train_parameter_server(
        comm, lambda: build_model(config, dataset), dataset.X_train, dataset.y_train,
        num_servers=config.num_servers, mode=config.ps_mode, staleness=config.staleness, epochs=config.epochs,
        batch_size=config.batch_size, lr=lr, momentum=config.momentum, weight_decay=config.weight_decay,
        warmup_epochs=config.warmup_epochs, seed=config.seed, on_epoch_end=on_epoch_end,
        progress=config.progress, timeout=config.timeout)
    if not isinstance(result, ps.WorkerStats) or result.model is None:
        return None
    param_bytes = ps.FlatLayout(result.model.parameters(), config.num_servers).nbytes
    return TrainResult(history[-1]["test_accuracy"], history, ps.figures(result.servers, num_workers, param_bytes),
                       result.model)
