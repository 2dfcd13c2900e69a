"""Checkpoint files: atomic save, verified load, the newest valid one (re-exported by
:mod:`minidist.fault`, which holds what goes in them: the :class:`~minidist.fault.Checkpointer`).

A checkpoint must never be half a file. :func:`save_checkpoint` writes the standard
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
import warnings
import zipfile

import numpy as np

from minidist import backend

FORMAT = "minidist-checkpoint-1"
_NAME = re.compile(r"ckpt-(\d+)\.npz")
_TEMPORARY = re.compile(r"\.ckpt-\d+\.npz\..+\.tmp")  # save_checkpoint's, left by a kill mid-write


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used; the message names the file and the problem
    (missing, truncated or not an .npz, not a minidist checkpoint, bad checksum, a state that
    does not fit the run)."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint folder that holds another run: its checkpoints were written with other
    flags that shape the run (learning rate, strategy, precision, comm hook, ...), another
    world size or another layout. The message names each field that differs and its value
    there and here. Not a fault a restart can cure: the command line reports it as a usage
    error (exit status 2), which ``launch`` never retries; the fix is the run's own flags or
    another ``--checkpoint-dir``."""


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
