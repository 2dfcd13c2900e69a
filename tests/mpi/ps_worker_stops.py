"""A parameter-server job in which one worker stops early (it returns after its first push,
without saying DONE). The server's deadline must end the job with an error that names that
worker, not the rank that waited.

    mpiexec -n 3 python -m mpi4py tests/mpi/ps_worker_stops.py [TIMEOUT]

Rank 0 is the server, ranks 1 and 2 the workers; worker rank 2 stops after one step.
"""
import sys

import numpy as np

from minidist import nn
from minidist.functions import cross_entropy
from minidist.parallel import parameter_server as ps
from minidist.tensor import Tensor

STOPPING_WORKER = 2


def job(comm, timeout, steps=5):
    model = nn.mlp([4, 3, 2], rng=0, dtype="float64")
    rank = comm.Get_rank()
    if rank == 0:
        return ps.ParameterServer(comm, model, mode="sync", lr=0.1, timeout=timeout).serve()
    worker = ps.Worker(comm, model, timeout=timeout)
    rng = np.random.default_rng(rank)
    xb, yb = rng.standard_normal((4, 4)), rng.integers(0, 2, 4)
    for _ in range(1 if rank == STOPPING_WORKER else steps):
        worker.pull()
        model.zero_grad()
        cross_entropy(model(Tensor(xb)), yb).backward()
        worker.push()
    if rank == STOPPING_WORKER:
        return None  # stops early: no DONE
    return worker.finish(receive_final=rank == 1)


if __name__ == "__main__":
    from mpi4py import MPI

    job(MPI.COMM_WORLD, float(sys.argv[1]) if len(sys.argv) > 1 else 2.0)
