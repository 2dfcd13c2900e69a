"""Every pipeline schedule under real mpiexec against one process (run by
tests/test_pipeline_executor.py): gradients after one step equal the single-process ones
(float64, <= 1e-12). Prints 'ALL OK ranks=P' on rank 0, or the problems."""
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import test_pipeline_executor as T

comm = MPI.COMM_WORLD
p, rank = comm.Get_size(), comm.Get_rank()
problems = []
cases = [(name, 1) for name in sorted(T.SCHEDULES)] + [("1f1b", 2)]
for name, v in cases:
    m = 4 * v
    x, y = T.data(batch=16)
    grads, losses, _, _ = T.run_pipeline(comm, name, m, x, y, v)
    expected, _ = T.single_process_grads(x, y, m)
    num_stages = p * v
    # which parameters are this rank's: count them stage by stage on the full model
    model = T.make_model()
    slices = T.stage_slices(num_stages)
    offset = 0
    for s in range(num_stages):
        count = len(list(model[slices[s]].parameters()))
        if s in grads:
            for g, e in zip(grads[s], expected[offset:offset + count]):
                if g is None or np.max(np.abs(g - e)) > T.TOL:
                    problems.append(f"{name} v={v}: stage {s} gradient differs")
        offset += count
found = comm.gather(problems, root=0)
if rank == 0:
    flat = [x for part in found for x in part]
    print(f"ALL OK ranks={p}" if not flat else "\n".join(flat))
