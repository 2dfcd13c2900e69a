"""Fit the alpha-beta-gamma cost model to this machine, for P ranks.

    .venv/bin/mpiexec -n P .venv/bin/python -m mpi4py benchmarks/fit_costmodel.py \
        [--iters N] [--repeats R] [--json PATH]

Rank 0 times a local float32 ``numpy.add`` (``costmodel.measure_reduction``): its slope is
gamma, the cost of a byte reduced. Then every rank times minidist's four all-reduce algorithms
(ring, recursive doubling, tree, naive) on float32 vectors of 4 B .. 64 MiB, the sizes of
``bench_collectives.py``, and alpha and beta are fitted to those times with gamma kept
(``costmodel.fit_times``): ``seconds = per_call + messages * alpha + bytes * beta + reduced *
gamma``, with each algorithm's own counts, fitted to what tells the algorithms apart. So the
constants describe a step as the algorithms really pay it (the Python of posting and waiting,
a rendezvous for a large message, the wait for a core when there are more ranks than cores),
and ``"auto"``, which picks the algorithm the model predicts fastest, picks what was measured
fastest wherever the model's three terms can tell them apart.

How it measures: the algorithms take turns inside every iteration (so a burst of load from
elsewhere hits all alike), each after a Barrier, and a time is the slowest rank's; a size's
figure is the median over ``--iters`` iterations (fewer for big sizes, at least 5), then the
median over ``--repeats`` sweeps. Rank 0 prints measured against predicted, the fastest
algorithm measured against the model's pick, and the ``FITTED[P] = CostModel(...)`` line to
paste into ``minidist/costmodel.py``. Run it for every world size "auto" should know (P = 2
and 4 on the course's machine).
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

import numpy
from mpi4py import MPI

from minidist import collectives, costmodel

SIZES = tuple(4**k for k in range(1, 14))  # 4 B .. 64 MiB, as bench_collectives.py
ALGORITHMS = costmodel.ALL_REDUCE_ALGORITHMS


def sweep(comm, iters):
    """{(algorithm, nbytes): median seconds (slowest rank)} over every size, once."""
    figures = {}
    for nbytes in SIZES:
        x = numpy.random.default_rng(comm.Get_rank()).standard_normal(max(nbytes // 4, 1), dtype=numpy.float32)
        out = numpy.empty_like(x)
        runs = max(5, min(iters, iters * (1 << 20) // nbytes))
        samples = numpy.zeros((len(ALGORITHMS), runs))
        for i in range(runs + 1):  # the first round warms up
            for j, algorithm in enumerate(ALGORITHMS):
                comm.Barrier()
                start = time.perf_counter()
                collectives.all_reduce(comm, x, algorithm=algorithm, out=out)
                if i:
                    samples[j, i - 1] = time.perf_counter() - start
        comm.Allreduce(MPI.IN_PLACE, samples, op=MPI.MAX)
        figures.update({(a, x.nbytes): float(numpy.median(samples[j])) for j, a in enumerate(ALGORITHMS)})
    return figures


def report(figures, model, per_call, p):
    """The table rank 0 prints: measured and predicted per algorithm and size, and the picks."""
    rows, missed = [], 0
    for nbytes in sorted({n for _, n in figures}):
        measured = {a: figures[(a, nbytes)] for a in ALGORITHMS}
        fastest, pick = min(measured, key=measured.get), costmodel.choose_all_reduce(nbytes, p, model)
        missed += pick != fastest
        row = {"nbytes": nbytes}
        for a in ALGORITHMS:
            row[a] = measured[a]
            row[f"{a[:4]} model"] = per_call + model.time("all_reduce", a, nbytes, p)
        rows.append({**row, "fastest": fastest, "model picks": pick,
                     "pick / fastest": f"{measured[pick] / measured[fastest]:.2f}"})
    return costmodel.format_table(rows), missed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=20, help="iterations per size and sweep (default 20)")
    parser.add_argument("--repeats", type=int, default=3, help="sweeps over all sizes (default 3)")
    parser.add_argument("--json", metavar="PATH", help="write measurements and constants as JSON")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    if p < 2:
        print("fit_costmodel: run under `mpiexec -n 2` (needs two ranks)", file=sys.stderr)
        return 2
    gamma = None
    if comm.Get_rank() == 0:  # the least disturbed of the sweeps, size by size
        sweeps = [costmodel.measure_reduction(SIZES[2:], iters=args.iters) for _ in range(args.repeats)]
        reduction = [min(same_size, key=lambda point: point[1]) for same_size in zip(*sweeps)]
        gamma = max(costmodel.fit_line(reduction)[1], 0.0)
    sweeps = [sweep(comm, args.iters) for _ in range(args.repeats)]
    if comm.Get_rank() != 0:
        return 0
    figures = {key: statistics.median(s[key] for s in sweeps) for key in sweeps[0]}
    model, per_call = costmodel.fit_times([(a, n, t) for (a, n), t in figures.items()], p, gamma=gamma)
    table, missed = report(figures, model, per_call, p)
    print(f"all-reduce on {p} ranks, float32 (median of {args.repeats} sweeps, each the slowest rank's median):")
    print(table)
    print(f"\nalpha = {model.alpha:.3e} s   beta = {model.beta:.3e} s/B   gamma = {model.gamma:.3e} s/B   "
          f"per call = {per_call:.3e} s; the model picks the fastest measured at {len(SIZES) - missed} of "
          f"{len(SIZES)} sizes")
    library = " ".join(MPI.Get_library_version().splitlines()[0].split())
    print(f"FITTED[{p}] = CostModel(alpha={model.alpha:.3g}, beta={model.beta:.3g}, gamma={model.gamma:.3g})"
          f"  # {datetime.date.today()}, {library}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": str(datetime.date.today()), "mpi": library, "world_size": p,
                       "alpha": model.alpha, "beta": model.beta, "gamma": model.gamma, "per_call": per_call,
                       "times": [[a, n, t] for (a, n), t in sorted(figures.items())]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
