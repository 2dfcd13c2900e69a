"""Hierarchical and torus all-reduce on fake nodes against MPI's own Allreduce, and the delay
layer, on MPI.COMM_WORLD of 8 ranks with MINIDIST_RANKS_PER_NODE=2 (test_hierarchical_mpi.py).

    MINIDIST_RANKS_PER_NODE=2 mpiexec -n 8 python -m mpi4py tests/mpi/hierarchical_cases.py

For P = 2..8 (the first P ranks, split off) and fake nodes of l ranks (set_ranks_per_node; l
dividing P, l = 1 and l = P included somewhere), both algorithms on n = 0, 1, P + 1 (odd for
even P), 1001 and 100003 elements: integers and max/min bit for bit equal to Allreduce, float
sum/prod within collective_cases' stated tolerance (another order of additions). Then the
world's layout from the environment, a layout error on every rank, and DelayComm: its
cross-node Send waits, its same-node one does not. Rank 0 prints the problems, then
"ALL OK cases=N" or "FAILED problems=K", and a "DELAY intra=... inter=..." line.
"""
import time

import collective_cases as cc
import numpy as np
from mpi4py import MPI

from minidist import collectives
from minidist.node_layout import node_layout, set_ranks_per_node
from minidist.p2p import CollectiveError
from minidist.topology_delay import DelayComm

MPI_OPS = {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}
LAYOUTS = {2: (1, 2), 3: (1,), 4: (2,), 5: (1,), 6: (2, 3), 7: (7,), 8: (2, 4)}  # P: ranks per fake node
ALGORITHMS = ("hierarchical", "torus")


def cases(p):
    """(n, dtype, op): every op on int64 and float64 for the small sizes, sums for the large one."""
    small = [(n, dtype, op) for n in (0, 1, p + 1, 1001) for dtype in ("int64", "float64") for op in MPI_OPS]
    return small + [(100003, "int64", "sum"), (100003, "float32", "sum")]


def check(comm, algorithm, n, dtype, op):
    """Problems of one all-reduce against Allreduce (an empty list when fine)."""
    p, rank = comm.Get_size(), comm.Get_rank()
    xs = cc.inputs(p, n, dtype, op)
    mine = collectives.all_reduce(comm, xs[rank], op=op, algorithm=algorithm)
    theirs = np.empty_like(xs[rank])
    comm.Allreduce(xs[rank], theirs, op=MPI_OPS[op])
    exact = np.dtype(dtype).kind in "iu" or op in ("max", "min")
    if exact and mine.tobytes() != theirs.tobytes():
        return [f"{algorithm} p={p} n={n} {dtype} {op}: differs from Allreduce on rank {rank}"]
    if not exact and not (cc.within_tolerance(mine, xs, op) and cc.within_tolerance(theirs, xs, op)):
        return [f"{algorithm} p={p} n={n} {dtype} {op}: outside the tolerance on rank {rank}"]
    return []


def main():
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    problems, count = [], 0
    for p, layouts in LAYOUTS.items():
        sub = world.Split(0 if rank < p else MPI.UNDEFINED, rank)
        if sub == MPI.COMM_NULL:
            continue
        for ranks_per_node in layouts:
            set_ranks_per_node(sub, ranks_per_node)
            layout = node_layout(sub)
            if (layout.num_nodes, layout.ranks_per_node, layout.source) != (p // ranks_per_node, ranks_per_node,
                                                                             "setting"):
                problems.append(f"p={p} l={ranks_per_node}: layout {layout[:4]}")
            for algorithm in ALGORITHMS:
                for n, dtype, op in cases(p):
                    problems += check(sub, algorithm, n, dtype, op)
                    count += 1
        if p == 6:  # fake nodes of 4 do not divide 6 ranks: the same error on every rank
            set_ranks_per_node(sub, 4)
            try:
                collectives.all_reduce(sub, np.ones(3), algorithm="torus")
                problems.append(f"rank {rank}: nodes of 4 on 6 ranks did not raise")
            except CollectiveError as error:
                if "6 ranks do not split into fake nodes of 4" not in str(error):
                    problems.append(f"rank {rank}: wrong error {error}")
        sub.Free()
    layout = node_layout(world)  # MINIDIST_RANKS_PER_NODE=2 from the environment
    if (layout.nodes, layout.source) != ((0, 0, 1, 1, 2, 2, 3, 3), "environment"):
        problems.append(f"rank {rank}: the world's layout is {layout[:4]}")
    problems += check(world, "hierarchical", 1001, "float64", "sum")

    slow = DelayComm(world, inter=(0.05, 1e9))  # ranks_per_node from the environment
    x = np.zeros(1000, np.uint8)
    seconds = []
    world.Barrier()
    if rank == 0:
        for dest in (1, 2):  # rank 1 shares node 0; rank 2 is on node 1
            start = time.perf_counter()
            slow.Send(x, dest)
            seconds.append(time.perf_counter() - start)
    elif rank in (1, 2):
        slow.Recv(x, 0)
    problems += check(slow, "hierarchical", 1001, "int64", "sum")
    problems += check(slow, "auto", 100003, "int64", "sum")
    count += 3

    found = world.gather(problems, root=0)
    if rank == 0:
        found = [line for lines in found for line in lines]
        for line in found:
            print(line)
        print(f"DELAY intra={seconds[0]:.4f} inter={seconds[1]:.4f}")
        print(f"ALL OK cases={count}" if not found else f"FAILED problems={len(found)}")


if __name__ == "__main__":
    main()
