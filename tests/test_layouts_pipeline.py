"""Layouts that validate must run (issue 18, 4.4): a pipeline the command line accepts either
trains or is refused up front, never a traceback on every rank.

Two layouts used to crash: ``--schedule interleaved`` with a number of micro-batches its rounds
do not divide (2 ranks, ``--microbatches 5``: torch refuses it; here the rounds differ by one
micro-batch), and ``--hidden 1000 1 1`` on 4 ranks (the cut with the smallest largest stage left
a stage of one ReLU, without parameters). Oracles: the schedule validator (no deadlock), a
one-process step on the whole batch (float64, <= 1e-12), and training that reaches above chance.
"""
import numpy as np
import pytest
from mpitools import mpirun_minidist
from test_pipeline_train import dp_pp_step, global_batch, make_model, one_process_step

from minidist import nn, optim, sim, train
from minidist.data import load_digits
from minidist.functions import cross_entropy
from minidist.parallel.pipeline import schedules as S
from minidist.parallel.pipeline.stage import split_model
from minidist.parallel.pipeline.train import check_pipeline, split_stages, train_pipeline
from minidist.parallel.pipeline.train_pipedream import train_pipedream

DIGITS = load_digits(seed=0)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble")


def test_interleaved_runs_every_micro_batch_count_without_deadlock():
    """Every p <= 6, m <= 30, v <= 3, including the m torch refuses (m % max(1, m // p) != 0):
    each stage on its rank, every action once, no deadlock; rounds of at least p micro-batches
    when m >= p."""
    refused_by_torch = 0
    for p in range(1, 7):
        for v in range(1, 4):
            for m in range(1, 31):
                schedule = S.interleaved_1f1b(p, m, v)
                S.validate(schedule)
                assert [sorted({a.stage for a in row}) for row in schedule] == [list(range(r, p * v, p))
                                                                                for r in range(p)]
                refused_by_torch += m % max(1, m // p) != 0
    assert refused_by_torch > 100  # the grid does cover them


@pytest.mark.parametrize("p,m,v", [(2, 5, 2), (4, 9, 3), (4, 6, 2), (3, 7, 2)])
def test_interleaved_with_uneven_rounds_still_beats_one_stage_per_rank(p, m, v):
    """Interleaving (v stages per rank, each 1/v of the rank's work) must not be slower than 1F1B
    on the same pipeline, uneven rounds included (simulated, uniform stages)."""
    interleaved = S.simulate(S.interleaved_1f1b(p, m, v), 1 / v, 2 / v)
    plain = S.simulate(S.one_f_one_b(p, m), 1, 2)
    assert interleaved.makespan <= plain.makespan + 1e-12
    assert plain.makespan == pytest.approx((m + p - 1) * 3)  # the 1F1B closed form, the oracle's oracle


def one_process_microbatch_step(x, y, dp, m, lr=0.1, momentum=0.9):
    """The oracle: one process, the loss every pipeline minimises, the mean over its m
    micro-batches (numpy.array_split sizes) of each micro-batch's mean loss (torch's
    pipelining does the same: unequal micro-batches weigh equally), averaged over the dp
    contiguous shards; one SGD step."""
    model = make_model()
    opt = optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    losses = [cross_entropy(model(xk), yk) for xs, ys in zip(np.array_split(x, dp), np.array_split(y, dp))
              for xk, yk in zip(np.array_split(xs, m), np.array_split(ys, m))]
    loss = losses[0]
    for more in losses[1:]:
        loss = loss + more
    loss = loss * (1.0 / len(losses))
    loss.backward()
    opt.step()
    return [p.data for p in model.parameters()], loss.item()


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("world,dp,m", [(2, 1, 5), (2, 1, 7), (4, 2, 3)])
def test_every_schedule_with_uneven_micro_batches_equals_one_process(schedule, world, dp, m):
    """16 rows, m micro-batches of unequal size (array_split: 4, 3, 3, 3, 3 for m = 5), on the
    simulator: every stage's parameters after the step equal one process's on the same
    micro-batches."""
    x, y = global_batch()
    results = sim.run(dp_pp_step, world, dp, schedule, m, x, y)
    expected, expected_loss = one_process_microbatch_step(x, y, dp, m)
    uniform, _ = one_process_step(x, y)  # the whole-batch mean differs when micro-batches differ in size
    assert any(np.max(np.abs(a - b)) > 1e-9 for a, b in zip(expected, uniform))
    got = {}
    for rank in range(world // dp):  # pipeline 0 (the others hold the same parameters)
        got.update(results[rank][0])
    flat = [a for s in sorted(got) for a in got[s]]
    assert len(flat) == len(expected)
    for a, e in zip(flat, expected):
        assert np.max(np.abs(a - e)) <= 1e-12
    assert all(abs(loss - expected_loss) <= 1e-12 for _, loss in results)


def test_split_stages_gives_every_stage_a_layer_with_parameters():
    model = nn.mlp([64, 1000, 1, 1, 10], rng=0)  # --hidden 1000 1 1: 4 Linear layers
    assert not all(list(s.parameters()) for s in split_model(model, 4, balance="parameters"))  # the old cut
    stages = split_stages(model, 4)
    assert [sum(isinstance(layer, nn.Linear) for layer in s) for s in stages] == [1, 1, 1, 1]
    assert [layer for s in stages for layer in s] == list(model)  # every layer once, in order
    default = nn.mlp([64, *train.PIPELINE_HIDDEN, 10], rng=0)  # where the min-max cut is fine, it is kept
    assert [len(s) for s in split_stages(default, 4)] == [len(s) for s in split_model(default, 4, "parameters")]


def config_for(**fields):
    base = dict(strategy="pipeline", epochs=1, batch_size=32, progress=False, timeout=60)
    return train.TrainConfig(**{**base, **fields})


@pytest.mark.parametrize("world,fields", [
    (2, {"schedule": "interleaved", "microbatches": 5, "hidden": (32, 32, 32)}),
    (2, {"schedule": "interleaved", "microbatches": 7, "stages_per_rank": 3, "hidden": (32,) * 5}),
    (4, {"schedule": "1f1b", "hidden": (1000, 1, 1)}),
    (4, {"schedule": "zero-bubble", "microbatches": 3, "hidden": (1000, 1, 1)}),
    (2, {"schedule": "gpipe", "microbatches": 5, "hidden": (1,)}),
])
def test_layouts_that_validate_train_on_the_sim(world, fields):
    config = config_for(**fields)
    check_pipeline(world, config)  # the command line accepts it ...
    results = sim.run(train_pipeline, world, config, DIGITS)  # ... so it must run
    result = results[0]
    assert result.figures["stages"] == world * config.stages_per_rank if config.schedule == "interleaved" \
        else result.figures["stages"] == world
    assert np.isfinite(result.history[-1]["loss"]) and result.test_accuracy > 0.1 - 1e-9


@pytest.mark.parametrize("schedule", ["pipedream", "pipedream-2bw"])
def test_pipedream_with_a_tiny_layer_beside_a_huge_one_trains(schedule):
    config = config_for(schedule=schedule, hidden=(1000, 1, 1), lr=train.PIPELINE_LR, momentum=0.5,
                        microbatches=4)
    results = sim.run(train_pipedream, 4, config, DIGITS)
    assert np.isfinite(results[0].history[-1]["loss"])


@pytest.mark.mpi
def test_the_two_layouts_that_crashed_under_mpiexec_now_train():
    interleaved = mpirun_minidist(2, "train", "--strategy", "pipeline", "--schedule", "interleaved", "--microbatches",
                                  "5", "--epochs", "1", "--no-progress", timeout=300)
    assert interleaved.returncode == 0, interleaved.stderr[-3000:]
    assert "Traceback" not in interleaved.stderr and "final test_accuracy=" in interleaved.stdout
    tiny = mpirun_minidist(4, "train", "--strategy", "pipeline", "--hidden", "1000", "1", "1", "--epochs", "1",
                           "--no-progress", timeout=300)
    assert tiny.returncode == 0, tiny.stderr[-3000:]
    assert "Linear layers per stage: 1,1,1,1" in tiny.stdout and "final test_accuracy=" in tiny.stdout
