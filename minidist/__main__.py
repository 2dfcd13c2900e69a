"""Command line: ``python -m minidist COMMAND [options]``.

Commands (each lives in the module that owns the concept; this file only dispatches):

  train     train an MLP (``--strategy single|ddp|ps``), alone or under ``mpiexec -n N``
  evaluate  data-parallel inference over the test set
  doctor    print versions and run a 4-rank smoke test through the launcher
  check NN  validate your exercise NN with nbval and print a verdict

Every command takes ``-h``. Unknown commands, flags or values print a usage error
(exit status 2), never a traceback.
"""
from __future__ import annotations

import importlib
import sys

# command -> (module, function, one-line help). The function takes argv (a list of str)
# and returns an exit status.
COMMANDS = {
    "train": ("minidist.train", "train_main", "train an MLP on digits or MNIST"),
    "evaluate": ("minidist.parallel.inference", "evaluate_main", "data-parallel evaluation on the test set"),
    "doctor": ("minidist.launch", "doctor_main", "check numpy/cupy/mpi4py/MPI and run a 4-rank smoke test"),
    "check": ("minidist.course.runner", "check_main", "validate exercise NN (nbval) and print a verdict"),
}


def usage() -> str:
    lines = ["usage: python -m minidist COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<9} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += ["", "Run `python -m minidist COMMAND -h` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(usage(), file=sys.stderr)
        print(f"\nminidist: error: unknown command {command!r}", file=sys.stderr)
        return 2
    module_name, function_name, _ = COMMANDS[command]
    module = importlib.import_module(module_name)
    function = getattr(module, function_name, None)
    if function is None:
        print(f"minidist: error: command {command!r} is not available in this version", file=sys.stderr)
        return 2
    return int(function(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
