"""Replicas that come and go without a job restart: the quorum at each sync point, the state a
healthy peer hands a joiner, and the refusal of a joiner that trains something else.

The idea is torchft's (``torchft/manager.py``, ``src/lighthouse.rs``, ``src/manager.rs``): before
each sync the live replicas form a *quorum*; the all-reduce runs over the quorum only, so a
replica that died is simply not in it ("the average over who is there"); a replica whose step is
behind the quorum's highest (a restarted or new one) *heals*: it receives the current state from
an up-to-date peer (torchft assigns the sources round-robin over the replicas at ``max_step``) and
reads no checkpoint. torchft computes the quorum in a separate server, the lighthouse; here there
is no extra process, so the quorum is led by the lowest-ranked live member (PCCL's peers also
agree on membership among themselves, without a server).

One round, at every sync point (``ReplicaSet.quorum``), costs 2 (m - 1) messages of a few dozen
bytes on m members, nothing next to the pseudo-gradients:

    member r != leader   sends HELLO [step, digest] to the leader, waits for its DECISION
    the leader           waits for every member's HELLO, at most ``timeout`` seconds (p2p's one
                         deadline): a member not heard from by then is dropped; takes the JOIN
                         requests that have arrived; sends each one the DECISION:
                         [step, donor, members that reduce, receivers that heal]
    members at the step  all-reduce their pseudo-gradients over the members (``ReplicaGroup``)
    the donor            (the lowest member at the highest step) sends the state to each receiver

A member that hears no DECISION within 2 x timeout takes the leader for dead, drops it and asks
the next-lowest member. That member must not judge the others by the plain deadline: they are
still waiting on the dead leader, for up to 2 x timeout from when they sent it their HELLO, and
would be dropped as silent while alive (four replicas that lost their leader split into three
quorums of one, each sure the others had died). So a member that took over after a failover
waits 3 x timeout for the members' HELLOs: long enough for each to give up on the old leader
(2 x timeout) and reach it. The members agree because they all wait on the same leaders, in the
same order. Under ``minidist.sim`` a wait that names its culprit expires at once
when every live rank is blocked, so a dead replica is dropped without waiting in real time.

Why spare ranks, not the supervisor, for joining under mpiexec: MPI-4 without ULFM cannot add a
process to a running job, and the supervisor (``minidist.launch``) restarts the whole job from a
checkpoint (chapter 18), which is what this chapter avoids. So ``mpiexec -n P`` starts spare
ranks too; a spare waits, then asks to join (``ReplicaSet.join``) at a sync point, and the
members' communicator never changes: the quorum is a list of world ranks, and ``ReplicaGroup``
speaks mpi4py's point-to-point names over it, so the collectives run over it unchanged (no
``Comm_split``, which every rank, the dead one included, would have to call).

What is left out (said so in the chapter): a replica that dies *inside* the all-reduce makes the
others' all-reduce raise CollectiveTimeout (no hang, but no recovery: torchft discards such a step
with ``should_commit`` and heals the replicas that applied it at the next quorum); a member that
was slow past the deadline is dropped and told so (ReplicaDropped): it must join again.
"""
from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass

import numpy

from minidist import p2p
from minidist.parallel.parameter_server.protocol import any_source

# Tags of the membership messages (the parameter servers use 7801-7806, the collectives 77xx).
HELLO_TAG, DECISION_TAG, JOIN_TAG, STATE_TAG, REFUSAL_TAG = 7851, 7852, 7853, 7854, 7855
JOINING = -1  # the step a joiner announces: behind everyone


class ReplicaRefused(ValueError):
    """A joiner's model or configuration differs from the replicas' (raised on the joiner).
    ``fields``: the names of the fields that differ."""

    def __init__(self, message, fields=()):
        super().__init__(message)
        self.fields = tuple(fields)


class ReplicaDropped(RuntimeError):
    """This replica was left out of the quorum (it was slower than the deadline): its state is
    no longer the replicas'; it must :meth:`ReplicaSet.join` again."""


class _Expired(Exception):
    def __init__(self, pending):
        super().__init__("expired")
        self.pending = set(pending)


def digest(fingerprint: dict) -> int:
    """A 60-bit hash of a fingerprint (``{field: value}``, values with a stable ``repr``): equal on
    two replicas exactly when they train the same thing (SHA-256 of the sorted items)."""
    return int(hashlib.sha256(repr(sorted(fingerprint.items())).encode()).hexdigest()[:15], 16)


def differing_fields(mine: dict, theirs: dict) -> list[str]:
    """The fields whose values differ between two fingerprints (missing counts as differing), sorted."""
    return sorted(name for name in set(mine) | set(theirs) if mine.get(name, None) != theirs.get(name, None))


class ReplicaGroup:
    """A communicator over some world ranks, for the collectives: the quorum's members.

    ``ReplicaGroup(comm, ranks)`` (``ranks`` sorted world ranks, this rank among them) answers
    ``Get_rank()``/``Get_size()`` in the group's numbers and maps ``Isend``/``Irecv``/``Send``/
    ``Recv``/``isend``/``irecv`` to the world ranks; every other attribute (the sim's
    ``wait_all``) is ``comm``'s. ``rank_names`` names the members by world rank in timeouts.
    It makes no MPI call, so it can be built while a member is dead (``Comm_split`` cannot)."""

    def __init__(self, comm, ranks):
        self.comm, self.ranks = comm, tuple(int(r) for r in ranks)
        if comm.Get_rank() not in self.ranks:
            raise ValueError(f"rank {comm.Get_rank()} is not among the group's ranks {list(self.ranks)}")
        self.rank = self.ranks.index(comm.Get_rank())
        self.rank_names = [f"{r} (world)" for r in self.ranks]

    def __getattr__(self, name):
        if name == "comm":
            raise AttributeError(name)
        return getattr(self.comm, name)

    def _world(self, rank):
        return self.ranks[rank] if rank >= 0 else rank

    def Get_rank(self):
        """This rank's number in the group (its index in ``ranks``)."""
        return self.rank

    def Get_size(self):
        """The number of ranks in the group."""
        return len(self.ranks)

    def Isend(self, buf, dest, tag=0):
        """mpi4py's Isend to the group's rank ``dest``."""
        return self.comm.Isend(buf, self._world(dest), tag)

    def Irecv(self, buf, source=-1, tag=-1):
        """mpi4py's Irecv from the group's rank ``source`` (negative: passed on, "any")."""
        return self.comm.Irecv(buf, self._world(source), tag)

    def Send(self, buf, dest, tag=0):
        """mpi4py's Send to the group's rank ``dest``."""
        return self.comm.Send(buf, self._world(dest), tag)

    def Recv(self, buf, source=-1, tag=-1, status=None):
        """mpi4py's Recv from the group's rank ``source``."""
        return self.comm.Recv(buf, self._world(source), tag, status)

    def isend(self, obj, dest, tag=0):
        """mpi4py's pickling isend (the collectives' agreement round) to the group's rank ``dest``."""
        return self.comm.isend(obj, self._world(dest), tag)

    def irecv(self, buf=None, source=-1, tag=-1):
        """mpi4py's pickling irecv from the group's rank ``source``."""
        return self.comm.irecv(buf, self._world(source), tag)


@dataclass(frozen=True)
class Quorum:
    """One sync point's membership: ``step`` (the highest step among the members, which the
    sync advances), ``members`` (world ranks at that step: they reduce), ``receivers`` (ranks
    that heal from ``donor``: joiners and members behind), ``refused`` (joiners turned away)."""

    step: int
    donor: int
    members: tuple
    receivers: tuple
    refused: tuple = ()

    def encode(self, world_size: int) -> numpy.ndarray:
        """The DECISION message: int64 [step, donor, m, k, refused, members..., receivers..., -1 ...]."""
        out = numpy.full(5 + 2 * world_size, -1, dtype=numpy.int64)
        out[:5] = [self.step, self.donor, len(self.members), len(self.receivers), len(self.refused)]
        out[5:5 + len(self.members)] = self.members
        out[5 + len(self.members):5 + len(self.members) + len(self.receivers)] = self.receivers
        return out

    @classmethod
    def decode(cls, message) -> Quorum:
        """The Quorum an :meth:`encode` message holds (``refused`` as that many placeholders)."""
        step, donor, m, k, refused = (int(v) for v in message[:5])
        members = tuple(int(r) for r in message[5:5 + m])
        return cls(step, donor, members, tuple(int(r) for r in message[5 + m:5 + m + k]), (None,) * refused)


class ReplicaSet:
    """The live replicas as this rank sees them, and the rounds that change them (module docstring).

    comm: the communicator of the replicas (``mpi4py.MPI.COMM_WORLD``, a sim rank, or the ``dp``
    group of a mesh: one rank per replica group). members: the world ranks that start as
    replicas (default: all); the others are spares that may :meth:`join`. timeout: the seconds
    a leader waits for a member (a member waits twice that for the leader, a joiner ``join``'s
    own); default ``p2p.get_timeout()``. ``lost``: the ranks this rank saw dropped; ``refusals``:
    how many joiners the quorums it took part in turned away (the same count on every member)."""

    def __init__(self, comm, members=None, timeout=None):
        self.comm, self.rank, self.size = comm, comm.Get_rank(), comm.Get_size()
        self.members = sorted(range(self.size) if members is None else {int(r) for r in members})
        if not self.members or any(not 0 <= r < self.size for r in self.members):
            raise ValueError(f"members must be ranks of the communicator (0..{self.size - 1}), got {members}")
        self.timeout = p2p.get_timeout() if timeout is None else float(timeout)
        self.lost = []
        self.refusals = 0

    @property
    def leader(self) -> int:
        """The lowest member: it leads the next quorum round."""
        return self.members[0]

    def group(self, ranks) -> ReplicaGroup:
        """A :class:`ReplicaGroup` over ``ranks`` (this rank among them)."""
        return ReplicaGroup(self.comm, ranks)

    # -- the quorum round, on the members ------------------------------------------------

    def quorum(self, step: int, fingerprint: dict) -> Quorum:
        """The sync point's :class:`Quorum` (collective over the live members; module docstring).
        ``step``: this replica's count of syncs so far; ``fingerprint``: what it trains, against
        which joiners are checked. Raises ReplicaDropped when the leader left this rank out."""
        if self.rank not in self.members:
            raise ReplicaDropped(f"rank {self.rank} is not a member: join first (ReplicaSet.join)")
        took_over = False  # a leader was dropped this round: the others may still be waiting on it
        while True:
            if self.leader == self.rank:
                decision = self._lead(step, fingerprint, patience=3 if took_over else 1)
                break
            decision = self._follow(step, fingerprint)
            if decision is not None:
                break
            self.lost.append(self.members.pop(0))  # the leader is silent: the next-lowest leads
            took_over = True
        if self.rank not in decision.members + decision.receivers:
            raise ReplicaDropped(f"rank {self.rank} was left out of the quorum at step {decision.step} (slower than "
                                 f"the {self.timeout:g} s deadline): join again")
        self.refusals += len(decision.refused)
        self.lost += [r for r in self.members if r not in decision.members + decision.receivers]
        self.members = sorted(decision.members + decision.receivers)
        return decision

    def _lead(self, step, fingerprint, patience=1):
        """Lead the round: wait ``patience`` x timeout for the members' hellos (3 after a
        failover, module docstring), decide, send the decision."""
        others = [r for r in self.members if r != self.rank]
        hellos = [numpy.zeros(2, numpy.int64) for _ in others]
        heard = self._receive(hellos, others, HELLO_TAG, patience * self.timeout,
                              "a quorum leader waiting for a member's hello")
        steps = {self.rank: step, **{r: int(h[0]) for r, h, ok in zip(others, hellos, heard) if ok}}
        joiners, refused = self._take_joins(digest(fingerprint), set(steps))
        top = max(steps.values())
        members = tuple(sorted(r for r, s in steps.items() if s == top))
        receivers = tuple(sorted([r for r, s in steps.items() if s < top] + joiners))
        decision = Quorum(top, members[0], members, receivers, tuple(refused))
        message = decision.encode(self.size)
        requests = [self.comm.Isend(message, r, DECISION_TAG) for r in sorted(set(steps) - {self.rank} | set(joiners))]
        refusal = numpy.frombuffer(pickle.dumps(fingerprint), numpy.uint8)
        for r in refused:  # the refused joiner learns why: the leader's fingerprint, compared there
            requests.append(self.comm.Isend(_refused_message(self.size, len(refusal)), r, DECISION_TAG))
            requests.append(self.comm.Isend(refusal, r, REFUSAL_TAG))
        p2p.wait_all(self.comm, requests, [None] * len(requests), "a quorum leader sending its decision")
        return decision

    def _follow(self, step, fingerprint):
        leader = self.leader
        hello = numpy.array([step, digest(fingerprint)], numpy.int64)
        send = self.comm.Isend(hello, leader, HELLO_TAG)
        message = numpy.zeros(5 + 2 * self.size, numpy.int64)
        if not self._receive([message], [leader], DECISION_TAG, 2 * self.timeout, "a member waiting for the "
                             "quorum's decision")[0]:
            return None
        p2p.wait_all(self.comm, [send], [leader], "a member's hello")
        return Quorum.decode(message)

    def _take_joins(self, mine, heard):
        """The JOIN requests that have arrived (never waits): (admitted ranks, refused ranks). A
        request from a rank ``heard`` from as a member this round is stale and dropped; a member
        not heard from that asks to join has restarted."""
        admitted, refused = [], []
        while True:
            request = numpy.zeros(3, numpy.int64)
            receive = self.comm.Irecv(request, any_source(), JOIN_TAG)
            if not receive.Test():
                _cancel(receive)
                return admitted, refused
            rank, theirs = int(request[2]), int(request[1])
            if rank in heard or rank in admitted or rank in refused:
                continue  # a repeated request
            (admitted if theirs == mine else refused).append(rank)

    def _receive(self, buffers, sources, tag, timeout, what):
        """Receive one message per source within ``timeout``; which arrived (list of bools)."""
        if not sources:
            return []
        requests = [self.comm.Irecv(b, s, tag) for b, s in zip(buffers, sources)]
        try:
            p2p.wait_all(self.comm, requests, list(sources), what, receives=len(requests), timeout=timeout,
                         blame=_Expired)
        except _Expired as expired:
            arrived = [j not in expired.pending for j in range(len(sources))]
            for request, done in zip(requests, arrived):
                if done:  # matched, perhaps not completed (the sim fills the buffer on completion)
                    request.Wait()
            return arrived
        return [True] * len(sources)

    # -- joining, on a spare or restarted replica ------------------------------------------

    def join(self, fingerprint: dict, candidates=None, timeout=None) -> Quorum:
        """Ask to join at the next sync point; returns the Quorum that admitted this rank (it is
        then among its receivers: receive the state from ``quorum.donor`` with
        :meth:`receive_state`). ``candidates``: the ranks to ask, in order (default: every other
        rank, lowest first: the lowest live member leads); each gets ``timeout`` seconds (default
        4 x the set's timeout: a sync point may be H inner steps away). Raises ReplicaRefused
        naming the fields of ``fingerprint`` that differ from the replicas', CollectiveTimeout
        when no candidate answers."""
        timeout = 4 * self.timeout if timeout is None else timeout
        candidates = [r for r in (range(self.size) if candidates is None else candidates) if r != self.rank]
        request = numpy.array([JOINING, digest(fingerprint), self.rank], numpy.int64)
        for leader in candidates:
            send = self.comm.Isend(request, leader, JOIN_TAG)
            message = numpy.zeros(5 + 2 * self.size, numpy.int64)
            if not self._receive([message], [leader], DECISION_TAG, timeout, "a joiner waiting to be admitted")[0]:
                continue
            p2p.wait_all(self.comm, [send], [leader], "a joiner's request")
            decision = Quorum.decode(message)
            if decision.refused and decision.members == ():
                self._refused(leader, int(message[4]), fingerprint)
            self.members = sorted(decision.members + decision.receivers)
            return decision
        raise p2p.CollectiveTimeout(f"rank {self.rank} asked ranks {candidates} to join and none admitted it within "
                                    f"{timeout:g} s each", self.rank, candidates)

    def _refused(self, leader, nbytes, fingerprint):
        theirs = numpy.zeros(nbytes, numpy.uint8)
        self._receive([theirs], [leader], REFUSAL_TAG, self.timeout, "a refused joiner waiting for the reason")
        theirs = pickle.loads(theirs.tobytes())
        fields = differing_fields(fingerprint, theirs)
        said = "; ".join(f"{name} is {fingerprint.get(name)!r} here, {theirs.get(name)!r} on the replicas"
                         for name in fields)
        raise ReplicaRefused(f"rank {leader} refused rank {self.rank} as a replica: {said}", fields)

    # -- the state a healthy peer hands a receiver -----------------------------------------

    def send_state(self, arrays, receivers) -> None:
        """The donor's half: send ``arrays`` (numpy arrays, in an order both sides know) to each
        receiver; waits with the deadline."""
        requests, peers = [], []
        for r in receivers:
            for a in arrays:
                requests.append(self.comm.Isend(numpy.ascontiguousarray(a), r, STATE_TAG))
                peers.append(r)
        p2p.wait_all(self.comm, requests, peers, "a donor sending the replicas' state")

    def receive_state(self, like, donor) -> list:
        """The receiver's half: arrays shaped and typed as ``like``, from ``donor``, in order."""
        out = [numpy.empty_like(numpy.asarray(a)) for a in like]
        for a in out:  # one at a time: messages of one pair and tag arrive in order
            p2p.wait_all(self.comm, [self.comm.Irecv(a, donor, STATE_TAG)], [donor], "a replica receiving the state",
                         receives=1)
        return out


def _refused_message(world_size, nbytes):
    out = numpy.full(5 + 2 * world_size, -1, dtype=numpy.int64)
    out[:5] = [JOINING, -1, 0, 0, nbytes]
    return out


def _cancel(request):
    try:
        request.Cancel()
        request.Wait()
    except Exception:  # best effort, as p2p's: nothing was received
        pass

