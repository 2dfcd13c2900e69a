"""Lessons and quiz decks of chapters 07-12 against their own outputs.

Every number a lesson's prose quotes about a cell is checked against what that cell printed in
the committed notebook (the output a learner sees before running anything). Cells are found by
a phrase they contain, not by their index, so inserting a cell does not break the tests.
"""
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]


def lesson(name: str) -> nbformat.NotebookNode:
    """The committed notebook notebooks/<name>.ipynb, outputs included."""
    return nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)


def cell_with(nb: nbformat.NotebookNode, marker: str, cell_type: str) -> nbformat.NotebookNode:
    """The one cell of ``cell_type`` whose source contains ``marker``; fails if none or several do."""
    found = [cell for cell in nb.cells if cell.cell_type == cell_type and marker in cell.source]
    assert len(found) == 1, f"{len(found)} {cell_type} cells contain {marker!r}"
    return found[0]


def printed(cell: nbformat.NotebookNode) -> str:
    """The text a code cell printed (streams and text/plain results), as saved in the notebook."""
    parts = []
    for output in cell.get("outputs", []):
        if output.get("output_type") == "stream":
            parts.append(output["text"])
        elif "text/plain" in output.get("data", {}):
            parts.append(output["data"]["text/plain"])
    return "".join(parts)


def prose(text: str) -> str:
    """Markdown with its line breaks folded into spaces, so a phrase may wrap anywhere."""
    return re.sub(r"\s+", " ", text)


def number_after(pattern: str, text: str) -> float:
    """The number that the regular expression's group 1 matches in ``text`` (fails if absent)."""
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not found in {text[:300]!r}"
    return float(match.group(1))


def markdown(nb: nbformat.NotebookNode) -> str:
    return prose(" ".join(cell.source for cell in nb.cells if cell.cell_type == "markdown"))


# ----------------------------------------------------------------------------- chapters 07 and 08: m < p


@pytest.mark.parametrize("name, marker", [("07_model_parallelism", "## 2. The naive layer split")])
def test_lessons_say_torch_refuses_fewer_microbatches_than_stages_for_gpipe_too(name, marker):
    # torch.distributed.pipelining's PipelineScheduleSingle.__init__ raises ValueError for
    # n_microbatches < num_stages since pytorch/pytorch#144702 (January 2025): GPipe and 1F1B alike.
    text = prose(cell_with(lesson(name), marker, "markdown").source)
    assert "ScheduleGPipe` as well as" in text and "Schedule1F1B" in text, text
    assert "pytorch/pytorch#144702" in text and "January 2025" in text
    assert not re.search(r"(?i)(py)?torch \d+\.\d+", text), "no release number: the PR's date is what we know"


def test_lesson_07_defines_the_bubble_once_as_the_simulator_computes_it():
    text = markdown(lesson("07_model_parallelism"))
    assert text.count("This is the one definition of the bubble") == 1
    assert "schedules.simulate(...).bubble_fraction" in text
