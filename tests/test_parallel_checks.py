"""Exercises 05 and 06: the checks in minidist.course.checks.parallel pass the solutions (on the sim
and, for 05, under real mpiexec), catch the usual mistakes with the right hint, and turn a
deadlock into an AssertionError; each solution notebook holds the same functions as its script."""
import runpy
from pathlib import Path

import nbformat
import numpy as np
import pytest
from mpitools import requires_mpi

from minidist import collectives
from minidist.course.checks import parallel as pc
from minidist.course.exercises import solution_regions
from minidist.functions import cross_entropy
from minidist.tensor import Tensor

ROOT = Path(__file__).resolve().parents[1]


def notebook_functions(name):
    """The functions a solution notebook defines: its first code cell (the imports) and every
    cell that starts with ``def``, run without the rest."""
    namespace = {}
    nb = nbformat.read(ROOT / "solutions" / f"{name}.ipynb", as_version=4)
    code = [cell.source for cell in nb.cells if cell.cell_type == "code"]
    for source in code[:1] + [s for s in code[1:] if s.startswith("def ")]:
        exec(compile(source, name, "exec"), namespace)
    return namespace


S05 = runpy.run_path(str(ROOT / "solutions" / "05_data_parallel.py"))
S06 = notebook_functions("06_parameter_servers")


# -- the solutions pass ------------------------------------------------------------------------

def test_exercise_05_solution_passes_on_the_sim():
    assert pc.on_sim(pc.check_average_gradients, S05["average_gradients"], (1, 2, 3, 5)).count("one all-reduce") == 4
    assert "p=4: train_step: 3 steps on 4 ranks" in pc.on_sim(pc.check_train_step, S05["train_step"])


def test_exercise_06_solution_passes_on_the_sim():
    assert pc.on_sim(pc.check_worker_loop, S06["train_worker"], (2, 4)).count("sync equals") == 2
    assert "2 servers and 3 workers" in pc.on_sim(pc.check_worker_loop, S06["train_worker"], (5,), num_servers=2)
    verdicts = pc.on_sim(pc.check_sync_server, S06["serve_sync"], (2, 5))
    assert "2·N·M = 27008 bytes per step (N=4, M=3376)" in verdicts


def test_notebook_and_script_05_hold_the_same_functions():
    """A learner copies the functions from the notebook into the script: the same code."""
    nb = nbformat.read(ROOT / "solutions" / "05_data_parallel.ipynb", as_version=4)
    notebook = [r for cell in nb.cells if cell.cell_type == "code" for r in solution_regions(cell.source)]
    script = solution_regions((ROOT / "solutions" / "05_data_parallel.py").read_text())
    assert notebook == script and len(script) == 2


@pytest.mark.mpi
@requires_mpi
def test_exercise_05_script_passes_under_mpiexec():
    from minidist.launch import launch

    result = launch(str(ROOT / "solutions" / "05_data_parallel.py"), 3, timeout=120)
    assert result.ok, result.stderr
    assert "05_data_parallel: all checks pass on 3 ranks" in result.stdout


# -- mistakes fail with the right hint ---------------------------------------------------------

def flat_grads(params):
    return np.concatenate([p.grad.reshape(-1) for p in params])


def per_parameter(comm, params):
    for p in params:
        p.grad = collectives.all_reduce(comm, p.grad) / comm.Get_size()


def no_division(comm, params):
    total, start = collectives.all_reduce(comm, flat_grads(params)), 0
    for p in params:
        p.grad = total[start:start + p.size].reshape(p.shape)
        start += p.size


def no_copy_back(comm, params):
    collectives.all_reduce(comm, flat_grads(params))


def flat_grad_kept(comm, params):
    total = collectives.all_reduce(comm, flat_grads(params)) / comm.Get_size()
    for p in params:
        p.grad = total[: p.size]


@pytest.mark.parametrize("wrong, hint", [
    (per_parameter, "one bucket, not one all-reduce per parameter"),
    (no_division, "divide by the world size"),
    (no_copy_back, "copy the averaged values back"),
    (flat_grad_kept, "reshaped"),
])
def test_wrong_averaging_fails_with_its_hint(wrong, hint):
    with pytest.raises(AssertionError, match=hint):
        pc.on_sim(pc.check_average_gradients, wrong, (3,))


def update_before_averaging(comm, model, optimizer, xb, yb):
    optimizer.zero_grad()
    loss = cross_entropy(model(Tensor(xb)), yb)
    loss.backward()
    optimizer.step()
    S05["average_gradients"](comm, model.parameters())
    return loss.item()


def no_zero_grad(comm, model, optimizer, xb, yb):
    loss = cross_entropy(model(Tensor(xb)), yb)
    loss.backward()
    S05["average_gradients"](comm, model.parameters())
    optimizer.step()
    return loss.item()


def returns_tensor(comm, model, optimizer, xb, yb):
    S05["train_step"](comm, model, optimizer, xb, yb)
    return Tensor(np.zeros(()))


@pytest.mark.parametrize("wrong, hint", [
    (update_before_averaging, "only then call optimizer.step"),
    (no_zero_grad, "zero the gradients"),
    (returns_tensor, r"loss.item\(\)"),
])
def test_wrong_train_step_fails_with_its_hint(wrong, hint):
    with pytest.raises(AssertionError, match=hint):
        pc.on_sim(pc.check_train_step, wrong, (2,))


def pull_once(worker, model, loader, epochs):
    worker.pull()
    losses = []
    for _ in range(epochs):
        for xb, yb in loader:
            model.zero_grad()
            loss = cross_entropy(model(Tensor(xb)), yb)
            loss.backward()
            worker.push()
            losses.append(loss.item())
    return losses


def one_epoch_only(worker, model, loader, epochs):
    return S06["train_worker"](worker, model, loader, 1)


@pytest.mark.parametrize("wrong, hint", [
    (pull_once, "pull before every step"),
    (one_epoch_only, "for every batch of every epoch"),
])
def test_wrong_worker_loop_fails_with_its_hint(wrong, hint):
    with pytest.raises(AssertionError, match=hint):
        pc.on_sim(pc.check_worker_loop, wrong, (3,))


def sums_without_averaging(comm, params, num_steps, lr):
    gradient = np.empty_like(params)
    for _ in range(num_steps):
        for w in range(1, comm.Get_size()):
            comm.Send(params, dest=w, tag=pc.PARAMS_TAG)
        for w in range(1, comm.Get_size()):
            comm.Recv(gradient, source=w, tag=pc.GRAD_TAG)
            params = params - lr * gradient
    return params


def waits_for_gradients_first(comm, params, num_steps, lr):
    gradient = np.empty_like(params)
    for _ in range(num_steps):
        for w in range(1, comm.Get_size()):
            comm.Recv(gradient, source=w, tag=pc.GRAD_TAG)
    return params


def test_wrong_server_fails_and_a_deadlock_becomes_an_assertion():
    with pytest.raises(AssertionError, match="average the N gradients"):
        pc.on_sim(pc.check_sync_server, sums_without_averaging, (3,))
    with pytest.raises(AssertionError, match="deadlock.*\nHint: every rank blocked"):
        pc.on_sim(pc.check_sync_server, waits_for_gradients_first, (3,))


def test_a_stub_raises_not_implemented_error():
    def stub(comm, params):
        raise NotImplementedError()

    with pytest.raises(NotImplementedError):
        pc.on_sim(pc.check_average_gradients, stub, (2,))
