"""What a run writes and reads besides its steps: the final weights (``--save-model``, atomic) and
checkpoints that are edited behind a valid checksum, dangling or all corrupt (issue 18, 4.3 and
4.5). Each problem must be named (the field, the file), never a crash deep inside training or a
silent "no checkpoint yet"."""
import dataclasses
import errno
import os

import numpy as np
import pytest

from minidist import data, fault, train
from minidist.checkpoint_io import (
    CheckpointError,
    CheckpointWarning,
    checkpoint_path,
    latest_valid_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)

DIGITS = data.load_digits(seed=0)


def single(directory, **fields):
    base = dict(epochs=2, hidden=(16,), progress=False, checkpoint_dir=str(directory), checkpoint_every=10)
    return train.TrainConfig(**{**base, **fields})


# -- save_model is atomic ------------------------------------------------------------------------

def test_a_full_disk_during_save_model_keeps_the_previous_weights(tmp_path, monkeypatch):
    target = tmp_path / "weights.npz"
    config = train.TrainConfig(epochs=1, hidden=(16,), progress=False, save_model=str(target))
    first = train.train_single(config, DIGITS, report=False)
    before = target.read_bytes()
    real = np.savez

    def full_disk(file, *args, **arrays):  # half of the archive reaches the disk, then ENOSPC
        handle = open(file, "wb") if isinstance(file, (str, os.PathLike)) else file
        handle.write(b"PK\x03\x04 half an archive")
        handle.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "savez", full_disk)
    with pytest.raises(CheckpointError, match="the disk is full; nothing was written there"):
        train.train_single(dataclasses.replace(config, epochs=2), DIGITS, report=False)
    monkeypatch.setattr(np, "savez", real)
    assert target.read_bytes() == before  # the previous weights, intact
    assert [p.name for p in tmp_path.iterdir()] == ["weights.npz"]  # no temporary file left
    with np.load(target) as saved:
        assert all(np.array_equal(saved[k], v) for k, v in first.model.state_dict().items())


def test_save_model_appends_npz_as_numpy_does(tmp_path):
    config = train.TrainConfig(epochs=1, hidden=(16,), progress=False, save_model=str(tmp_path / "weights"))
    train.train_single(config, DIGITS, report=False)
    assert [p.name for p in tmp_path.iterdir()] == ["weights.npz"]


# -- checkpoints edited behind a valid checksum ------------------------------------------------

@pytest.fixture(scope="module")
def saved_state(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpt")
    with pytest.raises(fault.TrainingStopped):
        train.train_single(single(directory, stop_after_steps=25), DIGITS, report=False)
    return directory, load_checkpoint(list_checkpoints(directory)[-1][1])


def edited(state, change):
    optimizer = {**state["optimizer"], "velocity": list(state["optimizer"]["velocity"])}
    copy = {**state, "position": dict(state["position"]), "optimizer": optimizer}
    change(copy)
    return copy


def resume_from(tmp_path, state):
    save_checkpoint(checkpoint_path(tmp_path, 20), state)  # a valid checksum over the edited state
    train.train_single(single(tmp_path, resume=True), DIGITS, report=False)


@pytest.mark.parametrize("change,message", [
    (lambda s: s["optimizer"]["velocity"].__setitem__(0, np.zeros((3, 3), np.float32)),
     r"optimizer\.velocity\[0\] has shape \(3, 3\), its parameter \(16, 64\)"),
    (lambda s: s["optimizer"].__setitem__("velocity", s["optimizer"]["velocity"][:2]),
     "optimizer.velocity holds 2 buffers for 4 parameters"),
    (lambda s: s["position"].__setitem__("epoch", -1), r"position\.epoch must be an integer >= 0, got -1"),
    (lambda s: s["position"].__setitem__("global_step", 7), "position.global_step 7 is not the checkpoint's step 20"),
    (lambda s: s["position"].__setitem__("loss_total", float("nan")), "position.loss_total must be a finite number"),
    (lambda s: s.pop("model"), "the state lacks model"),
    (lambda s: s["position"].pop("history"), "position lacks history"),
    (lambda s: s["optimizer"].pop("lr"), "optimizer lacks lr"),
    (lambda s: s.__setitem__("step", -1), "step must be an integer >= 0, got -1"),
])
def test_an_edited_checkpoint_is_refused_naming_the_field(tmp_path, saved_state, change, message):
    with pytest.raises(CheckpointError, match=message):
        resume_from(tmp_path, edited(saved_state[1], change))


def test_an_unedited_copy_resumes(tmp_path, saved_state):
    resume_from(tmp_path, saved_state[1])  # the oracle of the test above: the same path works untouched


# -- folders whose files cannot be used ----------------------------------------------------------

def test_a_dangling_symlink_and_only_corrupt_files_are_named_not_no_checkpoint_yet(tmp_path, saved_state):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    os.symlink(tmp_path / "gone.npz", checkpoint_path(directory, 30))
    with pytest.warns(CheckpointWarning), pytest.raises(
            CheckpointError, match=r"holds 1 checkpoint file and none is usable \(checkpoint .*ckpt-00000030\.npz: a "
                                   r"dangling symbolic link \(to '.*gone\.npz'"):
        latest_valid_checkpoint(directory)
    good = saved_state[0] / "ckpt-00000020.npz"
    (directory / "ckpt-00000020.npz").write_bytes(good.read_bytes()[:500])  # truncated
    with pytest.warns(CheckpointWarning), pytest.raises(CheckpointError, match="holds 2 checkpoint files and "
                                                                                     "none is usable"):
        train.train_single(single(directory, resume=True), DIGITS, report=False)


def test_a_dangling_symlink_as_the_folder_is_named(tmp_path):
    os.symlink(tmp_path / "nowhere", tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=r"ckpt is a dangling symbolic link \(to '.*nowhere'"):
        train.train_single(single(tmp_path / "ckpt", resume=True), DIGITS, report=False)
