"""Checkpoint files: atomic save, verified load, the newest valid one, one writer per folder
(the one import path of these names; :mod:`minidist.fault` holds what goes in the files: the
:class:`~minidist.fault.Checkpointer`).

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

Longer than 400 lines: the file format, its checksum, the atomic write, the lock and the search for
the newest valid file are one contract with the files on disk.
"""
from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import json
import os
import re
import socket
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


@contextlib.contextmanager
def atomic_file(path):
    """``with atomic_file(path) as file:`` write ``path`` atomically: ``file`` is a temporary
    file opened for binary writing in ``path``'s folder (``.<name>.<random>.tmp``); when the
    block ends normally it is flushed, fsync'ed and renamed over ``path`` (``os.replace``,
    atomic on POSIX), then the folder is fsync'ed. When the block raises (e.g. OSError ENOSPC,
    a full disk) the temporary file is removed and ``path`` keeps its previous content (or stays
    absent). The sequence of Pillai et al., OSDI 2014 (module docstring). Raises what the
    block raises, OSError when the folder cannot be written."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, temporary = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        os.chmod(temporary, 0o666 & ~_umask())  # mkstemp's 0600 -> what open() would have given
        with os.fdopen(fd, "wb") as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with _suppress_os_error():
            os.unlink(temporary)
        raise
    _fsync_directory(directory)


def save_checkpoint(path, state: dict) -> None:
    """Write ``state`` to ``path`` atomically (:func:`atomic_file`): after a crash at any point,
    ``path`` holds either its previous content or all of ``state``, never part of it.

    ``state``: a dict whose leaves are arrays (NumPy or CuPy, saved as NumPy), or JSON values
    (str, int (any size, e.g. a generator's ``bit_generator.state``), float, bool, None),
    nested in dicts (string keys) and lists; tuples come back as lists. Raises TypeError for
    a leaf JSON cannot hold or an object array, OSError when the directory cannot be written
    (the temporary file is removed whenever the write fails).
    """
    arrays: dict = {}
    header = json.dumps({"format": FORMAT, "state": _flatten(state, "", arrays)}, allow_nan=True).encode()
    payload = {**arrays, "__header__": np.frombuffer(header, dtype=np.uint8),
               "__sha256__": np.frombuffer(_digest(header, arrays).encode(), dtype=np.uint8)}
    with atomic_file(path) as file:
        np.savez(file, **payload)


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
    match the content (a corrupt copy); a symbolic link to nothing."""
    path = os.fspath(path)
    if os.path.islink(path) and not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path}: a dangling symbolic link (to {os.readlink(path)!r}, which does "
                              "not exist)")
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


# ---------------------------------------------------------------------------------------
# A model's final weights (--save-model): the state dict, and what is needed to use it again
# ---------------------------------------------------------------------------------------

METADATA_KEY = "__metadata__"  # in a weights file: the model's description, JSON as UTF-8 bytes


def save_weights(path, state_dict: dict, metadata: dict | None = None) -> None:
    """Write a model's weights to ``path`` (``.npz``) atomically (:func:`atomic_file`): one array
    per name of ``state_dict`` (NumPy or CuPy, saved as NumPy), as ``np.savez(path, **state_dict)``
    writes and ``evaluate --checkpoint`` reads; with ``metadata`` (a JSON-able dict, e.g. a GPT's
    configuration and its tokenizer's vocabulary) one more entry, :data:`METADATA_KEY`, holding
    it as JSON text in uint8 bytes (no pickle needed to read it back). Raises TypeError for
    metadata JSON cannot hold, ValueError when a state dict name is METADATA_KEY, OSError when
    the file cannot be written (the previous file, if any, is left intact)."""
    if METADATA_KEY in state_dict:
        raise ValueError(f"save_weights: {METADATA_KEY!r} is reserved for the metadata, not a parameter name")
    arrays = {name: backend.to_numpy(value) for name, value in state_dict.items()}
    if metadata is not None:
        arrays[METADATA_KEY] = np.frombuffer(json.dumps(metadata).encode(), dtype=np.uint8)
    with atomic_file(path) as file:
        np.savez(file, **arrays)


def unwritable(path, error: OSError, flag: str) -> CheckpointError:
    """The one-line error of a weights file that could not be written at ``path``, given as
    ``flag`` (``--save-model``, ``OUT``): what went wrong (a full disk said so), that
    :func:`atomic_file` left nothing half-written, and the fix."""
    full = error.errno in (errno.ENOSPC, errno.EDQUOT)
    reason = "the disk is full" if full else (error.strerror or str(error))
    return CheckpointError(f"cannot write {flag} {path}: {reason}; nothing was written there (a previous {path}, if "
                           f"any, is intact): {'free some space there' if full else 'fix the folder'} or give {flag} "
                           "a path on another disk")


def load_weights(path) -> tuple[dict, dict | None]:
    """``(state_dict, metadata)`` of a file :func:`save_weights` wrote (metadata None when the
    file has none, e.g. an MLP's or one written by ``np.savez``). Raises CheckpointError naming
    ``path`` when it is missing, not a readable ``.npz``, or its metadata is not JSON."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"weights {path}: no such file")
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except (zipfile.BadZipFile, ValueError, EOFError, OSError) as error:
        raise CheckpointError(f"weights {path}: truncated or corrupt, not a readable .npz ({error})") from None
    raw = arrays.pop(METADATA_KEY, None)
    if raw is None:
        return arrays, None
    try:
        metadata = json.loads(raw.tobytes().decode())
    except (ValueError, UnicodeDecodeError) as error:
        raise CheckpointError(f"weights {path}: unreadable {METADATA_KEY} ({error})") from None
    return arrays, metadata


def checkpoint_path(directory, step: int) -> str:
    """The file of the checkpoint after global step ``step`` in ``directory``:
    ``ckpt-<step, 8 digits>.npz``, so names sort by step."""
    return os.path.join(os.fspath(directory), f"ckpt-{step:08d}.npz")


def list_checkpoints(directory) -> list[tuple[int, str]]:
    """``(step, path)`` of every checkpoint file in ``directory``, oldest first (temporary
    files and other names are ignored; [] when the directory does not exist). Raises
    CheckpointError when ``directory`` is a symbolic link to nothing (naming its target)."""
    directory = os.fspath(directory)
    if os.path.islink(directory) and not os.path.exists(directory):
        raise CheckpointError(f"checkpoint folder {directory} is a dangling symbolic link (to "
                              f"{os.readlink(directory)!r}, which does not exist): create that folder or point the "
                              "link elsewhere")
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
    or None when there is no checkpoint file at all. Each newer one that fails
    :func:`load_checkpoint` (truncated, bad checksum, a dangling symbolic link) is skipped
    with a :class:`CheckpointWarning` naming the file and why. Raises CheckpointError when
    there are checkpoint files but none is valid (each named with its problem): not "no
    checkpoint yet", which would silently start the run over."""
    problems = []
    for _, path in reversed(list_checkpoints(directory)):
        try:
            return path, load_checkpoint(path)
        except CheckpointError as error:
            problems.append(str(error))
            warnings.warn(f"{error}; skipping it for the previous checkpoint", CheckpointWarning, stacklevel=2)
    if problems:
        raise CheckpointError(f"checkpoint folder {os.fspath(directory)} holds {len(problems)} checkpoint file"
                              f"{'s' if len(problems) > 1 else ''} and none is usable ({'; '.join(problems)}); move "
                              "them away to start from scratch, or restore a good copy")
    return None


# ---------------------------------------------------------------------------------------
# One writer per folder: a lock file naming the process that writes there
# ---------------------------------------------------------------------------------------

LOCK_NAME = ".lock"  # in the checkpoint folder, while a run writes there
_HOLDER = re.compile(r"pid=(\d+) host=(\S+)")


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only the existence and permission checks
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


class CheckpointLock:
    """The lock of a checkpoint folder: one run writes there at a time.

    Two runs saving into one folder delete each other's files (each keeps its last few
    checkpoints and removes the temporary files of interrupted writes, which may be the other
    run's write in progress: it then dies with ENOENT at its rename). :meth:`acquire` creates
    ``<folder>/.lock`` exclusively (``O_CREAT | O_EXCL``, atomic on a local file system and on
    NFS v3+) holding ``pid=<pid> host=<host>``; :meth:`release` removes it, and so does the
    end of the process (``atexit``). A lock whose process is gone (a SIGKILL, an MPI abort) is
    stale: the next run on the same host takes it over with a :class:`CheckpointWarning`
    (the check is ``kill(pid, 0)``; a reused pid would make it look alive). A lock of this very
    process (an earlier run in the same interpreter) is taken again silently. The idea is that
    of a PID lock file (e.g. Git's ``index.lock``, ``/var/run/*.pid``), plus the stale-lock check.
    """

    def __init__(self, directory):
        self.directory = os.fspath(directory)
        self.path = os.path.join(self.directory, LOCK_NAME)
        self.held = False

    def acquire(self) -> None:
        """Take the lock (creating the folder if need be); nothing if this object holds it.
        Raises CheckpointMismatchError naming the pid and host of a live run that holds it
        (or of a run on another host, whose pid cannot be checked from here), CheckpointError
        for a folder that is a dangling symbolic link, OSError when the folder cannot be
        written."""
        if self.held:
            return
        list_checkpoints(self.directory)  # a dangling link: named
        os.makedirs(self.directory, exist_ok=True)
        host = socket.gethostname()
        mine = f"pid={os.getpid()} host={host}\n"
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if not self._take_over_if_stale(host):
                    continue
            else:
                with os.fdopen(fd, "w") as file:
                    file.write(mine)
                    file.flush()
                    os.fsync(file.fileno())
            self.held = True
            atexit.register(self.release)
            return
        raise CheckpointMismatchError(f"checkpoint folder {self.directory}: could not take its lock {self.path} "
                                      "(other runs keep taking it); use another --checkpoint-dir")

    def _take_over_if_stale(self, host: str) -> bool:
        """The lock file exists: True if it is this process's; raise if a live run holds it;
        move a stale one aside (False: try again)."""
        try:
            with open(self.path) as file:
                content = file.read()
        except FileNotFoundError:
            return False  # released meanwhile
        match = _HOLDER.search(content)
        if match is None:  # being written right now, or not ours: let the holder finish
            raise CheckpointMismatchError(f"checkpoint folder {self.directory} is locked ({self.path} holds "
                                          f"{content.strip()[:80]!r}): another run may be writing there; use another "
                                          "--checkpoint-dir, or delete the lock if no run is")
        pid, their_host = int(match.group(1)), match.group(2)
        if their_host == host and pid == os.getpid():
            return True
        if their_host != host or _process_alive(pid):
            where = "" if their_host == host else " (another host: its process cannot be checked from here)"
            raise CheckpointMismatchError(
                f"checkpoint folder {self.directory} is in use by another run (pid {pid} on host {their_host}"
                f"{where}, lock {self.path}): two runs writing one folder would delete each other's checkpoints; "
                "wait for it to end or use another --checkpoint-dir (delete the lock if that run is gone)")
        aside = f"{self.path}.stale-{pid}-{os.getpid()}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False  # another run took it over first
        with open(aside) as file:
            moved = file.read()
        if moved != content:  # we moved a fresh lock someone took after our read: put it back
            with contextlib.suppress(FileExistsError):
                os.link(aside, self.path)
        os.unlink(aside)
        if moved == content:
            warnings.warn(f"checkpoint folder {self.directory}: took over the stale lock of pid {pid} on {host}, "
                          "which no longer runs (killed?)", CheckpointWarning, stacklevel=4)
        return False

    def release(self) -> None:
        """Remove the lock file if this object holds it (a lock another process took over is
        left alone)."""
        if not self.held:
            return
        self.held = False
        atexit.unregister(self.release)
        with contextlib.suppress(OSError):
            with open(self.path) as file:
                match = _HOLDER.search(file.read())
            if match and int(match.group(1)) == os.getpid() and match.group(2) == socket.gethostname():
                os.unlink(self.path)
