"""The puzzle of exercise 15: a FULL_SHARD training step under a memory budget (ZeRO-3,
Rajbhandari et al., SC 2020, section 5.3; PyTorch FSDP's ``ShardingStrategy.FULL_SHARD``).

:func:`check_full_shard_step` takes your ``full_shard_step(comm, model, shards, x, dy, update,
states)``: ``model.units`` a list of :class:`Unit` (a Linear layer, with a tanh but the last),
each with its parameters laid end to end in one flat vector of ``unit.numel`` numbers; ``shards[i]``
this rank's shard of unit i's vector, padded with zeros to P s_i numbers, s_i = ceil(numel_i / P)
(rank r holds numbers r s_i .. (r + 1) s_i); ``x`` this rank's batch; ``dy`` the gradient of the
output on it; ``update(w_shard, g_shard, state)`` AdamW on one shard (``states[i]`` unit i's
state). It returns the output of the model on ``x`` and, before it returns, replaces every
``shards[i]`` with the updated shard. One unit at a time::

    forward,  unit by unit:     all-gather its shards, drop the padding, unit.forward(whole, h),
                                let the whole vector go
    backward, in reverse order: all-gather again, unit.backward(whole, saved, grad),
                                reduce-scatter the padded gradient, divide by P, update the shard

On simulated worlds of 1 to 4 ranks, :data:`STEPS` steps with units of :data:`SIZES` (42, 48 and
21 numbers: no P of 2, 3, 4 divides them all), it checks on every rank:

- values: the output equals one process's (the whole model on this rank's batch, to 1e-12), and
  after each step the shards gathered are one process's AdamW step on the ranks' mean gradient;
- memory: whenever a unit's forward or backward runs, the whole vectors you gathered that are
  still alive (tracked by weak references to the arrays the all-gathers receive into and to the
  arrays you pass to the units, with the arrays they are views of) total at most :func:`budget`,
  one unit's: the largest padded vector, 8 P s_max bytes.
  Keeping every unit gathered from the forward to the backward, as ZeRO-2 or FSDP's
  SHARD_GRAD_OP do, saves the second all-gather and breaks the budget;
- traffic: counted by a :class:`minidist.tracing.CountingComm`, each step sends exactly
  3 (P - 1) Σ s_i values, 3 Ψ (P - 1)/P for Ψ the padded numbers: two ring all-gathers and one
  ring reduce-scatter of every unit, 1.5 times data parallelism's all-reduce.

Every rank's answer must come from what it received: the inputs are drawn afresh at every call,
and the first step runs once more with every message spoiled in transit
(:func:`~minidist.course.checks.crossing.check_received`), then once more with every message but
the all-gathers' spoiled: a shard still right after it did not get the gradients through the
communicator. The engine's FSDP and ZeRO may not
be the answer nor be called by it; ``minidist.collectives``' ``all_gather`` and
``reduce_scatter`` may. A failure raises ``AssertionError("what: problem\\nHint: ...")`` on
every rank; your code raising gives a :class:`minidist.course.checks.LearnerError`::

    from minidist.course.checks import full_shard as full_shard_checks
    print(full_shard_checks.check_full_shard_step(full_shard_step))
"""
from __future__ import annotations

import math
import secrets
import sys
import weakref

import numpy as np

from minidist import collectives, sim
from minidist.collectives import all_gather
from minidist.course.checks import DEADLOCK_HINT, call_learner, check_own_code, fail, fail_together, forbidding
from minidist.course.checks.crossing import any_right, check_received
from minidist.course.checks.integrity import unchanged
from minidist.course.checks.sharding import adamw_update
from minidist.parallel.fsdp import fsdp, unit
from minidist.parallel.zero import optimizer as zero_optimizer
from minidist.tracing import CountingComm

WORLD_SIZES = (1, 2, 3, 4)
WIDTHS = (5, 7, 6, 3)  # the layers: 5 -> 7 -> 6 -> 3
SIZES = tuple(o * i + o for i, o in zip(WIDTHS, WIDTHS[1:]))  # (42, 48, 21)
BATCH, STEPS = 4, 3
ATOL = 1e-12

HINTS = {
    "values": ("unit by unit: whole = all_gather(comm, shards[i]).reshape(-1)[:unit.numel]; h, saved = "
               "unit.forward(whole, h); then backward in reverse order with the units gathered again"),
    "padding": ("a unit's forward and backward take its whole vector without the padding: "
                "all_gather(comm, shards[i]).reshape(-1)[:unit.numel] (unit.numel numbers)"),
    "grad_padding": ("pad unit.backward's gradient with zeros to P s numbers (the shard's size times P) before "
                     "reduce_scatter: it cuts like numpy.array_split, and every rank's shard must be s numbers"),
    "sum": ("average the gradients: the reduce-scatter gives this rank's shard of the *sum* over the P ranks; "
            "divide by comm.Get_size() before the update"),
    "whole": ("update only this rank's shard of each unit, with its shard of the gradient: the state stays 1/P "
              "of the model's"),
    "budget_all": ("every unit's whole vector stayed alive until the backward: FULL_SHARD lets a unit's whole "
                   "parameters go as soon as its forward is done (keep only the shard; drop every reference, a "
                   "list of them included) and gathers them again for its backward. One all-gather more per "
                   "step, and the memory of one unit instead of all"),
    "budget": ("more than one unit's whole parameters were alive at once: gather a unit right before its forward "
               "(or backward) and drop the whole vector right after it, before gathering the next one"),
    "bytes_short": ("fewer values than FULL_SHARD sends: two all-gathers (forward, and again in the backward) and "
                    "one reduce-scatter of every unit per step"),
    "bytes_more": ("more values than FULL_SHARD sends: a reduce-scatter of the gradient (not an all-reduce: this "
                   "rank updates only its shard) and one all-gather per unit in each direction"),
    "silent": ("nothing was sent: use minidist.collectives' all_gather and reduce_scatter, which talk through "
               "comm's Send and Recv"),
    "gradients_received": ("the gradients must reach the other ranks through comm: reduce_scatter(comm, padded "
                           "gradient); every simulated rank is a thread of this one process, but under mpiexec each "
                           "rank is a process of its own, and a gradient left in memory they share is not there"),
    "state": "pass states[i] to update for unit i: every unit keeps its own AdamW moments, a shard's worth",
}


class Unit:
    """One unit of the puzzle's model: a Linear layer (``inp`` -> ``out`` features), followed by
    tanh unless ``last``, its weight (out, inp) and bias (out,) laid end to end in one flat vector
    of :attr:`numel` numbers. :meth:`forward` and :meth:`backward` keep no reference to the whole
    vector (only weak ones, to measure what you keep alive; see the module docstring)."""

    def __init__(self, inp: int, out: int, last: bool, tracker=None):
        self.inp, self.out, self.last, self.numel = inp, out, last, out * inp + out
        self._tracker = tracker

    def _split(self, flat):
        flat = np.asarray(flat, dtype=np.float64)
        if flat.shape != (self.numel,):
            raise ValueError(f"this unit takes its whole vector of {self.numel} numbers, got shape {flat.shape}")
        if self._tracker is not None:
            self._tracker.saw(flat)
        return flat[: self.out * self.inp].reshape(self.out, self.inp), flat[self.out * self.inp:]

    def forward(self, flat, h):
        """(output, saved): h (B, inp) -> (B, out); ``saved`` is what :meth:`backward` needs."""
        weight, bias = self._split(flat)
        z = np.asarray(h) @ weight.T + bias
        out = z if self.last else np.tanh(z)
        return out, (np.asarray(h), out)

    def backward(self, flat, saved, grad):
        """(gradient of the input, gradient of the flat vector) for the output's gradient ``grad``."""
        weight, _ = self._split(flat)
        h, out = saved
        gz = np.asarray(grad) if self.last else np.asarray(grad) * (1 - out * out)
        return gz @ weight, np.concatenate([(gz.T @ h).reshape(-1), gz.sum(axis=0)])


class Model:
    """The puzzle's model: :attr:`units`, Linear layers of :data:`WIDTHS`."""

    def __init__(self, tracker=None):
        self.units = [Unit(i, o, k == len(WIDTHS) - 2, tracker) for k, (i, o) in enumerate(zip(WIDTHS, WIDTHS[1:]))]


class Tracker:
    """Weak references to the whole vectors you gather (the arrays the ring all-gather receives
    into) and to those passed to the units (and the arrays they are views of): :attr:`peak` the
    most bytes of them alive at once whenever a unit ran, since :meth:`reset`."""

    def __init__(self):
        self.refs, self.peak = [], 0

    def register(self, array):
        """Track ``array`` and the array that owns its memory."""
        owner = _owner(array)
        for one in {id(array): array, id(owner): owner}.values():
            if not any(ref() is one for ref in self.refs):
                self.refs.append(weakref.ref(one))

    def saw(self, flat):
        """A unit runs on ``flat``: track it, and count what is alive now."""
        self.register(flat)
        self.refs = [ref for ref in self.refs if ref() is not None]
        owners = {id(o): o for o in (_owner(ref()) for ref in self.refs) if o is not None}
        self.peak = max(self.peak, sum(o.nbytes for o in owners.values()))

    def reset(self):
        self.peak = 0


def _owner(array):
    while isinstance(getattr(array, "base", None), np.ndarray):
        array = array.base
    return array


class WatchedComm:
    """The communicator your step gets: ``counted`` (a CountingComm), every array an all-gather
    receives into tracked by ``tracker``."""

    def __init__(self, counted, tracker):
        self._counted, self._tracker = counted, tracker

    def __getattr__(self, name):
        return getattr(self._counted, name)

    def _watch(self, buf, args, kwargs):
        tag = kwargs.get("tag", args[1] if len(args) > 1 else None)
        array = buf[0] if isinstance(buf, (list, tuple)) else buf
        if tag == collectives.TAGS["all_gather"] and isinstance(array, np.ndarray):
            self._tracker.register(array)

    def Irecv(self, buf, *args, **kwargs):
        self._watch(buf, args, kwargs)
        return self._counted.Irecv(buf, *args, **kwargs)

    def Recv(self, buf, *args, **kwargs):
        self._watch(buf, args, kwargs)
        return self._counted.Recv(buf, *args, **kwargs)


def shard_sizes(p: int) -> list[int]:
    """s_i = ceil(numel_i / P) for each unit."""
    return [math.ceil(n / p) for n in SIZES]


def budget(p: int) -> int:
    """Bytes: the most whole parameters alive at once, the largest unit's padded vector (float64)."""
    return 8 * p * max(shard_sizes(p))


def _weights(salt) -> list[np.ndarray]:
    return [np.random.default_rng([salt, 1, k]).standard_normal(n) * 0.5 for k, n in enumerate(SIZES)]


def _batch(rank: int, step: int, salt) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([salt, 2, step, rank])
    return rng.standard_normal((BATCH, WIDTHS[0])), rng.standard_normal((BATCH, WIDTHS[-1]))


def _forward_backward(model, whole, x, dy):
    h, saved = x, []
    for u, w in zip(model.units, whole):
        h, s = u.forward(w, h)
        saved.append(s)
    y, grads, g = h, [None] * len(whole), dy
    for k in reversed(range(len(whole))):
        g, grads[k] = model.units[k].backward(whole[k], saved[k], g)
    return y, grads


def reference(p: int, salt) -> list[tuple[list[np.ndarray], list[np.ndarray]]]:
    """One process, per step: (the output on each rank's batch, the whole vectors after AdamW on
    the ranks' mean gradient)."""
    model, whole, states, out = Model(), _weights(salt), [{} for _ in SIZES], []
    for step in range(STEPS):
        ys, grads = [], [np.zeros(n) for n in SIZES]
        for r in range(p):
            y, g = _forward_backward(model, whole, *_batch(r, step, salt))
            ys.append(y)
            grads = [a + b / p for a, b in zip(grads, g)]
        whole = [adamw_update(w, g, s) for w, g, s in zip(whole, grads, states)]
        out.append((ys, whole))
    return out


def _padded_shard(vector, p, rank):
    s = math.ceil(vector.size / p)
    return np.concatenate([vector, np.zeros(p * s - vector.size)])[rank * s:(rank + 1) * s]


def _step_rank(comm, full_shard_step, salt):
    p, rank = comm.Get_size(), comm.Get_rank()
    # long: three steps, each checked in the order a mistake shows: output, memory, updates, shards, bytes
    sizes, expected = shard_sizes(p), reference(p, salt)
    tracker = Tracker()
    model = Model(tracker)
    shards = [_padded_shard(w, p, rank) for w in _weights(salt)]
    states = [{} for _ in SIZES]
    counted = CountingComm(comm, allow_collectives=True)
    formula = 3 * (p - 1) * sum(sizes)
    for step in range(STEPS):
        what = (f"full_shard_step on {p} rank{'s' * (p > 1)}, step {step + 1} of {STEPS} (units of "
                f"{', '.join(map(str, SIZES))} numbers, shards of {', '.join(map(str, sizes))})")
        calls = []

        def update(w_shard, g_shard, state, what=what, calls=calls):
            k = next((i for i, s in enumerate(states) if s is state), None)
            if k is None:
                fail(what, "update got a state that is none of states[i]", HINTS["state"])
            calls.append(k)
            if np.shape(w_shard) != (sizes[k],) or np.shape(g_shard) != (sizes[k],):
                fail(what, f"update for unit {k} got shards of shapes {np.shape(w_shard)} and {np.shape(g_shard)}, "
                           f"expected ({sizes[k]},)",
                     HINTS["whole"] if {SIZES[k], p * sizes[k]} & {*np.shape(w_shard), *np.shape(g_shard)}
                     else HINTS["grad_padding"])
            return adamw_update(np.asarray(w_shard, dtype=np.float64), np.asarray(g_shard, dtype=np.float64), state)

        x, dy = _batch(rank, step, salt)
        tracker.reset()
        before = counted.elements
        y = call_learner(what, full_shard_step, WatchedComm(counted, tracker), model, shards, x, dy, update, states,
                         name="your full_shard_step", hint=HINTS["padding"])
        sent = counted.elements - before
        want_y, want_whole = expected[step][0][rank], expected[step][1]
        problem = None
        if not isinstance(y, np.ndarray) or y.shape != want_y.shape:
            problem = what, f"expected the output of shape {want_y.shape}, got {getattr(y, 'shape', type(y))}", \
                HINTS["values"]
        elif not np.allclose(y, want_y, rtol=0, atol=ATOL):
            problem = what, "the output differs from one process's", HINTS["values"]
        elif tracker.peak > budget(p):
            everything = tracker.peak >= 8 * p * sum(sizes)
            problem = (what, f"{tracker.peak:,} bytes of whole parameters were alive at once, over the budget of "
                             f"{budget(p):,} (the largest unit's {p} x {max(sizes)} numbers)",
                       HINTS["budget_all" if everything else "budget"])
        elif sorted(calls) != list(range(len(SIZES))):
            problem = what, f"update was called for units {sorted(calls)}, expected each once", HINTS["state"]
        fail_together(comm, problem)
        mine = [np.asarray(s, dtype=np.float64).reshape(-1) for s in shards]
        gathered = [all_gather(comm, m).reshape(-1)[:n] if m.shape == (s,) else None
                    for m, s, n in zip(mine, sizes, SIZES)]
        if any(g is None for g in gathered):
            problem = what, "shards[i] is no longer a shard of s_i numbers", HINTS["whole"]
        elif not all(np.allclose(g, w, rtol=0, atol=ATOL) for g, w in zip(gathered, want_whole)):
            summed = p > 1 and _summed_matches(gathered, p, salt, step)
            problem = what, "after the step the shards, gathered, differ from one process's AdamW step", \
                HINTS["sum" if summed else "values"]
        elif sent != formula:
            problem = (what, f"sent {sent} values, expected 3 (P-1) Σ s_i = {formula}",
                       HINTS["silent" if sent == 0 else "bytes_short" if sent < formula else "bytes_more"])
        fail_together(comm, problem)
    return (f"p={p}: {STEPS} AdamW steps equal one process, at most {tracker.peak:,} of {budget(p):,} bytes of whole "
            f"parameters alive, {formula} values sent per step (3 (P-1) Σ s_i)")


def _summed_matches(gathered, p, salt, step) -> bool:
    """Whether the shards after ``step`` match one process stepping on the ranks' *summed* gradient."""
    model, whole, states = Model(), _weights(salt), [{} for _ in SIZES]
    for k in range(step + 1):
        grads = [np.zeros(n) for n in SIZES]
        for r in range(p):
            grads = [a + b for a, b in zip(grads, _forward_backward(model, whole, *_batch(r, k, salt))[1])]
        whole = [adamw_update(w, g, s) for w, g, s in zip(whole, grads, states)]
    return all(np.allclose(g, w, rtol=0, atol=1e-10) for g, w in zip(gathered, whole))


def _still_right(comm, full_shard_step, salt) -> bool:
    p, rank = comm.Get_size(), comm.Get_rank()
    shards = [_padded_shard(w, p, rank) for w in _weights(salt)]
    y = full_shard_step(CountingComm(comm, allow_collectives=True), Model(), shards, *_batch(rank, 0, salt),
                        adamw_update, [{} for _ in SIZES])
    return any_right(y, reference(p, salt)[0][0][rank], ATOL)


def _update_still_right(comm, full_shard_step, salt) -> bool:
    """The first step again, every message but the all-gathers' spoiled in transit (the
    gradients' reduce-scatter): is any value of this rank's shards after it still one process's?
    Then its gradient did not come through the communicator."""
    p, rank = comm.Get_size(), comm.Get_rank()
    shards = [_padded_shard(w, p, rank) for w in _weights(salt)]
    full_shard_step(CountingComm(comm, allow_collectives=True), Model(), shards, *_batch(rank, 0, salt),
                    adamw_update, [{} for _ in SIZES])
    want = reference(p, salt)[0][1]
    return any(any_right(np.asarray(s, dtype=np.float64).reshape(-1), _padded_shard(w, p, rank), ATOL)
               for s, w in zip(shards, want))


def _not_gathers(array, tag) -> bool:
    return tag != collectives.TAGS["all_gather"]


_ENGINE = (zero_optimizer.ZeroRedundancyOptimizer.__init__, zero_optimizer.ZeroRedundancyOptimizer.step,
           fsdp.FullyShardedDataParallel.__init__, unit.FlatUnit.gather, unit.FlatUnit.reduce)


@forbidding(*_ENGINE)
@unchanged(sys.modules[__name__], collectives, sim, np)
def check_full_shard_step(full_shard_step) -> str:
    """Check your ``full_shard_step(comm, model, shards, x, dy, update, states)`` (module docstring)."""
    check_own_code(full_shard_step, "full_shard_step")
    lines, salt = ["full_shard_step: ok"], secrets.randbits(64)
    for p in WORLD_SIZES:
        try:
            verdicts = sim.World(p, timeout=60).run(_step_rank, full_shard_step, salt)
        except (sim.DeadlockError, sim.SimTimeoutError) as error:
            fail(f"full_shard_step on {p} simulated ranks", str(error), DEADLOCK_HINT)
        check_received(f"full_shard_step on {p} simulated ranks, step 1", p, _still_right, full_shard_step, salt)
        check_received(f"full_shard_step on {p} simulated ranks, step 1's gradients", p, _update_still_right,
                       full_shard_step, salt, which=_not_gathers, hint=HINTS["gradients_received"])
        lines.append(verdicts[0])
    return "\n".join(lines)


__all__ = ["BATCH", "HINTS", "SIZES", "STEPS", "WIDTHS", "Model", "Unit", "budget", "check_full_shard_step",
           "reference", "shard_sizes"]
