"""minidist.course.checks.fault (exercise 12): a correct save and resume pass every check, and
each usual mistake fails with its own hint. The oracle for "correct" is the textbook sequence
(temporary file in the same folder, flush, fsync, os.replace, folder fsync; Pillai et al. 2014)
and the uninterrupted run's weights."""
import glob
import os
import re
import tempfile
import zipfile

import numpy as np
import pytest

from minidist.course.checks import LearnerError
from minidist.course.checks import fault as fault_checks

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill test forks")


def fsync_folder(folder):
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def good_save(path, state):
    folder = os.path.dirname(os.path.abspath(path))
    fd, temporary = tempfile.mkstemp(dir=folder, suffix=".part")
    with os.fdopen(fd, "wb") as f:
        np.savez(f, **state)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    fsync_folder(folder)


def good_load(directory):
    for name in sorted((n for n in os.listdir(directory) if re.fullmatch(r"ckpt-\d{6}\.npz", n)), reverse=True):
        try:
            with np.load(os.path.join(directory, name)) as npz:
                return {k: npz[k] for k in npz.files}
        except (zipfile.BadZipFile, ValueError, OSError, EOFError):
            continue
    return None


def in_place(path, state):
    with open(path, "wb") as f:
        np.savez(f, **state)


def temp_in_tmp(path, state):
    fd, temporary = tempfile.mkstemp(suffix=".npz", dir=tempfile.mkdtemp())
    with os.fdopen(fd, "wb") as f:
        np.savez(f, **state)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def no_fsync(path, state):
    with open(path + ".tmp", "wb") as f:
        np.savez(f, **state)
    os.replace(path + ".tmp", path)


def no_folder_fsync(path, state):
    with open(path + ".tmp", "wb") as f:
        np.savez(f, **state)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def fsync_before_last_write(path, state):
    with open(path + ".tmp", "wb") as f:
        np.savez(f, **state)
        f.flush()
        os.fsync(f.fileno())
        f.write(b"\0" * 100)  # bytes the fsync did not cover
    os.replace(path + ".tmp", path)
    fsync_folder(os.path.dirname(os.path.abspath(path)))


def by_mtime(directory):
    for name in sorted(glob.glob(os.path.join(directory, "ckpt-*.npz")), key=os.path.getmtime, reverse=True):
        try:
            with np.load(name) as npz:
                return {k: npz[k] for k in npz.files}
        except (zipfile.BadZipFile, ValueError, OSError):
            continue
    return None


def no_try(directory):
    name = sorted(n for n in os.listdir(directory) if re.fullmatch(r"ckpt-\d{6}\.npz", n))
    if not name:
        return None
    with np.load(os.path.join(directory, name[-1])) as npz:
        return {k: npz[k] for k in npz.files}


def lazy(directory):
    for name in sorted((n for n in os.listdir(directory) if re.fullmatch(r"ckpt-\d{6}\.npz", n)), reverse=True):
        try:
            return np.load(os.path.join(directory, name))  # read later, outside the try
        except (zipfile.BadZipFile, ValueError, OSError):
            continue
    return None


def any_ckpt_npz(directory):
    """Newest name first among ckpt-*.npz, skipping what does not read: the right idea with a
    pattern too loose (a copy named ckpt-000099-backup.npz matches it)."""
    for name in sorted(glob.glob(os.path.join(directory, "ckpt-*.npz")), reverse=True):
        try:
            with np.load(name) as npz:
                return {k: npz[k] for k in npz.files}
        except (zipfile.BadZipFile, ValueError, OSError, EOFError):
            continue
    return None


def every_file(directory):
    """Every file, newest name first, skipping what does not read (notes.txt, half a write)."""
    for name in sorted(os.listdir(directory), reverse=True):
        try:
            with np.load(os.path.join(directory, name)) as npz:
                return {k: npz[k] for k in npz.files}
        except (zipfile.BadZipFile, ValueError, OSError, EOFError):
            continue
    return None


def step_prefix(directory):
    """Any name that starts like a checkpoint, by its step: re.match, not re.fullmatch."""
    found = sorted((int(m.group(1)), n) for n in os.listdir(directory) if (m := re.match(r"ckpt-(\d+)", n)))
    for _, name in reversed(found):
        try:
            with np.load(os.path.join(directory, name)) as npz:
                return {k: npz[k] for k in npz.files}
        except (zipfile.BadZipFile, ValueError, OSError, EOFError):
            continue
    return None


def test_a_correct_save_and_resume_pass_every_check():
    verdict = fault_checks.check_fault_tolerance(good_save, good_load)
    assert verdict.startswith("checks pass") and "4 SIGKILLs" in verdict


@pytest.mark.parametrize("save, problem, hint", [
    (in_place, "written in place", fault_checks.WRITE_IN_PLACE_HINT),
    (temp_in_tmp, "the temporary file was in", fault_checks.TEMP_ELSEWHERE_HINT),
    (no_fsync, "not fsynced before the rename", fault_checks.NO_FSYNC_HINT),
    (no_folder_fsync, "the folder was not fsynced", fault_checks.DIR_FSYNC_HINT),
    (fsync_before_last_write, "the fsync saw", fault_checks.FLUSH_HINT),
])
def test_each_unsafe_save_fails_with_its_hint(save, problem, hint):
    with pytest.raises(AssertionError) as failure:
        fault_checks.check_atomic_save(save)
    assert problem in str(failure.value) and hint in str(failure.value)


@pytest.mark.parametrize("load, problem", [
    (by_mtime, "expected the state of step 30, got step 20"),
    (no_try, "raised BadZipFile"),
    (lazy, "the state returned cannot be read (BadZipFile"),
    (lambda directory: None, "expected the state of step 30, got None"),
    # The old check's stray files did not read, so these three passed it.
    (any_ckpt_npz, "expected the state of step 30, got step 99"),
    (every_file, "expected the state of step 30, got step 99"),
    (step_prefix, "expected the state of step 30, got step 99"),
])
def test_each_unsafe_resume_fails_with_a_hint(load, problem):
    with pytest.raises(AssertionError) as failure:
        fault_checks.check_load_latest(good_save, load)
    assert problem in str(failure.value) and "Hint: " in str(failure.value)


def test_a_stub_is_reported_as_a_stub():
    def stub(path, state):
        raise NotImplementedError()

    with pytest.raises(LearnerError, match="still a stub"):
        fault_checks.check_atomic_save(stub)


def test_kills_catch_a_resume_that_loses_the_momentum():
    def forgets_momentum(directory):
        state = good_load(directory)
        if state is not None:
            state["velocity"] = np.zeros_like(state["velocity"])
        return state

    # check_load_latest compares velocity too; the kill test alone must still see the difference
    with pytest.raises(AssertionError, match="load_latest after the run was killed between saves at step 37"):
        fault_checks.check_kill_and_resume(good_save, forgets_momentum)


def test_kills_find_the_newest_finished_save_and_the_resumed_weights_match():
    # The oracle: the textbook save and resume give the uninterrupted weights (the check's own
    # comparison), and a save that never renames is stopped by the first rename-point kill.
    assert fault_checks.check_kill_and_resume(good_save, good_load) is True
    with pytest.raises(AssertionError, match="finished without reaching the kill point(.|\n)*no os.replace"):
        fault_checks.check_kill_and_resume(in_place, good_load)


def test_a_save_that_lets_savez_rename_its_file_gets_the_savez_hint():
    def savez_to_a_name(path, state):
        np.savez(path + ".tmp", **state)  # writes path.tmp.npz
        os.replace(path + ".tmp", path)

    with pytest.raises(LearnerError, match="np.savez adds '.npz'"):
        fault_checks.check_atomic_save(savez_to_a_name)


def test_the_engines_save_and_load_are_not_answers():
    """The old check passed the engine's atomic save (checkpoint_io.save_checkpoint) and a
    load_latest calling the engine's latest_valid_checkpoint."""
    from minidist import checkpoint_io

    with pytest.raises(AssertionError, match=r"save_checkpoint: this is minidist.checkpoint_io.save_checkpoint, the "
                                             r"engine's own implementation, not yours"):
        fault_checks.check_atomic_save(checkpoint_io.save_checkpoint)

    def save_via_engine(path, state):
        checkpoint_io.save_checkpoint(path, state)

    with pytest.raises(LearnerError, match="called minidist.checkpoint_io.save_checkpoint, the engine's own"):
        fault_checks.check_atomic_save(save_via_engine)

    def load_via_engine(directory):
        found = checkpoint_io.latest_valid_checkpoint(directory)
        return None if found is None else found[1]

    with pytest.raises(LearnerError, match="called minidist.checkpoint_io.latest_valid_checkpoint, the engine's own"):
        fault_checks.check_load_latest(good_save, load_via_engine)
    with tempfile.TemporaryDirectory() as folder:  # the engine's functions work again afterwards
        checkpoint_io.save_checkpoint(os.path.join(folder, "x.npz"), {"a": np.ones(2)})
        assert checkpoint_io.load_checkpoint(os.path.join(folder, "x.npz"))["a"].tolist() == [1.0, 1.0]
