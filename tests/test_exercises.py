"""minidist.course.exercises: stubs at the right indent, broken markers refused, a learner's edits
kept, exercises/ in step with solutions/, and every generated exercise failing exactly where
the learner has work to do while its solution passes."""
import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from minidist import cli
from minidist.course import exercises
from minidist.course.exercises import MarkerError, strip_solutions

ROOT = Path(__file__).resolve().parents[1]

FUNCTION = '''def mean(values):
    """Average."""
    ### BEGIN SOLUTION
    total = sum(values)
    return total / len(values)
    ### END SOLUTION


print(mean([1, 2]))
'''


def test_region_in_a_function_becomes_a_stub_at_the_marker_indent():
    assert strip_solutions(FUNCTION) == '''def mean(values):
    """Average."""
    # YOUR CODE HERE
    raise NotImplementedError()


print(mean([1, 2]))
'''


def test_top_level_and_deeper_regions_and_untouched_sources():
    source = "x = 1\n### BEGIN SOLUTION\ny = 2\n### END SOLUTION\nfor i in range(3):\n    if i:\n" \
             "        ### BEGIN SOLUTION\n        print(i)\n        ### END SOLUTION\n        pass"
    assert strip_solutions(source) == "x = 1\n# YOUR CODE HERE\nraise NotImplementedError()\nfor i in range(3):\n" \
                                      "    if i:\n        # YOUR CODE HERE\n" \
                                      "        raise NotImplementedError()\n        pass"
    assert strip_solutions("a = 1\nb = 2") == "a = 1\nb = 2"
    # The last line of a notebook cell has no newline: neither does the stub that replaces it.
    assert strip_solutions("### BEGIN SOLUTION\nz = 3\n### END SOLUTION") == \
        "# YOUR CODE HERE\nraise NotImplementedError()"
    # Windows line endings survive.
    assert strip_solutions("a\r\n  ### BEGIN SOLUTION\r\n  b\r\n  ### END SOLUTION\r\nc\r\n") == \
        "a\r\n  # YOUR CODE HERE\r\n  raise NotImplementedError()\r\nc\r\n"


@pytest.mark.parametrize("source, message", [
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\nx\n### END SOLUTION\n### END SOLUTION\n",
     r"f\.py, line 2: '### BEGIN SOLUTION' inside the region opened on line 1"),
    ("x = 1\n### END SOLUTION\n", r"line 2: '### END SOLUTION' without"),
    ("### BEGIN SOLUTION\nx = 1\n", r"line 1: '### BEGIN SOLUTION' is never closed"),
    ("## BEGIN SOLUTION\nx = 1\n## END SOLUTION\n", r"line 1: malformed marker '## BEGIN SOLUTION'"),
    ("    ### end solution\n", "malformed marker"),
])
def test_nested_unbalanced_and_malformed_markers_raise(source, message):
    with pytest.raises(MarkerError, match=message):
        strip_solutions(source, "f.py")


def solution_notebook():
    nb = new_notebook(cells=[
        new_markdown_cell("# Title"),
        new_code_cell("import math", execution_count=1,
                      outputs=[nbformat.v4.new_output("stream", text="hello\n")],
                      metadata={"execution": {"iopub.status.idle": "2024-01-01T00:00:00Z"}}),
        new_code_cell("def f(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION", execution_count=2),
        new_code_cell("assert f(2) == 4", execution_count=3),
    ])
    nb.metadata["widgets"] = {"state": {}}
    return nbformat.writes(nb)


def test_notebook_exercise_replaces_regions_and_clears_every_output():
    nb = nbformat.reads(exercises.exercise_notebook(solution_notebook(), "s.ipynb"), as_version=4)
    assert nb.cells[0].source == "# Title"
    assert nb.cells[2].source == "def f(x):\n    # YOUR CODE HERE\n    raise NotImplementedError()"
    for cell in nb.cells[1:]:
        assert cell.outputs == [] and cell.execution_count is None and "execution" not in cell.metadata
    assert "widgets" not in nb.metadata
    assert exercises.is_stub(nb.cells[2].source) and not exercises.is_stub(nb.cells[3].source)


def test_markers_in_markdown_are_refused():
    nb = new_notebook(cells=[new_markdown_cell("### BEGIN SOLUTION\nsecret\n### END SOLUTION")])
    with pytest.raises(MarkerError, match="cell 0: solution markers belong in code cells"):
        exercises.exercise_notebook(nbformat.writes(nb), "s.ipynb")


@pytest.fixture
def course(tmp_path):
    (tmp_path / "solutions").mkdir()
    (tmp_path / "solutions" / "01_demo.py").write_text(FUNCTION)
    (tmp_path / "solutions" / "01_demo.ipynb").write_text(solution_notebook())
    (tmp_path / "solutions" / "02_other.py").write_text("### BEGIN SOLUTION\nx = 1\n### END SOLUTION\n")
    (tmp_path / "solutions" / "notes.txt").write_text("not an exercise")
    return tmp_path


def test_generate_writes_exercises_and_manifest_then_is_up_to_date(course, capsys):
    assert cli.main(["exercises", "--root", str(course)]) == 0
    written = sorted(p.name for p in (course / "exercises").iterdir())
    assert written == [".generated.json", "01_demo.ipynb", "01_demo.py", "02_other.py"]
    manifest = json.loads((course / "exercises" / ".generated.json").read_text())
    assert set(manifest) == {"01_demo.ipynb", "01_demo.py", "02_other.py"}
    assert "raise NotImplementedError()" in (course / "exercises" / "01_demo.py").read_text()
    assert cli.main(["exercises", "--root", str(course), "--check"]) == 0
    again = exercises.generate(course)
    assert again.written == [] and len(again.up_to_date) == 3


def test_check_lists_stale_files_and_exits_nonzero(course, capsys):
    exercises.generate(course)
    (course / "solutions" / "01_demo.py").write_text(FUNCTION.replace("Average", "Mean"))
    capsys.readouterr()
    assert cli.main(["exercises", "--root", str(course), "--check"]) == 1
    err = capsys.readouterr().err
    assert "exercises/01_demo.py" in err and "02_other" not in err
    # An unedited stale exercise is simply regenerated.
    assert cli.main(["exercises", "--root", str(course)]) == 0
    assert "Mean" in (course / "exercises" / "01_demo.py").read_text()


def test_an_edited_exercise_is_kept_unless_forced(course, capsys):
    exercises.generate(course)
    target = course / "exercises" / "01_demo.py"
    learner = target.read_text().replace("raise NotImplementedError()", "return sum(values) / len(values)")
    target.write_text(learner)
    (course / "solutions" / "01_demo.py").write_text(FUNCTION.replace("Average", "Mean"))
    # Keeping a learner's work is what `make exercises` should do: exit 0, naming the file kept.
    assert cli.main(["exercises", "--root", str(course)]) == 0
    out, err = capsys.readouterr()
    assert "kept exercises/01_demo.py: you have edited it (your work stays)" in out and "--force 01" in out
    assert err == ""
    assert target.read_text() == learner
    assert cli.main(["exercises", "--root", str(course), "--force", "01"]) == 0
    assert "Mean" in target.read_text() and "raise NotImplementedError()" in target.read_text()


def test_make_exercises_keeps_edits_with_status_0_and_fails_only_on_real_errors(course, capsys):
    """`make exercises` runs `python -m minidist exercises`: a learner's edited exercise is
    kept (named) and the command succeeds; a broken solution marker is still an error."""
    exercises.generate(course)
    target = course / "exercises" / "02_other.py"
    target.write_text("x = 41\n")
    done = subprocess.run([sys.executable, "-m", "minidist", "exercises", "--root", str(course)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "kept exercises/02_other.py" in done.stdout and target.read_text() == "x = 41\n"
    (course / "solutions" / "03_bad.py").write_text("### BEGIN SOLUTION\n")
    done = subprocess.run([sys.executable, "-m", "minidist", "exercises", "--root", str(course)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 1 and "03_bad.py, line 1" in done.stderr


def test_chapter_filter_and_usage_errors(course):
    report = exercises.generate(course, ["02"])
    assert report.written == ["exercises/02_other.py"]
    assert cli.main(["exercises", "--root", str(course), "two"]) == 2
    assert cli.main(["exercises", "--root", str(course), "--check", "--execute"]) == 2


def test_marker_error_is_reported_and_nothing_is_written(course, capsys):
    (course / "solutions" / "03_bad.py").write_text("### BEGIN SOLUTION\n")
    assert cli.main(["exercises", "--root", str(course)]) == 1
    assert "03_bad.py, line 1" in capsys.readouterr().err
    assert not (course / "exercises").exists()


@pytest.mark.slow
def test_execute_saves_outputs_reproducibly_with_widgets_as_text(tmp_path):
    nb = new_notebook(cells=[
        new_code_cell("print(6 * 7)"),
        new_code_cell("from minidist.course import quiz\n"
                      "quiz.show_flashcards([{'front': 'f', 'back': 'b'}], seed=None)"),
        new_code_cell("1 / 0", metadata={"tags": ["raises-exception"]}),
        new_code_cell("import ipywidgets\nout = ipywidgets.Output()\ndisplay(out)\n"
                      "with out:\n    print('in the widget')"),  # nbclient's Output hook needs the widget state
    ], metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    path = tmp_path / "07_demo.ipynb"
    nbformat.write(nb, path)
    exercises.execute_notebook(path)
    first = path.read_text()
    cells = nbformat.reads(first, as_version=4).cells
    assert cells[0].outputs[0].text == "42\n"
    assert cells[1].outputs[0].data == {"text/plain": "Flashcards (1 card, deck order)\n(answers hidden: run this "
                                                      "cell in Jupyter for the interactive cards, then Flip)\n1. f"}
    assert cells[2].outputs[0].ename == "ZeroDivisionError"
    assert [o.data for o in cells[3].outputs] == [{"text/plain": "Output()"}]  # what went into it: widget state
    assert all("execution" not in cell.metadata for cell in cells)
    exercises.execute_notebook(path)
    assert path.read_text() == first


def test_the_repository_exercises_are_up_to_date():
    """The manifest records today's rendering of every solution (a solution edited without
    regenerating fails here) and every exercise is that rendering or a learner's edit of it:
    a learner who fills in exercises/ still passes `make test`."""
    report = exercises.generate(ROOT, check=True)
    assert report.stale == [], f"run `python -m minidist exercises`: {report.stale} are out of date"
    assert report.up_to_date or report.kept, "solutions/ should hold at least one exercise"


def test_a_learners_filled_in_exercise_is_not_stale_but_a_changed_solution_is(course, capsys):
    exercises.generate(course)
    target = course / "exercises" / "01_demo.py"
    target.write_text(target.read_text().replace("raise NotImplementedError()", "return sum(values) / len(values)"))
    report = exercises.generate(course, check=True)
    assert report.stale == [] and report.kept == ["exercises/01_demo.py"]
    assert cli.main(["exercises", "--root", str(course), "--check"]) == 0
    out = capsys.readouterr().out
    assert "exercises/01_demo.py: your own work" in out and "up to date (3 files, 1 of them with your own work)" in out
    # The instructor changes the solution and forgets to regenerate: stale, edited or not.
    (course / "solutions" / "01_demo.py").write_text(FUNCTION.replace("Average", "Mean"))
    (course / "solutions" / "02_other.py").write_text("y = 0\n### BEGIN SOLUTION\nx = 2\n### END SOLUTION\n")
    assert exercises.generate(course, check=True).stale == ["exercises/01_demo.py", "exercises/02_other.py"]
    assert cli.main(["exercises", "--root", str(course), "--check"]) == 1


@pytest.mark.parametrize("text", ["{not json", "[]", '{"01_demo.py": 3}', '{"01_demo.py": "abc"}'])
def test_a_corrupt_manifest_is_a_usage_error_naming_it(course, capsys, text):
    exercises.generate(course)
    manifest = course / "exercises" / ".generated.json"
    manifest.write_text(text)
    for args in ([], ["--check"]):
        assert cli.main(["exercises", "--root", str(course), *args]) == 2
        err = capsys.readouterr().err
        assert f"error: {manifest} is not " in err and "delete it and run `python -m minidist exercises`" in err
        assert "Traceback" not in err
    manifest.unlink()  # the fix it names works, and keeps a learner's edit
    target = course / "exercises" / "01_demo.py"
    target.write_text(target.read_text() + "# mine\n")
    assert cli.main(["exercises", "--root", str(course)]) == 0
    assert target.read_text().endswith("# mine\n")


# ----------------------------------------------------------------------------- every exercise fails where it should

SOLUTION_NOTEBOOKS = sorted((ROOT / "solutions").glob("*.ipynb"))
SOLUTION_SCRIPTS = sorted((ROOT / "solutions").glob("*.py"))


def run_cells(path: Path) -> list[tuple[int, str, str | None]]:
    """Execute a notebook (continuing past errors) in its own folder; return
    ``(cell index, source, exception name or None)`` for every code cell."""
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    rows = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            ename = next((o.ename for o in cell.outputs if o.output_type == "error"), None)
            rows.append((index, cell.source, ename))
    return rows


def fresh_exercises(tmp_path: Path, solution: Path) -> Path:
    """The chapter's exercises as generated now (notebook and scripts, which its cells may
    launch) in ``tmp_path``: exercises/ may hold a learner's work. Returns the one for ``solution``."""
    for path in exercises.solution_files(ROOT, [solution.name[:2]]):
        (tmp_path / path.name).write_text(exercises.render_exercise(path), encoding="utf-8")
    return tmp_path / solution.name


@pytest.mark.slow
@pytest.mark.parametrize("solution", SOLUTION_NOTEBOOKS, ids=lambda p: p.name)
def test_exercise_fails_in_its_exercise_cells_only(solution, tmp_path):
    """Cells before the first stub run cleanly; from each stub up to the next one, the first
    error is the stub's NotImplementedError or a check's AssertionError (a LearnerError when
    the check called the stub; later errors in the same stretch follow from it). That the
    solution runs without an error, and passes its checks, is nbval's test of solutions/ (make
    test-notebooks) and test_check_cheats' honest run of ``check NN``."""
    rows = run_cells(fresh_exercises(tmp_path, solution))
    stubs = [k for k, (_, source, _) in enumerate(rows) if exercises.is_stub(source)]
    assert stubs, f"{solution.name} has no ### BEGIN SOLUTION region"
    for index, _, ename in rows[: stubs[0]]:
        assert ename is None, f"cell {index} fails ({ename}) before any exercise cell"
    for start, end in zip(stubs, stubs[1:] + [len(rows)]):
        errors = [(index, ename) for index, _, ename in rows[start:end] if ename]
        assert errors, f"exercise in cell {rows[start][0]}: nothing fails while it is a stub; add a check"
        assert errors[0][1] in ("NotImplementedError", "AssertionError", "LearnerError"), \
            f"exercise in cell {rows[start][0]}: first failure is {errors[0]}"


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("solution", SOLUTION_SCRIPTS, ids=lambda p: p.name)
def test_exercise_script_fails_and_solution_script_passes(solution, tmp_path):
    from minidist.course.runner import run_script_check

    ok, error = run_script_check(fresh_exercises(tmp_path, solution), 4, 60, solution)
    assert ok is False and (error.startswith("NotImplementedError") or ": this is still a stub: " in error), error
    ok, error = run_script_check(solution, 4, 60, solution)
    assert ok is True, error
