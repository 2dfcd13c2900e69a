"""Lesson 15 (sharded data parallelism) and its deck against the lesson's own outputs.

Every number the prose quotes about a cell is checked against what that cell printed in the
committed notebook (the output a learner sees before running anything). Cells are found by a
phrase they contain, not by their index. The measured table is also checked against its own
formulas (the ZeRO paper's fractions and the ring's bytes), so a changed engine (an array kept,
a message more) fails here, not silently in the prose.
"""
import re

import pytest
from lesson_outputs import cell_with, lesson, lesson_prose, number, printed, prose

NAME = "15_sharded_data_parallel"
STAGES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")


@pytest.fixture(scope="module")
def nb():
    return lesson(NAME)


@pytest.fixture(scope="module")
def text(nb):
    return lesson_prose(nb)


def test_the_memory_wall_and_the_stages_per_parameter(nb, text):
    out = printed(cell_with(nb, "for billions in"))
    assert number(r"7\.5 B parameters:\s+([\d,]+) GB", out) == 120
    assert number(r"175 B parameters:\s+([\d,]+) GB", out) == 2800
    assert "a model of 7.5 billion parameters needs 120 GB on *every* GPU" in text
    assert "7.5B model needs 120 GB on every GPU" in text and "175B needs 2,800 GB" in text
    drawn = printed(cell_with(nb, "P_DRAW = 4"))
    assert "DDP 16, ZeRO-1 7, ZeRO-2 5.5, ZeRO-3 4" in drawn
    assert "16 bytes per parameter under DDP, 7 under ZeRO-1, 5.5 under ZeRO-2 and 4 under ZeRO-3" in text


def test_reduce_scatter_and_all_gather_send_what_an_all_reduce_sends(nb, text):
    out = printed(cell_with(nb, "def sent(comm, what)"))
    sends = [number(r"([\d,]+) bytes per rank", line) for line in out.splitlines()]
    assert sends == [7200, 7200] and out.count("= 7,200") == 2
    assert "Both send 7,200 bytes per rank" in text


def table(out: str) -> dict:
    """{(P, stage): [parameters, formula, gradients, formula, optimizer, formula, sent, formula, activations]}."""
    rows = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) == 7 and parts[0].isdigit():
            numbers = [float(n.replace(",", "")) for cell in parts[2:] for n in cell.split("/")]
            rows[int(parts[0]), parts[1]] = numbers
    return rows


def test_the_measured_table_equals_its_formulas_and_the_prose(nb, text):
    out = printed(cell_with(nb, "def one_step"))
    rows = table(out)
    assert set(rows) == {(p, s) for p in (1, 2, 4) for s in STAGES}
    psi = number(r"Ψ = ([\d,]+) parameters", out)
    for (p, stage), r in rows.items():
        assert r[2:4] == [r[3], r[3]] and r[4] == r[5] and r[6] == r[7], (p, stage)  # gradients, state, bytes
        level = STAGES.index(stage)
        assert r[5] == 8 * psi / (p if level >= 1 else 1) and r[3] == 4 * psi / (p if level >= 2 else 1)
        assert r[7] == (3 if level == 3 else 2) * 4 * psi * (p - 1) / p
        assert r[0] == 4 * psi / (p if level >= 2 else 1)  # ZeRO-2 keeps shards between steps (the prose says why)
    assert f"Ψ = {psi:,.0f}" in text
    assert f"ZeRO-1 keeps {rows[4, 'ZeRO-1'][4]:,.0f} bytes of AdamW state, a quarter of DDP's " \
           f"{rows[1, 'DDP'][4]:,.0f}" in text
    assert f"{rows[2, 'DDP'][6]:,.0f} per rank and step for DDP, ZeRO-1 and ZeRO-2 on 2 ranks, " \
           f"{rows[2, 'ZeRO-3'][6]:,.0f} for ZeRO-3, 1.5 times" in text
    assert rows[2, "ZeRO-3"][6] == 1.5 * rows[2, "ZeRO-2"][6]
    assert f"**ZeRO-2's parameters**, {rows[2, 'ZeRO-2'][0]:,.0f} bytes on 2 ranks where the formula says " \
           f"{rows[2, 'ZeRO-2'][1]:,.0f}" in text
    ddp_act, fsdp_act = rows[1, "DDP"][8], rows[1, "ZeRO-3"][8]
    assert all(r[8] in (ddp_act, fsdp_act) for r in rows.values()) and fsdp_act - ddp_act == 4
    state = sum(rows[1, "DDP"][i] for i in (0, 2, 4))
    assert f"they are {ddp_act:,.0f} bytes under DDP (FSDP keeps 4 more" in text
    assert f"{ddp_act / state:.1f} times all the model state of one rank under DDP ({state:,.0f} bytes)" in text


def test_prefetch_order_and_timeline(nb, text):
    order = printed(cell_with(nb, "def gather_order"))
    without, with_ = order.splitlines()
    assert "prefetch transformer" not in without
    assert "forward root, prefetch transformer.h.0, forward transformer.h.0, prefetch transformer.h.1" in with_
    assert with_.endswith("backward root, backward transformer.h.1, backward transformer.h.0")
    timeline = printed(cell_with(nb, "compute, gather = 1.0, 0.6"))
    slow, fast = number(r"without prefetch ([\d.]+)", timeline), number(r"with prefetch ([\d.]+)", timeline)
    assert (slow, fast) == (6.4, 4.6)
    assert f"4 × (0.6 + 1.0) = {slow}" in text and f"0.6 + 4 × 1.0 = {fast}" in text
    assert "benchmarks/bench_sharding.py" in text


def test_the_175b_calculator(nb, text):
    out = printed(cell_with(nb, "def per_gpu_gb"))
    rows = {int(line.split("|")[0]): [float(x.replace(",", "")) for x in line.split("|")[1:]]
            for line in out.splitlines() if re.match(r"\s*\d+ \|", line)}
    assert set(rows) == {8, 64, 128, 512, 1024} and all(r[0] == 2800 for r in rows.values())
    assert f"{rows[1024][3]} GB per GPU on 1,024 GPUs, {rows[64][3]} GB on 64" in text
    assert f"{rows[1024][1]} and {rows[1024][2]} GB on 1,024 GPUs" in text
    ddp, zero3 = number(r"1,024 GPUs: ([\d,]+) GB \(DDP", out), number(r", ([\d,]+) GB \(ZeRO-3\)", out)
    assert f"sends {zero3:,.0f} GB of fp16 values under ZeRO-3 against {ddp:,.0f} GB under DDP" in text


def test_the_deck_is_shown_at_the_end(nb):
    codes = [cell.source for cell in nb.cells if cell.cell_type == "code"]
    assert f'quiz.show_flashcards("{NAME}")' in codes[-2] and f'quiz.show_quiz("{NAME}")' in codes[-1]
    assert "(7 cards" in printed(nb.cells[-2]) and "(5 questions)" in printed(nb.cells[-1])


def test_the_exercise_prose_quotes_its_cell():
    import nbformat
    from lesson_outputs import ROOT

    solved = nbformat.read(ROOT / "solutions" / f"{NAME}.ipynb", as_version=4)
    out = printed(cell_with(solved, "def try_step"))
    assert out.count("equal to one process to 1e-12: True, moments of 4 numbers, 16 values sent") == 3
    words = prose(" ".join(cell.source for cell in solved.cells if cell.cell_type == "markdown"))
    assert "moments of 4 numbers instead of 11 and sends 16 values: 2(P − 1)s = 2 · 2 · 4" in words
