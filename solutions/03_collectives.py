"""Exercise 03, the MPI part: broadcast, gather and all-gather from Send and Recv.

Every process runs this file. Write the three functions below (the same ones you wrote in
``03_collectives.ipynb``, where you can try them on the simulated world first), then run

    .venv/bin/mpiexec -n 4 .venv/bin/python -m mpi4py exercises/03_collectives.py

or ``.venv/bin/python -m minidist check 03``. The script checks each function against MPI's own
(``Bcast``, ``Gather``, ``Allgather``) and counts the messages each rank sends, on float64,
int64 and a 1 MiB float32 array (the result keeps x's dtype) with every Send made synchronous
(a program must not rely on MPI buffering its sends), prints one line per function, and exits
with status 1 at the first problem.

Rules: use only ``comm.Get_rank()``, ``comm.Get_size()``, ``comm.Send``, ``comm.Recv``
(``Sendrecv``, ``Isend``/``Irecv`` + ``Wait`` are allowed too). MPI's collectives are off
limits: the communicator you get refuses them. Return new arrays; leave ``x`` unchanged.
"""
import sys

import numpy as np

from minidist.course import checks
from minidist.course.checks import collectives as collective_checks


def broadcast(comm, x, root=0):
    """Root's ``x`` on every rank, by a binomial tree.

    Number the ranks relative to the root, ``vr = (rank - root) % p``. With m the largest
    power of two below p, the root first sends to vr = m; then every holder sends to the
    rank m/2 further on, then m/4, ... down to 1 (skipping targets >= p): the number of
    holders doubles each round, so ceil(log2 p) rounds. Seen from one rank: receive once,
    from vr minus its lowest set bit, then send to vr + k for every power of two k below
    that bit, the largest k first (the root sends to every power of two below p).
    """
    ### BEGIN SOLUTION
    rank, p = comm.Get_rank(), comm.Get_size()
    vr = (rank - root) % p
    out = x.copy() if rank == root else np.empty_like(x)
    mask = 1
    while mask < p:  # find my parent: the lowest set bit of vr
        if vr & mask:
            comm.Recv(out, source=(rank - mask) % p)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:  # pass it on to my children, the farthest one first
        if vr + mask < p:
            comm.Send(out, dest=(rank + mask) % p)
        mask >>= 1
    return out
    ### END SOLUTION


def gather(comm, x, root=0):
    """Every rank's ``x`` stacked on the root, shape (p, *x.shape), row r from rank r;
    None on the other ranks. Each rank sends its x to the root once."""
    ### BEGIN SOLUTION
    rank, p = comm.Get_rank(), comm.Get_size()
    if rank != root:
        comm.Send(np.ascontiguousarray(x), dest=root)
        return None
    out = np.empty((p,) + x.shape, x.dtype)
    for r in range(p):
        if r == root:
            out[r] = x
        else:
            comm.Recv(out[r], source=r)
    return out
    ### END SOLUTION


def all_gather(comm, x):
    """Every rank's ``x`` stacked on every rank, shape (p, *x.shape), by a ring.

    Rank r sends to r + 1 and receives from r - 1 (mod p). In step s (s = 0 .. p-2) it
    passes on the block it got in the step before (its own block at s = 0), which is block
    r - s, and receives block r - s - 1. After p - 1 steps every block has visited every rank.
    """
    ### BEGIN SOLUTION
    rank, p = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % p, (rank - 1) % p
    out = np.empty((p,) + x.shape, x.dtype)
    out[rank] = x
    for s in range(p - 1):
        comm.Sendrecv(out[(rank - s) % p], dest=right, recvbuf=out[(rank - s - 1) % p], source=left)
    return out
    ### END SOLUTION


def main():
    return checks.run_under_mpi("03_collectives", [(collective_checks.check_broadcast, broadcast),
                                                   (collective_checks.check_gather, gather),
                                                   (collective_checks.check_all_gather, all_gather)])


if __name__ == "__main__":
    sys.exit(main())
