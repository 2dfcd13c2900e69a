"""Lessons and quiz decks of chapters 00-06 against their own outputs and their sources.

Every number a lesson's prose quotes about a cell is checked against what that cell printed in
the committed notebook (the output a learner sees before running anything). Cells are found by
a phrase they contain, not by their index, so inserting a cell does not break the tests.
"""
import difflib
import inspect
import re

from lesson_outputs import cell_with, lesson, printed, prose

from minidist import parallel
from minidist.course import quiz


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


# ----------------------------------------------------------------------------- chapter 02

def test_lesson_02_tells_input_pipelines_from_pipeline_parallelism():
    text = prose(cell_with(lesson("02_sgd_and_input_pipelines"), "### Keep the accelerators fed", "markdown").source)
    assert "overlaps loading with compute" in text
    assert "data-parallel inference** (chapter 05) *shards the test set*" in text
    assert "**pipeline parallelism** (chapters 07 and 08)" in text
    assert "Neither of the first two is pipeline parallelism" in text


def test_deck_02_asks_which_pipeline_splits_the_model():
    spec = next(q for q in quiz.load_deck("02_sgd_and_input_pipelines") if q["id"] == "pipeline-meanings")
    right = [a["answer"] for a in spec["answers"] if a["correct"]]
    assert right == ["pipeline parallelism: layers in stages, micro-batches flow through"]
    assert {"input pipeline", "inference pipeline", "data-parallel inference"} <= {
        a["answer"].split(":")[0].removeprefix("an ") for a in spec["answers"]}


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



def test_lesson_04_reads_the_what_if_table_it_prints():
    # Each refit of the cost model changes the table's times: the prose once said "a quarter of an
    # hour", then "about half an hour" and "under half a second" after the table had moved on.
    # It now quotes the printed cells themselves, and the words around them must fit the numbers.
    nb = lesson("04_ring_allreduce")
    out = printed(cell_with(nb, "costmodel.what_if(world_sizes=", "code"))
    units = {"us": 1e-6, "ms": 1e-3, "s": 1.0}

    def cell(world_size, algorithm):
        row = re.search(rf"^\s*{world_size}\s+1 GiB\s+(.*)$", out, re.MULTILINE).group(1).split()
        column = ["ring", "recursive_doubling", "tree", "naive"].index(algorithm)
        value, unit = row[2 * column], row[2 * column + 1]
        return f"{value} {unit}", float(value) * units[unit]

    (naive_text, naive), (ring_text, ring), (ring_8_text, ring_8) = (
        cell(4096, "naive"), cell(4096, "ring"), cell(8, "ring"))
    text = prose(cell_with(nb, "At 4096 ranks the naive all-reduce", "markdown").source)
    assert naive_text in text and ring_text in text and ring_8_text in text, (naive_text, ring_text, ring_8_text)
    if "more than an hour" in text:
        assert naive > 3600, naive
    else:
        assert "about half an hour" in text and 25 * 60 <= naive <= 35 * 60, naive
    assert "only about a quarter longer than at 8 ranks" in text and 1.2 <= ring / ring_8 <= 1.3

# ----------------------------------------------------------------------------- chapter 05

BARE_GATHER = re.compile(r"(?<!all-)(?<!all_)\bgather", re.IGNORECASE)


def test_lesson_05_names_the_inference_collective_as_the_code_runs_it():
    # parallel.evaluate combines the counts with one all-gather (every rank gets the accuracy);
    # the lesson, its summary and the deck once said "gather" in some places, "all-gather" in others.
    assert "all_gather(comm, local)" in inspect.getsource(parallel.evaluate)
    nb = lesson("05_data_parallel")
    texts = [cell_with(nb, "## 8. Data-parallel inference and serving", "markdown").source,
             cell_with(nb, "Whatever P, the only data that moves", "markdown").source,
             next(line for line in cell_with(nb, "| data-parallel serving |", "markdown").source.splitlines()
                  if line.startswith("| data-parallel serving |"))]
    deck = quiz.read_deck("05_data_parallel")
    texts += [card["back"] for card in deck["flashcards"] if "inference" in card["front"].lower()]
    texts += [a["answer"] + " " + a.get("feedback", "") for q in deck["questions"] if q["id"] == "parallel-inference"
              for a in q["answers"]]
    assert not [t for t in texts if BARE_GATHER.search(t)], [t for t in texts if BARE_GATHER.search(t)]
    assert sum("all-gather" in t for t in texts) >= 4


def test_lesson_05_counts_the_inference_messages_it_prints():
    # "p(p − 1) messages of 24 bytes in a ring": the table's message and byte columns.
    nb = lesson("05_data_parallel")
    text = prose(cell_with(nb, "Whatever P, the only data that moves", "markdown").source)
    assert "p(p − 1) messages of 24 bytes" in text
    rows = re.findall(r"^\s*(\d+) \|[^|]+\|\s*([\d.]+) \| True\s*\|\s*(\d+) \|\s*(\d+)$",
                      printed(cell_with(nb, "served = nn.mlp", "code")), re.MULTILINE)
    assert [int(p) for p, *_ in rows] == [1, 2, 3, 4]
    for p, _, messages, nbytes in rows:
        p = int(p)
        assert (int(messages), int(nbytes)) == (p * (p - 1), 24 * p * (p - 1))


def test_lesson_05_tells_data_parallel_inference_from_pipelines():
    text = prose(cell_with(lesson("05_data_parallel"), "Whatever P, the only data that moves", "markdown").source)
    assert "not pipeline parallelism" in text and "input pipeline" in text


def test_tf_strategies_question_lists_the_six_strategies_of_the_lecture_tpu_included():
    spec = next(q for q in quiz.load_deck("05_data_parallel") if q["id"] == "tf-strategies")
    right = {a["answer"] for a in spec["answers"] if a["correct"]}
    assert right == {"mirrored", "multi-worker mirrored", "central storage", "parameter server", "one device", "TPU"}
    assert any(not a["correct"] for a in spec["answers"])


def test_every_choice_question_of_deck_05_has_four_options():
    # 6 of them had three; each got a fourth option, plausible but wrong on reflection.
    few = [q["id"] for q in choice_questions("05_data_parallel") if len(q["answers"]) < 4]
    assert not few, few


# ----------------------------------------------------------------------------- chapter 06

def test_lesson_06_says_the_engines_ddp_overlaps_as_chapter_05_shows():
    # It once said "the engine's buckets block"; DDP overlaps by default (chapter 05, section 6).
    assert inspect.signature(parallel.DistributedDataParallel).parameters["overlap"].default is True
    nb = lesson("06_parameter_servers")
    text = prose(cell_with(nb, "What tipped GPU training towards all-reduce", "markdown").source)
    assert "block" not in text
    assert "The engine's DDP does the same by default (`overlap=True`): chapter 05, section 6" in text
    cell_with(lesson("05_data_parallel"), "## 6. Overlap: communicating while backward runs", "markdown")


def stale_table() -> dict:
    """(lr, d) -> (updates to reach 0.90 or 'never', best, final), as lesson 06's stale-gradient cell printed it."""
    out = printed(cell_with(lesson("06_parameter_servers"), "def delayed_sgd(", "code"))
    rows = re.findall(r"^(0\.\d\d) \| (\d) \|\s+(\d+|never) \|\s+([\d.]+) \|\s+([\d.]+)$", out, re.MULTILINE)
    assert len(rows) == 6, out
    return {(lr, int(d)): (first, best, final) for lr, d, first, best, final in rows}


def test_lesson_06_quotes_the_costs_of_staleness_its_cell_prints():
    table = stale_table()
    nb = lesson("06_parameter_servers")
    text = prose(cell_with(nb, "Staleness shows both costs", "markdown").source)
    fresh, one, three = (table["0.02", d] for d in (0, 1, 3))
    ratio = int(three[0]) / int(fresh[0])
    assert (f"at lr 0.02, fresh gradients reach 0.90 test accuracy after {fresh[0]} updates; gradients one "
            f"update old need {one[0]}, and three updates old {three[0]}, {ratio:.1f} times as many") in text
    assert (f"the stale runs end at {one[2]} and {three[2]} against {fresh[2]} for fresh gradients "
            f"(their best along the way: {one[1]} and {three[1]} against {fresh[1]})") in text
    lost = [float(fresh[i]) - float(run[i]) for run in (one, three) for i in (1, 2)]
    assert "one to two points lost" in text and all(0.01 <= x <= 0.02 for x in lost), lost
    fresh, one, three = (table["0.05", d] for d in (0, 1, 3))
    assert int(one[0]) == 2 * int(fresh[0]) and three[0] == "never"
    assert (f"At lr 0.05 the fresh run reaches 0.90 after {fresh[0]} updates, one update of delay doubles "
            f"that to {one[0]}, and with three the run never gets there and ends at {three[2]}") in text
    summary = cell_with(nb, "| when a gradient is applied |", "markdown").source
    row = f"| fewest (fresh gradients: {table['0.02', 0][0]}) | most (3 updates old: {table['0.02', 3][0]}) " \
          f"| between (1 update old: {table['0.02', 1][0]}) |"
    assert row in summary


def test_every_choice_question_of_deck_06_has_four_options():
    # 8 of them had three (ring-vs-server is a checkbox question); each got a fourth option.
    few = [q["id"] for q in choice_questions("06_parameter_servers") if len(q["answers"]) < 4]
    assert not few, few
