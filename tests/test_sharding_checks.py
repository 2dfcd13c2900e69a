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
