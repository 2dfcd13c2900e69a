"""Faults in minidist.collectives under real MPI, compared by tests/test_collectives_mpi.py
with the same calls on the simulated world.

    mpiexec -n 3 python -m mpi4py tests/mpi/collective_faults.py

1. Refused input (collective_cases.refused_calls): every rank's CollectiveError message.
2. A missing rank: with p2p.set_timeout(2), ranks 0..p-2 call all_reduce while the
   last rank sleeps 4 s and never calls it. Each waiting rank must raise CollectiveTimeout
   (a TimeoutError) naming the last rank, after about 2 s.
Rank 0 prints one line ``RESULT <json>``: {"refusals": [per rank {name: message}],
"timeout": [per rank {"error", "is_timeout", "missing", "seconds", "message"}]}.
"""
import json
import time

import collective_cases as cc
import numpy as np
from mpi4py import MPI

from minidist import Tensor, collectives, p2p


def missing_rank(comm):
    rank, p = comm.Get_rank(), comm.Get_size()
    p2p.set_timeout(2.0)
    if rank == p - 1:
        time.sleep(4.0)
        return None
    start = time.perf_counter()
    try:
        collectives.all_reduce(comm, np.ones(4), algorithm="ring")
        error = None
    except Exception as exc:
        error = exc
    return {"error": type(error).__name__, "is_timeout": isinstance(error, TimeoutError),
            "is_collective_error": isinstance(error, p2p.CollectiveError),
            "missing": getattr(error, "missing", None), "seconds": time.perf_counter() - start,
            "message": str(error)}


def main():
    comm = MPI.COMM_WORLD
    refusals = comm.gather(cc.refusals(collectives, comm, Tensor), root=0)
    timeout = comm.gather(missing_rank(comm), root=0)
    if comm.Get_rank() == 0:
        print("RESULT " + json.dumps({"refusals": refusals, "timeout": timeout}), flush=True)


if __name__ == "__main__":
    main()
