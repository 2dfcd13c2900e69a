"""The course's commands, ``check NN`` and ``exercises``: the only ones that need the notebook
tooling (nbformat, nbclient), whose imports take seconds (nbformat's JSON-schema checks), so
:mod:`minidist.cli` imports this module only when one of them runs and ``train`` never pays
for it on each rank."""
from __future__ import annotations

import argparse
from pathlib import Path

from minidist.cli.values import chapter, positive_float, positive_int
from minidist.course import runner
from minidist.course.exercises import update_exercises


def check_command(argv: list[str]) -> int:
    """``python -m minidist check NN [--timeout S] [--ranks N] [--exercises DIR] [--solutions DIR]``:
    see ``course.runner.run_check``. Exit status 0 all pass, 1 something fails, 2 usage error."""
    parser = argparse.ArgumentParser(prog="python -m minidist check",
                                     description="Validate your exercise NN: run it as the grader does (with the "
                                                 "exercise's own checks, generated from solutions/) and say what "
                                                 "fails.")
    parser.add_argument("chapter", type=chapter, metavar="NN", help="exercise number, e.g. 01")
    parser.add_argument("--timeout", type=positive_float, default=120.0,
                        help="seconds per notebook cell and per script; after a timeout check stops within a few "
                             "seconds (default 120)")
    parser.add_argument("--ranks", "-n", type=positive_int, default=4,
                        help="MPI processes for the chapter's script (default 4)")
    parser.add_argument("--exercises", type=Path, default=Path("exercises"),
                        help="folder with the exercises (default: exercises)")
    parser.add_argument("--solutions", type=Path, default=None,
                        help="folder with the solutions the checks come from (default: the solutions/ next to the "
                             "exercises folder, in the current folder, or next to the minidist package)")
    args = parser.parse_args(argv)
    where = {"solutions": args.solutions} if args.solutions is not None else {}
    return runner.run_check(args.chapter, timeout=args.timeout, ranks=args.ranks, exercises=args.exercises, **where)


def exercises_command(argv: list[str]) -> int:
    """``python -m minidist exercises [--check] [--force] [--execute] [--root DIR] [NN ...]``:
    see ``course.exercises.update_exercises``."""
    parser = argparse.ArgumentParser(prog="python -m minidist exercises",
                                     description="Write exercises/ from solutions/ (stubs replace the solution "
                                                 "regions).")
    parser.add_argument("chapters", nargs="*", type=chapter, metavar="NN", help="only these chapters (default: all)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 and list files if exercises/ is out of date")
    parser.add_argument("--force", action="store_true", help="overwrite exercises even where you edited them")
    parser.add_argument("--execute", action="store_true",
                        help="first run the chapters' lesson and solution notebooks and save their outputs")
    parser.add_argument("--root", type=Path, default=Path("."), help="the course folder (default: the current one)")
    args = parser.parse_args(argv)
    if args.execute and args.check:
        parser.error("--execute writes notebooks; it cannot be combined with --check")
    return update_exercises(args.chapters or None, root=args.root, check=args.check, force=args.force,
                            execute=args.execute)
