"""Launcher test script: `crash` makes rank 1 raise while the others wait for it forever;
`hang` sleeps past any timeout after writing its pid; `echo` prints rank, args and $MINIDIST_TEST."""
import os
import sys
import time

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
mode = sys.argv[1]
if mode == "echo":
    print(f"rank {comm.Get_rank()} of {comm.Get_size()} args={sys.argv[2:]} env={os.environ.get('MINIDIST_TEST')}")
elif mode == "crash":
    if comm.Get_rank() == 1:
        raise RuntimeError("rank 1 crashed on purpose")
    comm.Recv(np.zeros(1), source=1)  # never sent: only the abort ends this
elif mode == "hang":
    with open(f"{sys.argv[2]}.{comm.Get_rank()}", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
