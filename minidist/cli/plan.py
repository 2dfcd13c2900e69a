"""``python -m minidist plan``: the layout planner (:mod:`minidist.planner`) on the command line."""
from __future__ import annotations

import argparse

from minidist import planner
from minidist.cli.values import fail, positive_float, positive_int

HEADROOM = 0.1  # of each GPU's memory, kept free
GPU_MEMORY = (0.001, 1e6)  # GiB per GPU the planner takes: a MiB to a million GiB
MAX_GPUS = 10**12  # the divisors come from sqrt(N) trials: 10**6 of them at most


def plan_parser() -> argparse.ArgumentParser:
    """The ``plan`` command's flags."""
    p = argparse.ArgumentParser(
        prog="python -m minidist plan",
        description="Rank the dp x pp x tp layouts (micro-batch, ZeRO stage, recomputation, sequence parallelism) of a "
                    "transformer on a cluster by predicted step time, with memory per GPU by category, and say why the "
                    "others fail. Closed forms only (minidist.planner): nothing runs.")
    p.add_argument("--model", required=True, metavar="NAME", help=f"a preset: {', '.join(planner.MODELS)}")
    p.add_argument("--gpus", required=True, type=positive_int, metavar="N", help="GPUs in all")
    p.add_argument("--gpu-memory", required=True, type=positive_float, metavar="GiB", help="memory per GPU in GiB")
    p.add_argument("--gpus-per-node", type=positive_int, default=8, metavar="G",
                   help="GPUs per node, joined by NVLink (default: 8)")
    p.add_argument("--global-batch", type=positive_int, default=512, metavar="B",
                   help="sequences per step (default: 512)")
    p.add_argument("--seq-len", type=positive_int, default=None, metavar="S",
                   help="tokens per sequence (default: the model's)")
    p.add_argument("--top", type=positive_int, default=5, metavar="K", help="layouts to show (default: 5)")
    p.add_argument("--mfu", type=positive_float, default=0.5, metavar="F",
                   help="fraction of the 312 TFLOP/s peak sustained on the FLOPs run, in (0, 1] (default: 0.5)")
    p.add_argument("--headroom", type=float, default=HEADROOM, metavar="F",
                   help="fraction of each GPU's memory kept free for what the formulas leave out (fp32 gradient "
                        f"accumulation, communication buffers, fragmentation), in [0, 1) (default: {HEADROOM:g})")
    p.add_argument("--zero", type=int, nargs="+", choices=(0, 1, 2, 3), default=None, metavar="STAGE",
                   help="the ZeRO stages to consider, from 0 1 2 3 (default: all)")
    p.add_argument("--recompute", nargs="+", choices=planner.RECOMPUTE, default=None, metavar="MODE",
                   help=f"the recomputation modes to consider, from {' '.join(planner.RECOMPUTE)} (default: all)")
    p.add_argument("--no-sequence-parallel", action="store_true",
                   help="leave Megatron's sequence parallelism out (SC21's runs had none: with --zero 0 and "
                        "--recompute full, the paper's features)")
    p.add_argument("--ep", type=positive_int, nargs="+", default=None, metavar="E",
                   help="for a model with experts (deepseek-v3, mixtral-8x7b): the expert-parallel degrees to try, "
                        "each dividing dp (default: every divisor of dp up to the number of experts)")
    return p


def plan_command(argv: list[str]) -> int:
    """``python -m minidist plan --model NAME --gpus N --gpu-memory GiB [--gpus-per-node G
    --global-batch B --seq-len S --top K --mfu F]``: prints a header (model, Psi, cluster), the
    best K layouts (memory per GPU by category in GiB, step time by term in seconds, MFU), then
    the rejected layouts counted by reason with one example each. Exit status 0; 1 when no
    layout fits; 2 for a usage error (an unknown model, GPUs that do not fill whole nodes, a
    sequence longer than the model's positions, --mfu above 1, --ep for a dense model), naming the
    flag. A model with experts gets an ep column and the all-to-alls' seconds ("a2a")."""
    parser = plan_parser()
    args = parser.parse_args(argv)
    if args.model not in planner.MODELS:
        parser.error(f"--model: unknown model {args.model!r}; choose one of {', '.join(planner.MODELS)}")
    if args.ep is not None and not planner.MODELS[args.model].n_expert:
        parser.error(f"--ep: {args.model} is dense (no experts); --ep is for deepseek-v3 or mixtral-8x7b")
    if args.mfu > 1:
        parser.error(f"--mfu must lie in (0, 1], got {args.mfu}")
    if not GPU_MEMORY[0] <= args.gpu_memory <= GPU_MEMORY[1]:
        given = _given(argv, "--gpu-memory") or f"{args.gpu_memory:g}"
        parser.error(f"--gpu-memory {given}: give the GiB per GPU, from {GPU_MEMORY[0]:g} to {GPU_MEMORY[1]:.0f}")
    if args.gpus > MAX_GPUS:
        parser.error(f"--gpus {args.gpus}: the planner searches clusters of up to 10**12 GPUs (the largest run today "
                     "hold about 10**5)")
    if not 0 <= args.headroom < 1:
        parser.error(f"--headroom must lie in [0, 1), got {args.headroom:g}")
    if args.gpus > args.gpus_per_node and args.gpus % args.gpus_per_node:
        parser.error(f"--gpus {args.gpus} does not fill whole nodes of --gpus-per-node {args.gpus_per_node}; "
                     f"use a multiple of {args.gpus_per_node}")
    model = planner.MODELS[args.model]
    seq_len = model.seq_len if args.seq_len is None else args.seq_len
    if model.learned_positions and seq_len > model.seq_len:
        parser.error(f"--seq-len {seq_len} exceeds {model.name}'s {model.seq_len} learned positions")
    cluster = planner.Cluster(args.gpus, args.gpus_per_node, int(args.gpu_memory * planner.GiB), mfu=args.mfu)
    options = {"zero_stages": tuple(args.zero or (0, 1, 2, 3)), "recompute": tuple(args.recompute or planner.RECOMPUTE),
               "sequence_parallel": (False,) if args.no_sequence_parallel else (False, True)}
    if args.ep is not None:
        options["expert_parallel"] = tuple(args.ep)
    result = planner.plan(model, cluster, args.global_batch, seq_len, top=args.top, headroom=args.headroom, **options)
    print("\n".join(report_lines(result, args.headroom)))
    if not result.best:
        return fail("plan", f"no layout of {model.name} fits {args.gpus} GPU(s) of {args.gpu_memory:g} GiB; more GPUs, "
                            "more memory or a smaller --global-batch / --seq-len")
    return 0


def _given(argv: list[str], flag: str) -> str | None:
    """The text given for ``flag`` in ``argv`` (``--flag V``, ``--flag=V``, or an abbreviation
    argparse takes), or None."""
    for i, arg in enumerate(argv):
        name, _, value = arg.partition("=")
        if len(name) > 2 and flag.startswith(name):
            return value if value else (argv[i + 1] if i + 1 < len(argv) else None)
    return None


COLUMNS = ("   dp   pp   tp   mb zero recompute  sp |  param   grad  optim  activ  total GiB |"
           " compute      tp      pp      dp  bubble    step s |  MFU")


MOE_COLUMNS = ("   dp   pp   tp   ep   mb zero recompute  sp |  param   grad  optim  activ  total GiB |"
               " compute      tp      pp      dp     a2a  bubble    step s |  MFU")


def moe_layout_line(prediction: planner.Prediction) -> str:
    """One row of the table under :data:`MOE_COLUMNS` (a model with experts)."""
    lay, mem, time = prediction.layout, prediction.memory, prediction.time
    gib = "".join(f"{mem[k] / planner.GiB:7.1f}" for k in ("parameters", "gradients", "optimizer", "activations"))
    secs = "".join(f"{time[k]:8.3f}" for k in ("compute", "tp", "pp", "dp", "ep", "bubble"))
    return (f"{lay.dp:5d}{lay.pp:5d}{lay.tp:5d}{lay.ep:5d}{lay.micro_batch:5d}{lay.zero_stage:5d} {lay.recompute:<9}"
            f"{'yes' if lay.sequence_parallel else 'no':>4} |{gib}{mem['total'] / planner.GiB:7.1f}     |{secs}"
            f"{time['total']:10.3f} | {time['mfu']:.1%}")


def layout_line(prediction: planner.Prediction) -> str:
    """One row of the table under :data:`COLUMNS` (:func:`moe_layout_line` for a model with experts)."""
    if "ep" in prediction.time:
        return moe_layout_line(prediction)
    lay, mem, time = prediction.layout, prediction.memory, prediction.time
    gib = "".join(f"{mem[k] / planner.GiB:7.1f}" for k in ("parameters", "gradients", "optimizer", "activations"))
    secs = "".join(f"{time[k]:8.3f}" for k in ("compute", "tp", "pp", "dp", "bubble"))
    v = f"/{lay.interleave}" if lay.interleave > 1 else ""
    return (f"{lay.dp:5d}{lay.pp:5d}{lay.tp:5d}{lay.micro_batch:5d}{lay.zero_stage:5d} {lay.recompute:<9}"
            f"{'yes' if lay.sequence_parallel else 'no':>4}{v} |{gib}{mem['total'] / planner.GiB:7.1f}     |{secs}"
            f"{time['total']:10.3f} | {time['mfu']:.1%}")


def report_lines(result: planner.Plan, headroom: float = 0.0) -> list[str]:
    """The text ``plan`` prints for a :class:`planner.Plan` found with ``headroom``: the header,
    the rejections, the table, and last the recommendation (the fastest layout)."""
    m, c = result.model, result.cluster
    nodes = max(1, c.gpus // c.gpus_per_node)
    usable = c.gpu_memory * (1 - headroom) / planner.GiB
    kept = f", {usable:.0f} usable (--headroom {headroom:g} kept free)" if headroom else ""
    lines = [f"model: {m.name}, Psi = {m.parameters / 1e9:.3f} B parameters ({m.layers} layers, hidden {m.hidden}, "
             f"{m.heads} head{'s' * (m.heads > 1)}, vocabulary {m.vocab}), sequence {result.seq_len}, global batch "
             f"{result.global_batch}",
             *([f"experts: {m.n_expert} routed + {m.n_shared_expert} shared of width {m.expert_width}, top-{m.top_k}, "
                f"in {m.layers - m.dense_layers} of the {m.layers} layers; {m.active_parameters / 1e9:.3f} B active "
                "parameters per token"] if m.n_expert else []),
             f"cluster: {c.gpus} GPU{'s' * (c.gpus > 1)} ({nodes} node{'s' * (nodes > 1)} of "
             f"{min(c.gpus, c.gpus_per_node)}), "
             f"{c.gpu_memory / planner.GiB:g} GiB each{kept}, {c.peak_flops / 1e12:g} TFLOP/s peak at {c.mfu:g} of "
             f"it; NVLink {c.nvlink_bandwidth / 1e9:g} GB/s, network {c.network_bandwidth / 1e9:g} GB/s per GPU"]
    rejected = sum(count for count, _, _ in result.rejected.values())
    lines.append(f"rejected: {rejected}")
    for reason, (count, example, message) in sorted(result.rejected.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"  {count:6d}  {reason}: e.g. {example}: {message}")
    if not result.best:
        return [*lines, "no layout fits"]
    shape, columns = ("dp pp tp ep mb", MOE_COLUMNS) if m.n_expert else ("dp pp tp mb", COLUMNS)
    lines += [f"{result.feasible} layouts fit; the best of each shape ({shape}), fastest first:", columns]
    lines += [layout_line(p) for p in result.best]
    best = result.best[0]
    lines.append(f"best: {best.layout} -> {best.memory['total'] / planner.GiB:.1f} GiB of the {usable:.0f} usable, "
                 f"{best.time['total']:.2f} s per step, MFU {best.time['mfu']:.1%}")
    return lines
