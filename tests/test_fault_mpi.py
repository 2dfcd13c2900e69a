"""Real kills under mpiexec: ``train --kill-at-step K --kill-rank R`` SIGKILLs rank R at the end
of global step K (once per checkpoint folder: the marker ``.killed-at-K``), and a relaunch with
``--resume`` must end with weights bit-identical to an uninterrupted run's (the oracle).

The kills: for each strategy two (step, rank) pairs drawn from ``numpy.random.default_rng(seed)``
(steps in the run's range, ranks over the whole world; the seeds, 13, 16 and 14, are the first
that kill two different ranks in each case, so a server, a worker, both stages and both ddp ranks
are hit: ddp (38, 1), (43, 0), also with the top-k comm hook, whose per-rank residuals the
checkpoints hold; pipeline (23, 0), (24, 1); ps (8, 1), (36, 0)), chained: the first launch
dies at the first step, its relaunch with ``--resume`` dies at the second, the third launch
finishes (so every relaunch is also a resume). Each killed job must end, every rank, with a
nonzero status within KILL_GRACE seconds of the kill (the marker's time): mpiexec
takes the others down, none waits for its ``--timeout`` (120 s here)."""
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mpitools import JOB_ENV, assert_bit_identical, mpiexec_or_skip
from mpitools import mpirun_minidist as mpirun
from mpitools import saved_weights as weights

from minidist import checkpoint_io, fault

ROOT = Path(__file__).resolve().parents[1]
KILL_GRACE = 20.0  # seconds from the kill to the end of the whole job
SMALL = ["train", "--no-progress", "--hidden", "32", "--timeout", "120", "--warmup-epochs", "1",
         "--checkpoint-every", "7"]
ENV = {**os.environ, **JOB_ENV}





def draw_kills(seed, steps, ranks, count=2):
    """``count`` (step, rank) pairs: distinct steps in 2..steps-1 (sorted), ranks in 0..ranks-1."""
    rng = np.random.default_rng(seed)
    chosen = sorted(rng.choice(np.arange(2, steps), size=count, replace=False).tolist())
    return [(int(s), int(rng.integers(ranks))) for s in chosen]


def killed_run(n, args, directory, step, rank):
    """Launch a run that kills rank ``rank`` at the end of ``step``; check it dies fast."""
    done = mpirun(n, *args, "--checkpoint-dir", directory, "--resume", "--kill-at-step", step, "--kill-rank", rank)
    ended = time.time()
    marker = Path(directory) / f".killed-at-{step}"
    assert done.returncode != 0, f"the job survived the kill of rank {rank} at step {step}:\n{done.stdout}"
    assert marker.exists(), done.stdout + done.stderr
    assert ended - marker.stat().st_mtime < KILL_GRACE, "the other ranks outlived the killed one"
    return done


# (ranks, flags, steps in the run, seed of the kills). digits, batch 32: 43 batches, 22 per half; a
# pipeline of 4 micro-batches drops the last one (fewer samples than micro-batches): 42.
CASES = {
    "ddp": (2, ["--strategy", "ddp", "--epochs", "2"], 2 * 22, 13),
    # top-k's error-feedback residuals differ per rank: each rank's goes in the checkpoint
    "ddp-topk": (2, ["--strategy", "ddp", "--epochs", "2", "--comm-hook", "topk", "--topk-ratio", "0.05"], 2 * 22, 13),
    "pipeline-1f1b": (2, ["--strategy", "pipeline", "--schedule", "1f1b", "--epochs", "1"], 42, 16),
    "ps-sync": (3, ["--strategy", "ps", "--ps-mode", "sync", "--epochs", "2"], 2 * 22, 14),
}


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(CASES))
def test_killed_twice_and_resumed_is_bit_identical(tmp_path, name):
    n, flags, steps, seed = CASES[name]
    args = [*SMALL, *flags]
    full = mpirun(n, *args, "--checkpoint-dir", tmp_path / "a", "--save-model", tmp_path / "full.npz")
    assert full.returncode == 0, full.stdout + full.stderr
    kills = draw_kills(seed, steps, n)
    for step, rank in kills:
        killed_run(n, args, tmp_path / "ckpt", step, rank)
    resumed = mpirun(n, *args, "--checkpoint-dir", tmp_path / "ckpt", "--resume", "--save-model",
                     tmp_path / "res.npz", "--kill-at-step", kills[-1][0])  # its marker is there: no kill
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    last = max(s for s in range(0, kills[-1][0] + 1, 7))
    assert f"resume: from {checkpoint_io.checkpoint_path(tmp_path / 'ckpt', last)}" in resumed.stdout, resumed.stdout
    assert_bit_identical(weights(tmp_path / "full.npz"), weights(tmp_path / "res.npz"))


@pytest.mark.mpi
def test_pipeline_with_dp_corrupt_newest_checkpoint_uses_the_previous(tmp_path):
    """4 ranks, 2 pipelines of 2: killed at step 20 (checkpoints 7 and 14), the newest one is
    truncated; the relaunch warns, resumes from step 7 and still ends bit-identical."""
    args = [*SMALL, "--strategy", "pipeline", "--dp", "2", "--epochs", "1"]
    full = mpirun(4, *args, "--checkpoint-dir", tmp_path / "a", "--save-model", tmp_path / "full.npz")
    assert full.returncode == 0, full.stdout + full.stderr
    killed_run(4, args, tmp_path / "ckpt", 20, 3)
    newest = Path(checkpoint_io.checkpoint_path(tmp_path / "ckpt", 14))
    newest.write_bytes(newest.read_bytes()[:-100])
    resumed = mpirun(4, *args, "--checkpoint-dir", tmp_path / "ckpt", "--resume", "--save-model",
                     tmp_path / "res.npz")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "ckpt-00000014.npz: truncated or corrupt" in resumed.stderr
    assert f"resume: from {checkpoint_io.checkpoint_path(tmp_path / 'ckpt', 7)} (step 7," in resumed.stdout
    assert_bit_identical(weights(tmp_path / "full.npz"), weights(tmp_path / "res.npz"))


RAISES_ON_RANK_1 = """
import sys
from minidist import cli, fault
after_step = fault.Checkpointer.after_step
def raising(self, step, stop=True):
    if self.rank == 1 and step == 5:
        raise RuntimeError("rank 1 fails at step 5 (test)")
    return after_step(self, step, stop)
fault.Checkpointer.after_step = raising
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.mpi
@pytest.mark.parametrize("n,flags", [(2, ["--strategy", "ddp"]), (3, ["--strategy", "ps"])])
def test_an_exception_on_one_rank_ends_every_rank(tmp_path, n, flags):
    """An uncaught exception on rank 1 (the others keep waiting for it in a collective, or a
    server for its push): mpi4py's runner aborts the job, far sooner than --timeout 120."""
    command = [mpiexec_or_skip(), "-n", str(n), sys.executable, "-m", "mpi4py", "-c", RAISES_ON_RANK_1,
               *SMALL, *flags, "--epochs", "2", "--checkpoint-dir", str(tmp_path)]
    began = time.time()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, env=ENV)
    assert done.returncode != 0
    assert "rank 1 fails at step 5" in done.stderr
    assert time.time() - began < KILL_GRACE + 10, "the job outlived the failing rank by far"


TIMED_SAVES = """
import atexit, sys, time
from mpi4py import MPI
from minidist import cli, fault
save, spent = fault.Checkpointer.save, []
def timed(self, step, position=None):
    began = time.perf_counter()
    save(self, step, position)
    spent.append(time.perf_counter() - began)
fault.Checkpointer.save = timed
rank = MPI.COMM_WORLD.Get_rank()  # asked now: train finalizes MPI itself before exit
atexit.register(lambda: rank == 0 and print(f"SAVES {len(spent)} {sum(spent)!r}", flush=True))
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.mpi
@pytest.mark.parametrize("n,flags,steps", [(2, ["--strategy", "ddp"], 22),
                                           (2, ["--strategy", "pipeline", "--schedule", "1f1b"], 42)])
def test_checkpoint_overhead_per_epoch(tmp_path, n, flags, steps):
    """The share of an epoch spent checkpointing at the default interval, under mpiexec with the
    default model: rank 0's mean time in ``Checkpointer.save`` (a save every step; for the
    pipeline it includes gathering the other rank's part) against DEFAULT_CHECKPOINT_EVERY
    steps of a run without checkpoints (its second epoch's time). Printed with -s; no bound
    (a shared machine): the numbers go in the report."""
    args = ["train", "--no-progress", "--timeout", "120", *flags]
    plain = mpirun(n, *args, "--epochs", "2")
    assert plain.returncode == 0, plain.stdout + plain.stderr
    epoch_seconds = float([line for line in plain.stdout.splitlines() if line.startswith("epoch 2/2")][0]
                          .split("time=")[1].split("s")[0])
    command = [mpiexec_or_skip(), "-n", str(n), sys.executable, "-m", "mpi4py", "-c", TIMED_SAVES, *args,
               "--epochs", "1", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "1"]
    timed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, env=ENV)
    assert timed.returncode == 0, timed.stdout + timed.stderr
    saves, seconds = [line.split()[1:] for line in timed.stdout.splitlines() if line.startswith("SAVES")][0]
    assert int(saves) == steps
    save_seconds, step_seconds = float(seconds) / int(saves), epoch_seconds / steps
    overhead = save_seconds / (fault.DEFAULT_CHECKPOINT_EVERY * step_seconds)
    size = os.path.getsize(checkpoint_io.list_checkpoints(tmp_path)[-1][1])
    print(f"\n{flags[1]}: {save_seconds * 1e3:.2f} ms a save ({size / 1024:.0f} KiB), {step_seconds * 1e3:.2f} ms a "
          f"step; at the default {fault.DEFAULT_CHECKPOINT_EVERY} steps the saves add {overhead:.2%} to each epoch")
