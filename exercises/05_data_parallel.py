"""Exercise 05, the MPI part: gradient averaging in a data-parallel step.

Every process runs this file. Write ``average_gradients`` and ``train_step`` below (the same
functions you wrote in ``05_data_parallel.ipynb``, where you can run them on the simulated
world first), then run

    .venv/bin/mpiexec -n 4 .venv/bin/python -m mpi4py exercises/05_data_parallel.py

or ``.venv/bin/python -m minidist check 05``. The script checks your averaging against the mean of every
rank's gradients, counts the messages (one all-reduce of all gradients flattened together),
and trains a few steps on every rank: the parameters must equal those of one process trained
on the global batch and those of ``DistributedDataParallel``, to 1e-10 in float64.
"""
import sys

import numpy as np

from minidist import collectives
from minidist.course import checks
from minidist.course.checks import parallel as parallel_checks
from minidist.functions import cross_entropy
from minidist.tensor import Tensor


def average_gradients(comm, params):
    """Replace every ``p.grad`` in ``params`` by the mean of that gradient over the ranks,
    with one all-reduce of all gradients flattened together:
    ``np.concatenate`` the flattened gradients in parameter order, ``collectives.all_reduce``
    the flat array, divide by ``comm.Get_size()``, and give each parameter its slice back,
    reshaped to the parameter's shape."""
    # YOUR CODE HERE
    raise NotImplementedError()


def train_step(comm, model, optimizer, xb, yb):
    """One synchronous data-parallel SGD step on this rank's batch (zero the gradients,
    forward, cross-entropy, backward, average the gradients, optimizer step); returns this
    rank's loss as a float."""
    # YOUR CODE HERE
    raise NotImplementedError()


def main():
    return checks.run_under_mpi("05_data_parallel", [(parallel_checks.check_average_gradients, average_gradients),
                                                     (parallel_checks.check_train_step, train_step)])


if __name__ == "__main__":
    sys.exit(main())
