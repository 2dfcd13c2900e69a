"""Virtual time: every rank's clock, the links' ports, and the timeline of a world with a
:class:`~minidist.sim.topology.Topology` (``World(n, topology=...)``).

Each rank keeps a clock (seconds, float, from 0). A message of b bytes that a rank posts when
its clock reads t is *ready* at t; it starts when its outgoing port is free (the link class's
port of the sender, or the node's shared network card: ``Topology.port``), takes
``alpha + b / bandwidth`` of its link class, and occupies the port until it arrives. The
receiver's clock moves to the arrival when its receive completes, the sender's when its send
completes (in this model a send is done when its message has arrived, as the alpha-beta
formulas count it). Local work is free unless the program says ``comm.compute(seconds)``.
Pickled messages (the lowercase calls, hence the collectives' agreement round and
``Split``) are metadata: they cost nothing, but carry the sender's clock, so the receiver's
clock moves to it (causality). A ``Barrier`` sets its ranks' clocks to the latest of them.

Exact and reproducible, whatever the threads' scheduling. A port only its own rank uses is
served in program order, which is also virtual-time order (a rank's clock never goes back),
so its messages are timed as they are posted. A shared port (``nic="shared"``) is served in
the order its messages became ready (ties: lower rank, then earlier post), which the threads'
real-time order need not follow; so such a message is only timed once every rank that has not
returned is blocked and none can go on (the moment the sim would otherwise declare a
deadlock; a rank polling ``Test`` counts as waiting). Then every message still waiting has
been posted, and none posted later can be ready earlier than the earliest of them (it would
follow from a message not yet timed), so the messages ready at that earliest time are timed,
in order, and the ranks go on. A rank that polls ``Test`` on such a message blocks until it
is timed. ``Test`` reports a message as
it does without a topology (done once it is there in real time) and moves the clock as a
``Wait`` would, so programs that branch on ``Test`` may time differently from run to run;
blocking programs (every collective of ``minidist.collectives``) do not.
"""
from __future__ import annotations

import math
import threading
from typing import NamedTuple


class Interval(NamedTuple):
    """One bar of a rank's Gantt timeline: ``kind`` "send", "recv" or "compute" on ``rank``
    from ``start`` to ``end`` (virtual seconds); ``peer`` the other rank (world rank; None for
    compute), ``link`` the link class's name ("intra", "inter"; None for compute), ``nbytes``
    the message's bytes (0 for compute), ``tag`` its tag (None for compute), ``label`` what
    ``comm.compute`` was told ("" for messages)."""

    rank: int
    kind: str
    start: float
    end: float
    peer: int | None
    link: str | None
    nbytes: int
    tag: int | None
    label: str


class Transfer:
    """The virtual timing of one message: when it was ready, its link class and port, and
    (once timed) its start and arrival (``end``; None before)."""

    __slots__ = ("ready", "link", "port", "start", "end")

    def __init__(self, ready, link=None, port=None):
        self.ready, self.link, self.port = ready, link, port
        self.start = self.end = None


class VirtualTime:
    """The clocks, ports and timeline of one world (module docstring). The post office calls
    it with its lock held, except :meth:`received` and :meth:`sent`, which touch only the
    calling rank's own clock."""

    def __init__(self, topology, size):
        self.topology, self.size = topology, size
        self._lock = threading.Lock()
        self.reset()

    def reset(self):
        """Clocks at 0, every port free, an empty timeline."""
        self.clocks = [0.0] * self.size
        self._port_free = {}
        self._pending = []  # envelopes on a shared port, waiting to be timed (grant_earliest)
        self._intervals = []

    def post(self, env, source, dest, kind):
        """Time (or queue) the message of Envelope ``env``, posted by world rank ``source`` now.
        Returns True when it must wait for :meth:`grant_earliest` (a shared port)."""
        env.transfer = transfer = Transfer(self.clocks[source])
        if kind != "array":  # metadata: free, but it carries the sender's clock
            transfer.start = transfer.end = transfer.ready
            return False
        transfer.link, transfer.port, shared = self.topology.channel(source, dest, env.record.tag)
        if shared:
            self._pending.append(env)
            return True
        self._time(env)
        return False

    def _time(self, env):
        transfer, record = env.transfer, env.record
        transfer.start = max(transfer.ready, self._port_free.get(transfer.port, 0.0))
        transfer.end = transfer.start + transfer.link.time(record.nbytes)
        self._port_free[transfer.port] = transfer.end
        name = transfer.link.name
        with self._lock:
            self._intervals.append(Interval(record.source, "send", transfer.start, transfer.end, record.dest,
                                            name, record.nbytes, record.tag, ""))
            self._intervals.append(Interval(record.dest, "recv", transfer.start, transfer.end, record.source,
                                            name, record.nbytes, record.tag, ""))

    def has_pending(self):
        """Whether messages wait to be timed (on a shared port)."""
        return bool(self._pending)

    def grant_earliest(self):
        """Every rank is blocked: time the waiting messages that became ready earliest (in
        order of rank, then post); return them (an empty list when none wait)."""
        if not self._pending:
            return []
        earliest = min(env.transfer.ready for env in self._pending)
        now = sorted((env for env in self._pending if env.transfer.ready == earliest),
                     key=lambda env: (env.record.source, env.record.seq))
        self._pending = [env for env in self._pending if env.transfer.ready != earliest]
        for env in now:
            self._time(env)
        return now

    def received(self, env, rank):
        """World rank ``rank`` completed the receive of ``env``: its clock moves to the arrival."""
        self.clocks[rank] = max(self.clocks[rank], env.transfer.end)

    def sent(self, env, rank):
        """World rank ``rank`` completed the send of ``env``: its clock moves to the arrival."""
        self.clocks[rank] = max(self.clocks[rank], env.transfer.end)

    def barrier(self, members):
        """The world ranks ``members`` leave a barrier together, at the latest of their clocks."""
        latest = max(self.clocks[m] for m in members)
        for m in members:
            self.clocks[m] = latest

    def compute(self, rank, seconds, label):
        """World rank ``rank`` computes for ``seconds`` (virtual): its clock moves on."""
        start = self.clocks[rank]
        self.clocks[rank] = start + seconds
        with self._lock:
            self._intervals.append(Interval(rank, "compute", start, start + seconds, None, None, 0, None, label))

    @property
    def timeline(self):
        """Every interval, sorted by rank, start, end and kind (a new list)."""
        with self._lock:
            return sorted(self._intervals, key=lambda i: (i.rank, i.start, i.end, i.kind, -1 if i.peer is None
                                                          else i.peer, i.tag or 0))

    @property
    def makespan(self):
        """The latest clock of any rank (seconds)."""
        return max(self.clocks)


def check_seconds(seconds):
    """``seconds`` as a float; ValueError unless it is a finite number >= 0."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) \
            or seconds < 0:
        raise ValueError(f"compute: seconds must be a finite number >= 0, got {seconds!r}")
    return float(seconds)
