"""Serving's four figures (issue 34, part 5), from one run, one BLAS thread:

(a) **Decode against batch size, on the roofline.** One decode step (one token for each of B
    sequences, each with C positions cached: ``GPT.forward_cached`` on a ``KVCache``) for B = 1, 2, 4,
    ...: milliseconds per step (the latency of a token), tokens per second, and where the step sits
    on chapter 13's roofline. A step does 2·P·B FLOPs in the weights' products (P the parameters,
    the embedding's lookups aside) plus 4·L·B·C_ctx·C in attention, and moves the weights (4·P bytes
    in float32) and the KV cache (2·L·B·C_ctx·C·4): its intensity is about B/2 FLOP per byte, so
    decode is memory-bound until B reaches twice the machine's ridge point (peak FLOP/s / bandwidth,
    measured here as chapter 13 measures them: a large float32 matrix product and a 64 MiB copy).
    Reference: the same step without the cache (``use_cache=False``: the whole context recomputed)
    at B = 1, and B = 1 for the tokens/s ratios.
(b) **Continuous against static batching** on one stream of requests of mixed lengths (prompts of
    1-16 tokens, 4-60 tokens asked, arriving over the first steps): the Scheduler with
    ``policy="continuous"`` and ``policy="static"``, the same requests and ``max_batch``: tokens/s,
    and each request's latency (arrival to last token) at p50 and p99, as ratios continuous/static.
(c) **TP 2 decode against one rank** on ``minidist.sim`` (two threads sharing one interpreter: the
    time says what the split and its messages cost here, not what two GPUs gain): ms per decode
    step of ``TensorParallelDecoder`` against the dense model, the bytes each rank sends per step
    against the closed form (1 + 2L all-reduces of B·C values, one all-gather of B·V/2 logits), and
    the KV bytes per rank (half).
(d) **KV memory, blocks against a reserved maximum**: over (b)'s continuous run, the most bytes the
    paged cache's sequences held at once, against reserving block_size positions for each of
    ``max_batch`` sequences (a contiguous cache's need), and against the positions really stored.

    .venv/bin/python benchmarks/bench_serving.py [--quick] [--json PATH]

``--quick`` (the smoke test) uses a tiny GPT and few steps.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np
from measure import machine_roofline, median_seconds
from threadpoolctl import threadpool_limits

from minidist import costmodel, sim
from minidist.models.gpt import GPT, GPTConfig
from minidist.models.kv_cache import KVCache
from minidist.serving import PagedKVCache, Request, Scheduler, TensorParallelDecoder
from minidist.tracing import CountingComm

VOCAB = 65  # the plays' characters
FULL = dict(decode=dict(n_layer=4, n_head=8, n_embd=512, block_size=256), context=64, batches=(1, 2, 4, 8, 16, 32, 64),
            stream=dict(n_layer=2, n_head=4, n_embd=128, block_size=96), requests=48, max_batch=8, repeats=7)
QUICK = dict(decode=dict(n_layer=1, n_head=2, n_embd=16, block_size=16), context=4, batches=(1, 2, 4),
             stream=dict(n_layer=1, n_head=2, n_embd=16, block_size=96), requests=8, max_batch=3, repeats=2)


# ----------------------------------------------------------------------------- (a) decode against batch


def decode_step_cost(config: GPTConfig, batch: int, context: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one float32 decode step (module docstring)."""
    c, layers = config.n_embd, config.n_layer
    weights = 12 * layers * c * c + config.vocab_size * c  # the products' weights (the head is the embedding)
    flops = 2 * weights * batch + 4 * layers * batch * context * c
    return flops, 4 * weights + 2 * layers * batch * context * c * 4


def decode_against_batch(sizes: dict, roofline: dict) -> dict:
    config = GPTConfig(VOCAB, **sizes["decode"])
    model, context, repeats = GPT(config, rng=0), sizes["context"], sizes["repeats"]
    rows = []
    for batch in sizes["batches"]:
        ids = np.random.default_rng(batch).integers(0, VOCAB, size=(batch, context))
        cache = KVCache(context + repeats + 1)
        model.forward_cached(ids, cache)
        step = median_seconds(lambda ids=ids, cache=cache: model.forward_cached(ids[:, -1:], cache), repeats)
        flops, nbytes = decode_step_cost(config, batch, context)
        bound = min(roofline["peak_flops"], flops / nbytes * roofline["bandwidth"])
        rows.append({"batch": batch, "ms_per_step": 1e3 * step, "tokens_per_second": batch / step,
                     "flop_per_byte": flops / nbytes, "gflops": flops / step / 1e9, "roofline_gflops": bound / 1e9,
                     "memory_bound": flops / nbytes < roofline["ridge_flop_per_byte"]})
    for row in rows:
        row["tokens_per_second_vs_batch_1"] = row["tokens_per_second"] / rows[0]["tokens_per_second"]
    one = np.random.default_rng(1).integers(0, VOCAB, size=(1, context + 1))
    recompute = median_seconds(lambda: model.generate(one, 1, use_cache=False), repeats)
    return {"config": sizes["decode"], "context": context, "rows": rows,
            "recompute_ms_per_token_batch_1": 1e3 * recompute,
            "cache_speedup_batch_1": recompute / (rows[0]["ms_per_step"] / 1e3),
            "batch_where_compute_bound": 2 * roofline["ridge_flop_per_byte"]}


# ----------------------------------------------------------------------------- (b), (d) the stream


def request_stream(count: int, block_size: int) -> list[tuple[int, Request]]:
    """(arrival step, request): mixed lengths, arriving over the first steps."""
    rng = np.random.default_rng(0)
    stream = []
    for i in range(count):
        prompt = rng.integers(0, VOCAB, size=int(rng.integers(1, 17))).tolist()
        wanted = int(min(rng.choice([4, 8, 60]), block_size - len(prompt)))
        stream.append((int(rng.integers(0, count // 2 + 1)), Request(prompt, wanted, seed=i)))
    return sorted(stream, key=lambda item: item[0])


def serve_stream(model, stream, policy: str, max_batch: int) -> dict:
    """Run the stream; wall seconds, per-request latency, tokens, and the paged cache's peak bytes."""
    scheduler = Scheduler(model, kv_block_size=16, max_batch=max_batch, policy=policy)
    arrived, finished, pending, step, tokens, peak_blocks, peak_positions = {}, {}, list(stream), 0, 0, 0, 0
    start = time.perf_counter()
    while pending or scheduler.has_work():
        while pending and pending[0][0] <= step:
            arrived[scheduler.add(pending.pop(0)[1])] = time.perf_counter()
        for event in scheduler.step():
            tokens += event.token_id is not None
            if event.finished:
                finished[event.request_id] = time.perf_counter()
        kv = scheduler.kv_cache
        peak_blocks = max(peak_blocks, kv.num_blocks - kv.num_free_blocks)
        peak_positions = max(peak_positions, sum(kv.lengths.values()))
        step += 1
    seconds = time.perf_counter() - start
    latency = [finished[i] - arrived[i] for i in finished]
    return {"seconds": seconds, "tokens": tokens, "steps": step, "tokens_per_second": tokens / seconds,
            "latency_p50_s": float(np.percentile(latency, 50)), "latency_p99_s": float(np.percentile(latency, 99)),
            "peak_blocks": peak_blocks, "peak_positions": peak_positions,
            "bytes_per_block": scheduler.kv_cache.bytes_per_block(), "block_size": scheduler.kv_cache.block_size}


def continuous_against_static(sizes: dict) -> tuple[dict, dict]:
    config = GPTConfig(VOCAB, **sizes["stream"])
    model = GPT(config, rng=0)
    stream = request_stream(sizes["requests"], config.block_size)
    runs = {policy: serve_stream(model, stream, policy, sizes["max_batch"]) for policy in ("static", "continuous")}
    c, s = runs["continuous"], runs["static"]
    ratios = {"throughput": c["tokens_per_second"] / s["tokens_per_second"],
              "latency_p50": c["latency_p50_s"] / s["latency_p50_s"],
              "latency_p99": c["latency_p99_s"] / s["latency_p99_s"]}
    per_position = c["bytes_per_block"] // c["block_size"]
    reserved = sizes["max_batch"] * config.block_size * per_position
    kv = {"paged_peak_bytes": c["peak_blocks"] * c["bytes_per_block"], "reserved_maximum_bytes": reserved,
          "stored_positions_peak_bytes": c["peak_positions"] * per_position}
    kv["paged_over_reserved"] = kv["paged_peak_bytes"] / reserved
    return {"config": sizes["stream"], "requests": len(stream), "max_batch": sizes["max_batch"], **runs,
            "continuous_over_static": ratios}, kv


# ----------------------------------------------------------------------------- (c) TP 2 decode


def tp_decode_rank(comm, sizes: dict, batch: int) -> dict:
    """One rank's ms per decode step, bytes sent per step and KV bytes, TP over ``comm``."""
    config = GPTConfig(VOCAB, **sizes["decode"])
    counted = CountingComm(comm, allow_collectives=True, keep_messages=False)
    model = GPT(config, rng=0)
    decoder = TensorParallelDecoder(model, counted) if comm.Get_size() > 1 else model
    cache = PagedKVCache(batch * -(-config.block_size // 16), 16)
    ids = np.random.default_rng(0).integers(0, VOCAB, size=(batch, sizes["context"]))
    for row in range(batch):
        cache.allocate(row, sizes["context"])
        decoder.forward_cached(ids[row:row + 1], cache.batch([row]))
    before = counted.nbytes
    decoder.forward_cached(ids[:, -1:], cache.batch(range(batch)))
    sent = counted.nbytes - before
    step = median_seconds(lambda: decoder.forward_cached(ids[:, -1:], cache.batch(range(batch))), sizes["repeats"])
    return {"ms_per_step": 1e3 * step, "bytes_sent": sent, "kv_bytes": cache.nbytes}


def tp_against_one(sizes: dict) -> dict:
    config, batch = GPTConfig(VOCAB, **sizes["decode"]), sizes["batches"][-1]
    one = sim.run(tp_decode_rank, 1, sizes, batch)[0]
    two = sim.run(tp_decode_rank, 2, sizes, batch)
    activation = batch * config.n_embd * 4
    all_reduce = costmodel.terms("all_reduce", costmodel.choose_all_reduce(activation, 2), activation, 2)[1]
    width = -(-VOCAB // 2)
    closed = (1 + 2 * config.n_layer) * all_reduce + costmodel.terms("all_gather", "ring", 2 * batch * width * 4, 2)[1]
    return {"batch": batch, "one_rank": one, "tp_2": two, "closed_form_bytes_per_rank": closed,
            "tp_2_over_one_time": max(r["ms_per_step"] for r in two) / one["ms_per_step"],
            "kv_bytes_per_rank_over_one": two[0]["kv_bytes"] / one["kv_bytes"]}


# ----------------------------------------------------------------------------- report


def report(figures: dict) -> None:
    roof, dec = figures["roofline"], figures["decode"]
    print(f"this CPU, one thread: peak {roof['peak_flops'] / 1e9:.1f} GFLOP/s, bandwidth "
          f"{roof['bandwidth'] / 1e9:.1f} GB/s, ridge {roof['ridge_flop_per_byte']:.1f} FLOP/byte: decode is "
          f"compute-bound from a batch of about {dec['batch_where_compute_bound']:.0f}")
    print(f"\n(a) decode against batch size (GPT {dec['config']}, {dec['context']} positions cached)")
    print("  batch | ms/step (latency per token) | tokens/s | x batch 1 | FLOP/byte | GFLOP/s | roofline | bound")
    for r in dec["rows"]:
        print(f"  {r['batch']:5d} | {r['ms_per_step']:27.2f} | {r['tokens_per_second']:8.0f} | "
              f"{r['tokens_per_second_vs_batch_1']:9.2f} | {r['flop_per_byte']:9.2f} | {r['gflops']:7.2f} | "
              f"{r['roofline_gflops']:8.2f} | {'memory' if r['memory_bound'] else 'compute'}")
    print(f"  without the cache (context recomputed), batch 1: {dec['recompute_ms_per_token_batch_1']:.2f} ms per "
          f"token; the cache is {dec['cache_speedup_batch_1']:.1f}x faster")
    st = figures["stream"]
    print(f"\n(b) continuous against static batching: {st['requests']} requests of mixed lengths, max_batch "
          f"{st['max_batch']} (GPT {st['config']})")
    print("  policy     | steps | tokens/s | latency p50 (s) | p99 (s)")
    for policy in ("static", "continuous"):
        r = st[policy]
        print(f"  {policy:10} | {r['steps']:5d} | {r['tokens_per_second']:8.0f} | {r['latency_p50_s']:15.3f} | "
              f"{r['latency_p99_s']:7.3f}")
    ratio = st["continuous_over_static"]
    print(f"  continuous / static: throughput {ratio['throughput']:.2f}x, p50 latency {ratio['latency_p50']:.2f}x, "
          f"p99 {ratio['latency_p99']:.2f}x")
    tp = figures["tp"]
    sent = [r["bytes_sent"] for r in tp["tp_2"]]
    print(f"\n(c) TP 2 decode against one rank (sim, batch {tp['batch']}): {tp['one_rank']['ms_per_step']:.2f} ms "
          f"one rank, {max(r['ms_per_step'] for r in tp['tp_2']):.2f} ms TP 2 ({tp['tp_2_over_one_time']:.2f}x); "
          f"bytes sent per rank per step {sent} against the closed form {tp['closed_form_bytes_per_rank']:.0f}: "
          f"{'equal' if all(abs(s - tp['closed_form_bytes_per_rank']) < 0.5 for s in sent) else 'NOT equal'}; KV "
          f"bytes per rank {tp['kv_bytes_per_rank_over_one']:.2f} of one rank's")
    kv = figures["kv_memory"]
    print(f"\n(d) KV memory over (b)'s continuous run: paged peak {kv['paged_peak_bytes']:,} bytes, reserved maximum "
          f"{kv['reserved_maximum_bytes']:,} ({kv['paged_over_reserved']:.2f}x of it); the positions stored at "
          f"their peak {kv['stored_positions_peak_bytes']:,}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny GPT and few steps (the smoke test)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    figures = {"machine": platform.machine(), "numpy": np.__version__, "quick": args.quick,
               "load_average_before": os.getloadavg()}  # a busy machine slows every figure; say how busy
    with threadpool_limits(limits=1):
        figures["roofline"] = machine_roofline(sizes["repeats"])
        figures["decode"] = decode_against_batch(sizes, figures["roofline"])
        figures["stream"], figures["kv_memory"] = continuous_against_static(sizes)
        figures["tp"] = tp_against_one(sizes)
    figures["load_average_after"] = os.getloadavg()
    report(figures)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(figures, file, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
