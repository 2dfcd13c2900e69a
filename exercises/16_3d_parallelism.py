"""Exercise 16, the MPI part: the mesh's three groups under real mpiexec.

Every process runs this file. Write ``build_groups`` below (the same function you wrote in
``16_3d_parallelism.ipynb``, where the simulator checked it first), then run

    .venv/bin/mpiexec -n 8 .venv/bin/python -m mpi4py exercises/16_3d_parallelism.py

or ``.venv/bin/python -m minidist check 16`` (4 ranks by default; ``--ranks 8`` for the ten shapes of
8). On the simulator every rank is a thread of one Python process; here each is its own process,
and ``comm.Split`` is MPI's MPI_Comm_split: the check runs your function on every (dp, pp, tp)
shape of the job's ranks and verifies, on every rank, the three names, three Splits, each group's
size, this rank's coordinate as its rank there, and the members (an all-gather over the group).
"""
import sys

import numpy as np

from minidist.course import checks
from minidist.course.checks import mesh as mesh_checks


def build_groups(comm, shape):
    """This rank's three groups of the (dp, pp, tp) mesh of shape ``shape`` over ``comm``, ranks
    numbered row-major with tp fastest: ``{"dp": group, "pp": group, "tp": group}``, each made by
    one ``comm.Split(color, key)`` (colour: the other two coordinates raveled; key: this
    rank's coordinate along the dimension)."""
    # YOUR CODE HERE
    raise NotImplementedError()


def main():
    return checks.run_under_mpi("16_3d_parallelism", [(mesh_checks.check_build_groups_under_mpi, build_groups)])


if __name__ == "__main__":
    sys.exit(main())
