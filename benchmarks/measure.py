"""What several benchmarks measure the same way: the median time of a call, and this machine's
roofline (peak FLOP/s, memory bandwidth and their ratio, the ridge), as chapter 13 measures it.

Imported by the benchmark scripts beside it (``python benchmarks/bench_x.py`` puts this folder
first on the path)."""
from __future__ import annotations

import statistics
import time

import numpy as np


def median_seconds(fn, repeats: int) -> float:
    """The median wall time, in seconds, of ``repeats`` calls of ``fn()`` (``time.perf_counter``)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine_roofline(repeats: int) -> dict:
    """Peak FLOP/s (a 1024² float32 product) and bandwidth (a 64 MiB copy), as chapter 13 measures:
    ``{"peak_flops", "bandwidth" (bytes/s, read + write), "ridge_flop_per_byte"}``, medians of
    ``repeats`` runs."""
    a = np.random.default_rng(0).standard_normal((1024, 1024)).astype("float32")
    peak = 2 * 1024**3 / median_seconds(lambda: a @ a, repeats)
    big = np.ones(16 * 2**20, dtype="float32")
    copy = np.empty_like(big)
    bandwidth = 2 * big.nbytes / median_seconds(lambda: np.copyto(copy, big), repeats)
    return {"peak_flops": peak, "bandwidth": bandwidth, "ridge_flop_per_byte": peak / bandwidth}
