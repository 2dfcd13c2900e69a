"""The checks of exercise 21: DiLoCo's outer step over the replicas that are there, and the
state a healthy peer hands a joiner (chapter 21), on four simulated replicas.

Your ``outer_step(comm, members, theta, momentum, local, lr, mu, nesterov) -> (theta, momentum)``
runs on every rank in ``members`` (sorted world ranks of ``comm``, the quorum of this sync point;
the others may be dead and must not be waited for). ``theta`` is the global weights, ``momentum``
the outer momentum buffer, ``local`` this replica's weights after its H inner steps, all float64
``(n,)``. It returns the new global weights and momentum (Douillard et al. 2023, Algorithm 1;
PyTorch's SGD with momentum):

    Delta    = mean over the members of (theta - local_i)     the pseudo-gradient
    momentum = mu momentum + Delta
    theta    = theta - lr (Delta + mu momentum)   (nesterov)   or   theta - lr momentum

Your ``heal(comm, donor, receivers, theta, momentum) -> (theta, momentum)`` runs on the donor and
on each receiver (a joiner: it passes a fresh model's weights and zeros, of the right shapes): the
donor sends its state, every receiver returns the donor's state bit for bit, the donor its own.

:func:`check_outer_step` calls ``outer_step`` on 3 of 3 and on 3 of 4 simulated ranks (rank 2
absent) against the formula in float64 (1e-12), and asks that every member returns the same bytes.
:func:`check_heal` runs ``heal`` with a donor and two receivers (one rank not involved) and reads
on the simulator's trace that the state went by messages. :func:`check_churn` runs the puzzle:
four replicas of a float64 MLP with AdamW inside (H = 3, 12 inner steps, outer Nesterov lr 0.7,
mu 0.9), one replica lost before an inner step and started again as a joiner (quorum and join by
the engine's ``ReplicaSet``, the outer step and the hand-over yours); the global weights and
momentum at the end must equal the same run written sequentially (:func:`reference`) to 1e-10,
and all four replicas' states must be bit-identical after every sync each took part in.

A wrong answer in one of the usual ways fails with its own hint: the pseudo-gradient's sign
reversed, the mean over the world instead of the members, an all-reduce over the world that waits
for the lost replica, Nesterov as plain momentum, the momentum not updated, a sum whose order
differs between replicas, a joiner not given the momentum. The
engine's ``DiLoCo.sync`` / ``load_state_arrays`` and ``ReplicaSet.send_state`` / ``receive_state``
raise while your code runs. Use::

    from minidist.course.checks import across_datacenters as dc_checks
    print(dc_checks.check_outer_step(outer_step))
    print(dc_checks.check_heal(heal))
    print(dc_checks.check_churn(outer_step, heal))
"""
from __future__ import annotations

import hashlib
import sys

import numpy as np

from minidist import nn, optim, sim
from minidist.course.checks import LearnerError, SynchronousSends, call_learner, check_own_code, fail, forbidding
from minidist.course.checks.integrity import unchanged
from minidist.functions import cross_entropy
from minidist.parallel.local_sgd import DiLoCo, ReplicaSet, flatten, unflatten
from minidist.tensor import Tensor

SIZES = [6, 8, 8, 3]  # the MLP of check_churn: 147 parameters
H, STEPS, M = 3, 12, 4  # sync every 3 inner steps, 12 steps, 4 replicas
OUTER = (0.7, 0.9, True)  # lr, mu, nesterov: DiLoCo's
SCENARIOS = ((2, 5), (1, 3))  # (the replica lost, the inner step it does not take); not the leader (rank 0)
TOL = 1e-12  # one outer step against the formula
RUN_TOL = 1e-10  # a whole run against the sequential one
ENGINE = (DiLoCo.sync, DiLoCo.load_state_arrays, ReplicaSet.send_state, ReplicaSet.receive_state)

HINTS = {
    "sign": "the pseudo-gradient is theta - local (where the replicas started minus where they got: uphill, like a "
            "gradient), so that theta - lr * Delta moves theta towards the replicas; yours has it reversed",
    "world": "average over the members of this sync point, len(members), not over comm.Get_size(): a replica that "
             "is lost adds nothing to the sum, so dividing by the world's size shrinks the step",
    "plain": "with nesterov the step is lr (Delta + mu momentum), the new momentum looked ahead once more; yours "
             "applied lr * momentum, plain momentum (PyTorch's SGD(nesterov=True))",
    "nesterov": "without nesterov the step is lr * momentum; yours added Delta + mu momentum (Nesterov's) anyway",
    "stale": "return the updated momentum, mu * momentum + Delta, not the one you were given",
    "order": "every member must add the same numbers in the same order, or the last bits differ and the replicas "
             "drift apart: reduce with one all-reduce that hands every member the same bytes (the ring: "
             "collectives.all_reduce(ReplicaGroup(comm, members), x, algorithm='ring')), or sum in rank order",
    "lost": "a replica that is not among the members is lost: it takes part in no collective, so reduce over the "
            "members only (ReplicaGroup(comm, members) is a communicator over them), never over comm itself",
    "momentum": "the joiner needs the outer momentum too, not only theta: send both, so that its next outer step "
                "is the others' (a joiner with zero momentum takes a different step and the replicas part)",
}


def _step_formula(theta, momentum, locals_, lr, mu, nesterov, *, sign=1.0, count=None, plain=None, stale=False):
    """The outer step by its formula (float64), or with one of the usual mistakes."""
    delta = sign * sum(theta - x for x in locals_) / (count or len(locals_))
    new = mu * momentum + delta
    nest = nesterov if plain is None else not plain
    theta = theta - lr * ((delta + mu * new) if nest else new)
    return theta, (momentum if stale else new)


def _as_state(result, n, what):
    if not (isinstance(result, tuple | list) and len(result) == 2):
        fail(what, f"returned {type(result).__name__}, not a pair (theta, momentum)",
             "return theta, momentum: two float64 arrays of shape (n,)")
    out = []
    for name, a in zip(("theta", "momentum"), result):
        a = np.asarray(a)
        if a.shape != (n,) or a.dtype != np.float64:
            fail(what, f"{name} has shape {a.shape} and dtype {a.dtype}, not ({n},) float64",
                 "keep the arrays flat and in float64, as you were given them")
        out.append(a.copy())
    return tuple(out)


def _one_step(comm, outer_step, members, theta, momentum, locals_, hyper):
    if comm.Get_rank() not in members:
        return None  # a lost replica: it takes no part
    result = call_learner("outer_step", outer_step, SynchronousSends(comm), list(members), theta.copy(),
                          momentum.copy(), locals_[comm.Get_rank()].copy(), *hyper)
    return _as_state(result, theta.size, "outer_step")


def _diagnose(got, theta, momentum, locals_, hyper, world):
    lr, mu, nesterov = hyper
    wrong = {"sign": dict(sign=-1.0), "world": dict(count=world), "plain": dict(plain=True),
             "nesterov": dict(plain=False), "stale": dict(stale=True)}
    for name, mistake in wrong.items():
        if name == "plain" and not nesterov or name == "nesterov" and nesterov:
            continue
        want = _step_formula(theta, momentum, locals_, lr, mu, nesterov, **mistake)
        if all(np.allclose(g, w, rtol=0, atol=1e-9) for g, w in zip(got, want)):
            return HINTS[name]
    return "compute Delta, then the momentum, then theta, as in the formula above, with numbers you can check by hand"


@forbidding(*ENGINE)
@unchanged(sys.modules[__name__], np)
def check_outer_step(outer_step) -> str:
    """``outer_step`` on 3 of 3 and 3 of 4 simulated ranks, three settings of (lr, mu, nesterov),
    against :func:`_step_formula` (1e-12) and bit-identical across the members. Returns a verdict."""
    check_own_code(outer_step, "outer_step")
    rng = np.random.default_rng()  # drawn afresh: the answer cannot be remembered
    cases = [((0.7, 0.9, True), 3, (0, 1, 2)), ((0.5, 0.8, False), 3, (0, 1, 2)), ((1.0, 0.0, False), 4, (0, 1, 3)),
             ((0.7, 0.9, True), 4, (0, 1, 3))]
    for hyper, world, members in cases:
        n = 37
        theta, momentum = rng.standard_normal(n), rng.standard_normal(n)
        locals_ = {r: theta - 0.1 * rng.standard_normal(n) for r in range(world)}
        what = f"outer_step with members {list(members)} of {world} ranks, (lr, mu, nesterov) = {hyper}"
        try:
            results = sim.World(world).run(_one_step, outer_step, members, theta, momentum, locals_, hyper)
        except LearnerError as error:
            if "deadlock" in str(error) and len(members) < world:
                raise LearnerError(f"{error}\nHint: {HINTS['lost']}") from None
            raise
        mine = [locals_[r] for r in members]
        want = _step_formula(theta, momentum, mine, *hyper)
        for r in members:
            if not all(np.allclose(g, w, rtol=0, atol=TOL) for g, w in zip(results[r], want)):
                error = max(np.abs(g - w).max() for g, w in zip(results[r], want))
                fail(what, f"rank {r}'s (theta, momentum) is off the formula by up to {error:.3g}",
                     _diagnose(results[r], theta, momentum, mine, hyper, world))
        if any(not all(np.array_equal(a, b) for a, b in zip(results[r], results[members[0]])) for r in members):
            fail(what, "the members' results agree to rounding but not bit for bit", HINTS["order"])
    return "outer_step: the formula on 3 of 3 and on 3 of 4 replicas, the same bytes on every member (pass)"


def _heal_run(comm, heal, donor, receivers, state):
    rank = comm.Get_rank()
    if rank != donor and rank not in receivers:
        return None
    mine = state if rank == donor else (np.random.default_rng(rank).standard_normal(state[0].size),
                                        np.zeros(state[1].size))
    result = call_learner("heal", heal, SynchronousSends(comm), donor, list(receivers), mine[0].copy(),
                          mine[1].copy())
    return _as_state(result, state[0].size, f"heal on rank {rank}")


@forbidding(*ENGINE)
@unchanged(sys.modules[__name__], np)
def check_heal(heal) -> str:
    """``heal`` on 4 simulated ranks (donor 1, receivers 0 and 3, rank 2 not involved): every
    receiver ends with the donor's state bit for bit, sent as messages of at least its bytes."""
    check_own_code(heal, "heal")
    rng = np.random.default_rng()
    state = (rng.standard_normal(29), rng.standard_normal(29))
    world = sim.World(4)
    results = world.run(_heal_run, heal, 1, (0, 3), state)
    what = "heal (donor 1, receivers [0, 3])"
    if not all(np.array_equal(a, b) for a, b in zip(results[1], state)):
        fail(what, "the donor's own state changed", "the donor returns the theta and momentum it was given")
    for r in (0, 3):
        theta, momentum = results[r]
        if np.array_equal(theta, state[0]) and not np.array_equal(momentum, state[1]):
            fail(what, f"rank {r} got theta but not the momentum", HINTS["momentum"])
        if not (np.array_equal(theta, state[0]) and np.array_equal(momentum, state[1])):
            fail(what, f"rank {r}'s state is not the donor's", "send theta and the momentum from the donor to every "
                 "receiver; each receiver returns what it received")
        sent = sum(m.nbytes for m in world.trace if m.source == 1 and m.dest == r and m.kind == "array")
        if sent < state[0].nbytes + state[1].nbytes:
            fail(what, f"the donor sent rank {r} {sent} bytes, less than theta and the momentum "
                       f"({state[0].nbytes + state[1].nbytes})", "send the state as messages (comm.Send / comm.Recv)")
    return "heal: both receivers hold the donor's theta and momentum, sent by messages (pass)"


def _data(replica, step):
    rng = np.random.default_rng(1000 * replica + step)
    return rng.standard_normal((8, SIZES[0])), rng.integers(0, SIZES[-1], 8)


def _model(seed=0):
    model = nn.mlp(SIZES, rng=seed, dtype="float64")
    return model, optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _inner_step(model, optimizer, replica, step):
    x, y = _data(replica, step)
    optimizer.zero_grad()
    cross_entropy(model(Tensor(x)), y).backward()
    optimizer.step()


def _digest(theta, momentum):
    return hashlib.sha256(theta.tobytes() + momentum.tobytes()).hexdigest()


def _sync(comm, outer_step, heal, quorum, state, params):
    """One sync point on this rank: the members' outer step (yours), then the donor's hand-over
    (yours). ``state``: [theta, momentum, syncs]; changed in place."""
    rank = comm.Get_rank()
    if rank in quorum.members:
        result = call_learner("outer_step", outer_step, SynchronousSends(comm), list(quorum.members), state[0].copy(),
                              state[1].copy(), flatten(params), *OUTER)
        state[0], state[1] = _as_state(result, state[0].size, f"outer_step on rank {rank}")
        state[2] = quorum.step + 1
        unflatten(state[0], params)
    if rank == quorum.donor and quorum.receivers:
        call_learner("heal", heal, SynchronousSends(comm), quorum.donor, list(quorum.receivers), state[0].copy(),
                     state[1].copy())


def replica(comm, outer_step, heal, victim, at):
    """One replica of :func:`check_churn`'s run on the simulator. Returns its final theta, momentum
    and {syncs: digest of (theta, momentum)} after every sync it took part in or healed at, and the
    sync at which it healed (None when it was not lost)."""
    rank = comm.Get_rank()
    replicas = ReplicaSet(comm, timeout=60)
    fingerprint = {"exercise": 21, "sizes": repr(SIZES)}
    model, optimizer = _model()
    state = [flatten(model.parameters()), np.zeros(sum(p.data.size for p in model.parameters())), 0]
    hashes, t, healed = {}, 0, None
    while t < STEPS:
        if (rank, t + 1) == (victim, at):  # lost before step `at`; starts again as a fresh process
            victim = None
            model, optimizer = _model(seed=100 + rank)
            quorum = replicas.join(fingerprint)
            result = call_learner("heal", heal, SynchronousSends(comm), quorum.donor, list(quorum.receivers),
                                  flatten(model.parameters()), np.zeros(state[1].size))
            state = [*_as_state(result, state[1].size, f"heal on the joiner, rank {rank}"), quorum.step + 1]
            unflatten(state[0], model.parameters())
            t = state[2] * H
            hashes[state[2]] = _digest(state[0], state[1])
            healed = state[2]
            continue
        t += 1
        _inner_step(model, optimizer, rank, t)
        if t % H == 0:
            _sync(comm, outer_step, heal, replicas.quorum(state[2], fingerprint), state, model.parameters())
            hashes[state[2]] = _digest(state[0], state[1])
    return state[0], state[1], hashes, healed


def reference(victim, at):
    """The same run written sequentially in float64: replica ``victim`` takes no inner step from
    ``at`` to the next sync point s H (inclusive) and is not in that sync's mean; then it holds
    theta and a fresh AdamW, as the joiner does. Returns (theta, momentum)."""
    lr, mu, nesterov = OUTER
    runs = [_model() for _ in range(M)]
    theta = flatten(runs[0][0].parameters())
    momentum = np.zeros_like(theta)
    back = -(-at // H) * H  # the sync point at which the lost replica is healed
    for t in range(1, STEPS + 1):
        here = [r for r in range(M) if not (r == victim and at <= t <= back)]
        for r in here:
            _inner_step(*runs[r], r, t)
        if t % H:
            continue
        locals_ = [flatten(runs[r][0].parameters()) for r in here]
        theta, momentum = _step_formula(theta, momentum, locals_, lr, mu, nesterov)
        if t == back:
            runs[victim] = _model(seed=100 + victim)
        for model, _ in runs:
            unflatten(theta, model.parameters())
    return theta, momentum


def _check_identical(what, hashes, victim, healed):
    """Fail at the first sync after which two replicas' (theta, momentum) differ in a bit; the
    joiner's first sync (its hand-over) gets the momentum's hint, any other the order's."""
    for syncs in sorted(set().union(*hashes)):
        held = {r: h[syncs] for r, h in enumerate(hashes) if syncs in h}
        if len(set(held.values())) > 1:
            joining = victim in held and syncs == healed
            odd = victim if joining else next(r for r in held if held[r] != held[min(held)])
            fail(what, f"after sync {syncs} replica {odd}'s (theta, momentum) is not bit-identical to replica "
                       f"{min(r for r in held if r != odd)}'s", HINTS["momentum"] if joining else HINTS["order"])


@forbidding(*ENGINE)
@unchanged(sys.modules[__name__], np)
def check_churn(outer_step, heal) -> str:
    """The puzzle: :data:`SCENARIOS` on four simulated replicas with your outer step and hand-over,
    against :func:`reference` (1e-10) and bit-identical across the replicas after every sync."""
    check_own_code(outer_step, "outer_step")
    check_own_code(heal, "heal")
    for victim, at in SCENARIOS:
        results = sim.World(M, timeout=60).run(replica, outer_step, heal, victim, at)
        what = f"4 replicas, H = {H}, replica {victim} lost before inner step {at} and joining again"
        _check_identical(what, [hashes for _, _, hashes, _ in results], victim, results[victim][3])
        theta, momentum = reference(victim, at)
        for name, got, want in (("theta", results[0][0], theta), ("momentum", results[0][1], momentum)):
            error = np.abs(got - want).max()
            if error > RUN_TOL:
                fail(what, f"the final {name} is off the sequential run by {error:.3g}",
                     "run check_outer_step and check_heal first: each names the usual mistakes")
    return (f"4 replicas lost and rejoined ({len(SCENARIOS)} runs): the sequential run's theta and momentum, "
            f"bit-identical replicas after every sync (pass)")
