"""``--strategy ddp`` declares itself: its flags (what each gradient bucket sends, and how the
buckets are all-reduced), the rules between them, and what its runs can do (replay a step, resume
on another number of ranks). ``ddp --zero`` is ZeRO-1's variant (``minidist.parallel.zero.strategy``)."""
from __future__ import annotations

from minidist.parallel.data_parallel.comm_hooks import COMM_HOOKS
from minidist.parallel.data_parallel.ddp import DDP_ALGORITHMS
from minidist.parallel.data_parallel.train import train_ddp
from minidist.resharding import consolidate
from minidist.strategy import Flag, Strategy

COMM_HOOK = Flag("--comm-hook", "comm_hook", dict(
    choices=COMM_HOOKS, help="ddp: what each gradient bucket sends: none (fp32 all-reduce), fp16 or bf16 (half the "
                             "bytes), int8 (all-gather of int8 + scale) or topk (the largest entries), the last two "
                             "with error feedback (default: none)"),
    why=" (the hooks compress DDP's gradient buckets)")
ALL_REDUCE = Flag("--all-reduce", "all_reduce", dict(
    choices=DDP_ALGORITHMS, help="ddp: the gradient buckets' all-reduce; hierarchical, torus and multi_ring run over "
                                 "the nodes (the machines, or fake nodes of MINIDIST_RANKS_PER_NODE ranks) (default: "
                                 "auto, by size)"),
    why=" (the all-reduce of its gradient buckets)")
TOPK_RATIO = Flag("--topk-ratio", "topk_ratio", dict(
    type="positive_float", help="ddp with --comm-hook topk: fraction of each bucket's entries sent, in (0, 1] "
                                "(default: 0.01)"))


def check_flags(config, given: set) -> None:
    """Raise ValueError for ddp's flags that do not go together: a comm hook or an all-reduce
    algorithm with ``--zero`` (ZeRO-1 reduce-scatters the gradients itself), an all-reduce
    algorithm with a hook that replaces the all-reduce, a top-k ratio without the top-k hook or
    past 1."""
    if config.zero and "comm_hook" in given:
        raise ValueError("--comm-hook does not apply with --zero: ZeRO-1 reduce-scatters the gradients itself, and "
                         "DDP's all-reduce, which the hooks compress, is skipped")
    if "all_reduce" in given and (config.zero or config.comm_hook in ("int8", "topk")):
        why = ("ZeRO-1 reduce-scatters the gradients and all-gathers the parameters instead" if config.zero else
               "the hook replaces it with an all-gather of the compressed buckets (fp16 and bf16 keep it)")
        flag = "--zero" if config.zero else f"--comm-hook {config.comm_hook}"
        raise ValueError(f"--all-reduce does not apply with {flag}: it chooses DDP's all-reduce, and {why}")
    if "topk_ratio" in given and config.comm_hook != "topk":
        raise ValueError("--topk-ratio applies to --comm-hook topk only")
    if "topk_ratio" in given and not config.topk_ratio <= 1:
        raise ValueError(f"--topk-ratio must be in (0, 1] (a fraction of each bucket), got {config.topk_ratio:g}")


STRATEGY = Strategy(
    name="ddp", driver=train_ddp, label="ddp (also --zero)", elastic_label="ddp",
    summary="ddp (--zero: ZeRO-1)",
    flags=(COMM_HOOK, ALL_REDUCE, TOPK_RATIO), check_flags=check_flags,
    global_batch=True, replay=True, elastic=lambda config: True, consolidate=consolidate)
