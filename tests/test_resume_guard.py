"""Resume never silently changes the run (issue 18, section 4.2).

- the flags that change what a step computes (precision, loss scale, comm hook, top-k ratio, as
  lr) are compared with the checkpoint's: CheckpointMismatchError naming the field;
- --epochs may grow (one line says so) but not end before the checkpoint's epoch;
- one run writes a folder at a time (a lock file naming pid and host; a stale one is taken
  over with a warning);
- a folder of another run is refused, also on a first start without --resume.
"""
import dataclasses
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from minidist import data, fault, sim, train
from minidist.checkpoint_io import LOCK_NAME, CheckpointMismatchError, CheckpointWarning, list_checkpoints
from minidist.parallel.data_parallel.train import train_ddp
from minidist.parallel.pipeline.train import train_pipeline

ROOT = Path(__file__).resolve().parents[1]
DIGITS = data.load_digits(seed=0)


def single(directory, **fields):
    base = dict(epochs=2, hidden=(16,), progress=False, checkpoint_dir=str(directory), checkpoint_every=10)
    return train.TrainConfig(**{**base, **fields})


def stop_single(config, after=25):
    with pytest.raises(fault.TrainingStopped):
        train.train_single(dataclasses.replace(config, stop_after_steps=after), DIGITS, report=False)


@pytest.mark.parametrize("saved,resumed,field", [
    ({}, {"precision": "bf16"}, "precision: 'fp32' there, 'bf16' here"),
    ({"precision": "fp16", "loss_scale": 1024.0}, {"precision": "fp16", "loss_scale": 512.0},
     "loss_scale: 1024.0 there, 512.0 here"),
    ({"precision": "fp16"}, {"precision": "fp16", "loss_scale": 1024.0}, "loss_scale: 'dynamic' there, 1024.0 here"),
    ({"lr": 0.05}, {"lr": 0.1}, "lr: 0.05 there, 0.1 here"),
])
def test_single_resume_refuses_a_changed_step_flag(tmp_path, saved, resumed, field):
    stop_single(single(tmp_path, **saved))
    with pytest.raises(CheckpointMismatchError, match=field.replace("(", r"\(")):
        train.train_single(single(tmp_path, resume=True, **resumed), DIGITS, report=False)


def test_the_default_loss_scale_and_dynamic_are_one_setting(tmp_path):
    stop_single(single(tmp_path, precision="fp16"))
    result = train.train_single(single(tmp_path, resume=True, precision="fp16", loss_scale="dynamic"), DIGITS,
                                report=False)
    assert result.history[-1]["epoch"] == 2


def ddp_run(directory, **fields):
    base = dict(strategy="ddp", epochs=1, hidden=(16,), progress=False, timeout=60, checkpoint_dir=str(directory),
                checkpoint_every=5)
    return sim.run(train_ddp, 2, train.TrainConfig(**{**base, **fields}), DIGITS)


@pytest.mark.parametrize("saved,resumed,field", [
    ({}, {"comm_hook": "int8"}, "comm_hook: 'none' there, 'int8' here"),
    ({"comm_hook": "topk", "topk_ratio": 0.05}, {"comm_hook": "topk", "topk_ratio": 0.1},
     "topk_ratio: 0.05 there, 0.1 here"),
])
def test_ddp_resume_refuses_another_comm_hook_or_ratio(tmp_path, saved, resumed, field):
    with pytest.raises(fault.TrainingStopped):
        ddp_run(tmp_path, stop_after_steps=7, **saved)
    with pytest.raises(CheckpointMismatchError, match=field):
        ddp_run(tmp_path, resume=True, **resumed)


def test_epochs_may_grow_with_a_line_but_not_end_before_the_checkpoint(tmp_path, capsys):
    config = single(tmp_path, epochs=3)
    stop_single(config, after=100)  # 43 steps an epoch: the checkpoint of step 100 lies in epoch 3
    with pytest.raises(CheckpointMismatchError, match=r"lies in epoch 3, past the end of this run \(epochs: 2\); "
                                                      r"give --epochs 3 or more"):
        train.train_single(single(tmp_path, epochs=2, resume=True), DIGITS)
    assert "final" not in capsys.readouterr().out
    grown = train.train_single(single(tmp_path, epochs=4, resume=True), DIGITS)
    assert [row["epoch"] for row in grown.history] == [1, 2, 3, 4]
    assert "resume: epochs 3 in the checkpoint, 4 now: the run continues to the new last epoch" in \
        capsys.readouterr().out


# -- another run's folder -------------------------------------------------------------------

def test_a_first_start_into_a_folder_of_another_run_is_refused_before_training(tmp_path, capsys):
    stop_single(single(tmp_path))
    before = [p for _, p in list_checkpoints(tmp_path)]
    with pytest.raises(CheckpointMismatchError, match="precision: 'fp32' there, 'bf16' here"):
        train.train_single(single(tmp_path, precision="bf16"), DIGITS)  # no --resume
    assert "epoch 1/2" not in capsys.readouterr().out  # refused before the first step
    assert [p for _, p in list_checkpoints(tmp_path)] == before  # nothing of the other run touched


def test_a_first_start_into_a_folder_of_this_run_says_so(tmp_path, capsys):
    stop_single(single(tmp_path))
    capsys.readouterr()
    train.train_single(single(tmp_path, epochs=1), DIGITS)
    assert f"note: {tmp_path} already holds this run's checkpoints (the newest: step 20); starting from scratch " \
           "since --resume is not given" in capsys.readouterr().out


def test_ddp_and_pipeline_refuse_a_single_process_folder(tmp_path):
    stop_single(single(tmp_path))
    with pytest.raises(CheckpointMismatchError, match="strategy: 'single' there, 'ddp' here"):
        ddp_run(tmp_path, resume=True)
    config = train.TrainConfig(strategy="pipeline", epochs=1, hidden=(16, 16), progress=False, timeout=60,
                               checkpoint_dir=str(tmp_path), resume=True)
    with pytest.raises(CheckpointMismatchError, match="strategy: 'single' there, 'pipeline' here"):
        sim.run(train_pipeline, 2, config, DIGITS)


# -- one writer per folder ---------------------------------------------------------------------

def write_lock(directory, pid):
    os.makedirs(directory, exist_ok=True)
    (Path(directory) / LOCK_NAME).write_text(f"pid={pid} host={socket.gethostname()}\n")


def test_a_live_runs_lock_is_refused_naming_pid_and_host(tmp_path):
    write_lock(tmp_path, os.getppid())  # a live process that is not this one
    with pytest.raises(CheckpointMismatchError, match=rf"in use by another run \(pid {os.getppid()} on host "
                                                      rf"{socket.gethostname()}"):
        train.train_single(single(tmp_path, epochs=1), DIGITS, report=False)
    assert list_checkpoints(tmp_path) == []


def test_a_stale_lock_is_taken_over_with_a_warning_and_released_at_the_end(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_lock(tmp_path, dead.pid)
    with pytest.warns(CheckpointWarning, match=f"took over the stale lock of pid {dead.pid}"):
        train.train_single(single(tmp_path, epochs=1), DIGITS, report=False)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [20, 30, 40]
    assert not (tmp_path / LOCK_NAME).exists()  # save_model (the run's end) released it


HOLDER = """
import sys, time
from minidist.checkpoint_io import CheckpointLock
CheckpointLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(120)
"""


def test_a_second_run_into_a_folder_in_use_is_refused_then_takes_it_over_once_the_first_is_gone(tmp_path):
    """A process holds the folder's lock (as a run does while it trains): ``train`` into that
    folder stops before its first step naming the holder's pid and host (two runs there used
    to delete each other's temporary files, one dying with ENOENT). Once the holder is killed
    (its lock left behind, as after SIGKILL) the next run takes the lock over with a warning."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    args = [sys.executable, "-m", "minidist", "train", "--epochs", "1", "--hidden", "16", "--no-progress",
            "--checkpoint-every", "10", "--checkpoint-dir", str(tmp_path)]
    try:
        assert holder.stdout.readline().strip() == "locked"
        second = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stderr  # CheckpointMismatchError: a usage error, never retried
        assert f"in use by another run (pid {holder.pid} on host {socket.gethostname()}" in second.stderr
        assert "Traceback" not in second.stderr and "epoch 1/1" not in second.stdout
        assert list_checkpoints(tmp_path) == []
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    third = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert third.returncode == 0, third.stderr
    assert f"took over the stale lock of pid {holder.pid}" in third.stderr
    assert not (tmp_path / LOCK_NAME).exists() and len(list_checkpoints(tmp_path)) == 3


def test_the_lock_sits_beside_the_checkpoints_and_is_not_one(tmp_path):
    write_lock(tmp_path, os.getpid())  # this process: an earlier run in it (taken again silently)
    train.train_single(single(tmp_path, epochs=1), DIGITS, report=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000020.npz", "ckpt-00000030.npz",
                                                           "ckpt-00000040.npz"]


# -- the checkpoint knows its data (issue 36, item 4) -------------------------------------------


def write_mnist(directory, seed, compress=False, n=48):
    """Four small MNIST IDX files of ``n`` training and 12 test images drawn from ``seed``."""
    import gzip
    import struct

    import numpy as np

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    ext = ".gz" if compress else ""
    for split, count in (("train", n), ("t10k", 12)):
        for kind, array in (("images-idx3", rng.integers(0, 256, (count, 28, 28), dtype=np.uint8)),
                            ("labels-idx1", rng.integers(0, 10, count, dtype=np.uint8))):
            header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}i", *array.shape)
            with (gzip.open if compress else open)(directory / f"{split}-{kind}-ubyte{ext}", "wb") as f:
                f.write(header + array.tobytes())
    return directory


def mnist_run(directory, data_dir, **fields):
    config = single(directory, dataset="mnist", data_dir=str(data_dir), batch_size=8, checkpoint_every=2, **fields)
    return config, data.load_mnist(data_dir)


def test_a_resume_on_other_images_of_the_same_sizes_is_refused_naming_the_data(tmp_path):
    """Stopped on the images of folder a, resumed with --data-dir b (other images, the same
    sizes) or with a's images replaced: before, it trained on silently; now the checkpoint's
    fingerprint of the training arrays differs and the resume is refused, naming --data-dir.
    The same arrays gzipped resume."""
    first = write_mnist(tmp_path / "a", seed=1)
    config, dataset = mnist_run(tmp_path / "run", first)
    with pytest.raises(fault.TrainingStopped):
        train.train_single(dataclasses.replace(config, stop_after_steps=3), dataset, report=False)
    other = write_mnist(tmp_path / "b", seed=2)
    resumed, other_data = mnist_run(tmp_path / "run", other, resume=True)
    with pytest.raises(CheckpointMismatchError, match=r"the training data differ from the checkpoint's: --data-dir "
                                                      r".*/b holds other images or labels than the run was trained on"):
        train.train_single(resumed, other_data, report=False)
    write_mnist(first, seed=3)  # the same folder, its images replaced
    resumed, replaced = mnist_run(tmp_path / "run", first, resume=True)
    with pytest.raises(CheckpointMismatchError, match="the training data differ from the checkpoint's"):
        train.train_single(resumed, replaced, report=False)
    same = write_mnist(tmp_path / "gz", seed=1, compress=True)
    resumed, same_data = mnist_run(tmp_path / "run", same, resume=True)
    assert train.train_single(resumed, same_data, report=False) is not None
