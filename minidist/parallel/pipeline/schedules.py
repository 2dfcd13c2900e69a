"""Pipeline schedules as pure data: which stage runs which pass on which micro-batch, and when.

A model cut into S stages runs one mini-batch as m micro-batches. Every (stage s, micro-batch k)
needs a forward pass F, then a backward pass: either one whole B, or (zero-bubble schedules) B
split in two, I (the gradient with respect to the stage's input, which the previous stage is
waiting for) and W (the gradient with respect to the stage's weights, which nobody waits for).
A *schedule* says, for each rank, the order in which it runs its actions:

    schedule = [[0F0, 0F1, 0B0, 0B1],      # rank 0: stage 0
                [1F0, 1F1, 1B0, 1B1]]      # rank 1: stage 1        (GPipe, p = 2, m = 2)

``str(action)`` is torch.distributed.pipelining's form: stage, kind, micro-batch (``2F0``, ``1B3``).
The data dependencies between ranks are the messages of the pipeline:

    sF k  needs (s-1)F k      the activations of micro-batch k, sent forward
    sB k  needs (s+1)B k      the gradient of the loss with respect to stage s's output, sent back
    (sI k likewise; the last stage's backward needs only its own forward, where the loss is)
    sW k  needs sI k          on the same rank

Nothing here touches a communicator: the generators return lists, :func:`validate` checks one
(every action exactly once, backward after forward, no deadlock), and :func:`simulate` plays it
with given pass times to measure the makespan, the bubble and the activations held. The
executor (``pipeline.executor``) runs the same lists over ``minidist.sim`` or MPI.

The closed forms the simulator reproduces (uniform stages, no communication cost, t_f and t_b
the forward and backward time of one stage on one micro-batch; p stages, m micro-batches):

    GPipe, 1F1B       makespan (m + p - 1)(t_f + t_b), bubble fraction (p - 1)/(m + p - 1)
                      (Huang et al. 2019; Narayanan et al. 2021). GPipe holds m micro-batches'
                      activations on every stage, 1F1B min(m, p - s) on stage s.
    interleaved       v stages per rank, each of 1/v of the rank's layers: bubble / ideal time
                      = (p - 1)/(v m) for m a multiple of p (Narayanan et al. 2021, sec. 2.2.2).
    ZB-H1             at t_f = t_b = t_w the bubble is 1/3 of 1F1B's (Qi et al. 2024, sec. 2.1).

Longer than 400 lines: the schedules as pure data, their validation and the simulator that times
them are one model of chapter 8, tested together.
"""
from __future__ import annotations

import math
import numbers
import re
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import NamedTuple

KINDS = ("F", "B", "I", "W")
_ACTION = re.compile(r"\s*(\d+)([FBIW])(\d+)\s*")


class ScheduleError(ValueError):
    """A schedule that cannot run: an action missing or repeated, a backward before its
    forward, a stage on two ranks, or an order that deadlocks. The message names the action."""


class _Fields(NamedTuple):
    stage: int
    kind: str
    microbatch: int


class Action(_Fields):
    """One pass of one stage on one micro-batch: a named tuple ``(stage, kind, microbatch)``.

    ``stage`` (int >= 0) is the global stage index, ``kind`` one of ``"F"`` (forward), ``"B"``
    (whole backward), ``"I"`` (backward to the input only) and ``"W"`` (backward to the weights
    only), ``microbatch`` (int >= 0) the micro-batch index. ``str(Action(2, "F", 0)) == "2F0"``,
    the form of torch.distributed.pipelining's ``_Action`` (a NamedTuple too); :meth:`from_str`
    parses it back. Raises ValueError for a negative index or an unknown kind.
    """

    __slots__ = ()

    def __new__(cls, stage: int, kind: str, microbatch: int):
        if kind not in KINDS:
            raise ValueError(f"Action: kind must be one of {KINDS}, got {kind!r}")
        for name, value in (("stage", stage), ("microbatch", microbatch)):
            if type(value) is not int or value < 0:  # type(), not isinstance: bool is no index
                raise ValueError(f"Action: {name} must be an int >= 0, got {value!r}")
        return super().__new__(cls, stage, kind, microbatch)

    def __str__(self):
        return f"{self.stage}{self.kind}{self.microbatch}"

    __repr__ = __str__

    @classmethod
    def from_str(cls, text: str) -> Action:
        """Parse torch's form ``"<stage><kind><micro-batch>"``, e.g. ``"1B3"``. Raises
        ValueError naming the text when it is not of that form."""
        match = _ACTION.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            raise ValueError(f"Action.from_str: {text!r} is not of the form <stage><F|B|I|W><micro-batch>, "
                             f"e.g. '2F0' or '1B3'")
        return cls(int(match.group(1)), match.group(2), int(match.group(3)))


def _action(stage: int, kind: str, microbatch: int) -> Action:
    """An Action from values known to be valid (the generators' and checks' own), unchecked:
    the hot paths build hundreds of thousands of them."""
    return Action._make((stage, kind, microbatch))


def parse_schedule(rows) -> list[list[Action]]:
    """A schedule from text: one row per rank, each a string of actions separated by spaces
    (``"0F0 0F1 0B0 0B1"``) or a list of strings or Actions. Raises ValueError on bad text."""
    parsed = []
    for row in rows:
        items = row.split() if isinstance(row, str) else row
        parsed.append([a if isinstance(a, Action) else Action.from_str(a) for a in items])
    return parsed


def check_count(fn: str, name: str, value) -> int:
    """``value`` if it is an integer >= 1 (not a bool); else ValueError naming ``fn`` and ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{fn}: {name} must be an integer >= 1, got {value!r}")
    return value


# ------------------------------------------------------------------ the generators
def gpipe(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """GPipe (Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline
    Parallelism", NeurIPS 2019): rank r (holding stage r) runs all m forwards, then all m
    backwards, both in micro-batch order, the order torch's ``ScheduleGPipe`` executes.
    Every stage holds all m micro-batches' activations at the turn. Any m >= 1 works.
    Returns a list of ``num_stages`` lists of Actions. Raises ValueError for a count < 1."""
    p = check_count("gpipe", "num_stages", num_stages)
    m = check_count("gpipe", "num_microbatches", num_microbatches)
    return [[_action(r, "F", k) for k in range(m)] + [_action(r, "B", k) for k in range(m)] for r in range(p)]


def one_f_one_b(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """1F1B, "PipeDream-Flush" (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN
    Training", ICML 2021; Fan et al., DAPPLE, PPoPP 2021), in the order torch's
    ``Schedule1F1B`` executes:

        warm-up    w = min(m, p - r) forwards              F0 ... F(w-1)
        steady     one backward, then one forward          B0 Fw  B1 F(w+1) ...
        cool-down  the w backwards left                    ... B(m-1)

    Stage r holds at most min(m, p - r) micro-batches' activations (GPipe: m), with the same
    bubble as GPipe. For m < p torch's class refuses; here the order is still valid (ranks with
    p - r >= m run it as GPipe does) and it runs: one micro-batch is naive model parallelism.
    Returns a list of ``num_stages`` lists of Actions. Raises ValueError for a count < 1."""
    p = check_count("one_f_one_b", "num_stages", num_stages)
    m = check_count("one_f_one_b", "num_microbatches", num_microbatches)
    return [one_f_one_b_order(r, m, min(m, p - r)) for r in range(p)]


def one_f_one_b_order(stage: int, num_microbatches: int, warmup: int) -> list[Action]:
    """One stage's 1F1B order with ``warmup`` (1 <= warmup <= num_microbatches) forwards
    first: F0 .. F(w-1), then B0 Fw B1 F(w+1) ..., then the w backwards left. ``one_f_one_b``
    uses w = min(m, p - r); PipeDream's ``pipedream_1f1b`` takes w from its in-flight count."""
    m = num_microbatches
    order = [_action(stage, "F", k) for k in range(warmup)]
    for k in range(m - warmup):
        order += [_action(stage, "B", k), _action(stage, "F", warmup + k)]
    order += [_action(stage, "B", k) for k in range(m - warmup, m)]
    return order


def interleaved_1f1b(num_ranks: int, num_microbatches: int, stages_per_rank: int) -> list[list[Action]]:
    """Interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
    Clusters Using Megatron-LM", SC 2021, sec. 2.2.2), in the order of torch 2.13's
    ``ScheduleInterleaved1F1B`` for every m torch accepts, and for any other m >= 1.

    The model is cut into p * v stages; rank r holds stages r, r + p, ..., r + (v-1) p, so a
    micro-batch visits every rank v times and the pipeline fills v times faster: the bubble
    shrinks by v, at the price of v times as many messages. The micro-batches go in
    ``max(1, m // p)`` rounds (torch's count): rank r runs forwards of its first local stage
    for one round, then its second local stage, ..., and backwards likewise from its last
    local stage down. torch needs the rounds equal (p = 2, m = 6: 2 + 2 + 2) and refuses an m
    they do not divide (p = 2, m = 5); here the rounds then differ by one micro-batch (3 + 2),
    so every round still holds at least p when m >= p: a micro-batch must have passed all p
    ranks of one local stage before its rank-0 forward on the next is due. (Megatron-LM's
    newer schedule table takes rounds of p and a shorter last one, 2 + 2 + 1; with blocking
    receives in this order that deadlocks, e.g. p = 4, m = 9, v = 3.) Rank r runs
    ``min((v-1) g + 2 (p-1-r), v m)`` warm-up forwards (g the first round's size), then one
    forward and one backward at a time, then the backwards left. ``tests/test_layouts_pipeline.py``
    validates every p <= 6, m <= 30, v <= 3 (no deadlock) and trains uneven m on the simulator.

    Returns a list of ``num_ranks`` lists of Actions (global stage indices). Raises ValueError
    for a count < 1."""
    p = check_count("interleaved_1f1b", "num_ranks", num_ranks)
    m = check_count("interleaved_1f1b", "num_microbatches", num_microbatches)
    v = check_count("interleaved_1f1b", "stages_per_rank", stages_per_rank)
    rounds = max(1, m // p)
    sizes = [m // rounds + (i < m % rounds) for i in range(rounds)]  # equal when rounds divides m
    return [_interleaved_rank(r, p, m, v, sizes) for r in range(p)]


def _interleaved_rank(r: int, p: int, m: int, v: int, sizes: list[int]) -> list[Action]:
    """Rank r's list in :func:`interleaved_1f1b`, for rounds of ``sizes`` micro-batches: its
    forwards visit each round's micro-batches on local stage 0, then 1, ..., v - 1; its
    backwards the same rounds on local stage v - 1 down to 0."""
    forwards, backwards, first = [], [], 0
    for size in sizes:
        for local in range(v):
            forwards += [_action(local * p + r, "F", k) for k in range(first, first + size)]
            backwards += [_action((v - 1 - local) * p + r, "B", k) for k in range(first, first + size)]
        first += size
    total = v * m  # forwards this rank runs, and as many backwards
    warmup = min((v - 1) * sizes[0] + 2 * (p - 1 - r), total)
    order = forwards[:warmup]
    for i in range(warmup, total):
        order += [forwards[i], backwards[i - warmup]]
    return order + backwards[total - warmup:]


def zero_bubble(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, sec. 2.1): 1F1B with the
    backward split into I (input gradient, which the previous stage waits for) and W (weight
    gradient, which nobody waits for), the W passes deferred into what would be bubbles.

    Rank r runs p - 1 - r warm-up forwards, then forward, I, W triples (so, as in 1F1B, p - r
    forwards come before its first backward), but holds back its first r W passes (the further
    from the first stage, the more; a W runs r triples late): I passes then travel back
    through the pipeline without waiting for W, the first stage starts its backwards sooner,
    and the r held-back W passes fill the cool-down at the end. Every rank then keeps at most
    min(m, p) micro-batches between F and W, the first rank's 1F1B peak, so the peak activation
    memory is that of 1F1B (W needs less than a whole backward). At t_f = t_I = t_W and m >= p
    the bubble is a third of 1F1B's. This is the order of torch's ``ScheduleInterleavedZeroBubble`` (ZB1P) with
    one stage per rank. Any m >= 1 works.

    Returns a list of ``num_stages`` lists of Actions. Raises ValueError for a count < 1."""
    p = check_count("zero_bubble", "num_stages", num_stages)
    m = check_count("zero_bubble", "num_microbatches", num_microbatches)
    schedule = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        order = [_action(r, "F", k) for k in range(warmup)]
        for k in range(m):  # the k-th backward
            if warmup + k < m:
                order.append(_action(r, "F", warmup + k))
            order.append(_action(r, "I", k))
            if k >= r:  # the first r weight passes wait for the cool-down
                order.append(_action(r, "W", k - r))
        order += [_action(r, "W", k) for k in range(max(0, m - r), m)]
        schedule.append(order)
    return schedule


# ------------------------------------------------------------------ checking and playing
@dataclass
class _Plan:
    """What the checks learn: where each stage lives, and what each action waits for."""

    rank_of: dict  # stage -> rank
    num_stages: int
    num_microbatches: int
    needs: dict  # action -> the actions it waits for (its messages, and its own F or I)


def _placement(schedule) -> tuple[dict, dict]:
    """The shape and placement checks: ``(rank_of, seen)``, stage -> its rank and action ->
    (rank, position); ScheduleError for a stage on two ranks, a repeated action, no action."""
    if not isinstance(schedule, (list, tuple)) or not schedule:
        raise ScheduleError(f"a schedule is a non-empty list with one list of Actions per rank, got {schedule!r}")
    rank_of, seen = {}, {}
    for r, row in enumerate(schedule):
        if not isinstance(row, (list, tuple)):
            raise ScheduleError(f"rank {r}: expected a list of Actions, got {type(row).__name__} "
                                f"(text goes through parse_schedule first)")
        for i, a in enumerate(row):
            if not isinstance(a, Action):
                raise ScheduleError(f"rank {r}, position {i}: {a!r} is not an Action (use parse_schedule for text)")
            if rank_of.setdefault(a.stage, r) != r:
                raise ScheduleError(f"{a}: stage {a.stage} runs on rank {rank_of[a.stage]} and on rank {r}; "
                                    f"a stage lives on one rank")
            if a in seen:
                raise ScheduleError(f"{a} appears twice (rank {seen[a][0]} position {seen[a][1]}, "
                                    f"rank {r} position {i}); each action runs exactly once")
            seen[a] = (r, i)
    if not seen:
        raise ScheduleError("the schedule has no actions")
    return rank_of, seen


def _plan(schedule) -> _Plan:
    """Every check but deadlock: shape, placement (:func:`_placement`), completeness, per-rank order."""
    rank_of, seen = _placement(schedule)
    num_stages = max(rank_of) + 1
    num_mb = max(a.microbatch for a in seen) + 1
    # Every (stage, micro-batch): one F, and one B or one I and one W. Remember whose backward
    # sends stage s - 1 its gradient: B, or I when split.
    gradient_from = {}
    for s in range(num_stages):
        if s not in rank_of:
            raise ScheduleError(f"stage {s} has no actions (stages are numbered 0..{num_stages - 1}); missing {s}F0")
        for k in range(num_mb):
            whole, i_pass, w_pass = _action(s, "B", k), _action(s, "I", k), _action(s, "W", k)
            if (s, "F", k) not in seen:
                raise ScheduleError(f"missing {Action(s, 'F', k)}: every stage runs every micro-batch 0..{num_mb - 1}")
            if whole in seen and (i_pass in seen or w_pass in seen):
                raise ScheduleError(f"{whole} and {i_pass if i_pass in seen else w_pass} both present: a backward is "
                                    f"either one B or an I and a W")
            if whole not in seen and not (i_pass in seen and w_pass in seen):
                if i_pass in seen or w_pass in seen:
                    missing = w_pass if i_pass in seen else i_pass
                    raise ScheduleError(f"missing {missing}: a split backward needs both {i_pass} and {w_pass}")
                raise ScheduleError(f"missing {whole} (or {i_pass} and {w_pass}): every forward needs its backward")
            gradient_from[s, k] = whole if whole in seen else i_pass
    # What each action waits for. On its own rank, a backward must come after its forward and
    # W after I: otherwise the rank would wait for itself.
    needs = {}
    last = num_stages - 1
    for r, row in enumerate(schedule):
        done = set()
        for i, a in enumerate(row):
            s, kind, k = a
            if kind == "F":
                needs[a] = (_action(s - 1, "F", k),) if s > 0 else ()
                own = None
            elif kind == "W":
                own = _action(s, "I", k)
                needs[a] = (own,)
            else:
                own = _action(s, "F", k)
                needs[a] = (own, gradient_from[s + 1, k]) if s < last else (own,)
            if own is not None and own not in done:
                raise ScheduleError(f"rank {r} position {i}: {a} comes before {own}, which it needs; move it after")
            done.add(a)
    return _Plan(rank_of, num_stages, num_mb, needs)


def _play(schedule, plan: _Plan, duration, t_comm: float):
    """Run the ranks' lists in order: each action starts when its rank is free and its inputs
    have arrived (``t_comm`` after they were produced on another rank). Sends never block (the
    executor posts them with Isend, as torch's schedules do); a rank waits only to receive.
    Returns (start, end) dicts; raises ScheduleError naming the stuck actions on deadlock.

    Event-driven: a rank runs until it needs an action not yet done, then waits on it; finishing
    an action wakes the ranks waiting on it. O(actions)."""
    start, end = {}, {}
    pos = [0] * len(schedule)
    free = [0.0] * len(schedule)
    waiting = defaultdict(list)  # action -> ranks blocked on it
    ready = deque(range(len(schedule)))
    needs, rank_of = plan.needs, plan.rank_of
    while ready:
        r = ready.popleft()
        row, n, t_free = schedule[r], len(schedule[r]), free[r]
        while pos[r] < n:
            a = row[pos[r]]
            t = t_free
            for d in needs[a]:
                t_d = end.get(d)
                if t_d is None:
                    waiting[d].append(r)
                    break
                t = max(t, t_d + t_comm) if rank_of[d[0]] != r else max(t, t_d)
            else:
                start[a] = t
                end[a] = t_free = t + duration(a)
                pos[r] += 1
                if a in waiting:
                    ready.extend(waiting.pop(a))
                continue
            break
        free[r] = t_free
    stuck = [r for r in range(len(schedule)) if pos[r] < len(schedule[r])]
    if stuck:
        lines = []
        for r in stuck:
            a = schedule[r][pos[r]]
            d = next(d for d in needs[a] if d not in end)
            lines.append(f"rank {r} waits at {a} for {d} (rank {rank_of[d.stage]})")
        raise ScheduleError("deadlock: no rank can go on; " + "; ".join(lines))
    return start, end


def validate(schedule) -> None:
    """Check that ``schedule`` (one list of Actions per rank) can run, or raise ScheduleError
    (a ValueError) naming the action at fault:

    - each stage on one rank; stages 0..S-1 and micro-batches 0..m-1 all present;
    - every (stage, micro-batch) exactly one F and either one B or one I and one W;
    - on its rank, a B or I after its F, a W after its I;
    - no deadlock when the ranks run their lists in order and exchange activations (F of stage
      s waits for F of s - 1) and gradients (B/I of s waits for B/I of s + 1) by blocking
      receives. Sends are taken as non-blocking (Isend); with synchronous sends even 1F1B
      deadlocks unless each send is paired with the receive that follows it (torch fuses them).
    Returns None."""
    plan = _plan(schedule)
    _play(schedule, plan, lambda a: 0.0, 0.0)


@dataclass(frozen=True)
class SimulationResult:
    """What :func:`simulate` measured, times in the units of its arguments.

    ``start`` / ``end``: Action -> time; ``makespan``: the last end (the first action starts at
    0); ``busy``: per rank, the time spent computing; ``bubble_fraction``: the idle share of all
    rank-time, 1 - sum(busy) / (ranks * makespan); ``peak_in_flight``: per rank, the most
    (stage, micro-batch) pairs whose activations it holds at once, counted from the F until the
    backward is complete (B, or W when split: W still needs the stage's inputs)."""

    start: dict
    end: dict
    makespan: float
    busy: list
    bubble_fraction: float
    peak_in_flight: list

    @property
    def bubble_time(self) -> float:
        """Idle rank-time summed over ranks: ranks * makespan - sum(busy)."""
        return len(self.busy) * self.makespan - sum(self.busy)

    def timeline(self, rank_actions) -> list[tuple[Action, float, float]]:
        """(action, start, end) for the given actions (e.g. one rank's list), for plotting."""
        return [(a, self.start[a], self.end[a]) for a in rank_actions]


def _is_time(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def _per_stage(name: str, value, num_stages: int) -> list[float]:
    values = list(value) if isinstance(value, (list, tuple)) else [value] * num_stages
    if len(values) != num_stages:
        raise ValueError(f"simulate: {name} has {len(values)} entries; give one number or one per stage ({num_stages})")
    for x in values:
        if not _is_time(x):
            raise ValueError(f"simulate: {name} must be a finite number >= 0 (or one per stage), got {value!r}")
    return [float(x) for x in values]


def simulate(schedule, t_forward=1.0, t_backward=2.0, t_weight=0.0, t_comm=0.0) -> SimulationResult:
    """Play ``schedule`` with given pass times and measure it (a discrete-event simulation of
    the dependencies listed in the module docstring; no communicator involved).

    ``t_forward``: one stage's forward on one micro-batch; ``t_backward``: its backward to the
    input (an I action); ``t_weight``: its backward to the weights (a W action). A whole B costs
    ``t_backward + t_weight``. Each is a number >= 0 or a list with one per stage. ``t_comm``:
    the delay of one message between stages on different ranks. Validates first: raises
    ScheduleError as :func:`validate`, ValueError for a negative or non-finite time.

    Activations held (``peak_in_flight``) count a (stage, micro-batch) from its F until its
    backward is complete: B, or W for a split backward. After I, W still needs the stage's
    inputs and output gradient (for a Linear layer, dW = x^T dy needs all of x), so ZB-H1 keeps
    p on every rank, the first rank's 1F1B peak, as Qi et al. (2024, sec. 2.1) state. For
    interleaved schedules a unit is one stage's activations, 1/v of the rank's layers.

    Uniform stages, t_comm = 0: GPipe and 1F1B give makespan (m + p - 1)(t_f + t_b) and bubble
    fraction (p - 1)/(m + p - 1) (GPipe, Huang et al. 2019; 1F1B, Narayanan et al. 2021);
    interleaved (m a multiple of p) (v m + p - 1)(t_f + t_b); ZB-H1 (m >= p, t_w <= t_f, t_b)
    m (t_f + t_b + t_w) + (p - 1)(t_f + t_b - t_w). With t_comm, GPipe adds 2 (p - 1) t_comm.
    Cost: a few microseconds per action (a million actions take seconds)."""
    plan = _plan(schedule)
    costs = {kind: _per_stage(name, t, plan.num_stages) for kind, name, t in
             (("F", "t_forward", t_forward), ("I", "t_backward", t_backward), ("W", "t_weight", t_weight))}
    costs["B"] = [i + w for i, w in zip(costs["I"], costs["W"])]
    if not _is_time(t_comm):
        raise ValueError(f"simulate: t_comm must be a finite number >= 0, got {t_comm!r}")

    def duration(a):
        return costs[a.kind][a.stage]

    start, end = _play(schedule, plan, duration, float(t_comm))
    makespan = max(end.values())
    busy = [sum(duration(a) for a in row) for row in schedule]
    bubble = 1.0 - sum(busy) / (len(schedule) * makespan) if makespan > 0 else 0.0
    peaks = []
    for row in schedule:
        held = peak = 0
        for a in row:  # a rank runs its list in order, so the count changes only at its own actions
            held += {"F": 1, "B": -1, "W": -1}.get(a.kind, 0)
            peak = max(peak, held)
        peaks.append(peak)
    return SimulationResult(start, end, makespan, busy, bubble, peaks)
