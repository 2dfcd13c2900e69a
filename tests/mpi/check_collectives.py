"""Every collective case against MPI's own calls, then bad input, on MPI.COMM_WORLD.

    mpiexec -n P python -m mpi4py tests/mpi/check_collectives.py [--quick]

Each case (tests/mpi/collective_cases.py) runs minidist.collectives on the real
communicator and compares the result with (a) the replay of the algorithm's own order,
bit for bit, (b) MPI's native call (Bcast, Scatter, Gather, Allgather, Reduce,
Reduce_scatter, Allreduce): bit for bit for integers, max/min and data movement, within the
stated tolerance for float sum/prod, and (c) the other ranks: identical bytes (digests
gathered at the end, so checking costs no extra message round per case). Rank 0
prints one line per problem and ends with "ALL OK cases=N" or "FAILED problems=K".
"""
import sys

import collective_cases as cc
import numpy as np
from mpi4py import MPI

from minidist import collectives, p2p

MPI_OPS = {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}


def native(comm, case, xs, result):
    """Problems comparing ``result`` with MPI's own collective on the same input."""
    name, rank, p = case["collective"], comm.Get_rank(), comm.Get_size()
    root, op = case.get("root", 0), case.get("op")
    x = xs[rank]
    if name == "broadcast":
        theirs = x.copy() if rank == root else np.empty_like(x)
        comm.Bcast(theirs, root=root)
    elif name == "scatter":
        theirs = np.empty_like(x)
        comm.Scatter(np.stack(xs) if rank == root else None, theirs, root=root)
    elif name == "gather":
        theirs = np.empty((p,) + x.shape, x.dtype) if rank == root else None
        comm.Gather(x, theirs, root=root)
    elif name == "all_gather":
        theirs = np.empty((p,) + x.shape, x.dtype)
        comm.Allgather(x, theirs)
    elif name == "reduce":
        theirs = np.empty_like(x) if rank == root else None
        comm.Reduce(x, theirs, op=MPI_OPS[op], root=root)
    elif name == "reduce_scatter":
        counts = [b - a for a, b in cc.chunk_bounds(x.size, p)]
        theirs = np.empty(counts[rank], x.dtype)
        comm.Reduce_scatter(x, theirs, recvcounts=counts, op=MPI_OPS[op])
    else:
        theirs = np.empty_like(x)
        comm.Allreduce(x, theirs, op=MPI_OPS[op])
    problems = []
    if theirs is None:
        if result is not None:
            problems.append("returned a value off root")
    elif op in ("sum", "prod") and x.dtype.kind == "f":
        if name == "reduce_scatter":
            a, b = cc.chunk_bounds(x.size, p)[rank]
            inputs = [y[a:b] for y in xs]
        else:
            inputs = xs
        eps = np.finfo(x.dtype).eps
        stack = np.abs(np.stack(inputs).astype(np.float64))
        scale = stack.sum(axis=0) if op == "sum" else stack.prod(axis=0)
        if result is None or not np.all(np.abs(result.astype(np.float64) - theirs) <= p * eps * scale):
            problems.append(f"differs from MPI's native {name} by more than the tolerance")
    else:
        how = cc.differs(result, theirs)
        if how:
            problems.append(f"differs from MPI's native {name}: {how}")
    return problems


def bad_input(comm):
    """Each bad call must raise CollectiveError on every rank; then a good call must work."""
    rank, p = comm.Get_rank(), comm.Get_size()
    z = np.zeros(3)
    calls = {
        "unknown op": lambda: collectives.all_reduce(comm, z, op="avg"),
        "unknown algorithm": lambda: collectives.all_reduce(comm, z, algorithm="butterfly"),
        "root out of range": lambda: collectives.broadcast(comm, z, root=p),
        "negative root": lambda: collectives.reduce(comm, z, root=-1),
        "scatter root shape": lambda: collectives.scatter(comm, np.zeros((p + 1, 2)) if rank == 0 else np.zeros(2)),
    }
    if p > 1:
        calls.update({
            "shape mismatch": lambda: collectives.all_reduce(comm, np.zeros(3 + (rank == p - 1)), algorithm="ring"),
            "dtype mismatch": lambda: collectives.all_gather(comm, np.zeros(3, "f4" if rank == 1 else "f8")),
            "op on one rank": lambda: collectives.reduce_scatter(comm, z, op="max" if rank else "avg"),
            "roots disagree": lambda: collectives.gather(comm, z, root=rank),
        })
    problems = []
    for what, call in calls.items():
        try:
            call()
            message = None
        except p2p.CollectiveError as exc:
            message = str(exc)
        messages = comm.allgather(message)
        if any(m is None for m in messages) or len(set(messages)) != 1:
            problems.append(f"bad input '{what}': not the same CollectiveError on every rank: {messages}")
    after = collectives.all_reduce(comm, np.full(5, rank + 1.0), algorithm="ring")
    if not np.array_equal(after, np.full(5, p * (p + 1) / 2)):
        problems.append("a good all_reduce after the bad calls gave a wrong result")
    return problems


def main():
    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    case_list = cc.cases(p)
    if "--quick" in sys.argv:
        case_list = [c for c in case_list if c["n"] < 1000]
    problems, digests = cc.run_cases(comm, collectives, case_list, lambda i, case: cc.prepare(case, p), native)
    problems += bad_input(comm)
    everyone = comm.gather((problems, digests), root=0)
    if comm.Get_rank() == 0:
        flat = [m for rank_problems, _ in everyone for m in rank_problems]
        flat += cc.digest_problems([d for _, d in everyone])
        for m in flat[:40]:
            print(m)
        print(f"ALL OK cases={len(case_list)} ranks={p}" if not flat else f"FAILED problems={len(flat)}")


if __name__ == "__main__":
    main()
