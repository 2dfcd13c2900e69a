"""HYBRID_SHARD under real mpiexec -n 4 in fake nodes of 2 (MINIDIST_RANKS_PER_NODE=2, run by
tests/test_hsdp.py): FULL_SHARD in each node, the two nodes replicas; the GPT in float64, six AdamW
steps with clipping; the weights equal the one-process run on the global batch of 8 to 1e-10 and
the bytes across the nodes are 2 (N - 1) / N of a node's shard per rank and step. Prints
'HSDP OK' on rank 0, or the problems."""
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
hybrid = dataclasses.replace(config, strategy="fsdp", sharding_strategy="HYBRID_SHARD", batch_size=2, scale_lr=False)
result = train_fsdp(comm, hybrid, text)
if comm.Get_rank() == 0:
    single = train.train_single(config, text)
    problems = []
    difference = G.max_difference(G.weights(single.model), G.weights(result.model))
    if not difference < 1e-10:
        problems.append(f"the weights differ from one process's by up to {difference:.3g}")
    cross = [int(b) for b in result.figures["cross_bytes_per_step"].split(",")]
    shard = result.figures["parameter_bytes"]  # a node's shard of the padded vectors, in bytes
    if cross != [shard] * 4:  # 2 (N - 1) / N of it with N = 2 nodes
        problems.append(f"bytes across the nodes per step {cross}, expected {shard} on every rank")
    print("HSDP OK" if not problems else "\n".join(problems), flush=True)
