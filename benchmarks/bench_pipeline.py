"""How close does a real 2-stage pipeline come to its ideal? Samples/s and the bubble, measured.

A compute-heavy MLP (default 8 Linear layers of width 512 with ReLU, float32, batch 1024,
random data) is trained one step at a time:

- ``single``: the whole model in one process (rank 0 of the same job, while rank 1 waits
  at a barrier): the reference, measured in the same run;
- ``gpipe m`` and ``1f1b m``: the model split into 2 stages of 4 layers, one per rank
  (``mpiexec -n 2``), the batch into m micro-batches, for m = 1, 2, 4, 8.

Every process uses one BLAS thread (set before NumPy loads), so the two stages on two
cores compete fairly with the single process on one core. Rounds are interleaved (single,
then every pipeline configuration, then again) and the table reports medians over
``--repeats`` rounds of ``--steps`` timed steps each.

Printed per configuration: samples/s (batch / the median step time, a step lasting until
its slower rank finishes), the speed-up against ``single``, the ideal speed-up p·m/(m + p - 1)
(two stages never both busy during the fill and the drain), the measured share of the ideal,
the same share measured against ``single m`` (one process running the same m micro-batches one
after another: what splitting the batch costs by itself, with no pipeline), and the bubble:
measured (1 - the time a rank spent computing / the step time, averaged over the ranks, from
the executor's timelines) next to the formula (p - 1)/(m + p - 1).

    .venv/bin/python benchmarks/bench_pipeline.py [--microbatches 1 2 4 8] [--repeats 3] [--json PATH]
    .venv/bin/python benchmarks/bench_pipeline.py --quick      # a smoke run, seconds

Targets (issue 9): measured bubble within +-15 % of the formula for m >= 2; throughput
>= 0.85 x the ideal 2m/(m + 1) x single.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
SCHEDULES = ("gpipe", "1f1b")


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8], help="values of m (default: 1 2 4 8)")
    p.add_argument("--width", type=int, default=512, help="width of every layer (default: 512)")
    p.add_argument("--layers", type=int, default=8, help="Linear layers, split evenly over 2 stages (default: 8)")
    p.add_argument("--batch", type=int, default=1024, help="mini-batch (default: 1024)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per configuration and round (default: 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default: 2)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds; medians are reported (default: 3)")
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed for the launched job (default: 600)")
    p.add_argument("--quick", action="store_true", help="a small model, few steps, one round (smoke test)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def make_model(args):
    from minidist import nn

    layers = []
    for i in range(args.layers):
        layers.append(nn.Linear(args.width, args.width, rng=i, dtype="float32"))
        if i < args.layers - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def worker(args):
    """Runs under mpiexec -n 2: the single-process reference on rank 0, then the pipelines.
    Rank 0 prints one JSON line of raw timings."""
    import numpy as np
    from mpi4py import MPI

    from minidist.functions import cross_entropy
    from minidist.parallel.pipeline import executor as E

    comm = MPI.COMM_WORLD
    rank, p = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch, args.width)).astype(np.float32)
    y = rng.integers(0, args.width, size=args.batch)
    model = make_model(args)
    half = len(list(model)) // 2 + 1  # Linear, ReLU, ... : stage 0 takes the first layers/2 Linears and their ReLUs
    stage_module = model[:half] if rank == 0 else model[half:]

    def single_step(m=1):
        # m > 1: the same micro-batches one after another in one process (gradient accumulation),
        # the cost of splitting the batch with no pipeline at all
        model.zero_grad()
        for part in np.array_split(np.arange(args.batch), m):
            (cross_entropy(model(x[part]), y[part]) * (1.0 / m)).backward()

    schedules = {}
    for name in SCHEDULES:
        for m in args.microbatches:
            stage = E.PipelineStage(stage_module, rank, p, comm, timeout=args.timeout)
            cls = E.ScheduleGPipe if name == "gpipe" else E.Schedule1F1B
            schedules[(name, m)] = cls(stage, m, cross_entropy)

    def pipeline_step(sched):
        stage_module.zero_grad()
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y)
        return sched

    def quiet_barrier():
        # MPICH's Barrier spins: rank 1 would take a core from the single-process reference
        # while it waits. An Ibarrier polled with sleeps leaves the core free.
        request = comm.Ibarrier()
        while not request.Test():
            time.sleep(0.0005)

    results = {"single": [], **{f"single {m}": [] for m in args.microbatches if m > 1},
               **{f"{n} {m}": [] for n, m in schedules}}
    busy = {f"{n} {m}": [] for n, m in schedules}
    for round_ in range(args.repeats):
        order = list(schedules) if round_ % 2 == 0 else list(reversed(schedules))
        quiet_barrier()
        if rank == 0:
            for _ in range(args.warmup):
                single_step()
            for m in [1, *[m for m in args.microbatches if m > 1]]:
                for _ in range(args.steps):
                    t = time.perf_counter()
                    single_step(m)
                    results["single" if m == 1 else f"single {m}"].append(time.perf_counter() - t)
        quiet_barrier()
        for key in order:
            sched = schedules[key]
            for _ in range(args.warmup):
                pipeline_step(sched)
            for _ in range(args.steps):
                comm.Barrier()
                t = time.perf_counter()
                pipeline_step(sched)
                elapsed = comm.allreduce(time.perf_counter() - t, op=MPI.MAX)  # the slower rank ends the step
                shares = comm.allgather(sched.busy_fraction())
                results[f"{key[0]} {key[1]}"].append(elapsed)
                busy[f"{key[0]} {key[1]}"].append(sum(shares) / len(shares))
    if rank == 0:
        print(json.dumps({"times": results, "busy": busy}))


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.quick:
        args.width, args.layers, args.batch, args.steps, args.warmup, args.repeats = 128, 4, 256, 2, 1, 1
        args.microbatches = [1, 4]
    if args.worker:
        worker(args)
        return 0
    sys.path.insert(0, str(ROOT))
    from minidist import launch

    worker_args = ["--worker", "--width", str(args.width), "--layers", str(args.layers), "--batch", str(args.batch),
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--repeats", str(args.repeats),
                   "--timeout", str(args.timeout), "--microbatches", *map(str, args.microbatches)]
    env = {**os.environ, **ONE_THREAD}
    result = launch.launch(HERE, 2, timeout=args.timeout, args=worker_args, env=env)
    if not result.ok:
        print(result.stdout, result.stderr[-3000:], file=sys.stderr)
        return 1
    raw = json.loads(result.stdout.strip().splitlines()[-1])
    times, busy = raw["times"], raw["busy"]
    single = statistics.median(times["single"])
    p = 2
    print(f"bench_pipeline: {args.layers} Linear layers of width {args.width}, batch {args.batch}, float32, "
          f"2 stages on 2 processes, one BLAS thread each; medians of {args.repeats} rounds x {args.steps} steps")
    print(f"{'config':<10} {'samples/s':>10} {'vs single':>10} {'ideal':>7} {'of ideal':>9} "
          f"{'vs single m':>12} {'bubble':>8} {'formula':>8}")
    rows = []
    for m in [1, *[m for m in args.microbatches if m > 1]]:
        key = "single" if m == 1 else f"single {m}"
        t = statistics.median(times[key])
        print(f"{key:<10} {args.batch / t:>10.0f} {single / t:>10.2f}")
        rows.append({"config": key, "samples_per_s": args.batch / t, "speedup": single / t})
    for name in SCHEDULES:
        for m in args.microbatches:
            key = f"{name} {m}"
            t = statistics.median(times[key])
            speedup = single / t
            same_split = statistics.median(times["single" if m == 1 else f"single {m}"]) / t
            ideal = p * m / (m + p - 1)
            bubble = 1 - statistics.median(busy[key])
            formula = (p - 1) / (m + p - 1)
            print(f"{key:<10} {args.batch / t:>10.0f} {speedup:>10.2f} {ideal:>7.2f} {speedup / ideal:>9.2f} "
                  f"{same_split / ideal:>12.2f} {bubble:>8.3f} {formula:>8.3f}")
            rows.append({"config": key, "samples_per_s": args.batch / t, "speedup": speedup, "ideal": ideal,
                         "share_of_ideal": speedup / ideal, "share_of_ideal_vs_single_m": same_split / ideal,
                         "bubble": bubble, "bubble_formula": formula})
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": platform.platform(), "args": vars(args), "rows": rows,
                                               "raw": raw}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
