"""Sharded data parallelism's three figures (issue 21, part 5), from one run:

(a) **Memory per rank, by category.** One AdamW training step of the same float32 GPT on P = 1,
    2 and 4 ``minidist.sim`` ranks (threads running the algorithms mpiexec runs), four ways:
    DDP, ZeRO-1 (``ZeroRedundancyOptimizer``), ZeRO-2 (FSDP ``SHARD_GRAD_OP``) and ZeRO-3 (FSDP
    ``FULL_SHARD``). After the step each rank's parameters, gradients and optimizer state are
    measured in their arrays (``memory.parameter_bytes``, ``gradient_bytes``,
    ``optimizer_state_bytes``: what stays between steps; FSDP's gathered vectors are gone by
    then) and the activations as the peak of ``memory.track`` over the forward; besides, FSDP's
    gathered vectors at their most during the step (sampled as each unit is gathered: ZeRO-2
    holds every unit whole from its forward to its backward, so the whole 4Ψ at the end of the
    forward, on top of its shards; ZeRO-3 the root and a block or two). Beside them the
    ZeRO paper's counts (Rajbhandari et al., SC 2020, section 5, figure 1), here float32 AdamW
    rather than mixed precision: parameters 4Ψ, gradients 4Ψ, AdamW's two moments 8Ψ bytes for Ψ
    parameters (16Ψ in all, the paper's 2 + 2 + 12 for fp16 with fp32 master weights), each
    divided by P from its stage on: stage 1 the optimizer state, stage 2 the gradients too,
    stage 3 the parameters too. Activations are not sharded by any stage (each rank keeps those
    of its own batch, the same per-rank batch here at every P).
(b) **Bytes per step per rank**, counted message by message (``tracing.CountingComm``), beside
    the closed forms with ring collectives, Ψ the padded flat vectors' bytes: 2Ψ(P-1)/P for DDP
    (one all-reduce = a reduce-scatter + an all-gather), ZeRO-1 (the paper's: the optimizer
    reduce-scatters the local gradients and all-gathers the updated shards) and ZeRO-2, 3Ψ(P-1)/P
    for ZeRO-3 (the parameters gathered twice, before forward and before backward).
(c) **Step time** on 2 ranks under mpiexec (one BLAS thread per process; on the sim when there
    is no mpiexec): the median of repeated steps, the strategies interleaved round by round so
    that a slow spell of the machine hits them all, FSDP with and without forward prefetch
    (``FullyShardedDataParallel(..., forward_prefetch=False)``). On this course's 2-core laptop
    the figure says what the messages cost here, not what NVLink would give.

    .venv/bin/python benchmarks/bench_sharding.py [--quick] [--json PATH]

``--quick`` (the smoke test) uses a tiny GPT and a few timed steps.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from minidist import memory, optim, sim
from minidist.collectives import gather_objects
from minidist.models.gpt import GPT, GPTConfig
from minidist.parallel.data_parallel.ddp import DistributedDataParallel
from minidist.parallel.fsdp import FullyShardedDataParallel
from minidist.parallel.zero import ZeroRedundancyOptimizer
from minidist.tracing import CountingComm

VOCAB = 65  # the plays' characters
FULL = dict(n_layer=4, n_head=4, n_embd=64, block_size=64, batch_size=32)  # train --model gpt's defaults
QUICK = dict(n_layer=2, n_head=4, n_embd=32, block_size=16, batch_size=8)
RANKS = (1, 2, 4)
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
FSDP_NAME = {"zero2": "SHARD_GRAD_OP", "zero3": "FULL_SHARD"}
LR, WEIGHT_DECAY = 5e-3, 0.1  # train --model gpt's AdamW
TIMED = ("ddp", "zero1", "zero2", "zero3", "zero2 no prefetch", "zero3 no prefetch")


def gpt_config(sizes: dict) -> GPTConfig:
    return GPTConfig(VOCAB, sizes["block_size"], sizes["n_layer"], sizes["n_head"], sizes["n_embd"])


def batch(sizes: dict, rank: int):
    """This rank's batch (the per-rank batch of ``train``'s --batch-size, different on each rank)."""
    rng = np.random.default_rng(rank)
    shape = (sizes["batch_size"], sizes["block_size"])
    return rng.integers(0, VOCAB, size=shape), rng.integers(0, VOCAB, size=shape)


class Trainer:
    """One of the four strategies on ``comm`` for the GPT: ``step(idx, targets)`` runs forward,
    backward and AdamW's step; ``module``, ``optimizer``, the counted ``traffic`` and the
    arrays to measure (``kept_parameters``, ``kept_gradients``) and ``padded`` (Ψ's numbers)."""

    def __init__(self, comm, sizes: dict, strategy: str, forward_prefetch: bool = True):
        self.strategy = strategy
        self.traffic = CountingComm(comm, allow_collectives=True, keep_messages=False)
        model = GPT(gpt_config(sizes), rng=0)
        if strategy in ("ddp", "zero1"):
            self.module = DistributedDataParallel(model, self.traffic, algorithm="ring", overlap=False)
            if strategy == "ddp":
                self.optimizer = optim.AdamW(self.module.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
            else:
                self.optimizer = ZeroRedundancyOptimizer(self.module.parameters(), optim.AdamW, self.traffic,
                                                         reduce_gradients=True, lr=LR, weight_decay=WEIGHT_DECAY)
            self.kept = self.module.parameters()
            self.padded = sum(p.size for p in self.kept) if strategy == "ddp" else self.optimizer.flat.padded
        else:
            self.module = FullyShardedDataParallel(model, self.traffic, FSDP_NAME[strategy],
                                                   forward_prefetch=forward_prefetch)
            self.optimizer = optim.AdamW(self.module.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
            self.kept = self.module.parameters()
            self.padded = sum(u.flat.padded for u in self.module.units)
            self._watch_gathers()
        self.gathered_peak = 0  # bytes of FSDP's gathered vectors (and prefetches in flight) at their most
        self.traffic.reset()  # the broadcast of the weights at the start is not a step's

    def _watch_gathers(self):
        """Sample the gathered vectors' bytes after every unit's pre-forward and pre-backward
        (the moments a unit's parameters become whole), keeping the largest."""
        fsdp = self.module
        for hook in ("_pre_forward", "pre_backward"):
            original = getattr(fsdp, hook)

            def sampled(unit, original=original):
                original(unit)
                now = sum(u.flat.nbytes for u in fsdp.units if u.full is not None or u.work is not None)
                self.gathered_peak = max(self.gathered_peak, now)

            setattr(fsdp, hook, sampled)

    def forward(self, idx, targets):
        return self.module(idx, targets)[1]

    def step(self, idx, targets, track: bool = False):
        self.optimizer.zero_grad()
        if self.strategy == "zero1":  # the optimizer reduce-scatters the local gradients itself (2Ψ, not 3Ψ)
            with self.module.no_sync():
                loss, peak = self._forward_backward(idx, targets, track)
        else:
            loss, peak = self._forward_backward(idx, targets, track)
        self.optimizer.step()
        return loss, peak

    def _forward_backward(self, idx, targets, track):
        if track:
            with memory.track() as tracker:
                loss = self.forward(idx, targets)
            peak = tracker.peak_bytes
        else:
            loss, peak = self.forward(idx, targets), None
        loss.backward()
        return float(loss.item()), peak

    def optimizer_state_bytes(self) -> int:
        return memory.optimizer_state_bytes(getattr(self.optimizer, "optim", self.optimizer))


# ----------------------------------------------------------------------------- (a) and (b)


def measure_rank(comm, sizes: dict, strategy: str) -> dict:
    """One step on this rank: its bytes sent, its arrays kept after the step, its activations."""
    trainer = Trainer(comm, sizes, strategy)
    loss, peak = trainer.step(*batch(sizes, comm.Get_rank()), track=True)
    return {"sent": trainer.traffic.nbytes, "parameters": memory.parameter_bytes(trainer.kept),
            "gathered_peak": trainer.gathered_peak,
            "gradients": memory.gradient_bytes(trainer.kept), "optimizer_state": trainer.optimizer_state_bytes(),
            "activations": peak, "padded": trainer.padded, "loss": loss}


def formulas(strategy: str, psi: int, p: int) -> dict:
    """The ZeRO paper's bytes per rank for Ψ = ``psi`` float32 parameters under AdamW."""
    stage = STRATEGIES.index(strategy)  # 0 for DDP
    return {"parameters": 4 * psi / (p if stage >= 3 else 1), "gradients": 4 * psi / (p if stage >= 2 else 1),
            "optimizer_state": 8 * psi / (p if stage >= 1 else 1)}


def bytes_closed_form(strategy: str, padded_bytes: int, p: int) -> float:
    """Bytes a rank sends per step with ring collectives (Ψ: the padded vectors' bytes)."""
    return (3 if strategy == "zero3" else 2) * padded_bytes * (p - 1) / p


def memory_and_bytes(sizes: dict) -> list[dict]:
    psi = sum(p.size for p in GPT(gpt_config(sizes), rng=0).parameters())
    rows = []
    for p in RANKS:
        for strategy in STRATEGIES:
            ranks = sim.run(measure_rank, p, sizes, strategy)
            worst = {key: max(r[key] for r in ranks) for key in ("parameters", "gathered_peak", "gradients",
                                                                 "optimizer_state", "activations")}
            forms = formulas(strategy, psi, p)
            closed = bytes_closed_form(strategy, 4 * ranks[0]["padded"], p)
            rows.append({"ranks": p, "strategy": strategy, "psi": psi, **worst,
                         "total": sum(worst[k] for k in ("parameters", "gradients", "optimizer_state")),
                         "formula": forms, "formula_total": sum(forms.values()),
                         "sent_per_rank": [r["sent"] for r in ranks], "sent_closed_form": closed,
                         "sent_equal": all(abs(r["sent"] - closed) < 0.5 for r in ranks),
                         "loss": ranks[0]["loss"]})
    return rows


# ----------------------------------------------------------------------------- (c) step time


def time_rank(comm, sizes: dict, rounds: int) -> dict | None:
    """Every strategy of TIMED on ``comm``, ``rounds`` rounds of one step each, interleaved; the
    median seconds per step on rank 0 (a barrier before each step; the slowest rank's time)."""
    trainers = {name: Trainer(comm, sizes, name.split()[0], forward_prefetch="no prefetch" not in name)
                for name in TIMED}
    idx, targets = batch(sizes, comm.Get_rank())
    seconds = {name: [] for name in TIMED}
    for round_ in range(rounds + 1):  # round 0 warms up (and records the forward order to prefetch)
        for name, trainer in trainers.items():
            comm.Barrier()
            start = time.perf_counter()
            trainer.step(idx, targets)
            if round_:
                seconds[name].append(time.perf_counter() - start)
    everyone = gather_objects(comm, seconds)
    if everyone is None:
        return None
    slowest = {name: [max(times) for times in zip(*(r[name] for r in everyone))] for name in TIMED}
    return {name: 1e3 * statistics.median(s) for name, s in slowest.items()}


def step_time(sizes: dict, rounds: int, ranks: int = 2) -> dict:
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    if mpiexec:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        command = [mpiexec, "-n", str(ranks), sys.executable, "-m", "mpi4py", str(Path(__file__).resolve()),
                   "--worker", json.dumps({"sizes": sizes, "rounds": rounds})]
        run = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=env)
        if run.returncode != 0:
            raise RuntimeError(f"mpiexec failed:\n{run.stdout}\n{run.stderr}")
        ms, where = json.loads(run.stdout.strip().splitlines()[-1]), f"mpiexec, {ranks} ranks"
    else:
        from threadpoolctl import threadpool_limits
        with threadpool_limits(1):
            ms, where = sim.run(time_rank, ranks, sizes, rounds)[0], f"sim, {ranks} ranks"
    return {"where": where, "rounds": rounds, "median_ms_per_step": ms,
            "of_ddp": {name: t / ms["ddp"] for name, t in ms.items()}}


def worker(spec: str) -> int:
    """Under mpiexec: (c) on MPI.COMM_WORLD, rank 0 printing the medians as JSON."""
    from mpi4py import MPI
    spec = json.loads(spec)
    out = time_rank(MPI.COMM_WORLD, spec["sizes"], spec["rounds"])
    if out is not None:
        print(json.dumps(out))
    return 0


# ----------------------------------------------------------------------------- report


def report(figures: dict) -> None:
    sizes, rows = figures["sizes"], figures["memory_and_bytes"]
    psi = rows[0]["psi"]
    print(f"GPT: L={sizes['n_layer']} heads={sizes['n_head']} C={sizes['n_embd']} T={sizes['block_size']} "
          f"B={sizes['batch_size']} per rank, V={VOCAB}, float32 AdamW; Ψ = {psi:,} parameters")
    print("(a) bytes each rank keeps between steps (the largest rank's), measured / formula (Rajbhandari et al.);")
    print("    gathered: FSDP's whole unit vectors at their most during the step, on top of the shards")
    print(f"    {'P':>2} {'strategy':8} {'parameters':>21} {'gathered':>9} {'gradients':>21} {'optimizer state':>21} "
          f"{'activations':>12} {'of DDP':>7}")
    ddp = {r["ranks"]: r["total"] for r in rows if r["strategy"] == "ddp"}
    for r in rows:
        cells = [f"{r[k]:>10,}/{r['formula'][k]:>10,.0f}" for k in ("parameters", "gradients", "optimizer_state")]
        cells.insert(1, f"{r['gathered_peak']:>9,}")
        cells = " ".join(cells)
        print(f"    {r['ranks']:>2} {r['strategy']:8} {cells} {r['activations']:>12,} "
              f"{r['total'] / ddp[r['ranks']]:>7.3f}")
    print("(b) bytes each rank sends per training step (measured on the sim; closed form with ring collectives)")
    print(f"    {'P':>2} {'strategy':8} {'measured':>12} {'closed form':>12}  equal  of DDP")
    sent_ddp = {r["ranks"]: max(r["sent_per_rank"]) for r in rows if r["strategy"] == "ddp"}
    for r in rows:
        ratio = max(r["sent_per_rank"]) / sent_ddp[r["ranks"]] if sent_ddp[r["ranks"]] else float("nan")
        print(f"    {r['ranks']:>2} {r['strategy']:8} {max(r['sent_per_rank']):>12,} {r['sent_closed_form']:>12,.0f}  "
              f"{'yes' if r['sent_equal'] else 'NO':5}  {ratio:.2f}")
    c = figures["step_time"]
    print(f"(c) median ms per step ({c['where']}, {c['rounds']} rounds, 1 BLAS thread per rank)")
    for name, ms in c["median_ms_per_step"].items():
        print(f"    {name:18} {ms:8.1f}  ({c['of_ddp'][name]:.2f} of DDP)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny GPT and 3 timed rounds (the smoke test)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds of (c) (default 20; quick 3)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)  # (c) under mpiexec
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    sizes = QUICK if args.quick else FULL
    rounds = args.rounds or (3 if args.quick else 20)
    figures = {"machine": platform.machine(), "numpy": np.__version__, "sizes": sizes}
    figures["memory_and_bytes"] = memory_and_bytes(sizes)
    figures["step_time"] = step_time(sizes, rounds)
    report(figures)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(figures, file, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
