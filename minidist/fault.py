"""Training checkpoints: atomic save, resume (:class:`Checkpointer`, the training state they hold).

A run that dies (a killed rank, a lost node) loses everything since its last checkpoint, so a
checkpoint must hold the *whole* training state (model weights, the optimizer's momentum
buffers, the learning-rate schedule, every random generator, the sampler's epoch and position
within it, the global step): resuming from it must then give weights bit-identical to a run
that was never stopped (Keras' ``BackupAndRestore``, PyTorch's "saving and loading a general
checkpoint" recipe).

A checkpoint must also never be half a file. :func:`save_checkpoint` writes the standard
atomic-replace sequence (e.g. Pillai et al., "All File Systems Are Not Created Equal", OSDI
2014): write a temporary file in the same directory, ``fsync`` it, ``os.replace`` it over the
final name (atomic on POSIX), then ``fsync`` the directory so the rename itself survives a
crash. A kill at any moment leaves either the old file or the new one, plus at worst a stale
temporary file that nothing reads. A SHA-256 checksum over the payload catches what the
rename cannot: a truncated copy, a flipped bit on disk.

The file is an ``.npz`` (NumPy's zip of ``.npy`` arrays): every array of the state under its
path (``model/0.weight``), plus ``__header__`` (the rest of the state as UTF-8 JSON, arrays
replaced by ``{"__array__": key}``) and ``__sha256__`` (hex digest over the header and every
array's dtype, shape and bytes, in key order).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
import warnings
import zipfile

import numpy as np

from minidist import backend, nn

FORMAT = "minidist-checkpoint-1"
_NAME = re.compile(r"ckpt-(\d+)\.npz")
_TEMPORARY = re.compile(r"\.ckpt-\d+\.npz\..+\.tmp")  # save_checkpoint's, left by a kill mid-write


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used; the message names the file and the problem
    (missing, truncated or not an .npz, not a minidist checkpoint, bad checksum, a state that
    does not fit the run)."""


class CheckpointWarning(UserWarning):
    """A corrupt checkpoint skipped by :func:`latest_valid_checkpoint` (named in the message)."""


def _flatten(value, prefix: str, arrays: dict):
    """``value`` with every array moved into ``arrays`` (key: its path) and replaced by a
    reference; dicts, lists and tuples are walked, everything else must be JSON."""
    if isinstance(value, dict):
        return {str(k): _flatten(v, f"{prefix}/{k}", arrays) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_flatten(v, f"{prefix}/{i}", arrays) for i, v in enumerate(value)]
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # NumPy or CuPy array
        key = prefix.lstrip("/") or "array"
        arrays[key] = backend.to_numpy(value)
        if arrays[key].dtype.hasobject:
            raise TypeError(f"save_checkpoint: {key} is an array of Python objects; only numeric arrays are saved")
        return {"__array__": key}
    return value


def _unflatten(value, arrays: dict):
    if isinstance(value, dict):
        if set(value) == {"__array__"}:
            return arrays[value["__array__"]]
        return {k: _unflatten(v, arrays) for k, v in value.items()}
    if isinstance(value, list):
        return [_unflatten(v, arrays) for v in value]
    return value


def _digest(header: bytes, arrays: dict) -> str:
    h = hashlib.sha256(header)
    for key in sorted(arrays):
        a = np.ascontiguousarray(arrays[key])
        h.update(f"{key}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _fsync_directory(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # a platform that cannot open directories (Windows): the rename is all we get
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(path, state: dict) -> None:
    """Write ``state`` to ``path`` atomically: after a crash at any point, ``path`` holds
    either its previous content or all of ``state``, never part of it.

    ``state``: a dict whose leaves are arrays (NumPy or CuPy, saved as NumPy), or JSON values
    (str, int (any size, e.g. a generator's ``bit_generator.state``), float, bool, None),
    nested in dicts (string keys) and lists; tuples come back as lists. Raises TypeError for
    a leaf JSON cannot hold or an object array, OSError when the directory cannot be written
    (the temporary file is removed whenever the write fails).
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    arrays: dict = {}
    header = json.dumps({"format": FORMAT, "state": _flatten(state, "", arrays)}, allow_nan=True).encode()
    payload = {**arrays, "__header__": np.frombuffer(header, dtype=np.uint8),
               "__sha256__": np.frombuffer(_digest(header, arrays).encode(), dtype=np.uint8)}
    fd, temporary = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        os.chmod(temporary, 0o666 & ~_umask())  # mkstemp's 0600 -> what open() would have given
        with os.fdopen(fd, "wb") as file:
            np.savez(file, **payload)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with _suppress_os_error():
            os.unlink(temporary)
        raise
    _fsync_directory(directory)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class _suppress_os_error:
    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        return kind is not None and issubclass(kind, OSError)


def load_checkpoint(path) -> dict:
    """The state :func:`save_checkpoint` wrote to ``path``, verified (arrays as NumPy arrays,
    tuples as lists).

    Raises CheckpointError naming ``path`` and the problem: missing; truncated or not an
    ``.npz`` at all; an ``.npz`` that is not a minidist checkpoint; a checksum that does not
    match the content (a corrupt copy)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path}: no such file")
    try:
        with np.load(path, allow_pickle=False) as npz:
            names = set(npz.files)
            if not {"__header__", "__sha256__"} <= names:
                raise CheckpointError(f"checkpoint {path}: not a minidist checkpoint (an .npz without "
                                      "__header__ and __sha256__; was it written by save_checkpoint?)")
            arrays = {k: npz[k] for k in names - {"__header__", "__sha256__"}}
            header, expected = npz["__header__"].tobytes(), npz["__sha256__"].tobytes().decode("ascii", "replace")
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, ValueError, EOFError, OSError, KeyError) as error:
        raise CheckpointError(f"checkpoint {path}: truncated or corrupt, not a readable .npz ({error})") from None
    if _digest(header, arrays) != expected:
        raise CheckpointError(f"checkpoint {path}: bad checksum (the content changed after it was written: a "
                              "corrupt copy); use an older checkpoint")
    try:
        document = json.loads(header)
    except ValueError as error:
        raise CheckpointError(f"checkpoint {path}: unreadable header ({error})") from None
    found = document.get("format") if isinstance(document, dict) else None
    if found != FORMAT:
        raise CheckpointError(f"checkpoint {path}: not a minidist checkpoint (format {found!r}, expected {FORMAT!r})")
    return _unflatten(document["state"], arrays)


def checkpoint_path(directory, step: int) -> str:
    """The file of the checkpoint after global step ``step`` in ``directory``:
    ``ckpt-<step, 8 digits>.npz``, so names sort by step."""
    return os.path.join(os.fspath(directory), f"ckpt-{step:08d}.npz")


def list_checkpoints(directory) -> list[tuple[int, str]]:
    """``(step, path)`` of every checkpoint file in ``directory``, oldest first (temporary
    files and other names are ignored; [] when the directory does not exist)."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return []
    found = [(int(m.group(1)), os.path.join(directory, name))
             for name in os.listdir(directory) if (m := _NAME.fullmatch(name))]
    return sorted(found)


def save_training_checkpoint(directory, step: int, state: dict, keep: int = 3) -> str:
    """Save ``state`` as the checkpoint of global step ``step`` in ``directory`` (created if
    need be) with :func:`save_checkpoint`, then delete all but the newest ``keep`` (>= 1)
    checkpoints there, and the temporary files of writes a kill interrupted (one writer per
    directory). Returns the path written. Raises ValueError for keep < 1."""
    if keep < 1:
        raise ValueError(f"save_training_checkpoint: keep must be >= 1, got {keep}")
    os.makedirs(os.fspath(directory), exist_ok=True)
    path = checkpoint_path(directory, step)
    save_checkpoint(path, state)
    stale = [os.path.join(directory, n) for n in os.listdir(directory) if _TEMPORARY.fullmatch(n)]
    for old in [p for _, p in list_checkpoints(directory)[:-keep]] + stale:
        with _suppress_os_error():
            os.unlink(old)
    return path


def latest_valid_checkpoint(directory) -> tuple[str, dict] | None:
    """The newest checkpoint of ``directory`` that loads and verifies, as ``(path, state)``,
    or None when there is none. Each newer one that fails :func:`load_checkpoint` (truncated,
    bad checksum) is skipped with a :class:`CheckpointWarning` naming the file and why."""
    for _, path in reversed(list_checkpoints(directory)):
        try:
            return path, load_checkpoint(path)
        except CheckpointError as error:
            warnings.warn(f"{error}; skipping it for the previous checkpoint", CheckpointWarning, stacklevel=2)
    return None


# ---------------------------------------------------------------------------------------
# Checkpoints (single and ddp): the whole training state, saved every N steps, resumed mid-epoch
# ---------------------------------------------------------------------------------------

# Steps between checkpoints when --checkpoint-every is not given. A save (two copies of the
# weights, fsync twice) took 1.5 ms on the dev machine and a digits step 0.19 ms: every 100
# steps cost 7.9 %, every 500 about 1.6 % (tests/test_py::test_checkpoint_overhead_per_epoch
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

    def __init__(self, config, model, optimizer, lr_schedule=None, *, comm=None, keep: int = 3,
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
        generators; returns the position to hand :func:`fit`. Raises CheckpointError
        naming the file when it was written by a run with another configuration."""
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
        ``config.resume`` is off or there is no checkpoint yet. Raises CheckpointError."""
        if not self.config.resume:
            return None
        found = latest_valid_checkpoint(self.config.checkpoint_dir) if self.rank == 0 else None
        path, state, problem = (found[0], found[1], None) if found else (None, None, None)
        if self.comm is not None and self.world_size > 1:
            from minidist.collectives import agree  # noqa: PLC0415

            path = agree(self.comm, None, path)[0]
            if path is not None and self.rank != 0:
                try:
                    state = load_checkpoint(path)
                except CheckpointError as error:
                    problem = str(error)
            def raise_problem(problem, rank, size):
                raise CheckpointError(f"{problem} (on rank {rank} of {size}: every rank reads rank 0's "
                                            "choice, so --checkpoint-dir must be a folder all ranks share)")

            steps = agree(self.comm, problem, None if state is None else state["step"], raise_problem=raise_problem)
            if len(set(steps)) != 1:
                raise CheckpointError(f"the ranks read different steps {steps} from {path}")
        if path is None:
            self.log(f"resume: no checkpoint in {self.config.checkpoint_dir} yet, starting from scratch")
            return None
        position = self.load(state, path)
        self.log(f"resume: from {path} (step {state['step']}, epoch {position['epoch'] + 1}, "
                 f"batch {position['step']} of it)")
        return position

    def __call__(self, position: dict) -> None:
        """fit's ``on_step_end``: save every ``every`` global steps (rank 0; CheckpointError
        when the file cannot be written), stop after ``config.stop_after_steps``."""
        step = position["global_step"]
        if self.config.checkpoint_dir is not None and step % self.every == 0 and self.rank == 0:
            began = time.perf_counter()
            try:
                save_training_checkpoint(self.config.checkpoint_dir, step, self.state(position), keep=self.keep)
            except OSError as error:  # the previous checkpoints are intact; stop rather than train on unprotected
                raise CheckpointError(f"cannot write the checkpoint of step {step} in "
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
