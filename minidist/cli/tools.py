"""The other engine commands: ``evaluate`` (data-parallel inference), ``generate`` (text from a
trained GPT), ``launch`` (the restart supervisor) and ``doctor``. The course's, ``check NN`` and
``exercises``, are in :mod:`minidist.cli.course`."""
from __future__ import annotations

import argparse
import contextlib
import io
import sys

import numpy as np

from minidist import backend, launch, nn, strategy, train, workloads
from minidist.checkpoint_io import CheckpointError
from minidist.cli.train import check_layout, train_config, train_parser
from minidist.cli.values import fail, nonnegative_int, positive_float, positive_int
from minidist.collectives import broadcast, chunk_bounds
from minidist.p2p import get_timeout
from minidist.parallel.data_parallel.inference import evaluate, mlp_sizes_from_state

# ---------------------------------------------------------------------------------------
# evaluate
# ---------------------------------------------------------------------------------------


def evaluate_parser() -> argparse.ArgumentParser:
    """The ``evaluate`` command's flags."""
    p = argparse.ArgumentParser(
        prog="python -m minidist evaluate",
        description="Data-parallel evaluation on the test set: each rank scores its shard, one final all-gather. "
                    "Run under `mpiexec -n N python -m mpi4py -m minidist evaluate`.")
    p.add_argument("--checkpoint", metavar="PATH",
                   help="an .npz of a model's state_dict (np.savez(PATH, **model.state_dict())); the layer sizes "
                        "are read from it. Without it, rank 0 first trains the default MLP single-process")
    p.add_argument("--save", metavar="PATH", help="rank 0 saves the evaluated model's state_dict to PATH (.npz)")
    p.add_argument("--epochs", type=positive_int, default=None,
                   help="without --checkpoint: epochs of the single-process training (default: 10)")
    p.add_argument("--hidden", type=positive_int, nargs="+", default=None,
                   help="without --checkpoint: hidden layer sizes (default: 128)")
    p.add_argument("--batch-size", type=positive_int, default=1024, help="evaluation batch per rank (default: 1024)")
    p.add_argument("--seed", type=nonnegative_int, default=0,
                   help="seed for the data split, init and shuffling (default: 0)")
    p.add_argument("--dataset", choices=["digits", "mnist"], default="digits", help="digits (bundled) or mnist")
    p.add_argument("--data-dir", help="with --dataset mnist: the folder with the four MNIST IDX files")
    return p


def evaluate_command(argv: list[str]) -> int:
    """``python -m minidist evaluate``: every rank loads the dataset (and ``--checkpoint``),
    or rank 0 trains the default MLP quietly; rank 0's weights are broadcast, each rank
    scores its shard (``parallel.inference.evaluate``), one all-gather combines the counts.
    Rank 0 prints ranks, shard sizes, the single-process accuracy, whether the two agree,
    and last ``test_accuracy=0.xxxx``. Exit status 0; 1 when a file is missing or
    unreadable, mpi4py is missing, a rank does not answer in time or the results disagree;
    2 for usage errors (bad flags, a checkpoint that does not fit the dataset), printed once
    under mpiexec (by rank 0). The end is :func:`minidist.launch.finish` (a bounded barrier)."""
    parser = evaluate_parser()
    world = launch.world_from_env()
    with _silent_unless(world is None or world[0] == 0):  # a usage error: printed by rank 0 only
        args = parser.parse_args(argv)
        if args.dataset == "mnist" and not args.data_dir:
            parser.error("--dataset mnist needs --data-dir DIR (the folder with the MNIST IDX files)")
        if args.data_dir is not None and args.dataset != "mnist":
            parser.error("--data-dir applies to --dataset mnist only (digits are bundled)")
        for flag, value in (("--epochs", args.epochs), ("--hidden", args.hidden)):
            if args.checkpoint and value is not None:
                parser.error(f"{flag} applies only without --checkpoint (it shapes the model rank 0 trains)")
    try:
        comm = launch.require_mpi4py("evaluate", load=True).COMM_WORLD
    except launch.LaunchError as error:
        return fail("evaluate", str(error))
    try:
        status = _evaluate(comm, args, parser)
    except TimeoutError as error:  # a rank that did not answer within the collectives' deadline
        status = fail("evaluate", str(error))
    return launch.finish(comm, status, get_timeout(), command="evaluate")


def _silent_unless(prints: bool):
    """A context in which stdout and stderr go nowhere, unless ``prints``."""
    if prints:
        return contextlib.nullcontext()
    sink = io.StringIO()
    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stdout(sink))
    stack.enter_context(contextlib.redirect_stderr(sink))
    return stack


def _evaluate(comm, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The body of ``evaluate`` on one rank; its exit status."""
    rank, size = comm.Get_rank(), comm.Get_size()
    launch.limit_blas_threads(comm)
    config = train.TrainConfig(epochs=args.epochs or 10, hidden=tuple(args.hidden or (128,)), seed=args.seed,
                               dataset=args.dataset, data_dir=args.data_dir, progress=False)
    try:
        dataset = train.load_dataset(config)
        state = dict(np.load(args.checkpoint)) if args.checkpoint else None
    except (OSError, ValueError) as error:  # every rank reads the same files: all fail alike
        return fail("evaluate", str(error))
    if state is not None:
        model, problem = _model_of(state, args, dataset)
        if problem is not None:  # the same on every rank (the same file): printed once
            if rank == 0:
                parser.print_usage(sys.stderr)
                print(f"{parser.prog}: error: {problem}", file=sys.stderr, flush=True)
            return 2
    elif rank == 0:
        model = train.train_single(config, dataset, report=False).model
    else:
        model = train.build_model(config, dataset)
    for p in model.parameters():  # rank 0's weights everywhere
        p.data[...] = broadcast(comm, p.data, root=0)
    accuracy = evaluate(model, dataset.X_test, dataset.y_test, comm, batch_size=args.batch_size)
    if rank != 0:
        return 0
    if args.save:
        np.savez(args.save, **model.state_dict())
    single = train.accuracy(model, dataset.X_test, dataset.y_test)
    shards = [stop - start for start, stop in chunk_bounds(len(dataset.X_test), size)]
    print(f"ranks={size}")
    print(f"shard_sizes={','.join(map(str, shards))}")
    print(f"single_process_accuracy={single:.4f}")
    print(f"matches_single_process={accuracy == single}")
    print(f"test_accuracy={accuracy:.4f}")
    return 0 if accuracy == single else 1


def _model_of(state: dict, args: argparse.Namespace, dataset):
    """``(model, None)``: the MLP of a ``--checkpoint`` state dict, or ``(None, problem)`` when
    it is no MLP's or does not fit the dataset's features and classes."""
    try:
        sizes = mlp_sizes_from_state(state)
    except ValueError as error:
        return None, f"--checkpoint {args.checkpoint}: {error}"
    if sizes[0] != dataset.num_features or sizes[-1] < dataset.num_classes:
        return None, (f"--checkpoint {args.checkpoint} is a model for {sizes[0]} features and {sizes[-1]} classes; "
                      f"--dataset {args.dataset} has {dataset.num_features} and {dataset.num_classes}")
    model = nn.mlp(sizes)
    model.load_state_dict(state)
    return model, None


# ---------------------------------------------------------------------------------------
# generate
# ---------------------------------------------------------------------------------------


# Below this the logits divided by T overflow or the sampling is greedy already (a gap of 1e-3 between two logits is
# e^-1000 = 0 in float64): --top-k 1 says greedy.
MIN_TEMPERATURE = 1e-6


def generate_parser() -> argparse.ArgumentParser:
    """The ``generate`` command's flags."""
    p = argparse.ArgumentParser(prog="python -m minidist generate",
                                description="Sample text from a GPT trained with `train --model gpt`: the prompt, then "
                                            "--max-new-tokens characters drawn one at a time.")
    p.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="the GPT: a `train --model gpt --save-model PATH` file (.npz), a --checkpoint-dir folder "
                        "(its newest valid checkpoint) or one of its ckpt-<step>.npz files")
    p.add_argument("--prompt", required=True, metavar="TEXT",
                   help="the text to continue (every character must be in the model's vocabulary)")
    p.add_argument("--max-new-tokens", type=nonnegative_int, default=200, metavar="N",
                   help="characters to generate (default: 200)")
    p.add_argument("--temperature", type=positive_float, default=1.0, metavar="T",
                   help=f"divide the logits by T before sampling; lower is more conservative (default: 1.0; at least "
                        f"{MIN_TEMPERATURE:g}: --top-k 1 is greedy decoding)")
    p.add_argument("--top-k", type=positive_int, default=None, metavar="K",
                   help="sample among the K most likely characters only (default: all)")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="the sampling's seed: the same seed, the same text "
                                                                    "(default: 0)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where to compute (default: cpu)")
    p.add_argument("--no-kv-cache", dest="kv_cache", action="store_false",
                   help="recompute the whole context for every new character instead of keeping its keys and values "
                        "(the KV cache, the default): the same text, slower")
    return p


def generate_command(argv: list[str]) -> int:
    """``python -m minidist generate --checkpoint PATH --prompt TEXT [--max-new-tokens N
    --temperature T --top-k K --seed S --device D --no-kv-cache]``: prints the prompt and the characters
    sampled after it (``workloads.generate_text``: the same seed gives the same text). A sharded
    checkpoint (tp, FSDP, ZeRO-1, pipeline, 3d) is consolidated on the fly. Exit status 0; 1 when
    PATH is missing, unreadable, truncated or corrupt, or its weights are NaN or infinite (the
    tensor named); 2 for a usage error: bad flags, a --temperature below MIN_TEMPERATURE, a PATH
    that holds no GPT (an MLP's weights), a prompt with a character outside the model's
    vocabulary (named), --device cuda without CuPy or a GPU."""
    parser = generate_parser()
    args = parser.parse_args(argv)
    if args.temperature < MIN_TEMPERATURE:
        parser.error(f"--temperature {args.temperature!r} is too small: the logits divided by it overflow (the text "
                     f"was blank); for greedy decoding use --top-k 1, else a temperature >= {MIN_TEMPERATURE:g}")
    if args.device == "cuda":
        try:
            backend.check_device("cuda")
        except backend.DeviceError as error:
            parser.error(str(error))
    try:
        model, tokenizer = workloads.load_language_model(args.checkpoint, device=args.device)
    except workloads.NotALanguageModelError as error:
        parser.error(f"--checkpoint {error}")
    except CheckpointError as error:
        return fail("generate", str(error))
    unknown = sorted(set(args.prompt) - set(tokenizer.vocab))
    if unknown:
        parser.error(f"--prompt: {', '.join(map(repr, unknown))} {'is' if len(unknown) == 1 else 'are'} not in the "
                     f"model's vocabulary of {tokenizer.vocab_size} characters (those of its training text); remove "
                     "or replace it")
    if not args.prompt:
        parser.error("--prompt is empty; give at least one character to start from")
    print(workloads.generate_text(model, tokenizer, args.prompt, args.max_new_tokens, temperature=args.temperature,
                                  top_k=args.top_k, seed=args.seed, use_cache=args.kv_cache))
    return 0


# ---------------------------------------------------------------------------------------
# doctor, check, exercises
# ---------------------------------------------------------------------------------------


def launch_command(argv: list[str]) -> int:
    """``python -m minidist launch -n N --max-restarts K [--timeout S] -- train FLAGS``: run
    ``train FLAGS`` on N ranks and relaunch it with ``--resume`` when it fails, at most K
    times (``launch.supervise``). The train flags are checked first (a usage error, status 2,
    before anything starts) and must include ``--checkpoint-dir``. ``--strategy single`` runs
    one process without mpiexec (so it needs no MPI, and ``-n 1``); every other strategy runs
    under ``mpiexec -n N``. Exit status: the last attempt's (128 + the signal's number for a
    process killed by a signal, as a shell reports it); 1 when MPI is missing; 128 + the
    signal's number when this process gets SIGINT, SIGTERM or SIGHUP, after it ended the job
    (``launch.Stopped``; one line, no traceback). ``--replay-step`` is a usage error here.
    ``--min-ranks K`` (elastic, ``launch.supervise``): each relaunch runs on fewer ranks, down to
    K (none above the train flags' ``--global-batch-size``, which --min-ranks needs)
    (with --strategy ddp or fsdp: the checkpoints that reshard)."""
    parser = argparse.ArgumentParser(
        prog="python -m minidist launch", usage="python -m minidist launch [-n N] [--min-ranks K] [--max-restarts R] "
                                                "[--timeout S] -- train FLAGS",
        description="Run train FLAGS on N ranks; when the job fails, relaunch it with --resume from its "
                    "--checkpoint-dir, at most K times (as torchrun --max-restarts).")
    parser.add_argument("-n", "--nproc", type=positive_int, default=1, help="ranks (processes) (default: 1)")
    parser.add_argument("--max-restarts", type=nonnegative_int, default=3,
                        help="relaunches after a failure before giving up (default: 3)")
    parser.add_argument("--min-ranks", type=positive_int, default=None, metavar="K",
                        help="elastic: relaunch on fewer ranks after each failure (N-1, ... down to K; train needs "
                             "--global-batch-size) instead of N again (default: N every time)")
    parser.add_argument("--timeout", type=positive_float, default=None,
                        help="seconds one attempt may run before it is killed and counted as failed (default: no "
                             "limit; the ranks' own waits stop at train's --timeout)")
    own, job = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = parser.parse_args(own)
    if not job or job[0] != "train":
        parser.error("give the job after --: `-- train FLAGS` (only train writes the checkpoints a restart needs)")
    train_args = train_parser().parse_args(job[1:])
    try:
        config = train_config(train_args)
    except ValueError as problem:
        parser.error(f"train flags: {problem}")
    if config.checkpoint_dir is None:
        parser.error("train flags: launch restarts a failed job from its checkpoints; add --checkpoint-dir DIR")
    if config.replay_step is not None:
        parser.error("train flags: --replay-step reruns one step and writes nothing, so there is nothing to restart; "
                     "run `python -m minidist train ... --replay-step K` directly")
    single = strategy.get(config.strategy).one_process
    if single and args.nproc != 1:
        parser.error(f"--strategy {config.strategy} trains in one process: use -n 1, not -n {args.nproc}")
    fits = _check_elastic(parser, args, config) if args.min_ranks is not None else None
    try:
        status = launch.supervise(args.nproc, job[1:], args.max_restarts, args.timeout, use_mpiexec=not single,
                                  min_ranks=args.min_ranks, fits=fits)
    except launch.LaunchError as error:
        return fail("launch", str(error))
    except launch.Stopped as stopped:  # SIGINT, SIGTERM, SIGHUP: the job is ended; one line, no traceback
        print(f"minidist launch: {stopped}; ended the job (mpiexec and its ranks)", file=sys.stderr, flush=True)
        return stopped.status
    return 128 - status if status < 0 else status


def _check_elastic(parser: argparse.ArgumentParser, args: argparse.Namespace, config):
    """The usage errors of ``launch --min-ranks``: a strategy whose checkpoints do not reshard,
    no --global-batch-size, K above -n, no size between -n and K the job can run on. Returns the
    sizes' rule for ``launch.supervise`` (``fits``): None (at most G) for the data-parallel
    strategies; for tp, the numbers of ranks the model splits over (``check_tensor_parallel``);
    for pipeline and 3d, the numbers of ranks their flags can lay out (``check_layout``: the
    relaunch keeps --dp (and --tp), so the ranks must be a multiple of dp (x tp) whose pipeline
    of ranks / (dp x tp) stages the model's layers can fill: fewer ranks, fewer stages)."""
    record = strategy.resolve(config)
    if not record.elastic(config):
        parser.error(f"--min-ranks relaunches on fewer ranks from resharded checkpoints: --strategy "
                     f"{strategy.listed(strategy.elastic_labels(), 'or')}, not this job (--strategy {config.strategy})")
    if config.global_batch_size is None:
        parser.error("--min-ranks keeps the global batch while the ranks change: give train --global-batch-size G")
    fits = None
    if record.resize_rule is not None:
        def fits(m):
            try:
                check_layout(config, m)
            except ValueError:
                return False
            return True
    try:
        sizes = launch.elastic_sizes(args.nproc, args.min_ranks, config.global_batch_size, fits=fits)
    except ValueError as problem:
        parser.error(str(problem))
    if len(sizes) == 1 and args.min_ranks < args.nproc:
        rule = "" if record.resize_rule is None else record.resize_rule(config)
        parser.error(f"--min-ranks {args.min_ranks}: no number of ranks from {args.nproc - 1} down to "
                     f"{args.min_ranks} can run this job{rule}")
    return fits


def doctor_command(argv: list[str]) -> int:
    """``python -m minidist doctor [--ranks N] [--timeout S]``: see ``launch.doctor``."""
    parser = argparse.ArgumentParser(prog="python -m minidist doctor",
                                     description="Check numpy/cupy/mpi4py/MPI, run a smoke test under mpiexec, and "
                                                 "report the nodes and whether MPI is CUDA-aware.")
    parser.add_argument("-n", "--ranks", type=positive_int, default=4, help="ranks in the smoke test (default 4)")
    parser.add_argument("--timeout", type=positive_float, default=120.0,
                        help="seconds before the smoke test is killed (default 120)")
    args = parser.parse_args(argv)
    return launch.doctor(args.ranks, args.timeout)
