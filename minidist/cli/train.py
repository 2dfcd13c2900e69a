"""``python -m minidist train``: the flags, the checks argparse cannot express, the
:class:`~minidist.train.TrainConfig` they make, and the run (or ``--replay-step``)."""
from __future__ import annotations

import argparse
import os

import numpy as np

from minidist import anomaly, backend, fault, launch, nn, replay, train
from minidist.cli.values import (
    fail,
    loss_scale,
    momentum,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
)
from minidist.parallel.data_parallel.comm_hooks import COMM_HOOKS
from minidist.parallel.data_parallel.train import train_ddp
from minidist.parallel.parameter_server import check_world
from minidist.parallel.parameter_server.train import train_ps
from minidist.parallel.pipeline.executor import PipelineError
from minidist.parallel.pipeline.train import check_pipeline, train_pipeline
from minidist.parallel.pipeline.train_pipedream import train_pipedream
from minidist.precision import PRECISIONS
from minidist.train import (
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

# ---------------------------------------------------------------------------------------
# train
# ---------------------------------------------------------------------------------------

# Flags whose default is None on the parser, so that giving one the chosen strategy would
# ignore is seen and refused; the defaults they stand for are TrainConfig's.
PS_FLAGS = {"--ps-mode": "ps_mode", "--num-servers": "num_servers", "--staleness": "staleness"}
PIPELINE_FLAGS = {"--schedule": "schedule", "--microbatches": "microbatches", "--dp": "dp",
                  "--stages-per-rank": "stages_per_rank", "--no-weight-stashing": "weight_stashing",
                  "--vertical-sync": "vertical_sync"}


def train_parser() -> argparse.ArgumentParser:
    """The ``train`` command's flags (the defaults reach >= 0.95 on digits in seconds)."""
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="python -m minidist train", description="Train an MLP with minidist.")
    p.add_argument("--strategy", choices=STRATEGIES, default=d.strategy,
                   help="how to train: single, ddp, ps (parameter servers), pipeline (default: single)")
    p.add_argument("--epochs", type=positive_int, default=d.epochs, help="passes over the training set (default: 20)")
    p.add_argument("--batch-size", type=positive_int, default=d.batch_size,
                   help="samples per step, per rank (default: 32)")
    p.add_argument("--lr", type=positive_float, default=None,
                   help=f"learning rate, > 0 (default: {d.lr:g}; {PIPELINE_LR:g} for --strategy pipeline, whose MLP "
                        "is deeper)")
    p.add_argument("--momentum", type=momentum, default=None,
                   help=f"SGD momentum in [0, 1) (default: {d.momentum:g}; {PIPEDREAM_MOMENTUM:g} for the pipedream "
                        "schedules, whose stale gradients add momentum of their own)")
    p.add_argument("--weight-decay", type=nonnegative_float, default=d.weight_decay,
                   help="L2 penalty, >= 0 (default: 0)")
    p.add_argument("--hidden", type=positive_int, nargs="+", default=None,
                   help=f"hidden layer sizes (default: {' '.join(map(str, d.hidden))}; for --strategy pipeline "
                        f"{' '.join(map(str, PIPELINE_HIDDEN))}, {len(PIPELINE_HIDDEN) + 1} Linear layers)")
    p.add_argument("--warmup-epochs", type=nonnegative_float, default=d.warmup_epochs,
                   help="ramp the lr up linearly over this many epochs (Goyal et al. 2017) (default: 0)")
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
                   help="pipeline: pipelines side by side (data x pipeline parallelism); must divide the number of "
                        f"ranks (default: {d.dp})")
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
    p.add_argument("--topk-ratio", type=positive_float, default=None,
                   help="ddp with --comm-hook topk: fraction of each bucket's entries sent, in (0, 1] "
                        "(default: 0.01)")
    p.add_argument("--timeout", type=positive_float, default=None,
                   help="ddp, ps and pipeline: seconds any wait for another rank may take before the run stops with "
                        "an error (default: 300)")
    p.add_argument("--seed", type=nonnegative_int, default=d.seed,
                   help="seed for data split, init and shuffling (default: 0)")
    p.add_argument("--dataset", choices=["digits", "mnist"], default=d.dataset, help="digits (bundled) or mnist")
    p.add_argument("--data-dir", help="with --dataset mnist: the folder with the four MNIST IDX files")
    p.add_argument("--device", choices=["cpu", "cuda"], default=d.device, help="where to compute (default: cpu)")
    p.add_argument("--precision", choices=PRECISIONS, default=d.precision,
                   help="single, ddp, pipeline: compute in fp16 or bf16 with float32 master weights (mixed "
                        "precision, Micikevicius et al. 2018) (default: fp32)")
    p.add_argument("--loss-scale", type=loss_scale, default=None, metavar="{dynamic,none,N}",
                   help="with --precision fp16/bf16: dynamic loss scaling, none, or a constant N (default: dynamic for "
                        "fp16, none for bf16, whose range is float32's)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
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
    return p


def train_config(args: argparse.Namespace):
    """The :class:`~minidist.train.TrainConfig` of parsed ``train`` flags. Raises ValueError
    (a usage error, naming the flag) for a flag the chosen strategy would ignore or a
    combination that cannot run."""
    strategy, d = args.strategy, TrainConfig()
    for only, flags in (("ps", PS_FLAGS), ("pipeline", PIPELINE_FLAGS)):
        for flag, name in flags.items():
            if strategy != only and getattr(args, name) is not None:
                raise ValueError(f"{flag} applies to --strategy {only} only, not to --strategy {strategy}")
    schedule = args.schedule or d.schedule
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
    dp = d.dp if args.dp is None else args.dp
    ps_mode = args.ps_mode or d.ps_mode
    if args.staleness is not None and ps_mode != "ssp":
        raise ValueError(f"--staleness applies to --ps-mode ssp only (the bound of stale synchronous parallel), "
                         f"not to --ps-mode {ps_mode}")
    one_batch = strategy == "single" or ps_mode == "async" or (strategy == "pipeline" and dp == 1)
    if args.scale_lr is not None and one_batch:
        where = {"single": "--strategy single has one worker",
                 "pipeline": "one pipeline (--dp 1) has one batch per step"}.get(
            strategy, "--ps-mode async applies each worker's gradient with its own batch")
        raise ValueError(f"--scale-lr/--no-scale-lr apply to ddp, ps sync/ssp and pipeline with --dp > 1 only "
                         f"({where}: nothing to scale)")
    if args.comm_hook is not None and strategy != "ddp":
        raise ValueError(f"--comm-hook applies to --strategy ddp only (the hooks compress DDP's gradient buckets), "
                         f"not to --strategy {strategy}")
    if args.topk_ratio is not None and args.comm_hook != "topk":
        raise ValueError("--topk-ratio applies to --comm-hook topk only")
    if args.topk_ratio is not None and not args.topk_ratio <= 1:
        raise ValueError(f"--topk-ratio must be in (0, 1] (a fraction of each bucket), got {args.topk_ratio:g}")
    if args.timeout is not None and strategy == "single":
        raise ValueError("--timeout applies to --strategy ddp, ps and pipeline only (a single process waits for "
                         "no one)")
    if args.dataset == "mnist" and not args.data_dir:
        raise ValueError("--dataset mnist needs --data-dir DIR (the folder with the MNIST IDX files)")
    if args.data_dir is not None and args.dataset != "mnist":
        raise ValueError("--data-dir applies to --dataset mnist only (digits are bundled)")
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
    if args.save_model is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.save_model))):
        raise ValueError(f"--save-model {args.save_model}: the folder {os.path.dirname(args.save_model)!r} does not "
                         "exist; create it first")
    if args.checkpoint_dir is not None and os.path.exists(args.checkpoint_dir) and not os.path.isdir(
            args.checkpoint_dir):
        raise ValueError(f"--checkpoint-dir {args.checkpoint_dir} is a file, not a folder")
    if args.precision != "fp32" and (strategy == "ps" or (strategy == "pipeline" and schedule in PIPEDREAM_SCHEDULES)):
        where = "--strategy ps" if strategy == "ps" else f"--schedule {schedule}"
        raise ValueError(f"--precision {args.precision} applies to --strategy single, ddp and pipeline (not the "
                         f"pipedream schedules) only, not to {where}")
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
    return TrainConfig(
        strategy=strategy, epochs=args.epochs, batch_size=args.batch_size,
        momentum=args.momentum if args.momentum is not None else (
            PIPEDREAM_MOMENTUM if strategy == "pipeline" and schedule in PIPEDREAM_SCHEDULES else d.momentum),
        weight_stashing=args.weight_stashing is not False, vertical_sync=bool(args.vertical_sync),
        lr=args.lr if args.lr is not None else (PIPELINE_LR if strategy == "pipeline" else d.lr),
        weight_decay=args.weight_decay, seed=args.seed, scale_lr=args.scale_lr,
        hidden=tuple(args.hidden) if args.hidden else (PIPELINE_HIDDEN if strategy == "pipeline" else d.hidden),
        warmup_epochs=args.warmup_epochs, ps_mode=ps_mode,
        num_servers=d.num_servers if args.num_servers is None else args.num_servers,
        staleness=d.staleness if args.staleness is None else args.staleness,
        dataset=args.dataset, data_dir=args.data_dir, device=args.device, progress=not args.no_progress,
        precision=args.precision, loss_scale=args.loss_scale,
        timeout=d.timeout if args.timeout is None else args.timeout, schedule=schedule,
        microbatches=d.microbatches if args.microbatches is None else args.microbatches, dp=dp,
        stages_per_rank=d.stages_per_rank if args.stages_per_rank is None else args.stages_per_rank,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every or d.checkpoint_every,
        resume=args.resume, save_model=args.save_model, stop_after_steps=args.stop_after_steps,
        comm_hook=args.comm_hook or d.comm_hook,
        topk_ratio=d.topk_ratio if args.topk_ratio is None else args.topk_ratio,
        kill_at_step=args.kill_at_step, kill_rank=args.kill_rank or 0, replay_step=args.replay_step)


def _check_replay(args: argparse.Namespace, strategy: str) -> None:
    """Raise ValueError (a usage error) for ``--replay-step`` with flags a replay cannot honour."""
    if strategy not in ("single", "ddp"):
        raise ValueError(f"--replay-step applies to --strategy single and ddp only, not to --strategy {strategy}")
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
# --schedule never flushes (PIPEDREAM_SCHEDULES) is trained by the "pipedream" row.
DRIVERS = {
    "single": (_train_single, None),
    "ddp": (train_ddp, None),
    "ps": (train_ps, _check_ps),
    "pipeline": (train_pipeline, check_pipeline),
    "pipedream": (train_pipedream, check_pipeline),
}


def driver_name(config: TrainConfig) -> str:
    """The row of :data:`DRIVERS` that trains ``config``: its strategy, or "pipedream" for a
    pipeline with a schedule that never flushes."""
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



def train_command(argv: list[str]) -> int:
    """``python -m minidist train [flags]`` (**contract**): per-epoch lines, the strategy's
    figures (``key=value``), last ``final test_accuracy=0.xxxx`` on the reporting rank.
    Exit status 0; 1 when the run fails (missing MNIST files, no mpi4py, the loss became NaN
    or infinite, a rank waited past ``--timeout``, a checkpoint that cannot be resumed); 2 for
    a usage error. The hidden ``--stop-after-steps K`` (tests) stops after global step K, as
    if the run were killed there, prints one line and exits 0."""
    parser = train_parser()
    args = parser.parse_args(argv)
    try:
        config = train_config(args)
    except ValueError as problem:
        parser.error(str(problem))
    comm = None
    if config.strategy != "single":
        try:
            comm = launch.require_mpi4py(f"--strategy {config.strategy}", load=True).COMM_WORLD
        except launch.LaunchError as error:
            return fail("train", f"{error} (or `make install`), then run `mpiexec -n 4 python -m mpi4py -m minidist "
                                  f"train --strategy {config.strategy}`")
    size = 1 if comm is None else comm.Get_size()
    if comm is not None:
        launch.limit_blas_threads(comm)  # N ranks on a node share its cores (unless OMP_NUM_THREADS says otherwise)
    if config.kill_at_step is not None and config.kill_rank >= size:
        parser.error(f"--kill-rank {config.kill_rank} names no rank of this run of {size}; use 0..{size - 1}")
    try:
        check_layout(config, size)
    except ValueError as problem:
        parser.error(str(problem))
    try:
        dataset = train.load_dataset(config)
    except (OSError, ValueError) as error:  # a missing, corrupt or inconsistent file: named in the message
        parser.error(str(error))
    np.random.seed(config.seed)  # nothing should use the global generator; this makes sure
    nn.manual_seed(config.seed)
    if config.replay_step is not None:
        return _replay(config, dataset, comm)
    try:
        # A diverging run overflows before its loss turns NaN; fit stops it with a clear error,
        # so NumPy's overflow warnings (file and line of a matmul) would only be noise.
        with np.errstate(over="ignore", invalid="ignore"):
            result = run_driver(config, dataset, comm)
    except train.NonFiniteLossError as error:
        return fail("train", f"{error}; try a smaller --lr (now {config.lr:g})")
    except fault.TrainingStopped as stopped:
        if comm is None or comm.Get_rank() == 0:
            print(stopped)
        return 0
    except fault.CheckpointError as error:
        return fail("train", str(error))
    except TimeoutError as error:
        return fail("train", f"{error} (--timeout is {config.timeout:g} s)")
    except PipelineError as error:  # a pipeline stage that heard nothing from its neighbour in time
        return fail("train", f"{error} (--timeout is {config.timeout:g} s)")
    if result is None:  # a rank that is not the reporter (under mpiexec)
        return 0
    for key, value in result.figures.items():
        print(f"{key}={value}")
    print(f"final test_accuracy={result.test_accuracy:.4f}")
    return 0


def _replay(config, dataset, comm) -> int:
    """``train --replay-step K``: :func:`minidist.replay.replay`, its report printed on rank 0.
    Exit status 0; 1 (one ``error:`` line) when an op made a NaN or an infinity (named), the
    step lies past the run's end, or a checkpoint does not fit the flags."""
    try:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # detect_anomaly names the op instead
            report = replay.replay(config, lambda run, **kw: run_driver(run, dataset, comm, **kw), comm)
    except anomaly.AnomalyError as error:
        return fail("train", f"replay of step {config.replay_step}: {error}")
    except (replay.ReplayError, fault.CheckpointError, train.NonFiniteLossError) as error:
        return fail("train", str(error))
    except TimeoutError as error:
        return fail("train", f"{error} (--timeout is {config.timeout:g} s)")
    if comm is None or comm.Get_rank() == 0:
        print(report.format())
    return 0
