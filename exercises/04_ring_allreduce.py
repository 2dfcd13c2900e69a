"""Exercise 04, the MPI part: ring all-reduce from Send and Recv.

Every process runs this file. Write ``ring_all_reduce`` below (the same function you wrote
in ``04_ring_allreduce.ipynb``, where you can watch it on the simulated world first), then run

    .venv/bin/mpiexec -n 4 .venv/bin/python -m mpi4py exercises/04_ring_allreduce.py

or ``.venv/bin/python -m minidist check 04``. The script compares your result with MPI's ``Allreduce``
and counts what each rank sends: a ring all-reduce sends 2(p-1) messages per rank, about
2n(p-1)/p elements in all. A ring that passes whole tensors gets the right sum and still fails.
It also runs int64 and a 1 MiB float32 array (the result keeps x's dtype), with every Send made
synchronous: a ring where every rank Sends before it Receives waits forever (use Sendrecv), and
``.venv/bin/python -m minidist check 04`` reports that when its timeout ends the job.

Rules: only point-to-point calls (``Send``, ``Recv``, ``Sendrecv``, ``Isend``/``Irecv``);
return a new array of x's shape; leave ``x`` unchanged.
"""
import sys

import numpy as np

from minidist.course import checks
from minidist.course.checks import collectives as collective_checks


def ring_all_reduce(comm, x):
    """The sum of every rank's ``x``, on every rank, by a ring (shape and dtype of x).

    Flatten a copy of x and cut it into p chunks with ``numpy.array_split`` (the first
    n % p chunks are one element longer). Rank r sends to r + 1 and receives from r - 1.
      Reduce-scatter, steps s = 0 .. p-2: send chunk (r - s - 1) % p, receive chunk
      (r - s - 2) % p and add it into your own copy of that chunk. Afterwards rank r holds
      the complete sum of chunk r.
      All-gather, steps s = 0 .. p-2: send chunk (r - s) % p (the finished one you got last),
      receive chunk (r - s - 1) % p and overwrite yours with it.
    Each rank sends 2(p-1) messages of about n/p elements: 2n(p-1)/p in all, whatever p.
    """
    # YOUR CODE HERE
    raise NotImplementedError()


def main():
    return checks.run_under_mpi("04_ring_allreduce", [(collective_checks.check_ring_all_reduce, ring_all_reduce)])


if __name__ == "__main__":
    sys.exit(main())
