"""A data-parallel job in which rank 1 calls ``sys.exit(0)`` right after constructing
DistributedDataParallel while rank 0 keeps training. Rank 1 then waits in MPI_Finalize and
rank 0 in its first gradient all-reduce; the collectives' deadline must end the job with an
error that names rank 1 (not a hang, not an MPI library assertion).

    mpiexec -n 2 python -m mpi4py tests/mpi/ddp_rank_exits.py [TIMEOUT_SECONDS]
"""
import sys

import numpy as np

from minidist import nn, optim, p2p
from minidist.functions import cross_entropy
from minidist.parallel import DistributedDataParallel
from minidist.tensor import Tensor


def main(timeout):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    p2p.set_timeout(timeout)
    model = nn.mlp([8, 16, 4], rng=0)
    ddp = DistributedDataParallel(model, comm)
    if comm.Get_rank() == 1:
        sys.exit(0)  # leaves the job early, without an error
    optimizer = optim.SGD(ddp.parameters(), lr=0.1)
    rng = np.random.default_rng(0)
    for step in range(5):
        x, y = rng.standard_normal((4, 8)).astype(np.float32), rng.integers(0, 4, 4)
        optimizer.zero_grad()
        cross_entropy(ddp(Tensor(x)), y).backward()
        optimizer.step()
        print(f"step {step} done", flush=True)


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 2.0)
