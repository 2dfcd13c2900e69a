"""Command line: ``python -m minidist COMMAND [options]``; the only module that parses arguments.

Commands:

  train     train an MLP (``--strategy single|ddp|ps``), alone or under ``mpiexec -n N``
  evaluate  data-parallel inference over the test set
  doctor    print versions and run a 4-rank smoke test through the launcher
  check NN  validate your exercise NN with nbval and print a verdict

Every command takes ``-h``. Unknown commands, flags or values print a usage error
(exit status 2), never a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path


def chapter(value: str) -> str:
    """argparse type: an exercise number such as ``1`` or ``01``, returned as two digits."""
    if not re.fullmatch(r"\d{1,2}", value):
        raise argparse.ArgumentTypeError(f"{value!r} is not an exercise number such as 01")
    return value.zfill(2)


def check_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minidist check",
                                     description="Validate your exercise NN: run it as the grader does and say what fails.")
    parser.add_argument("chapter", type=chapter, metavar="NN", help="exercise number, e.g. 01")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per notebook cell and per script (default 120)")
    parser.add_argument("--ranks", "-n", type=int, default=4, help="MPI processes for the chapter's script (default 4)")
    parser.add_argument("--exercises", type=Path, default=Path("exercises"), help="folder with the exercises (default: exercises)")
    return parser


def check_command(argv: list[str]) -> int:
    """``python -m minidist check NN [--timeout S] [--ranks N] [--exercises DIR]``."""
    args = check_parser().parse_args(argv)
    from minidist.course import runner

    return runner.run_check(args.chapter, timeout=args.timeout, ranks=args.ranks, exercises=args.exercises)


# command -> (function, one-line help); each function takes argv and returns an exit status.
COMMANDS = {
    "train": (lambda argv: importlib.import_module("minidist.train").train_main(argv), "train an MLP on digits or MNIST"),
    "evaluate": (lambda argv: importlib.import_module("minidist.parallel.inference").evaluate_main(argv),
                 "data-parallel evaluation on the test set"),
    "doctor": (lambda argv: importlib.import_module("minidist.launch").doctor_main(argv),
               "check numpy/cupy/mpi4py/MPI and run a 4-rank smoke test"),
    "check": (check_command, "validate exercise NN (nbval) and print a verdict"),
}


def usage() -> str:
    lines = ["usage: python -m minidist COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<9} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `python -m minidist COMMAND -h` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run ``python -m minidist`` with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(usage(), file=sys.stderr)
        print(f"\nminidist: error: unknown command {command!r}", file=sys.stderr)
        return 2
    function, _ = COMMANDS[command]
    try:
        return int(function(rest) or 0)
    except SystemExit as exit_:  # argparse: -h (0) or a usage error (2)
        return int(exit_.code or 0)
