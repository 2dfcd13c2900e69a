"""Data x pipeline parallelism under real mpiexec -n 4 against one process (run by
tests/test_pipeline_train.py): 2 pipelines of 2 stages, one step of every schedule, the
parameters after the step equal the one-process step on the global batch (float64, <= 1e-12).
Prints 'DPxPP OK' on rank 0, or the problems."""
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import test_pipeline_train as T

comm = MPI.COMM_WORLD
problems = []
x, y = T.global_batch()
expected, expected_loss = T.one_process_step(x, y)
for schedule in sorted(T.SCHEDULES):
    params, loss = T.dp_pp_step(comm, 2, schedule, 2, x, y)
    found = comm.allgather(params)
    for dp_rank in range(2):
        got = {}
        for part in found[2 * dp_rank:2 * dp_rank + 2]:
            got.update(part)
        flat = [a for s in sorted(got) for a in got[s]]
        if len(flat) != len(expected) or any(np.max(np.abs(a - e)) > T.TOL for a, e in zip(flat, expected)):
            problems.append(f"{schedule}: pipeline {dp_rank}'s parameters differ from one process")
    if abs(loss - expected_loss) > T.TOL:
        problems.append(f"{schedule}: rank {comm.Get_rank()} loss {loss} != {expected_loss}")
problems = comm.gather(problems, root=0)
if comm.Get_rank() == 0:
    flat = [p for part in problems for p in part]
    print("DPxPP OK" if not flat else "\n".join(flat))
