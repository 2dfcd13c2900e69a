"""``python -m minidist check NN``: grade an exercise as the grader does and say what fails.

The verdict comes from the exercise's own cells and script, not from the learner's copy of
them. For each ``exercises/NN_*.ipynb`` the runner takes the exercise as generated from
``solutions/NN_*.ipynb`` (:func:`minidist.course.exercises.render_exercise`) and the learner's
notebook, and runs, in one fresh kernel (cwd: the learner's folder), :func:`assemble`'s list of
cells: every code cell of the exercise in order, where each of its stub cells (and every cell
the learner added or changed) is the learner's own. The exercise's cells run through
:mod:`minidist.course.grading`: in a state the learner's code cannot have altered (the modules
the checks use restored, the checks imported afresh, IPython's custom exception handlers
dropped), and they count as passed only when their own record says so. A cell of the exercise
the learner edited or deleted still runs, as generated, and the report says so.

Each mpirun script ``exercises/NN_*.py`` runs under ``mpiexec -n ranks``
(:func:`run_script_check`): on every rank the learner's functions are loaded from their script
and the exercise's own script (from ``solutions/``) runs its ``main()`` with them; a rank
that ends without writing its verdict (``os._exit(0)``, a crash) is a failure.

A cell passes when it runs without error within ``timeout`` seconds; once a cell times out
(the kernel is interrupted, then shut down) or the kernel dies, the cells after it are not
counted. nbval's markers (``# NBVAL_SKIP``, the ``raises-exception`` tag, ...) mean nothing
here: every cell must run without error. Exit status: 0 all pass, 1 something fails, 2 usage
error (no such exercise, a notebook that is not a notebook, no ``solutions/`` to grade with).
Its arguments are parsed in :mod:`minidist.cli`, which calls :func:`run_check`.

Longer than 400 lines: grading a notebook and grading an mpirun script share the kernel, the guard
and the report.
"""
from __future__ import annotations

import contextlib
import difflib
import os
import re
import secrets
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import nbformat
from jupyter_core.utils import run_sync
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError

import minidist
from minidist import launch as launcher
from minidist.course import exercises, grading
from minidist.course.checks import DEADLOCK_HINT, STUB_HINT

# Colour codes, raw or as pytest's JUnit XML writes them (#x1B).
_ANSI = re.compile(r"(?:\x1b|#x1B)\[[0-9;]*[A-Za-z]")
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit))(:.*)?$", re.MULTILINE)
NAME_HINT = "a name an earlier cell should have defined is missing: fix the first failing cell above"
_OTHER_OUTPUT = re.compile(r"^(Traceback |  File |Abort\(|\[)")
# nbval's markers that would let a cell be skipped or raise (nbval.plugin's names): ignored here.
SKIP_MARKERS = ("NBVAL_SKIP", "NBVAL_RAISES_EXCEPTION")
SKIP_TAGS = ("nbval-skip", "nbval-raises-exception", "raises-exception")
INTERRUPT_GRACE = 3.0  # seconds a timed-out cell gets to stop after the interrupt (launch kills its mpiexec)
EDITED_NOTE = "your copy of this cell differs from the exercise: check runs the exercise's cell"
DELETED_NOTE = "your notebook has no copy of this cell: check runs the exercise's cell"


class CheckError(Exception):
    """``check NN`` cannot run: a file that is not a notebook, no solution to grade it with, a
    kernel that cannot start. The message names the file and the fix; :func:`run_check` prints
    it and exits with status 2."""


def last_exception(text: str) -> str:
    """The final exception of a traceback (``"AssertionError: ...\nHint: ..."``), colour
    codes removed, cut where other output resumes (another rank's traceback, MPI's abort
    notice); the last non-empty line when there is no exception line."""
    text = _ANSI.sub("", text or "").rstrip()
    matches = list(_EXCEPTION_LINE.finditer(text))
    if not matches:
        lines = [line for line in text.splitlines() if line.strip()]
        return lines[-1].strip() if lines else "failed"
    kept = []
    for line in text[matches[-1].start():].splitlines():
        if kept and (not line.strip() or _OTHER_OUTPUT.match(line)):
            break
        kept.append(line)
    return "\n".join(kept).strip().removesuffix(":")


def _first_line(source: str) -> str:
    line = next((s.strip() for s in source.splitlines() if s.strip() and not s.strip().startswith("#")), "")
    return line if len(line) <= 60 else line[:57] + "..."


def read_notebook(path: Path):
    """The notebook at ``path`` (nbformat v4), validated. Raises :class:`CheckError` naming
    the file when it is not valid JSON or not a notebook (a half-saved file, a merge gone wrong)."""
    try:
        nb = nbformat.read(str(path), as_version=4)
        nbformat.validate(nb)
    except Exception as error:  # nbformat raises a dozen types for a bad file
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckError(f"{path} is not a valid notebook ({reason[:200]}); open it in Jupyter and save it "
                         f"again, or get a fresh copy with `python -m minidist exercises --force "
                         f"{Path(path).name[:2]}` (that replaces your work in it)") from None
    return nb


def skip_markers(cell) -> list[str]:
    """The nbval markers on ``cell`` (comment lines or tags) that would let it be skipped or
    raise under nbval; check ignores them, and names them when the cell fails."""
    comments = {line.strip().lstrip("#").strip() for line in cell.source.splitlines() if line.strip().startswith("#")}
    tags = cell.metadata.get("tags", [])
    return [m for m in SKIP_MARKERS if m in comments] + [t for t in SKIP_TAGS if isinstance(tags, list) and t in tags]


# ----------------------------------------------------------------------------- the cells to run


@dataclass
class Step:
    """One cell of the grading run: ``source`` is the learner's cell (``exercise_cell`` None)
    or the exercise's code cell number ``exercise_cell`` (counting code cells from 0), run
    through :mod:`minidist.course.grading`. ``label`` names it in the report (``"cell 7
    (print(...))"``, numbered as in the learner's notebook where it has the cell); ``note``
    says when the exercise's cell runs in place of the learner's edited or missing copy."""

    label: str
    source: str
    exercise_cell: int | None = None
    note: str = ""
    markers: tuple = ()


def _label(number: int, source: str, suffix: str = "") -> str:
    return f"cell {number}{suffix} ({_first_line(source)})"


def assemble(learner, exercise) -> list[Step]:
    """The cells check runs for the learner's notebook ``learner`` graded against the generated
    ``exercise`` (both nbformat notebooks), in order.

    The two lists of code cells are aligned on identical sources (``difflib.SequenceMatcher``).
    A cell of the exercise the learner has unchanged is the exercise's (graded); a stub cell of
    the exercise and every cell only the learner has (answers, their own cells, their edits of
    the exercise's cells) are the learner's. Where the learner changed or removed cells of the
    exercise, those run too, as generated, with a note: the ones before the first stub of that
    stretch first, then the learner's cells of the stretch, then the rest."""
    mine = [(i, c) for i, c in enumerate(learner.cells) if c.cell_type == "code"]
    theirs = [(i, c) for i, c in enumerate(exercise.cells) if c.cell_type == "code"]
    stub = [exercises.is_stub(c.source) for _, c in theirs]

    def learner_step(k):
        index, cell = mine[k]
        return Step(_label(index + 1, cell.source), cell.source, markers=tuple(skip_markers(cell)))

    def exercise_step(k, gap):
        index, cell = theirs[k]
        similar = any(difflib.SequenceMatcher(None, cell.source, mine[g][1].source).ratio() > 0.6 for g in gap)
        return Step(_label(index + 1, cell.source, " of the exercise"), cell.source, k,
                    EDITED_NOTE if similar else DELETED_NOTE)

    steps = []
    matcher = difflib.SequenceMatcher(None, [c.source for _, c in theirs], [c.source for _, c in mine],
                                      autojunk=False)
    for tag, t0, t1, m0, m1 in matcher.get_opcodes():
        if tag == "equal":
            for t, m in zip(range(t0, t1), range(m0, m1)):
                index, cell = mine[m]
                steps.append(learner_step(m) if stub[t] else Step(_label(index + 1, cell.source), cell.source, t))
            continue
        gap = range(m0, m1)
        first_stub = next((t for t in range(t0, t1) if stub[t]), t1)
        steps += [exercise_step(t, gap) for t in range(t0, first_stub)]
        steps += [learner_step(m) for m in gap]
        steps += [exercise_step(t, gap) for t in range(first_stub, t1) if not stub[t]]
    return steps


# ----------------------------------------------------------------------------- running them


def _error_of(cell) -> str:
    """``"Name: message"`` of the error output of an executed cell, or "" when it has none."""
    for output in cell.get("outputs", []):
        if output.get("output_type") == "error":
            value = _ANSI.sub("", str(output.get("evalue", ""))).strip()
            return f"{output.get('ename', 'Error')}: {value}" if value else str(output.get("ename", "Error"))
    return ""


KERNEL_STARTS = 3  # tries to start the grading kernel: one that dies before it answers is started again


def _start_kernel(stack, client, env, log, kernel_log) -> None:
    """Enter ``client.setup_kernel`` on ``stack``, starting the kernel again (up to
    :data:`KERNEL_STARTS` tries) when it dies before answering ``kernel_info``: a start-up
    failure of the kernel's own (a port taken by another kernel starting at the same moment, a
    loaded machine), not of the learner's code, which has not run yet. Raises CheckError with
    the kernel's last words when every try fails."""
    for attempt in range(1, KERNEL_STARTS + 1):
        try:
            stack.enter_context(client.setup_kernel(env=env, stderr=log))
            return
        except RuntimeError as error:
            if "kernel_info" not in str(error) or attempt == KERNEL_STARTS:
                raise CheckError(f"check could not start a kernel ({error}), {attempt} tries:\n"
                                 f"{_tail(kernel_log)}") from None


def _tail(path: Path, lines: int = 5) -> str:
    """The last ``lines`` lines of a log file that are not jupyter's transport warning."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    kept = [line for line in text.splitlines() if line.strip() and "running over TCP without encryption" not in line]
    return "\n".join(kept[-lines:])


def _stop(client, seconds: float) -> None:
    """After a cell's timeout: interrupt the kernel (a KeyboardInterrupt in the cell, so that
    ``minidist.launch`` kills its mpiexec) and wait at most ``seconds`` for it to answer again."""
    try:
        run_sync(client.km.interrupt_kernel)()
        client.timeout = seconds
        client.execute_cell(nbformat.v4.new_code_cell("pass"), 0, store_history=False)
    except Exception:  # a kernel that ignores the interrupt is shut down right after
        pass


def run_notebook_checks(notebook: Path, timeout: float, exercise: Path) -> list[tuple[str, bool, str]]:
    """Grade the learner's ``notebook`` against the solution notebook ``exercise`` (its
    generated exercise is what counts; see the module docstring) in a fresh kernel whose cwd is
    the notebook's folder, ``timeout`` seconds per cell. Returns one ``(label, passed, error)``
    per cell run (:func:`assemble`), in order; ``error`` also carries the notes.

    A cell of the exercise passes only with its own passing record; a learner's cell passes when
    it ran without an error. After a timeout (the kernel is interrupted, then shut down) or the
    kernel's death, the cells after it are failures, "not counted". Raises :class:`CheckError`
    when a file is not a notebook or the grading cannot start in the kernel."""
    learner = read_notebook(notebook)
    generated = nbformat.reads(exercises.render_exercise(Path(exercise)), as_version=4)
    steps = assemble(learner, generated)
    sources = [c.source for c in generated.cells if c.cell_type == "code"]
    name = f"_check_{secrets.token_hex(8)}"
    nonce = secrets.token_hex(16)
    results: list[tuple[str, bool, str] | None] = [None] * len(steps)
    with tempfile.TemporaryDirectory(prefix="minidist-check-") as tmp:
        report = grading.Report(Path(tmp) / "report.jsonl", nonce)
        env = {**os.environ, grading.REPORT_ENV: report.path, grading.NONCE_ENV: nonce, "PYTHONUNBUFFERED": "1"}
        cells = [nbformat.v4.new_code_cell(
            f"__import__('minidist.course.grading', fromlist=['install']).install(get_ipython(), {name!r}, "
            f"{sources!r})")]
        cells += [nbformat.v4.new_code_cell(f"{name}({step.exercise_cell})" if step.exercise_cell is not None
                                            else step.source) for step in steps]
        nb = nbformat.v4.new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "language": "python",
                                                                             "display_name": "Python 3"}})
        client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                                interrupt_on_timeout=False, shutdown_kernel="immediate", record_timing=False,
                                skip_cells_with_tag=name, resources={"metadata": {"path": str(Path(notebook).parent)}})
        stopped = None
        kernel_log = Path(tmp) / "kernel.log"  # the kernel's own stderr (IPKernelApp warnings, a crash)
        with open(kernel_log, "wb") as log, contextlib.ExitStack() as stack:
            _start_kernel(stack, client, env, log, kernel_log)
            try:
                client.execute_cell(cells[0], 0)
            except (CellTimeoutError, DeadKernelError) as error:
                raise CheckError(f"check could not start grading in a kernel ({type(error).__name__}):\n"
                                 f"{_tail(kernel_log)}") from None
            if _error_of(cells[0]):
                raise CheckError(f"check could not start grading in a kernel: {_error_of(cells[0])}")
            for k, step in enumerate(steps):
                earlier = report.count(step.exercise_cell) if step.exercise_cell is not None else 0
                try:
                    client.execute_cell(cells[k + 1], k + 1)
                except CellTimeoutError:
                    _stop(client, INTERRUPT_GRACE)
                    results[k] = (step.label, False, f"timed out after {timeout:g} s (a loop that never ends, or a "
                                                     f"Recv that no Send matches?); the cells after it are not counted")
                    stopped = f"not counted: {step.label.split(' (')[0]} before it timed out"
                    break
                except DeadKernelError:
                    said = _tail(kernel_log)
                    results[k] = (step.label, False, "the kernel died while this cell ran (os._exit, a crash, or "
                                                     "out of memory?); the cells after it are not counted"
                                  + (f"\nthe kernel's last words: {said}" if said else ""))
                    stopped = f"not counted: the kernel died in {step.label.split(' (')[0]}"
                    break
                results[k] = (step.label, *_outcome(step, cells[k + 1], report, earlier))
    rows = []
    for k, step in enumerate(steps):
        label, passed, error = results[k] or (step.label, False, stopped or "not run")
        if not passed and step.markers:
            error += (f"\nnote: {', '.join(step.markers)} is ignored here: check runs every cell, "
                      "and every cell must run without error")
        if step.note:
            error = f"{error}\nnote: {step.note}" if error else f"note: {step.note}"
        rows.append((label, passed, error))
    return rows


def _outcome(step: Step, cell, report, earlier: int) -> tuple[bool, str]:
    """``(passed, error)`` of a cell that finished: a learner's cell by its error output, one of
    the exercise's by the record it wrote while it ran (``earlier`` records of it before)."""
    shown = _error_of(cell)
    if step.exercise_cell is None:
        return not shown, shown
    record = report.read().get(step.exercise_cell) if report.count(step.exercise_cell) > earlier else None
    if record is None:
        return False, ("no verdict was recorded for this cell: the check did not run to its end (did your code "
                       "replace or delete what runs it?)" + (f"\n{shown}" if shown else ""))
    return record


# ----------------------------------------------------------------------------- scripts under mpiexec


def run_script_check(script: Path, ranks: int, timeout: float, exercise: Path) -> tuple[bool, str]:
    """Grade the learner's mpirun script ``script`` under ``mpiexec -n ranks`` (through
    :mod:`minidist.launch`, at most ``timeout`` seconds): on every rank
    :func:`minidist.course.grading.grade_script` loads the learner's functions and runs the
    ``main()`` of the exercise generated from the solution script ``exercise`` with them.
    Returns ``(passed, error)``: passed only when the job exits 0 and every rank wrote a
    passing record; a rank without one is named."""
    exercise = Path(exercise)
    names = exercises.solution_names(exercise.read_text(encoding="utf-8"))
    nonce = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="minidist-check-") as tmp:
        truth = Path(tmp) / exercise.name
        truth.write_text(exercises.render_exercise(exercise), encoding="utf-8")
        runner_script = Path(tmp) / "grade.py"
        runner_script.write_text(
            "import sys\n\nfrom minidist.course import grading\n\n"
            f"sys.exit(grading.grade_script({str(truth)!r}, {str(Path(script).resolve())!r}, {names!r}))\n")
        report = grading.Report(Path(tmp) / "report.jsonl", nonce)
        env = {grading.REPORT_ENV: report.path, grading.NONCE_ENV: nonce}
        try:
            result = launcher.launch(str(runner_script), ranks, timeout=timeout, env=env, cwd=str(Path(script).parent))
        except launcher.LaunchTimeout:  # a hang under MPI is almost always a deadlock
            return False, (f"timed out after {timeout:g} s: the ranks wait for each other (a deadlock?)\n"
                           f"Hint: {DEADLOCK_HINT}")
        except launcher.LaunchError as error:  # no mpiexec or no mpi4py: the message names the fix
            return False, str(error)
        records = report.read()
    output = _ANSI.sub("", f"{result.stdout}\n{result.stderr}")
    if result.returncode != 0 and _EXCEPTION_LINE.search(output):  # a rank's error, as Python printed it
        return False, last_exception(output)
    silent = [rank for rank in range(ranks) if rank not in records]
    if silent:  # os._exit(0) ends a rank without its record; mpiexec may or may not see a failure
        who = f"ranks {', '.join(map(str, silent))} exited without reporting their" if len(silent) > 1 else \
            f"rank {silent[0]} exited without reporting its"
        return False, (f"{who} verdict (exit status {result.returncode}: the checks did not finish; os._exit or "
                       f"sys.exit in your code?)\nHint: let your functions return; the checks decide when the script "
                       f"ends")
    if result.returncode != 0:
        return False, last_exception(output)
    failed = [(rank, records[rank][1]) for rank in range(ranks) if not records[rank][0]]
    if failed:
        return False, failed[0][1]
    return True, ""


# ----------------------------------------------------------------------------- the command


def _print_failure(label: str, error: str) -> None:
    print(f"  ✘ {label}")
    for line in error.splitlines():
        print(f"      {line}")
    if error.startswith("NotImplementedError"):
        print(f"      Hint: {STUB_HINT}")
    elif error.startswith("NameError"):
        print(f"      Hint: {NAME_HINT}")


def find_solutions(exercises_folder: Path, solutions: Path | None = None) -> Path:
    """The ``solutions/`` folder to grade with: ``solutions`` when given, else the first that
    exists of ``<exercises_folder>/../solutions``, ``./solutions`` and the one next to the
    ``minidist`` package (a course checkout). Raises :class:`CheckError` naming the fix."""
    if solutions is not None:
        if not Path(solutions).is_dir():
            raise CheckError(f"--solutions {solutions}: no such folder")
        return Path(solutions)
    candidates = [Path(exercises_folder).resolve().parent / "solutions", Path.cwd() / "solutions",
                  Path(minidist.__file__).resolve().parents[1] / "solutions"]
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    raise CheckError("no solutions/ folder to grade with (check runs the exercise's own cells, generated from "
                     "it): run check from the course folder, or give it with --solutions DIR")


def stubs_left(notebooks: list[Path], scripts: list[Path], truth: Path) -> tuple[list[str], int, bool]:
    """Where the learner's stubs are not yet replaced (``"13_transformers.ipynb cells 7, 11"``,
    ``"03_collectives.py (3 functions)"``), how many are left, and whether the learner's files are
    untouched: their code as generated from the solutions in ``truth`` (nothing attempted)."""
    places, left, untouched = [], 0, True
    for notebook in notebooks:
        cells = read_notebook(notebook).cells
        numbers = [str(i + 1) for i, c in enumerate(cells) if c.cell_type == "code" and exercises.is_stub(c.source)]
        if numbers:
            places.append(f"{notebook.name} cell{'s' * (len(numbers) > 1)} {', '.join(numbers)}")
        left += len(numbers)
        generated = nbformat.reads(exercises.render_exercise(truth / notebook.name), as_version=4).cells
        untouched &= [c.source for c in cells if c.cell_type == "code"] == [c.source for c in generated
                                                                           if c.cell_type == "code"]
    for script in scripts:
        text = script.read_text(encoding="utf-8", errors="replace")
        count = exercises.stub_count(text)
        if count:
            places.append(f"{script.name}" + (f" ({count} functions)" if count > 1 else ""))
        left += count
        untouched &= text == exercises.render_exercise(truth / script.name)
    return places, left, untouched and left > 0


def run_check(chapter: str, *, timeout: float, ranks: int, exercises: Path, solutions: Path | None = None) -> int:
    """Check exercise ``chapter`` (two digits, e.g. ``"01"``) in the folder ``exercises``,
    graded with the exercise generated from ``solutions`` (default: :func:`find_solutions`).

    Runs each notebook (:func:`run_notebook_checks`, ``timeout`` seconds per cell) and each
    mpirun script (:func:`run_script_check` with ``ranks`` processes and ``timeout`` seconds),
    prints one line per file and each failing cell with its error and hint (and every note),
    then a verdict (``exercise 01: 7 of 7 checks pass``, naming the stubs not yet replaced).
    An untouched exercise (its code as generated) is not run: one line says so and where its stubs
    are (before, its cells that need no answer made it "6 of 10 pass"). Returns 0 when everything
    passes, 1 when something fails or nothing was attempted, 2 for a usage error: no exercise
    ``chapter`` (the message lists those that exist), a file that is not a notebook, no
    solutions folder or no solution for a file.
    The arguments are validated by :mod:`minidist.cli` (``python -m minidist check NN``).
    """
    folder = Path(exercises)
    nn = chapter
    notebooks = sorted(folder.glob(f"{nn}_*.ipynb"))
    scripts = sorted(folder.glob(f"{nn}_*.py"))
    if not notebooks and not scripts:
        have = sorted({p.name[:2] for p in folder.glob("[0-9][0-9]_*") if p.suffix in (".ipynb", ".py")})
        print(f"minidist check: error: no exercise {nn} in {folder}/ "
              f"(exercises there: {', '.join(have) or 'none'})", file=sys.stderr)
        return 2
    try:  # every notebook must be one, and every file must have its solution, before anything runs
        for notebook in notebooks:
            read_notebook(notebook)
        truth = find_solutions(folder, solutions)
        for path in notebooks + scripts:
            if not (truth / path.name).is_file():
                raise CheckError(f"no {path.name} in {truth}/ to grade {path} with (check runs the exercise's own "
                                 f"cells); name your file as the exercise does")
    except CheckError as error:
        print(f"minidist check: error: {error}", file=sys.stderr)
        return 2
    places, left, untouched = stubs_left(notebooks, scripts, truth)
    if untouched:  # nothing attempted: a count of the cells that need no answer would mislead
        print(f"exercise {nn}: not started: {'its answer' if left == 1 else f'each of its {left} answers'} is still "
              f"a stub (`# YOUR CODE HERE` and `raise NotImplementedError()`) in {'; '.join(places)}: replace "
              f"{'it' if left == 1 else 'each'} with your code, then run `python -m minidist check {nn}` again")
        return 1
    passed = total = 0
    for notebook in notebooks:
        try:
            rows = run_notebook_checks(notebook, timeout, truth / notebook.name)
        except CheckError as error:
            print(f"minidist check: error: {error}", file=sys.stderr)
            return 2
        good = sum(ok for _, ok, _ in rows)
        print(f"{notebook}: {good} of {len(rows)} cells pass")
        for label, ok, error in rows:
            if not ok:
                _print_failure(label, error)
            elif error:  # a note on a cell that passed
                print(f"  ✔ {label}\n      {error}")
        passed, total = passed + good, total + len(rows)
    for script in scripts:
        ok, error = run_script_check(script, ranks, timeout, truth / script.name)
        print(f"{script} under mpiexec -n {ranks}: {'passes' if ok else 'fails'}")
        if not ok:
            _print_failure("script", error)
        passed, total = passed + ok, total + 1
    verdict = "all pass" if passed == total else "not yet"
    if left:
        verdict += f"; still a stub: {'; '.join(places)}"
    print(f"exercise {nn}: {passed} of {total} checks pass ({verdict})")
    return 0 if passed == total else 1
