"""``train --model gpt`` under real mpiexec (issue 19, part 5): ddp on 2 ranks with half the
per-rank batch follows the single process, a pipeline of 2 ranks too, and a stopped ddp run
resumed from its checkpoints ends bit-identical to one never stopped."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from mpitools import JOB_ENV, mpirun_minidist

from minidist.checkpoint_io import load_weights
from minidist.train import GPT_LR

pytestmark = pytest.mark.mpi

# A small GPT on the plays: a few seconds a run.
GPT = ["train", "--model", "gpt", "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16",
       "--steps", "20", "--eval-every", "10", "--no-progress"]


def run_single(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "minidist", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **JOB_ENV})


def evaluations(stdout: str) -> list[tuple[float, float]]:
    """(train_loss, val_loss) of each evaluation line."""
    return [(float(m.group(1)), float(m.group(2)))
            for m in re.finditer(r"train_loss=([\d.]+)\s+val_loss=([\d.]+)", stdout)]


def final_val_loss(stdout: str) -> float:
    last = stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"final val_loss=\d+\.\d{4}", last), last
    return float(last.split("=")[1])


def test_ddp_on_two_ranks_with_half_the_batch_follows_the_single_process():
    single = run_single(*GPT, "--batch-size", "16")
    assert single.returncode == 0, single.stderr
    ddp = mpirun_minidist(2, *GPT, "--strategy", "ddp", "--batch-size", "8", "--no-scale-lr", timeout=300)
    assert ddp.returncode == 0, ddp.stderr
    a, b = evaluations(single.stdout), evaluations(ddp.stdout)
    assert len(a) == len(b) == 2
    assert np.allclose(a, b, atol=1e-4, rtol=0), (a, b)  # the lines print 4 decimals: equal as printed
    assert abs(final_val_loss(single.stdout) - final_val_loss(ddp.stdout)) < 1e-4
    # --no-scale-lr: the GPT's default peak lr, unscaled by the global batch
    assert "global batch 16" in ddp.stdout and f"lr {GPT_LR:g}," in ddp.stdout


def test_a_two_rank_pipeline_follows_the_single_process():
    single = run_single(*GPT, "--batch-size", "8")
    piped = mpirun_minidist(2, *GPT, "--strategy", "pipeline", "--schedule", "1f1b", "--microbatches", "2",
                            "--batch-size", "8", timeout=300)
    assert piped.returncode == 0, piped.stderr
    assert "GPT blocks per stage: 1,1" in piped.stdout
    assert np.allclose(evaluations(single.stdout), evaluations(piped.stdout), atol=1e-4, rtol=0)


def test_a_stopped_ddp_run_resumes_bit_identical(tmp_path):
    common = [*GPT, "--strategy", "ddp", "--batch-size", "8", "--checkpoint-every", "6"]
    whole = mpirun_minidist(2, *common, "--checkpoint-dir", tmp_path / "a", "--save-model", tmp_path / "a.npz",
                            timeout=300)
    assert whole.returncode == 0, whole.stderr
    stopped = mpirun_minidist(2, *common, "--checkpoint-dir", tmp_path / "b", "--stop-after-steps", "15", timeout=300)
    assert stopped.returncode == 0 and "stopped after step 15" in stopped.stdout, stopped.stderr
    resumed = mpirun_minidist(2, *common, "--checkpoint-dir", tmp_path / "b", "--resume", "--save-model",
                              tmp_path / "b.npz", timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "resume: from" in resumed.stdout and "(step 12, epoch 2, batch 2 of it)" in resumed.stdout
    (a, meta_a), (b, meta_b) = load_weights(tmp_path / "a.npz"), load_weights(tmp_path / "b.npz")
    assert meta_a == meta_b and meta_a["gpt_config"]["n_embd"] == 32
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == np.float32 and np.array_equal(a[name], b[name]), name
    assert final_val_loss(whole.stdout) == final_val_loss(resumed.stdout)
