"""async_collectives.all_reduce(async_op=True): bitwise equal to the blocking all-reduce of
the same algorithm (the oracle), on the sim for P = 1..4 and under mpiexec; several in
flight at once; progress without waiting; deadlines; bad arguments."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mpitools import mpiexec_or_skip

from minidist import async_collectives, collectives, p2p, sim

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "mpi"))
import async_cases  # noqa: E402


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_bitwise_equal_to_blocking_on_sim(p):
    sim.run(async_cases.case_bitwise_equal, p)


def test_out_and_async_op_false():
    def fn(comm):
        x = np.arange(10.0) * (comm.Get_rank() + 1)
        out = np.empty_like(x)
        got = async_collectives.all_reduce(comm, x, algorithm="ring", out=out, async_op=True).wait()
        blocking = async_collectives.all_reduce(comm, x, algorithm="ring")  # async_op=False: the array
        return got is out, np.array_equal(out, blocking), isinstance(blocking, np.ndarray)

    assert sim.run(fn, 3) == [(True, True, True)] * 3


def test_is_completed_makes_progress_without_waiting():
    """Rank 1 starts late: rank 0's is_completed() is False meanwhile (it returns at once),
    then True after polling alone, without a wait()."""
    def fn(comm):
        x = np.ones(100_000)
        if comm.Get_rank() == 1:
            time.sleep(0.2)
        work = async_collectives.all_reduce(comm, x, algorithm="ring", validate=False, async_op=True)
        early = work.is_completed()
        t0 = time.perf_counter()
        while not work.is_completed():
            time.sleep(0.001)
        assert time.perf_counter() - t0 < 5
        return early, float(work.wait()[0])

    results = sim.run(fn, 2)
    assert results[0] == (False, 2.0) and results[1][1] == 2.0


def test_is_completed_honours_the_deadline():
    """A partner that never takes part: polling is_completed() raises CollectiveTimeout
    naming it once the step has waited past collectives' deadline."""
    def fn(comm):
        if comm.Get_rank() == 1:
            time.sleep(1.0)
            return None
        previous = p2p.set_timeout(0.3)
        try:
            work = async_collectives.all_reduce(comm, np.ones(8), algorithm="ring", validate=False, async_op=True)
            with pytest.raises(p2p.CollectiveTimeout, match="not heard from rank 1") as info:
                while not work.is_completed():
                    time.sleep(0.01)
            return info.value.missing
        finally:
            p2p.set_timeout(previous)

    assert sim.World(2, timeout=20).run(fn)[0] == [1]


def test_bad_arguments_raise_on_every_rank():
    def fn(comm):
        op = "sum" if comm.Get_rank() == 0 else "mean"
        with pytest.raises(p2p.CollectiveError, match="unknown op 'mean'"):
            async_collectives.all_reduce(comm, np.ones(3), op=op, async_op=True)
        return True

    assert sim.run(fn, 2) == [True, True]


def test_slow_link_delays_delivery():
    """sim.World(bandwidth=...): 2 ranks exchange 400 kB at 4 MB/s: about 0.1 s, and the
    receive is incomplete before then; bad bandwidths are rejected."""
    def fn(comm):
        buf, other = np.zeros(50_000), 1 - comm.Get_rank()
        t0 = time.perf_counter()
        reqs = [comm.Irecv(buf, source=other, tag=1), comm.Isend(np.ones(50_000), dest=other, tag=1)]
        early = reqs[0].Test()
        p2p.wait_all(comm, reqs, [other, other], "test", receives=1)
        return early, time.perf_counter() - t0

    for early, seconds in sim.World(2, bandwidth=4e6).run(fn):
        assert not early and 0.09 < seconds < 2
    for bad in (0, -1.0, float("inf"), True, "fast"):
        with pytest.raises(ValueError, match="bandwidth"):
            sim.World(2, bandwidth=bad)


@pytest.mark.mpi
@pytest.mark.parametrize("p", [2, 3])
def test_bitwise_equal_to_blocking_under_mpiexec(p):
    mpiexec = mpiexec_or_skip()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    done = subprocess.run([mpiexec, "-n", str(p), sys.executable, "-m", "mpi4py",
                           str(ROOT / "tests" / "mpi" / "async_cases.py")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"world_size": p, "failures": []}, "\n".join(report["failures"])


def test_wait_finishes_the_works_started_before():
    """NCCL's stream order: wait() on the second all-reduce returns only when the first is done
    too, so a blocking collective after it cannot deadlock on a half-finished first one."""
    def fn(comm):
        x = np.arange(20_000.0) + comm.Get_rank()
        first = async_collectives.all_reduce(comm, x, algorithm="ring", validate=False, async_op=True)
        second = async_collectives.all_reduce(comm, 2 * x, algorithm="tree", validate=False, async_op=True)
        second.wait()
        finished_first = first.end_time is not None
        collectives.all_reduce(comm, x[:4])  # blocking, while nothing is in flight any more
        return finished_first, np.array_equal(first.wait(), collectives.all_reduce(comm, x, algorithm="ring"))

    assert sim.run(fn, 3) == [(True, True)] * 3
