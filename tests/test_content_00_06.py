"""Lessons and quiz decks of chapters 00-06 against their own outputs and their sources.

Every number a lesson's prose quotes about a cell is checked against what that cell printed in
the committed notebook (the output a learner sees before running anything). Cells are found by
a phrase they contain, not by their index, so inserting a cell does not break the tests.
"""
import difflib
import re
from pathlib import Path

import nbformat

from minidist.course import quiz

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


def words(text: str) -> str:
    return re.sub(r"[^a-z0-9 ]", "", text.lower()).strip()


def choice_questions(deck: str) -> list[dict]:
    return [q for q in quiz.load_deck(deck) if q["type"] in ("multiple_choice", "many_choice")]


# ----------------------------------------------------------------------------- chapter 00

# The answers of the source flashcards (L9 Systems for ML: the lifecycle cards) that deck 00's
# checkbox questions ask about. An option must say the same thing in other words.
SOURCE_CARD_ANSWERS = [
    "throughput", "accuracy", "latency",
    "identify sources of data", "join data from multiple sources", "clean data", "plot trends and anomalies",
    "build informative features", "design new model architectures", "tune hyperparameters",
    "validate prediction accuracy",
    "retrain", "track data and code (for debugging)", "capture dependencies", "audit, e.g. data privacy",
    "train models on live data", "retrain on new data", "validate accuracy", "manage versioning",
    "server models with real data (in real-time)", "embed model serving insides the end-user app",
    "optimise for low latency", "quantise model weights for memory efficiency",
]


def test_deck_00_checkbox_options_do_not_echo_the_source_cards():
    echoes = []
    for spec in quiz.load_deck("00_start_here"):
        if spec["type"] != "many_choice":
            continue
        for answer in spec["answers"]:
            for card in SOURCE_CARD_ANSWERS:
                similarity = difflib.SequenceMatcher(None, words(answer["answer"]), words(card)).ratio()
                if similarity >= 0.6:
                    echoes.append(f"{spec['id']}: {answer['answer']!r} ~ {card!r} ({similarity:.2f})")
    assert not echoes, "\n".join(echoes)


# ----------------------------------------------------------------------------- chapter 01

def test_lesson_01_gives_backward_the_cost_chapters_07_and_10_use():
    # One cost for the backward pass across the course: about two forwards (for a matrix
    # product, one product for the input's gradient and one for the weight's), the ratio that
    # chapter 07's Work layer (1 ms forward, 2 ms backward) and chapter 10's recomputation
    # arithmetic (3 forward-equivalents a step) use. Lesson 01 once said "one extra forward".
    text = prose(cell_with(lesson("01_autograd"), "## 1. Gradients of single numbers", "markdown").source)
    assert "one extra forward" not in text
    assert re.search(r"about \*{0,2}two forward passes\*{0,2}", text), text
    assert "input" in text and "weight" in text  # why two: both gradients of a product


# ----------------------------------------------------------------------------- chapter 04

def test_lesson_04_quotes_the_link_speed_ups_its_table_prints():
    nb = lesson("04_ring_allreduce")
    out = printed(cell_with(nb, "link_models = {name: CostModel", "code"))
    speed_up = re.search(r"NVLink 4 / NVSwitch against PCIe 3\.0 x16, ring: (\d+)x faster \(ResNet-50, float32\), "
                         r"(\d+)x faster \(GPT-2 XL, 16-bit\)", out)
    naive = re.search(r"naive \(PS\) / ring, every link and gradient: ([\d.]+)x to ([\d.]+)x", out)
    assert speed_up and naive, out
    text = prose(cell_with(nb, "On PCIe 3.0 the ResNet-50 gradient", "markdown").source)
    resnet, gpt = speed_up.groups()
    assert f"Over NVLink 4 both are {resnet} and {gpt} times faster" in text, text
    low, high = naive.groups()
    assert f"exchange costs {float(low):.0f} to {float(high):.0f} times the ring" in text, text
