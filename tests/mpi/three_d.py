"""3-D parallelism under real mpiexec -n 8 against one process (run by tests/test_three_d.py):
dp 2 x pp 2 x tp 2, the GPT in float64, three AdamW steps with warm-up, cosine and clipping,
two micro-batches; the dense weights and the evaluations equal the one-process run on the
global batch (2 x 8 windows) to 1e-10. The composition (tp, then pp, then dp) is
``three_d.train.parallelize`` run by the one loop, ``train.train_parallel``. Prints '3D OK' on
rank 0, or the problems."""
import dataclasses
import sys
from pathlib import Path

from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import test_gpt_train as G

from minidist import train, workloads
from minidist.parallel.three_d.train import train_3d

workloads.LanguageModelWorkload.model = G.float64_model
comm = MPI.COMM_WORLD
text = workloads.load_text(G.TEXT)
config = train.TrainConfig(**dict(G.TINY, n_head=4, steps=3, eval_every=3, scale_lr=False))
result = train_3d(comm, dataclasses.replace(config, strategy="3d", dp=2, tp=2, microbatches=2), text)
if comm.Get_rank() == 0:
    single = train.train_single(dataclasses.replace(config, batch_size=2 * config.batch_size), text)
    problems = G.differences_from(single, result)
    if (result.figures["dp"], result.figures["pp"], result.figures["tp"]) != (2, 2, 2):
        problems.append(f"the layout is {result.figures}")
    print("3D OK" if not problems else "\n".join(problems), flush=True)
