"""One rank stops (SIGSTOP, as a rank frozen by a debugger or a swapped-out node would) at a
point of start-up or shutdown; every other rank must end within the deadline, naming it.

    mpiexec -n 3 python -m mpi4py tests/mpi/startup_stop.py WHERE SECONDS

WHERE: ``grid`` (before ``ProcessGrid.create``, whose ``comm.Split`` would wait forever),
``blas`` (before ``launch.limit_blas_threads``, which counts the ranks on each node), or
``finish`` (rank 1 stops after training, before ``train`` ends and MPI finalizes). SECONDS: the
deadline of every wait (``--timeout``). A rank that gives up prints one line naming the rank it
waited for and the seconds it waited, then aborts the job (the stopped rank with it).
"""
import os
import signal
import sys
import time

from mpi4py import MPI

from minidist import cli, launch
from minidist.cli import train as train_cli
from minidist.p2p import set_timeout
from minidist.parallel.pipeline.grid import ProcessGrid

STOPPED = 1
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
where, seconds = sys.argv[1], float(sys.argv[2])


def stop_here():
    if rank == STOPPED:
        os.kill(os.getpid(), signal.SIGSTOP)


if where == "finish":
    real_driver = train_cli.run_driver

    def train_then_stop(*args, **kwargs):
        result = real_driver(*args, **kwargs)
        stop_here()
        return result

    train_cli.run_driver = train_then_stop
    sys.exit(cli.main(["train", "--strategy", "ddp", "--epochs", "1", "--hidden", "8", "--no-progress",
                       "--timeout", str(seconds)]))

set_timeout(seconds)
stop_here()
start = time.perf_counter()
try:
    if where == "grid":
        ProcessGrid.create(comm, 1)
    elif where == "blas":
        launch.limit_blas_threads(comm)
    else:
        raise SystemExit(f"unknown WHERE {where!r}")
except TimeoutError as error:
    print(f"rank {rank} gave up after {time.perf_counter() - start:.1f} s: {error}", file=sys.stderr, flush=True)
    launch.abort_job(comm, 1)  # after a moment for mpiexec to forward the line (an abort at once could lose it)
print(f"rank {rank} passed {where}", flush=True)
