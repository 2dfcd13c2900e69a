"""Faults in minidist.collectives under real MPI, compared by tests/test_collectives_mpi.py
with the same calls on the simulated world.

    mpiexec -n P python -m mpi4py tests/mpi/collective_faults.py      (P = 2 or 3)

1. Refused input (collective_cases.refused_calls): every rank's CollectiveError message.
2. A missing rank: with p2p.set_timeout(2), ranks 0..p-2 call all_reduce while the
   last rank sleeps 4 s and never calls it. Each waiting rank must raise CollectiveTimeout
   (a TimeoutError) naming the last rank, after about 2 s.
Then ranks that disagree (collective_cases.mismatched_calls), and one good all-reduce after them.
Rank 0 prints one line ``RESULT <json>``: {"refusals": [per rank {name: message}], "mismatches":
[the same], "after": [per rank the good all-reduce's values],
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
    mismatches = comm.gather(cc.refusals(collectives, comm, Tensor, cc.mismatched_calls(collectives, comm)), root=0)
    x = np.arange(3.0) * (comm.Get_rank() + 1)  # after the mismatches, a good call still works
    after = comm.gather(collectives.all_reduce(comm, x).tolist(), root=0)
    timeout = comm.gather(missing_rank(comm), root=0)
    if comm.Get_rank() == 0:
        print("RESULT " + json.dumps({"refusals": refusals, "mismatches": mismatches, "after": after,
                                      "timeout": timeout}), flush=True)


if __name__ == "__main__":
    main()
