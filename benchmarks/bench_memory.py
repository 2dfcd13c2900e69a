"""Activation recomputation: peak memory and time of a training step against the number of segments.

A 64-block MLP (each block Linear(64, 64) then Tanh, float32) takes one training step on a
batch of 4096 rows: forward through ``recompute.checkpoint_sequential(model, k, x)``, the
loss ``mean(output)``, backward. For k = 1 (no checkpointing), 2, 4, ..., 64 segments:

- ``peak held``: the largest number of bytes held for backward during the step, counted by
  ``memory.track`` (the arrays the ops saved and the inputs they reference; parameters and
  gradients are not in it). ``formula``: Chen et al.'s count for this model, (k - 1) segment
  inputs + 2 arrays per block of the last segment (its n - (k-1)floor(n/k) blocks: a block
  holds its pre-activation and its output) + 1 (that segment's input), times one activation
  (4096 x 64 x 4 bytes = 1 MiB).
- ``alloc peak``: tracemalloc's peak during the step above what was allocated before it
  (everything NumPy allocated: held arrays, gradients, temporaries), measured in one extra
  step so that tracing does not slow the timed ones.
- ``forwards``: block forward calls, counted: n + (k-1)floor(n/k).
- ``time``: the median step time over ``--repeats`` interleaved rounds of ``--steps`` steps
  (every k once per round, so a busy machine slows all of them alike).

Ratios are against k = 1 measured in the same run. One BLAS thread is used (set before
NumPy loads). Chen et al. ("Training Deep Nets with Sublinear Memory Cost", 2016) show the
peak is smallest near k = sqrt(n) (here 8) for the price of about one extra forward.

    .venv/bin/python benchmarks/bench_memory.py [--segments 1 2 4 8 16 32 64] [--json PATH] [--plot PATH]
    .venv/bin/python benchmarks/bench_memory.py --quick      # a smoke run, seconds

Target (issue 11): at k = 8 the peak held is >= 3x lower than at k = 1, for <= 1.4x the time.
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from minidist import memory, nn  # noqa: E402
from minidist.recompute import checkpoint_sequential  # noqa: E402
from minidist.tensor import Tensor  # noqa: E402

MIB = 2**20
TARGET_K, TARGET_MEMORY, TARGET_TIME = 8, 3.0, 1.4


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--segments", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64],
                   help="values of k (default: 1 2 4 8 16 32 64; 1 is always measured)")
    p.add_argument("--blocks", type=int, default=64, help="Linear + Tanh blocks (default: 64)")
    p.add_argument("--width", type=int, default=64, help="width of every layer (default: 64)")
    p.add_argument("--batch", type=int, default=4096, help="rows per step (default: 4096)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per k and round (default: 3)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default: 3)")
    p.add_argument("--quick", action="store_true", help="8 blocks, batch 256, one round (smoke test)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--plot", metavar="PATH", help="also draw peak and time against k (needs matplotlib)")
    return p


class Counted(nn.Module):
    """A block that counts its forward calls."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, x):
        self.calls += 1
        return self.inner(x)


def make_model(blocks, width):
    return nn.Sequential(*[Counted(nn.Sequential(nn.Linear(width, width, rng=i), nn.Tanh()))
                           for i in range(blocks)])


def step(model, k, x):
    model.zero_grad()
    checkpoint_sequential(model, k, x).mean().backward()


def formula_arrays(n, k):
    """Activations held at the peak (see the module docstring)."""
    s = n // k
    return (k - 1) + 2 * max(n - (k - 1) * s, s) + 1


def measure(args):
    n = args.blocks
    segments = sorted({1, *args.segments})
    bad = [k for k in segments if not 1 <= k <= n]
    if bad:
        raise SystemExit(f"bench_memory: segments must be between 1 and --blocks ({n}); got {bad}")
    model = make_model(n, args.width)
    x = Tensor(np.random.default_rng(0).standard_normal((args.batch, args.width)).astype("float32"))
    activation = x.data.nbytes
    rows = {}
    for k in segments:
        step(model, k, x)  # warm-up (and gradients allocated once)
        for block in model:
            block.calls = 0
        with memory.track() as tracker:
            step(model, k, x)
        forwards = sum(block.calls for block in model)
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        step(model, k, x)
        alloc_peak = tracemalloc.get_traced_memory()[1] - before
        tracemalloc.stop()
        rows[k] = {"k": k, "segment_size": n // k, "forwards": forwards,
                   "forwards_formula": n + (k - 1) * (n // k),
                   "peak_held_bytes": tracker.peak_bytes,
                   "formula_bytes": formula_arrays(n, k) * activation,
                   "alloc_peak_bytes": alloc_peak, "times": []}
    for _ in range(args.repeats):
        for k in segments:
            for _ in range(args.steps):
                start = time.perf_counter()
                step(model, k, x)
                rows[k]["times"].append(time.perf_counter() - start)
    ref = rows[1]
    ref_time = statistics.median(ref["times"])
    for row in rows.values():
        row["time_s"] = statistics.median(row["times"])
        row["min_time_s"] = min(row["times"])
        row["memory_ratio"] = ref["peak_held_bytes"] / row["peak_held_bytes"]
        row["alloc_ratio"] = ref["alloc_peak_bytes"] / row["alloc_peak_bytes"]
        row["time_ratio"] = row["time_s"] / ref_time
        del row["times"]
    return list(rows.values())


def report(args, rows):
    print(f"{args.blocks} blocks of Linear({args.width}, {args.width}) + Tanh, batch {args.batch}, float32; "
          f"one activation = {args.batch * args.width * 4 / MIB:g} MiB; median of {args.repeats} x {args.steps} steps")
    head = (f"{'k':>3} {'seg':>4} {'forwards':>9} {'peak held MiB':>14} {'formula':>8} {'lower':>6} "
            f"{'alloc peak MiB':>15} {'lower':>6} {'time ms':>8} {'x time':>7}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['k']:>3} {r['segment_size']:>4} {r['forwards']:>9} {r['peak_held_bytes'] / MIB:>14.1f} "
              f"{r['formula_bytes'] / MIB:>8.1f} {r['memory_ratio']:>5.2f}x {r['alloc_peak_bytes'] / MIB:>15.1f} "
              f"{r['alloc_ratio']:>5.2f}x {r['time_s'] * 1e3:>8.1f} {r['time_ratio']:>6.2f}x")
    best = min(rows, key=lambda r: r["peak_held_bytes"])
    print(f"smallest peak held at k = {best['k']} (sqrt(n) = {args.blocks ** 0.5:.1f})")
    target = next((r for r in rows if r["k"] == TARGET_K), None)
    verdict = None
    if target is not None and not args.quick:
        verdict = target["memory_ratio"] >= TARGET_MEMORY and target["time_ratio"] <= TARGET_TIME
        print(f"target at k = {TARGET_K}: peak {target['memory_ratio']:.2f}x lower (>= {TARGET_MEMORY:g}x), "
              f"time {target['time_ratio']:.2f}x (<= {TARGET_TIME:g}x): {'met' if verdict else 'missed'}")
    return verdict


def plot(rows, path, blocks):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [r["k"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.plot(ks, [r["peak_held_bytes"] / MIB for r in rows], "o-", label="measured (memory.track)")
    left.plot(ks, [r["formula_bytes"] / MIB for r in rows], "x--", label="formula")
    left.plot(ks, [r["alloc_peak_bytes"] / MIB for r in rows], "s:", label="allocated (tracemalloc)")
    left.set(xscale="log", xlabel="segments k", ylabel="peak memory of a step (MiB)")
    left.axvline(blocks ** 0.5, color="grey", lw=0.8, ls=":", label="k = sqrt(n)")
    left.legend()
    right.plot(ks, [r["time_ratio"] for r in rows], "o-")
    right.set(xscale="log", xlabel="segments k", ylabel="step time / time at k = 1")
    for ax in (left, right):
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.minorticks_off()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.quick:
        args.blocks, args.batch, args.steps, args.repeats = 8, 256, 1, 1
        args.segments = [k for k in (1, 2, 4, 8) if k <= args.blocks]
    rows = measure(args)
    verdict = report(args, rows)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "config": {"blocks": args.blocks, "width": args.width, "batch": args.batch, "steps": args.steps,
                       "repeats": args.repeats, "quick": args.quick},
            "machine": {"python": platform.python_version(), "numpy": np.__version__, "cpu": platform.processor()},
            "target": {"k": TARGET_K, "memory_ratio": TARGET_MEMORY, "time_ratio": TARGET_TIME, "met": verdict},
            "rows": rows}, indent=1))
    if args.plot:
        plot(rows, args.plot, args.blocks)


if __name__ == "__main__":
    main()
