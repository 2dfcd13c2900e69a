"""minidist.course.checks.sharding (exercise 15): the solution's ZeRO-1 step passes on 1 to 4
simulated ranks; versions wrong in each way the check looks for fail, each with its own hint
(the sum instead of the mean, the whole vector updated, the padding forgotten, an all-reduce
instead of the reduce-scatter, nothing sent, the padding returned); the engine's
ZeroRedundancyOptimizer is refused when called by the answer; a stub says it is one."""
import numpy as np
import pytest

from minidist.collectives import all_gather, all_reduce, reduce_scatter
from minidist.course.checks import STUB_HINT, LearnerError
from minidist.course.checks import sharding as sharding_checks
from minidist.nn import Parameter
from minidist.optim import SGD
from minidist.parallel.zero import ZeroRedundancyOptimizer

OWN = "own implementation, not yours"


def zero1(mistake=None):
    """The exercise's step, the solution's or with one mistake."""

    def zero1_step(comm, w, g, update, state):
        p, rank, n = comm.Get_size(), comm.Get_rank(), w.size
        s = -(-n // p)
        if mistake == "padding":
            s = n // p + (rank < n % p)
            start = rank * (n // p) + min(rank, n % p)
            g_mine = reduce_scatter(comm, g) / p
            new = update(w[start:start + s], g_mine, state)
            return all_gather(comm, new).reshape(-1)[:n]
        pad = np.zeros(p * s - n)
        g_padded, w_padded = np.concatenate([g, pad]), np.concatenate([w, pad])
        if mistake == "whole":
            return update(w, all_reduce(comm, g) / p, state)
        if mistake == "all_reduce":
            g_mine = (all_reduce(comm, g_padded) / p)[rank * s:(rank + 1) * s]
        elif mistake == "silent":
            g_mine = g_padded[rank * s:(rank + 1) * s]  # this rank's own, never averaged
        else:
            g_mine = reduce_scatter(comm, g_padded) / (1 if mistake == "sum" else p)
        new = update(w_padded[rank * s:(rank + 1) * s], g_mine, state)
        whole = all_gather(comm, new).reshape(-1)
        return whole if mistake == "unpadded" else whole[:n]

    return zero1_step


def test_the_solution_passes_on_one_to_four_ranks():
    verdict = sharding_checks.check_zero1_step(zero1())
    assert verdict.startswith("zero1_step: ok")
    assert "p=3: 3 AdamW steps equal one process, shards of 4 of 12, 16 values sent per step" in verdict


@pytest.mark.parametrize("mistake, hint", [
    ("sum", "divide it by comm.Get_size()"),
    ("whole", "update only this rank's shard"),
    ("padding", "pad w and g with zeros"),
    ("all_reduce", "a rank needs only its shard of the mean"),
    ("silent", "the optimizer"),  # never averaged: values differ first
    ("unpadded", "without its padding"),
])
def test_each_mistake_gets_its_hint(mistake, hint):
    with pytest.raises((AssertionError, LearnerError)) as caught:
        sharding_checks.check_zero1_step(zero1(mistake))
    message = str(caught.value)
    if mistake == "silent":
        assert "differs from one process's AdamW" in message
    else:
        assert hint in message, message


def test_the_engine_is_refused_and_a_stub_says_so():
    def engine_step(comm, w, g, update, state):
        shard = Parameter(w.copy())
        shard.grad = g
        ZeroRedundancyOptimizer([shard], SGD, comm, lr=0.1).step()
        return shard.data

    with pytest.raises((AssertionError, LearnerError)) as caught:
        sharding_checks.check_zero1_step(engine_step)
    assert OWN in str(caught.value)

    def stub(comm, w, g, update, state):
        raise NotImplementedError()

    with pytest.raises((AssertionError, LearnerError)) as caught:
        sharding_checks.check_zero1_step(stub)
    assert STUB_HINT in str(caught.value)


def test_a_step_that_did_not_come_through_comm_fails():
    """Issue 36: each passed before, with the traffic of a right answer. The gradients passed
    through memory the simulated ranks (threads) share: still right with every message spoiled
    in transit; the gradients drawn again from the check's seeds, or the checks' reference
    returned: the inputs are drawn afresh at every call."""
    shared = {}

    def through_shared_memory(comm, w, g, update, state):
        p, rank, n = comm.Get_size(), comm.Get_rank(), w.size
        s = -(-n // p)
        padding, step = np.zeros(p * s - n), state.get("t", 0)
        shared[p, step, rank] = g.copy()
        reduce_scatter(comm, np.zeros(p * s))  # the traffic, and a wait for every rank
        mean = np.concatenate([sum(shared[p, step, r] for r in range(p)) / p, padding])
        new = update(np.concatenate([w, padding])[rank * s:(rank + 1) * s], mean[rank * s:(rank + 1) * s], state)
        return all_gather(comm, new).reshape(-1)[:n]  # the other shards come honestly

    def the_checks_reference(comm, w, g, update, state):
        p, s = comm.Get_size(), -(-w.size // comm.Get_size())
        reduce_scatter(comm, np.zeros(p * s))
        update(np.zeros(s), np.zeros(s), state)
        all_gather(comm, np.zeros(s))
        return sharding_checks.reference(p)[state["t"] - 1]

    with pytest.raises(AssertionError) as caught:  # its own shard is right, the others NaN
        sharding_checks.check_zero1_step(through_shared_memory)
    assert str(caught.value).startswith("zero1_step on 2 simulated ranks, step 1: with every array message spoiled in "
                                        "transit (NaN arrives), ranks 0, 1 still returned right values: they did "
                                        "not depend on what your rank received"), str(caught.value)

    def all_through_shared_memory(comm, w, g, update, state):
        p, rank, n = comm.Get_size(), comm.Get_rank(), w.size
        s = -(-n // p)
        padding, step = np.zeros(p * s - n), state.get("t", 0)
        shared["g", p, step, rank] = g.copy()
        reduce_scatter(comm, np.zeros(p * s))
        mean = np.concatenate([sum(shared["g", p, step, r] for r in range(p)) / p, padding])
        shared["w", p, step, rank] = update(np.concatenate([w, padding])[rank * s:(rank + 1) * s],
                                            mean[rank * s:(rank + 1) * s], state)
        all_gather(comm, np.zeros(s))
        return np.concatenate([shared["w", p, step, r] for r in range(p)])[:n]

    with pytest.raises(AssertionError) as caught:
        sharding_checks.check_zero1_step(all_through_shared_memory)
    assert "ranks 0, 1 still returned right values: they did not depend on what your rank received" in str(
        caught.value), str(caught.value)
    with pytest.raises(AssertionError, match="differs from one process's AdamW on the mean gradient"):
        sharding_checks.check_zero1_step(the_checks_reference)
