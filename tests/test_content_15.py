"""Lesson 15 (sharded data parallelism) and its deck against the lesson's own outputs.

Every number the prose quotes about a cell is checked against what that cell printed in the
committed notebook (the output a learner sees before running anything). Cells are found by a
phrase they contain, not by their index. The measured table is also checked against its own
formulas (the ZeRO paper's fractions and the ring's bytes), so a changed engine (an array kept,
a message more) fails here, not silently in the prose.
"""
import json
import re

import pytest
from lesson_outputs import ROOT, cell_with, lesson, lesson_prose, number, printed, prose

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
    assert question("zero2-bytes-per-parameter")["answers"][0]["value"] == 5.5
    source = cell_with(nb, "P_DRAW = 4").source  # one legend, not a label over every narrow band (they overlapped)
    assert "fig.legend(" in source and "ax.text(" not in source
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
    assert question("zero3-bytes-measured")["answers"][0]["value"] == rows[4, "ZeRO-3"][6]
    assert question("zero3-bytes-measured")["answers"][1]["value"] == rows[4, "DDP"][6]
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
    assert question("prefetch-timeline")["answers"][0]["value"] == fast
    assert question("prefetch-timeline")["answers"][1]["value"] == slow


def question(qid: str) -> dict:
    deck = json.loads((ROOT / "minidist" / "course" / "quizzes" / f"{NAME}.json").read_text())
    return next(q for q in deck["questions"] if q["id"] == qid)


def test_the_step_times_are_quoted_from_the_saved_runs(nb, text):
    # bench_sharding.py --json, three runs saved under notebooks/measurements/; the cell reads them
    runs = [json.loads(path.read_text()) for path in sorted((ROOT / "notebooks" / "measurements").glob(
        "bench_sharding_run*.json"))]
    assert len(runs) == 3 and all(r["step_time"]["where"] == "mpiexec, 2 ranks" for r in runs)
    out = printed(cell_with(nb, "bench_sharding_run*.json"))
    for k, run in enumerate(runs, 1):
        line = next(line for line in out.splitlines() if line.startswith(f"{k:>3} |"))
        printed_ratios = [float(x) for x in line.split("|")[2:]]
        of_ddp = run["step_time"]["of_ddp"]
        expected = [of_ddp[n] for n in ("zero1", "zero2", "zero2 no prefetch", "zero3", "zero3 no prefetch")]
        assert printed_ratios == [round(x, 2) for x in expected], k
    gains = {}
    for stage in ("zero2", "zero3"):
        gains[stage] = [r["step_time"]["of_ddp"][f"{stage} no prefetch"] - r["step_time"]["of_ddp"][stage]
                        for r in runs]
        assert f"{stage}: prefetch saves {', '.join(f'{g:+.2f}' for g in gains[stage])}" in out
        assert min(gains[stage]) < 0 < max(gains[stage])  # the sign changes between runs: noise
    said = ", ".join(f"{g:+.2f}".replace("-", "−") for g in gains["zero2"])
    assert f"for ZeRO-2 ({said} of DDP's step)" in text
    said = ", ".join(f"{g:+.2f}".replace("-", "−") for g in gains["zero3"])
    assert f"for ZeRO-3 ({said})" in text and "**within the noise**" in text
    zero1 = [r["step_time"]["of_ddp"]["zero1"] for r in runs]
    assert f"between {min(zero1):.2f} and {max(zero1):.2f} of DDP" in text
    assert all(r["step_time"]["of_ddp"]["zero3"] > 1 for r in runs) and "What every run shows is ZeRO-3 slower" in text
    assert "1.19 to 1.20" not in text and "between a sixth and a quarter" not in text  # the old, unsaved quotes
    assert "+0.13, −0.03, +0.08" in next(a["feedback"] for a in question("prefetch-noise")["answers"]
                                        if a["correct"])


def test_the_175b_calculator(nb, text):
    out = printed(cell_with(nb, "def per_gpu_gb"))
    rows = {int(line.split("|")[0]): [float(x.replace(",", "")) for x in line.split("|")[1:]]
            for line in out.splitlines() if re.match(r"\s*\d+ \|", line)}
    assert set(rows) == {8, 64, 128, 512, 1024} and all(r[0] == 2800 for r in rows.values())
    assert f"{rows[1024][3]} GB per GPU on 1,024 GPUs, {rows[64][3]} GB on 64" in text
    assert f"{rows[1024][1]} and {rows[1024][2]} GB on 1,024 GPUs" in text
    ddp, zero3 = number(r"1,024 GPUs: ([\d,]+) GB \(DDP", out), number(r", ([\d,]+) GB \(ZeRO-3\)", out)
    assert question("zero3-175b-1024")["answers"][0]["value"] == rows[1024][3]
    assert question("zero3-175b-1024")["answers"][1]["value"] == rows[1024][2]
    floor = question("zero1-floor")  # 4Ψ = 700 GB, and the printed 702.1 on 1,024 GPUs within its tolerance
    assert floor["answers"][0]["value"] == 700 and abs(rows[1024][1] - 700) <= floor["tolerance"]
    assert "the 4Ψ = 700 GB of parameters and gradients" in text
    assert f"sends {zero3:,.0f} GB of fp16 values under ZeRO-3 against {ddp:,.0f} GB under DDP" in text


def test_the_deck_has_numeric_questions_and_no_option_length_gives_the_answer_away():
    deck = json.loads((ROOT / "minidist" / "course" / "quizzes" / f"{NAME}.json").read_text())
    assert len(deck["questions"]) >= 12 and sum(q["type"] == "numeric" for q in deck["questions"]) >= 5
    for q in deck["questions"]:
        if q["type"] == "multiple_choice":
            right = next(len(a["answer"]) for a in q["answers"] if a["correct"])
            others = [len(a["answer"]) for a in q["answers"] if not a["correct"]]
            assert right <= max(others) and (right >= min(others) or right <= 3), q["id"]  # numbers may be short


def test_the_deck_is_shown_at_the_end(nb):
    codes = [cell.source for cell in nb.cells if cell.cell_type == "code"]
    assert f'quiz.show_flashcards("{NAME}")' in codes[-2] and f'quiz.show_quiz("{NAME}")' in codes[-1]
    assert "(7 cards" in printed(nb.cells[-2]) and "(13 questions)" in printed(nb.cells[-1])


def test_the_exercise_prose_quotes_its_cell():
    import nbformat
    from lesson_outputs import ROOT

    solved = nbformat.read(ROOT / "solutions" / f"{NAME}.ipynb", as_version=4)
    out = printed(cell_with(solved, "def try_step"))
    assert out.count("equal to one process to 1e-12: True, moments of 4 numbers, 16 values sent") == 3
    words = prose(" ".join(cell.source for cell in solved.cells if cell.cell_type == "markdown"))
    assert "moments of 4 numbers instead of 11 and sends 16 values: 2(P − 1)s = 2 · 2 · 4" in words
