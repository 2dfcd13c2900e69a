"""Exercise 07, the MPI part: one GPipe stage's send/recv loop.

Every process runs this file and holds one stage of the model: process r runs stage r.
Write ``gpipe_stage_step`` below (the same function you wrote in
``07_model_parallelism.ipynb``, where you can run it on the simulated world first), then run

    .venv/bin/mpiexec -n 4 .venv/bin/python -m mpi4py exercises/07_model_parallelism.py

or ``.venv/bin/python -m minidist check 07``. For m = 1, 2, 3 and 4 micro-batches the script runs one
step of your pipeline and checks that every stage's gradients equal those of one process
that runs the whole model on the whole mini-batch (to 1e-10, float64), that the last process
returns the micro-batch losses, and that each micro-batch crossed each boundary between
processes exactly once forward and once back. Your ``Send`` is made synchronous (``Ssend``),
so a pipeline that only works because MPI buffered a message hangs here, as it would with
larger messages; ``.venv/bin/python -m minidist check`` stops it after its timeout.
"""
import sys

import numpy as np

from minidist.course import checks
from minidist.course.checks import pipeline as pipeline_checks
from minidist.functions import cross_entropy  # used by your code (the stub does not use it yet)
from minidist.tensor import Tensor


def microbatch_rows(batch_size, m):
    """Rows of each of the m micro-batches that ``numpy.array_split`` cuts a mini-batch of
    ``batch_size`` rows into (the first ``batch_size % m`` one row longer)."""
    return [len(part) for part in np.array_split(np.empty(batch_size), m)]


def gpipe_stage_step(comm, stage, x, y, m, batch_size):
    """One GPipe step of this rank's stage: forward every micro-batch, then backward every
    micro-batch, leaving in ``stage``'s parameters the gradient of the mean micro-batch loss.

    comm: the pipeline's communicator; rank r runs stage r of ``comm.Get_size()``.
    stage: this rank's layers (an ``nn.Sequential`` starting with a Linear: a received
        activation has ``stage[0].in_features`` columns, dtype ``stage[0].weight.dtype``).
    x: the mini-batch, shape (batch_size, features), on rank 0; None elsewhere.
    y: its integer labels, shape (batch_size,), on the last rank; None elsewhere.
    m: number of micro-batches (``numpy.array_split`` of the mini-batch).
    batch_size: rows of the mini-batch (every rank needs it to size its receive buffers).
    Returns the list of the m micro-batch losses (floats) on the last rank, None elsewhere.

    Forward, for i = 0 .. m-1: rank 0 takes micro-batch i of x; every other rank receives it
    from rank - 1 (``comm.Recv``) as ``Tensor(buf, requires_grad=True)``; run ``stage``; the last
    rank computes ``cross_entropy(out, y_i)``, the others ``comm.Send`` ``out.data`` to rank + 1.
    Keep each micro-batch's input and output. Backward, for i = 0 .. m-1: the last rank starts
    from its loss, scaled by 1/m (``loss.backward(numpy.asarray(1.0 / m))``); every other rank
    receives the gradient of its output from rank + 1 and calls ``out.backward(grad)``; every
    rank but the first sends ``inp.grad`` to rank - 1."""
    # YOUR CODE HERE
    raise NotImplementedError()


def main():
    return checks.run_under_mpi("07_model_parallelism", [(pipeline_checks.check_gpipe_stage_step, gpipe_stage_step)])


if __name__ == "__main__":
    sys.exit(main())
