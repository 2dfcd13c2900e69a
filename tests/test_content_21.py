"""Lesson 21 (across data centres) and its deck against their own outputs.

Every number the prose quotes about a cell is checked against what that cell printed in the
committed notebook, and the printed numbers are recomputed here from closed forms independent of
the engine: the ring's bytes 2 (M - 1)/M n per replica, divided by H; the outer Nesterov step by
its formula; a fragment's share of the bytes; the MLP's parameter count. The benchmark cells are
``# NBVAL_IGNORE_OUTPUT`` (they read the newest saved run), so the prose's figures are checked
against the file it names, ``bench_local_sgd_run1.json``. The deck keeps chapter 13 on's rules and
its numbers are the lesson's formulas and the saved run's."""
import json
import re
from pathlib import Path

import pytest
from lesson_outputs import cell_with, lesson, lesson_prose, number, printed

from minidist.course import quiz

NAME = "21_across_datacenters"
BENCH = Path(__file__).resolve().parents[1] / "notebooks" / "measurements" / "bench_local_sgd_run1.json"


@pytest.fixture(scope="module")
def nb():
    return lesson(NAME)


@pytest.fixture(scope="module")
def text(nb):
    return lesson_prose(nb)


def mlp_numbers(sizes):
    return sum(a * b + b for a, b in zip(sizes, sizes[1:]))


def test_the_bytes_of_a_billion_parameters_over_a_wan(nb, text):
    out = printed(cell_with(nb, "N_PARAMS, M_REPLICAS, WAN ="))
    for h in (1, 10, 100, 500):
        per_step = 2 * 7 / 8 * 1e9 * 4 / h
        assert f"H = {h:3}: {per_step / 1e9:6.3f} GB per replica and step, {per_step / (1e9 / 8):7.3f} s" in out
    assert "hold the WAN for 56 s" in text and "With H = 500 it is 0.112 s" in text


def test_one_step_with_outer_sgd_at_lr_1_is_ddp(nb, text):
    out = printed(cell_with(nb, "ddp_world, local_world = sim.World(3), sim.World(3)"))
    assert number(r"largest difference from DDP's weights: ([0-9.e+-]+)", out) < 1e-12
    assert number(r"the weights moved by up to ([0-9.]+)", out) > 1e-2  # the run trained: the agreement means something
    ddp, diloco = re.findall(r"DDP ([\d,]+), DiLoCo ([\d,]+)", out)[0]
    assert ddp == diloco
    assert mlp_numbers([6, 8, 8, 3]) == 155 and "one ring all-reduce of the 155 numbers per step" in text


def test_the_outer_step_by_hand(nb, text):
    theta, v, lr, mu = 1.0, 0.1, 0.7, 0.9
    delta = theta - 0.7
    v = mu * v + delta
    new = theta - lr * (delta + mu * v)
    out = printed(cell_with(nb, "theta, v, lr, mu = 1.0, 0.1, 0.7, 0.9"))
    assert f"Nesterov step = lr (delta + mu v) = {lr * (delta + mu * v):.4f}, theta -> {new:.4f}" in out
    assert f"({new:.4f} against 0.7)" in text
    assert f"lr · v = {lr * v:.3f}" in text and f"lr · Δ = {lr * delta:.2f}" in text
    deck = {q["id"]: q for q in quiz.load_deck(NAME)}
    assert next(a["value"] for a in deck["outer-step"]["answers"] if a.get("correct")) == pytest.approx(new, abs=1e-12)


def test_streaming_fragments_on_the_trace(nb, text):
    out = printed(cell_with(nb, 'print("fragment_offsets(4, 8) =", fragment_offsets(4, 8))'))
    assert "fragment_offsets(4, 8) = [2, 4, 6, 8]" in out  # (p + 1) H // F
    assert f"numbers per fragment: {[mlp_numbers([32] * 5) // 4] * 4}" in out
    fragment = 2 * 1 / 2 * 8 * 1056  # a ring all-reduce of 1,056 float64 on M = 2
    out = printed(cell_with(nb, "def bytes_per_step("))
    assert f"F = 1: bytes per inner step {[0] * 7 + [4 * int(fragment)] + [0] * 7 + [4 * int(fragment)]}" in out
    assert f"F = 4: bytes per inner step {[0, int(fragment)] * 8}" in out
    assert out.count("total 67,584") == 2 and "peak 33,792" in out and "peak 8,448" in out
    assert "The totals match (67,584 bytes each); DiLoCo's peak is 33,792 bytes in one step, Streaming DiLoCo's 8,448" \
        in text and "= 8,448 bytes per rank" in text


def test_a_replica_lost_and_rejoined(nb, text):
    out = printed(cell_with(nb, "results = sim.World(4, timeout=60).run(churn_replica, 3, 12, lost=(2, 5))"))
    assert re.findall(r"sync after inner step +(\d+): members (\[[\d, ]+\])", out) == [
        ("3", "[0, 1, 2, 3]"), ("6", "[0, 1, 3]"), ("9", "[0, 1, 2, 3]"), ("12", "[0, 1, 2, 3]")]
    assert "died before step 5; healed from a peer at sync 2, resumes at step 7" in out
    assert "bit-identical after syncs [1, 2, 3, 4]: True" in out
    assert number(r"sequential run \(replica 2 out from step 5 to the sync at 6\): ([0-9.e+-]+)", out) < 1e-12
    assert "At the sync after step 6 only replicas 0, 1 and 3 reduce" in text and "resumes at step 7" in text
    out = printed(cell_with(nb, "def other_joiner(comm):"))
    assert "members at the last sync: [0, 1, 2, 3] | the four final states bit-identical: True" in out
    assert "fields that differ: ('parameters', 'sync_every'); sync_every is 5 here, 2 on the replicas" in out


def test_the_benchmark_cells_are_ignored_by_nbval(nb):
    for marker in ('glob("bench_local_sgd_*.json")', 'walls = bench["wall_time_against_wan"]'):
        assert cell_with(nb, marker).source.startswith("# NBVAL_IGNORE_OUTPUT")


def test_the_benchmark_figures_are_the_saved_json(text):
    """Sections 3, 4 and 7 quote bench_local_sgd_run1.json (helper diloco's saved run)."""
    if not BENCH.is_file():
        pytest.skip("the benchmark's saved run is not in this checkout")
    bench = json.loads(BENCH.read_text())
    assert "`bench_local_sgd_run1.json`" in text
    rows = {(r["strategy"], r["sync_every"], r.get("outer_momentum")): r for r in bench["loss_against_bytes"]}
    ddp = rows["ddp", 1, None]
    assert f"{ddp['val_loss']:.3f}" == "2.512" and ddp["bytes"] == 34_675_200
    assert "validation loss of 2.512 after sending 34,675,200 bytes" in text
    quoted = {(50, 0.5): ("2.586", "42.8"), (100, 0.5): ("2.603", "75.0"), (300, 0.9): ("2.713", "150.0")}
    for (h, mu), (loss, ratio) in quoted.items():
        row = rows["diloco", h, mu]
        assert (f"{row['val_loss']:.3f}", f"{ddp['bytes'] / row['bytes']:.1f}") == (loss, ratio)
        assert re.search(rf"{loss},? with {ratio} times fewer", text), (loss, ratio)
    assert rows["diloco", 100, 0.5]["val_loss"] - ddp["val_loss"] < 0.1 and "Within 0.1 of DDP's loss" in text
    assert f"{rows['diloco', 1, 0.9]['val_loss']:.3f}" == "3.143" and "the *worst* run, 3.143" in text
    assert [f"{rows['diloco', h, 0.9]['val_loss']:.3f}" for h in (50, 100)] == ["2.662", "2.739"]
    assert "(2.662 and 2.739 at μ = 0.9)" in text
    peaks = {r["fragments"]: r for r in bench["peak_bandwidth"]}
    assert (peaks[1]["peak_bytes_per_step"], peaks[4]["peak_bytes_per_step"]) == (1_048_648, 262_216)
    assert "a peak of 1,048,648 bytes in one step for DiLoCo against 262,216" in text
    assert all(f"{peaks[f]['total_bytes'] / 1e6:.1f}" == "2.1" for f in (1, 4)) and "(about 2.1 MB each)" in text
    walls = {r["wan_bytes_per_s"]: r for r in bench["wall_time_against_wan"]}
    slow, fast = walls[1e6], walls[1e10]
    assert [f"{slow[k]:.2f}" for k in ("ddp_s", "diloco_s", "streaming_s")] == ["76.91", "5.60", "6.95"]
    assert [f"{fast[k]:.2f}" for k in ("ddp_s", "diloco_s", "streaming_s")] == ["14.01", "2.45", "3.80"]
    assert f"{slow['ddp_s'] / slow['diloco_s']:.1f}" == "13.7"
    assert "DDP takes 76.91 s for 40 steps of 2 s of compute; DiLoCo 5.60 s, 13.7 times less" in text
    assert "At 10 GB/s, DDP still takes 14.01 s" in text and "DiLoCo takes 2.45 s" in text
    assert "(6.95 s at 1 MB/s, 3.80 s at 10 GB/s)" in text
    assert abs(40 * 6 * 0.05 + slow["compute_s"] - fast["ddp_s"]) < 0.01  # the ring's 6 latencies a step
    deck = {q["id"]: q for q in quiz.load_deck(NAME)}

    def right(qid):
        return next(a["value"] for a in deck[qid]["answers"] if a.get("correct"))

    assert right("bench-ratio") == round(ddp["bytes"] / rows["diloco", 100, 0.5]["bytes"], 1)
    assert right("wall-ratio") == round(slow["ddp_s"] / slow["diloco_s"], 1)


def test_the_deck_keeps_the_rules_and_the_lessons_formulas():
    path = Path(quiz.__file__).parent / "quizzes" / f"{NAME}.json"
    questions = json.loads(path.read_text())["questions"]
    assert len(questions) >= 12 and sum(q["type"] == "numeric" for q in questions) >= 3
    for q in questions:
        if q["type"] == "multiple_choice":
            right = [len(a["answer"]) for a in q["answers"] if a["correct"]][0]
            others = [len(a["answer"]) for a in q["answers"] if not a["correct"]]
            assert min(others) <= right <= max(others), q["id"]
    deck = {q["id"]: q for q in questions}

    def right(qid):
        return next(a["value"] for a in deck[qid]["answers"] if a.get("correct"))

    assert right("bytes-h") == pytest.approx(2 * 7 / 8 * 4e9 / 500 / 1e9, abs=1e-12)
    assert right("offsets") == (2 + 1) * 8 // 4 + 8
