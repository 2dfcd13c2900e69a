"""What mixed precision costs on a CPU: epoch time of fp16/bf16 against fp32, in the same run.

    .venv/bin/python benchmarks/bench_precision.py [--quick]

1. One training epoch on digits (``train.supervised_step``, batch 32) for MLPs of hidden width
   128 and 1024, each precision in turn inside every round (so a burst of load from elsewhere
   hits all alike); the figure is the median over rounds, the ratio is against fp32's median.
2. One (n, n) @ (n, n) product: float32 BLAS, the emulation ``minidist.precision`` uses (round
   to fp16/bf16, multiply in float32, round), and NumPy's own float16 matmul (no BLAS).

On a CPU, low precision is *slower*: there are no tensor cores, NumPy computes in float32
anyway, and every cast is an extra pass over the data. What mixed precision buys on a GPU
(2-8x matmul throughput, half the bytes of activations and messages) is not measured here;
the halved bytes between pipeline stages are (``pipeline_bytes_sent`` of ``train``).
"""
from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from minidist import data, nn, optim, precision, train

PRECISIONS = ("fp32", "fp16", "bf16")


def epoch_seconds(rounds: int, hidden: int) -> dict:
    """Median seconds of one epoch per precision (fresh model per precision, same seed)."""
    digits = data.load_digits(seed=0)
    loader = data.DataLoader(digits.X_train, digits.y_train, batch_size=32, shuffle=True, seed=0)
    steps = {}
    for p in PRECISIONS:
        model = nn.mlp([64, hidden, 10], rng=0)
        opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        scaler = precision.grad_scaler_for(p)
        steps[p] = train.supervised_step(model, opt, precision=p, scaler=scaler if scaler.is_enabled() else None)
    times = {p: [] for p in PRECISIONS}
    for _ in range(rounds):
        for p in PRECISIONS:
            start = time.perf_counter()
            for x, y in loader:
                steps[p](x, y)
            times[p].append(time.perf_counter() - start)
    return {p: statistics.median(t) for p, t in times.items()}


def matmul_seconds(n: int, repeats: int) -> dict:
    """Median seconds of one (n, n) product: fp32, the fp16/bf16 emulation, NumPy float16."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n)).astype(np.float32), rng.standard_normal((n, n)).astype(np.float32)
    a16, b16 = a.astype(np.float16), b.astype(np.float16)
    ways = {
        "fp32 BLAS": lambda: a @ b,
        "fp16 emulated": lambda: (a16.astype(np.float32) @ b16.astype(np.float32)).astype(np.float16),
        "bf16 emulated": lambda: (a.astype(precision.BFLOAT16).astype(np.float32)
                                  @ b.astype(precision.BFLOAT16).astype(np.float32)).astype(precision.BFLOAT16),
        "fp16 NumPy": lambda: a16 @ b16,
    }
    times = {k: [] for k in ways}
    for _ in range(repeats):
        for k, fn in ways.items():
            start = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(t) for k, t in times.items()}


def main() -> None:
    quick = "--quick" in sys.argv[1:]
    rounds = 3 if quick else 7
    for hidden in (128, 1024):
        medians = epoch_seconds(rounds, hidden)
        print(f"epoch on digits, MLP 64-{hidden}-10, median of {rounds}:")
        for p, s in medians.items():
            print(f"  {p}: {s * 1e3:8.1f} ms  ratio to fp32 {s / medians['fp32']:.2f}")
    n = 256 if quick else 512
    medians = matmul_seconds(n, 5 if quick else 15)
    print(f"one ({n}, {n}) @ ({n}, {n}) product:")
    for k, s in medians.items():
        print(f"  {k:<14}: {s * 1e3:8.2f} ms  ratio to fp32 {s / medians['fp32 BLAS']:.2f}")


if __name__ == "__main__":
    main()
