"""Start-up and shutdown under real mpiexec (issue 18): no wait without a deadline, ranks that
agree on the whole configuration, a usage error printed once.

Every job runs in its own process group with a subprocess timeout, and the group is killed
afterwards whatever happened: a test that waits for a hang never hangs itself.
"""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.mpitools import JOB_ENV, mpiexec_or_skip

pytestmark = pytest.mark.mpi

ROOT = Path(__file__).resolve().parents[1]
STOP_SCRIPT = ROOT / "tests" / "mpi" / "startup_stop.py"
DEADLINE = 5.0  # --timeout of the jobs that wait for a stopped rank
JOB_LIMIT = 150  # seconds before the test gives up on a job (it hung): 2 shared cores, slow start-ups


def run_job(command, env=None, limit=JOB_LIMIT):
    """Run ``command`` in its own process group; (returncode, stdout, stderr, seconds). Fails the
    test, after killing the whole group, when it runs past ``limit`` seconds."""
    start = time.perf_counter()
    command = [str(part) for part in command]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env or {**os.environ, **JOB_ENV}, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        out, err = "", ""
        pytest.fail(f"the job hung: still running after {limit} s: {' '.join(command)}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # a stopped rank left behind, if any
        except ProcessLookupError:
            pass
        proc.wait()
    return proc.returncode, out, err, time.perf_counter() - start


def minidist(*args):
    """``python -m mpi4py -m minidist ARGS`` (one program of an mpiexec command line)."""
    return [sys.executable, "-m", "mpi4py", "-m", "minidist", *map(str, args)]


# ------------------------------------------------------------------ a rank stopped: named, never a hang

@pytest.mark.parametrize("where", ["grid", "blas"])
def test_a_rank_stopped_before_a_split_is_named_within_the_deadline(where):
    """Before the fix, the others entered comm.Split / Split_type and waited forever."""
    env = {k: v for k, v in {**os.environ, **JOB_ENV}.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                                                           "MKL_NUM_THREADS")}
    status, out, err, _ = run_job([mpiexec_or_skip(), "-n", "3", sys.executable, "-m", "mpi4py", STOP_SCRIPT, where,
                                   DEADLINE], env=env)
    assert status != 0, out + err
    waited = [float(s) for s in re.findall(r"rank [02] gave up after ([\d.]+) s: .*has not heard from rank 1\b", err)]
    assert waited, err
    assert all(DEADLINE <= s <= DEADLINE + 3 for s in waited), waited
    assert "passed" not in out


def test_a_rank_stopped_before_finalize_ends_the_job_naming_it():
    """Before the fix, rank 0 printed its result and waited in MPI_Finalize forever. The deadline
    (--timeout) also bounds the training's own waits, so it leaves room for a loaded machine."""
    deadline = 4 * DEADLINE
    status, out, err, _ = run_job([mpiexec_or_skip(), "-n", "3", sys.executable, "-m", "mpi4py", STOP_SCRIPT, "finish",
                                   deadline])
    assert status != 0, out + err
    assert "final test_accuracy=" in out, out + err  # training itself finished
    line = next((ln for ln in err.splitlines() if "cannot finish" in ln), "")
    assert re.search(rf"rank [02] cannot finish: rank 1 did not reach the end of the job within {deadline:g} s",
                     line), err
    assert "Traceback" not in err


# ------------------------------------------------------------------ one configuration for every rank

def mpmd(first, second):
    """``mpiexec -n 1 python ... train FIRST : -n 1 python ... train SECOND``: rank 0 and rank 1 get other flags."""
    return [mpiexec_or_skip(), "-n", "1", *minidist("train", *first), ":", "-n", "1", *minidist("train", *second)]


COMMON = ["--epochs", "1", "--no-progress", "--timeout", "30"]


@pytest.mark.parametrize("strategy, first, second, named", [
    # before: trained on mismatched inputs and labels, and exited 0
    ("pipeline", ["--seed", "0"], ["--seed", "1"], ["--seed is 0 on rank 0 and 1 on rank 1"]),
    # before: a traceback about shapes
    ("ddp", ["--batch-size", "32", "--hidden", "16"], ["--batch-size", "16", "--hidden", "8"],
     ["--batch-size is 32 on rank 0 and 16 on rank 1", "--hidden is 16 on rank 0 and 8 on rank 1"]),
])
def test_ranks_with_other_flags_are_a_usage_error_naming_fields_and_ranks(strategy, first, second, named):
    flags = ["--strategy", strategy, *COMMON] + (["--hidden", "8", "8"] if strategy == "pipeline" else [])
    status, out, err, _ = run_job(mpmd([*flags, *first], [*flags, *second]))
    assert status == 2, out + err
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(errors) == 1, err
    for text in named:
        assert text in errors[0]
    assert "Traceback" not in err and "epoch 1" not in out


# ------------------------------------------------------------------ a usage error: once, from rank 0

@pytest.mark.parametrize("flags", [
    ["--strategy", "ddp", "--epochs", "0"],            # argparse's own check
    ["--strategy", "ps", "--num-servers", "2"],        # the layout, checked once MPI runs: 2 servers, 2 ranks
    ["--strategy", "ddp", "--epochs", "1", "--save-model", "weights.txt"],
])
def test_a_usage_error_under_mpiexec_is_printed_once(flags):
    status, out, err, _ = run_job([mpiexec_or_skip(), "-n", "2", *minidist("train", *flags)])
    assert status == 2, out + err
    assert err.count("error:") == 1 and err.count("usage:") <= 1, err
    assert "Abort" not in err and "Traceback" not in err


def test_a_usage_error_on_one_rank_only_is_printed_by_rank_0_and_ends_every_rank():
    # before: rank 1 exited alone; rank 0 trained on and waited --timeout for it
    status, out, err, _ = run_job(mpmd(["--strategy", "ddp", *COMMON], ["--strategy", "ddp", "--epochs", "0"]))
    assert status == 2, out + err
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(errors) == 1 and "--epochs: must be a positive integer" in errors[0] and "rank 1" in errors[0], err
    assert "epoch 1" not in out


@pytest.mark.parametrize("flags", [
    ["--dataset", "mnist"],                        # argparse-level, before MPI
    ["--checkpoint", "CHECKPOINT"],                # found once MPI runs: a model of 3 features, digits have 64
])
def test_an_evaluate_usage_error_under_mpiexec_is_printed_once(flags, tmp_path):
    import numpy as np

    checkpoint = tmp_path / "small.npz"
    np.savez(checkpoint, **{"0.weight": np.zeros((4, 3), np.float32), "0.bias": np.zeros(4, np.float32)})
    flags = [str(checkpoint) if flag == "CHECKPOINT" else flag for flag in flags]
    status, out, err, _ = run_job([mpiexec_or_skip(), "-n", "2", *minidist("evaluate", *flags)])
    assert status == 2, out + err
    assert err.count("error:") == 1, err
    assert "Abort" not in err and "Traceback" not in err
