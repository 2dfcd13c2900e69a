"""Context parallelism under real mpiexec (2 or 4 ranks) against one process (run by
tests/test_context_parallel.py), in float64: every variant of ``context_parallel_attention``
(causal and not, a length no P > 1 divides) gives dense attention's output and dQ, dK, dV to
1e-12 on every rank; then ``train_context_parallel`` (ring on every rank; on 4 ranks also zig-zag,
dp 2 x cp 2, and cp 2 x tp 2: ring, and zig-zag with sequence parallelism) gives one process's
weights and evaluations on the global batch to 1e-10.
Prints 'CP OK' on rank 0, or the problems."""
import dataclasses
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import test_context_parallel as C
import test_gpt_train as G

from minidist import train, workloads
from minidist.collectives import gather_objects
from minidist.parallel.context_parallel.train import train_context_parallel

comm = MPI.COMM_WORLD
p, problems = comm.Get_size(), []
for variant in C.VARIANTS:
    for t in (8, 13):
        q, k, v, do = C.arrays(t, seed=t)
        for is_causal in (True, False):
            got, _ = C.cp_rank(comm, q, k, v, do, is_causal, variant)
            worst = max(float(np.abs(a - b).max()) for a, b in zip(got, C.dense(q, k, v, do, is_causal)))
            if worst > 1e-12:
                problems.append(f"rank {comm.Get_rank()}: {variant} T={t} causal={is_causal}: {worst:.2e} from dense")

workloads.LanguageModelWorkload.model = G.float64_model
text = workloads.load_text(G.TEXT)
config = train.TrainConfig(**C.CP)
# (dp, tp, variant, sequence parallelism)
layouts = [(1, 1, "ring", False)] + ([(1, 1, "zigzag", False), (2, 1, "ring", False), (1, 2, "ring", False),
                                       (1, 2, "zigzag", True)] if p == 4 else [])
for dp, tp, variant, sp in layouts:
    run = dataclasses.replace(config, dp=dp, tp=tp, cp_variant=variant, sequence_parallel=sp)
    result = train_context_parallel(comm, run, text)
    if comm.Get_rank() == 0:
        single = train.train_single(dataclasses.replace(run, strategy="single", dp=1, tp=1, sequence_parallel=False,
                                                        batch_size=8 * dp), text)
        problems += [f"dp {dp} x cp {p // (dp * tp)} x tp {tp} {variant}{' sp' * sp}: {problem}"
                     for problem in G.differences_from(single, result)]
everyone = gather_objects(comm, problems)
if comm.Get_rank() == 0:
    found = [problem for mine in everyone for problem in mine]
    print("CP OK" if not found else "\n".join(found), flush=True)
