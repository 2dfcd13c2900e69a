"""Command line: ``python -m minidist COMMAND [options]``; the only module that parses arguments.

Commands:

  train        train an MLP (``--strategy single|ddp|ps|pipeline``) or a GPT (``--model gpt``), alone or
               under ``mpiexec -n N``
  generate     sample text from a GPT trained with ``train --model gpt``
  serve        serve that GPT over HTTP (OpenAI's ``POST /v1/completions``, ``GET /health``)
  launch       run ``train`` under mpiexec, relaunching it with ``--resume`` when it fails
  checkpoint   ``consolidate DIR OUT``: a checkpoint's weights (any ranks, any sharding) as one dense .npz
  evaluate     data-parallel inference over the test set
  doctor       print versions and run a 4-rank smoke test through the launcher
  plan         rank the dp x pp x tp layouts of a transformer on a cluster (memory, step time)
  check NN     validate your exercise NN with nbval and print a verdict
  exercises    write ``exercises/`` from ``solutions/``

Each command is a parser, the checks argparse cannot express, and a call into the library
with plain keyword arguments or a :class:`minidist.train.TrainConfig` (never the parsed
namespace). Every command takes ``-h``. Unknown commands, flags or values, values out of
range, and flags the chosen strategy would ignore print a usage error naming the flag
(exit status 2), never a traceback. A run that fails (missing files, no mpi4py, a loss that
became NaN, a peer that stopped answering) prints one ``error:`` line and exits with 1.
"""
from __future__ import annotations

import importlib
import signal
import sys

from minidist import launch
from minidist.cli.train import train_config, train_parser

__all__ = ["COMMANDS", "command_function", "main", "train_config", "train_parser", "usage"]  # train_*: tests

# ---------------------------------------------------------------------------------------
# python -m minidist
# ---------------------------------------------------------------------------------------

# command -> (module of minidist.cli, its function, one-line help); each function takes argv and
# returns an exit status. A command's module is imported when the command runs: ``check`` and
# ``exercises`` need nbformat, whose import takes 2-3 s on a laptop, and every rank of every
# ``train`` would pay for it (the cause of slow starts under mpiexec before).
COMMANDS = {
    "train": ("train", "train_command", "train an MLP on digits or MNIST, or a GPT on Shakespeare (--model gpt)"),
    "generate": ("tools", "generate_command", "sample text from a GPT trained with train --model gpt"),
    "serve": ("serve", "serve_command", "serve a GPT over HTTP: POST /v1/completions (OpenAI's API), GET /health"),
    "launch": ("tools", "launch_command", "run train on N ranks, relaunching it from its checkpoints when it fails"),
    "checkpoint": ("checkpoint", "checkpoint_command", "consolidate DIR OUT: a checkpoint's weights as one dense .npz"),
    "evaluate": ("tools", "evaluate_command", "data-parallel evaluation on the test set"),
    "doctor": ("tools", "doctor_command", "check numpy/cupy/mpi4py/MPI and run a 4-rank smoke test"),
    "plan": ("plan", "plan_command", "rank the dp x pp x tp layouts of a model on a cluster (memory, step time)"),
    "check": ("course", "check_command", "validate exercise NN (nbval) and print a verdict"),
    "exercises": ("course", "exercises_command", "write exercises/ from solutions/"),
}


def command_function(command: str):
    """The function that runs ``command`` (a key of COMMANDS): ``f(argv) -> exit status``, its
    module imported now. Raises KeyError for an unknown command."""
    module, function, _ = COMMANDS[command]
    return getattr(importlib.import_module(f"minidist.cli.{module}"), function)


def usage() -> str:
    """The text of ``python -m minidist -h``: the commands, one line each."""
    lines = ["usage: python -m minidist COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += ["", "Run `python -m minidist COMMAND -h` for a command's options."]
    return "\n".join(lines)


# Per command, the flag that sets how much one step or call holds at once: the fix of a MemoryError.
MEMORY_FLAGS = {"train": "--batch-size", "evaluate": "--batch-size"}


def out_of_memory(command: str, argv: list[str], error: MemoryError) -> str:
    """The one-line message of a MemoryError that ended ``command`` run with ``argv``: NumPy's
    words (what it could not allocate) and the flag to make smaller, with its value if given."""
    said = str(error).strip()
    said = f" ({said[0].lower()}{said[1:]})" if said else ""
    flag = MEMORY_FLAGS.get(command)
    if flag is None:
        return f"out of memory{said}: close other programs or run it on a machine with more memory"
    value = next((a.split("=", 1)[1] if "=" in a else argv[i + 1] for i, a in enumerate(argv)
                  if (a == flag and i + 1 < len(argv)) or a.startswith(flag + "=")), None)
    now = f" (now {value})" if value is not None else ""
    return f"out of memory{said}: what one step holds does not fit in this machine's memory; use a smaller {flag}{now}"


def main(argv: list[str] | None = None) -> int:
    """Run ``python -m minidist`` with ``argv`` (default ``sys.argv[1:]``); return the exit
    status: 0 success, 1 the command failed, 2 usage error (argparse's ``SystemExit`` is
    turned into the status, so tests can call this in-process), 130 after Ctrl-C (one line,
    no traceback); 1 with one line naming the flag to make smaller after a MemoryError
    (:func:`out_of_memory`). The command runs with one BLAS thread unless OMP_NUM_THREADS (or
    OPENBLAS_NUM_THREADS, MKL_NUM_THREADS) says otherwise (``launch.one_blas_thread``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(usage(), file=sys.stderr)
        print(f"\nminidist: error: unknown command {command!r}", file=sys.stderr)
        return 2
    try:
        with launch.one_blas_thread(), launch.running(command, rest):  # one BLAS thread: the matrices are small
            return int(command_function(command)(rest) or 0)
    except SystemExit as exit_:  # argparse: -h (0) or a usage error (2)
        if isinstance(exit_.code, str):
            print(exit_.code, file=sys.stderr)
            return 1
        return exit_.code or 0
    except MemoryError as error:  # a batch too big for this machine: one line naming the fix, not a traceback
        print(f"minidist {command}: error: {out_of_memory(command, rest, error)}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: one line and the shell's status for SIGINT, not a traceback
        print(f"\nminidist {command}: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
