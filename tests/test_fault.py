"""Training checkpoints (minidist.fault, fault.Checkpointer, train --checkpoint-dir/--resume).

The oracle of resume is the uninterrupted run: a run stopped after step K (the hidden
``--stop-after-steps K``, which stops as a kill would: the steps since the last checkpoint are
lost and redone) and resumed must end with bit-identical weights. Corruption is made by hand
(truncating, flipping a byte, leaving a half-written temporary file)."""
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mpitools import assert_bit_identical
from mpitools import mpirun_minidist as mpirun
from mpitools import saved_weights as weights
from scenarios import assert_same_weights, on_sim, stop_and_resume

from minidist import backend, checkpoint_io, collectives, data, fault, train
from minidist.cli.train import DRIVERS

ROOT = Path(__file__).resolve().parents[1]


def run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "minidist", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)





def sample_state(seed=0):
    rng = np.random.default_rng(seed)
    return {"step": 7, "model": {"0.weight": rng.standard_normal((3, 2)).astype(np.float32)},
            "velocity": [None, np.arange(4.0)], "rng": rng.bit_generator.state, "lr": 0.1 / 3}


# -- the file format -----------------------------------------------------------------------

def test_save_and_load_round_trip_exactly(tmp_path):
    state = sample_state()
    checkpoint_io.save_checkpoint(tmp_path / "a.npz", state)
    back = checkpoint_io.load_checkpoint(tmp_path / "a.npz")
    assert back["step"] == 7 and back["lr"] == 0.1 / 3 and back["velocity"][0] is None
    assert np.array_equal(back["model"]["0.weight"], state["model"]["0.weight"])
    assert back["model"]["0.weight"].dtype == np.float32
    assert back["rng"] == state["rng"]  # 128-bit PCG64 state through JSON
    assert [p.name for p in tmp_path.iterdir()] == ["a.npz"]  # no temporary file left


def test_truncated_flipped_and_foreign_files_are_named(tmp_path):
    path = tmp_path / "a.npz"
    checkpoint_io.save_checkpoint(path, sample_state())
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(checkpoint_io.CheckpointError, match=r"a\.npz: truncated or corrupt"):
        checkpoint_io.load_checkpoint(path)
    flipped = bytearray(raw)
    flipped[raw.index(sample_state()["model"]["0.weight"].tobytes()) + 5] ^= 0x01  # inside an array's data
    path.write_bytes(bytes(flipped))
    with pytest.raises(checkpoint_io.CheckpointError, match=r"a\.npz: (bad checksum|truncated or corrupt)"):
        checkpoint_io.load_checkpoint(path)
    np.savez(path, w=np.zeros(3))
    with pytest.raises(checkpoint_io.CheckpointError, match="not a minidist checkpoint"):
        checkpoint_io.load_checkpoint(path)
    with pytest.raises(checkpoint_io.CheckpointError, match="no such file"):
        checkpoint_io.load_checkpoint(tmp_path / "missing.npz")


def test_checksum_catches_what_the_zip_does_not(tmp_path):
    """Rewrite one array with a changed value but a valid zip (its CRC recomputed): only the
    SHA-256 over the payload can tell."""
    path = tmp_path / "a.npz"
    checkpoint_io.save_checkpoint(path, sample_state())
    with np.load(path) as npz:
        entries = {k: npz[k] for k in npz.files}
    entries["model/0.weight"] = entries["model/0.weight"] + np.float32(1e-3)
    np.savez(path, **entries)
    with pytest.raises(checkpoint_io.CheckpointError, match="bad checksum"):
        checkpoint_io.load_checkpoint(path)


def test_keep_last_k_and_newest_valid_skips_corrupt_ones(tmp_path):
    for step in (10, 20, 30, 40):
        checkpoint_io.save_training_checkpoint(tmp_path, step, {"step": step}, keep=3)
    assert [s for s, _ in checkpoint_io.list_checkpoints(tmp_path)] == [20, 30, 40]
    newest = checkpoint_io.checkpoint_path(tmp_path, 40)
    raw = Path(newest).read_bytes()
    Path(newest).write_bytes(raw[:-40])  # truncated
    with pytest.warns(checkpoint_io.CheckpointWarning, match="ckpt-00000040.npz"):
        path, state = checkpoint_io.latest_valid_checkpoint(tmp_path)
    assert state["step"] == 30 and path.endswith("ckpt-00000030.npz")
    assert checkpoint_io.latest_valid_checkpoint(tmp_path / "nothing") is None


def test_a_kill_during_a_write_leaves_the_previous_checkpoint(tmp_path):
    """A kill mid-write leaves a temporary file (never under a checkpoint's name, since only the
    rename gives it one); a partial file under the final name (a copy tool's, not ours) fails its
    checks. Either way the previous checkpoint is the one resumed."""
    checkpoint_io.save_training_checkpoint(tmp_path, 10, {"step": 10})
    good = Path(checkpoint_io.checkpoint_path(tmp_path, 10)).read_bytes()
    (tmp_path / ".ckpt-00000020.npz.k1ll3d.tmp").write_bytes(good[:100])
    assert checkpoint_io.latest_valid_checkpoint(tmp_path)[1]["step"] == 10
    Path(checkpoint_io.checkpoint_path(tmp_path, 20)).write_bytes(good[: len(good) // 3])
    with pytest.warns(checkpoint_io.CheckpointWarning, match="ckpt-00000020.npz: truncated"):
        assert checkpoint_io.latest_valid_checkpoint(tmp_path)[1]["step"] == 10
    assert Path(checkpoint_io.checkpoint_path(tmp_path, 10)).read_bytes() == good


def test_a_failed_write_keeps_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "a.npz"
    checkpoint_io.save_checkpoint(path, {"step": 1})
    with pytest.raises(TypeError, match="JSON"):
        checkpoint_io.save_checkpoint(path, {"step": object()})  # JSON cannot hold it: fails before the write
    with pytest.raises(TypeError, match="bad is an array of Python objects"):
        checkpoint_io.save_checkpoint(path, {"step": 2, "bad": np.zeros(3, dtype=object)})

    def dies_mid_write(file, **arrays):
        file.write(b"PK\x03\x04 half a zip")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_io.np, "savez", dies_mid_write)
    with pytest.raises(OSError, match="No space left"):
        checkpoint_io.save_checkpoint(path, {"step": 3, "w": np.zeros(3)})
    assert checkpoint_io.load_checkpoint(path) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["a.npz"]


# -- resume: bit-identical to the uninterrupted run ------------------------------------------

COMMON = ["train", "--epochs", "3", "--no-progress", "--warmup-epochs", "1", "--checkpoint-every", "10"]


@pytest.mark.parametrize("every,stop,kept,where,epochs_before", [
    (10, 67, [40, 50, 60], "step 60, epoch 2, batch 17", 1),  # mid-epoch; steps 61..67 redone
    (43, 50, [43], "step 43, epoch 1, batch 43", 0),  # saved at an epoch's last step, before its report
])
def test_single_stopped_and_resumed_is_bit_identical(tmp_path, every, stop, kept, where, epochs_before):
    """digits, batch 32: 43 steps an epoch. The run stopped after step ``stop`` resumes from
    its newest checkpoint and ends with the uninterrupted run's weights, bit for bit."""
    args = [*COMMON[:-2], "--checkpoint-every", str(every)]
    full = run(*args, "--checkpoint-dir", tmp_path / "a", "--save-model", tmp_path / "full.npz")
    assert full.returncode == 0, full.stderr
    stopped = run(*args, "--checkpoint-dir", tmp_path / "b", "--stop-after-steps", str(stop))
    assert stopped.returncode == 0 and f"stopped after step {stop}" in stopped.stdout, stopped.stderr
    assert [s for s, _ in checkpoint_io.list_checkpoints(tmp_path / "b")] == kept
    resumed = run(*args, "--checkpoint-dir", tmp_path / "b", "--resume", "--save-model", tmp_path / "res.npz")
    assert resumed.returncode == 0, resumed.stderr
    assert "resume: from" in resumed.stdout and where in resumed.stdout
    assert_bit_identical(weights(tmp_path / "full.npz"), weights(tmp_path / "res.npz"))
    # the resumed epochs print the same lines (loss over the whole epoch, accuracies)
    lines = [line.split("time=")[0] for line in full.stdout.splitlines() if line.startswith("epoch ")]
    assert len(lines) == 3
    assert [line.split("time=")[0] for line in resumed.stdout.splitlines()
            if line.startswith("epoch ")] == lines[epochs_before:]


KILLED_MID_WRITE = """
import os, signal, sys
import numpy as np
from minidist import cli
real, saves = np.savez, []
def savez(file, **arrays):  # the 7th save (step 70): half the file written, then SIGKILL
    saves.append(1)
    real(file, **arrays)
    if len(saves) == 7:
        file.flush()
        file.truncate(file.tell() // 2)
        file.flush()
        os.kill(os.getpid(), signal.SIGKILL)
np.savez = savez
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
def test_sigkill_during_a_write_then_resume_is_bit_identical(tmp_path):
    """A real SIGKILL in the middle of writing the checkpoint of step 70: the stale temporary
    file is ignored, step 60 is intact, and the resumed run matches the uninterrupted one."""
    full = run(*COMMON, "--checkpoint-dir", tmp_path / "a", "--save-model", tmp_path / "full.npz")
    assert full.returncode == 0, full.stderr
    killed = subprocess.run([sys.executable, "-c", KILLED_MID_WRITE, *COMMON, "--checkpoint-dir", tmp_path / "b"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert killed.returncode == -9, killed.stderr
    names = sorted(p.name for p in (tmp_path / "b").iterdir())
    assert names[2:] == ["ckpt-00000040.npz", "ckpt-00000050.npz", "ckpt-00000060.npz"]
    assert names[0].startswith(".ckpt-00000070.npz.") and names[0].endswith(".tmp")  # the half-written file
    assert names[1] == ".lock"  # the killed run's, stale now
    resumed = run(*COMMON, "--checkpoint-dir", tmp_path / "b", "--resume", "--save-model", tmp_path / "res.npz")
    assert resumed.returncode == 0, resumed.stderr
    assert "took over the stale lock of pid" in resumed.stderr
    assert "step 60, epoch 2, batch 17" in resumed.stdout
    assert_bit_identical(weights(tmp_path / "full.npz"), weights(tmp_path / "res.npz"))
    assert not [p for p in (tmp_path / "b").iterdir() if p.name.endswith(".tmp")]  # the next save removed it


def test_resume_restores_momentum_and_schedule():
    """In-process, from a state captured after step 50: the resumed weights match the
    uninterrupted run's bit for bit, and a state without the momentum buffers or with the
    warm-up counter reset does not (so the test would see either part missing)."""
    dataset = data.load_digits(seed=0)
    config = train.TrainConfig(epochs=2, progress=False, warmup_epochs=1)
    reference = train.train_single(config, dataset, report=False).model.state_dict()

    captured = {}

    class Capture(fault.Checkpointer):
        def __call__(self, position):
            if position["global_step"] == 50:
                captured.update(self.state(position))
                raise fault.TrainingStopped(50)

    with pytest.raises(fault.TrainingStopped):
        train.train_single(config, dataset, report=False, checkpointer_class=Capture)

    def resume_with(state):
        model = train.build_model(config, dataset)
        optimizer = train.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
        loader = data.DataLoader(dataset.X_train, dataset.y_train, batch_size=32, seed=0)
        warmup = train.warmup_schedule(optimizer, config, len(loader))
        ckpt = fault.Checkpointer(config, model, optimizer, warmup)
        start = ckpt.load(state, "memory")
        train.fit(train.supervised_step(model, optimizer, lr_schedule=warmup), loader, 2, start=start)
        return model.state_dict()

    for k, v in resume_with(captured).items():
        assert np.array_equal(v, reference[k])
    no_momentum = {**captured, "optimizer": {**captured["optimizer"], "velocity": [None] * 4}}
    no_warmup = {**captured, "lr_schedule": {**captured["lr_schedule"], "count": 0}}
    for broken in (no_momentum, no_warmup):
        assert any(not np.array_equal(v, reference[k]) for k, v in resume_with(broken).items())


def test_resume_refuses_a_checkpoint_of_another_configuration(tmp_path):
    stopped = run(*COMMON, "--checkpoint-dir", tmp_path, "--stop-after-steps", "20")
    assert stopped.returncode == 0, stopped.stderr
    other = run(*COMMON, "--checkpoint-dir", tmp_path, "--resume", "--batch-size", "16")
    assert other.returncode == 2  # CheckpointMismatchError: a usage error, never retried by launch
    assert "written by another run (batch_size: 32 there, 16 here)" in other.stderr
    fresh = run(*COMMON, "--checkpoint-dir", tmp_path, "--precision", "bf16")  # a first start, no --resume
    assert fresh.returncode == 2 and "precision: 'fp32' there, 'bf16' here" in fresh.stderr
    assert "epoch 1/3" not in fresh.stdout


def test_an_unwritable_checkpoint_stops_with_a_clear_error(tmp_path):
    (tmp_path / "blocked").write_text("a file where the checkpoint folder should be created")
    done = run("train", "--epochs", "1", "--no-progress", "--checkpoint-dir", tmp_path / "blocked" / "ckpt",
               "--checkpoint-every", "5")
    assert done.returncode == 1
    assert "cannot write in the checkpoint folder" in done.stderr and "Not a directory" in done.stderr
    assert "Traceback" not in done.stderr and "epoch 1/1" not in done.stdout  # refused before the first step


def test_resume_with_an_empty_directory_starts_from_scratch(tmp_path):
    done = run("train", "--epochs", "1", "--no-progress", "--checkpoint-dir", tmp_path, "--resume")
    assert done.returncode == 0, done.stderr
    assert "no checkpoint in" in done.stdout and "starting from scratch" in done.stdout


@pytest.mark.parametrize("args,message", [
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir"),
    (["--checkpoint-dir", "x", "--checkpoint-every", "0"], "must be a positive integer"),
    (["--strategy", "ps", "--ps-mode", "async", "--checkpoint-dir", "x"], "applies to --ps-mode sync only"),
    (["--strategy", "ps", "--ps-mode", "ssp", "--resume", "--checkpoint-dir", "x"], "applies to --ps-mode sync"),
    (["--strategy", "pipeline", "--schedule", "pipedream", "--save-model", "m.npz"],
     "applies to the flushing schedules only"),
    (["--kill-at-step", "3"], "--kill-at-step needs --checkpoint-dir"),
    (["--checkpoint-dir", "x", "--kill-rank", "1"], "--kill-rank needs --kill-at-step"),
    (["--checkpoint-dir", "x", "--kill-at-step", "3", "--kill-rank", "1"], "--kill-rank 1 names no rank"),
    (["--save-model", "no/such/folder/m.npz"], "the folder 'no/such/folder' does not exist"),
    (["--checkpoint-dir", "README.md"], "is a file, not a folder"),
])
def test_checkpoint_usage_errors(args, message):
    done = run("train", *args)
    assert done.returncode == 2
    assert message in done.stderr


@pytest.mark.mpi
def test_ddp_stopped_mid_epoch_and_resumed_is_bit_identical(tmp_path):
    """mpiexec -n 2: rank 0 writes, both ranks load the file; 22 steps an epoch, stopped after
    step 35 (epoch 2), resumed from step 30."""
    ddp = [*COMMON, "--strategy", "ddp", "--timeout", "60"]
    full = mpirun(2, *ddp, "--checkpoint-dir", tmp_path / "a", "--save-model", tmp_path / "full.npz")
    assert full.returncode == 0, full.stdout + full.stderr
    stopped = mpirun(2, *ddp, "--checkpoint-dir", tmp_path / "b", "--stop-after-steps", "35")
    assert stopped.returncode == 0 and "stopped after step 35" in stopped.stdout, stopped.stdout + stopped.stderr
    resumed = mpirun(2, *ddp, "--checkpoint-dir", tmp_path / "b", "--resume", "--save-model", tmp_path / "res.npz")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "step 30, epoch 2, batch 8" in resumed.stdout
    assert_bit_identical(weights(tmp_path / "full.npz"), weights(tmp_path / "res.npz"))


def test_generators_are_saved_and_restored():
    """Every NumPy generator of the run (nn's default one, a Dropout's) is put back."""
    model = train.nn.Sequential(train.nn.Linear(4, 4, rng=0), train.nn.Dropout(0.5, rng=1))
    optimizer = train.optim.SGD(model.parameters(), lr=0.1)
    ckpt = fault.Checkpointer(train.TrainConfig(), model, optimizer)
    state = ckpt.state({"epoch": 0, "step": 0, "loss_total": 0.0, "global_step": 0, "history": []})
    generators = ckpt._generators()
    assert len(generators) == 2
    expected = [g.random(3) for g in generators]
    ckpt.load(state, "memory")
    assert all(np.array_equal(g.random(3), e) for g, e in zip(generators, expected))


def test_checkpoint_overhead_per_epoch(tmp_path):
    """The share of training time spent saving at the default interval: the mean save time
    (over one save per step) against DEFAULT_CHECKPOINT_EVERY steps of training without
    checkpoints. Measured 2026-11-23 on the 2-core dev machine (ext4): see the report printed
    with -s. The bound is loose (a shared machine); the target is <= 5 %."""
    dataset = data.load_digits(seed=0)
    config = train.TrainConfig(epochs=4, progress=False)
    start = time.perf_counter()
    plain = train.train_single(config, dataset, report=False)
    step_seconds = (time.perf_counter() - start) / sum(row["steps"] for row in plain.history)
    saves = []

    class Timed(fault.Checkpointer):
        def __call__(self, position):
            super().__call__(position)
            saves.append(self.save_seconds)

    config = train.TrainConfig(epochs=2, progress=False, checkpoint_dir=str(tmp_path), checkpoint_every=1)
    train.train_single(config, dataset, report=False, checkpointer_class=Timed)
    save_seconds = saves[-1] / len(saves)
    overhead = save_seconds / (fault.DEFAULT_CHECKPOINT_EVERY * step_seconds)
    print(f"\ncheckpoint: {save_seconds * 1e3:.2f} ms a save, {step_seconds * 1e3:.3f} ms a step; at the default "
          f"{fault.DEFAULT_CHECKPOINT_EVERY} steps the saves add {overhead:.1%} to each epoch")
    assert plain.model is not None
    assert overhead < 0.25, f"a checkpoint costs {overhead:.0%} of the training time at the default interval"


# -- the gathered layout's parts (ps, pipeline) and extra state ---------------------------------

def test_gather_and_scatter_objects_on_the_sim():
    """Oracle: the objects themselves. Rank r's part (of a size that differs per rank) reaches
    rank 0 intact, and rank 0's list comes back one part per rank; root's problem is raised
    on every rank."""
    from minidist import sim

    def parts(comm):
        r = comm.Get_rank()
        mine = {"rank": r, "w": np.arange(r * 1000, dtype=np.float32)}
        gathered = collectives.gather_objects(comm, mine, root=0)
        back, info = collectives.scatter_objects(comm, gathered[::-1] if r == 0 else None, root=0, info="path")
        nothing = collectives.scatter_objects(comm, None, root=0, info=None)
        try:
            collectives.scatter_objects(comm, [1, 2, 3], root=0, problem="bad checkpoint" if r == 0 else None,
                                        error=checkpoint_io.CheckpointError)
        except checkpoint_io.CheckpointError as error:
            raised = str(error)
        return gathered, back, info, nothing, raised

    results = sim.run(parts, 3)
    gathered = results[0][0]
    assert [g["rank"] for g in gathered] == [0, 1, 2] and all(results[r][0] is None for r in (1, 2))
    assert all(np.array_equal(g["w"], np.arange(g["rank"] * 1000, dtype=np.float32)) for g in gathered)
    for r, (_, back, info, nothing, raised) in enumerate(results):
        assert back["rank"] == 2 - r and back["w"].size == (2 - r) * 1000 and info == "path"
        assert nothing == (None, None) and raised == "bad checkpoint"


class Counter:
    def __init__(self):
        self.count = 0

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def test_extra_objects_are_saved_and_restored(tmp_path):
    """A GradScaler-like object passed as extra: its state goes into the file and comes back;
    a checkpoint without it, or an object without state_dict, is refused by name."""
    model = train.nn.Sequential(train.nn.Linear(4, 4, rng=0))
    optimizer = train.optim.SGD(model.parameters(), lr=0.1)
    scaler = Counter()
    scaler.count = 7
    config = train.TrainConfig(checkpoint_dir=str(tmp_path), checkpoint_every=1)
    position = {"epoch": 0, "step": 1, "loss_total": 0.5, "global_step": 1, "history": []}
    fault.Checkpointer(config, model, optimizer, extra={"scaler": scaler})(position)
    state = checkpoint_io.load_checkpoint(checkpoint_io.checkpoint_path(tmp_path, 1))
    assert state["extra"] == {"scaler": {"count": 7}}
    fresh = Counter()
    assert fault.Checkpointer(config, model, optimizer, extra={"scaler": fresh}).load(state, "f") == position
    assert fresh.count == 7
    with pytest.raises(checkpoint_io.CheckpointError, match=r"extra state \['scaler'\] saved, \[\] in this run"):
        fault.Checkpointer(config, model, optimizer).load(state, "f")
    with pytest.raises(TypeError, match=r"extra\['scaler'\] needs state_dict"):
        fault.Checkpointer(config, model, optimizer, extra={"scaler": object()})


CUDA = pytest.mark.skipif(not backend.cuda_available(), reason="needs CuPy and a GPU")


@pytest.mark.parametrize("world,fields", [
    pytest.param(2, {"strategy": "pipeline", "schedule": "1f1b", "device": "cuda"}, marks=CUDA, id="cuda-pipeline"),
    pytest.param(3, {"strategy": "ps", "ps_mode": "sync", "device": "cuda"}, marks=CUDA, id="cuda-ps"),
    (2, {"strategy": "pipeline", "schedule": "gpipe"}),
    (2, {"strategy": "pipeline", "schedule": "zero-bubble"}),
    (2, {"strategy": "pipeline", "schedule": "interleaved"}),
    (4, {"strategy": "pipeline", "schedule": "1f1b", "dp": 2}),
    (3, {"strategy": "ps", "ps_mode": "sync", "num_servers": 1}),
    (4, {"strategy": "ps", "ps_mode": "sync", "num_servers": 2}),
])
def test_gathered_resume_on_the_sim_is_bit_identical(tmp_path, world, fields):
    """Every flushing schedule and ps sync (one and two servers), in-process on the simulator:
    stopped after step 20, resumed from the checkpoint of step 18, the final weights equal the
    uninterrupted run's bit for bit (the mpiexec kills: tests/test_fault_mpi.py)."""

    dataset = data.load_digits(seed=0)
    kw = dict(epochs=1, progress=False, hidden=(32, 32, 32), lr=0.02, warmup_epochs=1, checkpoint_every=6, timeout=30,
              **fields)
    driver = DRIVERS[fields["strategy"]][0]

    def saved():
        assert [s for s, _ in checkpoint_io.list_checkpoints(tmp_path / "b")] == [6, 12, 18]

    config = train.TrainConfig(**kw, checkpoint_dir=str(tmp_path / "b"))
    assert_same_weights(*stop_and_resume(on_sim(driver, dataset, world), config, stop_after=20, between=saved))


# -- one import path per name ---------------------------------------------------------------------

FILE_NAMES = ("FORMAT", "CheckpointError", "CheckpointMismatchError", "CheckpointWarning", "CheckpointLock",
              "atomic_file", "checkpoint_path", "latest_valid_checkpoint", "list_checkpoints", "load_checkpoint",
              "save_checkpoint", "save_training_checkpoint")


def test_the_checkpoint_files_names_are_imported_from_checkpoint_io_only():
    """minidist.fault no longer re-exports checkpoint_io's names, and no module of the package,
    the tests or the benchmarks reaches them through fault (code or docstring)."""
    for name in ("FORMAT", "CheckpointWarning", "checkpoint_path", "list_checkpoints", "save_checkpoint"):
        assert not hasattr(fault, name), f"minidist.fault still re-exports {name}"
    names = "|".join(FILE_NAMES)
    through_fault = re.compile(rf"\bfault\.({names})\b|from minidist\.fault import [^\n]*\b({names})\b")
    offenders = [f"{path.relative_to(ROOT)}: {match.group(0)}"
                 for folder in ("minidist", "tests", "benchmarks") for path in sorted((ROOT / folder).rglob("*.py"))
                 if path.name != "test_fault.py"
                 for match in through_fault.finditer(path.read_text())]
    assert offenders == []
