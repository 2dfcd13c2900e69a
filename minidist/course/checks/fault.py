"""The checks of exercise 12: an atomic checkpoint save and a resume from the newest valid file,
checked by watching the system calls a save makes and by killing a real training process.

You write two functions::

    save_checkpoint(path, state)      # state: {name: NumPy array}; path: <folder>/ckpt-<step, 6 digits>.npz
    load_latest(directory) -> dict    # the state of the newest checkpoint that reads back whole, or None

A save must never leave half a file under the final name: write a temporary file in the same
folder, ``flush`` and ``os.fsync`` it, ``os.replace`` it over ``path`` (atomic on POSIX), then
``fsync`` the folder so that the rename itself is on disk (the sequence studied by Pillai et al.,
"All File Systems Are Not Created Equal", OSDI 2014; :func:`minidist.checkpoint_io.save_checkpoint` is
the engine's version). The checks, in this order, each with a hint:

1. :func:`check_atomic_save`: one save over an existing checkpoint, with ``os.replace``,
   ``os.rename`` and ``os.fsync`` watched: the file holds the new arrays; the final name still
   held the old content when the rename came; the temporary file sat in the same folder; it
   was fsynced after all its bytes were written (a ``flush`` first) and before the rename; the
   folder was fsynced after it; nothing is left behind. A missing fsync cannot be seen by a
   kill (the kernel still holds the data), only by a power loss, so it is checked by watching.
2. :func:`check_load_latest`: None for an empty folder; the newest by *step* (not by file
   time); other names and temporary files ignored, whole checkpoints under such names too
   (``ckpt-000090.npz.tmp``, ``ckpt-000099-backup.npz``); a truncated newest file, one with a
   flipped byte (the zip format's CRC-32 catches it when the array is read) and an empty one
   skipped for the one before.
3. :func:`check_kill_and_resume`: :func:`train` (softmax regression, SGD with momentum, a
   checkpoint every :data:`EVERY` steps) in a forked child process, SIGKILLed four times: between two
   saves, in a save before its rename, in its fsync, right after its rename; after each kill
   ``load_latest`` must give the state of the newest finished save, and the run resumed to the
   end must give weights and momentum **bitwise** equal to an uninterrupted run's. Needs
   ``os.fork`` (Linux, macOS); elsewhere this part is skipped and the verdict says so.

Each failure raises ``AssertionError("what: problem\\nHint: ...")``; an error raised by your
code becomes :class:`minidist.course.checks.LearnerError` with your line.

Longer than 400 lines: exercise 12's checks, each with the hints for the usual wrong turns, as the
runner calls them in order.
"""
from __future__ import annotations

import os
import select
import signal
import stat
import sys
import tempfile
import time
import warnings

import numpy as np

from minidist import checkpoint_io
from minidist.course.checks import armed, call_learner, check_own_code, fail, forbidding, learner_error

STEPS, EVERY, BATCH, FEATURES, CLASSES, SAMPLES = 80, 10, 32, 16, 4, 256
LR, MOMENTUM, SEED = 0.1, 0.9, 12
# (what kills the child, at which step); each run resumes from what the previous one left.
KILLS = (("between saves", 37), ("before the rename", 50), ("in the fsync", 60), ("after the rename", 70))
CHILD_DEADLINE = 30.0  # seconds a forked training run may take to reach its kill point

WRITE_IN_PLACE_HINT = ("you wrote straight to the final name: a kill during the write leaves half a file there, and "
                       "the previous checkpoint is already gone; write a temporary file in the same folder, then "
                       "os.replace(temporary, path) (call os.replace itself, not a name imported from os)")
TEMP_ELSEWHERE_HINT = ("make the temporary file in the folder of path (tempfile.mkstemp(dir=os.path.dirname(path)) "
                       "or path + '.tmp'): a rename is atomic only within one file system, and /tmp is often "
                       "another one (os.replace then fails with EXDEV; shutil.move falls back to a copy, which a "
                       "kill can cut in half)")
NO_FSYNC_HINT = ("call f.flush() then os.fsync(f.fileno()) before the rename: without it the rename can reach the "
                 "disk before the data, and after a power loss the final name holds an empty or partial file. A "
                 "kill cannot show this (the kernel still has the data), so the check watches for the call")
FLUSH_HINT = ("f.flush() before os.fsync(f.fileno()): Python's file buffers the last bytes in the process, so an "
              "fsync before the flush leaves them out")
DIR_FSYNC_HINT = ("after os.replace, fsync the folder: fd = os.open(folder, os.O_RDONLY); os.fsync(fd); "
                  "os.close(fd). A name lives in its folder, so until the folder is on disk a power loss can "
                  "bring back the old file")
SAVEZ_HINT = ("a file your save names does not exist: np.savez adds '.npz' to a file name that does not end in it "
              "(np.savez('x.tmp') writes x.tmp.npz), so write into the open file instead: with os.fdopen(fd, 'wb') "
              "as f (or open(temporary, 'wb') as f): np.savez(f, **state)")
NEWEST_HINT = ("pick the file with the largest step in its name (ckpt-000030.npz: the 6 digits sort as the steps "
               "do), not the latest modification time, and ignore names that do not match ckpt-<digits>.npz")
# The engine's versions of what the exercise asks for: the learner's code may not call them.
ENGINE_SAVES_AND_LOADS = (checkpoint_io.save_checkpoint, checkpoint_io.load_checkpoint,
                          checkpoint_io.latest_valid_checkpoint, checkpoint_io.save_training_checkpoint)
SKIP_HINT = ("try the files newest first; read every array inside a try (np.load is lazy: a flipped byte is found "
             "by the zip format's CRC-32 only when the array is read) and on any error (zipfile.BadZipFile, "
             "ValueError, OSError, EOFError) go on to the next older file")


# ----------------------------------------------------------------------------- the training run


def _data():
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((SAMPLES, FEATURES))
    y = np.argmax(x @ rng.standard_normal((FEATURES, CLASSES)) + 0.5 * rng.standard_normal((SAMPLES, CLASSES)), 1)
    return x, y


def checkpoint_name(directory, step: int) -> str:
    """``<directory>/ckpt-<step, 6 digits>.npz``: the path :func:`train` passes to your save."""
    return os.path.join(os.fspath(directory), f"ckpt-{step:06d}.npz")


def train(directory, save, load_latest, *, steps: int = STEPS, every: int = EVERY, on_step=None):
    """The run the checks kill: softmax regression (float64 weight ``(16, 4)``) on 256 fixed
    samples, mini-batches of 32, SGD with momentum 0.9 and lr 0.1 (PyTorch's rule: ``velocity =
    0.9 velocity + grad``, ``weight -= lr velocity``). It starts from ``load_latest(directory)``
    when that returns a state (``{"weight", "velocity", "step"}``), else from a seeded weight,
    and after every ``every``-th step calls ``save(checkpoint_name(directory, step), state)``.
    Step s draws its batch with ``default_rng([12, s])``, so the data order needs no saved
    generator. ``on_step(step)`` (optional) is called after each step, before its save.
    Returns ``(weight, velocity)``; raises AssertionError for a state without those keys."""
    x, y = _data()
    state = call_learner("load_latest(directory) when the run starts", load_latest, directory)
    if state is None:
        weight = np.random.default_rng(SEED + 1).standard_normal((FEATURES, CLASSES)) * 0.1
        velocity, start = np.zeros_like(weight), 0
    else:
        missing = {"weight", "velocity", "step"} - set(state)
        if missing:
            fail("load_latest(directory)", f"the state has no {sorted(missing)} (keys: {sorted(state)})",
                 "return a dict of every array the checkpoint file holds, under the names save was given")
        weight, velocity, start = np.array(state["weight"]), np.array(state["velocity"]), int(state["step"])
    for step in range(start, steps):
        rows = np.random.default_rng([SEED, step]).choice(SAMPLES, BATCH, replace=False)
        logits = x[rows] @ weight
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        p[np.arange(BATCH), y[rows]] -= 1.0
        velocity = MOMENTUM * velocity + x[rows].T @ p / BATCH
        weight = weight - LR * velocity
        if on_step is not None:
            on_step(step + 1)
        if (step + 1) % every == 0:
            call_learner(f"save_checkpoint at step {step + 1}", save, checkpoint_name(directory, step + 1),
                         {"weight": weight, "velocity": velocity, "step": np.array(step + 1)}, name="your save")
    return weight, velocity


def _state(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {"weight": rng.standard_normal((FEATURES, CLASSES)), "velocity": rng.standard_normal((FEATURES, CLASSES)),
            "step": np.array(step)}


def _same(a: dict | None, b: dict) -> bool:
    return a is not None and set(a) >= set(b) and all(np.array_equal(np.asarray(a[k]), b[k]) for k in b)


def _as_dict(got, what: str) -> dict | None:
    """``got`` (a dict or NumPy's NpzFile) with every array read now; None stays None."""
    if got is None:
        return None
    try:
        return {k: np.asarray(got[k]) for k in got.keys()}
    except Exception as error:  # an NpzFile read too late: a corrupt file found by the caller
        fail(what, f"the state returned cannot be read ({type(error).__name__}: {error})",
             "return a plain dict, read inside your try: {k: npz[k] for k in npz.files} under 'with np.load(...)'; "
             + SKIP_HINT)


def _read(path) -> dict:
    with np.load(path) as npz:
        return {k: npz[k] for k in npz.files}


# ----------------------------------------------------------------------------- 1. the save, watched


class _Watch:
    """Records os.replace / os.rename / os.fsync calls while active (the real calls still run)."""

    def __init__(self, old_path=None, old_state=None):
        self.events, self.old_path, self.old_state = [], old_path, old_state

    def __enter__(self):
        self.real = {name: getattr(os, name) for name in ("replace", "rename", "fsync")}

        def renamer(name):
            def rename(src, dst, *args, **kwargs):
                src_stat = os.stat(src)
                still_old = self.old_path is None or (os.path.exists(dst) and _same(_read(dst), self.old_state))
                self.events.append(("rename", os.path.abspath(src), os.path.abspath(dst), src_stat, still_old))
                return self.real[name](src, dst, *args, **kwargs)
            return rename

        def fsync(fd):
            self.events.append(("fsync", os.fstat(fd)))
            return self.real["fsync"](fd)

        os.replace, os.rename, os.fsync = renamer("replace"), renamer("rename"), fsync
        return self

    def __exit__(self, *exc):
        for name, function in self.real.items():
            setattr(os, name, function)


@forbidding(*ENGINE_SAVES_AND_LOADS)
def check_atomic_save(save) -> None:
    """Check ``save(path, state)`` over an existing file with its calls watched (see the module
    docstring, part 1). Raises AssertionError with a hint, LearnerError when ``save`` raises."""
    check_own_code(save, "save_checkpoint")
    what = "save_checkpoint(path, state) over an older checkpoint"
    with tempfile.TemporaryDirectory(prefix="minidist-ex12-") as directory:
        path, old, new = checkpoint_name(directory, 10), _state(1), _state(10)
        np.savez(path, **old)
        with _Watch(path, old) as watch:
            try:
                with armed():
                    save(path, new)
            except AssertionError:
                raise
            except Exception as error:  # the learner's error, with a hint
                hint = SAVEZ_HINT if isinstance(error, FileNotFoundError) else ""
                raise learner_error(what, error, "your save_checkpoint", hint) from None
        try:
            written = _read(path)
        except Exception as error:
            fail(what, f"np.load cannot read the file it wrote ({type(error).__name__}: {error})",
                 "write the arrays with np.savez(f, **state) into the open temporary file")
        if not _same(written, new):
            fail(what, f"the file does not hold the state it was given (keys {sorted(written)})",
                 "write every array of state under its own name: np.savez(f, **state)")
        renames = [e for e in watch.events if e[0] == "rename"]
        if not renames:
            fail(what, "no os.replace (or os.rename) call: the file was written in place", WRITE_IN_PLACE_HINT)
        _, src, dst, src_stat, still_old = renames[-1]
        if dst != os.path.abspath(path):
            fail(what, f"the last rename went to {dst}, not to {path}", "os.replace(temporary, path) last")
        if os.path.dirname(src) != os.path.dirname(dst):
            fail(what, f"the temporary file was in {os.path.dirname(src)}, not in the folder of {path}",
                 TEMP_ELSEWHERE_HINT)
        if not still_old:
            fail(what, "the final name no longer held the previous checkpoint when the rename came: it was "
                       "written before the rename", WRITE_IN_PLACE_HINT)
        at = watch.events.index(renames[-1])
        synced = [e[1] for e in watch.events[:at] if e[0] == "fsync" and e[1].st_ino == src_stat.st_ino]
        if not synced:
            fail(what, "the temporary file was not fsynced before the rename", NO_FSYNC_HINT)
        if max(s.st_size for s in synced) < src_stat.st_size:
            fail(what, f"the fsync saw {max(s.st_size for s in synced)} bytes of the {src_stat.st_size} the file "
                       "had at the rename", FLUSH_HINT)
        folder = os.stat(directory).st_ino
        if not any(e[0] == "fsync" and stat.S_ISDIR(e[1].st_mode) and e[1].st_ino == folder
                   for e in watch.events[at + 1:]):
            fail(what, "the folder was not fsynced after the rename", DIR_FSYNC_HINT)
        left = sorted(set(os.listdir(directory)) - {os.path.basename(path)})
        if left:
            fail(what, f"it left {left} in the folder", "the rename moves the temporary file onto path; create "
                 "nothing else (and close what you open: os.fdopen(fd, 'wb') owns mkstemp's descriptor)")


# ----------------------------------------------------------------------------- 2. the newest valid file


@forbidding(*ENGINE_SAVES_AND_LOADS)
def check_load_latest(save, load_latest) -> None:
    """Check ``load_latest(directory)`` on folders written with ``save`` (see the module docstring,
    part 2). Raises AssertionError with a hint, LearnerError when your code raises."""
    check_own_code(load_latest, "load_latest")
    def latest(directory, what):
        got = call_learner(f"load_latest on a folder {what}", load_latest, directory, name="your load_latest",
                           hint=SKIP_HINT)
        return _as_dict(got, f"load_latest on a folder {what}")

    with tempfile.TemporaryDirectory(prefix="minidist-ex12-") as directory:
        got = latest(directory, "with no checkpoint")
        if got is not None:
            fail("load_latest on an empty folder", f"expected None (start from scratch), got {type(got).__name__}",
                 "return None when no file can be read: the first run of a job has no checkpoint")
        # Other files first (older than every checkpoint): two readable checkpoints under other names
        # (a save killed before its rename, a copy), a file that is not one, half a write.
        for stray, step in (("ckpt-000090.npz.tmp", 90), ("ckpt-000099-backup.npz", 99)):
            with open(os.path.join(directory, stray), "wb") as f:
                np.savez(f, **_state(step))
        with open(os.path.join(directory, "notes.txt"), "w") as f:
            f.write("not a checkpoint")
        with open(os.path.join(directory, ".ckpt-000090.npz.tmp"), "wb") as f:
            f.write(b"PK\x03\x04 the start of a write a kill interrupted")
        time.sleep(0.01)
        for step in (10, 30, 20):  # written out of order: the newest file by time is step 20
            call_learner(f"save_checkpoint at step {step}", save, checkpoint_name(directory, step), _state(step),
                         name="your save_checkpoint")
            time.sleep(0.01)
        cases = [("with steps 10, 30 and 20 (written in that order) and four other files, two of them readable "
                  "checkpoints under other names", None, NEWEST_HINT)]
        newest = checkpoint_name(directory, 30)
        whole = open(newest, "rb").read()
        cases.append(("whose newest file is cut in half", whole[: len(whole) // 2], SKIP_HINT))
        flipped = bytearray(whole)
        at = flipped.find(_state(30)["weight"].tobytes())
        if at < 0:  # saved compressed: no raw bytes to find
            at = len(flipped) // 2
        flipped[at + 11] ^= 0xFF
        cases.append(("whose newest file has one flipped byte in its weights", bytes(flipped), SKIP_HINT))
        for what, content, hint in cases:
            if content is not None:
                with open(newest, "wb") as f:
                    f.write(content)
            expected = 30 if content is None else 20
            got = latest(directory, what)
            if not _same(got, _state(expected)):
                step = None if got is None else int(np.asarray(got.get("step", -1)))
                fail(f"load_latest on a folder {what}",
                     f"expected the state of step {expected}, got " + ("None" if got is None else f"step {step}"),
                     hint)
        open(checkpoint_name(directory, 40), "wb").close()
        if not _same(latest(directory, "whose newest file is empty"), _state(20)):
            fail("load_latest on a folder whose newest file is empty", "expected the state of step 20", SKIP_HINT)


# ----------------------------------------------------------------------------- 3. kills


def _child(directory, save, load_latest, kill, step, pipe) -> None:
    """In the forked child: train, stopping forever at the kill point after telling the parent."""
    sys.stdout = sys.stderr = open(os.devnull, "w")  # the parent's streams (a notebook's) are not ours

    def stop():
        os.write(pipe, b"ready\n")
        time.sleep(CHILD_DEADLINE)
        os._exit(3)

    saving = {"path": None}
    real_replace, real_rename, real_fsync = os.replace, os.rename, os.fsync
    target = os.path.abspath(checkpoint_name(directory, step))

    def renamer(real):
        def rename(src, dst, *args, **kwargs):
            if kill == "before the rename" and os.path.abspath(dst) == target:
                stop()
            result = real(src, dst, *args, **kwargs)
            if kill == "after the rename" and os.path.abspath(dst) == target:
                stop()
            return result
        return rename

    def fsync(fd):
        if kill == "in the fsync" and saving["path"] == target and not stat.S_ISDIR(os.fstat(fd).st_mode):
            stop()
        return real_fsync(fd)

    def watched_save(path, state):
        saving["path"] = os.path.abspath(path)
        return save(path, state)

    os.replace, os.rename, os.fsync = renamer(real_replace), renamer(real_rename), fsync
    train(directory, watched_save, load_latest, on_step=lambda s: stop() if kill == "between saves" and s == step
          else None)
    os.write(pipe, b"finished without reaching the kill point\n")


def _run_and_kill(directory, save, load_latest, kill, step) -> None:
    """Fork a training run, wait (at most CHILD_DEADLINE s) until it reaches the kill point, SIGKILL it."""
    read, write = os.pipe()
    with warnings.catch_warnings():  # Python 3.12 warns that forking a threaded process (a kernel) may deadlock
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child never returns into the caller's code
        code = 0
        try:
            os.close(read)
            _child(directory, save, load_latest, kill, step, write)
        except BaseException as error:
            os.write(write, f"{type(error).__name__}: {error}".replace("\n", " ").encode()[:2000] + b"\n")
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    said = b""
    try:
        deadline = time.monotonic() + CHILD_DEADLINE
        while not said.endswith(b"\n") and (left := deadline - time.monotonic()) > 0:
            if not select.select([read], [], [], left)[0]:
                break
            chunk = os.read(read, 4096)
            if not chunk:
                break
            said += chunk
    finally:
        os.close(read)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    message = said.decode(errors="replace").strip()
    if message != "ready":
        hint = ("run the check's train(directory, save_checkpoint, load_latest) yourself and read the error"
                if not message.startswith("finished") or kill == "between saves" else
                "your save made no os.replace or os.fsync call for this checkpoint, so there was nothing to kill "
                "it in: write a temporary file, fsync it, os.replace it (check_atomic_save says what is missing)")
        fail(f"the training run to be killed {kill} at step {step}",
             message or f"it did not reach the kill point within {CHILD_DEADLINE:g} s", hint)


def check_kill_and_resume(save, load_latest) -> bool:
    """Kill :func:`train` four times (:data:`KILLS`), resume each time, compare with an
    uninterrupted run (see the module docstring, part 3). Returns False (nothing checked) where
    ``os.fork`` does not exist. Raises AssertionError with a hint, LearnerError from your code."""
    if not hasattr(os, "fork"):
        return False
    saved = {}

    def keep(path, state):
        saved[int(state["step"])] = {k: np.array(v) for k, v in state.items()}

    weight, velocity = train("(kept in memory)", keep, lambda directory: None)  # the uninterrupted run
    with tempfile.TemporaryDirectory(prefix="minidist-ex12-") as directory:
        for kill, step in KILLS:
            _run_and_kill(directory, save, load_latest, kill, step)
            expected = step // EVERY * EVERY if kill in ("between saves", "after the rename") else step - EVERY
            what = f"load_latest after a kill {kill} at step {step}"
            got = _as_dict(call_learner(what, load_latest, directory, name="your load_latest", hint=SKIP_HINT), what)
            if not _same(got, saved[expected]):
                found = "None" if got is None else f"step {int(np.asarray(got.get('step', -1)))}"
                fail(f"load_latest after the run was killed {kill} at step {step}",
                     f"expected the state saved at step {expected}, got {found}",
                     WRITE_IN_PLACE_HINT if kill != "between saves" and found != "None" else SKIP_HINT)
        resumed = train(directory, save, load_latest)
    for name, got, want in (("weight", resumed[0], weight), ("velocity", resumed[1], velocity)):
        if not np.array_equal(got, want):
            fail("the run killed four times and resumed", f"its final {name} differs from the uninterrupted run's "
                 f"(largest difference {np.max(np.abs(got - want)):.3g})",
                 "load_latest must give back every array exactly as saved (same dtype, nothing rounded)")
    return True


@forbidding(*ENGINE_SAVES_AND_LOADS)
def check_fault_tolerance(save, load_latest) -> str:
    """All three checks; returns a one-line verdict (stable text) when they pass."""
    check_atomic_save(save)
    check_load_latest(save, load_latest)
    killed = check_kill_and_resume(save, load_latest)
    kills = (f"{len(KILLS)} SIGKILLs ({', '.join(k for k, _ in KILLS)}) resumed to weights bitwise equal to an "
             "uninterrupted run's" if killed else "the kill test skipped (this system has no os.fork)")
    return ("checks pass: the save is atomic (temporary file in the same folder, flush and fsync, os.replace, folder "
            f"fsync), load_latest skips truncated, corrupt and empty files; {kills}")
