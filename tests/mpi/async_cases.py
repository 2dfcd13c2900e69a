"""Non-blocking all-reduce against the blocking one, under mpiexec (and on the sim).

    mpiexec -n P python -m mpi4py tests/mpi/async_cases.py

prints one JSON line on rank 0: {"world_size": P, "failures": [...]}.
"""
from __future__ import annotations

import json
import sys
import traceback

import numpy as np

from minidist import async_collectives, collectives

ALGORITHMS = ("ring", "recursive_doubling", "tree", "naive")


def case_bitwise_equal(comm):
    """Every algorithm, sizes below and above p and the eager limit, float64 and int32:
    the async result has the blocking result's bytes; several Works in flight at once,
    waited in reverse order, each still gets its own result."""
    rank = comm.Get_rank()
    for n in (1, 3, 1001, 20_000):
        for dtype in ("float64", "int32"):
            x = (np.random.default_rng(rank * 100 + n).standard_normal(n) * 1000).astype(dtype)
            works = [(alg, async_collectives.all_reduce(comm, x, algorithm=alg, async_op=True)) for alg in ALGORITHMS]
            for alg, work in reversed(works):
                expected = collectives.all_reduce(comm, x, algorithm=alg)
                got = work.wait()
                assert got.dtype == expected.dtype and got.tobytes() == expected.tobytes(), (alg, n, dtype)
                assert work.is_completed() and work.end_time >= work.start_time
    return {"ok": True}


CASES = [case_bitwise_equal]


def main():
    from mpi4py import MPI

    comm, failures = MPI.COMM_WORLD, []
    for case in CASES:
        try:
            case(comm)
        except Exception:
            failures.append(f"rank {comm.Get_rank()} {case.__name__}: {traceback.format_exc()}")
    everyone = comm.gather(failures, root=0)
    if comm.Get_rank() == 0:
        print(json.dumps({"world_size": comm.Get_size(), "failures": [f for fs in everyone for f in fs]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
