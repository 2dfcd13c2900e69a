"""The sim's messages in flight and the ranks waiting for them: matching in MPI's order,
blocking, deadlock detection, and the trace records with their logical clock.

:class:`PostOffice` is the shared state of one world (``minidist.sim.World`` is one) under
one lock. ``Comm`` and ``Request`` (the API the ranks call) post messages and receives here
and wait here; a program never calls it directly.

Matching follows MPI: a message goes to the earliest posted matching receive, and a
receive takes the earliest arrived matching message, so messages between two ranks with the
same tag never overtake each other. A message's *context* is (communicator, kind): kind
``P2P`` for the programs' messages, ``COLLECTIVE`` inside the sim's lowercase collectives,
so those never match a program's receive, and no message of one communicator matches a
receive of another (MPI's context ids).

Deadlock detection: when every rank that has not returned is blocked in a wait and none can
proceed, every blocked rank raises :class:`DeadlockError` naming what each rank waits for and
the wait-for cycle, if there is one. A wait that asked for it (``expire_on_deadlock``, a wait
with a deadline whose caller names the culprit better than a deadlock report) is ended
instead: the earliest such deadline expires at once, as :class:`WaitTimeout` with
``deadlocked`` True, since nothing could arrive before it.

Longer than 400 lines: matching in MPI's order, the eager limit, strict mode, the trace and deadlock
detection all act on the one table of messages in flight.
"""
from __future__ import annotations

import math
import operator
import threading
import time
from dataclasses import dataclass

from minidist.sim.virtual_time import VirtualTime

ANY_SOURCE = -1
ANY_TAG = -1
EAGER_LIMIT = 4096  # bytes a Send may buffer; a larger one waits for its receive (minidist.sim's docstring)
P2P, COLLECTIVE = "p2p", "collective"  # the kinds of a message's context (module docstring)


class SimError(RuntimeError):
    """Base class of the errors the simulated world raises itself."""


class DeadlockError(SimError):
    """Every rank that has not returned is blocked and none can ever proceed."""


class RankAborted(SimError):
    """Raised on the other ranks after one rank failed (the world is being torn down)."""


class SimTimeoutError(SimError, TimeoutError):
    """The world ran past its global timeout."""


class WaitTimeout(SimError, TimeoutError):
    """``Comm.wait_all(requests, timeout)`` ran out of time. ``pending`` holds the indices of
    the requests that did not complete, ``peers`` the ranks they wait on (None: any rank);
    ``deadlocked`` is True when the sim ended the wait early because no rank could proceed
    (``expire_on_deadlock``)."""

    def __init__(self, message, pending=(), peers=(), deadlocked=False):
        super().__init__(message)
        self.pending, self.peers, self.deadlocked = list(pending), list(peers), deadlocked


class MessageMismatchError(ValueError):
    """A receive buffer does not fit the message (dtype, element count or kind)."""


@dataclass
class Message:
    """One message in the trace. ``nbytes``/``count``/``dtype`` describe the payload
    (for ``kind="object"``: the pickle's bytes, count 0, dtype ``"pickle"``); ``t_start`` is
    when it was sent and ``t_end`` when the receiver got it (None if never received), in
    seconds since the run started; ``step`` is its logical round (``minidist.sim``'s
    docstring), final once it is received."""

    seq: int
    source: int
    dest: int
    tag: int
    nbytes: int
    count: int
    dtype: str
    kind: str
    step: int
    t_start: float
    t_end: float | None = None


class Envelope:
    """A message in flight: its trace record, its payload, its matching context, whether a
    receive has taken it (a synchronous send waits for that) and when it has crossed its link
    (``perf_counter`` seconds; 0: at once)."""

    __slots__ = ("record", "payload", "context", "matched", "arrives", "transfer")

    def __init__(self, record, payload, context):
        self.record, self.payload, self.context = record, payload, context
        self.matched = False
        self.arrives = 0.0  # math.inf: waits to be timed in virtual time (minidist.sim.virtual_time)
        self.transfer = None  # its virtual timing (a Transfer), in a world with a topology

    def matches(self, source, tag, context):
        """Whether a receive for ``source`` and ``tag`` (negative: any) in ``context`` takes it."""
        r = self.record
        return self.context == context and (source < 0 or r.source == source) and (tag < 0 or r.tag == tag)


def is_rank(value, size) -> bool:
    """True when ``value`` is an integer (anything ``operator.index`` accepts) in [0, size)."""
    try:
        return 0 <= operator.index(value) < size
    except TypeError:
        return False


def plural_ranks(ranks):
    """``"rank 1"`` or ``"ranks 1, 3"``."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


class PostOffice:
    """The messages of ``size`` ranks in flight, and the ranks blocked waiting for them, under
    one lock (``self.cond``). Subclassed by ``minidist.sim.World``, whose docstring gives
    ``strict``, ``eager_limit``, ``bandwidth``, ``topology`` and ``timeout``."""

    def __init__(self, size, timeout, strict, eager_limit, bandwidth, topology=None):
        self.size, self.timeout = size, timeout
        self.strict, self.eager_limit, self.bandwidth = strict, eager_limit, bandwidth
        self.topology = topology
        self.virtual = None if topology is None else VirtualTime(topology, size)
        self.cond = threading.Condition()
        self.reset()

    def reset(self):
        """Forget every message and wait: a fresh trace, clocks at 0, the deadline restarted."""
        n = self.size
        self.trace: list[Message] = []
        self.errors: dict[int, BaseException] = {}
        self._unexpected = [[] for _ in range(n)]  # arrived, not yet matched (arrival order)
        self._posted = [[] for _ in range(n)]  # receives posted, not yet matched (post order)
        self._blocked = [None] * n  # rank -> (ready, description, peers, expiry or None) while it waits
        self._clock = [0] * n  # the step of a rank's next send
        self._recv_clock = [0] * n  # the first step in which a rank can receive again
        self.finished: set[int] = set()
        self.failure = None  # (rank, exception) that stops the world
        self._deadlock = None
        self._expire = None  # the rank whose wait expires now (a deadlock with expire_on_deadlock)
        self._barrier_arrived: dict[tuple, set[int]] = {}  # communicator context -> world ranks arrived
        self._barrier_generation: dict[tuple, int] = {}
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + self.timeout
        self._link_free = {}  # (source, dest) -> perf_counter time the link is free (bandwidth)
        self._in_flight_until = 0.0  # the latest arrival of any message on a slow link
        if self.virtual is not None:
            self.virtual.reset()

    def eager(self, nbytes):
        """Whether a send of ``nbytes`` is buffered (returns at once) rather than synchronous."""
        return not self.strict and nbytes <= self.eager_limit

    def check_rank(self, rank, what):
        if not is_rank(rank, self.size):
            raise ValueError(f"{what} must be a rank in 0..{self.size - 1}, got {rank!r}")

    # -- posting and matching ------------------------------------------------------------
    def post(self, source, dest, tag, payload, kind, context):
        """World rank ``source`` sends ``payload`` (an array copy, or a pickle for kind
        "object"): record it, hand it to the earliest matching posted receive or queue it.
        Returns its Envelope."""
        self.check_rank(dest, f"rank {source}: dest")
        if tag < 0:
            raise ValueError(f"rank {source}: a send needs a tag >= 0, got {tag}")
        if kind == "array":
            count, dtype, nbytes = payload.size, str(payload.dtype), payload.nbytes
        else:
            count, dtype, nbytes = 0, "pickle", len(payload)
        with self.cond:
            self.raise_if_stopped(source)
            record = Message(len(self.trace), source, dest, tag, nbytes, count, dtype, kind,
                             self._clock[source], time.perf_counter() - self.t0)
            if kind == "array":  # pickled metadata does not move the logical clock
                self._clock[source] += 1
            self.trace.append(record)
            env = Envelope(record, payload, context)
            if self.bandwidth is not None:
                start = max(time.perf_counter(), self._link_free.get((source, dest), 0.0))
                env.arrives = self._link_free[(source, dest)] = start + max(nbytes, 1) / self.bandwidth
                self._in_flight_until = max(self._in_flight_until, env.arrives)
            if self.virtual is not None and self.virtual.post(env, source, dest, kind):
                env.arrives = math.inf  # timed once every rank waits (minidist.sim.virtual_time)
            for i, req in enumerate(self._posted[dest]):
                if env.matches(req.source, req.tag, req.context):
                    del self._posted[dest][i]
                    req.envelope, env.matched = env, True
                    break
            else:
                self._unexpected[dest].append(env)
            self.cond.notify_all()
        return env

    def post_receive(self, req, rank):
        """World rank ``rank`` posts the receive ``req`` (its ``source``, ``tag``, ``context``):
        it takes the earliest matching queued message (``req.envelope``) or waits in line."""
        if req.source >= 0:
            self.check_rank(req.source, f"rank {rank}: source")
        with self.cond:
            self.raise_if_stopped(rank)
            for i, env in enumerate(self._unexpected[rank]):
                if env.matches(req.source, req.tag, req.context):
                    del self._unexpected[rank][i]
                    req.envelope, env.matched = env, True
                    self.cond.notify_all()  # a synchronous sender may be waiting for this
                    break
            else:
                self._posted[rank].append(req)
        return req

    def cancel(self, req, rank):
        """Take rank ``rank``'s posted receive ``req`` out of line if nothing matched it yet;
        True if it was. Called with ``self.cond`` held."""
        if req in self._posted[rank]:
            self._posted[rank].remove(req)
            return True
        return False

    def received(self, record, rank, envelope=None):
        """Stamp ``record`` as received by world rank ``rank`` now and move the logical clock
        (``minidist.sim``'s docstring: one array receive per step), and in virtual time the
        rank's clock to the arrival of ``envelope`` (the message)."""
        record.t_end = time.perf_counter() - self.t0
        if self.virtual is not None and envelope is not None:
            self.virtual.received(envelope, rank)
        if record.kind == "array":
            record.step = max(record.step, self._recv_clock[rank])
            self._recv_clock[rank] = record.step + 1
            self._clock[rank] = max(self._clock[rank], record.step + 1)

    def sent(self, envelope, rank):
        """World rank ``rank``'s send of ``envelope`` completed: in virtual time its clock moves
        to the message's arrival."""
        if self.virtual is not None:
            self.virtual.sent(envelope, rank)

    def time_if_others_wait(self, rank):
        """Virtual time, for a rank that polls (``Test``) instead of waiting: if every other
        live rank is blocked and none can go on, time the earliest waiting messages, as
        :meth:`detect_deadlock` would if this rank waited (else a poll loop would spin until
        the timeout). Called with ``self.cond`` held."""
        if self.virtual is None or not self.virtual.has_pending():
            return
        others = [r for r in range(self.size) if r not in self.finished and r != rank]
        if all(self._blocked[r] is not None and not self._blocked[r][0]() for r in others):
            for env in self.virtual.grant_earliest():
                env.arrives = 0.0
            self.cond.notify_all()

    def awaits_timing(self, envelope):
        """Whether ``envelope`` waits to be timed in virtual time (a shared port's message)."""
        return envelope is not None and envelope.arrives == math.inf

    def barrier(self, rank, members, context):
        """World rank ``rank`` enters the barrier of the communicator ``context`` whose world
        ranks are ``members``; returns once all of them have."""
        with self.cond:
            self.raise_if_stopped(rank)
            generation = self._barrier_generation.setdefault(context, 0)
            arrived = self._barrier_arrived.setdefault(context, set())
            arrived.add(rank)
            if len(arrived) == len(members):
                if self.virtual is not None:
                    self.virtual.barrier(members)
                arrived.clear()
                self._barrier_generation[context] += 1
                self.cond.notify_all()
                return

            def absent():
                return tuple(sorted(set(members) - arrived))

            def missing():
                return f"waits in Barrier ({plural_ranks(absent())} not arrived)"

            self.wait_until(rank, lambda: self._barrier_generation[context] != generation, missing, absent)

    # -- blocking, deadlock detection, teardown (called with self.cond held) -------------
    def raise_if_stopped(self, rank, description=None):
        """Raise what ends rank ``rank``'s wait: the deadlock, the timeout, another rank's failure."""
        if self._deadlock is not None:
            raise DeadlockError(self._deadlock)
        if self.failure is not None:
            failed, exc = self.failure
            if isinstance(exc, SimTimeoutError):
                waiting = f"rank {rank} {description()}, and" if description else f"rank {rank}:"
                raise SimTimeoutError(f"{waiting} the sim world timed out after {self.timeout:g} s")
            raise RankAborted(f"rank {rank} stopped because rank {failed} raised "
                              f"{type(exc).__name__}: {exc}")

    def wait_until(self, rank, ready, description, peers=None, deadline=None, expire_on_deadlock=False):
        """Wait on the condition until ``ready()``; raise on deadlock, failure or timeout.
        ``description()`` says what the rank waits for; ``peers`` (ranks, a function giving
        them, or None for "any rank") is who could release it, for the wait-for cycle.
        ``deadline`` (perf_counter seconds): raise WaitTimeout then (Comm.wait_all);
        ``expire_on_deadlock``: a deadlock ends this wait as WaitTimeout (module docstring)."""
        expiry = deadline if expire_on_deadlock and deadline is not None else None
        self._blocked[rank] = (ready, description, peers, expiry)
        try:
            while not ready():
                self.raise_if_stopped(rank, description)
                if self.detect_deadlock():  # messages were timed in virtual time: look again
                    continue
                if self._expire == rank:
                    self._expire = None
                    raise WaitTimeout(f"rank {rank} {description()}", deadlocked=True)
                self.raise_if_stopped(rank, description)
                now = time.perf_counter()
                if deadline is not None and now >= deadline and now < self.deadline:
                    raise WaitTimeout(f"rank {rank} {description()}")
                remaining = self.deadline - now
                if remaining <= 0:
                    self.failure = self.failure or (rank, SimTimeoutError("timeout"))
                    self.cond.notify_all()
                    raise SimTimeoutError(f"rank {rank} {description()}, and the sim world timed "
                                          f"out after {self.timeout:g} s")
                wake = remaining if deadline is None else min(remaining, deadline - now)
                if self._in_flight_until > now:  # a message on a slow link may arrive before anyone notifies
                    wake = min(wake, max(self._in_flight_until - now, 1e-4), 1e-3)
                self.cond.wait(min(wake, 1.0))
        finally:
            self._blocked[rank] = None
            if self._expire == rank:  # ready after all: the next deadlock may name another wait
                self._expire = None

    def detect_deadlock(self):
        """If every live rank is blocked and none is ready: in virtual time, time the messages
        waiting for a shared port that became ready earliest and return True (the ranks go on);
        else let the earliest deadline of a wait that expires on deadlock expire now, or else
        declare a deadlock, naming what each rank waits for and, if there is one, a cycle of
        ranks waiting on each other."""
        live = [r for r in range(self.size) if r not in self.finished]
        if self._in_flight_until > time.perf_counter():  # a slow link is still delivering
            return False
        if self._expire is not None or not all(self._blocked[r] is not None and not self._blocked[r][0]()
                                               for r in live):
            return False
        if self.virtual is not None:
            timed = self.virtual.grant_earliest()
            for env in timed:
                env.arrives = 0.0
            if timed:
                self.cond.notify_all()
                return True
        expiring = [(self._blocked[r][3], r) for r in live if self._blocked[r][3] is not None]
        if expiring:
            self._expire = min(expiring)[1]
            self.cond.notify_all()
            return False
        parts = []
        for r in range(self.size):
            if r in self.finished:
                parts.append(f"rank {r} has returned" if r not in self.errors else f"rank {r} has failed")
            else:
                parts.append(f"rank {r} {self._blocked[r][1]()}")
        cycle = find_cycle(self._waits_on(live))
        head = "deadlock, no rank can proceed"
        if cycle:
            head += " (wait-for cycle: " + " -> ".join(f"rank {r}" for r in cycle) + ")"
        self._deadlock = head + ": " + "; ".join(parts)
        self.cond.notify_all()
        return False

    def _waits_on(self, live):
        """The wait-for graph of the blocked live ranks: {rank: [live ranks it waits on]}."""
        waits_on = {}
        for r in live:
            peers = self._blocked[r][2]
            peers = peers() if callable(peers) else peers
            waits_on[r] = [q for q in live if q != r] if peers is None else [q for q in peers if q in live]
        return waits_on


def find_cycle(waits_on):
    """A cycle in the wait-for graph {rank: [ranks it waits on]} as [r0, r1, ..., r0] (the
    first found from the lowest rank), or None. Depth-first search, iterative."""
    state = {}  # rank -> 1 on the current path, 2 done
    for start in sorted(waits_on):
        if start in state:
            continue
        path, stack = [start], [iter(waits_on[start])]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state and nxt in waits_on:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(waits_on[nxt]))
    return None
