"""minidist.course.checks.full_shard (exercise 15's puzzle): the solution's FULL_SHARD step passes on
1 to 4 simulated ranks within the memory budget and with exactly 3 (P-1) Σ s_i values sent; each
usual wrong turn fails with its own hint: every unit kept gathered from the forward to the backward
(ZeRO-2's way: the budget), the next unit gathered during this one's forward, the gradients summed,
not averaged, the padding forgotten (units of 42, 48 and 21 numbers), an all-reduce where the
reduce-scatter belongs, the whole vector updated; the engine's FSDP is refused."""
import numpy as np
import pytest

from minidist.collectives import all_gather, all_reduce, reduce_scatter
from minidist.course.checks import LearnerError
from minidist.course.checks import full_shard as full_shard_checks

OWN = "own implementation, not yours"


def step(mistake=None):
    """The puzzle's full_shard_step, the solution's or with one mistake."""

    def full_shard_step(comm, model, shards, x, dy, update, states):
        p, rank = comm.Get_size(), comm.Get_rank()

        def gathered(i):
            whole = all_gather(comm, shards[i]).reshape(-1)
            return whole if mistake == "no_padding_dropped" else whole[:model.units[i].numel]

        kept, h, saved = [], x, []
        ahead = gathered(0) if mistake == "prefetch" else None
        for i, unit in enumerate(model.units):
            if mistake == "prefetch":  # the next unit gathered while this one runs: two alive
                whole, ahead = ahead, gathered(i + 1) if i + 1 < len(model.units) else None
            else:
                whole = gathered(i)
            if mistake == "keep_all":
                kept.append(whole)
            h, s = unit.forward(whole, h)
            saved.append(s)
            del whole
        grad = dy
        for i in reversed(range(len(model.units))):
            whole = kept[i] if mistake == "keep_all" else gathered(i)
            grad, grad_flat = model.units[i].backward(whole, saved[i], grad)
            del whole
            if mistake == "no_grad_padding":
                padded = grad_flat
            else:
                padded = np.concatenate([grad_flat, np.zeros(p * shards[i].size - grad_flat.size)])
            if mistake == "all_reduce":
                s = shards[i].size
                g_mine = all_reduce(comm, padded)[rank * s:(rank + 1) * s]
            else:
                g_mine = reduce_scatter(comm, padded)
            if mistake != "sum":
                g_mine = g_mine / p
            if mistake == "whole_update":  # the whole vector stepped, this rank's slice kept
                s = shards[i].size
                whole = all_gather(comm, shards[i]).reshape(-1)
                shards[i] = update(whole, all_reduce(comm, padded) / p, states[i])[rank * s:(rank + 1) * s]
                continue
            shards[i] = update(shards[i], g_mine, states[i])
        return h

    return full_shard_step


def test_the_solution_passes_on_one_to_four_ranks():
    verdict = full_shard_checks.check_full_shard_step(step())
    assert verdict.startswith("full_shard_step: ok")
    # shards of 11, 12 and 6 on 4 ranks: 3 * 3 * 29 = 261 values, the largest unit 4 * 12 * 8 bytes
    assert "p=4: 3 AdamW steps equal one process, at most 384 of 384 bytes" in verdict
    assert "261 values sent per step" in verdict


@pytest.mark.parametrize("mistake, fragment", [
    ("keep_all", "every unit's whole vector stayed alive until the backward"),
    ("prefetch", "more than one unit's whole parameters were alive at once"),
    ("sum", "divide by comm.Get_size()"),
    ("no_grad_padding", "pad unit.backward's gradient with zeros"),
    ("all_reduce", "not an all-reduce"),
    ("whole_update", "update only this rank's shard"),
])
def test_each_mistake_gets_its_hint(mistake, fragment):
    with pytest.raises(AssertionError, match="Hint: ") as caught:
        full_shard_checks.check_full_shard_step(step(mistake))
    assert fragment in str(caught.value), str(caught.value)


def test_the_padding_passed_to_a_unit_gets_the_padding_hint():
    with pytest.raises(LearnerError, match="without the padding"):
        full_shard_checks.check_full_shard_step(step("no_padding_dropped"))


def test_the_engines_fsdp_is_refused():
    from minidist.parallel.fsdp import unit

    def engine(comm, model, shards, x, dy, update, states):
        unit.FlatUnit.gather(None)

    with pytest.raises(LearnerError, match=OWN):
        full_shard_checks.check_full_shard_step(engine)


def test_gradients_through_shared_memory_fail():
    """The gathers honest, the gradients averaged through a dict the simulated ranks' threads share
    and a reduce-scatter of zeros for the traffic: values, memory and bytes right, impossible under
    mpiexec; the step run with every message but the all-gathers' spoiled catches it."""
    board, counter = {}, {}

    def full_shard_step(comm, model, shards, x, dy, update, states):
        p, rank = comm.Get_size(), comm.Get_rank()
        h, saved = x, []
        for i, unit in enumerate(model.units):
            h, s = unit.forward(all_gather(comm, shards[i]).reshape(-1)[:unit.numel], h)
            saved.append(s)
        grad = dy
        for i in reversed(range(len(model.units))):
            whole = all_gather(comm, shards[i]).reshape(-1)[:model.units[i].numel]
            grad, grad_flat = model.units[i].backward(whole, saved[i], grad)
            del whole
            padded = np.concatenate([grad_flat, np.zeros(p * shards[i].size - grad_flat.size)])
            n = counter.setdefault((p, rank), 0)
            counter[p, rank] = n + 1
            board.setdefault((p, n), {})[rank] = padded
            reduce_scatter(comm, np.zeros_like(padded))  # the traffic, and a wait for every rank
            s = shards[i].size
            mean = sum(board[p, n][r] for r in range(p)) / p
            shards[i] = update(shards[i], mean[rank * s:(rank + 1) * s], states[i])
        return h

    with pytest.raises(AssertionError, match="step 1's gradients: with every array message spoiled"):
        full_shard_checks.check_full_shard_step(full_shard_step)
