"""minidist.course.checks.across_datacenters (exercise 21): the solution's outer step and hand-over
pass on simulated replicas, one of them lost and joining again; answers wrong in each usual way fail
with their own hint: the pseudo-gradient's sign reversed, the mean over the world instead of the
members, Nesterov applied as plain momentum (and the reverse), the momentum returned stale, a sum
whose order differs between replicas, an all-reduce over the world while a replica is dead
(a deadlock), a joiner not given the momentum; the engine's own DiLoCo or SGD as the answer.
The check's oracle, its sequential run, is checked against the engine's DiLoCo on the simulator
with the same loss and joining (a second implementation), and against DDP-free arithmetic."""
import numpy as np
import pytest

from minidist import collectives, sim
from minidist.course.checks import STUB_HINT, LearnerError
from minidist.course.checks import across_datacenters as dc
from minidist.parallel.local_sgd import DiLoCo, ReplicaGroup, ReplicaSet, flatten


def outer_with(mistake=None):
    """The exercise's outer step, the solution's or with one mistake."""

    def outer_step(comm, members, theta, momentum, local, lr, mu, nesterov):
        group = ReplicaGroup(comm, members)
        mine = (local - theta) if mistake == "sign" else (theta - local)
        if mistake == "order":  # every rank gathers the others' and adds its own first
            rank = members.index(comm.Get_rank())
            every = collectives.all_gather(group, mine)
            total = mine.copy()
            for q in (*range(rank + 1, len(members)), *range(rank)):
                total = total + every[q]
        elif mistake == "world_comm":  # waits for the lost replica
            total = collectives.all_reduce(comm, mine, algorithm="ring")
        else:
            total = collectives.all_reduce(group, mine, algorithm="ring")
        delta = total / (comm.Get_size() if mistake == "world" else len(members))
        new = mu * momentum + delta
        nest = nesterov if mistake not in ("plain", "always") else mistake == "always"
        theta = theta - lr * ((delta + mu * new) if nest else new)
        return theta, (momentum if mistake == "stale" else new)

    return outer_step


def heal_with(mistake=None):
    def heal(comm, donor, receivers, theta, momentum):
        if comm.Get_rank() == donor:
            for r in receivers:
                comm.Send(theta, dest=r, tag=21)
                if mistake != "no_momentum":
                    comm.Send(momentum, dest=r, tag=22)
            return theta, momentum
        theta = np.empty_like(theta)
        comm.Recv(theta, source=donor, tag=21)
        if mistake == "no_momentum":
            return theta, np.zeros_like(momentum)
        momentum = np.empty_like(momentum)
        comm.Recv(momentum, source=donor, tag=22)
        return theta, momentum

    return heal


OUTER, HEAL = outer_with(), heal_with()


def test_the_solution_passes_every_check():
    assert "(pass)" in dc.check_outer_step(OUTER)
    assert "(pass)" in dc.check_heal(HEAL)
    assert "(pass)" in dc.check_churn(OUTER, HEAL)


@pytest.mark.parametrize("mistake, fragment", [
    ("sign", "reversed"), ("world", "not over comm.Get_size"), ("plain", "plain momentum"),
    ("always", "without nesterov"), ("stale", "updated momentum"), ("order", "same order"),
    ("world_comm", "reduce over the members only")])
def test_each_mistake_of_the_outer_step_gets_its_hint(mistake, fragment):
    with pytest.raises(AssertionError, match=fragment):
        dc.check_outer_step(outer_with(mistake))


def test_a_joiner_without_the_momentum_fails_heal_and_the_run():
    with pytest.raises(AssertionError, match="got theta but not the momentum"):
        dc.check_heal(heal_with("no_momentum"))
    with pytest.raises(AssertionError, match="the joiner needs the outer momentum too"):
        dc.check_churn(OUTER, heal_with("no_momentum"))


def test_the_run_catches_what_one_step_might_miss():
    """A sum in another order on every replica is caught by the run too (bit-identity)."""
    with pytest.raises(AssertionError, match="not bit-identical"):
        dc.check_churn(outer_with("order"), HEAL)


def test_the_engines_own_code_is_refused():
    def heal_by_the_engine(comm, donor, receivers, theta, momentum):
        replicas = ReplicaSet(comm)
        if comm.Get_rank() == donor:
            replicas.send_state([theta, momentum], receivers)
            return theta, momentum
        return tuple(replicas.receive_state([theta, momentum], donor))

    with pytest.raises(LearnerError, match="own implementation, not yours"):
        dc.check_heal(heal_by_the_engine)


def test_a_stub_says_it_is_a_stub():
    def outer_step(comm, members, theta, momentum, local, lr, mu, nesterov):
        raise NotImplementedError()

    with pytest.raises(LearnerError, match=STUB_HINT[:30]):
        dc.check_outer_step(outer_step)


def test_the_reference_is_the_engines_diloco_with_a_replica_lost_and_rejoined():
    """The oracle against a second implementation: the engine's DiLoCo (its own quorum, outer SGD
    and hand-over) on the simulator, with the check's model, data and loss step."""
    victim, at = dc.SCENARIOS[0]

    def run(comm):
        rank = comm.Get_rank()

        def build(join, seed):
            model, optimizer = dc._model(seed)
            lr, mu, nesterov = dc.OUTER
            return model, optimizer, DiLoCo(model.parameters(), ReplicaSet(comm, timeout=60), dc.H, outer_lr=lr,
                                            outer_momentum=mu, nesterov=nesterov, join=join)

        model, optimizer, diloco = build(False, 0)
        lost = False
        while diloco.inner_steps < dc.STEPS:
            t = diloco.inner_steps + 1
            if (rank, t) == (victim, at) and not lost:
                lost = True
                model, optimizer, diloco = build(True, 100 + rank)
                continue
            dc._inner_step(model, optimizer, rank, t)
            diloco.step()
        return diloco.state_arrays()

    states = sim.World(dc.M, timeout=60).run(run)
    theta, momentum = dc.reference(victim, at)
    np.testing.assert_allclose(states[0][0], theta, rtol=0, atol=1e-12)
    np.testing.assert_allclose(states[0][1], momentum, rtol=0, atol=1e-12)
    assert np.abs(theta - flatten(dc._model()[0].parameters())).max() > 1e-3  # it trained


def test_the_step_formula_by_hand():
    """One outer step on two replicas, numbers checked by hand: theta 1, locals 0.8 and 0.6:
    Delta = 0.3; momentum 0.9 * 0.1 + 0.3 = 0.39; Nesterov step 0.7 (0.3 + 0.9 * 0.39) = 0.4557."""
    theta, momentum = dc._step_formula(np.ones(1), np.full(1, 0.1), [np.full(1, 0.8), np.full(1, 0.6)], 0.7, 0.9, True)
    np.testing.assert_allclose([theta[0], momentum[0]], [1 - 0.4557, 0.39], rtol=0, atol=1e-15)
