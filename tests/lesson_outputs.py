"""Reading a committed lesson as a learner first sees it: its cells, what they printed, its
prose. Shared by the content tests (tests/test_content_*.py), which check every number a
lesson's prose quotes against the output of the cell it is about. Cells are found by a phrase
they contain, not by their index, so inserting a cell does not break the tests."""
import re
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]


def lesson(name: str) -> nbformat.NotebookNode:
    """The committed notebook notebooks/<name>.ipynb, outputs included."""
    return nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)


def cell_with(nb: nbformat.NotebookNode, marker: str, cell_type: str = "code") -> nbformat.NotebookNode:
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


def lesson_prose(nb: nbformat.NotebookNode) -> str:
    """All of a lesson's markdown cells as one :func:`prose` string (a phrase may cross cells)."""
    return prose(" ".join(cell.source for cell in nb.cells if cell.cell_type == "markdown"))


def number(pattern: str, text: str) -> float:
    """The number (commas allowed) in the first group of ``pattern``'s first match in ``text``;
    fails naming the pattern and the start of the text when there is none."""
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not found in {text[:600]!r}"
    return float(match.group(1).replace(",", ""))
