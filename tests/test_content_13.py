"""Lesson 13 (transformers) and its deck against the lesson's own outputs.

Every number the prose quotes about a cell is checked against what that cell printed in the
committed notebook (the output a learner sees before running anything), timing cells included:
their numbers change from run to run, so the prose must have been written from the saved run.
Cells are found by a phrase they contain, not by their index.
"""
import json
import math
import re
from pathlib import Path

import nbformat
import pytest
from lesson_outputs import cell_with, lesson_prose, number, printed

from minidist import planner
from minidist.course import quiz

ROOT = Path(__file__).resolve().parents[1]
NAME = "13_transformers"


@pytest.fixture(scope="module")
def nb():
    return nbformat.read(ROOT / "notebooks" / f"{NAME}.ipynb", as_version=4)


def markdown(nb) -> str:
    return lesson_prose(nb)



def quoted(text: str, value: str) -> bool:
    """``value`` appears in ``text`` as a whole number (not inside a longer one)."""
    return re.search(rf"(?<![\d.]){re.escape(value)}(?![\d])", text) is not None


# ----------------------------------------------------------------------------- the deterministic cells

def test_the_causal_demo_moves_only_later_positions_as_the_prose_says(nb):
    out = printed(cell_with(nb, "changed[0, 6] = "))
    assert "GPT (causal mask), logits that moved: ......xxxxxxx" in out
    assert re.search(r"both directions \(BERT\), outputs that moved:\s+x{13}\n", out)
    assert re.search(r"causal \(GPT\), outputs that moved:\s+\.{6}x{7}\n", out)
    text = markdown(nb)
    assert "only positions 6 to 12 move" in text and "positions 0 to 5" in text


def test_parameter_count_and_embedding_share(nb):
    out = printed(cell_with(nb, "formula = L * per_block"))
    counted = number(r"parameters: ([\d,]+) counted", out)
    assert counted == number(r"\+ 2C = ([\d,]+)", out) == 108_992
    embeddings = number(r"transformer\.wte\.weight\s+\(75, 64\)\s+([\d,]+)", out) + \
        number(r"transformer\.wpe\.weight\s+\(64, 64\)\s+([\d,]+)", out)
    text = markdown(nb)
    assert f"the two embeddings are {embeddings:,.0f} of the {counted:,.0f} parameters, about " \
           f"{round(100 * embeddings / counted)} %" in text
    assert "largest difference from the hand-written forward: 0.0" in printed(cell_with(nb, "def block_by_hand"))


def test_the_square_term_is_almost_everything_only_for_wide_models(nb):
    """Issue 35 item 2: 12·L·C² is 94.7 % of GPT-2 XL but 68.3 % of the 124 M GPT-2; the cell counts
    both with the planner's counter, and the prose quotes the printed shares."""
    out = printed(cell_with(nb, "planner.get_model(name)"))
    shares = {}
    for name in ("gpt2", "gpt2-xl", "gpt3-175b"):
        spec = planner.get_model(name)
        square = 12 * spec.layers * spec.hidden**2
        line = next(line for line in out.splitlines() if line.startswith(f"{name} "))
        assert f"{spec.parameters:,d} parameters" in line
        assert abs(spec.parameters - spec.published) < 1e-4 * spec.published or name == "gpt3-175b"
        shares[name] = number(r"12·L·C² is\s+([\d.]+) %", line)
        assert shares[name] == round(100 * square / spec.parameters, 1)
        if name == "gpt2":
            embedding = number(r"the token embedding\s+([\d.]+) %", line)
            assert embedding == round(100 * spec.vocab * spec.hidden / spec.parameters, 1)
    assert (shares["gpt2"], shares["gpt2-xl"], shares["gpt3-175b"]) == (68.3, 94.7, 99.6)
    text = markdown(nb)
    assert f"the 12·L·C² term is only {shares['gpt2']} % of the parameters" in text
    assert f"50,257 × 768 numbers is {embedding} % by itself" in text
    assert f"For GPT-2 XL (C = 1,600, 48 blocks) it is {shares['gpt2-xl']} %" in text
    assert f"for GPT-3 (C = 12,288) {shares['gpt3-175b']} %" in text
    assert "For GPT-2's sizes the 12·L·C² term is almost everything" not in text


def test_the_training_recipe_is_gpt3s_and_korthikanti_has_one_year(nb):
    """Issue 35 item 2: clipping at 1, warm-up and cosine decay are GPT-3's (Brown et al. 2020,
    appendix B), not GPT-2's; Korthikanti et al. is MLSys 2023 in the prose and in the code."""
    text = markdown(nb)
    assert "That is GPT-3's recipe (Brown et al. 2020, appendix B: the global gradient norm clipped at 1.0, " \
           "a linear warm-up over the first 375 million tokens, then a cosine decay to 10 % of the peak rate)" in text
    assert "as GPT-2 and nanoGPT train" not in text
    optim_doc = (ROOT / "minidist" / "optim.py").read_text(encoding="utf-8")
    assert "GPT-2-style" not in optim_doc and "GPT-3's schedule, Brown et al. 2020" in optim_doc
    sources = " ".join(cell.source for cell in nb.cells)
    assert "Korthikanti et al. 2022" not in sources and "2022, section" not in sources
    assert "Korthikanti et al., MLSys 2023, section 4.1" in cell_with(nb, "def training_memory").source
    assert "Large Transformer Models\", MLSys 2023, section 4.1)" in text


def test_the_block_table_says_it_prints_bytes(nb):
    """Issue 35 item 2: the header of the per-op table names bytes (each row is bytes / (s·h))."""
    out = printed(cell_with(nb, "def block_activations"))
    assert "492,544 bytes held; per op, in units of s*h = 4,096 bytes:" in out
    assert "float32 values" not in out


def test_attention_memory_matches_its_formula_and_the_prose(nb):
    out = printed(cell_with(nb, "formula = 4 * (3 * H * T * D + H * T * T)"))
    rows = [line.split("|") for line in out.splitlines()[1:]]
    assert [int(r[0]) for r in rows] == [64, 128, 256, 512, 1024]
    assert all(r[1].strip() == r[2].strip() for r in rows)
    text = markdown(nb)
    first, last = rows[0][3].strip().rstrip("%"), rows[-1][3].strip().rstrip("%")
    assert f"the T² part is already {round(float(first))} %" in text and f"at T = 1024 it is {last} %" in text
    assert f"{int(rows[-1][1].replace(',', '')) / 1e6:.1f} MB for one sequence of 1024 tokens" in text


def test_training_losses_quoted_are_the_printed_ones(nb):
    out = printed(cell_with(nb, "history = {"))
    last = [line for line in out.splitlines() if re.match(r"\s*\d+ \|", line)][-1]  # the last step's row
    step, _, train, val = (part.strip() for part in last.split("|"))
    text = markdown(nb)
    assert f"After {step} steps the validation loss is {val} nats" in text
    assert f"At {float(val):.2f} nats per character" in text
    assert "ln 75 = 4.317" in text and "ln(75) = 4.317" in out
    d = number(r"D = ([\d,]+) tokens", printed(cell_with(nb, "per_token = 6 * N")))
    assert f"{step} steps of 16 windows: {d:,.0f} characters" in text
    assert float(val) < float(train) < 4.317  # the lagging training column, as the prose says


def test_the_sample_starts_with_its_prompt_and_looks_like_verse(nb):
    out = printed(cell_with(nb, "model.generate("))
    assert out.startswith("ROMEO:\n") and len(out.rstrip("\n")) == 6 + 300
    lines = [line for line in out.splitlines()[1:] if line.strip()]
    assert sum(line[0].isupper() for line in lines) > len(lines) / 2, "most lines start with a capital"
    assert all(re.search(rf"\b{word}\b", out) for word in ("thou", "you", "the"))
    assert "the shape of verse: short lines, most of them with a capital at the start" in markdown(nb)


def test_the_training_run_is_float64_so_its_outputs_do_not_depend_on_the_blas_kernel(nb):
    """In float32, 500 steps turn a matrix product's last bit (which depends on the BLAS kernel the CPU
    gets: OpenBLAS's Haswell, Sandy Bridge or SkylakeX kernels) into weights 0.05 apart, the third
    decimal of the losses and another sample after 17 characters; float64 ends near 1e-10, so the
    committed losses and sample are the same on every CPU (make test-notebooks-blas runs them so)."""
    train = cell_with(nb, "history = {").source
    assert 'model = GPT(config, rng=0, dtype="float64")' in train
    assert "model.generate(" in cell_with(nb, "model.generate(").source  # the sample comes from that model
    text = markdown(nb)
    assert "this run computes in **float64**, so that its numbers (the losses, the sample) are the same" in text
    assert "to about 10⁻¹⁰ because the run is float64: too little to tip any of the 300 draws" in text
    mfu = printed(cell_with(nb, "def matmul_flops"))
    assert "the training run (float64):" in mfu and "in float64 (the training run's precision)" in mfu


def test_memory_parts_quoted_are_the_measured_ones(nb):
    out = printed(cell_with(nb, "with memory.track(model32) as tracker:"))  # float32: the trained weights, cast
    params = number(r"parameters\s+:\s+([\d,]+) bytes", out)
    grads = number(r"gradients\s+:\s+([\d,]+) bytes", out)
    adam = number(r"AdamW state \(2 moments\)\s+:\s+([\d,]+) bytes", out)
    acts = number(r"activations \(peak, batch 16 x 64\)\s*:\s+([\d,]+) bytes", out)
    assert params == grads == 4 * 108_992 and adam == 2 * params
    blocks = [float(x) for x in re.findall(r"transformer\.h\.\d\s+[\d,]+ bytes \(\s*([\d.]+)%\)", out)]
    text = markdown(nb)
    assert f"{params:,.0f} bytes each" in text
    assert f"{(params + grads + adam) / 1e6:.2f} MB of state" in text
    assert f"are {acts / 1e6:.1f} MB, ten times the state" in text and round(acts / (params + grads + adam)) == 10
    assert f"{round(sum(blocks))} % of them sit in the two blocks" in text


def test_the_engines_block_formula_holds_for_every_size_printed(nb):
    out = printed(cell_with(nb, "def block_activations"))
    for measured, formula in re.findall(r"measured\s+([\d,]+), 104sh \+ 4as\^2 \+ 16s =\s+([\d,]+)", out):
        assert measured == formula
    units = {op: float(v) for op, v in re.findall(r"^\s+(\w+)\s+([\d.]+)$", out, re.MULTILINE)}
    assert units == {"LayerNorm": 8.25, "Linear": 28.0, "Reshape": 12.0, "ScaledDotProductAttention": 28.0,
                     "Transpose": 4.0, "Add": 8.0, "GELU": 32.0}
    engine = number(r"16 s = ([\d,]+) bytes", out)
    paper = number(r"as\^2\s+= ([\d,]+) bytes", out)
    assert f"{engine:,.0f} bytes against {paper:,.0f} here, {engine / paper:.1f} times as much" in markdown(nb)


def test_the_calculator_and_the_readme_comparison(nb):
    out = printed(cell_with(nb, "def training_memory"))
    text = markdown(nb)
    state = number(r"BERT-large, sequences of 512: state ([\d.]+) GiB", out)
    per_sequence = number(r"BERT-large, sequences of 512: state [\d.]+ GiB \+ ([\d.]+) GiB", out)
    fit = number(r"BERT-large, sequences of 512: .* at most (\d+) sequences", out)
    assert state == pytest.approx(340e6 * 16 / 2**30, abs=0.005)
    assert f"keeps {per_sequence} GiB of activations in BERT-large" in text and f"at most {fit:.0f} sequences" in text
    assert f"BERT-large's 340 M parameters cost before any data: {state} GiB" in text
    for seq_len, batch in ((384, 32), (512, 32)):
        total = number(rf"s = {seq_len}, batch {batch}\s+\|\s+[\d.]+\s+\|\s+[\d.]+\s+\|\s+([\d.]+)", out)
        assert quoted(text, f"{total:.2f} GiB"), total
    ratios = []
    for bound, measured in re.findall(r"BERT-\w+\s+s = \d+ \|\s+(\d+) \|\s+(\d+)", out):
        if int(measured):
            ratios.append(int(bound) / int(measured))
    assert f"allows {min(ratios):.1f} to {max(ratios):.1f} times as many sequences" in text
    assert re.search(r"BERT-large\s+s = 512 \|\s+\d+ \|\s+0$", out, re.MULTILINE)
    assert "google-research/bert, \"Out-of-memory issues\", 2018" in text


def test_flops_and_the_gpt3_estimates(nb):
    out = printed(cell_with(nb, "per_token = 6 * N"))
    text = markdown(nb)
    share = number(r"FLOPs \(([\d.]+)% attention\)", out)
    assert f"attention is {share} % of the work at T = 64" in text
    days_peak = number(r"6ND, at the A100's peak\s+: .* = ([\d.]+) days", out)
    days_megatron = number(r"8ND, at 140 TFLOP/s per GPU : .* = ([\d.]+) days", out)
    assert f"is {days_megatron} days, their \"about 34 days\"" in text and f"it would be {days_peak}." in text
    gpt3_share = 12 * 96 * 2048 * 12288 / (6 * 175e9 + 12 * 96 * 2048 * 12288)
    assert gpt3_share < 0.03 and "it is under 3 %" in text


def test_h100_roofline_and_link_times_quoted(nb):
    out = printed(cell_with(nb, "H100 = {"))
    text = markdown(nb)
    assert number(r"ridge point: (\d+) FLOP/byte \(bf16\)", out) == 295 and "295 FLOP per byte" in text
    mlp = number(r"MLP c_fc .*?([\d.]+) FLOP/byte", out)
    assert f"({mlp:.0f} FLOP per byte)" in text
    qk = re.search(r"q k\^T .*?([\d.]+) FLOP/byte: at most\s+([\d.]+)%", out).groups()
    assert f"({qk[0]} FLOP per byte) at most {qk[1]} %" in text
    shares = [float(x) for x in re.findall(r"(?:GELU|LayerNorm|softmax)\s+[\d.]+ FLOP/byte: at most\s+([\d.]+)%", out)]
    assert f"at most {min(shares)} to {max(shares)} % of it" in text
    links = printed(cell_with(nb, "LINKS = {"))
    for name, words in (("PCIe 3.0 x16", "Over PCIe 3.0 the exchange alone takes"),
                        ("NVLink 2 \\(V100", "over a V100's NVLinks"), ("NVLink 4 \\(H100", "over an H100's")):
        ms = re.search(name + r".*?([\d.]+) ms", links).group(1)
        assert re.search(re.escape(words) + r"\s+" + re.escape(ms) + " ms", text), (words, ms)


# ----------------------------------------------------------------------------- the timing cells' numbers

def timing_values(nb) -> dict:
    att = printed(cell_with(nb, "attention_ms = ["))
    rows = [[float(x) for x in re.findall(r"[\d.]+", line)[:3]] for line in att.splitlines()
            if re.match(r"\s*\d+ \|", line)]
    mfu = printed(cell_with(nb, "def matmul_flops"))
    roof = printed(cell_with(nb, "ELEMENTWISE = {"))
    values = {"ATT64": f"{rows[0][1]:.2f}", "LIN64": f"{rows[0][2]:.2f}", "ATT1024": f"{rows[-1][1]:.2f}",
              "LIN1024": f"{rows[-1][2]:.2f}",
              "CROSS": str(int(next(r[0] for r in rows if r[1] > r[2]))),
              "PEAK": re.search(r"peak: the best of them, ([\d.]+)", mfu).group(1),
              "PEAK64": re.search(r"in float64 \(the training run's precision\): ([\d.]+)", mfu).group(1),
              "MM_MIN": "{:.1f}".format(min(float(x) for x in re.findall(r"n = \d+: ([\d.]+)", mfu)))}
    values["ACHIEVED"], values["MFU"] = re.search(r"([\d.]+) GFLOP/s of useful work: MFU = ([\d.]+)%", mfu).groups()
    values["BW"], values["RIDGE"] = re.search(r"bandwidth ([\d.]+) GB/s, ridge point ([\d.]+)", roof).groups()
    labels = (("GELU \\(tanh\\)", "GELU"), ("LayerNorm", "LN"), ("softmax", "SM"), ("add \\(residual\\)", "ADD"))
    for label, key in labels:
        values[key] = re.search(label + r"\s*\|\s*[\d.]+\s*\|\s*[\d.]+\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)", roof).groups()
    return values


def test_the_timing_prose_quotes_the_saved_timings(nb):
    v = timing_values(nb)
    text = markdown(nb)
    assert f"At T = 64 attention takes {v['ATT64']} ms against {v['LIN64']} ms" in text
    assert f"from T = {v['CROSS']} on it takes longer" in text
    assert f"at T = 1024 it takes {v['ATT1024']} ms against {v['LIN1024']} ms" in text
    assert f"did {v['ACHIEVED']} GFLOP/s of the model's FLOPs, {v['MFU']} % of the {v['PEAK64']} GFLOP/s of the " \
           "core's best float64 matrix product" in text
    assert f"This core moves {v['BW']} GB/s and computes at most {v['PEAK']} GFLOP/s (float32): its ridge point is " \
           f"{v['RIDGE']} FLOP per byte" in text
    assert f"run at {v['MM_MIN']} to {v['PEAK']} GFLOP/s" in text
    for key, words in (("GELU", "GELU"), ("LN", "LayerNorm"), ("SM", "softmax"), ("ADD", "the residual addition")):
        rate, roof = v[key]
        assert re.search(rf"{words} {re.escape(rate)}( GFLOP/s)? against (a roof of )?{re.escape(roof)}\b", text), key


def test_timing_cells_are_marked_and_only_they(nb):
    timed = [cell for cell in nb.cells if cell.cell_type == "code" and "time.perf_counter" in cell.source]
    for cell in nb.cells:
        if cell.cell_type == "code" and ("median_time(" in cell.source or "train_seconds" in cell.source):
            if "train_seconds = time.perf_counter() - start" in cell.source:
                continue  # the training cell measures its time but prints only seeded losses
            assert cell.source.startswith("# NBVAL_IGNORE_OUTPUT"), cell.source[:80]
    assert timed


# ----------------------------------------------------------------------------- the deck and the exercise

def test_deck_has_at_least_twelve_questions_and_cards_on_the_lesson():
    """Issue 35 item 4: at least 12 questions, several of them numeric."""
    deck = json.loads((ROOT / "minidist" / "course" / "quizzes" / f"{NAME}.json").read_text(encoding="utf-8"))
    assert len(deck["questions"]) >= 12 and len(deck["flashcards"]) >= 8
    assert sum(q["type"] == "numeric" for q in deck["questions"]) >= 4
    ids = [q["id"] for q in deck["questions"]]
    assert len(ids) == len(set(ids))
    for spec in deck["questions"]:
        assert "exercise" not in spec["question"].lower(), spec["id"]
    assert quiz.read_deck(NAME)


def test_numeric_answers_of_the_deck_follow_from_the_lesson():
    specs = {q["id"]: q for q in quiz.load_deck(NAME)}

    def right(spec_id):
        return next(a["value"] for a in specs[spec_id]["answers"] if a.get("correct"))

    assert right("block-params") == 12 * 64 * 64 + 13 * 64
    assert right("attention-t-squared") == 4 * (2048 / 512) ** 2
    assert math.isclose(right("bert-large-state"), 340e6 * 16 / 2**30, abs_tol=0.005)
    assert math.isclose(right("six-nd") * 1e20, 6 * 1e9 * 20e9)
    gpt2 = planner.get_model("gpt2")
    assert math.isclose(right("square-term-share"), 12 * gpt2.layers * gpt2.hidden**2 / gpt2.parameters, abs_tol=5e-4)
    assert right("ridge-point") == round(989e12 / 3.35e12)  # the H100 cell's peak_bf16 over bandwidth


def test_no_right_option_is_told_by_its_length():
    """Issue 35 item 4: in no single-choice question of this deck is the right option strictly the
    longest or strictly the shortest of its options."""
    for spec in quiz.load_deck(NAME):
        if spec["type"] != "multiple_choice":
            continue
        right = len(next(a["answer"] for a in spec["answers"] if a["correct"]))
        others = [len(a["answer"]) for a in spec["answers"] if not a["correct"]]
        assert min(others) <= right <= max(others), spec["id"]


def test_the_lesson_sends_the_learner_to_its_exercise_and_the_exercise_exists(nb):
    text = markdown(nb)
    assert "exercises/13_transformers.ipynb" in text
    assert (ROOT / "exercises" / f"{NAME}.ipynb").exists() and (ROOT / "solutions" / f"{NAME}.ipynb").exists()
    assert "in 4 MiB of activations" in text or "fit in 4 MiB of activations" in text


def test_the_hardware_table_names_its_sources(nb):
    text = markdown(nb)
    for source in ("\"NVIDIA Tesla P100\" whitepaper and P100 datasheet (2016)",
                   "\"NVIDIA Tesla V100 GPU Architecture\" whitepaper (2017)",
                   "\"NVIDIA DGX-1 With Tesla V100 System Architecture\" whitepaper (2017)",
                   "\"NVIDIA A100 Tensor Core GPU Architecture\" whitepaper (2020)",
                   "\"NVIDIA H100 Tensor Core GPU Architecture\" whitepaper (2022)"):
        assert source in text, source
    for fact in ("732 GB/s", "900 GB/s", "1,555 GB/s", "3.35 TB/s", "4 links, 160 GB/s", "6 links, 300 GB/s",
                 "12 links, 600 GB/s", "18 links, 900 GB/s", "16 GPUs, 12 NVSwitches", "hybrid cube-mesh"):
        assert fact in text, fact
    h100 = cell_with(nb, "H100 = {").source
    assert '"peak_bf16": 989e12' in h100 and '"bandwidth": 3.35e12' in h100
