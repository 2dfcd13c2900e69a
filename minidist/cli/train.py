"""``python -m minidist train``: the run (or ``--replay-step``) of the flags that
``minidist.cli.train_flags`` checks and turns into a :class:`~minidist.train.TrainConfig`: start-up
(checked and agreed on by every rank), the strategy's driver, the result. The driver, its layout
check and whether it needs MPI are read off the strategy's record (``minidist.parallel.registry``)."""
from __future__ import annotations

import argparse
import contextlib
import io
import sys
from dataclasses import dataclass

import numpy as np

from minidist import anomaly, fault, launch, nn, node_layout, replay, strategy, train
from minidist.checkpoint_io import CheckpointError, CheckpointMismatchError
from minidist.cli.train_flags import (  # noqa: F401  (the flags' names, as they were imported from here)
    MODEL_DATASETS,
    MODEL_FLAGS,
    PROG,
    check_save_model,
    train_config,
    train_parser,
)
from minidist.cli.values import fail, positive_float
from minidist.p2p import CollectiveError, agree, get_timeout
from minidist.parallel.pipeline.executor import PipelineError
from minidist.train import TrainConfig

# ---------------------------------------------------------------------------------------
# The one table from a strategy to its driver
# ---------------------------------------------------------------------------------------


def drivers() -> dict:
    """{record name: (driver, layout check or None)} of every registered strategy and variant: a
    view of the registry (``minidist.strategy``) in the shape of the table this file had."""
    return {record.name: (record.driver, record.check) for record in strategy.all_records()}


DRIVERS = drivers()  # filled when minidist is imported: the registry registers every wing first


def driver_name(config: TrainConfig) -> str:
    """The record that trains ``config`` (``strategy.resolve``): its strategy, "pipedream" for a
    pipeline with a schedule that never flushes, or "zero" for ddp with ``config.zero``."""
    return strategy.resolve(config).name


def check_layout(config: TrainConfig, world_size: int) -> None:
    """Raise ValueError (naming the fix) when ``config``'s strategy cannot run on
    ``world_size`` ranks (servers that leave no worker, a pipeline with more stages than
    layers, ...); nothing for a layout every world size can run."""
    check = strategy.resolve(config).check
    if check is not None:
        check(world_size, config)


def run_driver(config: TrainConfig, dataset, comm, **kwargs):
    """Train ``config`` with its record's driver over ``comm`` (None for a one-process
    strategy); ``kwargs`` go to the driver (``checkpointer_class=``: single and ddp). Returns its
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
        return not strategy.get(config.strategy).one_process
    named = _flag_value(argv, "--strategy", TrainConfig().strategy)
    return world is not None and world[1] > 1 and not (named in strategy.names() and strategy.get(named).one_process)


def _start_alone(config: TrainConfig, parser: argparse.ArgumentParser) -> int:
    """A one-process strategy (single): the checks of start-up, then the run, in one process."""
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
    replicas = strategy.get(config.strategy).replicas(config, size)  # the ranks splitting G
    try:
        check_layout(config, size)
        if size > 1:  # MINIDIST_RANKS_PER_NODE, when set, must cut the job's ranks into nodes
            node_layout.check_environment(size)
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
    except CollectiveError as error:  # the ranks agreed on a problem (nodes of different sizes, ...)
        return fail("train", str(error))
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
