"""``python -m minidist check NN``: run an exercise as the grader does and say what fails.

It runs ``exercises/NN_*.ipynb`` under nbval (lax mode: cells must run without error;
outputs are not compared, so your own prints are fine) with a per-cell timeout, runs
``exercises/NN_*.py`` under ``mpiexec -n 4`` when the chapter has such a script, and prints
a verdict naming each failing cell with its hint. Exit status: 0 all pass, 1 something
fails, 2 usage error. Its arguments are parsed in :mod:`minidist.cli`, which calls
:func:`run_check`.
"""
from __future__ import annotations

import importlib
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path


# Colour codes, raw or as pytest's JUnit XML writes them (#x1B).
_ANSI = re.compile(r"(?:\x1b|#x1B)\[[0-9;]*[A-Za-z]")
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit))(:.*)?$", re.MULTILINE)
NAME_HINT = "a name an earlier cell should have defined is missing: fix the first failing cell above"
_OTHER_OUTPUT = re.compile(r"^(Traceback |  File |Abort\(|\[)")
STUB_HINT = "this is still a stub: replace `# YOUR CODE HERE` and `raise NotImplementedError()` with your code"


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


def run_notebook_checks(notebook: Path, timeout: float) -> list[tuple[str, bool, str]]:
    """Run ``notebook`` under nbval (lax, current Python, ``timeout`` seconds per cell) in a
    subprocess; return one ``(cell label, passed, error)`` per code cell, in order."""
    import nbformat

    nb = nbformat.read(str(notebook), as_version=4)
    code_cells = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "--color=no", "-p", "no:cacheprovider",
               "-p", "no:randomly", "-o", "addopts=", "--nbval-lax", "--nbval-current-env",
               f"--nbval-cell-timeout={timeout:g}", f"--junitxml={report}", str(notebook)]
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              timeout=timeout * (len(code_cells) + 2) + 120)
        if not report.exists():
            raise RuntimeError(f"nbval did not run:\n{proc.stdout}\n{proc.stderr}")
        cases = ET.parse(report).getroot().iter("testcase")
        results: dict[int, tuple[bool, str]] = {}
        for case in cases:
            match = re.search(r"Cell (\d+)", case.get("name", ""))
            if not match:
                continue
            problem = case.find("failure")
            problem = case.find("error") if problem is None else problem
            error = "" if problem is None else last_exception(problem.text or problem.get("message", ""))
            results[int(match.group(1))] = (problem is None, error)
    rows = []
    for k, (index, cell) in enumerate(code_cells):
        passed, error = results.get(k, (False, "not run"))
        rows.append((f"cell {index + 1} ({_first_line(cell.source)})", passed, error))
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
    except launcher.LaunchTimeout:
        return False, f"timed out after {timeout:g} s (a deadlock? every Send needs its Recv)"
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
    passed = total = 0
    for notebook in notebooks:
        rows = run_notebook_checks(notebook, timeout)
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
