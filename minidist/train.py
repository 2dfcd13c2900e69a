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
:class:`TrainConfig`: :func:`train_single`, :func:`train_ddp`, :func:`train_ps`,
:func:`train_pipeline`. Each
returns a :class:`TrainResult`; the command line (``minidist.cli``) parses the flags,
builds the config and prints the result (per-epoch lines, the strategy's figures, last
``final test_accuracy=0.xxxx``).
"""
from __future__ import annotations

import contextlib
import itertools
import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from minidist import backend, data, nn, optim
from minidist.functions import cross_entropy
from minidist.tensor import Tensor, no_grad

STRATEGIES = ("single", "ddp", "ps", "pipeline")
PS_MODES = ("sync", "async", "ssp")
PIPEDREAM_SCHEDULES = ("pipedream", "pipedream-2bw")  # no flush: train_pipedream
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble", *PIPEDREAM_SCHEDULES)
# The pipeline's default MLP: 8 Linear layers, so that 4 stages, or 4 ranks x 2 interleaved
# stages, each hold at least one (64-128-...-128-10 on digits).
PIPELINE_HIDDEN = (128,) * 7
# ... and its default learning rate. Measured on 4 ranks, seeds 0 and 1, 20 epochs: at 0.05 the
# deeper MLP's test accuracy swings (down to 0.87 at epoch 15, 0.96 at the end) and with --dp 2,
# whose lr doubles, it diverges; at 0.02 every schedule, and --dp 2, ends at 0.967 and 0.976.
PIPELINE_LR = 0.02
# PipeDream's default momentum. Stale gradients act like extra momentum (Mitliagkas et al.,
# "Asynchrony begets momentum", 2016): measured on digits, 4 ranks, lr 0.02, momentum 0.9 keeps
# every no-flush variant below 0.66 test accuracy after 3-4 epochs (2BW on one rank, one version
# behind, falls to 0.15), where 1F1B is at 0.93; at 0.5 stashing ends at 0.971 after 20 epochs,
# vertical sync 0.962, 2BW 0.976.
PIPEDREAM_MOMENTUM = 0.5


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
    (The command line's defaults for --strategy pipeline are PIPELINE_HIDDEN and PIPELINE_LR.)
    scale_lr: multiply lr by the number of data-parallel workers (Goyal et al. 2017);
    None means the strategy's default (on for ddp, off for ps).
    warmup_epochs (>= 0): ramp the lr up linearly over this many epochs of steps.
    ps_mode (one of PS_MODES), num_servers (>= 1), staleness (>= 0, ssp's bound): ps only.
    dataset: "digits" or "mnist" (then data_dir holds the IDX files). device: "cpu" or "cuda".
    progress: show a tqdm bar on the reporting rank. timeout: seconds every blocking wait
    of ddp, ps and pipeline may take before it raises (a dead or stuck peer).
    schedule (one of PIPELINE_SCHEDULES), microbatches (>= 1, per pipeline and step), dp
    (>= 1, pipelines side by side), stages_per_rank (>= 1, interleaved only): pipeline only.
    weight_stashing, vertical_sync: ``--schedule pipedream`` only (:func:`train_pipedream`).
    checkpoint_dir: where :class:`Checkpointer` saves the training state every
    ``checkpoint_every`` (>= 1; 0: DEFAULT_CHECKPOINT_EVERY) global steps; resume: continue from
    its newest valid checkpoint; save_model: a path for the final weights (``.npz`` of the
    state dict); stop_after_steps: stop (as if killed) after this global step, for tests.
    Single and ddp only.
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
    schedule: str = "1f1b"
    microbatches: int = 4
    dp: int = 1
    stages_per_rank: int = 2
    weight_stashing: bool = True
    vertical_sync: bool = False
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    save_model: str | None = None
    stop_after_steps: int | None = None


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


def fit(step_fn, loader, epochs: int, *, on_epoch_end=None, progress: bool = False, start: dict | None = None,
        on_step_end=None) -> list[dict]:
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
        bar = tqdm(batches, desc=f"epoch {epoch}/{epochs}", leave=False, disable=not progress, file=sys.stderr,
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


def report_epoch(model, dataset, config: TrainConfig, epoch, loss, seconds, log=print, extra: str = "") -> dict:
    """Score the model after an epoch and log the line every strategy prints (``extra``, the
    strategy's own figures, at its end); returns the history row (epoch, loss,
    train_accuracy, test_accuracy, seconds)."""
    row = {
        "epoch": epoch,
        "loss": loss,
        "train_accuracy": accuracy(model, dataset.X_train, dataset.y_train, device=config.device),
        "test_accuracy": accuracy(model, dataset.X_test, dataset.y_test, device=config.device),
        "seconds": seconds,
    }
    log(f"epoch {epoch}/{config.epochs}  loss={loss:.4f}  train_accuracy={row['train_accuracy']:.4f}  "
        f"test_accuracy={row['test_accuracy']:.4f}  time={seconds:.2f}s{extra}")
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
# Checkpoints (single and ddp): the whole training state, saved every N steps, resumed mid-epoch
# ---------------------------------------------------------------------------------------

# Steps between checkpoints when --checkpoint-every is not given. A save (two copies of the
# weights, fsync twice) took 1.5 ms on the dev machine and a digits step 0.19 ms: every 100
# steps cost 7.9 %, every 500 about 1.6 % (tests/test_fault.py::test_checkpoint_overhead_per_epoch
# prints it). Young/Daly's interval sqrt(2 * save * MTBF) is far longer for any MTBF over a
# minute; 500 steps (about 12 epochs of digits at batch 32) bounds the work a kill loses.
DEFAULT_CHECKPOINT_EVERY = 500
# The configuration a checkpoint must match to be resumed (--epochs may grow).
_RESUME_FIELDS = ("strategy", "batch_size", "lr", "momentum", "weight_decay", "hidden", "seed", "scale_lr",
                  "warmup_epochs", "dataset")


class TrainingStopped(Exception):
    """Raised by :class:`Checkpointer` after global step ``config.stop_after_steps`` (a run
    stopped on purpose, as if killed there; the tests resume from its checkpoints)."""

    def __init__(self, step: int):
        super().__init__(f"stopped after step {step} (--stop-after-steps); continue with --resume")
        self.step = step


class Checkpointer:
    """Saves and restores the whole training state of a single or ddp run (:mod:`minidist.fault`).

    The state: the model's ``state_dict``; the optimizer's (momentum buffers, lr, step count);
    the lr schedule's counters; every NumPy generator (``bit_generator.state`` of the module
    default generator of :mod:`minidist.nn` and of each layer that owns one, e.g. Dropout);
    where :func:`fit` is (epoch, batches done in it, their loss sum, global step, past epochs'
    rows); the sampler's epoch and position (samples read in the epoch); the configuration
    (:data:`_RESUME_FIELDS`) and world size, which a resumed run must match. The loaders'
    shuffles are functions of (seed, epoch), so epoch and position restore them exactly.

    Used as ``fit(..., start=ckpt.resume(), on_step_end=ckpt)``: every
    ``config.checkpoint_every`` global steps, rank 0 of ``comm`` (or the one process) writes
    ``ckpt-<step>.npz`` in ``config.checkpoint_dir`` atomically, keeping the last ``keep``.
    Raises :class:`TrainingStopped` after step ``config.stop_after_steps`` (without saving it:
    the steps since the last checkpoint are redone on resume, as after a kill).
    """

    def __init__(self, config: TrainConfig, model, optimizer, lr_schedule=None, *, comm=None, keep: int = 3,
                 log=print):
        self.config, self.model, self.optimizer, self.lr_schedule = config, model, optimizer, lr_schedule
        self.comm, self.keep, self.log = comm, keep, log
        self.rank = comm.Get_rank() if comm is not None else 0
        self.world_size = comm.Get_size() if comm is not None else 1
        self.every = config.checkpoint_every or DEFAULT_CHECKPOINT_EVERY
        self.save_seconds, self.saves = 0.0, 0

    def _generators(self) -> list:
        return [nn._default_rng] + [m.generator for m in self.model.modules()
                                    if isinstance(getattr(m, "generator", None), np.random.Generator)]

    def _fingerprint(self) -> dict:
        fields = {name: getattr(self.config, name) for name in _RESUME_FIELDS}
        fields["hidden"] = list(fields["hidden"])
        return {**fields, "world_size": self.world_size}

    def state(self, position: dict) -> dict:
        """The training state at ``position`` (what :func:`fit` hands ``on_step_end``)."""
        schedule = self.lr_schedule
        return {
            "step": position["global_step"],
            "position": {**position, "history": list(position["history"])},
            "sampler": {"epoch": position["epoch"], "position": position["step"] * self.config.batch_size},
            "model": dict(self.model.state_dict()),
            "optimizer": self.optimizer.state_dict(),
            "lr_schedule": None if schedule is None else {k: v for k, v in vars(schedule).items() if k != "optimizer"},
            "rng": [g.bit_generator.state for g in self._generators()],
            "config": self._fingerprint(),
        }

    def load(self, state: dict, path: str) -> dict:
        """Restore ``state`` (read from ``path``) into the model, optimizer, schedule and
        generators; returns the position to hand :func:`fit`. Raises fault.CheckpointError
        naming the file when it was written by a run with another configuration."""
        from minidist.fault import CheckpointError  # noqa: PLC0415

        theirs, mine = state.get("config", {}), self._fingerprint()
        differ = [f"{k}: {theirs.get(k)!r} there, {v!r} here" for k, v in mine.items() if theirs.get(k) != v]
        if differ:
            raise CheckpointError(f"checkpoint {path} was written by another run ({'; '.join(differ)}); resume with "
                                  "the same flags and number of ranks, or use another --checkpoint-dir")
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            if (state["lr_schedule"] is None) != (self.lr_schedule is None):
                raise ValueError("the lr schedule (--warmup-epochs) differs")
            for key, value in (state["lr_schedule"] or {}).items():
                setattr(self.lr_schedule, key, value)
            generators = self._generators()
            if len(generators) != len(state["rng"]):
                raise ValueError(f"{len(state['rng'])} random generators saved, {len(generators)} in the model")
            for generator, saved in zip(generators, state["rng"]):
                generator.bit_generator.state = saved
        except (KeyError, ValueError, TypeError) as error:
            raise CheckpointError(f"checkpoint {path} does not fit this run: {error}") from None
        return state["position"]

    def resume(self) -> dict | None:
        """Restore the newest valid checkpoint of ``config.checkpoint_dir`` (rank 0 picks it,
        skipping corrupt ones with a warning; every rank loads that file; the ranks agree on its
        step) and return the position for :func:`fit`; None (start from scratch, logged) when
        ``config.resume`` is off or there is no checkpoint yet. Raises fault.CheckpointError."""
        from minidist import fault  # noqa: PLC0415

        if not self.config.resume:
            return None
        found = fault.latest_valid_checkpoint(self.config.checkpoint_dir) if self.rank == 0 else None
        path, state, problem = (found[0], found[1], None) if found else (None, None, None)
        if self.comm is not None and self.world_size > 1:
            from minidist.collectives import agree  # noqa: PLC0415

            path = agree(self.comm, None, path)[0]
            if path is not None and self.rank != 0:
                try:
                    state = fault.load_checkpoint(path)
                except fault.CheckpointError as error:
                    problem = str(error)
            def raise_problem(problem, rank, size):
                raise fault.CheckpointError(f"{problem} (on rank {rank} of {size}: every rank reads rank 0's "
                                            "choice, so --checkpoint-dir must be a folder all ranks share)")

            steps = agree(self.comm, problem, None if state is None else state["step"], raise_problem=raise_problem)
            if len(set(steps)) != 1:
                raise fault.CheckpointError(f"the ranks read different steps {steps} from {path}")
        if path is None:
            self.log(f"resume: no checkpoint in {self.config.checkpoint_dir} yet, starting from scratch")
            return None
        position = self.load(state, path)
        self.log(f"resume: from {path} (step {state['step']}, epoch {position['epoch'] + 1}, "
                 f"batch {position['step']} of it)")
        return position

    def __call__(self, position: dict) -> None:
        """fit's ``on_step_end``: save every ``every`` global steps (rank 0; fault.CheckpointError
        when the file cannot be written), stop after ``config.stop_after_steps``."""
        from minidist import fault  # noqa: PLC0415

        step = position["global_step"]
        if self.config.checkpoint_dir is not None and step % self.every == 0 and self.rank == 0:
            began = time.perf_counter()
            try:
                fault.save_training_checkpoint(self.config.checkpoint_dir, step, self.state(position), keep=self.keep)
            except OSError as error:  # the previous checkpoints are intact; stop rather than train on unprotected
                raise fault.CheckpointError(f"cannot write the checkpoint of step {step} in "
                                            f"{self.config.checkpoint_dir}: {error}") from None
            self.save_seconds += time.perf_counter() - began
            self.saves += 1
        if self.config.stop_after_steps is not None and step >= self.config.stop_after_steps:
            raise TrainingStopped(step)

    def save_model(self) -> None:
        """Write the final weights to ``config.save_model`` (``.npz`` of the state dict, as
        ``evaluate --checkpoint`` reads) on rank 0; nothing without a path."""
        if self.config.save_model and self.rank == 0:
            np.savez(self.config.save_model, **{k: backend.to_numpy(v) for k, v in self.model.state_dict().items()})


# ---------------------------------------------------------------------------------------
# The strategies
# ---------------------------------------------------------------------------------------


def train_single(config: TrainConfig, dataset: data.Dataset, *, report: bool = True) -> TrainResult:
    """One process, one model: the reference every parallel strategy must match.

    SGD with ``config.lr`` (warmed up over ``config.warmup_epochs``), batches of
    ``config.batch_size`` reshuffled each epoch from ``config.seed``. With ``report`` the
    model is scored on the training and test sets after each epoch and one line printed;
    without, nothing is printed and only the final test accuracy is measured. Checkpoints,
    resume and the final weights' file: :class:`Checkpointer`. Raises NonFiniteLossError when
    the loss becomes NaN or infinite, fault.CheckpointError for a checkpoint that cannot be
    resumed, TrainingStopped after ``config.stop_after_steps``."""
    model = build_model(config, dataset)
    optimizer = optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum,
                          weight_decay=config.weight_decay)
    loader = data.DataLoader(dataset.X_train, dataset.y_train, batch_size=config.batch_size, shuffle=True,
                             seed=config.seed)
    warmup = _warmup(optimizer, config, len(loader))
    step_fn = supervised_step(model, optimizer, device=config.device, lr_schedule=warmup)
    log = tqdm.write if config.progress else print
    checkpointer = Checkpointer(config, model, optimizer, warmup, log=log if report else _quiet)

    def on_epoch_end(epoch, loss, seconds):
        return report_epoch(model, dataset, config, epoch, loss, seconds, log)

    history = fit(step_fn, loader, config.epochs, on_epoch_end=on_epoch_end if report else None,
                  progress=config.progress and report, start=checkpointer.resume(), on_step_end=checkpointer)
    checkpointer.save_model()
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
    and None on the other ranks. Checkpoints (rank 0 writes, every rank loads the same file):
    :class:`Checkpointer`, so ``config.checkpoint_dir`` must be one folder every rank sees.
    Raises NonFiniteLossError on a rank whose loss diverges, fault.CheckpointError (every rank)
    for a checkpoint that cannot be resumed, TrainingStopped after ``config.stop_after_steps``.
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
        checkpointer = Checkpointer(config, ddp.module, optimizer, warmup, comm=comm, log=log)
        history = fit(step_fn, loader, config.epochs, on_epoch_end=report if rank == 0 else None, progress=progress,
                      start=checkpointer.resume(), on_step_end=checkpointer)
        ddp.verify_synced()
        checkpointer.save_model()
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


# ---------------------------------------------------------------------------------------
# Pipeline parallelism (and data x pipeline)
# ---------------------------------------------------------------------------------------


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
    interleaved needs S x V), or more micro-batches than samples in a batch."""
    from minidist.parallel.pipeline.grid import check_grid  # noqa: PLC0415

    if config.schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"--schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, got {config.schedule!r}")
    for flag, value in (("--microbatches", config.microbatches), ("--stages-per-rank", config.stages_per_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag} must be a positive integer, got {value!r}")
    check_grid(world_size, config.dp)
    dp, pp, v = pipeline_layout(world_size, config)
    num_stages, linear = pp * v, len(config.hidden) + 1
    if num_stages > linear:
        how = (f"--schedule interleaved puts --stages-per-rank {v} stages on each of the {pp} ranks of a pipeline: "
               f"{num_stages} stages" if v > 1 else
               f"{world_size} ranks in {dp} pipeline{'s' if dp > 1 else ''} make {num_stages} stages")
        example = " ".join(["128"] * (num_stages - 1))
        raise ValueError(f"{how}, but the MLP has only {linear} Linear layers (a stage holds at least one); give "
                         f"--hidden at least {num_stages - 1} sizes (e.g. --hidden {example})"
                         + (", or fewer --stages-per-rank" if v > 1 else ", or more --dp (fewer stages per pipeline)"))
    if config.microbatches > config.batch_size:
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


def _gather_pipeline_model(grid, stage_modules) -> None:
    """Copy every stage's parameters of pipeline 0 (dp_rank 0) into the whole model held by
    its pp_rank 0: one ``collectives.gather`` over the pipeline, each rank's parameters laid
    end to end (``nn.parameters_to_vector``) and padded to the longest. The other pipelines
    hold the same parameters (their gradients were averaged) and take no part."""
    from minidist.collectives import gather  # noqa: PLC0415

    if grid.dp_rank != 0 or grid.pp_size == 1:
        return
    owned = [[p for s in range(r, len(stage_modules), grid.pp_size) for p in stage_modules[s].parameters()]
             for r in range(grid.pp_size)]
    sizes = [sum(p.size for p in params) for params in owned]
    mine = nn.parameters_to_vector(owned[grid.pp_rank])
    padded = backend.get_array_module(mine).zeros(max(sizes), dtype=mine.dtype)
    padded[:mine.size] = mine
    gathered = gather(grid.pp_comm, padded, root=0)
    if grid.pp_rank == 0:
        for r in range(1, grid.pp_size):
            nn.vector_to_parameters(gathered[r][:sizes[r]], owned[r])


def _schedule_actions(name: str, pp: int, v: int, m: int):
    from minidist.parallel.pipeline import schedules  # noqa: PLC0415

    return {"gpipe": lambda: schedules.gpipe(pp, m), "1f1b": lambda: schedules.one_f_one_b(pp, m),
            "interleaved": lambda: schedules.interleaved_1f1b(pp, m, v),
            "zero-bubble": lambda: schedules.zero_bubble(pp, m)}[name]()


def measured_bubble(busy, total) -> float:
    """The bubble of a pipeline run: 1 - compute time / step time, averaged over the ranks
    (``busy``, ``total``: seconds per rank, 1-D arrays); NaN when no step ran."""
    return float(np.mean(1.0 - busy / np.where(total > 0, total, np.nan)))


def train_pipeline(comm, config: TrainConfig, dataset: data.Dataset) -> TrainResult | None:
    """Pipeline-parallel training over ``comm`` (e.g. ``mpi4py.MPI.COMM_WORLD``, P ranks):
    ``config.dp`` = D pipelines of S = P / D ranks (a ``pipeline.grid.ProcessGrid``), each a
    chain of S x V stages (V = ``config.stages_per_rank`` for the interleaved schedule, else 1)
    run by ``config.schedule`` with ``config.microbatches`` micro-batches per step.

    Model: every rank builds the same MLP from ``config.seed`` (:func:`build_pipeline_model`,
    cheap here; a model too big for one device would be built stage by stage) and keeps its
    stages: ``pipeline.split_model(model, S x V, balance="parameters")``, the cut whose largest
    stage has the fewest parameters (the default 8-Linear MLP: 2 Linear layers per stage on 4
    stages, 1 on 8). Data: pipeline d reads its shard of the training set
    (``DistributedSampler(n, D, d)``, reshuffled each epoch, as ddp) in batches of
    ``config.batch_size``; every rank of a pipeline reads the same batches, so they agree on
    their sizes; the global batch is D x batch_size, and the lr is multiplied by D unless
    ``config.scale_lr`` is False (Goyal et al.'s rule, as ddp). An epoch's last batch is
    skipped when it has fewer samples than micro-batches (reshuffled, no sample is lost for
    good). Each step is a ``pipeline.step.PipelineStep``. With one rank and one stage this is
    plain sequential training through the same machinery; with ``microbatches=1`` it is naive
    model parallelism (one stage busy at a time).

    Each epoch's end: the bubble (1 - busy / step time from the executor's timelines, per
    rank over the epoch's steps, averaged over the ranks) and every stage's peak activation
    memory are gathered on rank 0; pipeline 0 gathers its stages' parameters into rank 0's
    whole model, which rank 0 scores on the training and test sets and logs (one line, with
    the bubble the simulator predicts for uniform stages beside the measured one). Every
    wait gives up after ``config.timeout`` seconds.

    Returns a TrainResult on rank 0 (figures: ranks, pipelines, stages, schedule,
    microbatches, global_batch, lr, bubble and simulated_bubble of the last epoch,
    peak_activation_bytes per stage, pipeline_bytes_sent by all stages) and None on the
    other ranks. Raises ValueError (naming the fix) for a layout :func:`check_pipeline`
    refuses, NonFiniteLossError on every rank when the loss diverges.
    """
    from minidist.collectives import gather  # noqa: PLC0415
    from minidist.parallel.pipeline import executor, schedules  # noqa: PLC0415
    from minidist.parallel.pipeline.grid import ProcessGrid  # noqa: PLC0415
    from minidist.parallel.pipeline.stage import split_model  # noqa: PLC0415
    from minidist.parallel.pipeline.step import PipelineStep  # noqa: PLC0415

    if config.schedule in PIPEDREAM_SCHEDULES:
        return train_pipedream(comm, config, dataset)
    world_size, rank = comm.Get_size(), comm.Get_rank()
    check_pipeline(world_size, config)
    dp, pp, v = pipeline_layout(world_size, config)
    num_stages, m, b = pp * v, config.microbatches, config.batch_size
    with collective_deadline(config.timeout):
        grid = ProcessGrid.create(comm, dp)
        model = build_pipeline_model(config, dataset)
        stage_modules = split_model(model, num_stages, balance="parameters")
        empty = [s for s, module in enumerate(stage_modules) if not list(module.parameters())]
        if empty:
            raise ValueError(f"pipeline stages {empty} of {num_stages} would hold no parameters; give --hidden more "
                             "layers or use fewer stages")
        mine = list(range(grid.pp_rank, num_stages, pp))
        stages = [executor.PipelineStage(stage_modules[s], s, num_stages, grid.pp_comm, timeout=config.timeout)
                  for s in mine]
        schedule_class = {"gpipe": executor.ScheduleGPipe, "1f1b": executor.Schedule1F1B,
                          "interleaved": executor.ScheduleInterleaved1F1B,
                          "zero-bubble": executor.ScheduleZeroBubble}[config.schedule]
        schedule = schedule_class(stages if v > 1 else stages[0], m, cross_entropy)
        scale = dp > 1 and (True if config.scale_lr is None else config.scale_lr)
        lr = optim.scale_lr(config.lr, b * dp, b) if scale else config.lr
        optimizer = optim.SGD([p for st in stages for p in st.submodule.parameters()], lr=lr,
                              momentum=config.momentum, weight_decay=config.weight_decay)
        sampler = data.DistributedSampler(len(dataset.X_train), dp, grid.dp_rank, shuffle=True, seed=config.seed)
        loader = data.DataLoader(dataset.X_train, dataset.y_train, batch_size=b, sampler=sampler,
                                 drop_last=0 < len(sampler) % b < m)
        warmup = _warmup(optimizer, config, len(loader))
        step = PipelineStep(schedule, grid, optimizer, warmup)
        simulated = schedules.simulate(_schedule_actions(config.schedule, pp, v, m), 1.0, 1.0, 1.0).bubble_fraction
        progress = rank == 0 and config.progress
        log = (tqdm.write if progress else print) if rank == 0 else _quiet
        linears = [sum(isinstance(layer, nn.Linear) for layer in stage) for stage in stage_modules]
        log(f"pipeline: {world_size} rank{'s' if world_size > 1 else ''} = {dp} pipeline{'s' if dp > 1 else ''} x "
            f"{pp} rank{'s' if pp > 1 else ''}, {num_stages} stage{'s' if num_stages > 1 else ''} "
            f"(Linear layers per stage: {','.join(map(str, linears))}), schedule {config.schedule}, {m} micro-batch"
            f"{'es' if m > 1 else ''} per batch of {b}, global batch {b * dp}, lr {lr:g}"
            + ("; one stage on one rank: plain sequential training" if num_stages == 1 else "")
            + ("; one micro-batch: naive model parallelism, one stage busy at a time" if m == 1 < num_stages else ""))
        last = {}

        def on_epoch_end(epoch, loss, seconds):  # on every rank: two gathers, then rank 0 reports
            figures = gather(comm, step.measurements(), root=0)
            step.reset_measurements()
            _gather_pipeline_model(grid, stage_modules)
            if rank != 0:
                return None
            busy, total = figures[:, 0], figures[:, 1]
            bubble = measured_bubble(busy, total)
            peaks = [int(max(figures[d * pp + s % pp, 4 + s // pp] for d in range(dp))) for s in range(num_stages)]
            last.update(bubble=bubble, peaks=peaks, sent=int(figures[:, 3].sum()))
            extra = (f"  bubble={bubble:.3f} (simulated {simulated:.3f})  "
                     f"activation_kib_per_stage={','.join(f'{p / 1024:.1f}' for p in peaks)}")
            row = report_epoch(model, dataset, config, epoch, loss, seconds, log, extra)
            row.update(bubble=bubble, peak_activation_bytes=peaks)
            return row

        history = fit(step, loader, config.epochs, on_epoch_end=on_epoch_end, progress=progress)
        grid.free()
    if rank != 0:
        return None
    figures = {
        "ranks": world_size,
        "pipelines": dp,
        "stages": num_stages,
        "schedule": config.schedule,
        "microbatches": m,
        "global_batch": b * dp,
        "lr": f"{lr:g}",
        "bubble": f"{last['bubble']:.3f}" if last else "nan",
        "simulated_bubble": f"{simulated:.3f}",
        "peak_activation_bytes": ",".join(map(str, last.get("peaks", []))),
        "pipeline_bytes_sent": last.get("sent", 0),
    }
    test_accuracy = history[-1]["test_accuracy"] if history else accuracy(model, dataset.X_test, dataset.y_test,
                                                                          device=config.device)
    return TrainResult(test_accuracy, history, figures, model)


class _EpochStreams:
    """A loader's epoch as streams: the epoch's batches (each of ``batch_size`` rows, the last
    short one dropped) concatenated into (x, y) pairs of at most ``batches`` batches each, one
    PipeDream step per pair. ``set_epoch`` passes on to the loader (reshuffling)."""

    def __init__(self, loader, batches: int):
        self.loader, self.batches = loader, batches

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

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
    NonFiniteLossError on every rank when an epoch's loss is not finite.
    """
    from minidist.collectives import broadcast, gather  # noqa: PLC0415
    from minidist.parallel.pipeline import executor, pipedream  # noqa: PLC0415
    from minidist.parallel.pipeline.grid import ProcessGrid  # noqa: PLC0415
    from minidist.parallel.pipeline.stage import split_model  # noqa: PLC0415

    world_size, rank = comm.Get_size(), comm.Get_rank()
    check_pipeline(world_size, config)
    p, b, two_bw = world_size, config.batch_size, config.schedule == "pipedream-2bw"
    per_batch = config.microbatches if two_bw else 1  # micro-batches per batch of b rows
    with collective_deadline(config.timeout):
        grid = ProcessGrid.create(comm, 1)
        model = build_pipeline_model(config, dataset)
        stage_modules = split_model(model, p, balance="parameters")
        stage = pipedream.PipeDreamStage(stage_modules[rank], rank, p, comm, timeout=config.timeout)
        optimizer = optim.SGD(list(stage.submodule.parameters()), lr=config.lr, momentum=config.momentum,
                              weight_decay=config.weight_decay)
        sampler = data.DistributedSampler(len(dataset.X_train), 1, 0, shuffle=True, seed=config.seed)
        loader = data.DataLoader(dataset.X_train, dataset.y_train, batch_size=b, sampler=sampler, drop_last=True)
        warmup = _warmup(optimizer, config, len(loader))
        most = (executor._META_TAG - 2) // (3 * p) // per_batch  # batches per stream the message tags allow
        streams = _EpochStreams(loader, most)
        schedules = {}
        clock = {"busy": 0.0, "step": 0.0}

        def schedule_for(n):  # one schedule object per stream length (the last stream may be shorter)
            if n not in schedules:
                if two_bw:
                    schedules[n] = pipedream.SchedulePipeDream2BW(stage, n, cross_entropy, optimizer,
                                                                  accumulation=per_batch, lr_schedule=warmup)
                else:
                    schedules[n] = pipedream.SchedulePipeDream(
                        stage, n, cross_entropy, optimizer, weight_stashing=config.weight_stashing,
                        vertical_sync=config.vertical_sync, lr_schedule=warmup)
            return schedules[n]

        def step_fn(x, y):  # one stream: every batch of it through the pipeline, then a flush
            schedule = schedule_for(len(x) // b * per_batch)
            losses = []
            args = (x,) if stage.is_first else ()
            kwargs = {"target": y, "losses": losses} if stage.is_last else {}
            schedule.step(*args, **kwargs)
            clock["busy"] += sum(e.end - e.start for e in schedule.timeline)
            clock["step"] += schedule.step_seconds
            loss = np.array([np.mean(losses) if stage.is_last else 0.0])
            return float(broadcast(comm, loss, root=p - 1, validate=False)[0]) if p > 1 else float(loss[0])

        log = print if rank == 0 else _quiet
        variant = config.schedule if two_bw else (
            "pipedream" + ("" if config.weight_stashing else " without weight stashing")
            + (" with vertical sync" if config.vertical_sync else ""))
        unit = f"one update per batch of {b} ({per_batch} micro-batches)" if two_bw else f"one update per batch of {b}"
        log(f"pipeline: {p} rank{'s' if p > 1 else ''}, {p} stage{'s' if p > 1 else ''}, schedule {variant}: no "
            f"flush, {unit}, lr {config.lr:g}, momentum {config.momentum:g}")
        last = {}

        def on_epoch_end(epoch, loss, seconds):
            figures = stage.stash.peak_versions, stage.stash.peak_stashed_bytes
            mine = np.array([clock["busy"], clock["step"], *figures,
                             sum(q.data.nbytes for q in stage.stash.params)], dtype=np.float64)
            clock.update(busy=0.0, step=0.0)
            gathered = gather(comm, mine, root=0) if p > 1 else mine[None, :]
            _gather_pipeline_model(grid, stage_modules)
            if rank != 0:
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

        history = fit(step_fn, streams, config.epochs, on_epoch_end=on_epoch_end, progress=False)
        grid.free()
    if rank != 0:
        return None
    figures = {
        "ranks": p, "stages": p, "schedule": config.schedule, "weight_stashing": config.weight_stashing,
        "vertical_sync": config.vertical_sync, "microbatches": per_batch, "lr": f"{config.lr:g}",
        "bubble": f"{last['bubble']:.3f}" if last else "nan",
        "versions_per_stage": ",".join(map(str, last.get("versions", []))),
        "stashed_bytes_per_stage": ",".join(map(str, last.get("stashed", []))),
        "parameter_bytes_per_stage": ",".join(map(str, last.get("params", []))),
    }
    test_accuracy = history[-1]["test_accuracy"] if history else accuracy(model, dataset.X_test, dataset.y_test,
                                                                          device=config.device)
    return TrainResult(test_accuracy, history, figures, model)
