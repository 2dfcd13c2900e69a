"""Lesson 16 (3-D parallelism), its deck and exercise 16 against their own outputs.

Every number the prose quotes about a cell is checked against what that cell printed in the
committed notebook (the output a learner sees before running anything). Cells are found by a
phrase they contain, not by their index. The traced step is also checked against itself (the
matrix against the bytes by group, the groups against the mesh's enumeration) and the layout
table against its own verdict column, so that a changed engine fails here, not silently in the
prose.
"""
import json
import re
from pathlib import Path

import nbformat
import pytest
from lesson_outputs import ROOT, cell_with, lesson, lesson_prose, number, printed, prose

NAME = "16_3d_parallelism"


@pytest.fixture(scope="module")
def nb():
    return lesson(NAME)


@pytest.fixture(scope="module")
def text(nb):
    return lesson_prose(nb)


def rows(out: str, first_column: str) -> dict:
    """{label: [numbers...]} of a printed table whose rows are ``label | n | n ...``."""
    table = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) > 2 and re.match(first_column, parts[0]):
            table[parts[0]] = parts[1:]
    return table


def test_why_three_dimensions(nb, text):
    table = rows(printed(cell_with(nb, "ALONE = {")), r"(data|tensor|pipeline|3-D)")
    assert len(table) == 6
    gib = {label: float(cells[0].replace(",", "")) for label, cells in table.items()}
    fits = [label for label, cells in table.items() if cells[1] == "yes"]
    assert fits == ["data parallel, ZeRO-3", "tensor (8) x data, ZeRO-3", "3-D: tensor 8 x pipeline 16 x data 8"]
    step = {label: float(cells[2]) for label, cells in table.items()}
    assert min(step[f] for f in fits) == step["3-D: tensor 8 x pipeline 16 x data 8"] == 43.54
    three_d = table["3-D: tensor 8 x pipeline 16 x data 8"]
    zero3 = table["data parallel, ZeRO-3"]
    assert [gib["data parallel only"], gib["tensor (8, one node) x data"], gib["pipeline (32) x data"]] == \
        [2609.5, 330.9, 98.5]
    assert "needs 2,609.5 GiB on every GPU" in text and "by 8, to 330.9 GiB" in text
    assert f"brings it to 98.5 GiB, still over the 80, and idles {table['pipeline (32) x data'][7]} s" in text
    assert f"{gib['data parallel, ZeRO-3']} GiB on data parallelism alone" in text
    assert f"{zero3[6]} s of it: {zero3[2]} s a step" in text
    assert f"fits in {gib['tensor (8) x data, ZeRO-3']} GiB and takes {step['tensor (8) x data, ZeRO-3']} s" in text
    assert f"fits in {gib['3-D: tensor 8 x pipeline 16 x data 8']} GiB with plain data parallelism and takes the " \
           f"least time, {three_d[2]} s" in text
    assert f"NVLink ({three_d[4]} s)" in text and f"small ({three_d[5]} s)" in text
    assert f"short ({three_d[6]} s)" in text and f"leave a {three_d[7]} s bubble" in text
    assert "16 stages over 256 micro-batches" in text  # 2,048 sequences / dp 8, micro-batch 1
    assert step["tensor (8) x data, ZeRO-3"] / step["3-D: tensor 8 x pipeline 16 x data 8"] - 1 < 0.06
    assert "TP × ZeRO-3 comes within 6 % of 3-D" in text


def test_the_mesh_and_its_groups(nb, text):
    drawn = printed(cell_with(nb, "COLOURS = {"))
    assert "tp groups: [[0, 1], [2, 3], [4, 5], [6, 7]]" in drawn
    assert "pp groups: [[0, 2], [1, 3], [4, 6], [5, 7]]" in drawn
    assert "dp groups: [[0, 4], [1, 5], [2, 6], [3, 7]]" in drawn
    seen = printed(cell_with(nb, "def groups_seen"))
    assert "rank 5 at (dp, pp, tp) = (1, 0, 1): dp [1, 5], pp [5, 7], tp [4, 5]" in seen
    assert "every rank's groups are lines of mesh_groups: True" in seen
    assert "mesh_groups equals picotron's enumeration: True" in seen
    assert "Rank 5 sits at (1, 0, 1) and is in the tp group [4, 5], the pipeline [5, 7] and the " \
           "data-parallel group [1, 5]" in text


def test_one_step_traced(nb, text):
    out = printed(cell_with(nb, "def step_messages"))
    total = number(r"(\d+) messages in one step", out)
    groups = {}
    for name in ("tp", "pp", "dp"):
        match = re.search(rf"{name}:\s+(\d+) messages,\s+([\d,]+) bytes; driver\s+([\d,]+)", out)
        count, trace, driver = (int(g.replace(",", "")) for g in match.groups())
        assert trace == driver, name
        groups[name] = (count, trace)
    assert sum(c for c, _ in groups.values()) == total == 224
    matrix = [[int(b.replace(",", "")) if b != "." else 0 for b in line.split()[1:]]
              for line in out.splitlines() if re.match(r" {3}\d {2}", line)]  # "   r  " opens a row
    assert len(matrix) == 8 and sum(map(sum, matrix)) == sum(b for _, b in groups.values())
    assert f"All {total:.0f} messages of the step run inside the groups" in text
    assert f"{groups['tp'][1]:,} bytes within the tp pairs, {groups['pp'][1]:,} along the pipelines and " \
           f"{groups['dp'][1]:,} between the replicas" in text
    assert f"Rank 0 sends {matrix[0][1]:,} bytes to rank 1" in text and f"{matrix[0][2]:,} to rank 2" in text
    assert f"come back, {matrix[2][0]:,} bytes" in text and f"{matrix[0][4]:,} to rank 4, its replica" in text
    assert f"carry the most messages, {groups['tp'][0]} of the {total:.0f}" in text
    assert f"all-reduce takes only {groups['dp'][0]}, one per rank, of {groups['dp'][1] / groups['dp'][0]:,.0f} " \
           "bytes on average" in text
    placed = printed(cell_with(nb, "PLACEMENTS = {"))
    inner, outer, pipeline_out = placed.splitlines()
    assert f"bytes over the network: tp 0, pp 0, dp {groups['dp'][1]:,}" in inner
    assert f"bytes over the network: tp {groups['tp'][1]:,}, pp 0, dp 0" in outer
    assert pipeline_out.startswith("pp outermost: nodes [0, 0, 1, 1, 0, 0, 1, 1]")
    assert f"bytes over the network: tp 0, pp {groups['pp'][1]:,}, dp 0" in pipeline_out
    fast, slow, pp_time = (number(r"take ([\d.]+) microseconds", line) for line in (inner, outer, pipeline_out))
    assert f"With pp outermost, only the pipeline's {groups['pp'][1]:,} bytes cross the network, not quite a third " \
           f"of the data-parallel {groups['dp'][1]:,}" in text
    assert 0.25 < groups["pp"][1] / groups["dp"][1] < 1 / 3
    assert f"then take {pp_time} µs of virtual time, a little more than the {fast} µs" in text and fast < pp_time
    assert f"pipeline's {groups['pp'][0]} messages each pay the network's latency, against the data-parallel " \
           f"all-reduce's {groups['dp'][0]}" in text
    question = quiz_question("pp-outermost-bytes")
    assert question["answers"][0]["value"] == groups["pp"][1] and question["answers"][1]["value"] == groups["dp"][1]
    assert f"only the data-parallel all-reduce crosses the network, {groups['dp'][1]:,} bytes" in text
    assert f"every tp message does, {groups['tp'][1]:,} bytes" in text
    assert f"take {slow} µs of virtual time instead of {fast} µs" in text and slow > fast


def layout_rows(out: str) -> dict:
    """{(dp, pp, tp): ([tp, pp, dp measured], [predicted], (smallest, largest parameter bytes), verdict)}."""
    found = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) == 6 and re.fullmatch(r"\d+ \d+ \d+", re.sub(r"\s+", " ", parts[0])):
            layout = tuple(int(x) for x in parts[0].split())
            pairs = [[int(x.replace(",", "")) for x in cell.split("/")] for cell in parts[1:4]]
            held = tuple(int(x.replace(",", "")) for x in re.findall(r"[\d,]+", parts[4]))
            found[layout] = ([m for m, _ in pairs], [p for _, p in pairs], held, parts[5])
    return found


def quiz_question(qid: str) -> dict:
    deck = json.loads((Path(ROOT) / "minidist" / "course" / "quizzes" / f"{NAME}.json").read_text())
    return next(q for q in deck["questions"] if q["id"] == qid)


def test_the_libraries_mesh_orders_are_cited_from_their_sources(text):
    # picotron/process_group_manager.py: arange(world).view(dp, pp, cp, tp); Megatron-Core's
    # initialize_model_parallel(order="tp-cp-ep-dp-pp") (RankGenerator, fastest first); torchtitan's ParallelDims
    # mesh ("pp", "dp_replicate", "dp_shard", "cp", "tp"), slowest first: only picotron orders (dp, pp, tp)
    assert "`picotron/process_group_manager.py`: `torch.arange(world_size).view(dp, pp, cp, tp)`" in text
    assert "picotron is the only one of the three libraries to use it" in text
    assert "`tp-cp-ep-dp-pp`" in text and "`megatron/core/parallel_state.py`" in text and "`RankGenerator`" in text
    assert '`("pp", "dp_replicate", "dp_shard", "cp", "tp")`' in text
    assert "`torchtitan/distributed/parallel_dims.py`" in text
    assert "Both keep tp innermost and put **pp outermost**, dp between" in text
    assert "the pipeline's stage boundaries take the farthest, slowest links" in text
    assert "torchtitan (`ParallelDims`) enumerate from `arange(P).view(dp, pp, tp)`" not in text  # the old claim
    right = next(a for a in quiz_question("picotron-order")["answers"] if a["correct"])
    assert right["answer"].startswith("picotron")


def test_why_a_layout_hides_its_traffic(nb, text):
    out = printed(cell_with(nb, "dp_threshold = F / cluster.network_bandwidth"))
    f_over_w = number(r"exceed F/W = ([\d,]+)", out)
    nvlink, network = number(r"F/\(2W\) = ([\d,]+) on NVLink", out), number(r", ([\d,]+) on the network", out)
    assert (f_over_w, nvlink, network) == (156e12 / 25e9, 156e12 / 600e9, 156e12 / 50e9)  # the planner's cluster
    table = rows(out, r"(data|tensor|pipeline|3-D)")
    first = rows(printed(cell_with(nb, "ALONE = {")), r"(data|tensor|pipeline|3-D)")
    assert set(table) == set(first)
    for label, cells in table.items():
        tokens, hides, ratio, bound, step, hidden = cells
        assert float(step) == float(first[label][2])  # the same planner step as the first table
        assert (hides == "yes") == (float(tokens.replace(",", "")) >= f_over_w), label
        if hides == "yes":  # the step less its dp term
            assert abs(float(hidden) - (float(first[label][2]) - float(first[label][6]))) <= 0.011, label
        if ratio != "-":
            assert bound == ("compute" if float(ratio.replace(",", "")) >= nvlink else "messages")
    zero3, tp_zero3, three_d = (table[k] for k in ("data parallel, ZeRO-3", "tensor (8) x data, ZeRO-3",
                                                   "3-D: tensor 8 x pipeline 16 x data 8"))
    assert zero3[1] == "no" and float(tp_zero3[5]) < float(three_d[5])
    assert f"give each of the 1,024 replicas {zero3[0]} tokens, under the {f_over_w:,.0f} that the network " \
           "needs" in text
    assert f"TP × ZeRO-3, {tp_zero3[5]} s, would then beat 3-D's {three_d[5]} s" in text
    assert "it **does not model the overlap**" in text and "nothing overlaps" in text
    assert f"C/(T − 1) = {three_d[2]} against {nvlink:,.0f}, compute-bound by far" in text
    at16 = number(r"tp = 16 \(across nodes\): C/\(T - 1\) = ([\d,]+)", out)
    assert "messages-bound" in out and f"at T = 16, across nodes, {at16:,.0f} against {network:,.0f}" in text
    tie = dict(re.findall(r"pp=\s*(\d+) dp=\s*\d+: [\d,]+ tokens per replica; [\d.]+ s as the planner counts, "
                          r"([\d.]+) s with the dp term hidden", out))
    assert float(tie["8"]) < float(tie["16"]) and f"({tie['8']} against {tie['16']} s)" in text
    assert "(with it hidden, section 1 found pp = 8 ahead)" in text  # the planner's takeaway 2, explained
    # the three conditions, as derived
    assert "**b ≥ F/W**" in text and "**C/(T − 1) ≥ F/(2W)**" in text
    assert "ZeRO-3** sends 1.5 times those bytes (chapter 15) and yet hides them at the **same** threshold" in text
    assert quiz_question("dp-threshold")["answers"][0]["value"] == f_over_w
    assert quiz_question("tp16-ratio")["answers"][0]["value"] == at16
    right = next(a for a in quiz_question("overlap-ranking")["answers"] if a["correct"])
    assert tp_zero3[5] in right["feedback"] and three_d[5] in right["feedback"]


def test_the_planners_six_all_reduces_and_korthikanti_one_year(text):
    assert "four all-reduces of the activations per block and micro-batch (six when the block is recomputed in full, " \
           "as in the table below)" in text
    assert "six all-reduces per block and micro-batch here, since full recomputation" in text
    assert "Korthikanti et al., MLSys 2023" in text and not re.search(r"Korthikanti et al\.[^.]{0,40}2022", text)


def test_the_deck_asks_the_lessons_ideas_with_numbers():
    deck = json.loads((Path(ROOT) / "minidist" / "course" / "quizzes" / f"{NAME}.json").read_text())
    ids = {q["id"] for q in deck["questions"]}
    assert not ids & {"colour", "key", "splits-size-one"}  # the exercise's own function: not the lesson's ideas
    assert "build_groups" not in json.dumps(deck)
    assert len(ids) >= 12 and sum(q["type"] == "numeric" for q in deck["questions"]) >= 3


def test_predicted_equals_measured_on_every_layout(nb, text):
    out = printed(cell_with(nb, "LAYOUTS = ["))
    table = layout_rows(out)
    assert set(table) == {(8, 1, 1), (4, 2, 1), (4, 1, 2), (2, 2, 2), (2, 4, 1), (2, 1, 4), (1, 2, 4), (1, 4, 2)}
    for layout, (measured, predicted, _, verdict) in table.items():
        assert measured == predicted and verdict == "True", layout
        for size, sent in zip(layout[::-1], measured):  # (tp, pp, dp): a group of one sends nothing
            assert (sent == 0) == (size == 1), layout
    assert out.rstrip().endswith("every count equal to its prediction: True")
    dense = number(r"the dense model: ([\d,]+) bytes", out)
    assert table[8, 1, 1][2] == (dense, dense)
    assert f"**dp = 8** sends {table[8, 1, 1][0][2]:,} bytes" in text and f"whole model, {dense:,.0f} bytes" in text
    low, high = table[2, 2, 2][2]
    assert f"{low:,} to {high:,} bytes on 2 × 2 × 2, a little more than a quarter" in text
    assert 0.25 < low / dense < high / dense < 0.3
    assert f"{table[4, 1, 2][0][0]:,} for tp = 2 and {table[2, 1, 4][0][0]:,} for tp = 4 on one stage" in text
    assert f"to {table[4, 1, 2][0][2]:,} and {table[2, 1, 4][0][2]:,} bytes" in text
    assert f"{max(row[0][1] for row in table.values()):,} bytes at most" in text


def test_the_planners_gpt3_layout_and_the_takeaways(nb, text):
    out = printed(cell_with(nb, "gpt3 = planner.plan"))
    best = re.findall(r"(dp=\d+ pp=\d+ tp=\d+) .*?: ([\d.]+) GiB, ([\d.]+) s per step, (\d+) TFLOP/s", out)
    assert number(r"(\d+) layouts fit", out) == 23 and "Of all the layouts of 1,024 GPUs, 23 fit" in text
    assert best[0] == ("dp=8 pp=16 tp=8", "27.2", "33.30", "132")
    assert "tp = 8, pp = 16, dp = 8: 27.2 GiB per GPU, 33.30 s a step, 132 TFLOP/s per GPU" in text
    assert float(best[2][2]) / float(best[0][2]) - 1 < 0.003 and "differ by less than 0.3 %" in text
    everything = best[5]
    assert everything[1:3] == ("73.9", "24.87") and "MFU 42.6%" in out.splitlines()[-1]
    assert "(73.9 GiB still fits) and predicts 24.87 s, an MFU of 42.6 %" in text
    paper = printed(cell_with(nb, "big = planner.Cluster(1536)"))
    theirs, ours = (number(r"GiB, ([\d.]+) s", line) for line in paper.splitlines())
    assert round(theirs - ours, 3) == 0.001 and "differ by 0.001 s of a 23 s step" in text
    assert "t = 8, p = 16, d = 12" in text and "dp=12 pp=16 tp=8" in paper
    assert number(r"(\d+) TFLOP/s", paper) == 127 and "Its 127 TFLOP/s is under the paper's 141" in text
    doc = (ROOT / "docs" / "planner_sc21.md").read_text()  # where the lesson's paper figures come from
    assert "| gpt3-175b | 1536 | 1536 | t=8, p=12, d=16, b=1 (Table 2) | 141 |" in doc
    assert "t = 8, p = 12, d = 16, at 141 TFLOP/s per GPU, as `docs/planner_sc21.md` records it" in text
    ways = printed(cell_with(nb, "allow_tp_across_nodes=True"))
    by_tp = {int(t): (float(step), float(tp)) for t, step, tp in
             re.findall(r"tp=\s*(\d+):\s+([\d.]+) s per step, of which TP\s+([\d.]+) s", ways)}
    assert min(by_tp, key=lambda t: by_tp[t][0]) == 8 and by_tp[16][1] > by_tp[8][0]
    assert f"shortens the step ({by_tp[2][0]:.2f}, {by_tp[4][0]:.2f}, {by_tp[8][0]:.2f} s)" in text
    assert by_tp[2][0] > by_tp[4][0] > by_tp[8][0]
    assert f"NVLink time ({by_tp[8][1]:.2f} s at t = 8)" in text
    assert f"TP alone takes {by_tp[16][1]:.2f} s, more than the whole {by_tp[8][0]:.2f} s step" in text
    assert "fits with tp=8: pp=8" in ways and "the smallest pipeline that fits is pp = 8" in text
    faster = number(r"([\d.]+) % more", ways)
    assert f"predicts {faster:.3f} % faster" in text
    bubbles = dict(re.findall(r"b=(\d): [\d.]+ s per step \(bubble ([\d.]+) s\)", ways))
    assert f"({bubbles['1']} s at b = 1, {bubbles['8']} s at b = 8)" in text


def test_the_layout_search(nb, text):
    explorer = cell_with(nb, "layout_explorer(")
    assert explorer.source.startswith("# NBVAL_IGNORE_OUTPUT")
    first = printed(cell_with(nb, "print(layout_report("))
    total, over = number(r"total\s+([\d.]+)", first), number(r"OUT OF MEMORY: ([\d.]+) GiB over", first)
    assert f"{total} GiB, {over} GiB over" in text
    best = printed(cell_with(nb, "planner.Cluster(512)"))
    times = {tp: float(t) for tp, t in re.findall(r"tp=(\d) .*?GiB, ([\d.]+) s per step", best)[::-1]}
    assert f"ahead of its best with tp = 8 by {100 * (times['8'] / times['4'] - 1):.1f} % ({times['4']} " \
           f"against {times['8']} s per step)" in text
    assert "512 GPUs of 80 GiB" in text


def test_the_deck_is_shown_at_the_end(nb):
    codes = [cell.source for cell in nb.cells if cell.cell_type == "code"]
    assert f'quiz.show_flashcards("{NAME}")' in codes[-2] and f'quiz.show_quiz("{NAME}")' in codes[-1]
    assert "(9 cards" in printed(nb.cells[-2]) and "(15 questions)" in printed(nb.cells[-1])


def test_the_exercise_prose_quotes_its_cell():
    solved = nbformat.read(Path(ROOT) / "solutions" / f"{NAME}.ipynb", as_version=4)
    out = printed(cell_with(solved, "def members"))
    assert "rank  5 at (1, 0, 1): dp [1, 5, 9] (rank 1 there), pp [5, 7] (rank 0 there), tp [4, 5] (rank 1 there)" \
        in out
    words = prose(" ".join(cell.source for cell in solved.cells if cell.cell_type == "markdown"))
    assert "its tp group is its neighbour and itself, [4, 5]; its pipeline is [5, 7]" in words
    assert "its data-parallel group is [1, 5, 9]" in words
    verdict = printed(cell_with(solved, "check_build_groups(build_groups)"))
    assert verdict.startswith("build_groups: ok") and len(verdict.strip().splitlines()) == 13  # 12 shapes
