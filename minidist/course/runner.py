"""``python -m minidist check NN``: run an exercise as the grader does and say what fails.

It runs ``exercises/NN_*.ipynb`` under nbval (lax mode: cells must run without error;
outputs are not compared, so your own prints are fine) with a per-cell timeout, runs
``exercises/NN_*.py`` under ``mpiexec -n 4`` when the chapter has such a script, and prints
a verdict naming each failing cell with its hint. Exit status: 0 all pass, 1 something
fails, 2 usage error (no such exercise, a notebook that is not a notebook, nbval missing).
Its arguments are parsed in :mod:`minidist.cli`, which calls :func:`run_check`.

A verdict comes only from code that ran. A cell counts as passed only when nbval's report
says it was executed and passed: a cell that was skipped, expected to fail, or is missing
from the report is a failure, and once a cell times out every later cell is a failure too
(nbval would mark them "expected to fail" and count a pass). nbval's markers that let a cell
be skipped or raise (``# NBVAL_SKIP``, ``# NBVAL_RAISES_EXCEPTION``, the tags ``nbval-skip``,
``raises-exception``) are switched off for the run by the hook at the end of this module,
so a stub cannot be hidden behind one: every cell must run without error.
"""
from __future__ import annotations

import importlib
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from minidist.course.checks import DEADLOCK_HINT, STUB_HINT

# Colour codes, raw or as pytest's JUnit XML writes them (#x1B).
_ANSI = re.compile(r"(?:\x1b|#x1B)\[[0-9;]*[A-Za-z]")
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit))(:.*)?$", re.MULTILINE)
NAME_HINT = "a name an earlier cell should have defined is missing: fix the first failing cell above"
_OTHER_OUTPUT = re.compile(r"^(Traceback |  File |Abort\(|\[)")
# nbval's markers that let a cell pass without running cleanly (nbval.plugin's names).
SKIP_MARKERS = ("NBVAL_SKIP", "NBVAL_RAISES_EXCEPTION")
SKIP_TAGS = ("nbval-skip", "nbval-raises-exception", "raises-exception")
_TIMEOUT = re.compile(r"Timeout of [\d.e+-]+ seconds exceeded")


class CheckError(Exception):
    """``check NN`` cannot run: a file that is not a notebook, nbval missing. The message
    names the file and the fix; :func:`run_check` prints it and exits with status 2."""


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
    import nbformat

    try:
        nb = nbformat.read(str(path), as_version=4)
        nbformat.validate(nb)
    except Exception as error:  # noqa: BLE001 (nbformat raises a dozen types for a bad file)
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckError(f"{path} is not a valid notebook ({reason[:200]}); open it in Jupyter and save it "
                         f"again, or get a fresh copy with `python -m minidist exercises --force "
                         f"{Path(path).name[:2]}` (that replaces your work in it)") from None
    return nb


def skip_markers(cell) -> list[str]:
    """The nbval markers on ``cell`` (comment lines or tags) that would let it be skipped or
    raise; the runner switches them off, and names them when the cell fails."""
    comments = {line.strip().lstrip("#").strip() for line in cell.source.splitlines() if line.strip().startswith("#")}
    tags = cell.metadata.get("tags", [])
    return [m for m in SKIP_MARKERS if m in comments] + [t for t in SKIP_TAGS if isinstance(tags, list) and t in tags]


def _case_outcome(case) -> tuple[str, str]:
    """``("passed" | "failed" | "timeout" | "skipped", error)`` of one JUnit test case."""
    problem = case.find("failure")
    problem = case.find("error") if problem is None else problem
    if problem is not None:
        text = f"{problem.get('message', '')}\n{problem.text or ''}"
        if _TIMEOUT.search(text):
            return "timeout", ""
        if "XPASS(strict)" in text:  # ran after a timeout (nbval marks those xfail): not counted
            return "skipped", "not counted: a cell before it timed out"
        return "failed", last_exception(problem.text or problem.get("message", ""))
    skipped = case.find("skipped")
    if skipped is not None:
        reason = (skipped.get("message") or skipped.text or "").strip()
        if "timed out" in reason:
            return "skipped", "not counted: a cell before it timed out"
        return "skipped", f"not run ({reason or 'skipped'}): only cells that ran count"
    return "passed", ""


def run_notebook_checks(notebook: Path, timeout: float) -> list[tuple[str, bool, str]]:
    """Run ``notebook`` under nbval (lax, current Python, ``timeout`` seconds per cell) in a
    subprocess; return one ``(cell label, passed, error)`` per code cell, in order.

    ``passed`` is True only for a cell nbval executed and passed (module docstring): a cell
    that timed out, every cell after it, and every cell skipped or missing from the report
    are failures. Raises :class:`CheckError` when the file is not a notebook or nbval did not run.
    """
    nb = read_notebook(notebook)
    code_cells = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    budget = timeout * (len(code_cells) + 2) + 120  # every wait has a deadline, nbval's too
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "--color=no", "-p", "no:cacheprovider",
               "-p", "no:randomly", "-p", __name__, "-o", "addopts=", "-o", "xfail_strict=true",
               "--nbval-lax", "--nbval-current-env", f"--nbval-cell-timeout={timeout:g}",
               f"--junitxml={report}", str(notebook)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=budget)
        except subprocess.TimeoutExpired:
            return [(f"cell {i + 1} ({_first_line(c.source)})", False,
                     f"not run: nbval did not finish within {budget:g} s") for i, c in code_cells]
        if not report.exists():
            raise CheckError(f"nbval did not run on {notebook} (is it installed? `pip install nbval`):\n"
                             f"{proc.stdout}\n{proc.stderr}".rstrip())
        outcomes: dict[int, tuple[str, str]] = {}
        for case in ET.parse(report).getroot().iter("testcase"):
            match = re.search(r"Cell (\d+)", case.get("name", ""))
            if match:
                outcomes[int(match.group(1))] = _case_outcome(case)
    rows, timed_out = [], None
    for k, (index, cell) in enumerate(code_cells):
        label = f"cell {index + 1} ({_first_line(cell.source)})"
        outcome, error = outcomes.get(k, ("skipped", "not run: nbval did not report this cell"))
        if timed_out is not None:  # whatever nbval said, a cell after a timeout is not counted
            outcome, error = "skipped", f"not counted: cell {timed_out} before it timed out"
        elif outcome == "timeout":
            timed_out = index + 1
            error = (f"timed out after {timeout:g} s (a loop that never ends, or a Recv that no Send "
                     f"matches?); the cells after it are not counted")
        markers = skip_markers(cell)
        if outcome != "passed" and markers:
            error += (f"\nnote: {', '.join(markers)} is ignored here: check runs every cell, "
                      "and every cell must run without error")
        rows.append((label, outcome == "passed", error))
    return rows


def run_script_check(script: Path, ranks: int, timeout: float) -> tuple[bool | None, str]:
    """Run an exercise script under ``mpiexec -n ranks`` through :mod:`minidist.launch`.
    Returns ``(passed, error)``; ``passed`` is None when the launcher is not available."""
    try:
        launcher = importlib.import_module("minidist.launch")
    except ImportError:
        return None, "skipped: minidist.launch is not available in this version"
    try:
        result = launcher.launch(str(script), ranks, timeout=timeout)
    except launcher.LaunchTimeout:  # a hang under MPI is almost always a deadlock
        return False, (f"timed out after {timeout:g} s: the ranks wait for each other (a deadlock?)\n"
                       f"Hint: {DEADLOCK_HINT}")
    except launcher.LaunchError as error:  # no mpiexec or no mpi4py: the message names the fix
        return False, str(error)
    if result.returncode == 0:
        return True, ""
    return False, last_exception(f"{result.stdout}\n{result.stderr}")


def _print_failure(label: str, error: str) -> None:
    print(f"  ✘ {label}")
    for line in error.splitlines():
        print(f"      {line}")
    if error.startswith("NotImplementedError"):
        print(f"      Hint: {STUB_HINT}")
    elif error.startswith("NameError"):
        print(f"      Hint: {NAME_HINT}")


def run_check(chapter: str, *, timeout: float, ranks: int, exercises: Path) -> int:
    """Check exercise ``chapter`` (two digits, e.g. ``"01"``) in the folder ``exercises``.

    Runs its notebook(s) under nbval with ``timeout`` seconds per cell and its mpirun script(s)
    under the launcher with ``ranks`` processes and ``timeout`` seconds, prints one line per
    file and each failing cell with its error and hint, then a verdict
    (``exercise 01: 7 of 7 checks pass``). Returns 0 when everything passes, 1 when something
    fails, 2 when exercise ``chapter`` does not exist (the message lists those that do).
    The arguments are validated by :mod:`minidist.cli` (``python -m minidist check NN``).
    """
    exercises = Path(exercises)
    nn = chapter
    notebooks = sorted(exercises.glob(f"{nn}_*.ipynb"))
    scripts = sorted(exercises.glob(f"{nn}_*.py"))
    if not notebooks and not scripts:
        have = sorted({p.name[:2] for p in exercises.glob("[0-9][0-9]_*") if p.suffix in (".ipynb", ".py")})
        print(f"minidist check: error: no exercise {nn} in {exercises}/ "
              f"(exercises there: {', '.join(have) or 'none'})", file=sys.stderr)
        return 2
    try:  # every notebook must be one before anything runs
        for notebook in notebooks:
            read_notebook(notebook)
    except CheckError as error:
        print(f"minidist check: error: {error}", file=sys.stderr)
        return 2
    passed = total = 0
    for notebook in notebooks:
        try:
            rows = run_notebook_checks(notebook, timeout)
        except CheckError as error:
            print(f"minidist check: error: {error}", file=sys.stderr)
            return 2
        good = sum(ok for _, ok, _ in rows)
        print(f"{notebook}: {good} of {len(rows)} cells pass")
        for label, ok, error in rows:
            if not ok:
                _print_failure(label, error)
        passed, total = passed + good, total + len(rows)
    for script in scripts:
        ok, error = run_script_check(script, ranks, timeout)
        if ok is None:
            print(f"{script}: {error}")
            continue
        print(f"{script} under mpiexec -n {ranks}: {'passes' if ok else 'fails'}")
        if not ok:
            _print_failure("script", error)
        passed, total = passed + ok, total + 1
    verdict = "all pass" if passed == total else "not yet"
    print(f"exercise {nn}: {passed} of {total} checks pass ({verdict})")
    return 0 if passed == total else 1


# ----------------------------------------------------------------------------- nbval hook
# run_notebook_checks loads this module into nbval's pytest (``-p minidist.course.runner``).
# nbval reads its markers into each cell item's ``options``; a grader honours none of those
# that let a cell pass without running cleanly.


def pytest_collection_modifyitems(items):
    """pytest hook: every notebook cell runs (no ``skip``) and must not raise (no
    ``check_exception``), whatever markers or tags it carries."""
    for item in items:
        options = getattr(item, "options", None)
        if options is not None:
            options["skip"] = False
            options["check_exception"] = False
