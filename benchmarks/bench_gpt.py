"""The GPT's three figures (issue 19, part 6), from one run:

(a) **Time to a loss.** The default ``train --model gpt`` (single process, float32): the wall-clock
    time until an evaluation's validation loss is <= 2.0 nats per character (evaluations
    included), and the final loss. Then ddp on 2 ranks (``minidist.sim``: the same algorithm as
    under mpiexec, on threads) with half the per-rank batch and ``--no-scale-lr`` must follow the
    single run: the largest difference of the train and val losses (fixed evaluation windows)
    after ``--follow-steps`` steps, against 1e-4.
(b) **One training step against PyTorch.** The engine's GPT and PyTorch eager on the same model
    (the same weights, copied by name: the names are nanoGPT's), the same batch, AdamW and
    gradient clipping, float32, one BLAS thread for both, timed round-robin in this process:
    forward and loss, backward, clip and AdamW, and the whole step; the ratio engine / torch.
    The engine runs three times, each on its own copy of the model: as it is
    (``scaled_dot_product_attention`` tiles from ``functions.FLASH_MIN_SEQUENCE``), with its
    attention never tiled (``md-dense``) and always tiled (``md-flash``: ``FlashAttention``,
    tiles of ``attention.FLASH_BLOCK_SIZE``). torch is skipped when it is not installed (it is not a dependency).
(c) **Activation memory per block.** ``memory.track`` on one ``Block`` (b sequences of s tokens,
    width h, a heads) by op, against Korthikanti et al., MLSys 2023 (section 4.1), term by term: their
    s·b·h·(34 + 5·a·s/h) bytes are 16-bit values and 1-byte dropout masks; the same tensors in
    float32 without dropout are 64·sbh + 4·a·s²·b, which is what the engine should keep, and
    what it keeps beyond them is named.

    .venv/bin/python benchmarks/bench_gpt.py [--quick] [--repeats 20] [--json PATH] [--parts abc]
        [--block-size T --batch-size B]

``--parts b`` measures the step alone (the training of (a) takes minutes); ``--block-size`` and
``--batch-size`` change the GPT's context and batch (``--block-size 256 --batch-size 8``: the
same 2,048 tokens a step, where ``scaled_dot_product_attention`` tiles).

``--quick`` (the smoke test) trains a tiny GPT for a few steps instead of the default run and
times fewer repeats: the figures are printed the same way, the loss target is not reached.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time

import numpy as np
from threadpoolctl import threadpool_limits

from minidist import cli, data, memory, nn, sim, train, workloads
from minidist import functions as F
from minidist.models.gpt import GPT, Block, GPTConfig
from minidist.parallel.data_parallel.train import train_ddp
from minidist.tensor import Tensor

TARGET = 2.0  # nats per character
QUICK = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--steps", "20",
         "--eval-every", "10"]


def default_config(quick: bool, extra=()) -> train.TrainConfig:
    """The command line's ``train --model gpt`` (or the quick variant), without a progress bar;
    ``extra``: more train flags (``--block-size 256 --batch-size 8``), given last."""
    return cli.train_config(cli.train_parser().parse_args(["--model", "gpt", "--no-progress",
                                                           *(QUICK if quick else []), *extra]))


# ----------------------------------------------------------------------------- (a) time to a loss


def time_to_target(config: train.TrainConfig, text: workloads.TextDataset) -> dict:
    """Train ``config`` in this process and read the history: the first evaluation at or below
    TARGET (its step and elapsed seconds), the final val loss and the mean time per step."""
    began = time.perf_counter()
    result = train.train_single(config, text)
    seconds = time.perf_counter() - began
    hit = next((row for row in result.history if row["val_loss"] <= TARGET), None)
    steps = sum(row["steps"] for row in result.history)
    return {"steps": config.steps, "final_val_loss": result.val_loss, "seconds": seconds,
            "ms_per_step": 1000 * sum(row["seconds"] for row in result.history) / steps,
            "target": TARGET, "reached_at_step": hit["step"] if hit else None,
            "seconds_to_target": hit["elapsed"] if hit else None}


def ddp_follows_single(config: train.TrainConfig, text: workloads.TextDataset, steps: int) -> dict:
    """``steps`` steps of the single process at batch B against ddp on 2 simulated ranks at B / 2
    each, --no-scale-lr: the largest difference of their evaluations' train and val losses."""
    single_config = dataclasses.replace(config, steps=steps, eval_every=steps // 2)
    single = train.train_single(single_config, text, report=True)
    ddp_config = dataclasses.replace(single_config, strategy="ddp", batch_size=config.batch_size // 2,
                                     scale_lr=False)
    ddp = sim.run(lambda comm: train_ddp(comm, ddp_config, text), 2)[0]
    gaps = [abs(a[key] - b[key]) for a, b in zip(single.history, ddp.history) for key in ("train_loss", "val_loss")]
    return {"steps": steps, "single_batch": config.batch_size, "ddp_batch_per_rank": config.batch_size // 2,
            "max_loss_difference": max(gaps), "within_1e-4": max(gaps) < 1e-4,
            "single_val_loss": single.history[-1]["val_loss"], "ddp_val_loss": ddp.history[-1]["val_loss"]}


# ----------------------------------------------------------------------------- (b) a step against torch


def engine_step(model: GPT, x, y, lr: float, weight_decay: float, clip: float):
    """The three phases of one engine step, as functions: forward and loss, backward, clip + AdamW."""
    from minidist import optim

    optimizer = optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    held = {}

    def forward():
        optimizer.zero_grad()
        held["loss"] = model(x, y)[1]
        return held["loss"].item()

    def backward():
        held.pop("loss").backward()

    def update():
        nn.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()

    return forward, backward, update


def tiled(phases, from_t):
    """The phases with scaled_dot_product_attention tiling from T >= ``from_t`` while they run
    (``functions.FLASH_MIN_SEQUENCE``): 1 tiles always, a huge number never."""
    def tile(phase):
        def run():
            saved, F.FLASH_MIN_SEQUENCE = F.FLASH_MIN_SEQUENCE, from_t
            try:
                return phase()
            finally:
                F.FLASH_MIN_SEQUENCE = saved
        return run

    return tuple(tile(phase) for phase in phases)


def torch_step(model: GPT, x, y, lr: float, weight_decay: float, clip: float):
    """The same model in PyTorch eager (nanoGPT's layout and names, ``F.scaled_dot_product_attention``),
    loaded from the engine's state dict; its three phases as functions, or None without torch."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(1)  # torch's own intra-op pool: one thread, as the engine's BLAS
    net = torch_gpt(torch, model.config)
    net.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in model.state_dict().items()})
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=weight_decay)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    held = {}

    def forward():
        optimizer.zero_grad(set_to_none=True)
        logits = net(xt)
        held["loss"] = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), yt.view(-1))
        return held["loss"].item()

    def backward():
        held.pop("loss").backward()

    def update():
        torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        optimizer.step()

    return forward, backward, update


def torch_gpt(torch, config: GPTConfig):
    """nanoGPT's GPT in a few lines of PyTorch (our own writing; the names match ``models.gpt``)."""
    nn_, F = torch.nn, torch.nn.functional
    c, heads = config.n_embd, config.n_head

    class Attention(nn_.Module):
        def __init__(self):
            super().__init__()
            self.c_attn, self.c_proj = nn_.Linear(c, 3 * c), nn_.Linear(c, c)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.c_attn(x).view(b, t, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
            return self.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c))

    class MLP(nn_.Module):
        def __init__(self):
            super().__init__()
            self.c_fc, self.gelu, self.c_proj = nn_.Linear(c, 4 * c), nn_.GELU(approximate="tanh"), nn_.Linear(4 * c, c)

        def forward(self, x):
            return self.c_proj(self.gelu(self.c_fc(x)))

    class Block_(nn_.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.attn, self.ln_2, self.mlp = nn_.LayerNorm(c), Attention(), nn_.LayerNorm(c), MLP()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class Net(nn_.Module):
        def __init__(self):
            super().__init__()
            self.transformer = nn_.ModuleDict(dict(
                wte=nn_.Embedding(config.vocab_size, c), wpe=nn_.Embedding(config.block_size, c),
                h=nn_.ModuleList(Block_() for _ in range(config.n_layer)), ln_f=nn_.LayerNorm(c)))
            self.lm_head = nn_.Linear(c, config.vocab_size, bias=False)
            self.lm_head.weight = self.transformer.wte.weight

        def forward(self, idx):
            t = idx.shape[1]
            x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(t))
            for block in self.transformer.h:
                x = block(x)
            return self.lm_head(self.transformer.ln_f(x))

    return Net()


def step_against_torch(config: train.TrainConfig, text: workloads.TextDataset, repeats: int) -> dict:
    """Median seconds of each phase and of the whole step, engine and torch, round-robin."""
    model = train.workload_for(config, text).model()
    x, y = data.TokenWindows(text.train, config.block_size, config.batch_size, seed=1).batch(0)
    args = (x, y, config.lr, config.weight_decay, config.grad_clip)
    contenders = {"minidist": engine_step(model, *args),  # as it is: the dispatch's rule
                  "md-dense": tiled(engine_step(train.workload_for(config, text).model(), *args), 2 ** 62),
                  "md-flash": tiled(engine_step(train.workload_for(config, text).model(), *args), 1)}
    twin = torch_step(model, *args)
    if twin is not None:
        contenders["torch"] = twin
    first = {name: phases[0]() for name, phases in contenders.items()}  # the same loss, or not the same work
    assert max(first.values()) - min(first.values()) < 1e-4, f"the models disagree: {first}"
    for phases in contenders.values():
        phases[1]()
        phases[2]()
    samples = {name: {p: [] for p in ("forward", "backward", "update", "step")} for name in contenders}
    for _ in range(repeats + 2):  # the first two warm up
        for name, phases in contenders.items():
            times = []
            for phase in phases:
                began = time.perf_counter()
                phase()
                times.append(time.perf_counter() - began)
            for key, value in zip(("forward", "backward", "update", "step"), [*times, sum(times)]):
                samples[name][key].append(value)
    medians = {name: {k: statistics.median(v[2:]) for k, v in s.items()} for name, s in samples.items()}
    figures = {"tokens": x.size, "median_seconds": medians}
    figures["ratio_flash_dense"] = {k: medians["md-flash"][k] / medians["md-dense"][k] for k in medians["minidist"]}
    if "torch" in medians:
        figures["ratio_minidist_torch"] = {k: medians["minidist"][k] / medians["torch"][k] for k in medians["torch"]}
        figures["ratio_flash_torch"] = {k: medians["md-flash"][k] / medians["torch"][k] for k in medians["torch"]}
    return figures


# ----------------------------------------------------------------------------- (c) activations per block


def block_activations(s: int, h: int, a: int, b: int) -> dict:
    """Bytes one Block keeps for backward on b sequences of s tokens (``memory.track``, by op)."""
    block = Block(GPTConfig(vocab_size=2, block_size=s, n_layer=1, n_head=a, n_embd=h), rng=np.random.default_rng(0),
                  dtype="float32", device=None)
    x = Tensor(np.random.default_rng(1).standard_normal((b, s, h)).astype(np.float32), requires_grad=True)
    with memory.track(block) as tracker:
        out = block(x)
        held = tracker.live_bytes, dict(tracker.live_by_op)
    del out
    return {"bytes": held[0], "by_op": held[1]}


def activation_terms(s: int, h: int, a: int, b: int) -> list[tuple[str, int, int, str]]:
    """Korthikanti et al.'s terms in float32 without dropout, beside what the engine keeps for
    each: (tensor, their bytes, the engine's bytes, why they differ)."""
    sbh, as2b = s * b * h * 4, a * s * s * b * 4
    return [
        ("LayerNorm inputs (ln_1, ln_2)", 2 * sbh, 2 * sbh + 2 * 2 * s * b * 4,
         "+ mean and 1/std of each row (2 floats per row and LayerNorm), which the paper leaves out"),
        ("c_attn input", sbh, sbh, ""),
        ("q, k", 2 * sbh, 2 * sbh, ""),
        ("softmax output (the weights)", as2b, as2b,
         "fused attention keeps the weights once; at p = 0 no dropout mask and no dropped copy"),
        ("v", sbh, sbh, ""),
        ("c_attn output before the head split", 0, 3 * sbh,
         "the Reshape's input: the engine's nodes hold their inputs, and splitting the heads copies"),
        ("heads side by side again (Transpose)", 0, sbh, "the same: the Transpose's input stays beside its copy"),
        ("c_proj input", sbh, sbh, ""),
        ("residual adds", 0, 2 * sbh, "each Add holds its two inputs; PyTorch's add saves nothing"),
        ("c_fc input", sbh, sbh, ""),
        ("GELU input", 4 * sbh, 8 * sbh, "GELU keeps Phi(x) next to x: its backward does not recompute the tanh"),
        ("second Linear input", 4 * sbh, 4 * sbh, ""),
        ("dropout masks (3)", 0, 0, "dropout p = 0: none (the paper counts 1 byte each: sbh + sbh + as^2b)"),
    ]


def activations(s: int, h: int, a: int, b: int) -> dict:
    measured = block_activations(s, h, a, b)
    terms = activation_terms(s, h, a, b)
    paper_16bit = s * b * h * (34 + 5 * a * s / h)
    return {"s": s, "h": h, "a": a, "b": b, "measured_bytes": measured["bytes"], "by_op": measured["by_op"],
            "korthikanti_16bit_bytes": paper_16bit,
            "korthikanti_fp32_no_dropout_bytes": 64 * s * b * h + 4 * a * s * s * b,
            "engine_model_bytes": sum(t[2] for t in terms), "terms": terms}


# ----------------------------------------------------------------------------- the run


def report(figures: dict) -> None:
    """Print the parts that were measured."""
    for key, part in (("time_to_target", report_time), ("step_against_torch", report_step),
                      ("activations", report_activations)):
        if key in figures:
            part(figures)


def report_time(figures: dict) -> None:
    a, follow = figures["time_to_target"], figures["ddp_follows_single"]
    reached = (f"{a['seconds_to_target']:.1f} s (step {a['reached_at_step']})" if a["reached_at_step"]
               else f"not reached in {a['steps']} steps")
    print(f"\n(a) val loss <= {TARGET}: {reached}; final val_loss {a['final_val_loss']:.4f} after {a['steps']} steps, "
          f"{a['seconds']:.1f} s in all, {a['ms_per_step']:.1f} ms per step")
    print(f"    ddp 2 ranks x batch {follow['ddp_batch_per_rank']} vs single batch {follow['single_batch']}, "
          f"{follow['steps']} steps, --no-scale-lr: largest loss difference {follow['max_loss_difference']:.2e} "
          f"({'<' if follow['within_1e-4'] else '>='} 1e-4)")


def report_step(figures: dict) -> None:
    b = figures["step_against_torch"]
    med = b["median_seconds"]
    print(f"(b) one step, {b['tokens']} tokens, float32, 1 BLAS thread: median seconds")
    print(f"    {'':9} {'forward':>9} {'backward':>9} {'update':>9} {'step':>9}")
    for name, phases in med.items():
        print(f"    {name:9} " + " ".join(f"{phases[k]:9.4f}" for k in ("forward", "backward", "update", "step")))
    for label, key in (("ratio", "ratio_minidist_torch"), ("flash/t", "ratio_flash_torch"),
                       ("flash/dns", "ratio_flash_dense")):
        if key in b:
            print(f"    {label:9} " + " ".join(f"{b[key][k]:9.2f}" for k in ("forward", "backward", "update", "step")))
    if "ratio_minidist_torch" not in b:
        print("    torch is not installed: no ratio against it")
    print(f"    (ratio: minidist / torch; flash/t: md-flash / torch; flash/dns: md-flash / md-dense; minidist "
          f"tiles from T >= {F.FLASH_MIN_SEQUENCE} (scaled_dot_product_attention's rule), md-flash always, "
          "md-dense never)")


def report_activations(figures: dict) -> None:
    c = figures["activations"]
    same = "equal to" if c["engine_model_bytes"] == c["measured_bytes"] else "NOT equal to"
    print(f"(c) one block, s={c['s']} b={c['b']} h={c['h']} a={c['a']}: measured {c['measured_bytes']:,} bytes, "
          f"{c['measured_bytes'] / c['korthikanti_fp32_no_dropout_bytes']:.3f} x Korthikanti's tensors in float32 "
          f"without dropout ({c['korthikanti_fp32_no_dropout_bytes']:,} = 64sbh + 4as^2b; their sbh(34 + 5as/h), "
          f"16-bit with dropout masks: {c['korthikanti_16bit_bytes']:,.0f}); the terms below add up to "
          f"{c['engine_model_bytes']:,}, {same} the measurement")
    print(f"    {'tensor':38} {'paper':>10} {'engine':>10}  why they differ")
    for tensor, theirs, ours, why in c["terms"]:
        print(f"    {tensor:38} {theirs:>10,} {ours:>10,}  {why}")
    print("    by op (measured): " + ", ".join(f"{op} {n:,}" for op, n in c["by_op"].items()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny GPT and a few steps (the smoke test)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per contender (default 20; quick 3)")
    parser.add_argument("--follow-steps", type=int, default=20, help="steps of the ddp-follows-single check")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("--parts", default="abc", help="which figures to measure, a subset of abc (default all)")
    parser.add_argument("--block-size", type=int, help="the GPT's context T instead of the default's")
    parser.add_argument("--batch-size", type=int, help="sequences per step instead of the default's")
    args = parser.parse_args(argv)
    if not args.parts or set(args.parts) - set("abc"):
        parser.error(f"--parts takes letters of abc, got {args.parts!r}")
    extra = [f"--{flag}={value}" for flag, value in (("block-size", args.block_size), ("batch-size", args.batch_size))
             if value is not None]
    config = default_config(args.quick, extra)
    text = workloads.load_text()
    figures = {"machine": platform.machine(), "numpy": np.__version__, "config": dataclasses.asdict(config)}
    if "a" in args.parts:
        figures["time_to_target"] = time_to_target(config, text)
        figures["ddp_follows_single"] = ddp_follows_single(config, text, args.follow_steps)
    if "b" in args.parts:
        with threadpool_limits(limits=1):
            figures["step_against_torch"] = step_against_torch(config, text,
                                                               args.repeats or (3 if args.quick else 20))
    if "c" in args.parts:
        figures["activations"] = activations(config.block_size, config.n_embd, config.n_head, config.batch_size)
    report(figures)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(figures, file, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
