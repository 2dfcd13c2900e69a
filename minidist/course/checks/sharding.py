"""The check of exercise 15: one ZeRO-1 step (Rajbhandari et al., SC 2020, section 5.1).

:func:`check_zero1_step` takes your ``zero1_step(comm, w, g, update, state)``: ``w`` the whole
flat parameter vector (float64, the same on every rank), ``g`` this rank's own gradient of it
(each rank's batch gives another), ``update(w_shard, g_shard, state)`` an elementwise
optimizer step that returns the updated shard and keeps its moments in ``state`` (a dict this
rank keeps from step to step), and it returns the new whole vector. The step is::

    pad w and g with zeros to padded = ceil(n / P) * P numbers, shard size s = padded / P
    reduce-scatter g (sum), divide by P: this rank's shard of the ranks' mean gradient
    update this rank's shard of w only (its optimizer state: s numbers per moment)
    all-gather the updated shards, drop the padding: the new w, the same on every rank

On simulated worlds of 1 to 4 ranks, with n = :data:`NUMEL` (no P of 2, 3, 4 divides it) and
:data:`STEPS` AdamW steps, it checks on every rank: the vector after each step equals one
process's AdamW on the mean of the ranks' gradients (to 1e-12); ``update`` was called once per
step, on a shard of s numbers, and each moment in ``state`` has s numbers (1/P of the state);
and, counted by a :class:`minidist.tracing.CountingComm`, each step sends one ring
reduce-scatter and one ring all-gather of the padded vector: 2(P-1)s values per rank, the
bytes of the one all-reduce data parallelism would have sent.

Every rank's answer must come from what it received: the gradients and the weights are drawn
afresh at every call (no rank can draw another's gradient again from a seed, nor take
:func:`reference`'s answer for the check's), and on 2 to 4 ranks the first step runs once more
with every message spoiled in transit (:func:`minidist.course.checks.crossing.check_received`):
a rank with a value of its vector still right did not depend on what it received (gradients
passed through memory the simulated ranks share, which under mpiexec is not there), and fails.

Known mistakes get their hint: the sum of the gradients instead of their mean (P times the
step), the whole vector updated (P copies of the state, the saving lost), the padding forgotten
(shards of unequal size, which ``all_gather`` refuses), an all-reduce instead of the
reduce-scatter (a rank needs only its shard of the mean), MPI's own collectives (not counted)
or nothing sent, the padding returned.

The engine's ``ZeroRedundancyOptimizer`` and FSDP (``FullyShardedDataParallel``, its
``FlatUnit``) may not be the answer, nor be called by it; ``minidist.collectives``'
``reduce_scatter`` and ``all_gather`` may (chapter 04 built them). A failure raises
``AssertionError("what: problem\\nHint: ...")`` on every rank (the ranks agree first:
:func:`minidist.course.checks.fail_together`); your code raising gives a
:class:`minidist.course.checks.LearnerError` with your line. On success it returns one verdict
line per world size::

    from minidist.course.checks import sharding as sharding_checks
    print(sharding_checks.check_zero1_step(zero1_step))
"""
from __future__ import annotations

import math
import secrets

import numpy as np

from minidist import sim
from minidist.course.checks import DEADLOCK_HINT, call_learner, check_own_code, fail, fail_together, forbidding
from minidist.course.checks.crossing import any_right, check_received
from minidist.parallel.fsdp import fsdp, unit
from minidist.parallel.zero import optimizer as zero_optimizer
from minidist.tracing import CountingComm

WORLD_SIZES = (1, 2, 3, 4)
NUMEL = 11  # 2, 3 and 4 divide neither 11 nor any shard cut
STEPS = 3
LR, BETAS, EPS, WEIGHT_DECAY = 0.1, (0.9, 0.999), 1e-8, 0.01
ATOL = 1e-12

HINTS = {
    "sum": ("average the gradients: after the reduce-scatter this rank holds the *sum* of its shard over the P "
            "ranks; divide it by comm.Get_size() before the update (data parallelism steps on the mean)"),
    "whole": ("update only this rank's shard, w_padded[rank * s:(rank + 1) * s] with the same slice of the "
              "gradient: updating the whole vector keeps P copies of the optimizer state, the very thing ZeRO-1 "
              "removes"),
    "padding": ("pad w and g with zeros to padded = ceil(n / P) * P numbers first (np.concatenate or np.pad): "
                "reduce_scatter cuts n numbers into shards of unequal size when P does not divide n, and "
                "all_gather needs the same shard size on every rank"),
    "all_reduce": ("a rank needs only its shard of the mean: reduce_scatter(comm, g_padded) sends (P-1)s "
                   "values; an all-reduce of the whole gradient sends twice that, and the all-gather after the "
                   "update then makes ZeRO-1 cost 1.5 times data parallelism"),
    "silent": ("the step sent no message on several ranks: use minidist.collectives.reduce_scatter and "
               "all_gather, which talk through comm's Send and Recv (MPI's own comm.Reduce_scatter and "
               "comm.Allgather are not counted)"),
    "bytes": ("one reduce_scatter(comm, g_padded) and one all_gather(comm, new_shard) per step, both from "
              "minidist.collectives, and nothing else: 2(P-1)s values per rank"),
    "unpad": "return the gathered vector without its padding: all_gather(...).reshape(-1)[:n], n = w.size",
    "values": ("w_new = all_gather(update(w_shard, reduce_scatter(g_padded) / P, state)) without the padding; "
               "the update is given: call it once, on this rank's shard"),
    "state": ("keep the optimizer's state in the dict you are given (update does): it must be the same dict at "
              "every step, and hold only this rank's shard"),
}


def adamw_update(w_shard, g_shard, state):
    """The optimizer step the check hands in: AdamW (decoupled decay) on one shard, its two
    moments and step count in ``state``; returns the new shard (``w_shard`` unchanged)."""
    if "m" not in state:
        state["m"], state["v"], state["t"] = np.zeros_like(w_shard), np.zeros_like(w_shard), 0
    state["t"] += 1
    state["m"] = BETAS[0] * state["m"] + (1 - BETAS[0]) * g_shard
    state["v"] = BETAS[1] * state["v"] + (1 - BETAS[1]) * g_shard * g_shard
    m_hat = state["m"] / (1 - BETAS[0] ** state["t"])
    v_hat = state["v"] / (1 - BETAS[1] ** state["t"])
    return w_shard * (1 - LR * WEIGHT_DECAY) - LR * m_hat / (np.sqrt(v_hat) + EPS)


def _gradient(rank: int, step: int, salt: int) -> np.ndarray:
    """Rank ``rank``'s gradient at ``step``, from ``salt`` (drawn at every check)."""
    return np.random.default_rng([salt, 1000 * step + rank]).standard_normal(NUMEL)


def _weights(salt: int) -> np.ndarray:
    """The vector before the first step, from ``salt``."""
    return np.random.default_rng([salt, 7]).standard_normal(NUMEL)


def reference(p: int, mean: bool = True, salt: int = 0) -> list[np.ndarray]:
    """One process: AdamW on the whole vector with the ranks' mean gradient, after each step
    (the inputs of ``salt``: the check draws its own at every call)."""
    w, state, out = _weights(salt), {}, []
    for step in range(STEPS):
        g = np.sum([_gradient(r, step, salt) for r in range(p)], axis=0) / (p if mean else 1)
        w = adamw_update(w, g, state)
        out.append(w)
    return out


def _problem(what, got, step, p, shard, sizes, sent, state, salt):
    """The problem with this rank's step (or None); a wrong shard size failed already, in update."""
    if len(sizes) != 1:
        return what, f"update was called {len(sizes)} times in one step, expected once", HINTS["values"]
    if not isinstance(got, np.ndarray) or got.shape != (NUMEL,):
        hint = HINTS["unpad"] if getattr(got, "shape", None) == (shard * p,) else HINTS["values"]
        return what, f"expected the new vector of shape ({NUMEL},), got {type(got).__name__} " \
                     f"{getattr(got, 'shape', '')}", hint
    want = reference(p, salt=salt)[step]
    if not np.allclose(got, want, rtol=0, atol=ATOL):
        summed = p > 1 and np.allclose(got, reference(p, mean=False, salt=salt)[step], rtol=0, atol=1e-10)
        return (what, f"the new vector differs from one process's AdamW on the mean gradient by up to "
                      f"{float(np.max(np.abs(got - want))):.3g}", HINTS["sum" if summed else "values"])
    moments = [v for v in state.values() if isinstance(v, np.ndarray)]
    if any(v.size != shard for v in moments):
        return what, f"the state holds arrays of {[v.size for v in moments]} numbers, expected {shard}", HINTS["state"]
    expected = 2 * (p - 1) * shard
    if sent != expected:
        if sent == 0:
            return what, "the step sent no message", HINTS["silent"]
        hint = HINTS["all_reduce"] if sent > expected else HINTS["bytes"]
        return what, f"the step sent {sent} values, expected {expected} (a ring reduce-scatter and all-gather of " \
                     f"{shard * p} values: 2(P-1)s)", hint
    return None


def _zero1_rank(comm, zero1_step, salt):
    p, rank = comm.Get_size(), comm.Get_rank()
    shard = math.ceil(NUMEL / p)
    w, state = _weights(salt), {}
    counted = CountingComm(comm, allow_collectives=True)
    for step in range(STEPS):
        what = (f"zero1_step(comm, w, g, update, state) on {p} rank{'s' * (p > 1)}, step {step + 1} of {STEPS} "
                f"(n = {NUMEL}, float64)")
        sizes = []

        def update(w_shard, g_shard, state_, sizes=sizes, what=what):
            sizes.append(int(np.size(w_shard)) if np.shape(w_shard) == np.shape(g_shard) else -1)
            if sizes[-1] != shard:  # at once: a wrong shard size fails the collectives after it
                size = sizes[-1]
                if size < 0:
                    fail(what, "update got a weight shard and a gradient shard of different sizes", HINTS["padding"])
                fail(what, f"update got a shard of {size} numbers, expected {shard} (padded {shard * p} / {p} ranks)",
                     HINTS["whole"] if size in (NUMEL, shard * p) else HINTS["padding"])
            return adamw_update(np.asarray(w_shard, dtype=np.float64), np.asarray(g_shard, dtype=np.float64), state_)

        before = counted.elements
        got = call_learner(what, zero1_step, counted, w.copy(), _gradient(rank, step, salt), update, state,
                           name="your zero1_step")
        problem = _problem(what, got, step, p, shard, sizes, counted.elements - before, state, salt)
        fail_together(comm, problem)
        w = got
    return f"{STEPS} AdamW steps equal one process, shards of {shard} of {shard * p}, " \
           f"{2 * (p - 1) * shard} values sent per step"


def _zero1_still_right(comm, zero1_step, salt) -> bool:
    """The first step of :func:`_zero1_rank` again (``comm`` spoils what it delivers): is any
    value of this rank's new vector still one process's (every value depends on every rank's
    gradient)?"""
    got = zero1_step(CountingComm(comm, allow_collectives=True), _weights(salt),
                     _gradient(comm.Get_rank(), 0, salt), adamw_update, {})
    return any_right(got, reference(comm.Get_size(), salt=salt)[0], ATOL)


_ENGINE = (zero_optimizer.ZeroRedundancyOptimizer.__init__, zero_optimizer.ZeroRedundancyOptimizer.step,
           zero_optimizer.ZeroRedundancyOptimizer.shard_gradient, fsdp.FullyShardedDataParallel.__init__,
           unit.FlatUnit.gather, unit.FlatUnit.reduce)


@forbidding(*_ENGINE)
def check_zero1_step(zero1_step) -> str:
    """Check your ``zero1_step(comm, w, g, update, state)`` (module docstring)."""
    check_own_code(zero1_step, "zero1_step")
    lines = []
    salt = secrets.randbits(64)  # the gradients and weights: new at every call
    for p in WORLD_SIZES:
        try:
            verdicts = sim.World(p, timeout=60).run(_zero1_rank, zero1_step, salt)
        except (sim.DeadlockError, sim.SimTimeoutError) as error:
            fail(f"zero1_step on {p} simulated ranks", str(error), DEADLOCK_HINT)
        check_received(f"zero1_step on {p} simulated ranks, step 1", p, _zero1_still_right, zero1_step, salt)
        lines.append(f"p={p}: {verdicts[0]}")
    return "zero1_step: ok\n" + "\n".join(lines)


__all__ = ["HINTS", "NUMEL", "STEPS", "WORLD_SIZES", "adamw_update", "check_zero1_step", "reference"]
