"""Lesson 14 (tensor parallelism) and its deck against the lesson's own outputs.

Every number the prose quotes about a cell is checked against what that cell printed in the
committed notebook (the output a learner sees before running anything). Cells are found by a
phrase they contain, not by their index. The measured tables are also checked against their
own formulas, so a changed engine (a message more, an array kept) fails here, not silently in
the prose.
"""
import json
import re

import pytest
from lesson_outputs import ROOT, cell_with, lesson, lesson_prose, number, printed

NAME = "14_tensor_parallelism"


@pytest.fixture(scope="module")
def nb():
    return lesson(NAME)


@pytest.fixture(scope="module")
def text(nb):
    return lesson_prose(nb)



def table(out: str, first: str) -> dict:
    """{(T, name): [numbers...]} from rows ``T | name | n | n`` (``first``: the header's start)."""
    rows = {}
    for line in out[out.index(first):].splitlines()[1:]:
        parts = [p.strip() for p in line.split("|")]
        if len(parts) >= 3 and parts[0].isdigit():
            rows[int(parts[0]), parts[1]] = [float(p.replace(",", "")) for p in parts[2:]]
    return rows


def test_the_split_pair_equals_the_dense_pair_on_uneven_sizes_and_the_prose_counts(nb, text):
    out = printed(cell_with(nb, "def split_mlp"))
    blocks = {1: "0:10", 2: "0:5 5:10", 3: "0:4 4:7 7:10", 4: "0:3 3:6 6:8 8:10"}
    sent = {}
    for p, block in blocks.items():
        line = next(line for line in out.splitlines() if line.startswith(f"T = {p}:"))
        assert block in line and "equal to 1e-12: True" in line, line
        sent[p] = (number(r"sent (\d+) values forward", line), number(r"(\d+) backward", line))
    assert sent[1] == (0, 0)
    assert sent[2] == sent[3] == (60, 72) and sent[4] == (120, 144)
    assert "(B, s, OUT) = 60 values, (B, s, IN) = 72 values" in out
    assert "rank 0 sends 60 values forward, the (3, 4, 5) output" in text
    assert "Backward it sends 72, the (3, 4, 6) gradient of X" in text
    assert "On 4 ranks both numbers double" in text
    assert "3 ranks hold 4, 3 and 3 hidden features and 4 ranks hold 3, 3, 2 and 2" in text


def test_gelu_of_a_sum_is_not_the_sum_of_gelus(nb):
    out = printed(cell_with(nb, "GELU(a) + GELU(b)"))
    rows = [re.findall(r"-?\d+\.\d+", line) for line in out.splitlines()]
    assert rows[0] != rows[1] and len(rows[0]) == len(rows[1]) == 2


def test_the_split_gpt_equals_the_dense_loss_and_its_parameter_share(nb, text):
    out = printed(cell_with(nb, "def split_gpt"))
    assert out.count("equal to the dense loss to 1e-12: True") == 2
    mine = number(r"T = 4:.*parameters per rank ([\d,]+)", out)
    total = number(r"T = 4:.*parameters per rank [\d,]+ of ([\d,]+)", out)
    assert f"{mine:,.0f} of {total:,.0f} on 4 ranks ({round(100 * mine / total)} %)" in text
    assert re.search(r"c_attn\.weight\s+\(96, 32\)\s+-> \(24, 32\)", out)
    assert re.search(r"mlp\.c_proj\.weight\s+\(32, 128\)\s+-> \(32, 32\)", out)
    assert re.search(r"ln_1\.weight\s+\(32,\)\s+-> \(32,\)", out)  # whole on every rank


def test_the_vocabulary_loss_sends_three_numbers_per_position_and_the_quiz_agrees(nb, text):
    out = printed(cell_with(nb, "def split_loss"))
    two, four = out.splitlines()[:2]
    assert "['0:4', '4:7']" in two and "['0:2', '2:4', '4:6', '6:7']" in four
    # the second all-reduce carries one number more, each rank's width (summed: V)
    assert "float64 messages forward: [6, 7, 6]," in two and "[6, 6, 7, 7, 6, 6]," in four
    assert two.count("values sent backward: 0") == four.count("values sent backward: 0") == 1
    for line in (two, four):
        loss, dense = re.search(r"loss (\d\.\d+) \(dense (\d\.\d+)\)", line).groups()
        assert loss == dense
    assert "Three all-reduces of N = 6 numbers" in text and "recursive doubling sends each one twice" in text
    assert "The second carries one number more" in text
    ratio = number(r"\(([\d,]+) times fewer\)", printed(cell_with(nb, "V_GPT2, T_ = 50_257, 8")))
    deck = json.loads((ROOT / "minidist" / "course" / "quizzes" / f"{NAME}.json").read_text())
    question = next(q for q in deck["questions"] if q["id"] == "vocab-ratio")
    assert any(a.get("correct") and a["range"][0] <= ratio <= a["range"][1] for a in question["answers"]
               if "range" in a)
    assert abs(question["answers"][0]["value"] - ratio) <= question["tolerance"]


def test_bytes_per_step_equal_their_formulas_and_the_prose(nb, text):
    out = printed(cell_with(nb, "def step_bytes"))
    rows = table(out, " T | strategy")
    assert set(rows) == {(p, s) for p in (2, 4) for s in ("TP", "TP + SP", "DDP")}
    for (p, strategy), (measured, formula) in rows.items():
        assert measured == formula, (p, strategy)
    n = number(r"n = B·s·C = ([\d,]+) values", out)
    params = number(r"N = ([\d,]+) parameters", out)
    assert "recursive_doubling for n on 2 ranks, recursive_doubling on 4" in out
    assert rows[2, "DDP"][0] == 4 * params and rows[4, "DDP"][0] == 4 * 1.5 * params  # ring: 2(T - 1)/T · N
    layers = 2
    assert rows[2, "TP"][0] == 4 * ((2 + 4 * layers) * n + 3 * 128 + 1)  # recursive doubling on 2: the whole array
    tp, sp = rows[2, "TP"][0], rows[2, "TP + SP"][0]
    regather = 4 * (2 * layers + 1) * n / 2
    assert f"on 2 ranks TP sends {tp:,.0f} bytes and TP + SP {sp:,.0f}" in text
    assert f"Of the {sp - tp:,.0f} more, {regather:,.0f} are the five all-gathers repeated in the backward and " \
           f"{sp - tp - regather:,.0f} the small all-reduces" in text
    assert f"({rows[4, 'TP + SP'][0]:,.0f} against {rows[4, 'TP'][0]:,.0f} bytes)" in text
    assert rows[4, "TP + SP"][0] < rows[4, "TP"][0]
    assert f"({tp:,.0f} against {rows[2, 'DDP'][0]:,.0f} bytes on 2 ranks)" in text and tp > rows[2, "DDP"][0]


def test_activation_memory_per_rank_and_by_op_as_the_prose_says(nb, text):
    out = printed(cell_with(nb, "def held_for_backward"))
    share = {}
    for p in (2, 4):
        for label in ("TP     ", "TP + SP"):
            share[p, label.strip()] = number(rf"T = {p}, {re.escape(label)}:\s+[\d,]+ bytes per rank = (\d+)%", out)
    assert f"{share[4, 'TP']:.0f} % on 4 ranks, {share[2, 'TP']:.0f} % on 2" in text
    assert f"down to {share[4, 'TP + SP']:.0f} % on 4 ranks (1/T is 25 %) and {share[2, 'TP + SP']:.0f} % on 2" in text
    assert share[4, "TP + SP"] < share[4, "TP"] and share[2, "TP + SP"] < share[2, "TP"]
    ops = {}
    for line in out[out.index("by op"):].splitlines()[1:]:
        name, rest = line[:34].strip(), line[34:]
        ops[name] = [int(v.strip().replace(",", "")) for v in rest.split("|")]
    assert ops["LayerNorm"][1] == ops["LayerNorm"][0] == 4 * ops["LayerNorm"][2]
    assert ops["Add"][1] == 4 * ops["Add"][2]
    assert ops["CopyToTensorParallelRegion"][1] == 4 * ops["AllGatherLinear"][2]
    ln, add, copy = ops["LayerNorm"], ops["Add"], ops["CopyToTensorParallelRegion"][1]
    assert f"the LayerNorms hold {ln[1]:,} bytes on each of the 4 ranks" in text
    assert ops["Add"][1] == ops["Add"][0]  # the bias is added inside LinearReduce: only the residual stream
    assert f"the residual stream) {add[1]:,}, again the dense model's" in text
    assert f"the inputs of the column-parallel layers, held by f, {copy:,}" in text
    assert f"{ln[2]:,} bytes for the LayerNorms, {add[2]:,} for the additions, and " \
           f"{ops['AllGatherLinear'][2]:,} for the column-parallel inputs" in text
    embedding = ops["Mul"][2] + ops["ReduceScatterToSequenceParallelReg"][2]
    assert f"{embedding:,} bytes on every rank" in text
    for op in ("GELU", "ScaledDotProductAttention", "LinearReduce"):
        assert ops[op][1] == ops[op][2]  # split by TP already: SP changes nothing
    question = quiz_question("sp-share-4")  # the deck's numeric answer is the cell's figure
    assert question["answers"][0]["value"] == share[4, "TP + SP"]
    assert question["answers"][1]["value"] == share[4, "TP"]


def test_the_block_is_drawn_by_region_with_the_bytes_by_op(nb):
    cell = cell_with(nb, "REGION = {")
    assert any("image/png" in o.get("data", {}) for o in cell.outputs)
    assert "held[4, False][1]" in cell.source and "held[4, True][1]" in cell.source  # the measured table's dicts


def test_no_option_length_gives_the_answer_away():
    deck = json.loads((ROOT / "minidist" / "course" / "quizzes" / f"{NAME}.json").read_text())
    singles = [q for q in deck["questions"] if q["type"] == "multiple_choice"]
    assert len(deck["questions"]) >= 12 and sum(q["type"] == "numeric" for q in deck["questions"]) >= 3
    for q in singles:
        right = next(len(a["answer"]) for a in q["answers"] if a["correct"])
        others = [len(a["answer"]) for a in q["answers"] if not a["correct"]]
        assert min(others) <= right <= max(others), q["id"]  # never strictly the shortest nor the longest


def test_when_tp_pays_quotes_the_calculator(nb, text):
    out = printed(cell_with(nb, "C_big, s_big, B_big, T_big"))
    compute = number(r"= ([\d.]+) ms at peak", out)
    nvlink = number(r"NVLink 4 .*:\s+([\d.]+) ms", out)
    ib = number(r"InfiniBand .*:\s+([\d.]+) ms", out)
    assert f"cost {nvlink:.2f} ms per block against {compute:.2f} ms of matrix products" in text
    assert f"the same messages take {ib:.2f} ms, more than twice the computation" in text
    assert 2 * compute < ib and nvlink < compute


def test_when_tp_pays_as_one_inequality_and_the_deck_quotes_it(nb, text):
    # C/(T - 1) against peak/(2 bandwidth): chapter 16's condition, with section 7's H100 and links
    out = printed(cell_with(nb, "C_big, s_big, B_big, T_big"))
    ratio = number(r"C/\(T - 1\) = ([\d,]+)", out)
    nvlink = number(r"NVLink 4 inside a node ([\d,]+)", out.splitlines()[-1])
    ib = number(r"InfiniBand NDR across nodes ([\d,]+)", out.splitlines()[-1])
    assert (ratio, nvlink, ib) == (round(12_288 / 7), round(989e12 / 900e9), round(989e12 / 100e9))
    assert nvlink < ratio < ib
    assert "**C/(T − 1) > peak/(2 · bandwidth)**" in text
    assert f"Here C/(T − 1) is {ratio:,.0f}: above NVLink's {nvlink:,.0f}, far below InfiniBand's {ib:,.0f}" in text
    question = quiz_question("tp-threshold-ib")
    assert question["answers"][0]["value"] == ib and question["answers"][1]["value"] == nvlink


def quiz_question(qid: str) -> dict:
    deck = json.loads((ROOT / "minidist" / "course" / "quizzes" / f"{NAME}.json").read_text())
    return next(q for q in deck["questions"] if q["id"] == qid)


def test_megatrons_padded_vocabulary_is_not_masked_and_training_drives_it_down(nb, text):
    # Megatron-LM: vocab_size_with_padding pads to make_vocab_size_divisible_by x TP; VocabParallelCrossEntropy
    # masks targets outside a rank's range, never padded logits (megatron/core/tensor_parallel/cross_entropy.py)
    assert "masks the padded logits" not in text and "It does **not** mask the padded logits" in text
    assert "`megatron/core/tensor_parallel/cross_entropy.py`" in text
    assert "`megatron/core/tokenizers/utils/build_tokenizer.py`" in text and "multiple of 128·T" in text
    out = printed(cell_with(nb, "def padded_loss"))
    dense, padded = (float(x) for x in re.search(r"loss over the 7 tokens (\d\.\d+); with the padded row in the "
                                                  r"softmax (\d\.\d+)", out).groups())
    assert padded > dense
    assert "its gradient = that probability / 6, at every position: True; all > 0: True" in out
    probabilities = [float(p) for p in re.search(r"positions: ([\d. ]+)", out).group(1).split()]
    after, before = (float(x) for x in re.search(r"largest probability ([\d.]+) \(it was ([\d.]+)\)", out).groups())
    assert before == max(probabilities) and after < before / 10
    assert f"take the padded token's largest probability from {before:.3f} to {after:.4f}" in text
    question = quiz_question("padded-vocabulary")
    assert "drives them down" in next(a["answer"] for a in question["answers"] if a["correct"])


def test_four_all_reduces_per_block_and_micro_batch_six_with_full_recomputation(text):
    assert "per block and micro-batch**: two in the forward, two in the backward" in text
    assert "**six**, the count chapter 16's planner uses" in text
    assert "per block per step" not in text
    assert quiz_question("tp-recompute-six")["answers"][0]["value"] == 6


def test_korthikanti_one_year_and_their_names_for_the_operators(text):
    assert "Korthikanti et al., MLSys 2023" in text and "2022)" not in text.split("Korthikanti")[1][:80]
    assert "write it f and f̄" in text and "**g** and the reduce-scatter that takes g's place **ḡ**" in text
    assert not re.search(r"Korthikanti et al\.[^.]{0,90}2022", text)


def test_the_deck_is_shown_at_the_end(nb):
    codes = [cell.source for cell in nb.cells if cell.cell_type == "code"]
    assert f'quiz.show_flashcards("{NAME}")' in codes[-2] and f'quiz.show_quiz("{NAME}")' in codes[-1]
    assert "(10 cards" in printed(nb.cells[-2]) and "(17 questions)" in printed(nb.cells[-1])


def test_timing_is_left_to_the_benchmark(nb, text):
    assert "benchmarks/bench_tensor_parallel.py" in text
    assert not any("perf_counter" in cell.source for cell in nb.cells if cell.cell_type == "code")
