"""``python -m minidist plan``: the layout planner (:mod:`minidist.planner`) on the command line."""
from __future__ import annotations

import argparse

from minidist import planner
from minidist.cli.values import fail, positive_float, positive_int


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
    return p


def plan_command(argv: list[str]) -> int:
    """``python -m minidist plan --model NAME --gpus N --gpu-memory GiB [--gpus-per-node G
    --global-batch B --seq-len S --top K --mfu F]``: prints a header (model, Psi, cluster), the
    best K layouts (memory per GPU by category in GiB, step time by term in seconds, MFU), then
    the rejected layouts counted by reason with one example each. Exit status 0; 1 when no
    layout fits; 2 for a usage error (an unknown model, GPUs that do not fill whole nodes, a
    sequence longer than the model's positions, --mfu above 1), naming the flag."""
    parser = plan_parser()
    args = parser.parse_args(argv)
    if args.model not in planner.MODELS:
        parser.error(f"--model: unknown model {args.model!r}; choose one of {', '.join(planner.MODELS)}")
    if args.mfu > 1:
        parser.error(f"--mfu must lie in (0, 1], got {args.mfu}")
    if args.gpus > args.gpus_per_node and args.gpus % args.gpus_per_node:
        parser.error(f"--gpus {args.gpus} does not fill whole nodes of --gpus-per-node {args.gpus_per_node}; "
                     f"use a multiple of {args.gpus_per_node}")
    model = planner.MODELS[args.model]
    seq_len = model.seq_len if args.seq_len is None else args.seq_len
    if model.learned_positions and seq_len > model.seq_len:
        parser.error(f"--seq-len {seq_len} exceeds {model.name}'s {model.seq_len} learned positions")
    cluster = planner.Cluster(args.gpus, args.gpus_per_node, int(args.gpu_memory * planner.GiB), mfu=args.mfu)
    result = planner.plan(model, cluster, args.global_batch, seq_len, top=args.top)
    print("\n".join(report_lines(result)))
    if not result.best:
        return fail("plan", f"no layout of {model.name} fits {args.gpus} GPU(s) of {args.gpu_memory:g} GiB; more GPUs, "
                            "more memory or a smaller --global-batch / --seq-len")
    return 0


COLUMNS = ("   dp   pp   tp   mb zero recompute  sp |  param   grad  optim  activ  total GiB |"
           " compute      tp      pp      dp  bubble    step s |  MFU")


def layout_line(prediction: planner.Prediction) -> str:
    """One row of the table under :data:`COLUMNS`."""
    lay, mem, time = prediction.layout, prediction.memory, prediction.time
    gib = "".join(f"{mem[k] / planner.GiB:7.1f}" for k in ("parameters", "gradients", "optimizer", "activations"))
    secs = "".join(f"{time[k]:8.3f}" for k in ("compute", "tp", "pp", "dp", "bubble"))
    v = f"/{lay.interleave}" if lay.interleave > 1 else ""
    return (f"{lay.dp:5d}{lay.pp:5d}{lay.tp:5d}{lay.micro_batch:5d}{lay.zero_stage:5d} {lay.recompute:<9}"
            f"{'yes' if lay.sequence_parallel else 'no':>4}{v} |{gib}{mem['total'] / planner.GiB:7.1f}     |{secs}"
            f"{time['total']:10.3f} | {time['mfu']:.1%}")


def report_lines(result: planner.Plan) -> list[str]:
    """The text ``plan`` prints for a :class:`planner.Plan`."""
    m, c = result.model, result.cluster
    nodes = max(1, c.gpus // c.gpus_per_node)
    lines = [f"model: {m.name}, Psi = {m.parameters / 1e9:.3f} B parameters ({m.layers} layers, hidden {m.hidden}, "
             f"{m.heads} heads, vocabulary {m.vocab}), sequence {result.seq_len}, global batch {result.global_batch}",
             f"cluster: {c.gpus} GPU{'s' * (c.gpus > 1)} ({nodes} node{'s' * (nodes > 1)} of "
             f"{min(c.gpus, c.gpus_per_node)}), "
             f"{c.gpu_memory / planner.GiB:g} GiB each, {c.peak_flops / 1e12:g} TFLOP/s peak at {c.mfu:g} of it; "
             f"NVLink {c.nvlink_bandwidth / 1e9:g} GB/s, network {c.network_bandwidth / 1e9:g} GB/s per GPU",
             f"{result.feasible} layouts fit; the best of each shape (dp pp tp mb), fastest first:" if result.best
             else "no layout fits",
             ]
    if result.best:
        lines += [COLUMNS] + [layout_line(p) for p in result.best]
    rejected = sum(count for count, _, _ in result.rejected.values())
    lines.append(f"rejected: {rejected}")
    for reason, (count, example, message) in sorted(result.rejected.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"  {count:6d}  {reason}: e.g. {example}: {message}")
    return lines
