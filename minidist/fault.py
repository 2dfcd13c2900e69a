"""Training checkpoints: the whole training state of a run, saved every N steps and resumed
(:class:`Checkpointer`); the files themselves (atomic save, checksum, newest valid one, the
folder's lock) are :mod:`minidist.checkpoint_io`'s.

A run that dies (a killed rank, a lost node) loses everything since its last checkpoint, so a
checkpoint must hold the *whole* training state (model weights, the optimizer's momentum
buffers, the learning-rate schedule, every random generator, the sampler's epoch and position
within it, the global step, a comm hook's error-feedback residuals): resuming from it must then
give weights bit-identical to a run that was never stopped (Keras' ``BackupAndRestore``,
PyTorch's "saving and loading a general checkpoint" recipe). A job whose ranks hold different
parts of the state (parameter servers, pipeline stages) gathers them into one file
(:class:`Checkpointer`, ``gathered=True``).

Longer than 400 lines: the Checkpointer is one class because saving and resuming are one contract
(what is saved is what is checked and restored, replicated or gathered, resharded or not); its rules
of resume sit above it.
"""
from __future__ import annotations

import math
import os
import signal
import time

import numpy as np

from minidist import data, nn, optim, strategy
from minidist.checkpoint_io import (
    CheckpointError,
    CheckpointLock,
    CheckpointMismatchError,
    latest_valid_checkpoint,
    load_checkpoint,
    save_training_checkpoint,
    save_weights,
    unwritable,
)
from minidist.collectives import gather_objects, scatter_objects
from minidist.p2p import agree
from minidist.precision import default_loss_scale
from minidist.resharding import ReshardError, reshard_parts, shard_metadata

# ---------------------------------------------------------------------------------------
# Checkpoints of a run: the whole training state, saved every N steps, resumed mid-epoch
# ---------------------------------------------------------------------------------------

# Steps between checkpoints when --checkpoint-every is not given. A save (two copies of the
# weights, fsync twice) took 1.5 ms on the dev machine and a digits step 0.19 ms: every 100
# steps cost 7.9 %, every 500 about 1.6 % (tests/test_py::test_checkpoint_overhead_per_epoch
# prints it). Young/Daly's interval sqrt(2 * save * MTBF) is far longer for any MTBF over a
# minute; 500 steps (about 12 epochs of digits at batch 32) bounds the work a kill loses.
# Under mpiexec -n 2 on the shared 2-core dev machine (tests/test_fault_mpi.py prints it), in
# two runs, busy then quieter: ddp 22.6 / 1.6 ms a save (79 KiB) against 1.8 / 0.45 ms a step,
# 2.5 % / 0.7 %; a 1F1B pipeline of the default 8-Linear MLP 52.6 / 6.1 ms a save (862 KiB, the
# gather to rank 0 included) against 14.5 / 1.9 ms a step, 0.7 % / 0.6 %.
DEFAULT_CHECKPOINT_EVERY = 500
# The configuration a checkpoint must match to be resumed: every flag that changes what a step
# computes (Checkpointer's docstring gives the rule), plus the world size.
_RESUME_FIELDS = ("strategy", "batch_size", "lr", "momentum", "weight_decay", "hidden", "seed", "scale_lr",
                  "warmup_epochs", "dataset", "ps_mode", "num_servers", "schedule", "microbatches", "dp",
                  "stages_per_rank", "precision", "loss_scale", "comm_hook", "topk_ratio", "model", "zero",
                  "sharding_strategy", "tp", "sequence_parallel", "global_batch_size")
# ... plus, for --model gpt, its own fields (steps too: the cosine schedule ends at the last step).
_GPT_RESUME_FIELDS = ("steps", "eval_every", "n_layer", "n_head", "n_embd", "block_size", "dropout",
                      "warmup_steps", "grad_clip")
# A field added after checkpoints were written: the value those checkpoints stand for.
_FIELDS_BEFORE = {"model": "mlp", "zero": False, "sharding_strategy": "FULL_SHARD", "tp": 1, "sequence_parallel": False,
                  "global_batch_size": None}
# ... and the fields that may change on resume, each change logged in one line.
_NOTED_FIELDS = {"epochs": "the run continues to the new last epoch",
                 "device": "the matrix products run on another device, so the weights may differ from an "
                           "uninterrupted run's in the last bits",
                 "all_reduce": "the gradients are summed in another order, so the weights may differ from an "
                               "uninterrupted run's in the last bits"}
# The line of a resume on another number of ranks (compare_runs); the other layout fields a
# strategy's elastic resume may change, and their lines, are its record's (``Strategy.layout_notes``).
_ELASTIC_NOTE = ("the state is resharded for this number of ranks and the data goes on from the same global sample "
                 "(the global batch is --global-batch-size on any number of ranks)")
KILL_MARKER = ".killed-at-{step}"  # in the checkpoint folder: --kill-at-step fired once there


class TrainingStopped(Exception):
    """Raised by :class:`Checkpointer` after global step ``config.stop_after_steps`` (a run
    stopped on purpose, as if killed there; the tests resume from its checkpoints)."""

    def __init__(self, step: int):
        super().__init__(f"stopped after step {step} (--stop-after-steps); continue with --resume")
        self.step = step


def is_elastic(config) -> bool:
    """Whether a run of ``config`` may resume a checkpoint written on another number of ranks
    (and on another layout, the record's ``layout_notes``): ``--global-batch-size`` given and
    the strategy that trains it says so (``minidist.strategy.is_elastic``: ddp, ddp --zero,
    fsdp, tp, pipeline, 3d without --zero, as the wings declare)."""
    return strategy.is_elastic(config)


def compare_runs(theirs, mine: dict, path: str, elastic: bool = False) -> list[str]:
    """Compare the configuration saved in checkpoint ``path`` (``theirs``, a dict) with this
    run's (``mine``, :meth:`Checkpointer.fingerprint`). Raises CheckpointMismatchError naming
    every field of :data:`_RESUME_FIELDS` or the world size that differs (its value there and
    here; when only the layout differs (world size, or a field of some strategy's
    ``layout_notes``), the strategies that resume on another one, ``strategy.layout_hint``; the
    strategy of this run's own hint for a checkpoint of the other, ``Strategy.resume_hints``:
    a tp checkpoint resumed by single); returns one line per noted field (:data:`_NOTED_FIELDS`:
    epochs, device, all_reduce; and, when ``elastic`` (:func:`is_elastic`), the world size and
    the layout fields of this run's strategy, when the checkpoint is of the same strategy) that
    changed, saying what changed and what it means."""
    theirs = theirs if isinstance(theirs, dict) else {}
    theirs = {**{k: v for k, v in _FIELDS_BEFORE.items() if theirs}, **theirs}
    record = _record_of(mine)
    layout = {"world_size": _ELASTIC_NOTE}
    if record is not None and theirs.get("strategy") == mine.get("strategy"):
        layout.update(record.layout_notes)
    noted = {**_NOTED_FIELDS, **(layout if elastic else {})}
    if "data" in theirs and "data" in mine and theirs["data"] != mine["data"]:
        raise CheckpointMismatchError(
            f"checkpoint {path}: the training data differ from the checkpoint's: --data-dir {mine.get('data_dir')} "
            f"holds other images or labels than the run was trained on (fingerprint {theirs['data']} there, "
            f"{mine['data']} here); resume with the run's own data, or use another --checkpoint-dir")
    differ = [k for k, v in mine.items() if k not in noted and k not in ("data", "data_dir") and theirs.get(k) != v]
    if differ:
        hint = ""
        if set(differ) <= {"world_size", *strategy.layout_fields()}:
            hint = strategy.layout_hint()
        elif record is not None:
            hint = record.resume_hints.get(theirs.get("strategy"), "")
        differ = [f"{k}: {theirs.get(k)!r} there, {mine[k]!r} here" for k in differ]
        raise CheckpointMismatchError(
            f"checkpoint {path} was written by another run ({'; '.join(differ)}); resume with the same flags and "
            f"number of ranks{hint}, or use another --checkpoint-dir")
    return [f"resume: {k} {theirs[k]!r} in the checkpoint, {mine[k]!r} now: {noted[k]}"
            for k in noted if k in theirs and k in mine and theirs[k] != mine[k]]


def _record_of(fields: dict):
    """The registered record of the strategy named in ``fields`` (a fingerprint), or None."""
    try:
        return strategy.get(fields.get("strategy"))
    except ValueError:
        return None


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_position(position, step, epochs: int, path: str) -> None:
    """Check the position :func:`~minidist.train.fit` would resume from (epoch, step, loss_total,
    global_step, history; module docstring of :mod:`minidist.train`) against the checkpoint's
    global ``step`` and this run's ``epochs``. Raises CheckpointError naming the field (a
    missing one, a count that is not an integer >= 0, a non-finite loss sum, a global step
    other than the checkpoint's, past epochs' rows that do not match the epoch), and
    CheckpointMismatchError when the checkpoint lies past the last of ``epochs`` epochs."""
    if not isinstance(position, dict):
        raise CheckpointError(f"checkpoint {path}: position is {type(position).__name__}, not a dict")
    missing = [k for k in ("epoch", "step", "loss_total", "global_step", "history") if k not in position]
    if missing:
        raise CheckpointError(f"checkpoint {path}: position lacks {', '.join(missing)}")
    for key in ("epoch", "step", "global_step"):
        if not _is_count(position[key]):
            raise CheckpointError(f"checkpoint {path}: position.{key} must be an integer >= 0, got "
                                  f"{position[key]!r}")
    if position["global_step"] != step:
        raise CheckpointError(f"checkpoint {path}: position.global_step {position['global_step']} is not the "
                              f"checkpoint's step {step}")
    total = position["loss_total"]
    if isinstance(total, bool) or not isinstance(total, (int, float)) or not math.isfinite(total):
        raise CheckpointError(f"checkpoint {path}: position.loss_total must be a finite number, got {total!r}")
    if not isinstance(position["history"], list) or len(position["history"]) != position["epoch"]:
        raise CheckpointError(f"checkpoint {path}: position.history must list the {position['epoch']} epochs "
                              "before the one in progress")
    if position["epoch"] + 1 > epochs:
        raise CheckpointMismatchError(
            f"checkpoint {path} (step {step}) lies in epoch {position['epoch'] + 1}, past the end of this run "
            f"(epochs: {epochs}); give --epochs {position['epoch'] + 1} or more to continue it, or use another "
            "--checkpoint-dir")


# An optimizer's state_dict: its keys, and those holding one array (or None) per parameter.
_OPTIMIZER_STATE = {"SGD": (("lr", "momentum", "weight_decay", "nesterov", "steps", "velocity"), ("velocity",)),
                    "Adam": (("lr", "betas", "eps", "weight_decay", "steps", "step", "exp_avg", "exp_avg_sq"),
                             ("exp_avg", "exp_avg_sq"))}


def check_optimizer_state(saved, params, path: str, kind: str = "SGD") -> None:
    """Check the ``state_dict`` (``saved``) of an optimizer of ``kind`` ("SGD", or "Adam" for
    Adam and AdamW) against the parameters it will drive: the hyperparameter keys present, one
    buffer (SGD's momentum, Adam's two moments: None or an array of the parameter's shape) per
    parameter. Raises CheckpointError naming the field."""
    if not isinstance(saved, dict):
        raise CheckpointError(f"checkpoint {path}: optimizer is {type(saved).__name__}, not a dict")
    keys, per_parameter = _OPTIMIZER_STATE[kind]
    missing = [k for k in keys if k not in saved]
    if missing:
        raise CheckpointError(f"checkpoint {path}: optimizer lacks {', '.join(missing)}")
    for key in per_parameter:
        buffers = saved[key]
        if not isinstance(buffers, list) or len(buffers) != len(params):
            count = len(buffers) if isinstance(buffers, list) else type(buffers).__name__
            raise CheckpointError(f"checkpoint {path}: optimizer.{key} holds {count} buffers for {len(params)} "
                                  "parameters")
        for i, (buffer, param) in enumerate(zip(buffers, params)):
            if buffer is not None and tuple(getattr(buffer, "shape", ())) != tuple(param.shape):
                raise CheckpointError(f"checkpoint {path}: optimizer.{key}[{i}] has shape "
                                      f"{tuple(getattr(buffer, 'shape', ()))}, its parameter {tuple(param.shape)}")


def _reraise(problem, _rank, _size):
    raise type(problem)(str(problem))  # a fresh exception on each rank (sim ranks share objects)


class Checkpointer:
    """Saves and restores the whole training state of a run (:mod:`minidist.fault`).

    The state of a rank: the model's ``state_dict`` (unless ``weights=False``); the
    optimizer's (momentum buffers, lr, step count); the lr schedule's counters; every NumPy
    generator (``bit_generator.state`` of the module default generator of :mod:`minidist.nn`
    and of each layer that owns one, e.g. Dropout); where :func:`fit` is (epoch, batches done
    in it, their loss sum, global step, past epochs' rows); the sampler's epoch and position
    (samples read in the epoch); ``extra`` objects' ``state_dict()`` (e.g. ``{"scaler":
    grad_scaler}``; each needs ``state_dict`` and ``load_state_dict``); ``per_rank`` objects'
    (state that differs from rank to rank in the replicated layout, e.g. ``{"comm_hook":
    error_feedback_state}``, whose residuals are each rank's own); the configuration
    (:meth:`fingerprint`), which a resumed run must match. The loaders' shuffles are functions
    of (seed, epoch), so epoch and position restore them exactly.

    Resume never silently changes the run. The rule, per field of the configuration:

    - what a step computes must match: strategy, batch_size, lr, momentum, weight_decay,
      hidden, seed, scale_lr, warmup_epochs, dataset, ps_mode, num_servers, schedule,
      microbatches, dp, stages_per_rank, precision, loss_scale (the default resolved: None
      and "dynamic" are one for fp16; a static scale's value too: the scaler's saved scale
      would silently override a new one), comm_hook, topk_ratio (its residuals were built
      for that ratio), zero and sharding_strategy (how the optimizer state and the
      parameters are split: a part saved for one layout fits no other), and the world size.
      A difference raises CheckpointMismatchError naming each field with its value there and
      here;
    - epochs may change (a run continued for longer), and device (the same run on a GPU):
      accepted, with one logged line saying what changed. An --epochs that ends before the
      checkpoint's epoch is a CheckpointMismatchError (no stale "final" accuracy);
    - the rest (timeout, progress, checkpoint_every, save_model, ...) does not change what is
      trained and is not compared.

    The same check guards a run that starts *without* ``config.resume`` into a folder that
    already holds checkpoints: another run's are refused before training; this run's are named
    in one line (they are replaced as the run goes). Only one run writes a folder at a time:
    rank 0 takes the folder's :class:`~minidist.checkpoint_io.CheckpointLock` before the first
    step and releases it in :meth:`save_model` / :meth:`close` (or at exit).

    Two layouts of a job's state (both one file per checkpoint, written by rank 0):

    - replicated (single, ddp; ``gathered=False``): every rank holds the same state; rank 0
      writes its own (plus every rank's ``per_rank`` states, gathered), every rank loads that
      file (so the folder must be shared).
    - gathered (ps, pipeline; ``gathered=True``): each rank holds a different part (a
      server's shard, a pipeline stage). Every rank's :meth:`state` is gathered to rank 0
      (:func:`minidist.collectives.gather_objects`), which writes ``{"step", "config",
      "ranks": [part of rank 0, ...]}``; on resume rank 0 reads it and sends each rank its part
      (:func:`minidist.collectives.scatter_objects`), so only rank 0 touches the folder. One
      file per checkpoint makes it atomic for the whole job. Large systems cannot funnel every
      byte through one rank: they write one shard per rank plus a commit marker once all are
      durable (``torch.distributed.checkpoint``; Mohan et al., "CheckFreq", FAST 2021).

    Used as ``fit(..., start=ckpt.resume(), on_step_end=ckpt)``: every
    ``config.checkpoint_every`` global steps a checkpoint ``ckpt-<step>.npz`` is written in
    ``config.checkpoint_dir`` atomically, keeping the last ``keep``. A rank that is not in
    fit (a parameter server) calls :meth:`save` and :meth:`after_step` itself. Raises
    :class:`TrainingStopped` after step ``config.stop_after_steps`` (without saving it: the
    steps since the last checkpoint are redone on resume, as after a kill). With
    ``config.kill_at_step`` K, rank ``config.kill_rank`` SIGKILLs itself at the end of step K,
    once per checkpoint folder (:meth:`after_step`). Raises TypeError for an ``extra`` or
    ``per_rank`` object without ``state_dict``/``load_state_dict``, or ``per_rank`` with
    ``gathered=True`` (a gathered part is per rank already: pass it as ``extra``).

    Elastic resume (:func:`is_elastic`: ``config.global_batch_size`` with ddp, ddp --zero,
    fsdp, tp, pipeline or 3d): a checkpoint written on N ranks resumes on M. The world size is then a noted field
    (one logged line); the replicated state loads as it is, a ``per_rank`` state saved by N
    ranks starts afresh (one logged line: a comm hook's error-feedback residuals belong to the
    ranks that made them); a gathered one is cut again for M (``layout``, a
    :class:`minidist.resharding.ShardLayout`: which leaves are pieces of flat vectors, saved
    with their offsets in every checkpoint as ``"shards"``; :func:`minidist.resharding.
    reshard_parts`). The data position is fit's (epoch, step): with a fixed global batch a step
    is the same G samples on any number of ranks (``data.GlobalBatchSampler``), and the
    checkpoint's ``sampler`` also holds ``global_samples``, the epoch's samples consumed.
    A checkpoint without shard metadata (older) resumes on its own number of ranks only
    (CheckpointError naming it). A strategy whose pieces are not slices of flat vectors passes
    ``reshard`` instead of ``layout``: ``reshard(parts, world_size) -> parts`` cuts the N saved
    parts for this run's ranks, raising ``resharding.ReshardError`` when they do not fit
    (tensor parallelism: ``parallel.tensor_parallel.train.reshard_tensor_parallel``; a pipeline's
    and 3d's stages: ``parallel.pipeline.elastic.reshard_pipeline``, called also when only their
    layout changed at the same number of ranks); with tp, sequence parallelism may also change on
    resume, with pipeline and 3d their --dp, --tp, --microbatches, stages per rank and flushing
    schedule (one logged line each).

    ``metadata`` (a JSON-able dict or None): what using the model again needs beyond its weights
    (a GPT's configuration and its tokenizer's vocabulary, ``workloads.LanguageModelWorkload.
    metadata``), written into every checkpoint (``state["metadata"]``; gathered: beside
    ``"ranks"``) and into the final weights' file (:meth:`save_model`). For ``--model gpt`` the
    fields that must match also include steps, eval_every, n_layer, n_head, n_embd, block_size,
    dropout, warmup_steps and grad_clip (a checkpoint of another model size is refused, naming
    the field), and the workload's extra parts check the windows (seed, sizes, token count) and
    the vocabulary.
    """

    def __init__(self, config, model, optimizer, lr_schedule=None, *, comm=None, keep: int = 3, log=print,
                 extra: dict | None = None, gathered: bool = False, weights: bool = True,
                 per_rank: dict | None = None, metadata: dict | None = None, layout=None, reshard=None):
        self.config, self.model, self.optimizer, self.lr_schedule = config, model, optimizer, lr_schedule
        self.layout, self.reshard, self.elastic = layout, reshard, is_elastic(config)
        self.metadata = metadata
        self.comm, self.keep, self.log, self.extra = comm, keep, log, dict(extra or {})
        self.gathered, self.weights, self.per_rank = gathered, weights and model is not None, dict(per_rank or {})
        if self.per_rank and gathered:
            raise TypeError("Checkpointer: per_rank is for the replicated layout; a gathered part is each rank's "
                            "own already (pass the objects as extra)")
        for kind, objects in (("extra", self.extra), ("per_rank", self.per_rank)):
            for name, obj in objects.items():
                if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                    raise TypeError(f"Checkpointer: {kind}[{name!r}] needs state_dict() and load_state_dict()")
        self.rank = comm.Get_rank() if comm is not None else 0
        self.world_size = comm.Get_size() if comm is not None else 1
        self.every = config.checkpoint_every or DEFAULT_CHECKPOINT_EVERY
        self.save_seconds, self.saves = 0.0, 0
        directory = config.checkpoint_dir
        self.lock = CheckpointLock(directory) if directory is not None and self.rank == 0 else None

    def _generators(self) -> list:
        modules = self.model.modules() if self.model is not None else []
        return [nn.default_generator()] + [m.generator for m in modules
                                    if isinstance(getattr(m, "generator", None), np.random.Generator)]

    def _distributed(self) -> bool:
        return self.comm is not None and self.world_size > 1

    def fingerprint(self) -> dict:
        """The configuration saved with each checkpoint and compared on resume
        (:func:`compare_runs`): the fields of :data:`_RESUME_FIELDS` (hidden as a list, the loss
        scale resolved: ``precision.default_loss_scale`` for None, a static scale as a float),
        the world size, and the noted fields (epochs, device, all_reduce)."""
        config = self.config
        names = _RESUME_FIELDS + (_GPT_RESUME_FIELDS if getattr(config, "model", "mlp") == "gpt" else ())
        fields = {name: getattr(config, name, None) for name in names}
        fields["hidden"] = list(fields["hidden"])
        if fields.get("global_batch_size") is not None:  # the per-rank batch is G / ranks: G is what must match
            fields["batch_size"] = None
        scale = fields["loss_scale"]
        if scale is None and fields["precision"] is not None:
            scale = default_loss_scale(fields["precision"])
        fields["loss_scale"] = scale if isinstance(scale, str) or scale is None else float(scale)
        noted = {name: getattr(config, name) for name in _NOTED_FIELDS if hasattr(config, name)}
        known = ({"data": self.data_fingerprint(), "data_dir": self.config.data_dir}
                 if self.data_fingerprint() is not None else {})
        return {**fields, "world_size": self.world_size, **noted, **known}

    def data_fingerprint(self) -> str | None:
        """What the run trains on, when a folder the user names holds it (``--dataset mnist
        --data-dir DIR``: ``data.mnist_fingerprint``, a hash of the training arrays, computed
        once); None for the bundled digits and the plays, which the flags fix (the GPT's windows
        and vocabulary are checked as parts)."""
        if not hasattr(self, "_data"):
            config = self.config
            directory = getattr(config, "data_dir", None)
            self._data = (data.mnist_fingerprint(directory) if getattr(config, "dataset", None) == "mnist"
                          and directory is not None else None)
        return self._data

    def due(self, step: int) -> bool:
        """Whether global step ``step`` ends with a checkpoint."""
        return self.config.checkpoint_dir is not None and step % self.every == 0

    def state(self, position: dict | None, step: int | None = None) -> dict:
        """This rank's training state at ``position`` (what :func:`fit` hands ``on_step_end``;
        None on a rank outside fit, which then names the global ``step``). Without the other
        ranks' ``per_rank`` states (:meth:`save` gathers them)."""
        schedule = self.lr_schedule
        state = {
            "step": position["global_step"] if position is not None else step,
            "rng": [g.bit_generator.state for g in self._generators()],
            "config": self.fingerprint(),
            "lr_schedule": None if schedule is None else {k: v for k, v in vars(schedule).items() if k != "optimizer"},
        }
        if position is not None:
            state["position"] = {**position, "history": list(position["history"])}
            state["sampler"] = {"epoch": position["epoch"], "position": position["step"] * self.config.batch_size}
            if getattr(self.config, "global_batch_size", None) is not None:  # the same on any number of ranks
                state["sampler"]["global_samples"] = position["step"] * self.config.global_batch_size
        if self.weights:
            state["model"] = dict(self.model.state_dict())
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
        if self.extra:
            state["extra"] = {name: obj.state_dict() for name, obj in self.extra.items()}
        if self.metadata is not None:
            state["metadata"] = self.metadata
        if self.layout is not None:  # where this rank's pieces lie in the whole tensors (resharding.py)
            state["shards"] = shard_metadata(self.layout, self.rank, state)
        return state

    def load(self, state: dict, path: str) -> dict | None:
        """Restore ``state`` (read from ``path``) into the model, optimizer, schedule, extra and
        per-rank objects and generators; returns the position to hand :func:`fit` (None for a
        rank outside fit), after logging one line per noted change (:func:`compare_runs`).
        Raises CheckpointMismatchError when it was written by another run (naming the fields)
        or lies past this run's last epoch; CheckpointError naming the field when a part is
        missing, of the wrong shape or out of range (a checkpoint edited behind its checksum)."""
        if not isinstance(state, dict):
            raise CheckpointError(f"checkpoint {path}: the state is {type(state).__name__}, not a dict")
        notes = compare_runs(state.get("config"), self.fingerprint(), path, self.elastic)
        needed = ["step", "rng", "lr_schedule", *(["model"] if self.weights else []),
                  *(["optimizer"] if self.optimizer is not None else [])]
        missing = [key for key in needed if key not in state]
        if missing:
            raise CheckpointError(f"checkpoint {path}: the state lacks {', '.join(missing)}")
        if not _is_count(state["step"]):
            raise CheckpointError(f"checkpoint {path}: step must be an integer >= 0, got {state['step']!r}")
        if state.get("position") is not None:
            check_position(state["position"], state["step"], self.config.epochs, path)
        if self.optimizer is not None:  # a wrapper (ZeroRedundancyOptimizer) saves the one it wraps, ``optim``
            inner = getattr(self.optimizer, "optim", self.optimizer)
            kind = "Adam" if isinstance(inner, optim.Adam) else "SGD"
            check_optimizer_state(state["optimizer"], inner.params, path, kind)
        try:
            self._load_parts(state)
        except KeyError as error:
            raise CheckpointError(f"checkpoint {path} does not fit this run: it lacks {error}") from None
        except (ValueError, TypeError) as error:
            raise CheckpointError(f"checkpoint {path} does not fit this run: {error}") from None
        for line in notes:
            self.log(line)
        return state.get("position")

    def _load_parts(self, state: dict) -> None:
        if self.weights:
            self.model.load_state_dict(state["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if (state["lr_schedule"] is None) != (self.lr_schedule is None):
            raise ValueError("the lr schedule (--warmup-epochs) differs")
        for key, value in (state["lr_schedule"] or {}).items():
            setattr(self.lr_schedule, key, value)
        for kind, objects in (("extra", self.extra), ("per_rank", self.per_rank)):
            saved = state.get(kind, {})
            if set(saved) != set(objects):
                raise ValueError(f"{kind} state {sorted(saved)} saved, {sorted(objects)} in this run")
            for name, obj in objects.items():
                mine = saved[name]
                if kind == "per_rank":
                    if self.elastic and isinstance(mine, list) and len(mine) != self.world_size:
                        self.log(f"resume: {name}'s state was saved by {len(mine)} ranks, one each, and cannot be "
                                 f"split for {self.world_size}: it starts afresh")
                        continue
                    if not isinstance(mine, list) or len(mine) != self.world_size:
                        raise ValueError(f"per_rank[{name!r}] does not hold one state per rank ({self.world_size})")
                    mine = mine[self.rank]
                obj.load_state_dict(mine)
        generators = self._generators()
        if not isinstance(state["rng"], list) or len(generators) != len(state["rng"]):
            raise ValueError(f"{len(state['rng'])} random generators saved, {len(generators)} in the model")
        for generator, saved in zip(generators, state["rng"]):
            generator.bit_generator.state = saved

    def resume(self) -> dict | None:
        """Before the first step, on every rank: rank 0 takes the folder's lock and finds its
        newest valid checkpoint (skipping corrupt ones with a warning), which must hold this
        run (:func:`compare_runs`). With ``config.resume``, restore it and return the position
        for :func:`fit`; None (start from scratch, logged) when there is none yet or
        ``config.resume`` is off. Replicated: every rank loads rank 0's choice and the ranks
        agree on its step. Gathered: rank 0 sends each rank its part. Raises (every rank)
        CheckpointMismatchError for a folder of another run or one another live run is
        writing, CheckpointError for a folder of unusable files or a checkpoint that cannot be
        restored."""
        if self.config.checkpoint_dir is None:
            return None
        path = state = problem = None
        if self.rank == 0:
            try:
                path, state = self._inspect()
            except CheckpointError as error:
                problem = error
        if self._distributed():
            path = agree(self.comm, problem, path, raise_problem=_reraise)[0]
        elif problem is not None:
            raise problem
        directory = self.config.checkpoint_dir
        if not self.config.resume:
            if state is not None:
                self.log(f"note: {directory} already holds this run's checkpoints (the newest: step {state['step']}); "
                         "starting from scratch since --resume is not given (they are replaced as the run goes)")
            return None
        if path is None:
            self.log(f"resume: no checkpoint in {directory} yet, starting from scratch")
            return None
        if self.gathered:
            return self._resume_gathered(path, state)
        return self._resume_replicated(path, state)

    def _inspect(self):
        """Rank 0: lock the folder; its newest valid checkpoint as (path, state), checked to be
        this run's, or (None, None)."""
        try:
            self.lock.acquire()
        except OSError as error:  # before the first step: nothing trained is lost
            raise CheckpointError(f"cannot write in the checkpoint folder {self.config.checkpoint_dir}: {error}") \
                from None
        try:
            found = latest_valid_checkpoint(self.config.checkpoint_dir)
        except CheckpointError as error:  # files, none usable
            if self.config.resume:
                raise
            self.log(f"note: {error}; starting from scratch since --resume is not given")
            return None, None
        if found is None:
            return None, None
        path, state = found
        compare_runs(state.get("config") if isinstance(state, dict) else None, self.fingerprint(), path, self.elastic)
        return path, state

    def _resume_replicated(self, path, state):
        problem = None
        if self._distributed():
            if self.rank != 0:
                try:
                    state = load_checkpoint(path)
                except CheckpointError as error:
                    problem = str(error)

            def raise_problem(problem, rank, size):
                raise CheckpointError(f"{problem} (on rank {rank} of {size}: every rank reads rank 0's choice, so "
                                      "--checkpoint-dir must be a folder all ranks share)")

            steps = agree(self.comm, problem, state.get("step") if isinstance(state, dict) else None,
                          raise_problem=raise_problem)
            if len(set(steps)) != 1:
                raise CheckpointError(f"the ranks read different steps {steps} from {path}")
        return self._restored(state, path)

    def _restored(self, state, path):
        position = self.load(state, path)
        where = (f", epoch {position['epoch'] + 1}, batch {position['step']} of it" if position is not None else "")
        if position is not None and getattr(self.config, "global_batch_size", None) is not None:
            where += f", global sample {position['step'] * self.config.global_batch_size} of the epoch"
        self.log(f"resume: from {path} (step {state['step']}{where})")
        return position

    def _resume_gathered(self, path, whole):
        problem = parts = None
        if self.rank == 0:
            parts = whole.get("ranks")
            if self.elastic and isinstance(parts, list) and parts and (len(parts) != self.world_size
                                                                       or self._layout_changed(whole)):
                parts, problem = self._resharded(parts, path)
            elif not isinstance(parts, list) or len(parts) != self.world_size:
                count = len(parts) if isinstance(parts, list) else "no"
                problem = (f"checkpoint {path} holds {count} ranks' parts, this run has {self.world_size} ranks; "
                           "it is not a checkpoint of this run's layout")
        if self._distributed():
            part, path = scatter_objects(self.comm, parts, root=0, problem=problem, info=path, error=CheckpointError)
        elif problem is not None:
            raise CheckpointError(problem)
        else:
            part = parts[0]
        return self._restored(part, path)

    def _layout_changed(self, whole: dict) -> bool:
        """Whether the gathered checkpoint ``whole`` was written on another layout of as many
        ranks (a pipeline's or 3d's --dp, --tp, stages per rank or schedule) and a ``reshard``
        is given to cut it again."""
        saved = whole.get("config") if isinstance(whole.get("config"), dict) else {}
        mine = self.fingerprint()
        record = _record_of(mine)
        return self.reshard is not None and record is not None and any(saved.get(k) != mine.get(k)
                                                                       for k in record.relayout)

    def _resharded(self, parts: list, path: str):
        """Rank 0: the ``parts`` N ranks saved, cut again for this run's ranks
        (:func:`minidist.resharding.reshard_parts`), and None; or (None, the problem)."""
        if self.layout is None and self.reshard is None:
            return None, (f"checkpoint {path} holds {len(parts)} ranks' parts and this run has {self.world_size} "
                          "ranks, but its state has no shard layout to cut again")
        try:
            if self.reshard is not None:  # the strategy's own cut (tensor parallelism's)
                return self.reshard(parts, self.world_size), None
            return reshard_parts(parts, self.layout, self.world_size), None
        except ReshardError as error:
            return None, f"checkpoint {path} (written by {len(parts)} ranks) cannot be resharded: {error}"

    def save(self, step: int, position: dict | None = None) -> None:
        """Write the checkpoint of global step ``step`` now. Every rank of a distributed run
        must call it (the gathered parts and the ``per_rank`` states go to rank 0, which
        writes); every rank raises CheckpointError when the file cannot be written."""
        began = time.perf_counter()
        state = self._state_to_write(step, position)
        problem = self._write(step, state) if self.rank == 0 else None
        if self._distributed():
            agree(self.comm, problem, None, raise_problem=_reraise)
        elif problem is not None:
            raise problem
        self.save_seconds += time.perf_counter() - began
        self.saves += 1

    def _state_to_write(self, step, position):
        """The whole checkpoint on rank 0 (None elsewhere); collective in a distributed run."""
        if self.gathered:
            mine = self.state(position, step)
            parts = gather_objects(self.comm, mine, root=0) if self._distributed() else [mine]
            whole = {"step": step, "config": self.fingerprint(), "ranks": parts}
            if self.metadata is not None:
                whole["metadata"] = self.metadata
            return whole if self.rank == 0 else None
        own = {name: obj.state_dict() for name, obj in self.per_rank.items()}
        every = gather_objects(self.comm, own, root=0) if self._distributed() and own else [own]
        if self.rank != 0:
            return None
        state = self.state(position, step)
        if self.per_rank:
            state["per_rank"] = {name: [states[name] for states in every] for name in self.per_rank}
        return state

    def _write(self, step, state) -> CheckpointError | None:
        try:
            if self.lock is not None:
                self.lock.acquire()
            save_training_checkpoint(self.config.checkpoint_dir, step, state, keep=self.keep)
        except CheckpointError as error:
            return error
        except OSError as error:  # the previous checkpoints are intact; stop rather than train on unprotected
            return CheckpointError(f"cannot write the checkpoint of step {step} in {self.config.checkpoint_dir}: "
                                   f"{error}")
        return None

    def after_step(self, step: int, stop: bool = True) -> None:
        """The end of global step ``step``: the hidden test hooks. ``config.kill_at_step``
        (with ``config.kill_rank``, default 0): that rank creates ``KILL_MARKER`` in the
        checkpoint folder and SIGKILLs itself, unless the marker exists (so a relaunch with
        --resume runs past it). ``config.stop_after_steps``: raise :class:`TrainingStopped`
        (unless ``stop`` is False: a rank that others stop, e.g. a parameter server)."""
        kill = getattr(self.config, "kill_at_step", None)
        if kill is not None and step == kill and self.rank == (getattr(self.config, "kill_rank", None) or 0):
            marker = os.path.join(self.config.checkpoint_dir, KILL_MARKER.format(step=step))
            if not os.path.exists(marker):
                os.makedirs(self.config.checkpoint_dir, exist_ok=True)
                with open(marker, "w") as file:
                    file.write(f"rank {self.rank} killed itself at the end of step {step}\n")
                    file.flush()
                    os.fsync(file.fileno())
                os.kill(os.getpid(), signal.SIGKILL)
        if stop and self.config.stop_after_steps is not None and step >= self.config.stop_after_steps:
            self.close()
            raise TrainingStopped(step)

    def __call__(self, position: dict) -> None:
        """fit's ``on_step_end``: save every ``every`` global steps (CheckpointError when the
        file cannot be written), then :meth:`after_step`."""
        step = position["global_step"]
        if self.due(step):
            self.save(step, position)
        self.after_step(step)

    def close(self) -> None:
        """The run's end: release the checkpoint folder's lock (if this rank holds it)."""
        if self.lock is not None:
            self.lock.release()

    def save_model(self) -> None:
        """The run's end: write the final weights to ``config.save_model`` (``.npz`` of the
        state dict, as ``evaluate --checkpoint`` reads; ``.npz`` is appended to a path without
        it, as ``numpy.savez`` does) on rank 0, with the run's ``metadata`` if any, atomically
        (:func:`~minidist.checkpoint_io.save_weights`: a full disk leaves the previous file intact
        and raises CheckpointError naming the path and the fix: ``checkpoint_io.unwritable``), then
        :meth:`close`. Nothing is written without a path."""
        self.close()
        if self.config.save_model and self.rank == 0:
            path = os.fspath(self.config.save_model)
            path = path if path.endswith(".npz") else path + ".npz"
            try:
                save_weights(path, self.model.state_dict(), self.metadata)
            except OSError as error:  # a full disk: one line (train prints CheckpointError so), not a traceback
                raise unwritable(path, error, "--save-model") from None
