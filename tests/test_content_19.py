"""Lesson 19 (context parallelism) and its deck against their own outputs.

Every number the prose quotes about a cell is checked against what that cell printed in the
committed notebook; the printed numbers are also recomputed here from closed forms and from a
plain softmax (oracles independent of the engine): the bytes the dense and tiled ops keep, the
online softmax's six keys, the ring's and Ulysses' bytes per rank, the block pairs of the two
layouts, the ring's overlap in virtual time. The mpiexec and benchmark cells are
``# NBVAL_IGNORE_OUTPUT`` and the prose quotes none of their output. The deck keeps chapter 13
on's rules (12 questions or more, 3 numeric, the right option neither the longest nor the
shortest)."""
import json
import re
from pathlib import Path

import numpy as np
import pytest
from lesson_outputs import cell_with, lesson, lesson_prose, number, printed

from minidist.course import quiz

NAME = "19_context_parallelism"


@pytest.fixture(scope="module")
def nb():
    return lesson(NAME)


@pytest.fixture(scope="module")
def text(nb):
    return lesson_prose(nb)


def test_attention_memory_dense_against_tiled(nb, text):
    out = printed(cell_with(nb, "H_MEM, D_MEM = 2, 16"))
    for t in (128, 256, 512, 1024, 2048):
        dense, flash = 3 * 2 * 16 * 8 * t + 2 * 8 * t * t, (4 * 2 * 16 * 8 + 2 * 8) * t  # q, k, v (+ O, L) and P
        assert f"T = {t:5}: dense keeps {dense:11,} bytes, flash {flash:9,}" in out
    assert out.count("same output to 1e-12: True") == 5
    assert "at T = 2048 the dense op keeps 68,681,728 bytes and the tiled one 2,129,920, 32 times less" in text
    assert round(68_681_728 / 2_129_920) == 32


def test_the_online_softmax_on_six_keys(nb, text):
    scores, values = np.array([2.0, 1.0, 3.0, 0.5, 4.0, 1.5]), np.arange(1.0, 7.0)
    o = np.exp(scores) @ values / np.exp(scores).sum()
    out = printed(cell_with(nb, "scores = np.array([2.0, 1.0, 3.0, 0.5, 4.0, 1.5])"))
    assert f"softmax over all 6 at once: o = {o:.6f}" in out and f"o' = {o:.6f}" in out
    l1 = np.exp(scores[:3] - 3).sum()
    assert f"l' = {l1:.4f}" in out and "rescale e^(m - m') = 0.3679" in out
    assert f"l = e^{{−1}} + e^{{−2}} + 1 = {l1:.4f}" in text
    assert f"all six at once ({o:.6f})" in text and "scaled by e^{−1} = 0.3679" in text
    merged = printed(cell_with(nb, "o_ab, L_ab = merge_attention("))
    lse = np.log(np.exp(scores).sum())
    share_b = np.exp(scores[3:]).sum() / np.exp(scores).sum()
    assert f"merged:  o = {o:.6f}, L = {lse:.4f}" in merged and f"+ {share_b:.4f}" in merged
    assert f"The merged output is the softmax's {o:.6f} again, and L = {lse:.4f}" in text
    assert f"The second block holds {share_b:.4f} of the mass" in text
    assert "softmax without the shift nan; log(e^La + e^Lb) = inf; merge_attention: o = 5.000000, L = 1200.0000" \
        in merged
    assert "the softmax without the shift is `nan`" in text and "it gives `inf`" in text and "gives 5" in text


def test_the_ring_equals_dense_and_sends_the_closed_forms(nb, text):
    out = printed(cell_with(nb, 'results = sim.run(cp_rank, 4, q, k, v, do, "ring")'))
    assert "positions per rank: [4, 3, 3, 3]" in out and "below 1e-12: True" in out
    assert "(4, 3, 3, 3)" in text
    out = printed(cell_with(nb, "def sent_with("))
    for p in (2, 4, 8):
        b = 2 * (32 // p) * 4 * 8 * 8  # B (T/P) H d values of 8 bytes
        assert f"P = {p}: each rank sends {2 * (p - 1) * b:6,} bytes forward" in out
        assert f"{2 * (p - 1) * b:6,} of K/V + {2 * p * b:6,} of dK/dV" in out


def test_the_ring_overlap_in_virtual_time(nb, text):
    out = printed(cell_with(nb, "class ClockedCounter("))
    # fast: the compute alone (4 pairs of 1 ms, each block hidden); slow: 3 transfers of 2.05 ms and one pair
    assert "0.55 ms: finished at 4.00 ms" in out and "without overlap 4 x 1 + 3 x 0.55 = 5.65 ms" in out
    assert "2.05 ms: finished at 7.15 ms" in out and round(3 * 2.05 + 1, 2) == 7.15
    assert "the ring finishes at 4.00 ms, the compute alone, where sending and then computing would take 5.65 ms" \
        in text
    assert "On the slow link each step waits for its block: 7.15 ms" in text


def test_the_causal_imbalance_and_zigzag(nb, text):
    out = printed(cell_with(nb, "P4, T64 = 4, 64"))
    assert "pairs per rank [1, 2, 3, 4], scores per rank [256, 512, 768, 1024]" in out
    assert "pairs per rank [9, 9, 9, 9], scores per rank [576, 576, 576, 576]" in out  # 2P + 1 of (64/8)^2
    assert "[(0, 8), (56, 64)]" in out
    assert "from 256 scores on rank 0 to 1,024 on rank 3" in text and "9 = 2P + 1 chunk pairs of 8 × 8 = 64 scores, " \
                                                                       "576 each" in text
    assert "the triangle itself divided evenly, 520 scores" in text and 64 * 65 // 2 // 4 == 520
    assert "the step is 1.78 times faster" in text and round(1024 / 576, 2) == 1.78
    timed = printed(cell_with(nb, 'world = ring_timeline(4, FAST, variant=variant, is_causal=True)'))
    assert "ring  : compute per rank [1.0, 2.0, 3.0, 4.0] ms; the layer ends at 4.00 ms" in timed
    assert "zigzag: compute per rank [2.25, 2.25, 2.25, 2.25] ms; the layer ends at 2.35 ms" in timed
    assert "the layer ends at 4.00 ms" in text and "for 2.25 ms and the layer ends at 2.35 ms" in text


def test_ulysses_and_the_dispute_counted(nb, text):
    out = printed(cell_with(nb, "def ulysses_shapes("))
    assert "rank 1 before: (1, 8, 2, 1)" in out and "rank 1 after the all-to-all: (1, 2, 8, 1)" in out
    assert "[[0 1 2 3 4 5 6 7]\n [0 1 2 3 4 5 6 7]]" in out and "on every rank: True" in out
    out = printed(cell_with(nb, "def megatron_sp(comm)"))
    fractions = {}
    for p in (2, 4, 8):
        nh = 8 * p * 8 * 4
        ulysses, megatron, ring = 4 * nh * (p - 1) // p**2, 4 * nh * (p - 1) // p, 2 * nh * (p - 1) // p
        assert f"Ulysses {ulysses:5}, Megatron-SP {megatron:5}, ring {ring:5}, all-gathered K/V {ring:5}" in out
        fractions[p] = (round(ulysses / nh, 3), megatron / nh)
    assert fractions == {2: (1.0, 2.0), 4: (0.75, 3.0), 8: (0.438, 3.5)}
    assert "2, 3 and 3.5 times Nh on 2, 4 and 8 ranks" in text and "1, 0.75 and 0.438 times Nh" in text
    assert "DeepSpeed issue #4217" in text and "aoyulong" in text


def test_when_the_ring_pays(nb, text):
    out = printed(cell_with(nb, "h, h_kv, peak = 4096, 1024, 989e12"))
    for bandwidth, label in ((450e9, "549"), (50e9, "4,945")):
        assert f"{989e12 * 1024 / (bandwidth * 4096):,.0f}" == label and f"T/P >= {label} positions" in out
    assert "T/P = 8,192; one block pair 1.11 ms at peak, one K/V block 0.67 ms over InfiniBand" in out
    assert "549 positions or more; across nodes,\n4,945".replace("\n", " ") in text
    assert "1.11 ms of compute covers a K/V block's 0.67 ms over InfiniBand" in text


def test_the_cp_run_equals_one_process(nb, text):
    out = printed(cell_with(nb, "cp_run = sim.run("))
    assert "rank 0 holds positions 0:2 and 14:16 of 16" in out
    single, cp = number(r"one process (\d\.\d+)", out), number(r"cp (\d\.\d+)\n", out)
    assert single == cp
    assert "largest weight difference from one process: below 1e-12" in out
    assert "chunk pairs per step per rank: 18,18,18,18" in out  # (2P + 1) x 2 layers
    assert "Rank 0 holds positions 0:2 and 14:16" in text and "18 chunk pairs per step: 2P + 1 = 9 per layer" in text
    for marker in ("launch.train_command(2", 'glob("bench_context_parallel_*.json")'):
        assert cell_with(nb, marker).source.startswith("# NBVAL_IGNORE_OUTPUT")


def test_the_deck_keeps_the_rules_of_chapters_13_on():
    path = Path(quiz.__file__).parent / "quizzes" / f"{NAME}.json"
    questions = json.loads(path.read_text())["questions"]
    assert len(questions) >= 12 and sum(q["type"] == "numeric" for q in questions) >= 3
    for q in questions:
        if q["type"] == "multiple_choice":
            right = [len(a["answer"]) for a in q["answers"] if a["correct"]][0]
            others = [len(a["answer"]) for a in q["answers"] if not a["correct"]]
            assert min(others) <= right <= max(others), q["id"]


def test_the_decks_numbers_are_the_lessons_formulas():
    deck = {q["id"]: q for q in quiz.load_deck(NAME)}

    def right(qid):
        return next(a["value"] for a in deck[qid]["answers"] if a.get("correct"))

    p, t, h = (int(n) for n in re.findall(r"P = (\d+) ranks, T = (\d+) positions, width h = (\d+)",
                                            deck["ring-values"]["question"])[0])
    assert right("ring-values") == 2 * (p - 1) * (t // p) * h
    assert right("contiguous-pairs") == 5 + 1 and right("zigzag-pairs") == 2 * 8 + 1
    assert right("ulysses-values") == 4 * 1_000_000 * 3 / 16
    assert right("weights-mb") == 1024 * 1024 * 8 / 1e6
    assert right("merge-weight") == pytest.approx(float(np.exp(2 - np.logaddexp(2, 2))), abs=1e-12)


def test_the_benchmark_figures_are_the_saved_jsons():
    """Section 8 quotes bench_context_parallel_2026-12-06_run2.json (the run after Ulysses and the
    all-gathered K/V attended by tiles) and the first run's Ulysses; its cell reads the newest saved
    run and is NBVAL_IGNORE_OUTPUT, so the prose is checked against the files it names."""
    text = lesson_prose(lesson(NAME))
    saved = Path(__file__).resolve().parents[1] / "notebooks" / "measurements"
    path = saved / "bench_context_parallel_2026-12-06_run2.json"
    first = saved / "bench_context_parallel_2026-12-06.json"
    if not path.is_file() or not first.is_file():
        pytest.skip("the benchmark's saved runs are not in this checkout")
    bench = json.loads(path.read_text())
    assert "`bench_context_parallel_2026-12-06_run2.json`" in text
    assert "`bench_context_parallel_2026-12-06.json`" in text
    untiled = json.loads(first.read_text())["longest_sequence"]
    assert [r["longest_T"] for r in untiled["rows"] if r["contender"] == "ulysses"][-1] == 400
    assert f"{untiled['slope_logT_logP']['ulysses']:.2f}" == "0.53" and "400 on 8 ranks at slope 0.53" in text
    longest = {(r["contender"], r["ranks"]): r["longest_T"] for r in bench["longest_sequence"]["rows"]}
    slopes = bench["longest_sequence"]["slope_logT_logP"]
    assert (longest["ring", 1], longest["ring", 8], longest["dense", 1], longest["dense", 8]) == (248, 1984, 78, 176)
    assert (longest["allgather", 1], longest["allgather", 8], longest["ulysses", 1], longest["ulysses", 8]) == \
        (164, 400, 142, 1136)
    assert [f"{slopes[c]:.2f}" for c in ("ring", "zigzag", "dense", "allgather", "ulysses")] == \
        ["1.00", "1.00", "0.40", "0.43", "1.00"]
    assert "248 positions on one rank, 1,984 on 8" in text and "(78 to 176" in text and "(164 to 400" in text
    assert "1.00 for Ulysses (142 to 1,136" in text
    forward = {(r["layout"], r["ranks"]): r["forward_in_Th"] for r in bench["bytes_per_layer"]}
    assert [forward["ring", p] for p in (2, 4, 8)] == [1.0, 1.5, 1.75] == [forward["allgather", p] for p in (2, 4, 8)]
    assert [forward["ulysses", p] for p in (2, 4, 8)] == [1.0, 0.75, 0.4375]
    assert [forward["tp+sp", p] for p in (2, 4, 8)] == [2.0, 3.0, 3.5]
    assert all(r["equal"] for r in bench["bytes_per_layer"])
    assert "Ulysses 1, 0.75 and 0.4375; TP + SP 2, 3 and 3.5" in text
    work = {(r["layout"], r["ranks"]): round(r["max_over_mean_scores"], 2) for r in bench["work_per_rank"]}
    assert [work["ring", p] for p in (2, 4, 8)] == [1.33, 1.6, 1.78] and {work["zigzag", p] for p in (2, 4, 8)} == {1.0}
    assert "contiguous: 1.33, 1.60 and 1.78" in text
    wall = bench["wall_time"]
    quoted = [f"{wall['one_process_median_s'][k]:.3f}" for k in ("dense", "flash")] + \
             [f"{wall['two_ranks_median_s'][k]:.3f}" for k in ("zigzag", "ring", "allgather", "ulysses")]
    assert quoted == ["0.180", "0.090", "0.079", "0.160", "0.096", "0.086"]
    assert "one process 0.180 s dense and 0.090 s tiled" in text and "zig-zag 0.079 s, the ring 0.160 s, " \
           "all-gathered K/V 0.096 s, Ulysses 0.086 s" in text
    assert f"load average {bench['load_average_before'][0]:.0f} to {max(bench['load_average_before']):.0f}" in text
