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

The drivers of ``python -m minidist train`` (**contract**) take a :class:`TrainConfig` and
return a :class:`TrainResult`. The one-process reference, :func:`train_single`, is at the end
of this file; each parallel one lives in its wing, beside the mechanism it drives
(``minidist.parallel.data_parallel.train``, ``parameter_server.train``, ``pipeline.train`` and
``pipeline.train_pipedream``). The command line (``minidist.cli``) parses the flags, builds the
config, picks the driver from one table and prints the result (per-epoch lines, the strategy's
figures, last ``final test_accuracy=0.xxxx``). Checkpoints of the training state:
:class:`minidist.fault.Checkpointer`.

What a driver trains is a workload (:mod:`minidist.workloads`, ``config.model``): the MLP
classifier's, :class:`ClassifierWorkload`, sits here beside the helpers it uses
(:func:`build_model`, :func:`report_epoch`, ...), which the parameter server's and PipeDream's
drivers call directly (they train the MLP only); the GPT's is
``workloads.LanguageModelWorkload``, and :func:`workload_for` picks one. This file is longer
than the house's 400 lines for that reason: the loop, the configuration, the MLP's workload and
the reference driver read together.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from minidist import backend, data, nn, optim, p2p, precision, workloads
from minidist.collectives import gather_objects
from minidist.fault import Checkpointer
from minidist.functions import cross_entropy
from minidist.precision import autocast
from minidist.tensor import Tensor, no_grad

STRATEGIES = ("single", "ddp", "ps", "pipeline", "tp", "fsdp", "3d")  # tp, 3d: the GPT only
MODELS = ("mlp", "gpt")
DATASETS = ("digits", "mnist", "shakespeare")
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
# --model gpt's defaults where a flag serves both models (the MLP's are TrainConfig's): AdamW's
# peak lr and decoupled weight decay, and the batch (windows per step, per rank). With the sizes
# and steps of TrainConfig (4 blocks, 4 heads, width 64, context 64, 800 steps, 100 of warm-up)
# they are the cheapest setting tried that ends below 2.0 nats per character with room to spare,
# measured on the course's 2-core machine (one BLAS thread, about 0.12 s a step when it is not
# loaded): lr 5e-3 crosses 2.0 between steps 600 and 700 and ends at 1.944 (seed 0; in 1000-step
# runs seed 1 stays within 0.01 of seed 0); 2e-3 ends at 2.048 after 800 steps, 3e-3 at 1.921
# after 1000; width 96 (lr 3e-3) is 0.07 lower at step 400 than width 64 but takes twice as long a
# step; 1000 steps end at 1.883.
GPT_LR = 5e-3
GPT_WEIGHT_DECAY = 0.1
GPT_BATCH_SIZE = 32


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
    of ddp, ps and pipeline may take before it raises (a dead or stuck peer); by default
    ``p2p.get_timeout()``, the engine's one deadline (300 s, or ``MINIDIST_TIMEOUT``).
    schedule (one of PIPELINE_SCHEDULES), microbatches (>= 1, per pipeline and step), dp
    (>= 1, pipelines side by side), stages_per_rank (>= 1, interleaved only): pipeline only.
    weight_stashing, vertical_sync: ``--schedule pipedream`` only (:func:`train_pipedream`).
    checkpoint_dir: where :class:`Checkpointer` saves the training state every
    ``checkpoint_every`` (>= 1; 0: DEFAULT_CHECKPOINT_EVERY) global steps; resume: continue from
    its newest valid checkpoint; save_model: a path for the final weights (``.npz`` of the
    state dict); stop_after_steps: stop (as if killed) after this global step, for tests;
    kill_at_step, kill_rank: rank ``kill_rank`` SIGKILLs itself at the end of global step
    ``kill_at_step``, once per checkpoint folder (``Checkpointer.after_step``), for tests.
    Every strategy but ps async/ssp and the PipeDream schedules.
    precision: "fp32", "fp16" or "bf16" (:mod:`minidist.precision`: autocast around forward and
    loss, float32 master weights); loss_scale: "dynamic", "none", a number > 0 (static) or None,
    the precision's default (dynamic for fp16, none for bf16 and fp32). Single, ddp, pipeline.
    replay_step: rerun the run from ``checkpoint_dir``'s checkpoint before this global step up to
    it, report it and stop (:func:`minidist.replay.replay`). Single and ddp.
    comm_hook (one of ``comm_hooks.COMM_HOOKS``: none, fp16, bf16, int8, topk) and topk_ratio (in
    (0, 1], topk only): what each DDP bucket sends (``minidist.parallel.data_parallel.comm_hooks``); ddp only.
    all_reduce: DDP's all-reduce algorithm (``ddp.DDP_ALGORITHMS``: auto, ring, recursive_doubling, tree, naive,
    hierarchical, torus, the last two over ``minidist.node_layout``'s nodes); ddp without zero, int8 or topk only.
    model: "mlp" (the classifier above) or "gpt" (``minidist.models.gpt``, a character-level language model on
    ``dataset="shakespeare"``; ``minidist.workloads``). Its fields: steps (>= 1) optimizer steps, evaluated
    every ``eval_every`` (>= 1) steps; for gpt ``epochs`` is derived, ceil(steps / eval_every) evaluation
    intervals, each one ``fit`` epoch. n_layer, n_head, n_embd (divisible by n_head), block_size (the context
    T), dropout (in [0, 1)): the GPTConfig. warmup_steps (>= 0): AdamW's lr rises linearly over them, then
    follows a cosine to a tenth of ``lr`` at the last step. grad_clip (>= 0; 0: none): the bound of the
    global gradient norm (``nn.utils.clip_grad_norm_``). lr, weight_decay and batch_size serve both models
    (the command line's gpt defaults are GPT_LR, GPT_WEIGHT_DECAY, GPT_BATCH_SIZE); the other MLP fields
    (epochs, momentum, hidden, warmup_epochs) do not apply to gpt, nor the gpt fields to mlp.
    sequence_parallel: with strategy "tp" or "3d" (tensor parallelism, gpt only), also cut the
    activations between the split layers by positions (``minidist.parallel.tensor_parallel``).
    tp: with strategy "3d" (``minidist.parallel.three_d``), the tensor-parallel ranks of each stage;
    with ``dp`` the pipelines side by side, the pipeline has world_size / (dp x tp) ranks.
    zero: with strategy "ddp", shard the optimizer's state over the ranks (ZeRO-1,
    ``minidist.parallel.zero``). sharding_strategy: with strategy "fsdp" (``minidist.parallel.fsdp``),
    "FULL_SHARD" (ZeRO-3), "SHARD_GRAD_OP" (ZeRO-2) or "NO_SHARD".
    global_batch_size: None, or G (>= 1) samples per step whatever the number of ranks M (single,
    ddp, ddp --zero, fsdp): each rank reads its part of G (``per_rank_config``: G / M, or, when
    M does not divide G, parts off by one whose gradients are weighted by their rows,
    ``loss_weight``), the epoch is ``data.GlobalBatchSampler``'s, the lr is ``lr`` for G on any M (no linear scaling),
    and a checkpoint resumes on another number of ranks (``fault.is_elastic``).
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
    timeout: float = field(default_factory=p2p.get_timeout)  # 300 s, or MINIDIST_TIMEOUT
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
    replay_step: int | None = None
    kill_at_step: int | None = None
    kill_rank: int = 0
    precision: str = "fp32"
    loss_scale: str | float | None = None
    comm_hook: str = "none"
    topk_ratio: float = 0.01
    all_reduce: str = "auto"
    model: str = "mlp"
    steps: int = 800
    eval_every: int = 100
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 64
    dropout: float = 0.0
    warmup_steps: int = 100
    grad_clip: float = 1.0
    sequence_parallel: bool = False
    tp: int = 1
    zero: bool = False
    sharding_strategy: str = "FULL_SHARD"
    global_batch_size: int | None = None

    def __post_init__(self):
        if self.model == "gpt" and self.eval_every >= 1:  # one fit epoch per evaluation interval
            self.epochs = math.ceil(self.steps / self.eval_every)


# TrainConfig fields that do not change what a run computes, so the ranks of one job may differ
# in them: how it shows progress, how long a wait may take, and paths that name the same files
# from different nodes (checkpoint_dir counts by whether it is given).
NOT_RUN_FIELDS = ("progress", "timeout", "save_model", "data_dir", "checkpoint_dir")


def run_fields(config: TrainConfig) -> dict:
    """The fields of ``config`` that shape the run (every TrainConfig field but
    :data:`NOT_RUN_FIELDS`, plus ``checkpointing``: whether ``checkpoint_dir`` is given), by
    name, in the dataclass's order. Every rank of a job must have the same ones: the command
    line compares them at start-up (:func:`run_digest`)."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in NOT_RUN_FIELDS}
    fields["checkpointing"] = config.checkpoint_dir is not None
    return fields


def run_digest(config: TrainConfig) -> str:
    """One hash of :func:`run_fields` (SHA-256 of their ``repr``, 16 hex digits): equal on two
    ranks exactly when their configurations shape the same run."""
    return hashlib.sha256(repr(sorted(run_fields(config).items())).encode()).hexdigest()[:16]


@dataclass
class TrainResult:
    """What a strategy reports: the final test accuracy (fraction in [0, 1]; NaN for gpt), the
    per-epoch history (dicts with epoch, loss, train_accuracy, test_accuracy, seconds; for gpt
    per evaluation: step, loss, train_loss, val_loss, seconds, ms_per_step, tokens_per_second),
    strategy-specific figures (e.g. bytes sent, printed before the last line), the trained
    model, and for gpt the final validation loss (nats per character) and a generated sample."""

    test_accuracy: float
    history: list = field(default_factory=list)
    figures: dict = field(default_factory=dict)
    model: object = None
    val_loss: float | None = None
    sample: str | None = None


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


def load_dataset(config: TrainConfig):
    """The dataset named by ``config.dataset``: a ``data.Dataset`` (``digits``, split by
    ``config.seed``, or ``mnist`` from ``config.data_dir``) or, for ``shakespeare``, a
    ``workloads.TextDataset`` (the plays tokenized by character, split 90/10). Raises
    FileNotFoundError or ValueError for missing or malformed MNIST files, ModuleNotFoundError
    (naming the install command) when the plays' package is missing."""
    if config.dataset == "mnist":
        return data.load_mnist(config.data_dir)
    if config.dataset == "shakespeare":
        return workloads.load_text()
    return data.load_digits(seed=config.seed)


def build_model(config: TrainConfig, dataset: data.Dataset) -> nn.Sequential:
    """An MLP features -> hidden... -> classes, initialised from ``config.seed``."""
    sizes = [dataset.num_features, *config.hidden, dataset.num_classes]
    return nn.mlp(sizes, rng=config.seed, device=config.device)


def warmup_schedule(optimizer, config: TrainConfig, steps_per_epoch: int) -> optim.WarmupLR | None:
    """The lr warm-up over ``config.warmup_epochs`` epochs of ``steps_per_epoch`` steps
    (:class:`minidist.optim.WarmupLR`, Goyal et al. 2017), or None when there is none."""
    if config.warmup_epochs <= 0:
        return None
    return optim.WarmupLR(optimizer, max(1, round(config.warmup_epochs * steps_per_epoch)))


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


# ---------------------------------------------------------------------------------------
# Workloads: what the drivers train (minidist.workloads explains; the MLP's is here, beside its helpers)
# ---------------------------------------------------------------------------------------


class ClassifierWorkload:
    """``--model mlp``: the MLP of :func:`build_model` trained with SGD on digits or MNIST
    (:class:`data.Dataset`), scored by accuracy after each epoch; the other workload is
    ``workloads.LanguageModelWorkload`` and :mod:`minidist.workloads` lists what each part is."""

    name = "mlp"
    grad_clip = None
    scale_lr_by_default = True  # ddp and --dp: SGD's lr x the data-parallel ranks (Goyal et al. 2017)

    def __init__(self, config: TrainConfig, dataset: data.Dataset):
        self.config, self.dataset, self.epochs = config, dataset, config.epochs

    def model(self) -> nn.Sequential:
        return build_model(self.config, self.dataset)

    def loader(self, rank: int | None = None, world_size: int | None = None, min_batch: int = 1) -> data.DataLoader:
        """The training set reshuffled each epoch from ``config.seed``: whole (``rank`` None) or
        this rank's shard of ``world_size`` (``data.DistributedSampler``), in batches of
        ``config.batch_size``; an epoch's last batch is dropped when it has fewer than
        ``min_batch`` samples (a pipeline's micro-batches). With ``config.global_batch_size`` G:
        ``data.GlobalBatchSampler``'s steps of G, this rank's G / world_size of each."""
        c, d = self.config, self.dataset
        if c.global_batch_size is not None:  # the same global steps on any number of ranks
            sampler = data.GlobalBatchSampler(len(d.X_train), c.global_batch_size, world_size or 1, rank or 0,
                                              seed=c.seed)
            return data.DataLoader(d.X_train, d.y_train, batch_size=sampler.batch_size, sampler=sampler)
        if rank is None:
            return data.DataLoader(d.X_train, d.y_train, batch_size=c.batch_size, shuffle=True, seed=c.seed)
        sampler = data.DistributedSampler(len(d.X_train), world_size, rank, shuffle=True, seed=c.seed)
        return data.DataLoader(d.X_train, d.y_train, batch_size=c.batch_size, sampler=sampler,
                               drop_last=0 < len(sampler) % c.batch_size < min_batch)

    def optimizer(self, params, lr: float) -> optim.SGD:
        return optim.SGD(params, lr=lr, momentum=self.config.momentum, weight_decay=self.config.weight_decay)

    def lr_schedule(self, optimizer, steps_per_epoch: int) -> optim.WarmupLR | None:
        return warmup_schedule(optimizer, self.config, steps_per_epoch)

    def forward(self, model, x):
        return model(Tensor(x, device=self.config.device))

    def loss(self, logits, y):
        return cross_entropy(logits, backend.to_device(y, self.config.device))

    def checkpoint_state(self, loader) -> dict:
        return {}  # the loader's position is fit's (epoch, step), its shuffle a function of (seed, epoch)

    def metadata(self) -> None:
        return None

    def begin(self, position):
        return position

    bar_label = None  # fit's default, "epoch 3/20"

    def report(self, model, epoch, loss, seconds, log, extra: str = "", world_size: int = 1) -> dict:
        return report_epoch(model, self.dataset, self.config, epoch, loss, seconds, log, extra)

    def final(self, model, history: list) -> dict:
        """``{"test_accuracy"}``: the last epoch's, or scored now when no epoch was reported."""
        accuracy_ = history[-1].get("test_accuracy") if history else None
        if accuracy_ is None:
            accuracy_ = accuracy(model, self.dataset.X_test, self.dataset.y_test, device=self.config.device)
        return {"test_accuracy": accuracy_}


def data_parallel_lr(work, config: TrainConfig, replicas: int) -> float:
    """The learning rate of ``replicas`` data-parallel copies that each read ``config.batch_size``
    samples (the global batch ``replicas`` times larger): ``config.lr`` multiplied by
    ``replicas`` (Goyal et al. 2017's linear scaling rule, ``optim.scale_lr``) when
    ``config.scale_lr`` says so, or, when it is None, when the workload scales by default (the
    MLP's SGD does, the GPT's AdamW does not: ``work.scale_lr_by_default``); ``config.lr`` for
    one replica. The one rule of ddp, ddp --zero, fsdp, and the pipelines' --dp (2-D and 3-D).
    With ``config.global_batch_size`` the global batch does not grow with the replicas, so the
    lr is ``config.lr`` (the lr of that batch) on any number of them."""
    if config.global_batch_size is not None:
        return config.lr
    scale = replicas > 1 and (work.scale_lr_by_default if config.scale_lr is None else config.scale_lr)
    return optim.scale_lr(config.lr, config.batch_size * replicas, config.batch_size) if scale else config.lr


def check_global_batch(config: TrainConfig, world_size: int, dataset=None) -> None:
    """Raise ValueError, naming the fix, when ``config.global_batch_size`` cannot be split over
    ``world_size`` ranks (fewer samples than ranks: ``data.split_global_batch``) or, given the
    MLP's ``dataset`` (a ``data.Dataset``), exceeds its training samples; nothing without a
    global batch. A world size that does not divide G is fine: the parts differ by one row."""
    g = config.global_batch_size
    samples = len(getattr(dataset, "X_train", ()))
    if g is not None and dataset is not None and hasattr(dataset, "X_train") and g > samples:
        raise ValueError(f"--global-batch-size {g} is larger than the {samples} training samples of --dataset "
                         f"{config.dataset}; use at most {samples}")
    if g is not None and world_size > g:
        raise ValueError(f"--global-batch-size {g} cannot be split over {world_size} ranks (a rank would read no "
                         f"sample); use --global-batch-size {world_size} or more, or at most {g} ranks")


def per_rank_config(config: TrainConfig, world_size: int, rank: int = 0) -> TrainConfig:
    """``config`` as rank ``rank`` of ``world_size`` runs it: with ``config.global_batch_size``
    G, ``batch_size`` becomes this rank's part of G (``data.split_global_batch``: G / world_size,
    or one row more or less when world_size does not divide G), what the loaders read;
    ``config`` itself without G. Raises ValueError (:func:`check_global_batch`) for more ranks
    than G."""
    if config.global_batch_size is None:
        return config
    check_global_batch(config, world_size)
    offsets = data.split_global_batch(config.global_batch_size, world_size)
    return dataclasses.replace(config, batch_size=int(offsets[rank + 1] - offsets[rank]))


def global_batch(config: TrainConfig, world_size: int) -> int:
    """The samples of one step over ``world_size`` data-parallel ranks: ``config.global_batch_size``
    when given, else ``config.batch_size`` (per rank) times the ranks."""
    return config.global_batch_size or config.batch_size * world_size


def batch_description(config: TrainConfig, world_size: int) -> str:
    """The run's batch as its first log line says it: "per-rank batch 8, global batch 32", or,
    when ``world_size`` does not divide ``config.global_batch_size``, "per-rank batch 6 or 5,
    global batch 16" (the parts of ``data.split_global_batch``)."""
    g = global_batch(config, world_size)
    if g % world_size:
        return f"per-rank batch {-(-g // world_size)} or {g // world_size}, global batch {g}"
    return f"per-rank batch {g // world_size}, global batch {g}"


def loss_weight(config: TrainConfig, world_size: int, rank: int) -> float:
    """The factor on rank ``rank``'s mean loss that makes the ranks' averaged gradient the mean
    over the global batch: ``rows * world_size / G`` for a part of ``rows`` rows of
    ``config.global_batch_size`` G (``data.split_global_batch``), since the average of the ranks'
    means weights each rank alike, and a rank with 6 rows of 16 must count 6/16 of it, not 1/3.
    1.0 (exactly) when the parts are equal or there is no G. The drivers pass it to
    :func:`supervised_step` / :func:`sharded_step` (``loss_weight=``)."""
    g = config.global_batch_size
    if g is None or g % world_size == 0:
        return 1.0
    offsets = data.split_global_batch(g, world_size)
    return float(offsets[rank + 1] - offsets[rank]) * world_size / g


def workload_for(config: TrainConfig, dataset):
    """The workload of ``config.model``: :class:`ClassifierWorkload` ("mlp") or
    ``workloads.LanguageModelWorkload`` ("gpt") over ``dataset`` (what :func:`load_dataset`
    returns for the config). Raises ValueError for another model."""
    if config.model == "gpt":
        return workloads.LanguageModelWorkload(config, dataset)
    if config.model == "mlp":
        return ClassifierWorkload(config, dataset)
    raise ValueError(f"model must be one of {', '.join(MODELS)}, got {config.model!r}")


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


# ---------------------------------------------------------------------------------------
# The one-process driver: the reference every parallel strategy must match
# ---------------------------------------------------------------------------------------


def train_single(config: TrainConfig, dataset, *, report: bool = True,
                 checkpointer_class=Checkpointer) -> TrainResult:
    """``train --strategy single``: one process, one model, the reference every parallel
    strategy must match, for either workload (:func:`workload_for`: ``config.model``).

    The MLP: SGD with ``config.lr`` (warmed up over ``config.warmup_epochs``), batches of
    ``config.batch_size`` reshuffled each epoch from ``config.seed``; with ``report`` the model
    is scored on the training and test sets after each epoch and one line printed. The GPT:
    AdamW, warm-up and cosine, ``config.steps`` steps of random windows, train and val loss
    every ``config.eval_every`` steps, a generated sample at the end. Without ``report``
    nothing is printed and only the final figure (test accuracy, val loss) is measured.
    Checkpoints, resume and the final weights' file: :class:`Checkpointer` (or
    ``checkpointer_class``, a subclass: ``minidist.replay`` passes its own). Raises
    NonFiniteLossError when the loss becomes NaN or infinite, checkpoint_io.CheckpointError for
    a checkpoint that cannot be resumed, TrainingStopped after ``config.stop_after_steps``."""
    config = per_rank_config(config, 1)
    work = workload_for(config, dataset)
    model = work.model()
    optimizer = work.optimizer(model.parameters(), config.lr)
    loader = work.loader()
    schedule = work.lr_schedule(optimizer, len(loader))
    scaler = precision.grad_scaler_for(config.precision, config.loss_scale)
    step_fn = workload_step(work, model, optimizer, schedule, scaler)
    log = rank_logger(True, config.progress)
    checkpointer = checkpointer_class(config, model, optimizer, schedule, log=log if report else silent,
                                      extra=checkpoint_parts(work, loader, scaler), metadata=work.metadata())

    def on_epoch_end(epoch, loss, seconds):
        return work.report(model, epoch, loss, seconds, log, extra=scaler.describe())

    history = fit(step_fn, loader, work.epochs, on_epoch_end=on_epoch_end if report else None,
                  progress=config.progress and report, start=work.begin(checkpointer.resume()),
                  on_step_end=checkpointer, bar_label=work.bar_label)
    checkpointer.save_model()
    figures = {"ranks": 1, "bytes_communicated": 0, **precision.figures(config.precision, scaler)}
    return TrainResult(**work.final(model, history), history=history, figures=figures, model=model)
