"""Context parallelism's four figures (issue 31, part 5), from one run:

(1) **Longest sequence in a memory budget, against P.** One causal attention layer (B = 1,
    H heads of d), forward and backward, on ``minidist.sim`` ranks: the largest T (a multiple
    of 2P) whose per-rank peak of bytes held for backward (``memory.track``, the busiest rank)
    stays within a fixed budget, for P = 1, 2, 4, 8. Contenders: ``dense`` (no tiling: the
    engine's fused ``ScaledDotProductAttention`` keeping its (t, T) weights, after an all-gather
    of K and V when P > 1), ``flash`` (the tiled op, P = 1), and the wing's four variants. T*
    is searched exactly (a quadratic fitted to small T predicts it; measurements at T* and
    T* + 2P confirm it), and the slope of log T* over log P is printed. memory.track leaves
    out an op's temporaries: beside T* the benchmark gives tracemalloc's peak over the whole
    simulated world at T*, divided by P (the ranks are threads of one process), where the
    (T/P)^2 scores of a ring's block pair show up.
(2) **Bytes per rank per layer, against P.** Counted on the sim's trace (array messages; the
    pickled agreement rounds left out) for one attention call forward, then forward and
    backward, beside the closed forms derived from the code, with b = B (T/P) h values, h = H d:
    ring and zigzag 2(P-1)b forward, (4P-2)b backward; allgather 2(P-1)b and 2(P-1)b;
    ulysses 4(P-1)b/P each way. Megatron sequence parallelism (``parallelize_gpt(...,
    sequence_parallel=True)``): one GPT layer's bytes (a 2-layer model's less a 1-layer one's),
    4 (P-1)/P B T h forward (two all-gathers, two reduce-scatters), 6 (P-1)/P B T h backward
    (the inputs of both column-parallel layers gathered again) plus 6 all-reduces of h values
    (the whole LayerNorm and row-parallel bias gradients).
(3) **Per-rank work, contiguous against zig-zag.** ``BlockCounter``'s chunk pairs and scores
    per rank for one causal forward, P = 2, 4, 8: contiguous rank r computes r + 1 pairs,
    zig-zag every rank 2P + 1 half-size ones.
(4) **Wall time on 2 ranks.** This file run under ``mpiexec -n 2`` (``--mpi-worker``) times each
    variant's forward and backward (the slower rank's time per repeat) and, in the same job,
    rank 0 alone computing the dense and the flash op on the whole sequence while rank 1 sleeps,
    every contender once per round, medians over the rounds, one BLAS thread a process; ratios
    against one-process dense. On a 2-core laptop the two
    ranks share the cores; the figure says what this engine's messages and block loops cost,
    not what a cluster would give.

    .venv/bin/python benchmarks/bench_context_parallel.py [--quick] [--json PATH] [--plot PNG]

Longer than 400 lines: the chapter's four figures, each a few functions, from one run into one JSON.

The full run writes notebooks/measurements/bench_context_parallel_<date>.json unless ``--json``
says otherwise; ``--quick`` (the smoke test) takes tiny sizes and writes only with ``--json``.
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from minidist import attention, costmodel, memory, sim  # noqa: E402
from minidist.launch import launch  # noqa: E402
from minidist.models.gpt import GPT, GPTConfig  # noqa: E402
from minidist.parallel.context_parallel import VARIANTS, BlockCounter, context_parallel_attention, shard_sequence  # noqa: E402
from minidist.parallel.tensor_parallel import parallelize_gpt  # noqa: E402
from minidist.parallel.tensor_parallel.operators import gather_from_sequence_parallel_region  # noqa: E402
from minidist.tensor import Tensor  # noqa: E402

FULL = dict(heads=8, head_dim=8, budget_kib=256, memory_ranks=(1, 2, 4, 8), ranks=(1, 2, 4, 8), bytes_t=512,
            work_t=256, time_t=1024, repeats=9)
QUICK = dict(heads=4, head_dim=8, budget_kib=48, memory_ranks=(1, 2), ranks=(1, 2, 4), bytes_t=64, work_t=32,
             time_t=128, repeats=3)
WORK_RANKS = (2, 4, 8)
CONTENDERS = ("dense", "flash") + VARIANTS
ITEMSIZE = 4  # float32
FORMULAS = [
    "ring, zigzag: forward 2(P-1) b (K, V around the ring), backward (4P-2) b (K, V again; dK, dV P passes)",
    "allgather: forward 2(P-1) b (ring all-gather of K, V), backward 2(P-1) b (ring reduce-scatter of dK, dV)",
    "ulysses: forward and backward 4(P-1) b / P = 4(P-1) T h / P^2 (all-to-all of q, k, v, then of the output; "
    "4 b / P to each peer)",
    "tp+sp (one GPT layer): forward 4 (P-1)/P T h, backward 6 (P-1)/P T h + 6 all-reduces of h values",
]
NOTES = [
    "Held for backward per rank: ring and zigzag keep q, k, v, O (t h values each) and the log-sum-exp, linear in "
    "t = T/P, so T* grows as P (slope 1). allgather keeps the whole sequence's K and V (2 T h) and a (t, T) bool mask; "
    "ulysses its H/P heads of q, k, v, O at every position and the whole (T, T) bool causal mask, which dominates at "
    "P = 8 (slopes about 0.4 and 0.5). dense (untiled) keeps its (t, T) weights per head: slope about 0.4, near 1/2.",
    "memory.track counts the arrays held for backward only; an op's temporaries are not in it. The ring computes "
    "each block pair untiled, so its transient scores are B H (T/P)^2 per pair (see alloc_per_rank).",
    "DeepSpeed issue #4217 (aoyulong, 2023, closed) asked why the Ulysses blog says Megatron-LM's sequence "
    "parallelism sends 4Nh per layer whatever P, when each rank holds only Nh/P. Counted here: each rank of a ring "
    "all-gather or reduce-scatter sends (P-1)/P of the whole Nh, so Megatron-SP's forward is 4(P-1)/P Nh per rank "
    "(about 4Nh, not falling with P), Ulysses' 4(P-1)/P^2 Nh (falling as 1/P): the blog's factor of P holds per "
    "rank. The maintainers' replies were not read; this note rests on the counted bytes.",
]


def inputs(t: int, sizes: dict, seed: int = 0):
    """q, k, v and the output's gradient of one whole sequence, (1, H, t, d) float32."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, sizes["heads"], t, sizes["head_dim"])).astype(np.float32) for _ in range(4)]


def attend(comm, contender: str, q, k, v, counter=None) -> Tensor:
    """This rank's causal attention output of one contender (module docstring) on its parts."""
    if contender in VARIANTS:
        return context_parallel_attention(q, k, v, comm, is_causal=True, variant=contender, counter=counter)
    scale = 1.0 / math.sqrt(q.shape[-1])
    if contender == "flash":
        return attention.flash_attention(q, k, v, is_causal=True)
    if comm.Get_size() == 1:
        return attention.ScaledDotProductAttention.apply(q, k, v, scale=scale, is_causal=True)
    k, v = (gather_from_sequence_parallel_region(x.transpose(0, 2, 1, 3), comm).transpose(0, 2, 1, 3) for x in (k, v))
    t, rank = q.shape[2], comm.Get_rank()
    mask = attention.causal_mask(np.arange(rank * t, (rank + 1) * t), np.arange(k.shape[2]))
    return attention.ScaledDotProductAttention.apply(q, k, v, scale=scale, mask=mask)


def layout(contender: str) -> str:
    return "zigzag" if contender == "zigzag" else "ring"


def step(comm, contender: str, arrays, backward=True, counter=None) -> Tensor:
    """One forward (and backward) of ``contender`` on this rank's parts of ``arrays``."""
    q, k, v, grad = (shard_sequence(a, comm, layout(contender)) for a in arrays)
    leaves = [Tensor(x, requires_grad=True) for x in (q, k, v)]
    out = attend(comm, contender, *leaves, counter=counter)
    if backward:
        out.backward(grad)
    return out


# ----------------------------------------------------------------------------- (1) longest T in a budget


def held_peak(comm, contender: str, arrays) -> int:
    """This rank's peak bytes held for backward over one forward and backward."""
    with memory.track() as tracker:
        out = step(comm, contender, arrays, backward=False)
    out.backward(shard_sequence(arrays[3], comm, layout(contender)))
    return tracker.peak_bytes


def measure_peak(contender: str, p: int, t: int, sizes: dict) -> int:
    """The busiest rank's held peak at sequence length t."""
    return max(sim.run(held_peak, p, contender, inputs(t, sizes)))


def alloc_per_rank(contender: str, p: int, t: int, sizes: dict) -> float:
    """tracemalloc's peak over the whole simulated world during one step, divided by P."""
    arrays = inputs(t, sizes)
    tracemalloc.start()
    sim.run(lambda comm: step(comm, contender, arrays) and None, p)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak / p


def fitted_last(seen: dict, budget: int, lo: int) -> int:
    """The largest n >= lo at which a least-squares quadratic through ``seen`` ({n: bytes})
    stays within ``budget`` (searched by bisection on the fit, no measurement)."""
    fit = np.polynomial.Polynomial.fit(list(seen), list(seen.values()), 2)
    top = lo + 1
    while fit(top) <= budget and top < 1 << 40:
        top *= 2
    while top > lo + 1:
        mid = (lo + top) // 2
        lo, top = (mid, top) if fit(mid) <= budget else (lo, mid)
    return lo


def longest_fitting(measure, budget: int, grain: int) -> tuple[int, dict]:
    """The largest n · grain with measure(n · grain) <= budget (measure increasing in n), and
    every measurement {T: bytes}: a quadratic fitted to the points so far proposes n, and
    measurements narrow [fits, does not fit] until the two are one grain apart (two more
    measurements when the bytes are a quadratic in T, as held bytes are here)."""
    seen = {n: measure(n * grain) for n in (4, 8, 12)}
    if seen[4] > budget:
        raise ValueError(f"even T = {4 * grain} exceeds the budget of {budget} bytes; raise --budget-kib")
    lo = max(n for n, b in seen.items() if b <= budget)
    hi = min((n for n, b in seen.items() if b > budget), default=None)
    while hi is None or hi > lo + 1:
        n = max(fitted_last(seen, budget, lo), lo + 1)
        if hi is not None:
            n = min(n, hi - 1)
        seen[n] = measure(n * grain)
        lo, hi = (n, hi) if seen[n] <= budget else (lo, n)
    return lo * grain, {n * grain: b for n, b in sorted(seen.items())}


def longest_sequence(sizes: dict) -> dict:
    budget = sizes["budget_kib"] * 1024
    rows = []
    for contender in CONTENDERS:
        for p in sizes["memory_ranks"]:
            if (contender == "flash" and p > 1) or (contender == "ulysses" and sizes["heads"] % p):
                continue
            grain = 2 * p
            t_star, seen = longest_fitting(lambda t, c=contender, p=p: measure_peak(c, p, t, sizes), budget, grain)
            rows.append({"contender": contender, "ranks": p, "longest_T": t_star, "peak_bytes": seen[t_star],
                         "next_T_peak_bytes": seen[t_star + grain], "measured_T": list(seen),
                         "alloc_per_rank": alloc_per_rank(contender, p, t_star, sizes)})
    slopes = {}
    for contender in CONTENDERS:
        pts = [(r["ranks"], r["longest_T"]) for r in rows if r["contender"] == contender]
        if len(pts) > 1:
            slopes[contender] = float(np.polyfit(np.log([x for x, _ in pts]), np.log([y for _, y in pts]), 1)[0])
    return {"budget_bytes": budget, "rows": rows, "slope_logT_logP": slopes}


# ----------------------------------------------------------------------------- (2) bytes per layer


def cp_closed_form(variant: str, p: int, b: int) -> tuple[float, float]:
    """(forward, backward) values one rank sends in one attention call, b = B (T/P) h."""
    if variant in ("ring", "zigzag"):
        return 2 * (p - 1) * b, (4 * p - 2) * b
    if variant == "allgather":
        return 2 * (p - 1) * b, 2 * (p - 1) * b
    return 4 * (p - 1) * b / p, 4 * (p - 1) * b / p


def traced_bytes(p: int, fn, *args) -> list[int]:
    world = sim.World(p)
    world.run(fn, *args)
    return [world.bytes_sent(r) for r in range(p)]


def sp_layer_run(comm, n_layer: int, sizes: dict, t: int, backward: bool):
    h = sizes["heads"] * sizes["head_dim"]
    model = parallelize_gpt(GPT(GPTConfig(65, t, n_layer, sizes["heads"], h), rng=0), comm, sequence_parallel=True)
    idx = np.random.default_rng(0).integers(0, 65, size=(2, 1, t))
    _, loss = model(idx[0], idx[1])
    if backward:
        loss.backward()


def sp_bytes(p: int, sizes: dict, t: int, backward: bool) -> list[int]:
    """Bytes each rank sends for one GPT layer under Megatron-SP (2 layers less 1 layer)."""
    two, one = (traced_bytes(p, sp_layer_run, n, sizes, t, backward) for n in (2, 1))
    return [a - b for a, b in zip(two, one)]


def bytes_per_layer(sizes: dict) -> list[dict]:
    t, h = sizes["bytes_t"], sizes["heads"] * sizes["head_dim"]
    arrays = inputs(t, sizes)
    rows = []
    for p in sizes["ranks"]:
        b = t // p * h
        for variant in VARIANTS:
            if variant == "ulysses" and sizes["heads"] % p:
                continue
            fwd = traced_bytes(p, lambda comm, v=variant: step(comm, v, arrays, backward=False) and None)
            both = traced_bytes(p, lambda comm, v=variant: step(comm, v, arrays) and None)
            forms = [ITEMSIZE * x for x in cp_closed_form(variant, p, b)]
            rows.append(bytes_row(variant, p, fwd, both, forms, t * h))
        if p > 1 and sizes["heads"] >= p:
            ar = costmodel.terms("all_reduce", costmodel.choose_all_reduce(h * ITEMSIZE, p), h * ITEMSIZE, p)[1]
            whole = (p - 1) / p * t * h * ITEMSIZE
            fwd, both = sp_bytes(p, sizes, t, False), sp_bytes(p, sizes, t, True)
            rows.append(bytes_row("tp+sp", p, fwd, both, [4 * whole, 6 * whole + 6 * ar], t * h))
    return rows


def bytes_row(name: str, p: int, fwd: list[int], both: list[int], forms: list[float], th: int) -> dict:
    backward = [x - y for x, y in zip(both, fwd)]
    equal = all(abs(x - forms[0]) < 0.5 for x in fwd) and all(abs(x - forms[1]) < 0.5 for x in backward)
    return {"layout": name, "ranks": p, "forward_per_rank": fwd, "backward_per_rank": backward,
            "forward_closed_form": forms[0], "backward_closed_form": forms[1], "equal": equal,
            "forward_in_Th": max(fwd) / (th * ITEMSIZE)}


# ----------------------------------------------------------------------------- (3) work per rank


def counted(comm, variant: str, arrays) -> dict:
    counter = BlockCounter()
    step(comm, variant, arrays, backward=False, counter=counter)
    return {"pairs": counter.forward_pairs, "scores": counter.forward_scores}


def work_per_rank(sizes: dict) -> list[dict]:
    rows = []
    for p in WORK_RANKS:
        arrays = inputs(sizes["work_t"], sizes)
        for variant in ("ring", "zigzag"):
            per = sim.run(counted, p, variant, arrays)
            scores = [r["scores"] for r in per]
            rows.append({"ranks": p, "layout": variant, "pairs": [r["pairs"] for r in per], "scores": scores,
                         "max_over_mean_scores": max(scores) / statistics.mean(scores)})
    return rows


# ----------------------------------------------------------------------------- (4) wall time on 2 ranks


def alone(comm, work) -> float:
    """Seconds rank 0 takes to run ``work()`` while the other ranks sleep (they poll for its
    message every millisecond rather than wait in MPI, which would spin and take a core)."""
    if comm.Get_rank() == 0:
        began = time.perf_counter()
        work()
        elapsed = time.perf_counter() - began
        for r in range(1, comm.Get_size()):
            comm.send(elapsed, dest=r, tag=7795)
        return elapsed
    request = comm.irecv(source=0, tag=7795)
    while True:
        done, elapsed = request.test()
        if done:
            return elapsed
        time.sleep(0.001)


def mpi_worker(sizes: dict) -> None:
    """Under mpiexec: per repeat, the one-process references (rank 0 alone on the whole
    sequence: dense, flash), then each variant on every rank (the slower rank's time), all
    interleaved so that a busy moment of the machine slows every contender alike; rank 0
    prints ``RESULT {name: median seconds}``."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    arrays = inputs(sizes["time_t"], sizes)
    variants = [v for v in VARIANTS if v != "ulysses" or sizes["heads"] % comm.Get_size() == 0]
    samples = {name: [] for name in ("dense", "flash", *variants)}
    for repeat in range(sizes["repeats"] + 1):  # the first round warms up and is dropped
        for name, times in samples.items():
            comm.Barrier()
            if name in VARIANTS:
                began = time.perf_counter()
                step(comm, name, arrays)
                elapsed = comm.allreduce(time.perf_counter() - began, op=MPI.MAX)
            else:
                elapsed = alone(comm, lambda n=name: step(MPI.COMM_SELF, n, arrays))
            if repeat:
                times.append(elapsed)
    if comm.Get_rank() == 0:
        print("RESULT " + json.dumps({name: statistics.median(times) for name, times in samples.items()}), flush=True)


def wall_time(sizes: dict, quick: bool) -> dict:
    done = launch(Path(__file__), 2, timeout=600, args=["--mpi-worker"] + (["--quick"] if quick else []))
    if done.returncode != 0:
        raise RuntimeError(f"the 2-rank timing failed:\n{done.stdout}\n{done.stderr}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    medians = json.loads(lines[-1][len("RESULT "):])
    single = {name: medians.pop(name) for name in ("dense", "flash")}
    return {"T": sizes["time_t"], "repeats": sizes["repeats"], "one_process_median_s": single,
            "two_ranks_median_s": medians,
            "ratio_over_one_process_dense": {v: s / single["dense"] for v, s in medians.items()},
            "ratio_over_one_process_flash": {v: s / single["flash"] for v, s in medians.items()},
            "flash_over_dense_one_process": single["flash"] / single["dense"]}


# ----------------------------------------------------------------------------- report


def report(figures: dict) -> None:
    s = figures["sizes"]
    m = figures["longest_sequence"]
    print(f"one causal attention layer, B=1 H={s['heads']} d={s['head_dim']} float32; ranks on minidist.sim")
    print(f"(1) longest T whose busiest rank holds <= {m['budget_bytes'] / 1024:.0f} KiB for backward (memory.track)")
    print(f"    {'contender':10} {'P':>2} {'longest T':>10} {'held':>10} {'T+2P held':>10} {'alloc/rank':>11}")
    for r in m["rows"]:
        print(f"    {r['contender']:10} {r['ranks']:>2} {r['longest_T']:>10} {r['peak_bytes']:>10,} "
              f"{r['next_T_peak_bytes']:>10,} {r['alloc_per_rank'] / 1024:>9.0f}Ki")
    print("    slope of log T* over log P: " + ", ".join(f"{c} {v:.2f}" for c, v in m["slope_logT_logP"].items()))
    print(f"(2) bytes one rank sends per layer (sim trace) against the closed form; T = {s['bytes_t']}, "
          "b = (T/P) h values of 4 bytes, h = H d:")
    for line in FORMULAS:
        print("      " + line)
    print(f"    {'layout':9} {'P':>2} {'forward':>10} {'formula':>10} {'backward':>10} {'formula':>10} {'fwd/(T h)':>9}"
          "  equal")
    for r in figures["bytes_per_layer"]:
        print(f"    {r['layout']:9} {r['ranks']:>2} {max(r['forward_per_rank']):>10,} "
              f"{r['forward_closed_form']:>10,.0f} {max(r['backward_per_rank']):>10,}"
              f" {r['backward_closed_form']:>10,.0f} {r['forward_in_Th']:>9.3f}"
              f"  {'yes' if r['equal'] else 'NO'}")
    print(f"(3) causal forward work per rank (BlockCounter), T = {s['work_t']}: chunk pairs, rank 0 .. P-1")
    for r in figures["work_per_rank"]:
        print(f"    {r['layout']:7} P={r['ranks']}: pairs {r['pairs']}  max/mean scores "
              f"{r['max_over_mean_scores']:.2f}")
    w = figures.get("wall_time")
    if w:
        print(f"(4) forward + backward, T = {w['T']}, median of {w['repeats']}: one process dense "
              f"{w['one_process_median_s']['dense'] * 1e3:.1f} ms, flash "
              f"{w['one_process_median_s']['flash'] * 1e3:.1f} ms")
        for v, sec in w["two_ranks_median_s"].items():
            print(f"    {v:9} 2 ranks (mpiexec) {sec * 1e3:8.1f} ms  = {w['ratio_over_one_process_dense'][v]:.2f} x "
                  f"one-process dense, {w['ratio_over_one_process_flash'][v]:.2f} x flash")


def plot(figures: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    rows = figures["longest_sequence"]["rows"]
    for contender in CONTENDERS:
        pts = [(r["ranks"], r["longest_T"]) for r in rows if r["contender"] == contender]
        a.plot(*zip(*pts), "x--" if contender == "zigzag" else "o-", label=contender)
    a.set(xscale="log", yscale="log", xlabel="ranks P", ylabel="longest T in the budget", title="(1) memory")
    a.set_xticks(figures["sizes"]["memory_ranks"], [str(p) for p in figures["sizes"]["memory_ranks"]])
    a.legend(fontsize=7)
    for name in VARIANTS + ("tp+sp",):
        pts = [(r["ranks"], max(r["forward_per_rank"])) for r in figures["bytes_per_layer"] if r["layout"] == name]
        if pts:
            b.plot(*zip(*pts), "x--" if name == "zigzag" else "o-", label=name)
    b.set(xlabel="ranks P", ylabel="bytes per rank, forward, one layer", title="(2) bytes")
    b.legend(fontsize=7)
    work = [r for r in figures["work_per_rank"] if r["ranks"] == max(WORK_RANKS)]
    for i, r in enumerate(work):
        c.bar(np.arange(r["ranks"]) + 0.4 * i, r["scores"], width=0.4, label=r["layout"])
    c.set(xlabel="rank", ylabel="scores computed (forward)", title=f"(3) work, P = {max(WORK_RANKS)}")
    c.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the smoke test)")
    parser.add_argument("--budget-kib", type=int, help="the per-rank budget of (1) (default 256; quick 48)")
    parser.add_argument("--no-mpi", action="store_true", help="skip (4), the 2-rank timing under mpiexec")
    parser.add_argument("--json", metavar="PATH", help="where to write the figures (default for a full run: "
                        "notebooks/measurements/bench_context_parallel_<date>.json)")
    parser.add_argument("--plot", metavar="PNG", help="also draw (1), (2) and (3) (needs matplotlib)")
    parser.add_argument("--mpi-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = dict(QUICK if args.quick else FULL)
    if args.budget_kib is not None:
        if args.budget_kib <= 0:
            parser.error("--budget-kib must be a positive number of KiB")
        sizes["budget_kib"] = args.budget_kib
    if args.mpi_worker:
        mpi_worker(sizes)
        return 0
    began = time.perf_counter()
    figures = {"date": str(datetime.date.today()), "machine": platform.machine(), "numpy": np.__version__,
               "sizes": sizes, "notes": NOTES, "load_average_before": os.getloadavg()}
    figures["longest_sequence"] = longest_sequence(sizes)
    figures["bytes_per_layer"] = bytes_per_layer(sizes)
    figures["work_per_rank"] = work_per_rank(sizes)
    if not args.no_mpi:
        figures["wall_time"] = wall_time(sizes, args.quick)
    figures["seconds"], figures["load_average_after"] = time.perf_counter() - began, os.getloadavg()
    report(figures)
    path = args.json or (None if args.quick else
                         str(ROOT / "notebooks" / "measurements" / f"bench_context_parallel_{figures['date']}.json"))
    if path:
        Path(path).write_text(json.dumps(figures, indent=1))
        print("wrote", path)
    if args.plot:
        plot(figures, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
