"""Lesson 18 (elastic training) and its deck against their own outputs.

Every number the prose quotes about a cell is checked against what that cell printed in the
committed notebook (the output a learner sees before running anything); cells are found by a
phrase they contain. The naive sampler's counts are also recomputed here from
``data.DistributedSampler`` (an oracle independent of the lesson's code), and the resharding
picture from the arithmetic of the cut, so that a changed engine fails here, not silently in the
prose. The mpiexec cells are ``# NBVAL_IGNORE_OUTPUT`` and the prose quotes none of their output.
"""
import re

import numpy as np
import pytest
from lesson_outputs import cell_with, lesson, lesson_prose, number, printed

from minidist import data, launch, train
from minidist.course import quiz

NAME = "18_elastic"


@pytest.fixture(scope="module")
def nb():
    return lesson(NAME)


@pytest.fixture(scope="module")
def text(nb):
    return lesson_prose(nb)


def test_the_resharding_picture(nb, text):
    out = printed(cell_with(nb, "NUMEL, SAVED_BY, WANTED_BY = "))
    assert "saved by rank 2 of 3: offset 8, length 4: [8, 9, -1, -1]" in out
    assert "read by rank 0 of 2: [0, 1, 2, 3, 4]  (0..4 from piece 0; 4..5 from piece 1)" in out
    assert "read by rank 1 of 2: [5, 6, 7, 8, 9]  (5..8 from piece 1; 8..10 from piece 2)" in out
    assert "-1" not in out.split("read by", 1)[1]  # the padding is never read
    assert "rank 0 takes 0..4 from piece 0 and 4..5 from piece 1, rank 1 takes 5..8 from piece 1 and 8..10 " \
           "from piece 2" in text
    assert "The three saved pieces hold 4 numbers each" in text and "The two new ranks want 5 each" in text


def overlaps(numel: int, saved_by: int, wanted_by: int) -> str:
    """What each new rank copies, from the arithmetic of the two cuts (ceil(numel / N) per piece):
    the oracle for the lesson's picture, which asks resharding.assemble instead."""
    size, new_size = -(-numel // saved_by), -(-numel // wanted_by)
    ranks = []
    for q in range(wanted_by):
        lo, hi = q * new_size, min((q + 1) * new_size, numel)
        parts = [f"{max(lo, r * size)}..{min(hi, (r + 1) * size)} from piece {r}" for r in range(saved_by)
                 if max(lo, r * size) < min(hi, (r + 1) * size, numel)]
        ranks.append(f"rank {q} reads " + ", ".join(parts))
    return f"{numel} numbers, {saved_by} -> {wanted_by}: " + "; ".join(ranks)


def test_the_overlap_is_drawn_from_the_engine(nb, text):
    """Issue 35 item 7: chapter 18's first picture, the N -> M overlap of the saved pieces, drawn
    from what resharding.assemble copies; its printed reads agree with the arithmetic of the cuts
    (the lesson's 3 -> 2 and the run's 4 -> 2 and 2 -> 3 on 195 numbers)."""
    cell = cell_with(nb, "def draw_cut(")
    assert "resharding.assemble" in cell.source
    assert any("image/png" in o.get("data", {}) for o in cell.outputs)
    out = printed(cell)
    for numel, saved_by, wanted_by in ((10, 3, 2), (195, 4, 2), (195, 2, 3)):
        assert overlaps(numel, saved_by, wanted_by) + "\n" in out
    assert "rank 1 reads 65..98 from piece 0, 98..130 from piece 1" in out
    assert "from 2 to 3 rank 1's range straddles the old cut at 98, so it reads the end of piece 0 and the start " \
           "of piece 1" in text
    assert "the last position of the 4 -> 2 cut, 196 = 2 × 98" in text


def test_zero_moments_cut_again(nb, text):
    on_4 = printed(cell_with(nb, "steps_4, lines, _ = run(4"))
    lengths = [int(n) for n in re.findall(r"length (\d+), holds", on_4)]
    numel = number(r"numel (\d+)", on_4)
    assert lengths == [49] * 4 and numel == 195 == 8 * 16 + 16 + 16 * 3 + 3
    assert "The MLP has 195 parameters; on 4 ranks each holds the momentum of 49 of them (4 × 49 = 196, one " \
           "number of padding)" in text
    on_2 = printed(cell_with(nb, "steps_2, lines, _ = run(2"))
    assert [int(n) for n in re.findall(r"length (\d+), holds", on_2)] == [98, 98]
    assert "resume: world_size 4 in the checkpoint, 2 now" in on_2
    assert "(step 10, epoch 1, batch 10 of it, global sample 120 of the epoch)" in on_2
    assert '"world_size 4 in the checkpoint, 2 now"' in text and "step 10, global sample 120 of the epoch" in text
    assert "holds two pieces of 98 numbers" in text


def test_the_naive_position_repeats_and_skips(nb, text):
    out = printed(cell_with(nb, "def naive("))
    twice, never = number(r"read twice: (\d+)", out), number(r"never read: (\d+)", out)
    assert (twice, never, number(r"read (\d+) times", out)) == (60, 75, 225)
    # the oracle: DistributedSampler's shards, each rank skipping its own batch count
    read = []
    for ranks, start, stop in ((4, 0, 10), (2, 10, 25), (3, 25, None)):
        for rank in range(ranks):
            shard = list(data.DistributedSampler(240, ranks, rank, seed=0))
            read += shard[start * 3 : None if stop is None else stop * 3]
    counts = np.bincount(read, minlength=240)
    assert ((counts == 2).sum(), (counts == 0).sum()) == (twice, never)
    assert "60 samples are read twice and 75 never" in text
    assert "10 batches of 3 per rank skip 60 samples where 4 ranks had read 120" in text  # 2 x 10 x 3; 4 x 10 x 3
    assert "25 batches per rank skip 225 samples where only 150 were read, so 75 are lost" in text  # 120 + 2 x 15 x 3
    assert "(60 and 75 here)" in text


def test_the_times_read_picture(nb, text):
    """Issue 35 item 7: the second picture, samples read 0, 1 or 2 times after the resizes, naive
    against the global position. The naive phases' positions are recomputed from the round-robin
    deal (rank r's j-th index sits at position j N + r of the shuffled order, so batches start..stop
    of 3 on N ranks cover positions 3 N start .. 3 N stop)."""
    cell = cell_with(nb, "def draw_reads(")
    assert any("image/png" in o.get("data", {}) for o in cell.outputs)
    out = printed(cell)
    naive = [(4, 0, 10), (2, 10, 25), (3, 25, None)]  # None: to the end of the shard
    spans = "; ".join(f"{n} ranks {3 * n * start}..{240 if stop is None else 3 * n * stop}" for n, start, stop in naive)
    assert spans == "4 ranks 0..120; 2 ranks 60..150; 3 ranks 225..240"
    assert f"naive: each rank skips its own batch count: {spans}; read 0/1/2 times: 75/105/60" in out
    assert "global position: step s reads order[12 s : 12 (s + 1)]: 4 ranks 0..120; 2 ranks 120..180; " \
           "3 ranks 180..240; read 0/1/2 times: 0/240/0" in out
    assert "The 2 ranks start again at position 60 of the shuffled order" in text
    assert "the 3 ranks jump to position 225" in text and "(120 and 180)" in text


def test_lesson_18_cites_public_reports(text):
    """Issue 35 item 2: the reports the lesson cites are public ones (read with the search tools:
    allenai/OLMo#176 'Restore dataset correctly when world size changes', transformers#14554 and its
    fix #14994, transformers#22580), not this project's own issue."""
    assert "allenai/OLMo pull request #176 (\"Restore dataset correctly when world size changes\", 2023)" in text
    assert "huggingface/transformers issue #14554, 2021" in text and "pull request #14994" in text
    assert "(issue #22580, 2023)" in text
    assert "40245" not in text and "the issue behind this chapter" not in text


def test_exactly_once_and_one_process(nb, text):
    out = printed(cell_with(nb, "steps_3, lines, result = run(3"))
    assert "resume: world_size 2 in the checkpoint, 3 now" in out and "global sample 180 of the epoch" in out
    assert "20 steps; every sample read exactly once: True" in out
    assert "order[12 t : 12 (t + 1)] for every t: True" in out
    assert "the epoch's 20 global batches are exactly the permutation's 20 slices of 12" in text
    ref = printed(cell_with(nb, "single = train.train_single"))
    # rounding in the last bits: printed as a bound, since the figure (1e-16 or 2e-16) depends on the BLAS kernel
    assert "largest difference below 1e-12\n" in ref and "within 1e-10: True" in ref
    assert "The largest difference over all the weights is below 1e-12 (about 1e-16 on this machine" in text
    assert ref.count("\n") == 2  # the reference run's epoch line is not shown
    dense = printed(cell_with(nb, '"checkpoint", "consolidate", str(WORK'))
    assert "(step 20, --strategy ddp --zero on 3 ranks): 4 tensors, 195 numbers" in dense
    assert "the dense file equals the final model: True" in dense


def test_uneven_parts_weighted_by_rows(nb, text):
    """G = 12 on 5 ranks: the parts and weights against data.split_global_batch's arithmetic, and
    both differences the prose quotes against the cell (weighted: rounding; unweighted: far off)."""
    out = printed(cell_with(nb, "steps_5, lines, five = run(5"))
    sizes = np.diff(data.split_global_batch(12, 5)).tolist()
    assert sizes == [3, 3, 2, 2, 2] and f"rows per rank: {sizes}" in out
    assert "loss weights: [1.25, 1.25, 0.8333, 0.8333, 0.8333]" in out  # rows x 5 / 12
    assert "per-rank batch 3 or 2, global batch 12" in out and "20 steps; every sample read exactly once: True" in out
    assert "weighted by rows: largest difference from one process below 1e-12\n" in out  # rounding: a bound
    alike = number(r"every rank alike: largest difference from one process ([\d.e+-]+)", out)
    assert 1e-3 < alike
    assert "Weighted, the 5-rank run ends below 1e-12 from one process" in text
    assert f"Unweighted, it ends {alike:.1e} away after 20 steps" in text
    assert "the first 12 mod 5 = 2 ranks read 3 samples, the other three read 2" in text
    assert "3 × 5 / 12 = 1.25 for the larger parts, 2 × 5 / 12 ≈ 0.83" in text
    assert "counting 1/10 and one on a 3-row rank 1/15 where each should count 1/12" in text  # 1/(5*2), 1/(5*3)
    deck = quiz.read_deck(NAME)
    backs = " ".join(card["back"] for card in deck["flashcards"])
    assert f"ended {alike:.1e} from one process; with them, below 1e-12" in backs
    # section 4: the supervisor's next size and the parts it reads, from the engine
    assert launch.elastic_sizes(4, 2, 16)[1] == 3 and np.diff(data.split_global_batch(16, 3)).tolist() == [6, 5, 5]
    assert "The supervisor goes to 3 ranks, which read 6, 5 and 5 of the 16 samples a step" in text


def test_the_mpiexec_cells_are_ignored_and_unquoted(nb, text):
    for marker in ('"--min-ranks", "2"', '"--strategy", "single", *FLAGS'):
        assert cell_with(nb, marker).source.startswith("# NBVAL_IGNORE_OUTPUT")
    assert "320" not in text and "0.8578" not in text


def test_the_mpiexec_check_names_the_ranks_the_job_ended_on(nb):
    """The cell once said 'ended on 2' while the supervisor had gone to 3 ranks: the count now
    comes from the supervisor's own relaunch line, and the consolidated checkpoint agrees."""
    relaunch = re.findall(r"relaunching on (\d+) ranks", printed(cell_with(nb, '"--min-ranks", "2"')))
    out = printed(cell_with(nb, '"--strategy", "single", *FLAGS'))
    assert relaunch and f"killed on 4, ended on {relaunch[-1]}, against one process" in out
    assert f"--strategy ddp --zero on {relaunch[-1]} ranks" in out


def test_the_strategy_table(text):
    for name in ("OneDeviceStrategy", "MirroredStrategy", "MultiWorkerMirroredStrategy", "ParameterServerStrategy",
                 "CentralStorageStrategy", "TPUStrategy", "torchrun --max-restarts R", "torchrun --nnodes MIN:MAX"):
        assert f"| `{name}` |" in text, name
    assert "**no counterpart**" in text


def test_the_deck_is_shown_at_the_end(nb):
    codes = [cell.source for cell in nb.cells if cell.cell_type == "code"]
    assert f'quiz.show_flashcards("{NAME}")' in codes[-2] and f'quiz.show_quiz("{NAME}")' in codes[-1]
    deck = quiz.read_deck(NAME)
    assert f"({len(deck['flashcards'])} cards" in printed(nb.cells[-2])
    assert f"({len(deck['questions'])} questions)" in printed(nb.cells[-1])
    backs = " ".join(card["back"] for card in deck["flashcards"])
    assert "read 60 samples twice and 75 never" in backs  # the naive cell's counts
    feedback = " ".join(a["feedback"] for q in deck["questions"] for a in q["answers"])
    assert "The chapter measured a difference below 1e-12" in feedback


def test_the_deck_has_twelve_questions_numeric_ones_from_the_lesson():
    """Issue 35 item 4: at least 12 questions, several numeric, each right value recomputed here
    from the formula or the oracle it comes from; no right option told by its length."""
    deck = quiz.read_deck(NAME)
    assert len(deck["questions"]) >= 12 and sum(q["type"] == "numeric" for q in deck["questions"]) >= 4
    specs = {q["id"]: q for q in deck["questions"]}

    def right(spec_id):
        return next(a["value"] for a in specs[spec_id]["answers"] if a.get("correct"))

    assert right("padding-count") == 8 * -(-195 // 8) - 195 == 5
    assert right("copy-from-piece") == min(2 * 334, 750) - max(334, 500) == 168
    assert right("resume-position") == 15 * 12
    config = train.TrainConfig(strategy="ddp", global_batch_size=16)
    assert right("weight-sixteen") == train.loss_weight(config, 3, 0) == 1.125

    def naive_counts(plan):
        read, done = [], 0
        for ranks, until in plan:
            for rank in range(ranks):
                read += list(data.DistributedSampler(240, ranks, rank, seed=0))[done * 3 : None if until is None
                                                                                 else until * 3]
            done = until
        return np.bincount(read, minlength=240)

    assert right("naive-four-to-three") == (naive_counts([(4, 10), (3, None)]) == 2).sum() == 30
    assert right("naive-four-to-six") == (naive_counts([(4, 10), (6, None)]) == 0).sum() == 60
    for spec in deck["questions"]:
        if spec["type"] == "multiple_choice":
            mine = len(next(a["answer"] for a in spec["answers"] if a["correct"]))
            others = [len(a["answer"]) for a in spec["answers"] if not a["correct"]]
            assert min(others) <= mine <= max(others), spec["id"]


def test_the_other_splits_named_in_section_2_exist_and_resume_as_said(text):
    """The functions the prose names, and the strategies it says resume on another layout, are the
    engine's (3d with --zero the exception)."""
    from minidist import fault, train
    from minidist.parallel.pipeline.elastic import reshard_pipeline
    from minidist.parallel.tensor_parallel.train import reshard_tensor_parallel

    assert callable(reshard_tensor_parallel) and callable(reshard_pipeline)
    assert "`tensor_parallel.train.reshard_tensor_parallel`, `pipeline.elastic.reshard_pipeline`" in text
    fixed = dict(model="gpt", global_batch_size=8)
    assert all(fault.is_elastic(train.TrainConfig(strategy=name, **fixed)) for name in ("tp", "pipeline", "3d"))
    assert fault.is_elastic(train.TrainConfig(strategy="3d", **fixed))
    assert not fault.is_elastic(train.TrainConfig(strategy="3d", zero=True, **fixed))
    assert "A 3d run with `--zero` does not" in text
