"""Tensor and sequence parallelism's three figures (issue 20, part 5), from one run:

(a) **Bytes per step.** What each rank sends in one training step (forward, backward, gradient
    clipping) of the same GPT split three ways, counted message by message on ``minidist.sim``
    ranks (``tracing.CountingComm``; the same algorithms as under mpiexec): tensor parallelism
    (Megatron-LM), tensor + sequence parallelism (Korthikanti et al., MLSys 2023), and data parallelism
    (DDP, the same global batch cut over the ranks). Beside each, the closed form: every
    collective's bytes per rank from ``costmodel.terms`` for the algorithm "auto" picks
    (``costmodel.choose_all_reduce``): TP sends 2(1 + 2L) all-reduces of an activation of
    B·T·C values per step, three of B·T numbers (the vocabulary-parallel loss; one of them
    carries V too) and one of one number (the clipping); TP + SP sends reduce-scatters and all-gathers of the same
    activations instead, plus one more all-gather per column-parallel layer (its input gathered
    again in backward) and the gradients of the whole parameters used on a block of positions;
    DDP one all-reduce of every gradient, in buckets, whatever the batch.
(b) **Activation memory per rank.** ``memory.track`` over one forward: the bytes kept for
    backward by the dense model and by each rank of the split ones, against Korthikanti et al.'s
    per-layer formulas (section 4.2): sbh(34 + 5as/h) unsplit, sbh(10 + 24/t + 5as/(ht)) with
    tensor parallelism (the LayerNorms, residuals and dropout masks, 10·sbh, stay whole), and
    sbh(34 + 5as/h)/t with sequence parallelism.
(c) **Step time.** ``train --model gpt`` for a few hundred steps in one process and ``--strategy
    tp`` on 2 ranks under mpiexec, the median milliseconds per step of its evaluation intervals
    and the share of the step spent communicating. On this course's 2-core laptop the two ranks
    share the cores a single process's BLAS would use, and the model is small: the figure says
    what the messages cost here, not what NVLink would give.

    .venv/bin/python benchmarks/bench_tensor_parallel.py [--quick] [--json PATH]

``--quick`` (the smoke test) uses a tiny GPT and runs (c) for 20 steps.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

from minidist import costmodel, memory, optim, sim
from minidist.models.gpt import GPT, GPTConfig
from minidist.parallel.data_parallel.ddp import DistributedDataParallel
from minidist.parallel.tensor_parallel import parallelize_gpt
from minidist.tracing import CountingComm

VOCAB = 65  # the plays' characters
FULL = dict(n_layer=4, n_head=4, n_embd=64, block_size=64, batch_size=32)  # train --model gpt's defaults
QUICK = dict(n_layer=2, n_head=4, n_embd=32, block_size=16, batch_size=8)
RANKS = (2, 4)


def gpt_config(sizes: dict) -> GPTConfig:
    return GPTConfig(VOCAB, sizes["block_size"], sizes["n_layer"], sizes["n_head"], sizes["n_embd"])


def batch(sizes: dict, rows: slice | None = None):
    rng = np.random.default_rng(0)
    shape = (sizes["batch_size"], sizes["block_size"])
    idx, targets = rng.integers(0, VOCAB, size=shape), rng.integers(0, VOCAB, size=shape)
    return (idx, targets) if rows is None else (idx[rows], targets[rows])


# ----------------------------------------------------------------------------- (a) bytes per step


def tp_step_bytes(comm, sizes: dict, sequence_parallel: bool) -> int:
    """Bytes this rank sends in one step of the split GPT (forward, backward, clipping)."""
    counted = CountingComm(comm, allow_collectives=True, keep_messages=False)
    model = parallelize_gpt(GPT(gpt_config(sizes), rng=0), counted, sequence_parallel=sequence_parallel)
    _, loss = model(*batch(sizes))
    loss.backward()
    model.clip_grad_norm_(1.0)
    return counted.nbytes


def ddp_step_bytes(comm, sizes: dict) -> tuple[int, list[int]]:
    """Bytes this rank sends in one step of DDP on its rows of the same global batch, and the
    sizes of its buckets (for the closed form)."""
    counted = CountingComm(comm, allow_collectives=True, keep_messages=False)
    ddp = DistributedDataParallel(GPT(gpt_config(sizes), rng=0), counted)
    counted.reset()  # the broadcast of the weights at the start is not a step's
    p, r = comm.Get_size(), comm.Get_rank()
    per = sizes["batch_size"] // p
    _, loss = ddp(*batch(sizes, slice(r * per, (r + 1) * per)))
    loss.backward()
    optim.AdamW(ddp.parameters(), lr=1e-3).step()
    return counted.nbytes, [bucket.nbytes for bucket in ddp.buckets]


def all_reduce_bytes(nbytes: int, p: int) -> float:
    """Bytes a rank sends in one all-reduce of ``nbytes`` with the algorithm "auto" picks."""
    return costmodel.terms("all_reduce", costmodel.choose_all_reduce(nbytes, p), nbytes, p)[1]


def closed_forms(sizes: dict, p: int, buckets: list[int]) -> dict:
    """Each strategy's bytes per rank and step from its message count (module docstring)."""
    b, t, c, layers = sizes["batch_size"], sizes["block_size"], sizes["n_embd"], sizes["n_layer"]
    activation, positions, word = b * t * c * 4, b * t * 4, 4
    loss_and_clip = 2 * all_reduce_bytes(positions, p) + all_reduce_bytes(positions + 4, p) + all_reduce_bytes(8, p)
    tp = 2 * (1 + 2 * layers) * all_reduce_bytes(activation, p) + loss_and_clip
    half = costmodel.terms("all_gather", "ring", activation, p)[1]  # = a reduce-scatter's: (p - 1)/p of it
    whole_params = (6 * layers + 2) * all_reduce_bytes(c * word, p) + all_reduce_bytes(t * c * word, p)
    sp = (2 * (2 + 4 * layers) + (1 + 2 * layers)) * half + whole_params + loss_and_clip
    ddp = sum(all_reduce_bytes(n, p) for n in buckets)
    return {"tp": tp, "tp+sp": sp, "ddp": ddp}


def bytes_per_step(sizes: dict) -> list[dict]:
    rows = []
    for p in RANKS:
        measured = {"tp": sim.run(tp_step_bytes, p, sizes, False),
                    "tp+sp": sim.run(tp_step_bytes, p, sizes, True)}
        ddp = sim.run(ddp_step_bytes, p, sizes)
        measured["ddp"] = [sent for sent, _ in ddp]
        forms = closed_forms(sizes, p, ddp[0][1])
        for name, sent in measured.items():
            rows.append({"ranks": p, "strategy": name, "measured_per_rank": sent, "closed_form": forms[name],
                         "equal": all(abs(s - forms[name]) < 0.5 for s in sent)})
    return rows


# ----------------------------------------------------------------------------- (b) activation memory


def held(comm, sizes: dict, sequence_parallel: bool) -> int:
    model = parallelize_gpt(GPT(gpt_config(sizes), rng=0), comm, sequence_parallel=sequence_parallel)
    with memory.track() as tracker:
        model(*batch(sizes))
    return tracker.peak_bytes


def activation_memory(sizes: dict) -> dict:
    with memory.track() as tracker:
        GPT(gpt_config(sizes), rng=0)(*batch(sizes))
    dense = tracker.peak_bytes
    s, h, a = sizes["block_size"], sizes["n_embd"], sizes["n_head"]
    unsplit = 34 + 5 * a * s / h
    rows = [{"ranks": 1, "layout": "dense", "peak_bytes_per_rank": dense, "of_dense": 1.0, "korthikanti": 1.0}]
    for p in RANKS:
        for sp in (False, True):
            peak = max(sim.run(held, p, sizes, sp))  # the largest rank's (the vocabulary is cut unevenly)
            paper = (unsplit / p if sp else 10 + 24 / p + 5 * a * s / (h * p)) / unsplit
            rows.append({"ranks": p, "layout": "tp+sp" if sp else "tp", "peak_bytes_per_rank": peak,
                         "of_dense": peak / dense, "korthikanti": paper})
    return {"rows": rows, "s": s, "b": sizes["batch_size"], "h": h, "a": a}


# ----------------------------------------------------------------------------- (c) step time


def step_time(sizes: dict, steps: int, eval_every: int) -> dict:
    """Median ms per step of the evaluation intervals: one process, then tp on 2 ranks."""
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    flags = ["--model", "gpt", "--no-progress", "--steps", str(steps), "--eval-every", str(eval_every),
             *[f"--{k.replace('_', '-')}={v}" for k, v in sizes.items()]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    root = Path(__file__).resolve().parents[1]
    out = {}
    runs = {"single": [sys.executable, "-m", "minidist", "train", *flags]}
    if mpiexec:
        runs["tp_2_ranks"] = [mpiexec, "-n", "2", sys.executable, "-m", "mpi4py", "-m", "minidist", "train", *flags,
                              "--strategy", "tp"]
    for name, command in runs.items():
        run = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=env, cwd=root)
        if run.returncode != 0:
            raise RuntimeError(f"{name} failed:\n{run.stdout}\n{run.stderr}")
        ms = [float(m) for m in re.findall(r"time/step=([\d.]+)ms", run.stdout)]
        comm = [float(m) / 100 for m in re.findall(r"comm=(\d+)%", run.stdout)]
        out[name] = {"median_ms_per_step": statistics.median(ms), "comm_share": statistics.median(comm) if comm else 0,
                     "final": run.stdout.strip().splitlines()[-1]}
    if "tp_2_ranks" in out:
        out["ratio_tp_single"] = out["tp_2_ranks"]["median_ms_per_step"] / out["single"]["median_ms_per_step"]
    return out


# ----------------------------------------------------------------------------- report


def report(figures: dict) -> None:
    sizes = figures["sizes"]
    print(f"GPT: L={sizes['n_layer']} heads={sizes['n_head']} C={sizes['n_embd']} T={sizes['block_size']} "
          f"B={sizes['batch_size']} V={VOCAB}, float32")
    print("(a) bytes each rank sends per training step (measured on the sim; closed form from the message count)")
    print(f"    {'ranks':>5} {'strategy':8} {'measured':>12} {'closed form':>12}  equal")
    for row in figures["bytes_per_step"]:
        print(f"    {row['ranks']:>5} {row['strategy']:8} {max(row['measured_per_rank']):>12,} "
              f"{row['closed_form']:>12,.0f}  {'yes' if row['equal'] else 'NO'}")
    for p in RANKS:
        by = {r["strategy"]: max(r["measured_per_rank"]) for r in figures["bytes_per_step"] if r["ranks"] == p}
        print(f"    {p} ranks: tp / ddp = {by['tp'] / by['ddp']:.2f}, tp+sp / tp = {by['tp+sp'] / by['tp']:.3f}")
    m = figures["activation_memory"]
    print(f"(b) activations kept for backward per rank, one forward (memory.track), s={m['s']} b={m['b']} h={m['h']} "
          f"a={m['a']}")
    print(f"    {'ranks':>5} {'layout':6} {'bytes':>12} {'of dense':>9} {'Korthikanti':>12}")
    for row in m["rows"]:
        print(f"    {row['ranks']:>5} {row['layout']:6} {row['peak_bytes_per_rank']:>12,} {row['of_dense']:>9.3f} "
              f"{row['korthikanti']:>12.3f}")
    c = figures.get("step_time")
    if c:
        print("(c) median ms per step (mpiexec, 1 BLAS thread per process)")
        print(f"    single      {c['single']['median_ms_per_step']:8.1f}")
        if "tp_2_ranks" in c:
            print(f"    tp 2 ranks  {c['tp_2_ranks']['median_ms_per_step']:8.1f}  (comm share "
                  f"{c['tp_2_ranks']['comm_share']:.0%}; ratio tp / single {c['ratio_tp_single']:.2f})")
        else:
            print("    no mpiexec: tp not timed")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny GPT and 20 steps (the smoke test)")
    parser.add_argument("--steps", type=int, default=None, help="steps of (c) (default 300; quick 20)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    steps = args.steps or (20 if args.quick else 300)
    figures = {"machine": platform.machine(), "numpy": np.__version__, "sizes": sizes}
    figures["bytes_per_step"] = bytes_per_step(sizes)
    figures["activation_memory"] = activation_memory(sizes)
    figures["step_time"] = step_time(sizes, steps, max(steps // 5, 1))
    report(figures)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(figures, file, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
