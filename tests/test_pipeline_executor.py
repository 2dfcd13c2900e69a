"""The pipeline executor against one process: after one step, every stage's parameters hold
the gradient of the mean micro-batch loss, equal (float64, <= 1e-12) to the same model run
micro-batch by micro-batch in a single process; each micro-batch crosses each boundary
once forward and once back; activation memory per stage is as the schedule says."""
from pathlib import Path

import numpy as np
import pytest
from mpitools import mpiexec_or_skip

from minidist import nn, sim
from minidist.functions import cross_entropy
from minidist.parallel.pipeline import executor as E

SIZES = [6, 9, 8, 7, 9, 8, 7, 8, 5]  # 8 Linear layers: up to 8 stages
TOL = 1e-12


def make_model():
    layers = []
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        layers.append(nn.Linear(a, b, rng=100 + i, dtype="float64"))
        if i < len(SIZES) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def stage_slices(num_stages):
    """Contiguous Linear(+Tanh) blocks, the first stages taking the remainder."""
    blocks = [[2 * i, 2 * i + 1] if 2 * i + 1 < 2 * (len(SIZES) - 1) - 1 else [2 * i] for i in range(len(SIZES) - 1)]
    n, k = len(blocks), num_stages
    counts = [n // k + (1 if s < n % k else 0) for s in range(k)]
    out, start = [], 0
    for c in counts:
        idx = [j for b in blocks[start:start + c] for j in b]
        out.append(slice(idx[0], idx[-1] + 1))
        start += c
    return out


def data(batch=12, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(batch, SIZES[0])), rng.integers(0, SIZES[-1], size=batch)


def single_process_grads(x, y, m):
    model = make_model()
    parts = np.array_split(np.arange(len(x)), m)
    for idx in parts:
        (cross_entropy(model(x[idx]), y[idx]) * (1.0 / m)).backward()
    return [p.grad for p in model.parameters()], model


SCHEDULES = {"gpipe": E.ScheduleGPipe, "1f1b": E.Schedule1F1B, "zero-bubble": E.ScheduleZeroBubble}


def run_pipeline(comm, schedule, m, x, y, v=1):
    p, rank = comm.Get_size(), comm.Get_rank()
    model = make_model()  # every rank builds the same model and keeps its own stages
    num_stages = p * v
    slices = stage_slices(num_stages)
    mine = [s for s in range(num_stages) if s % p == rank]
    stages = [E.PipelineStage(model[slices[s]], s, num_stages, comm, timeout=30) for s in mine]
    if v == 1:
        sched = SCHEDULES[schedule](stages[0], m, cross_entropy)
    else:
        sched = E.ScheduleInterleaved1F1B(stages, m, cross_entropy)
    kwargs = {}
    args = (x,) if 0 in mine else ()
    losses = []
    if num_stages - 1 in mine:
        kwargs = {"target": y, "losses": losses}
    sched.step(*args, **kwargs)
    grads = {}
    for s, stage in zip(mine, stages):
        grads[s] = [p_.grad for p_ in stage.submodule.parameters()]
    return grads, losses, {s: (st.messages_sent, st.peak_activation_bytes) for s, st in zip(mine, stages)}, \
        [e.action for e in sched.timeline]


def check_against_single(results, x, y, m, num_stages):
    expected, model = single_process_grads(x, y, m)
    slices = stage_slices(num_stages)
    got = {}
    for grads, _, _, _ in results:
        got.update(grads)
    flat = []
    for s in range(num_stages):
        flat.extend(got[s])
    assert len(flat) == len(expected)
    for g, e in zip(flat, expected):
        assert g is not None
        assert np.max(np.abs(g - e)) <= TOL
    return slices


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_every_schedule_equals_one_process(schedule, p):
    m = 4
    x, y = data()
    results = sim.run(run_pipeline, p, schedule, m, x, y)
    check_against_single(results, x, y, m, p)
    losses = [r[1] for r in results if r[1]][0]
    assert len(losses) == m


@pytest.mark.parametrize("p", [1, 2, 4])
def test_interleaved_equals_one_process(p):
    m = 4 if p < 4 else 8
    x, y = data(batch=16)
    results = sim.run(run_pipeline, p, "1f1b", m, x, y, 2)
    check_against_single(results, x, y, m, 2 * p)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_each_microbatch_crosses_each_boundary_once_each_way(schedule):
    p, m = 4, 4
    x, y = data()
    world = sim.World(p)
    results = world.run(run_pipeline, schedule, m, x, y)
    for _, _, stats, _ in results:
        for s, (sent, _) in stats.items():
            forward = m + 1 if s < p - 1 else 0  # one shape header, then m activations
            backward = m if s > 0 else 0
            assert sent == forward + backward


def test_gpipe_holds_every_microbatch_and_1f1b_at_most_p_minus_s():
    p, m = 4, 8
    x, y = data(batch=16)
    per_stage = {}
    for schedule in ("gpipe", "1f1b"):
        results = sim.run(run_pipeline, p, schedule, m, x, y)
        per_stage[schedule] = {s: peak for r in results for s, (_, peak) in r[2].items()}
    for s in range(p - 1):  # the last stage keeps only its loss graph, compare the others
        ratio = per_stage["gpipe"][s] / per_stage["1f1b"][s]
        assert ratio == pytest.approx(m / min(m, p - s), rel=0.01)


def test_bad_placement_and_missing_inputs_are_clear_errors():
    def wrong_rank(comm):
        with pytest.raises(E.PipelineError, match="lives on rank"):
            E.PipelineStage(make_model(), (comm.Get_rank() + 1) % 2, 2, comm)
        return True

    assert sim.run(wrong_rank, 2) == [True, True]

    def no_x(comm):
        model = make_model()
        stage = E.PipelineStage(model[stage_slices(2)[comm.Get_rank()]], comm.Get_rank(), 2, comm)
        sched = E.ScheduleGPipe(stage, 2, cross_entropy)
        with pytest.raises(E.PipelineError, match="must pass the mini-batch"):
            sched.step(target=np.zeros(4, dtype=np.int64)) if comm.Get_rank() == 1 else sched.step()
        return True

    assert sim.run(no_x, 2) == [True, True]


@pytest.mark.mpi
@pytest.mark.parametrize("p", [2, 4])
def test_every_schedule_equals_one_process_under_mpiexec(p):
    from minidist import launch

    mpiexec_or_skip()
    script = Path(__file__).parent / "mpi" / "pipeline_cases.py"
    result = launch.launch(script, p, timeout=120)
    assert result.ok and f"ALL OK ranks={p}" in result.stdout, result.stdout + result.stderr[-3000:]


def test_plot_schedule_draws_one_box_per_action_from_sim_and_from_a_real_run():
    import matplotlib

    matplotlib.use("Agg")
    from minidist.parallel.pipeline import schedules as S
    from minidist.parallel.pipeline.plot import plot_schedule

    schedule = S.one_f_one_b(2, 3)
    result = S.simulate(schedule)
    ax = plot_schedule([result.timeline(actions) for actions in schedule])
    assert len(ax.patches) == sum(len(a) for a in schedule) == 12
    x, y = data()
    runs = sim.run(run_pipeline, 2, "1f1b", 3, x, y)
    assert [r[3] for r in runs] == [[str(a) for a in actions] for actions in schedule]  # the run followed it


@pytest.mark.parametrize("schedule,make", [("gpipe", "gpipe"), ("1f1b", "one_f_one_b"), ("zero-bubble", "zero_bubble")])
def test_micro_batches_held_per_stage_equal_the_simulators_peak_in_flight(schedule, make):
    # Zero-bubble holds a micro-batch until its W (its inputs and output gradients), as the simulator counts.
    from minidist.parallel.pipeline import schedules as S

    p, m = 4, 8
    x, y = data(batch=16)

    def held(comm):
        model = make_model()
        s = comm.Get_rank()
        stage = E.PipelineStage(model[stage_slices(p)[s]], s, p, comm, timeout=30)
        sched = SCHEDULES[schedule](stage, m, cross_entropy)
        sched.step(*((x,) if s == 0 else ()), **({"target": y} if s == p - 1 else {}))
        return stage.peak_in_flight

    expected = S.simulate(getattr(S, make)(p, m)).peak_in_flight
    assert sim.run(held, p) == list(expected)


def test_the_executors_waits_join_the_sims_deadlock_detection():
    # Both stages wait for a message from the other: a DeadlockError naming the cycle within
    # seconds, not a wait for the 300 s deadline (the executor waits through collectives.wait_all).
    import time

    def job(comm):
        s = comm.Get_rank()
        stage = E.PipelineStage(make_model()[stage_slices(2)[s]], s, 2, comm)  # default timeout: 300 s
        stage._recv((4, 3), np.float64, np.empty(0), 1 - s, 99, "a message nobody sends")

    start = time.perf_counter()
    with pytest.raises(sim.DeadlockError, match="rank 0 -> rank 1 -> rank 0|rank 1 -> rank 0 -> rank 1"):
        sim.run(job, 2)
    assert time.perf_counter() - start < 20


def test_ranks_that_disagree_on_the_number_of_microbatches_get_a_clear_error():
    x, y = data()

    def job(comm):
        s = comm.Get_rank()
        stage = E.PipelineStage(make_model()[stage_slices(2)[s]], s, 2, comm)
        sched = E.ScheduleGPipe(stage, 2 if s == 0 else 4, cross_entropy)
        sched.step(x) if s == 0 else sched.step(target=y)

    with pytest.raises(E.PipelineError, match="micro-batches"):
        sim.run(job, 2)
