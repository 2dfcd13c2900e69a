"""Tiled (flash) attention against the dense op (issue 31, part 1), from one run:

(a) **Time over T.** One causal attention, forward and backward, float32, one BLAS thread, the
    GPT's heads (H = 4 of d = 16) and its 2,048 tokens a batch (B = 2048 / T sequences): the
    engine's dense ``ScaledDotProductAttention``, the tiled ``flash_attention`` at several tile
    sizes and, when torch is installed, ``torch.nn.functional.scaled_dot_product_attention``
    (eager, one thread), timed round-robin in this process; the median of each and the
    ratios flash / dense and flash / torch. This is where ``functions.FLASH_MIN_SEQUENCE``,
    the T from which ``scaled_dot_product_attention`` tiles, comes from.
(b) **Memory over T.** One sequence (B = 1), H = 4, d = 16, float32: the bytes held for backward
    (``memory.track``'s peak: dense keeps the (T, T) weights, flash q, k, v, O and the
    log-sum-exp) and the peak of everything NumPy allocated during forward and backward
    (``tracemalloc``: the temporaries too, which for dense include the (T, T) scores and their
    gradient, for flash one (Br, Bc) tile at a time), each with its growth from the previous T
    (4 for T², 2 for T·d when T doubles).

    .venv/bin/python benchmarks/bench_attention.py [--quick] [--repeats 7] [--json PATH] [--plot PNG]

``--quick`` (the smoke test) takes small T and few repeats: the same table, quickly.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import tracemalloc

import numpy as np
from threadpoolctl import threadpool_limits

from minidist import attention, memory
from minidist import functions as F
from minidist.tensor import Tensor

HEADS, HEAD_DIM, TOKENS = 4, 16, 2048  # the default GPT's attention (n_head 4, n_embd 64; batch 32 x 64)


def inputs(b: int, t: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((b, HEADS, t, HEAD_DIM)).astype(np.float32) for _ in range(4)]


def engine_contender(attend, arrays):
    """One forward and backward of ``attend`` on fresh leaves (the arrays reused), as a function."""
    q, k, v, grad = arrays

    def run():
        leaves = [Tensor(a, requires_grad=True) for a in (q, k, v)]
        attend(*leaves).backward(grad)
        return leaves[0].grad

    return run


def torch_contender(arrays):
    """The same in torch eager (its CPU flash kernel), or None without torch."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(1)
    q, k, v, grad = (torch.from_numpy(a) for a in arrays)

    def run():
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True).backward(grad)
        return leaves[0].grad.numpy()

    return run


def time_over_t(sizes, block_sizes, repeats: int) -> list[dict]:
    """Median seconds of forward + backward for each contender at each T, round-robin."""
    rows = []
    for t in sizes:
        arrays = inputs(max(1, TOKENS // t), t)
        contenders = {"dense": engine_contender(lambda *x: attention.ScaledDotProductAttention.apply(
            *x, scale=HEAD_DIM ** -0.5, is_causal=True), arrays)}
        for size in block_sizes:
            contenders[f"flash{size}"] = engine_contender(
                lambda *x, size=size: attention.flash_attention(*x, is_causal=True, block_size=size), arrays)
        twin = torch_contender(arrays)
        if twin is not None:
            contenders["torch"] = twin
        reference = contenders["dense"]()
        for name, run in contenders.items():  # the same gradient, or not the same work
            np.testing.assert_allclose(run(), reference, rtol=1e-3, atol=1e-4, err_msg=name)
        samples = {name: [] for name in contenders}
        for _ in range(repeats):
            for name, run in contenders.items():
                began = time.perf_counter()
                run()
                samples[name].append(time.perf_counter() - began)
        medians = {name: statistics.median(s) for name, s in samples.items()}
        row = {"T": t, "B": arrays[0].shape[0], "median_seconds": medians,
               "flash_over_dense": {n: medians[n] / medians["dense"] for n in medians if n.startswith("flash")}}
        if "torch" in medians:
            row["over_torch"] = {n: medians[n] / medians["torch"] for n in medians if n != "torch"}
        rows.append(row)
    return rows


def memory_over_t(sizes, block_size: int) -> list[dict]:
    """Bytes held for backward (memory.track) and tracemalloc's peak over forward + backward."""
    rows = []
    for t in sizes:
        arrays = inputs(1, t)
        row = {"T": t}
        for name, attend in (("dense", lambda *x: attention.ScaledDotProductAttention.apply(
                                 *x, scale=HEAD_DIM ** -0.5, is_causal=True)),
                             ("flash", lambda *x: attention.flash_attention(*x, is_causal=True,
                                                                            block_size=block_size))):
            leaves = [Tensor(a, requires_grad=True) for a in arrays[:3]]
            tracemalloc.start()
            with memory.track() as tracker:
                out = attend(*leaves)
            out.backward(arrays[3])
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            del out
            row[name] = {"held_for_backward": tracker.peak_bytes, "allocated_peak": peak}
        rows.append(row)
    return rows


def report(figures: dict) -> None:
    rows = figures["time"]
    names = list(rows[0]["median_seconds"])
    print(f"(a) causal attention forward + backward, float32, 1 BLAS thread, H={HEADS} d={HEAD_DIM}, "
          f"B*T = {TOKENS}: median ms")
    print(f"    {'T':>5} {'B':>3} " + " ".join(f"{n:>9}" for n in names) + "   flash/dense   over torch")
    for row in rows:
        med = row["median_seconds"]
        best = min(row["flash_over_dense"], key=row["flash_over_dense"].get)
        torch_part = (f"{best} {row['over_torch'][best]:.2f}, dense {row['over_torch']['dense']:.2f}"
                      if "over_torch" in row else "no torch")
        print(f"    {row['T']:>5} {row['B']:>3} " + " ".join(f"{1e3 * med[n]:9.2f}" for n in names)
              + f"   {best} {row['flash_over_dense'][best]:.2f}   {torch_part}")
    print(f"    scaled_dot_product_attention tiles from T >= {figures['flash_min_sequence']} "
          f"(functions.FLASH_MIN_SEQUENCE), tiles of {attention.FLASH_BLOCK_SIZE}")
    print(f"(b) memory, B=1 H={HEADS} d={HEAD_DIM} float32, causal, tiles of {figures['memory_block_size']}: "
          "bytes held for backward (memory.track) and peak allocated over forward + backward (tracemalloc)")
    print(f"    {'T':>5} {'dense held':>12} {'flash held':>12} {'ratio':>6} {'dense peak':>12} {'flash peak':>12} "
          f"{'ratio':>6}   growth from the T before: dense held, flash held")
    before = None
    for row in figures["memory"]:
        d, f = row["dense"], row["flash"]
        growth = (f"{d['held_for_backward'] / before['dense']['held_for_backward']:.2f}, "
                  f"{f['held_for_backward'] / before['flash']['held_for_backward']:.2f}") if before else ""
        print(f"    {row['T']:>5} {d['held_for_backward']:>12,} {f['held_for_backward']:>12,} "
              f"{d['held_for_backward'] / f['held_for_backward']:6.1f} {d['allocated_peak']:>12,} "
              f"{f['allocated_peak']:>12,} {d['allocated_peak'] / f['allocated_peak']:6.1f}   {growth}")
        before = row


def plot(figures: dict, path: str) -> None:
    """Peak memory over T, log-log, dense against flash (matplotlib, the notebooks' plotting library)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    sizes = [row["T"] for row in figures["memory"]]
    fig, ax = pyplot.subplots(figsize=(6, 4))
    for name, marker in (("dense", "o"), ("flash", "s")):
        for what, line in (("held_for_backward", "-"), ("allocated_peak", "--")):
            ax.plot(sizes, [row[name][what] for row in figures["memory"]], marker=marker, linestyle=line,
                    label=f"{name}, {what.replace('_', ' ')}")
    ax.set(xscale="log", yscale="log", xlabel="sequence length T", ylabel="bytes",
           title="attention memory, one sequence, 4 heads of 16")
    ax.set_xticks(sizes, labels=[str(t) for t in sizes])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small T and few repeats (the smoke test)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per contender (default 7; quick 2)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("--plot", metavar="PNG", help="also draw the memory figure")
    args = parser.parse_args(argv)
    time_sizes = [32, 64, 128] if args.quick else [64, 128, 256, 512, 1024, 2048]
    memory_sizes = [64, 128, 256] if args.quick else [128, 256, 512, 1024, 2048, 4096]
    block_sizes = [32, 64] if args.quick else [64, 128, 256]
    figures = {"machine": platform.machine(), "numpy": np.__version__,
               "flash_min_sequence": F.FLASH_MIN_SEQUENCE, "memory_block_size": attention.FLASH_BLOCK_SIZE}
    with threadpool_limits(limits=1):
        figures["time"] = time_over_t(time_sizes, block_sizes, args.repeats or (2 if args.quick else 7))
    figures["memory"] = memory_over_t(memory_sizes, attention.FLASH_BLOCK_SIZE)
    report(figures)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(figures, file, indent=1)
    if args.plot:
        plot(figures, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
