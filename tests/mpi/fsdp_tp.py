"""FSDP with tensor parallelism inside under real mpiexec -n 4 against one process (run by
tests/test_fsdp_tp.py): dp 2 x tp 2, FULL_SHARD, the GPT in float64, six AdamW steps with
clipping; the dense weights and the evaluations equal the one-process run on the global batch
of 8 to 1e-10. Prints 'FSDPxTP OK' on rank 0, or the problems."""
import dataclasses
import sys
from pathlib import Path

from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import test_gpt_train as G

from minidist import train, workloads
from minidist.parallel.fsdp.train import train_fsdp

workloads.LanguageModelWorkload.model = G.float64_model
comm = MPI.COMM_WORLD
text = workloads.load_text(G.TEXT)
config = train.TrainConfig(**G.TINY)
result = train_fsdp(comm, dataclasses.replace(config, strategy="fsdp", tp=2, batch_size=4, scale_lr=False), text)
if comm.Get_rank() == 0:
    single = train.train_single(config, text)
    problems = G.differences_from(single, result)
    if (result.figures["dp"], result.figures["tp"]) != (2, 2):
        problems.append(f"the layout is {result.figures}")
    print("FSDPxTP OK" if not problems else "\n".join(problems), flush=True)
