"""Write ``exercises/`` from ``solutions/``: the solutions are the one source of truth.

In a solution (a notebook's code cells, or a ``.py`` script) the code a learner should write
sits between two marker lines::

    def mean(values):
        ### BEGIN SOLUTION
        return sum(values) / len(values)
        ### END SOLUTION

The generated exercise keeps everything else and puts a stub at the marker's indent::

    def mean(values):
        # YOUR CODE HERE
        raise NotImplementedError()

Notebooks are rewritten with nbformat: code cells lose their outputs and execution counts
(every cell, so no solution output leaks), cells lose the timestamps of the solution's run,
and the saved widget state is dropped. Other files
in ``solutions/`` are not copied. Markers may not nest, every BEGIN needs its END, and a
line that looks like a marker but is not exactly one is an error (a typo would otherwise
leak the solution).

A learner never loses work: ``exercises/.generated.json`` records the SHA-256 of every file
as last written. A file that differs both from what the generator would write now and from
what it last wrote has been edited by hand, and is kept unless ``--force`` is given.

Lesson and solution notebooks are committed with their outputs. ``--execute`` runs them
first and saves them so that a second run gives the same file: no run timestamps, no widget
state, and widget outputs reduced to their plain text (JupyterLab would otherwise show
"model not found" for a widget until the cell is rerun; the quiz's text reads fine).

Command line (run from the course folder)::

    python -m minidist exercises              # write every exercise that is missing or stale
    python -m minidist exercises 01 02        # only chapters 01 and 02
    python -m minidist exercises --check      # exit 1 and list the files when exercises/ is out of date
    python -m minidist exercises --force 01   # overwrite chapter 01 even if you edited it
    python -m minidist exercises --execute 01 # run notebooks/01_*.ipynb and solutions/01_*.ipynb, then generate

Exit status: 0 done (or up to date; an exercise the learner edited is kept, and named, not an
error), 1 out of date (``--check``), a marker error or a notebook that failed to run
(``--execute``); 2 usage error (also a corrupt ``exercises/.generated.json``).
"""
from __future__ import annotations

import ast
import hashlib
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
STUB = ("# YOUR CODE HERE", "raise NotImplementedError()")
MANIFEST = ".generated.json"
SUFFIXES = (".ipynb", ".py")
_RUN_METADATA = ("execution", "ExecuteTime")  # timestamps of the run that produced the solution's outputs
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"  # a live widget's model id: random, useless once saved
# Anything that looks like a marker (any number of #, any case, any spacing) must be exact.
_MARKERISH = re.compile(r"^\s*#+\s*(BEGIN|END)\s+SOLUTION\b", re.IGNORECASE)


class MarkerError(ValueError):
    """Solution markers that cannot be turned into an exercise: nested, unbalanced, or
    malformed. The message names the file, the cell (notebooks) and the line."""


class ManifestError(ValueError):
    """``exercises/.generated.json`` is not what the generator writes (JSON mapping each
    exercise's file name to the SHA-256 of the text last written). The message names the file
    and the fix."""


def read_manifest(path: Path | str) -> dict[str, str]:
    """The manifest at ``path`` (``{file name: SHA-256 hex digest}``), or ``{}`` when there is
    none. Raises :class:`ManifestError` when it is not valid JSON or not such a mapping."""
    path = Path(path)
    if not path.exists():
        return {}
    fix = ("delete it and run `python -m minidist exercises`: it is written again, and every exercise that "
           "differs from its generated version is kept as your work")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ManifestError(f"{path} is not valid JSON ({error}); {fix}") from None
    if not (isinstance(manifest, dict) and all(isinstance(name, str) and isinstance(digest, str)
                                               and re.fullmatch(r"[0-9a-f]{64}", digest)
                                               for name, digest in manifest.items())):
        raise ManifestError(f"{path} is not a map of exercise file names to SHA-256 hashes; {fix}")
    return manifest


def strip_solutions(source: str, where: str = "<source>") -> str:
    """Return ``source`` with every BEGIN/END SOLUTION region (markers included) replaced by
    ``# YOUR CODE HERE`` and ``raise NotImplementedError()`` at the BEGIN marker's indent.

    Line endings of the kept lines are preserved; a source without markers comes back
    unchanged. Raises :class:`MarkerError` (with ``where`` and the 1-based line) for nested,
    unclosed, unopened or malformed markers.
    """
    out: list[str] = []
    opened_at: int | None = None
    for number, line in enumerate(source.splitlines(keepends=True), 1):
        text = line.strip()
        if _MARKERISH.match(line) and text not in (BEGIN, END):
            raise MarkerError(f"{where}, line {number}: malformed marker {text!r}; write {BEGIN!r} or {END!r}")
        if text == BEGIN:
            if opened_at is not None:
                raise MarkerError(f"{where}, line {number}: {BEGIN!r} inside the region opened on line {opened_at}")
            opened_at = number
            indent = line[: len(line) - len(line.lstrip())]
            newline = line[len(line.rstrip("\r\n")):] or "\n"
            out += [indent + STUB[0] + newline, indent + STUB[1] + newline]
        elif text == END:
            if opened_at is None:
                raise MarkerError(f"{where}, line {number}: {END!r} without a {BEGIN!r} before it")
            opened_at = None
            if not line.endswith(("\n", "\r")):  # END was the last line: no newline after the stub either
                out[-1] = out[-1].rstrip("\r\n")
        elif opened_at is None:
            out.append(line)
    if opened_at is not None:
        raise MarkerError(f"{where}, line {opened_at}: {BEGIN!r} is never closed by {END!r}")
    return "".join(out)


def solution_regions(source: str) -> list[str]:
    """The learner's parts of ``source``, in order: the lines between each BEGIN and END
    SOLUTION marker (markers excluded), joined by newlines. What :func:`strip_solutions`
    replaces; the tests use it to check that a notebook and its mpirun script hold the same code."""
    regions, inside = [], None
    for line in source.splitlines():
        if line.strip() == BEGIN:
            inside = []
        elif line.strip() == END:
            regions.append("\n".join(inside))
            inside = None
        elif inside is not None:
            inside.append(line)
    return regions


def solution_names(source: str) -> list[str]:
    """The names the learner's parts of the Python script ``source`` define, in order: for each
    top-level statement that holds a BEGIN SOLUTION line, the function or class it defines (or
    the names it assigns). The runner hands the learner's objects of these names to the
    exercise's own ``main()``. Raises SyntaxError when ``source`` does not parse."""
    lines = [number for number, line in enumerate(source.splitlines(), 1) if line.strip() == BEGIN]
    names = []
    for node in ast.parse(source).body:
        if not any(node.lineno <= number <= node.end_lineno for number in lines):
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found = [node.name]
        else:
            found = [n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
        names += [name for name in found if name not in names]
    return names


def stub_count(source: str) -> int:
    """How many generated stubs ``source`` (a cell or a file) contains: a script may hold one per
    function to write."""
    lines = [line.strip() for line in source.splitlines()]
    return sum(a == STUB[0] and b == STUB[1] for a, b in zip(lines, lines[1:]))


def is_stub(source: str) -> bool:
    """True when ``source`` (a cell or a file) contains a generated stub."""
    return stub_count(source) > 0


def exercise_notebook(text: str, where: str = "<notebook>") -> str:
    """The exercise for a solution notebook given as JSON text: markers replaced in code
    cells; all outputs, execution counts and run timestamps cleared; widget state dropped.
    Returns JSON text (nbformat's layout plus a final newline, as Jupyter saves it).
    Raises :class:`MarkerError`, also for markers in a markdown cell."""
    nb = nbformat.reads(text, as_version=4)
    for index, cell in enumerate(nb.cells):
        label = f"{where}, cell {index}"
        if cell.cell_type == "code":
            cell.source = strip_solutions(cell.source, label)
            cell.outputs = []
            cell.execution_count = None
        elif BEGIN in cell.source or END in cell.source:
            raise MarkerError(f"{label}: solution markers belong in code cells, not {cell.cell_type} cells")
    _drop_run_state(nb)
    return nbformat.writes(nb) + "\n"


def _drop_run_state(nb) -> None:
    """Remove what only says when and where a notebook ran: cell timestamps, widget state."""
    for cell in nb.cells:
        for key in _RUN_METADATA:
            cell.metadata.pop(key, None)
    nb.metadata.pop("widgets", None)


def execute_notebook(path: Path | str, timeout: int = 300) -> None:
    """Run the notebook at ``path`` in its own folder and save it in place with its outputs,
    reproducibly: no run timestamps, no widget state, widget outputs kept as plain text only.

    Uses the notebook's kernel (default ``python3``) and ``timeout`` seconds per cell; cells
    tagged ``raises-exception`` may fail. Raises nbclient's ``CellExecutionError`` (the cell and
    its traceback) when any other cell fails; the file is then left as it was.
    """
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    kernel = nb.metadata.get("kernelspec", {}).get("name", "python3")
    # The widget state is kept during the run (nbclient's hook for an ipywidgets.Output raises KeyError
    # without it) and dropped before saving (_drop_run_state).
    NotebookClient(nb, timeout=timeout, kernel_name=kernel, record_timing=False, store_widget_state=True,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            output.get("data", {}).pop(WIDGET_VIEW, None)
    _drop_run_state(nb)
    nbformat.write(nb, path)


def render_exercise(solution: Path) -> str:
    """The text of the exercise generated from the file ``solution`` (.ipynb or .py)."""
    text = solution.read_text(encoding="utf-8")
    if solution.suffix == ".ipynb":
        return exercise_notebook(text, str(solution))
    return strip_solutions(text, str(solution))


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass
class Report:
    """What one run did, as paths relative to the course folder."""

    written: list[str] = field(default_factory=list)
    up_to_date: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)  # would be written (only with check=True)
    # edited by a learner; not overwritten (with check=True: edits of the exercise as generated now)
    kept: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Nothing is out of date: no stale file (a learner's edits, kept, are fine)."""
        return not self.stale


def solution_files(root: Path, chapters: list[str] | None = None) -> list[Path]:
    """Solution files under ``root/solutions`` (.ipynb and .py), sorted, optionally only those
    whose name starts with one of the ``chapters`` (``"01"`` matches ``01_*``)."""
    return sorted(p for p in (root / "solutions").iterdir()
                  if p.suffix in SUFFIXES and p.is_file() and _in_chapters(p, chapters))


def _in_chapters(path: Path, chapters: list[str] | None) -> bool:
    return not chapters or any(path.name.startswith(f"{nn}_") for nn in chapters)


def generate(root: Path | str = ".", chapters: list[str] | None = None, *, check: bool = False,
             force: bool = False) -> Report:
    """Bring ``root/exercises`` up to date with ``root/solutions``.

    ``check=True`` writes nothing and lists the stale files: those the manifest does not record
    as generated from today's solutions (a solution changed and nobody regenerated), or missing;
    a learner's edit of an up-to-date exercise is listed in ``Report.kept``, not as stale, so
    that a learner's filled-in ``exercises/`` stays "up to date". Without ``force`` an exercise the
    learner edited (it differs from the new text and from the hash in the manifest) is kept
    and listed in ``Report.kept``. Raises :class:`MarkerError` before writing anything when a
    solution's markers are broken, :class:`ManifestError` when the manifest is corrupt,
    FileNotFoundError when there is no ``solutions/``.
    """
    root = Path(root)
    if not (root / "solutions").is_dir():
        raise FileNotFoundError(f"no solutions/ folder in {root.resolve()}: run this from the course folder")
    exercises = root / "exercises"
    manifest_path = exercises / MANIFEST
    manifest = read_manifest(manifest_path)
    planned = {f"exercises/{p.name}": render_exercise(p) for p in solution_files(root, chapters)}
    report = Report()
    changed = False
    for rel, text in planned.items():
        target = root / rel
        current = target.read_text(encoding="utf-8") if target.exists() else None
        name = target.name
        if current == text:
            report.up_to_date.append(rel)
            if manifest.get(name) != _sha256(text) and not check:
                manifest[name] = _sha256(text)
                changed = True
            continue
        edited = current is not None and _sha256(current) != manifest.get(name)
        if check:  # a learner's edit of the exercise as generated now is theirs; anything else is out of date
            (report.kept if edited and manifest.get(name) == _sha256(text) else report.stale).append(rel)
            continue
        if edited and not force:
            report.kept.append(rel)
            continue
        exercises.mkdir(exist_ok=True)
        target.write_text(text, encoding="utf-8")
        manifest[name] = _sha256(text)
        report.written.append(rel)
        changed = True
    if changed:
        manifest_path.write_text(json.dumps(dict(sorted(manifest.items())), indent=2) + "\n")
    return report


def _chapter_notebooks(root: Path, chapters: list[str] | None) -> list[Path]:
    """``notebooks/NN_*.ipynb`` then ``solutions/NN_*.ipynb`` for the chapters (all if None)."""
    return [p for folder in ("notebooks", "solutions")
            for p in sorted((root / folder).glob("[0-9][0-9]_*.ipynb")) if _in_chapters(p, chapters)]


def update_exercises(chapters: list[str] | None = None, *, root: Path | str = ".", check: bool = False,
                     force: bool = False, execute: bool = False) -> int:
    """``python -m minidist exercises``: bring ``root/exercises`` up to date (see the module
    docstring), print what was written, kept or is stale, and return the exit status: 0
    done or up to date (exercises the learner edited are kept and named: not an error), 1 out
    of date (``check``), a marker error or a notebook that failed to run (``execute``: the
    chapters' lesson and solution notebooks are run and saved first). ``chapters``: two-digit
    strings, None for all. The flags are parsed in :mod:`minidist.cli`; ``execute`` and
    ``check`` together raise ValueError."""
    if execute and check:
        raise ValueError("--execute writes notebooks; it cannot be combined with --check")
    root = Path(root)
    failures: tuple = (MarkerError, FileNotFoundError)
    try:
        if execute:
            failures += (CellExecutionError, CellTimeoutError, DeadKernelError)
            for notebook in _chapter_notebooks(root, chapters):
                print(f"executing {notebook.relative_to(root)}", flush=True)
                execute_notebook(notebook)
        report = generate(root, chapters, check=check, force=force)
    except ManifestError as error:  # a usage error: the learner's folder needs fixing first
        print(f"error: {error}", file=sys.stderr)
        return 2
    except failures as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for rel in report.written:
        print(f"wrote {rel}")
    for rel in report.kept:
        if check:
            print(f"{rel}: your own work (an edit of the current exercise)")
        else:
            print(f"kept {rel}: you have edited it (your work stays). To replace it with a fresh exercise, "
                  f"copy your work elsewhere, then rerun with --force {Path(rel).name[:2]}.")
    if report.stale:
        print("exercises/ is out of date with solutions/:", file=sys.stderr)
        for rel in report.stale:
            print(f"  {rel}", file=sys.stderr)
        print("run: python -m minidist exercises", file=sys.stderr)
    ok = report.ok  # a learner's edits are kept, never an error
    if check and ok:
        print(f"exercises/ is up to date ({len(report.up_to_date) + len(report.kept)} files"
              + (f", {len(report.kept)} of them with your own work)" if report.kept else ")"))
    return 0 if ok else 1

