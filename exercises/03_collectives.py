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
    # YOUR CODE HERE
    raise NotImplementedError()


def gather(comm, x, root=0):
    """Every rank's ``x`` stacked on the root, shape (p, *x.shape), row r from rank r;
    None on the other ranks. Each rank sends its x to the root once."""
    # YOUR CODE HERE
    raise NotImplementedError()


def all_gather(comm, x):
    """Every rank's ``x`` stacked on every rank, shape (p, *x.shape), by a ring.

    Rank r sends to r + 1 and receives from r - 1 (mod p). In step s (s = 0 .. p-2) it
    passes on the block it got in the step before (its own block at s = 0), which is block
    r - s, and receives block r - s - 1. After p - 1 steps every block has visited every rank.
    """
    # YOUR CODE HERE
    raise NotImplementedError()


def main():
    return checks.run_under_mpi("03_collectives", [(collective_checks.check_broadcast, broadcast),
                                                   (collective_checks.check_gather, gather),
                                                   (collective_checks.check_all_gather, all_gather)])


if __name__ == "__main__":
    sys.exit(main())
