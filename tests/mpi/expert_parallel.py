"""Expert parallelism under real mpiexec (run by tests/test_expert_parallel.py on 2 and 4 ranks),
float64: (1) one MoE layer, E = 5 experts over the ranks (uneven), tokens split over them: outputs,
the dropped set and the gradients equal the one-process layer to 1e-12; (2) three AdamW steps of
the MoE GPT with --strategy ep (with --dp 2 on 4 ranks) equal train_single on the global batch
of 8 to 1e-10. Prints 'EP OK' on rank 0, or the problems."""
import dataclasses
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import test_expert_parallel as X
import test_gpt_train as G
import test_moe as M

from minidist import train, workloads
from minidist.collectives import gather_objects
from minidist.parallel.expert_parallel.train import train_expert_parallel

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
problems = []

# (1) the layer
config = M.moe_config(5, 2, 0.75)
x, v = M.tokens(24), np.random.default_rng(7).standard_normal((24, M.C))
mine = M.ep_layer_run(comm, config, x, v, 1, True)
got = gather_objects(comm, mine)
if rank == 0:
    one = M.make_layer(config, True)
    xt = M.Tensor(x[None], requires_grad=True)
    (one(xt) * M.Tensor(v[None])).sum().backward()
    checks = {"outputs": (np.concatenate([g[0] for g in got]), one(M.Tensor(x[None])).data[0]),
              "input gradients": (np.concatenate([g[2] for g in got]), xt.grad[0]),
              "router gradient": (sum(g[3] for g in got), one.router.weight.grad)}
    for name, (a, b) in checks.items():
        if not np.abs(a - b).max() < 1e-12:
            problems.append(f"the layer's {name} differ from one process's by {np.abs(a - b).max():.3g}")
    if not (np.concatenate([g[1] for g in got]) == one.plan.keep).all():
        problems.append("the dropped set differs from one process's")
    for e in range(5):
        holder = next(g[4][e] for g in got if e in g[4])
        if any(not np.abs(h - q.grad).max() < 1e-12 for h, q in zip(holder, one.experts[e].parameters())):
            problems.append(f"expert {e}'s gradients differ from one process's")

# (2) the GPT
workloads.LanguageModelWorkload.model = X.moe_float64_model
text = workloads.load_text(G.TEXT)
run = train.TrainConfig(**X.EP, dp=2 if size == 4 else 1, global_batch_size=8)
result = train_expert_parallel(comm, run, text)
if rank == 0:
    single = train.train_single(dataclasses.replace(run, strategy="single", dp=1), text)
    problems += G.differences_from(single, result)
    print("EP OK" if not problems else "\n".join(problems), flush=True)
