"""The checks of exercise 08: a pipeline schedule you wrote, checked by the schedule validator,
the simulator and the closed forms of 1F1B, never against a copy of your own code.

:func:`check_one_f_one_b_order` calls your ``one_f_one_b_order(rank, num_stages,
num_microbatches)`` for every rank of every (p, m) in :data:`GRID` (p = 1..6 stages, m = 1..12
micro-batches, m < p included) and checks, in this order, with a hint for each:

1. the list: Actions (or their strings, ``"0F1"``) of the rank's own stage, F and B only,
   every micro-batch's forward and backward exactly once;
2. :func:`minidist.parallel.pipeline.schedules.validate`: no backward before its forward, no
   order that deadlocks when the ranks run their lists and wait for each other's messages;
3. :func:`~minidist.parallel.pipeline.schedules.simulate` at t_f = 1, t_b = 2: the makespan is
   (m + p - 1)(t_f + t_b) (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN
   Training", ICML 2021: 1F1B keeps GPipe's bubble), so the pipeline fills as it should;
4. the simulator's ``peak_in_flight``: rank r never holds more than min(m, p - r) micro-batches'
   activations (GPipe's order, same makespan, holds all m and fails here);
5. the order is the one torch's ``Schedule1F1B`` runs (the engine's ``one_f_one_b``, which
   ``tests/test_pipeline_schedules.py`` checks against fixtures recorded from torch 2.13).

Each failure raises ``AssertionError("what: problem\\nHint: ...")``; when your function
itself raises (a stub, an IndexError), :class:`minidist.course.checks.LearnerError` with your
line. Your function must be your own: the engine's ``one_f_one_b`` (or its per-rank
``one_f_one_b_order``, or PipeDream's order) as the answer, or called by it, fails. On success
it returns a one-line verdict::

    from minidist.course.checks import schedules as schedule_checks
    print(schedule_checks.check_one_f_one_b_order(one_f_one_b_order))
"""
from __future__ import annotations

from minidist.course.checks import call_learner, check_own_code, fail, forbidding
from minidist.parallel.pipeline import schedules as S
from minidist.parallel.pipeline.pipedream import pipedream_1f1b

# (num_stages, num_microbatches), smallest first so that the first failure is the simplest case.
GRID = tuple(sorted(((p, m) for p in (1, 2, 3, 4, 6) for m in (1, 2, 3, 4, 5, 8, 12)),
                   key=lambda pm: (pm[0] * pm[1], pm)))
T_FORWARD, T_BACKWARD = 1.0, 2.0

WARMUP_HINT = ("rank r runs w = min(m, p - r) warm-up forwards F0 ... F(w-1) before its first backward: the "
               "last stage starts backwards at once, the first waits until p micro-batches are in the pipeline")
STEADY_HINT = ("after the warm-up, alternate: one backward, then one forward (B0 Fw B1 F(w+1) ...), then the w "
               "backwards left (cool-down); a backward frees a micro-batch's activations, a forward adds one")

ORDER_HINT = ("take the micro-batches in order 0, 1, 2, ...: forwards in that order, and backwards too, as the "
              "gradients come back from the next rank; " + STEADY_HINT)


def _as_actions(what: str, result, rank: int) -> list[S.Action]:
    """The learner's return value as a list of Actions, or a failure saying what is wrong with it."""
    if result is None:
        fail(what, "returned None", "return the list of this rank's Actions")
    if isinstance(result, (str, bytes)) or not isinstance(result, (list, tuple)):
        fail(what, f"expected a list of Actions, got {type(result).__name__} {result!r:.80}",
             f"return a list such as [Action({rank}, 'F', 0), Action({rank}, 'B', 0)]")
    actions = []
    for i, item in enumerate(result):
        if isinstance(item, S.Action):
            actions.append(item)
            continue
        try:
            actions.append(S.Action.from_str(item))
        except ValueError:
            fail(what, f"item {i} is {item!r}, not an Action",
                 f"build each item with Action(stage, kind, microbatch), e.g. Action({rank}, 'F', 0)")
    return actions


def _check_own_actions(what: str, actions: list[S.Action], rank: int, m: int) -> None:
    """Rank ``rank``'s stage only, F and B only, each micro-batch's F and B exactly once."""
    for i, a in enumerate(actions):
        if a.stage != rank:
            fail(what, f"position {i} is {a}, an action of stage {a.stage}",
                 f"with one stage per rank, rank {rank} runs only stage {rank}: Action({rank}, ...)")
        if a.kind not in ("F", "B"):
            fail(what, f"position {i} is {a}: 1F1B runs whole backwards",
                 "use kinds 'F' and 'B' only; the split backward ('I' and 'W') is zero-bubble's")
    for kind in ("F", "B"):
        got = sorted(a.microbatch for a in actions if a.kind == kind)
        if got != list(range(m)):
            name = "forward" if kind == "F" else "backward"
            extra = sorted({k for k in got if got.count(k) > 1 or k >= m})
            missing = sorted(set(range(m)) - set(got))
            problem = (f"missing {name}s of micro-batches {missing}" if missing
                       else f"{name}s {extra} repeated or out of range")
            fail(what, f"{problem} ({len(actions)} actions: {' '.join(map(str, actions))})",
                 f"every micro-batch k in 0..{m - 1} needs exactly one forward and one backward on every rank")


def warmup_count(actions) -> int:
    """A rank's warm-up: the forwards in ``actions`` before its first backward (all of them when
    there is none)."""
    return next((i for i, a in enumerate(actions) if a.kind == "B"), len(actions))


def _warmup_hint(actions, r: int, p: int, m: int) -> str:
    """A hint naming rank ``r``'s warm-up count when it is not min(m, p - r), else ""."""
    warmup, right = warmup_count(actions), min(m, p - r)
    if warmup == right:
        return ""
    effect = ("each forward past min(m, p - r) holds one more micro-batch's activations until its backward comes"
              if warmup > right else "the next rank is left waiting for work: the pipeline fills too slowly")
    return (f"rank {r}'s warm-up is {warmup} forward{'s' * (warmup != 1)} before its first backward; 1F1B's is "
            f"min(m, p - r) = {right}: {effect}; " + WARMUP_HINT)


def _makespan_hint(schedule, m: int) -> str:
    """Too slow: name the first rank whose warm-up is not min(m, p - r), else the order."""
    p = len(schedule)
    for r, actions in enumerate(schedule):
        hint = _warmup_hint(actions, r, p, m)
        if hint:
            return hint
    return ORDER_HINT


def _deadlock_hint(message: str) -> str:
    if "deadlock" in message:
        return ("a rank waits for a backward's gradient that the next rank can only send after a forward this rank "
                "has not run yet; " + WARMUP_HINT)
    if "comes before" in message:
        return "a backward needs its own micro-batch's forward, on the same rank, earlier in the list"
    return WARMUP_HINT


@forbidding(S.one_f_one_b, S.one_f_one_b_order, S.interleaved_1f1b, pipedream_1f1b)
def check_one_f_one_b_order(fn) -> str:
    """Check ``fn(rank, num_stages, num_microbatches) -> list of Action`` (the exercise's
    ``one_f_one_b_order``) on every (p, m) of :data:`GRID`, as the module docstring lists:
    valid, makespan (m + p - 1)(t_f + t_b), peak in flight min(m, p - r), torch's order.

    Returns a one-line verdict. Raises AssertionError naming the (p, m), the rank and what
    differs, with a hint; :class:`~minidist.course.checks.LearnerError` when ``fn`` raises.
    """
    check_own_code(fn, "one_f_one_b_order")
    for p, m in GRID:
        case = f"one_f_one_b_order for p = {p} stage{'s' * (p > 1)}, m = {m} micro-batch{'es' * (m > 1)}"
        schedule = []
        for r in range(p):
            what = f"one_f_one_b_order(rank={r}, num_stages={p}, num_microbatches={m})"
            actions = _as_actions(what, call_learner(what, fn, r, p, m, name="your one_f_one_b_order"), r)
            _check_own_actions(what, actions, r, m)
            schedule.append(actions)
        try:
            S.validate(schedule)
        except S.ScheduleError as error:
            fail(case, f"the ranks' lists cannot run together: {error}", _deadlock_hint(str(error)))
        result = S.simulate(schedule, t_forward=T_FORWARD, t_backward=T_BACKWARD)
        expected = (m + p - 1) * (T_FORWARD + T_BACKWARD)
        if result.makespan != expected:
            fail(case, f"the simulator's makespan at t_f = {T_FORWARD:g}, t_b = {T_BACKWARD:g} is "
                       f"{result.makespan:g}, 1F1B's is (m + p - 1)(t_f + t_b) = {expected:g}: the pipeline idles "
                       f"longer than it must", _makespan_hint(schedule, m))
        peaks = [min(m, p - r) for r in range(p)]
        for r in range(p):
            if result.peak_in_flight[r] != peaks[r]:
                fail(case, f"rank {r} holds up to {result.peak_in_flight[r]} micro-batches' activations at once "
                           f"(forward run, backward not yet); 1F1B holds min(m, p - r) = {peaks[r]}",
                     (_warmup_hint(schedule[r], r, p, m) or STEADY_HINT)
                     + (" (running every forward first is GPipe's order: same makespan, all m held)"
                        if result.peak_in_flight[r] == m else ""))
        for r, (mine, torch_order) in enumerate(zip(schedule, S.one_f_one_b(p, m))):
            if mine != torch_order:
                i = next(i for i, (a, b) in enumerate(zip(mine, torch_order)) if a != b)
                fail(case, f"rank {r} position {i}: {mine[i]}, where torch's Schedule1F1B runs {torch_order[i]} "
                           f"(yours: {' '.join(map(str, mine))})", ORDER_HINT)
    stages = sorted({p for p, _ in GRID})
    counts = sorted({m for _, m in GRID})
    return (f"1F1B order: ok ({len(GRID)} pipelines, p = {stages[0]}..{stages[-1]} stages, m = {counts[0]}.."
            f"{counts[-1]} micro-batches, m < p included: valid, makespan (m + p - 1)(t_f + t_b), "
            f"peak in flight min(m, p - r), torch's order)")
