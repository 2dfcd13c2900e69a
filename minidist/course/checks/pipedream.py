"""The checks of exercise 09: a weight stash you wrote, checked by version tags and by
gradients, never against a copy of your own code.

Your stash is a class ``Stash()`` with three methods, used by one pipeline stage:

- ``save(microbatch, version, weights)`` at the forward of ``microbatch``: keep the stage's
  weights as they are now (``weights``: the list of its parameter arrays, which the optimizer
  will go on updating in place) under their ``version`` number;
- ``load(microbatch) -> (version, weights)`` at its backward: give back what was saved for it
  and forget it;
- ``len(stash)``: how many versions it holds.

:func:`check_stash` checks, in this order, with a hint for each:

1. **tags**: a stage whose weights hold their own version number (every entry of version v
   is v) runs PipeDream's order (1F1B, no flush; an update after each backward) for every
   stage s of p = 1..4 stages and 8 micro-batches; each ``load`` must return the version
   its forward saved, with the weights of that version (all entries equal to it), and the
   stash must hold at most p - s versions, and that many in the steady state;
2. **gradients**: a 4-stage float64 MLP trained on 12 micro-batches by PipeDream in one
   process (:func:`play_pipedream`: the stages' actions in the simulator's order, your stash
   on every stage, the saved weights copied in for each backward) must end with the weights
   of :func:`replay`, a plain loop that runs micro-batch j on each stage's version the
   schedule implies and applies W(k+1) = W(k) - lr g (Narayanan et al., "PipeDream", SOSP
   2019, sec. 3.3), within 1e-12; without a stash the weights drift by about 2e-3.

Each failure raises ``AssertionError("what: problem\\nHint: ...")``; when your code itself
raises, :class:`minidist.course.checks.LearnerError` with your line. On success it returns a
one-line verdict::

    from minidist.course.checks import pipedream as pipedream_checks
    print(pipedream_checks.check_stash(Stash))
"""
from __future__ import annotations

import numpy as np

from minidist import nn, optim
from minidist.course.checks import call_learner, check_own_code, fail
from minidist.functions import cross_entropy
from minidist.parallel.pipeline import pipedream as PD
from minidist.parallel.pipeline import schedules as S
from minidist.tensor import Tensor

SIZES = (6, 9, 8, 7, 5)  # 4 Linear layers: one per stage
LR = 0.2
ROWS = 3

COPY_HINT = ("save copies (w.copy()): the optimizer updates the stage's arrays in place, so a saved reference "
             "shows the latest weights by the time the backward runs")
QUEUE_HINT = ("keep one entry per micro-batch in flight, oldest first (a collections.deque), and give back the "
              "entry of the micro-batch asked for; 1F1B runs the backwards in the order of the forwards")


def _versions_of(order: list[S.Action]) -> dict[int, int]:
    """micro-batch -> the stage's version at its forward: the backwards (updates) before it."""
    versions, backwards = {}, 0
    for action in order:
        if action.kind == "B":
            backwards += 1
        else:
            versions[action.microbatch] = backwards
    return versions


def _check_tags(make_stash) -> None:
    for p in range(1, 5):
        for s in range(p):
            n = 8
            order = PD.pipedream_1f1b(p, n)[s]
            expected = _versions_of(order)
            stash = call_learner("Stash()", make_stash)
            live, version, held = [np.zeros(3), np.zeros((2, 2))], 0, []
            for action in order:
                i = action.microbatch
                where = f"stage {s} of {p}, micro-batch {i}"
                if action.kind == "F":
                    call_learner(f"save({i}, {version}, weights) on {where}", stash.save, i, version, live)
                    held.append(call_learner(f"len(stash) on {where}", len, stash))
                    continue
                got = call_learner(f"load({i}) on {where}", stash.load, i)
                if not (isinstance(got, tuple) and len(got) == 2):
                    fail(f"load({i}) on {where}", f"returned {got!r:.80}", "return the pair (version, weights)")
                saved_version, weights = got
                if saved_version != expected[i]:
                    fail(f"load({i}) on {where}", f"gave version {saved_version!r}, but micro-batch {i}'s forward "
                         f"saved version {expected[i]}", QUEUE_HINT)
                tags = sorted({float(v) for w in weights for v in np.asarray(w).ravel()})
                if tags != [float(expected[i])]:
                    fail(f"load({i}) on {where}", f"the weights hold {tags}, not version {expected[i]}'s entries "
                         f"(each entry of version v is v)", COPY_HINT)
                for w in live:  # the update after the backward: the next version, in place
                    w += 1.0
                version += 1
            if held and max(held) != p - s:
                fail(f"len(stash) on stage {s} of {p}", f"the stash held at most {max(held)} versions; stage s of a "
                     f"p-stage PipeDream pipeline has p - s = {p - s} micro-batches in flight, one version each",
                     "count the entries you hold; load must forget the entry it gives back")


# ----------------------------------------------------------------------------- one process
def make_stages(p: int = 4):
    """The float64 MLP of the gradient check, cut into p stages (nn.Sequential each)."""
    layers = []
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
        layers.append(nn.Linear(a, b, rng=50 + i, dtype="float64"))
        if i < len(SIZES) - 2:
            layers.append(nn.Tanh())
    model = nn.Sequential(*layers)
    bounds = np.array_split(np.arange(len(SIZES) - 1), p)
    return [model[2 * int(b[0]):min(2 * int(b[-1]) + 2, len(model))] for b in bounds]


def data(n: int, seed: int = 0):
    """n micro-batches of ROWS rows: (xs, ys)."""
    rng = np.random.default_rng(seed)
    x, y = rng.normal(size=(ROWS * n, SIZES[0])), rng.integers(0, SIZES[-1], size=ROWS * n)
    return np.array_split(x, n), np.array_split(y, n)


def play_pipedream(make_stash, p: int = 4, n: int = 12, lr: float = LR):
    """PipeDream in one process: every stage's actions of ``pipedream_1f1b(p, n)`` in the order
    the simulator plays them (t_f = 1, t_b = 2), SGD after each backward. With ``make_stash``
    (None: no stashing) each stage saves its weights at F and copies them in for B (the latest
    back afterwards). Returns (final weights per stage, log of (action, version used))."""
    stages = make_stages(p)
    params = [list(st.parameters()) for st in stages]
    opts = [optim.SGD(ps, lr=lr) for ps in params]
    stashes = [call_learner("Stash()", make_stash) if make_stash else None for _ in range(p)]
    xs, ys = data(n)
    schedule = PD.pipedream_1f1b(p, n)
    played = S.simulate(schedule, 1.0, 2.0)
    order = sorted((a for row in schedule for a in row), key=lambda a: (played.start[a], a.stage))
    version = [0] * p
    inputs, outputs, log = {}, {}, []
    for a in order:
        s, i = a.stage, a.microbatch
        if a.kind == "F":
            inp = Tensor(xs[i] if s == 0 else outputs[s - 1, i].data, requires_grad=s > 0)
            out = stages[s](inp)
            if s == p - 1:
                out = cross_entropy(out, ys[i])
            inputs[s, i], outputs[s, i] = inp, out
            if stashes[s] is not None:
                call_learner(f"save({i}, {version[s]}, weights)", stashes[s].save, i, version[s],
                             [q.data for q in params[s]])
            log.append((a, version[s]))
            continue
        used, latest = version[s], None
        if stashes[s] is not None:
            used, saved = call_learner(f"load({i})", stashes[s].load, i)
            latest = [q.data.copy() for q in params[s]]
            for q, w in zip(params[s], saved):
                q.data[...] = w
        out = outputs.pop((s, i))
        out.backward(None if s == p - 1 else inputs.pop((s + 1, i)).grad)
        if latest is not None:
            for q, w in zip(params[s], latest):
                q.data[...] = w
        log.append((a, used))
        opts[s].step()
        opts[s].zero_grad()
        version[s] += 1
    return [[q.data.copy() for q in ps] for ps in params], log


def replay(p: int = 4, n: int = 12, lr: float = LR, backward_on_latest: bool = False):
    """PipeDream's rule in a plain loop: micro-batch j runs forward and backward through the
    whole model with stage s on the version the schedule implies (the updates before its
    forward; ``backward_on_latest``: the backward on version j instead, as without stashing),
    then each stage applies W(j+1) = W(j) - lr g_j. Returns the final weights per stage."""
    stages = make_stages(p)
    params = [list(st.parameters()) for st in stages]
    versions = [_versions_of(row) for row in PD.pipedream_1f1b(p, n)]
    history = [[[q.data.copy() for q in ps]] for ps in params]
    xs, ys = data(n)

    def load(s, v):
        for q, w in zip(params[s], history[s][v]):
            q.data[...] = w

    for j in range(n):
        for s in range(p):
            load(s, versions[s][j])
            for q in params[s]:
                q.grad = None
        h = Tensor(xs[j])
        for st in stages:
            h = st(h)
        loss = cross_entropy(h, ys[j])
        for s in range(p) if backward_on_latest else ():
            load(s, j)
        loss.backward()
        for s in range(p):
            history[s].append([w - lr * q.grad for w, q in zip(history[s][-1], params[s])])
    return [h[-1] for h in history]


def max_difference(a, b) -> float:
    """Largest absolute difference between two lists (per stage) of lists of arrays."""
    return max(float(np.max(np.abs(x - y))) for sa, sb in zip(a, b) for x, y in zip(sa, sb))


def check_stash(make_stash) -> str:
    """Check your ``Stash`` class (module docstring): version tags on every stage of p = 1..4,
    then gradients against :func:`replay`. Returns a one-line verdict; raises
    AssertionError with a hint (LearnerError when your code raises)."""
    if not callable(make_stash):
        fail("Stash", f"expected a class, got {type(make_stash).__name__}", "pass the class itself: check_stash(Stash)")
    check_own_code(make_stash, "Stash", methods=("__init__", "save", "load", "__len__"))
    _check_tags(make_stash)
    got, _ = play_pipedream(make_stash)
    expected = replay()
    difference = max_difference(got, expected)
    if difference > 1e-12:
        fail("PipeDream with your stash, 4 stages, 12 micro-batches", f"the final weights differ from PipeDream's "
             f"rule by {difference:.2e} (allowed 1e-12)", "give back exactly the arrays saved for that micro-batch; "
             + COPY_HINT)
    return (f"OK: your stash gives every backward its forward's version (tags on p = 1..4, p - s versions held), and "
            f"PipeDream with it ends {difference:.1e} from PipeDream's rule (4 stages, 12 micro-batches)")
