"""Exercise 07: the checks in minidist.course.checks.pipeline pass the solution (on strict simulated
worlds of 1 to 4 ranks and under real mpiexec), catch the usual mistakes of a GPipe stage's
send/recv loop with the right hint (the gradient scale, a missing requires_grad, a wrongly
sized buffer, the pickling send, a 1F1B order, a receive from the wrong neighbour), and the
solution notebook holds the same function as the script."""
import inspect
import runpy
from pathlib import Path

import nbformat
import numpy as np
import pytest
from mpitools import requires_mpi

from minidist import sim
from minidist.course.checks import LearnerError
from minidist.course.checks import pipeline as pc
from minidist.course.exercises import solution_regions
from minidist.parallel.pipeline import schedules

ROOT = Path(__file__).resolve().parents[1]
S07 = runpy.run_path(str(ROOT / "solutions" / "07_model_parallelism.py"))
SOLUTION = S07["gpipe_stage_step"]


def variant(old, new):
    """The solution's gpipe_stage_step with ``old`` replaced by ``new`` in its source."""
    source = inspect.getsource(SOLUTION)
    assert old in source, old
    namespace = dict(S07)
    exec(compile(source.replace(old, new), "variant", "exec"), namespace)
    return namespace["gpipe_stage_step"]


# -- the solution passes ---------------------------------------------------------------------

def test_solution_passes_on_strict_worlds_of_1_to_4_ranks():
    verdicts = pc.on_sim(pc.check_gpipe_stage_step, SOLUTION).splitlines()
    assert len(verdicts) == 4
    assert verdicts[0].startswith("p=1: gpipe_stage_step on 1 rank, m = 1, 2, 3, 4: gradients equal one process")
    assert "the boundary once forward and once back (8 messages at m = 4)" in verdicts[1]
    assert "each of the 3 boundaries once forward and once back (24 messages at m = 4)" in verdicts[3]


def test_the_oracle_is_the_whole_batch_and_differs_from_a_wrong_model():
    """single_process: equal micro-batches average to the whole mini-batch's loss; another
    model gives other gradients."""
    X, y = pc.make_data(12)
    grads, losses = pc.single_process(3, X, y, 4)
    assert len(grads) == 3 and len(losses) == 4
    _, whole = pc.single_process(3, X, y, 1)
    assert np.mean(losses) == pytest.approx(whole[0], abs=1e-12)
    other, _ = pc.single_process(2, X, y, 1)
    assert other[0][0].shape != grads[0][0].shape or not np.allclose(other[0][0], grads[0][0])
    assert pc.widths(4)[0] == pc.IN_FEATURES and len(set(zip(pc.widths(4), pc.widths(4)[1:]))) == 4


def test_the_oracle_on_uneven_microbatches_weighs_each_row_by_its_microbatch():
    """10 rows in m = 4 micro-batches of 3, 3, 2, 2: the step's loss (1/m) sum_i CE_i gives row r
    of micro-batch i the weight 1/(m n_i). The oracle must equal that sum of per-row gradients,
    each row run alone (another route through the engine)."""
    from minidist.functions import cross_entropy
    from minidist.tensor import Tensor

    assert pc.BATCH == 10 and {pc.BATCH % m for m in pc.MICROBATCHES} - {0}, "a batch some m does not divide"
    X, y = pc.make_data()
    m = 4
    grads, losses = pc.single_process(3, X, y, m)
    sizes = [len(part) for part in np.array_split(np.arange(len(X)), m)]
    assert sizes == [3, 3, 2, 2]
    stages = pc.make_stages(3)
    whole = nn_sequential(stages)
    expected = [[np.zeros_like(q.data) for q in stage.parameters()] for stage in stages]
    row = 0
    for n in sizes:
        for _ in range(n):
            for stage in stages:
                for q in stage.parameters():
                    q.grad = None
            cross_entropy(whole(Tensor(X[row:row + 1])), y[row:row + 1]).backward()
            for e, stage in zip(expected, stages):
                for acc, q in zip(e, stage.parameters()):
                    acc += q.grad / (m * n)
            row += 1
    for got, want in zip(grads, expected):
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-13)
    whole_batch = pc.single_process(3, X, y, 1)[0]
    assert not np.allclose(grads[0][0], whole_batch[0][0], rtol=0, atol=1e-9), "uneven: not the plain mean"
    assert losses == pytest.approx([cross_entropy(whole(Tensor(xi)), yi).item()
                                    for xi, yi in zip(np.array_split(X, m), np.array_split(y, m))], abs=1e-12)


def nn_sequential(stages):
    from minidist import nn

    return nn.Sequential(*[layer for stage in stages for layer in stage])


def test_notebook_and_script_hold_the_same_function():
    """A learner copies the function from the notebook into the script: the same code."""
    nb = nbformat.read(ROOT / "solutions" / "07_model_parallelism.ipynb", as_version=4)
    notebook = [r for cell in nb.cells if cell.cell_type == "code" for r in solution_regions(cell.source)]
    script = solution_regions((ROOT / "solutions" / "07_model_parallelism.py").read_text())
    assert notebook == script and len(script) == 1


def test_a_stub_raises_not_implemented_error():
    def stub(comm, stage, x, y, m, batch_size):
        raise NotImplementedError()

    with pytest.raises(NotImplementedError):
        pc.on_sim(pc.check_gpipe_stage_step, stub, (2,))


# -- the usual mistakes fail, with their hint ---------------------------------------------

def one_f_one_b_order(comm, stage, x, y, m, batch_size):
    """Right gradients in 1F1B's order (warm-up forwards, then one backward per forward):
    not the GPipe loop the exercise asks for."""
    from minidist.functions import cross_entropy
    from minidist.tensor import Tensor

    rank, p = comm.Get_rank(), comm.Get_size()
    rows = S07["microbatch_rows"](batch_size, m)
    xs = np.array_split(x, m) if rank == 0 else None
    ys = np.array_split(y, m) if rank == p - 1 else None
    saved, losses = {}, []
    for action in schedules.one_f_one_b(p, m)[rank]:
        i = action.microbatch
        if action.kind == "F":
            if rank == 0:
                inp = Tensor(xs[i])
            else:
                buf = np.empty((rows[i], stage[0].in_features))
                comm.Recv(buf, source=rank - 1)
                inp = Tensor(buf, requires_grad=True)
            out = stage(inp)
            if rank == p - 1:
                out = cross_entropy(out, ys[i])
                losses.append(out.item())
            else:
                comm.Send(out.data, dest=rank + 1)
            saved[i] = inp, out
        else:
            inp, out = saved.pop(i)
            if rank == p - 1:
                grad = np.asarray(1.0 / m)
            else:
                grad = np.empty_like(out.data)
                comm.Recv(grad, source=rank + 1)
            out.backward(grad)
            if rank > 0:
                comm.Send(inp.grad, dest=rank - 1)
    return losses if rank == p - 1 else None


def one_microbatch_at_a_time(comm, stage, x, y, m, batch_size):
    """Right gradients, but each micro-batch goes forward and back before the next starts:
    no two stages ever work at once (the naive split, m times over)."""
    losses, start = [], 0
    for rows in S07["microbatch_rows"](batch_size, m):
        part = SOLUTION(comm, stage, None if x is None else x[start:start + rows],
                        None if y is None else y[start:start + rows], 1, rows)
        losses.extend(part or [])
        start += rows
    for q in stage.parameters():  # each micro-batch's gradient counts 1/m
        q.grad /= m
    return losses if y is not None else None


WRONG = [
    (variant("np.asarray(1.0 / m)", "np.asarray(1.0)"), AssertionError, "m = 2 times too large"),
    (variant("inp = Tensor(buf, requires_grad=True)", "inp = Tensor(buf)"), LearnerError, "requires_grad=True"),
    (variant("stage[0].in_features)", "stage[0].out_features)"), LearnerError, "size every receive buffer"),
    (variant("comm.Send(out.data, dest=rank + 1)", "comm.send(out.data, dest=rank + 1)"), LearnerError,
     "uppercase comm.Send"),
    (variant("comm.Recv(grad, source=rank + 1)", "comm.Recv(grad, source=rank - 1)"), AssertionError,
     "in the backward pass it receives from rank r + 1"),
    (variant("losses.append(out.item())", "losses.append(out.item() / m)"), AssertionError,
     "append each micro-batch's unscaled loss"),
    (variant("outputs[i].backward(grad)", "outputs[i].backward(grad / m)"), AssertionError,
     "pair each received gradient"),
    (one_f_one_b_order, AssertionError, "two neighbours both Send to each other at once"),
    (one_microbatch_at_a_time, AssertionError, "GPipe runs the forward of every micro-batch first"),
]


@pytest.mark.parametrize("wrong, error, hint", WRONG, ids=[w[2][:28] for w in WRONG])
def test_a_wrong_stage_loop_fails_with_its_hint(wrong, error, hint):
    with pytest.raises(error) as failure:
        pc.on_sim(pc.check_gpipe_stage_step, wrong, (3,))
    assert hint in str(failure.value)


def test_a_step_that_updates_the_parameters_fails():
    def with_update(comm, stage, x, y, m, batch_size):
        losses = SOLUTION(comm, stage, x, y, m, batch_size)
        for q in stage.parameters():
            q.data -= 0.1 * q.grad
        return losses

    with pytest.raises(AssertionError, match="parameter values changed"):
        pc.on_sim(pc.check_gpipe_stage_step, with_update, (2,))


def test_the_check_refuses_a_microbatch_count_the_batch_cannot_hold():
    with pytest.raises(ValueError, match="use 1 <= m <= 10"):
        sim.run(lambda comm: pc.check_gpipe_stage_step(comm, SOLUTION, microbatches=(11,)), 1)


def test_a_receive_buffer_sized_batch_size_over_m_fails():
    """batch_size // m rows is right only when m divides the batch: the old check (12 rows,
    m = 1..4) passed this loop; with 10 rows, m = 3 and 4 make micro-batches of unequal size."""
    wrong = variant("buf = np.empty((rows[i], stage[0].in_features)", "buf = np.empty((batch_size // m, "
                    "stage[0].in_features)")
    assert "m = 1, 2" in pc.on_sim(pc.check_gpipe_stage_step, wrong, (2,), microbatches=(1, 2))
    with pytest.raises(LearnerError, match="size every receive buffer from what travels") as failure:
        pc.on_sim(pc.check_gpipe_stage_step, wrong, (2,))
    assert "m = 3, a mini-batch of 10" in str(failure.value)


def test_the_engines_pipeline_is_not_an_answer():
    from minidist.parallel.pipeline import schedules as engine_schedules

    with pytest.raises(AssertionError, match="the engine's own implementation, not yours"):
        pc.on_sim(pc.check_gpipe_stage_step, engine_schedules.gpipe, (1,))


# -- under real mpiexec -------------------------------------------------------------------------

@pytest.mark.mpi
@requires_mpi
def test_exercise_07_script_passes_under_mpiexec_and_a_wrong_one_fails_once(tmp_path):
    from minidist.launch import launch

    result = launch(str(ROOT / "solutions" / "07_model_parallelism.py"), 3, timeout=120)
    assert result.ok, result.stderr
    assert "07_model_parallelism: all checks pass on 3 ranks" in result.stdout
    script = tmp_path / "unscaled.py"
    script.write_text((ROOT / "solutions" / "07_model_parallelism.py").read_text()
                      .replace("np.asarray(1.0 / m)", "np.asarray(1.0)"))
    wrong = launch(str(script), 3, timeout=120)
    assert wrong.returncode != 0
    assert wrong.stderr.count("AssertionError") == 1 and "times too large" in wrong.stderr
