"""Exercise 00, the MPI part: every process runs this same file.

Under ``mpiexec -n 4`` four copies start at once; each learns its rank (0..3) and the world
size (4) and takes its own share of the values. Run it the way the grader does::

    .venv/bin/python -m minidist check 00

(or by hand: ``.venv/bin/mpiexec -n 4 .venv/bin/python -m mpi4py exercises/00_warmup.py``).
"""
from mpi4py import MPI

from minidist.course import checks


def my_share(values, rank, size):
    """The values that rank ``rank`` of ``size`` handles: every ``size``-th one, starting at
    index ``rank`` (rank 1 of 4 gets indices 1, 5, 9, ...)."""
    # YOUR CODE HERE
    raise NotImplementedError()


def main():
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    values = list(range(1, 11))
    share = my_share(values, rank, size)
    # Lowercase mpi4py calls pickle Python objects: fine for a few numbers like these.
    counts = comm.allgather(len(share))
    total = comm.allreduce(sum(share))
    checks.check_equal(sum(counts), len(values), "values handled over all ranks",
                       hint="every value must belong to exactly one rank")
    checks.check_equal(total, sum(values), "sum of every rank's share",
                       hint="start at index rank and step by size")
    if rank == 0:
        print(f"{size} ranks shared {len(values)} values (counts {counts}); total {total}: checks pass")


if __name__ == "__main__":
    main()
