"""A rank SIGSTOPped mid-run under --strategy tp or 3d (run by tests/test_three_d.py): the last
rank of the job stops itself before its fourth training step (as `kill -STOP` would); the
others must end within the deadline (--timeout 5), naming it, instead of hanging. Usage:
mpiexec -n N python -m mpi4py tests/mpi/stopped_rank.py STRATEGY-FLAGS..."""
import os
import signal
import sys

from mpi4py import MPI

from minidist import cli, workloads

iterate = workloads.WindowLoader.__iter__


def stopping(self):
    for step, batch in enumerate(iterate(self)):
        if step == 3 and MPI.COMM_WORLD.Get_rank() == MPI.COMM_WORLD.Get_size() - 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        yield batch


workloads.WindowLoader.__iter__ = stopping
sys.exit(cli.main(["train", "--model", "gpt", "--n-layer", "2", "--n-head", "4", "--n-embd", "32", "--block-size",
                   "16", "--batch-size", "8", "--steps", "40", "--eval-every", "20", "--no-progress", "--timeout", "5",
                   *sys.argv[1:]]))
