"""Mixture-of-experts figures (issue 32, part 4), from one run:

(a) **Load over training, with and without balancing.** A small MoE GPT (E experts, top-k) trained
    on Shakespeare three times from the same seed: no balancing (alpha = 0), Switch's load-balancing
    loss (alpha = 0.01), DeepSeek-V3's routing bias (gamma, alpha = 0). Every step records layer 0's
    tokens per expert (routed, before capacity); the figure is the busiest expert's load over the
    mean (1 = balanced, E / k = every token on the same k experts), early and late, and the final
    val loss of each.
(b) **Drop rate against the capacity factor.** On each trained model of (a), one held-out batch:
    the fraction of the k·N assignments the capacity drops, all layers, for factors 0.5 .. 2.
(c) **Bytes and step time against the EP degree (sim).** One MoE layer (E experts, N global
    tokens) forward and backward on P = 1, 2, 4, 8 simulated ranks: each rank's all_to_all_v bytes
    on the trace (dispatch and combine, forward and backward, counts included) against
    4 · k · (N / P) · C · 4 · (P - 1) / P for a uniform router, and the wall time of a step.
(d) **When an MoE layer is compute-bound, on chapter 13's roofline.** An expert's products on t
    tokens do 2 · t · C · 4C FLOPs per matrix and read the 4C · C float32 weights (4 bytes each):
    t / 2 FLOP per byte, so they are compute-bound past t = 2 · ridge. A batch of B tokens gives
    each expert t = B · k / E of them (the scaling book's argument: sparsity divides the batch by
    E / k), so the layer needs B >= 2 · ridge · E / k. Measured: the machine's ridge (peak FLOP/s
    of a 1024² product over a 64 MiB copy's bandwidth, as chapter 13), one expert's GFLOP/s over t.
(e) **MoE against dense on Shakespeare.** ``train --model gpt`` (single, float32, the same seed
    and steps) dense, and with E experts of top-1 (Switch): the same active parameters per token
    (one MLP each, plus a router), E times the MLP parameters. The final val loss and time of each.

    .venv/bin/python benchmarks/bench_experts.py [--quick] [--json PATH]

``--quick`` (the smoke test): tiny sizes and few steps, the same figures printed.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time

import numpy as np
from measure import machine_roofline, median_seconds
from threadpoolctl import threadpool_limits

from minidist import collectives, data, optim, sim, train, workloads
from minidist.models.gpt import GPT, MLP, GPTConfig
from minidist.models.moe import MoE
from minidist.parallel.expert_parallel import apply_ep, moe_layers
from minidist.parallel.expert_parallel.train import train_moe_single
from minidist.tensor import Tensor, no_grad

FULL = dict(model=dict(n_layer=2, n_head=2, n_embd=32, block_size=32), batch=16, balance_steps=150, n_expert=8,
            top_k=2, factors=(0.5, 0.75, 1.0, 1.25, 1.5, 2.0), ep_tokens=512, ep_width=64, degrees=(1, 2, 4, 8),
            ep_repeats=7, expert_width=1024, expert_tokens=(1, 4, 16, 64, 256, 1024), compare_steps=600, repeats=5)
QUICK = dict(model=dict(n_layer=1, n_head=2, n_embd=16, block_size=16), batch=4, balance_steps=6, n_expert=4,
             top_k=2, factors=(0.5, 1.0, 2.0), ep_tokens=64, ep_width=16, degrees=(1, 2, 4), ep_repeats=1,
             expert_width=64, expert_tokens=(1, 16, 64), compare_steps=4, repeats=2)
BALANCING = {"none": dict(aux_loss_coef=0.0), "aux_loss": dict(aux_loss_coef=0.01),
             "bias": dict(aux_loss_coef=0.0, bias_update_rate=0.001)}


def max_over_mean(load) -> float:
    load = np.asarray(load, dtype=float)
    return float(load.max() / load.mean())


# ----------------------------------------------------------------------------- (a), (b) balance and drops


def train_balanced(text, sizes, balancing: dict):
    """(model, loads per step, val loss): a manual AdamW loop (lr 5e-3) on random windows."""
    config = GPTConfig(text.vocab_size, **sizes["model"], n_expert=sizes["n_expert"], top_k=sizes["top_k"],
                       capacity_factor=1.25, **balancing)
    model = GPT(config, rng=0)
    opt = optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.1)
    windows = data.TokenWindows(text.train, config.block_size, sizes["batch"], seed=0)
    loads = []
    for step in range(sizes["balance_steps"]):
        x, y = windows.batch(step)
        opt.zero_grad()
        model(x, y)[1].backward()
        opt.step()
        loads.append(moe_layers(model)[0].tokens_per_expert.tolist())
    val = data.TokenWindows(text.val, config.block_size, 32, seed=1)
    with no_grad():
        val_loss = statistics.mean(float(model(*val.batch(i))[1].item()) for i in range(4))
    return model, loads, val_loss


def drop_rates(model, text, sizes) -> dict:
    """Fraction of assignments dropped on one held-out batch, every MoE layer, per capacity factor."""
    x, _ = data.TokenWindows(text.val, model.config.block_size, 32, seed=2).batch(0)
    rates = {}
    with no_grad():
        for factor in sizes["factors"]:
            for layer in moe_layers(model):
                layer.capacity_factor = factor
            model(x)
            rates[factor] = sum(layer.dropped for layer in moe_layers(model)) / (
                len(moe_layers(model)) * x.size * sizes["top_k"])
    return rates


def balance_figures(text, sizes) -> dict:
    out = {}
    for name, balancing in BALANCING.items():
        model, loads, val_loss = train_balanced(text, sizes, balancing)
        tenth = max(len(loads) // 10, 1)
        out[name] = {"balancing": balancing, "tokens_per_expert": loads[::max(len(loads) // 30, 1)],
                     "max_over_mean_first_tenth": statistics.mean(max_over_mean(v) for v in loads[:tenth]),
                     "max_over_mean_last_tenth": statistics.mean(max_over_mean(v) for v in loads[-tenth:]),
                     "val_loss": val_loss, "drop_rate": drop_rates(model, text, sizes)}
    return out


# ----------------------------------------------------------------------------- (c) bytes and time against P


def ep_step(comm, config, x, repeats):
    layer = MoE(config, rng=np.random.default_rng(0), dtype="float32", device=None, mlp_class=MLP)
    layer = apply_ep(layer, comm, comm)
    n = x.shape[0] // comm.Get_size()
    mine = x[comm.Get_rank() * n:(comm.Get_rank() + 1) * n][None]

    def step():
        layer.zero_grad()
        layer(Tensor(mine)).sum().backward()

    seconds = median_seconds(step, repeats)
    return seconds, layer.dispatcher.sent_rows


def ep_figures(sizes) -> list:
    e, k, n, c = sizes["n_expert"], sizes["top_k"], sizes["ep_tokens"], sizes["ep_width"]
    config = GPTConfig(8, 8, 1, 1, c, n_expert=e, top_k=k, capacity_factor=None, aux_loss_coef=0.0)
    x = np.random.default_rng(0).standard_normal((n, c)).astype("float32")
    rows = []
    for p in sizes["degrees"]:
        if p > e:
            continue
        world = sim.World(p, timeout=300)
        got = world.run(ep_step, config, x, sizes["ep_repeats"])
        tag = collectives.TAGS["all_to_all_v"]
        steps = sizes["ep_repeats"]
        sent = [sum(m.nbytes for m in world.trace if m.source == r and m.tag == tag and m.kind == "array") / steps
                for r in range(p)]
        uniform = 4 * k * (n // p) * c * 4 * (p - 1) / p
        rows.append({"ranks": p, "bytes_per_rank_per_step": statistics.mean(sent), "uniform_router_bytes": uniform,
                     "rows_sent_per_dispatch": [g[1] for g in got],
                     "uniform_rows_per_dispatch": k * (n // p) * (p - 1) / p,
                     "seconds_per_step": max(g[0] for g in got)})
    return rows


# ----------------------------------------------------------------------------- (d) the roofline


def roofline_figures(sizes) -> dict:
    roof = machine_roofline(sizes["repeats"])
    c = sizes["expert_width"]  # 1024: 32 MiB of weights, past the caches (the roofline's bandwidth is DRAM's)
    expert = MLP(GPTConfig(8, 8, 1, 1, c), rng=np.random.default_rng(0), dtype="float32", device=None)
    rows = []
    with no_grad():
        for t in sizes["expert_tokens"]:
            h = Tensor(np.random.default_rng(t).standard_normal((t, c)).astype("float32"))
            seconds = median_seconds(lambda h=h: expert(h), sizes["repeats"])
            flops, nbytes = 2 * 2 * t * c * 4 * c, 4 * (2 * 4 * c * c + 2 * t * c + 2 * t * 4 * c)
            bound = min(roof["peak_flops"], flops / nbytes * roof["bandwidth"])
            rows.append({"tokens": t, "flop_per_byte": flops / nbytes, "gflops": flops / seconds / 1e9,
                         "roofline_gflops": bound / 1e9, "memory_bound": flops / nbytes < roof["ridge_flop_per_byte"]})
    ridge = roof["ridge_flop_per_byte"]
    batches = {f"E={e},k={k}": 2 * ridge * e / k for e, k in ((1, 1), (8, 2), (64, 2), (256, 8))}
    return {**roof, "expert_width": c, "expert_rows": rows, "tokens_per_expert_compute_bound": 2 * ridge,
            "batch_tokens_compute_bound": batches}


# ----------------------------------------------------------------------------- (e) MoE against dense


def compare_figures(text, sizes) -> dict:
    base = train.TrainConfig(model="gpt", **sizes["model"], steps=sizes["compare_steps"],
                             eval_every=sizes["compare_steps"], batch_size=sizes["batch"], progress=False)
    out = {}
    for name, config in (("dense", base), (f"moe E={sizes['n_expert']} top-1", dataclasses.replace(
            base, n_expert=sizes["n_expert"], top_k=1, capacity_factor=1.25))):
        start = time.perf_counter()
        result = train_moe_single(None, config, text) if config.n_expert else train.train_single(config, text,
                                                                                                  report=False)
        params = result.model.num_params()
        active = params - (config.n_expert - 1) * sum(p.size for p in moe_layers(result.model)[0].experts[0]
                                                      .parameters()) * config.n_layer if config.n_expert else params
        out[name] = {"val_loss": result.val_loss, "seconds": time.perf_counter() - start, "parameters": params,
                     "active_parameters": active, "steps": config.steps}
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the smoke test)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    text = workloads.load_text()
    with threadpool_limits(limits=1):
        figures = {"quick": args.quick, "machine": platform.platform(), "sizes": sizes,
                   "balance": balance_figures(text, sizes), "ep": ep_figures(sizes),
                   "roofline": roofline_figures(sizes), "moe_vs_dense": compare_figures(text, sizes)}
    report(figures)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1, default=str)


def report(figures):
    sizes = figures["sizes"]
    print(f"(a) load over training, layer 0, E={sizes['n_expert']} top-{sizes['top_k']}: busiest expert / mean")
    for name, row in figures["balance"].items():
        print(f"  {name:9s} first tenth {row['max_over_mean_first_tenth']:.2f}  last tenth "
              f"{row['max_over_mean_last_tenth']:.2f}  val_loss {row['val_loss']:.4f}")
    print("(b) drop rate against capacity factor (held-out batch, all layers)")
    for name, row in figures["balance"].items():
        print(f"  {name:9s} " + "  ".join(f"{f}: {r:.3f}" for f, r in row["drop_rate"].items()))
    print("(c) one MoE layer forward + backward on the sim: all_to_all_v bytes per rank per step, time")
    for row in figures["ep"]:
        print(f"  P={row['ranks']}: {row['bytes_per_rank_per_step']:.0f} B (uniform router: "
              f"{row['uniform_router_bytes']:.0f}), {1e3 * row['seconds_per_step']:.1f} ms")
    roof = figures["roofline"]
    print(f"(d) roofline: ridge {roof['ridge_flop_per_byte']:.1f} FLOP/B; an expert is compute-bound past "
          f"{roof['tokens_per_expert_compute_bound']:.0f} tokens; batch tokens needed: "
          + ", ".join(f"{k} {v:.0f}" for k, v in roof["batch_tokens_compute_bound"].items()))
    for row in roof["expert_rows"]:
        print(f"  t={row['tokens']:5d}: {row['gflops']:.2f} GFLOP/s (roofline {row['roofline_gflops']:.2f}), "
              f"{'memory' if row['memory_bound'] else 'compute'}-bound")
    print("(e) Shakespeare, single process, float32: dense against MoE of the same active parameters")
    for name, row in figures["moe_vs_dense"].items():
        print(f"  {name:16s} val_loss {row['val_loss']:.4f}  {row['seconds']:.1f} s  parameters "
              f"{row['parameters']} (active {row['active_parameters']})")


if __name__ == "__main__":
    main()
