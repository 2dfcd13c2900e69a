"""Lesson 20 (mixture of experts) and its deck against their own outputs.

Every number the prose quotes about a cell is checked against what that cell printed in the
committed notebook, and recomputed here where an oracle independent of the engine exists: the
parameter counts of the published models (their sizes times three matrices per expert), the
capacity and GShard's queue on the lesson's 12 tokens (recomputed from the printed choices), the
all-to-all bytes against k N h (P - 1)/P and against h (sent + received), DeepSeek-V3's arithmetic,
the planner's DeepSeek-V3 what-if against the report's figures, and the benchmark's saved JSON. The
benchmark cell is ``# NBVAL_IGNORE_OUTPUT``; the prose quotes the saved run named in it, read here.
The deck keeps chapter 13 on's rules."""
import json
import math
import re
from pathlib import Path

import pytest
from lesson_outputs import cell_with, lesson, lesson_prose, number, printed

NAME = "20_experts"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def nb():
    return lesson(NAME)


@pytest.fixture(scope="module")
def text(nb):
    return lesson_prose(nb)


def test_parameters_against_active_parameters(nb, text):
    out = printed(cell_with(nb, "def counts(config)"))
    rows = {name: (number(rf"{re.escape(name)}\s*:\s*([\d,]+) parameters", out),
                   number(rf"{re.escape(name)}\s*:\s*[\d,]+ parameters,\s*([\d,]+) used", out))
            for name in ("dense", "E = 8, top-2", "E = 64, top-2")}
    dense, moe8, moe64 = rows["dense"], rows["E = 8, top-2"], rows["E = 64, top-2"]
    assert dense[0] == dense[1]
    # the parameters grow with E: the MoE of E experts adds (E - 1) MLPs and a router per block
    mlp = (moe64[0] - moe8[0]) / (4 * 56) - 64  # 56 more experts and 56 more router rows of 64, 4 blocks
    assert mlp == 8 * 64 * 64 + 4 * 64 + 64  # two 64 x 256 matrices and their biases
    assert f"holds {moe8[0]:,.0f} parameters, {moe8[0] / dense[0]:.1f} times the dense {dense[0]:,.0f}" in text
    assert f"one token uses {moe8[1]:,.0f} of them ({moe8[1] / moe8[0]:.1%}".replace("%", " %") in text
    assert f"{moe64[0]:,.0f} parameters, of which {moe64[1]:,.0f} ({moe64[1] / moe64[0]:.1%}".replace("%", " %") in text


def test_the_published_models(nb, text):
    out = printed(cell_with(nb, "def swiglu_expert(h, f)"))
    mixtral, ds = 3 * 4096 * 14336, 3 * 7168 * 2048
    assert f"one expert {mixtral / 1e6:.1f} M; all experts {32 * 8 * mixtral / 1e9:.1f} B" in out
    assert f"the 2 used per token {32 * 2 * mixtral / 1e9:.1f} B" in out
    assert f"routed experts {58 * 256 * ds / 1e9:.1f} B" in out and f"per token {58 * 9 * ds / 1e9:.1f} B" in out
    assert "Mixtral's experts hold 45.1 B of its 46.7 B parameters, and the two a token uses 11.3 B" in text
    assert "routed experts hold 653.9 B of its 671 B, and the nine experts a token uses (8 routed, 1 shared) 23.0 B" \
        in text
    assert f"about {37 / 671:.1%}".replace("%", " %") in text


def test_routing_capacity_and_the_dropped_assignments(nb, text):
    out = printed(cell_with(nb, "N_TOK, E4, K2 = 12, 4, 2"))
    assert f"capacity C = ceil(1.0 x 2 x 12 / 4) = {math.ceil(1.0 * 2 * 12 / 4)} assignments" in out
    choices = [tuple(int(e) for e in re.findall(r"expert (\d)", line)) for line in out.splitlines()
               if line.startswith("token")]
    assert len(choices) == 12
    # GShard's queue over the printed choices: every first choice, then every second, tokens in order
    used, dropped = [0] * 4, []
    for slot in (0, 1):
        for t, pair in enumerate(choices):
            if used[pair[slot]] < 6:
                used[pair[slot]] += 1
            else:
                dropped.append((t, slot))
    assert dropped == [(7, 1), (9, 1)]
    routed = [sum(pair.count(e) for pair in choices) for e in range(4)]
    assert f"routed per expert (slot 1 + slot 2): {routed}, dropped: 2" in out and routed == [7, 5, 7, 5]
    for t in (7, 9):
        assert re.search(rf"token  {t}: .* DROPPED", out)
    assert "experts 0 and 2 are asked 7 times, experts 1 and 3 only 5" in text
    assert "first choice of tokens 0, 2, 4, 10 and 11 and the second of tokens 3 and 7" in text
    assert [t for t, pair in enumerate(choices) if pair[0] == 0] == [0, 2, 4, 10, 11]
    assert [t for t, pair in enumerate(choices) if pair[1] == 2] == [0, 1, 2, 4, 5, 9]


def test_balance_live(nb, text):
    out = printed(cell_with(nb, "BALANCING = {"))
    late = {name: number(rf"{re.escape(name)}\s*: busiest expert over the mean, last 20 steps: ([\d.]+)", out)
            for name in ("no balancing", "Switch's loss (alpha = 0.05)", "DeepSeek-V3's bias (gamma = 0.005)")}
    none, switch, bias = late.values()
    assert switch < bias < none
    assert f"on average {none:.2f} times its fair share" in text and f"{switch:.2f} times the mean" in text
    assert f"reaches {bias:.2f}" in text
    assert "[0, 9, 0, 119]" in out and "one expert takes 119 of 128 tokens" in text
    assert "[111, 2, 5, 10]" in out and "(111 tokens on expert 0 at step 20)" in text
    for line in out.splitlines():
        if "tokens per expert" in line:
            assert all(sum(map(int, load.split(","))) == 8 * 16 for load in re.findall(r"\[([\d, ]+)\]", line))


def test_dispatch_and_combine_bytes(nb, text):
    out = printed(cell_with(nb, "def uniform_tokens(n, seed)"))
    k, n, h = 2, 8, 8
    for p in (1, 2, 4):
        closed = int(2 * k * n * h * (p - 1) / p * 8)
        assert f"P = {p}: rows each rank sends {[k * n * (p - 1) // p] * p}; token bytes per rank {[closed] * p}" in out
    assert out.count("equal to one process: True") == 3
    assert "1,024 bytes per rank on 2 ranks, 1,536 on 4" in text
    rand = printed(cell_with(nb, "router_scale=8.0"))
    rows = re.findall(r"rank (\d): dispatch sends\s+(\d+) rows, receives\s+(\d+); token bytes\s+([\d,]+)", rand)
    assert len(rows) == 4 and sum(int(s) for _, s, _, _ in rows) == sum(int(r) for _, _, r, _ in rows)
    for _, sent, received, nbytes in rows:
        assert int(nbytes.replace(",", "")) == h * (int(sent) + int(received)) * 8
    assert ("2", "13", "14", "1,728") in rows
    assert "Rank 2 sends 13 rows and receives 14 back to compute: 1,728 bytes against the others' 1,344" in text


def test_ep_dp_groups_and_the_run(nb, text):
    out = printed(cell_with(nb, "def groups(comm)"))
    for rank in range(4):
        ep = [rank - rank % 2, rank - rank % 2 + 1]
        dp = [rank % 2, rank % 2 + 2]
        assert f"rank {rank}: ep group {ep} (trades tokens), dp group {dp}" in out
        assert f"holds experts {[0, 1] if rank % 2 == 0 else [2, 3]}" in out
    run = printed(cell_with(nb, "train_expert_parallel(comm, config, text)"))
    single, ep = re.search(r"one process ([\d.]+), ep ([\d.]+)", run).groups()
    assert single == ep and f"one process's val_loss, {ep}" in text
    assert "largest weight difference from one process: below 1e-12" in run
    assert "dropped 28;" in run and "28 assignments" in text


def test_deepseek_what_if(nb, text):
    out = printed(cell_with(nb, "H_DS, F_DS, LAYERS_MOE"))
    expert = 3 * 7168 * 2048
    for ep in (1, 8, 64):
        params = 256 / ep * expert * 58 / 16
        assert f"EP {ep:2}: routed-expert parameters per GPU {params / 1e9:6.2f} B, {2 * params / 1e9:6.1f} GB" in out
    assert "40.87 B routed-expert parameters, 81.7 GB in bf16" in text and "5.11 B; EP 64" in text
    assert "0.64 B, 1.3 GB" in text
    assert f"k h = {8 * 7168:,} values, {8 * 7168 * 2 // 1024} KiB" in out
    assert f"k · h = {8 * 7168:,} values per MoE layer, {8 * 7168 * 2 // 1024} KiB in bf16" in text
    planned = printed(cell_with(nb, "planner.Cluster(2048"))
    total, active = (number(rf"([\d.]+) B {what}", planned) for what in ("parameters", "active"))
    assert abs(total - 671) / 671 < 0.01 and abs(active - 37) / 37 < 0.02  # the report's 671 B and 37 B
    rows = {int(ep): (float(gib), float(experts), fits == "fits", float(compute), float(a2a), float(grads))
            for ep, gib, experts, fits, compute, a2a, grads in re.findall(
                r"EP\s+(\d+):\s+([\d.]+) GiB .*?experts\s+([\d.]+), .*?\), (fits|does not fit) 80 GiB; step: compute "
                r"([\d.]+) s, all-to-alls ([\d.]+) s, expert and dense gradients ([\d.]+) s", planned)}
    assert sorted(rows) == [1, 8, 16, 64]
    assert [rows[ep][2] for ep in (1, 8, 16, 64)] == [False, False, True, True]
    assert all(rows[ep][2] == (rows[ep][0] <= 80) for ep in rows)
    assert rows[1][4] == 0 and 0.8 < rows[64][3] / rows[64][4] < 1.25  # the report's "approximately 1:1"
    assert rows[64][5] < rows[1][5]
    assert f"would need {rows[1][0]:.1f} GiB ({rows[1][1]:.1f} GiB of it expert state); EP 8 brings it to " \
           f"{rows[8][0]:.1f} GiB" in text
    assert f"EP 16 fits, at {rows[16][0]:.1f} GiB; EP 64 gives {rows[64][0]:.1f} GiB, of which the experts are " \
           f"{rows[64][1]:.1f} GiB" in text
    assert f"they take {rows[64][4]:.1f} s against {rows[64][3]:.1f} s of compute" in text
    assert f"shrinks from {rows[1][5]:.2f} s to {rows[64][5]:.2f} s" in text


def test_the_benchmark_figures_are_the_saved_json(text):
    """Section 7 quotes bench_experts_2026-12-06_run2.json (helper moe's saved run)."""
    path = ROOT / "notebooks" / "measurements" / "bench_experts_2026-12-06_run2.json"
    if not path.exists():
        pytest.skip("the benchmark's saved run is not in this checkout")
    bench = json.loads(path.read_text())
    assert "`bench_experts_2026-12-06_run2.json`" in text
    b = bench["balance"]
    last = [f"{b[name]['max_over_mean_last_tenth']:.2f}" for name in ("none", "aux_loss", "bias")]
    assert f"{last[0]} times the mean load without balancing, {last[1]} with Switch's loss and {last[2]}" in text
    drops = [f"{b[name]['drop_rate'][factor]:.2f}" for factor in ("1.25", "2.0")
             for name in ("none", "aux_loss", "bias")]
    assert "they dropped {}, {} and {} of the assignments, at 2.0 {}, {} and {}".format(*drops) in text
    ep = {row["ranks"]: row for row in bench["ep"]}
    assert f"{ep[2]['bytes_per_rank_per_step']:,.0f} bytes per rank and step on 2 ranks, " \
           f"{ep[4]['bytes_per_rank_per_step']:,.0f} on 4, {ep[8]['bytes_per_rank_per_step']:,.0f} on 8" in text
    # three all-to-alls of the mean rows (float32, width 64), plus one int64 count per peer each
    rows = sum(ep[2]["rows_sent_per_dispatch"]) / 2
    assert 3 * rows * 64 * 4 == 195_456 and 195_456 + 3 * 8 == ep[2]["bytes_per_rank_per_step"]
    assert f"({ep[2]['uniform_router_bytes']:,.0f} on 2 ranks) counts four" in text
    times = [f"{ep[p]['seconds_per_step'] * 1e3:.0f}" for p in (2, 4, 8)]
    assert f"({times[0]}, {times[1]}, {times[2]} ms for 2, 4, 8 ranks)" in text
    roof = bench["roofline"]
    assert f"ridge was {roof['ridge_flop_per_byte']:.1f} FLOP per byte" in text
    assert f"compute-bound past {roof['tokens_per_expert_compute_bound']:.0f} tokens" in text
    batches = roof["batch_tokens_compute_bound"]
    assert f"a batch needs {batches['E=8,k=2']:.0f} tokens" in text and f"k/E) {batches['E=256,k=8']:.0f}" in text
    dense, moe = bench["moe_vs_dense"]["dense"], bench["moe_vs_dense"]["moe E=8 top-1"]
    assert f"val_loss of {dense['val_loss']:.3f} with {dense['parameters']:,} parameters" in text
    assert f"{moe['val_loss']:.3f} with {moe['parameters']:,} parameters ({moe['active_parameters']:,} active)" in text
    assert f"took {moe['seconds']:.1f} s against the dense run's {dense['seconds']:.1f} s" in text


def test_the_deck_keeps_the_rules_and_its_numbers_are_the_formulas():
    questions = {q["id"]: q for q in json.loads(
        (ROOT / "minidist" / "course" / "quizzes" / f"{NAME}.json").read_text())["questions"]}
    assert len(questions) >= 12 and sum(q["type"] == "numeric" for q in questions.values()) >= 3

    def right(qid):
        return next(a["value"] for a in questions[qid]["answers"] if a["correct"])

    assert right("capacity") == math.ceil(1.25 * 2 * 1000 / 8)
    assert right("aux-min") == pytest.approx(0.01 * 8 * sum((1 / 8) * (1 / 8) for _ in range(8)))
    assert right("a2a-values") == 2 * 4096 * 1024 * 7 // 8
    assert right("a2a-ratio") == 1 / 4
    assert right("compute-bound") == 13 * 256 // 8
