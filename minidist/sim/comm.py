"""The API a simulated rank calls: :class:`Comm`, one rank's view of a communicator with
mpi4py's method names -- arrays (``Send``/``Recv``/``Isend``/``Irecv``/``Sendrecv``...),
pickled objects (``send``/``recv``/``isend``/``irecv`` and the lowercase collectives),
``Barrier``, ``Split`` -- and ``wait_all``, the wait with a deadline ``minidist.p2p`` uses.
The messages themselves go through the world's post office (``minidist.sim.postoffice``).
"""
from __future__ import annotations

import pickle

import numpy

from minidist.sim.postoffice import ANY_SOURCE, ANY_TAG, COLLECTIVE, P2P, is_rank
from minidist.sim.requests import Request, wait_all
from minidist.sim.virtual_time import check_seconds

UNDEFINED = -32766  # Split's "no new communicator" colour: the value of mpi4py's MPI.UNDEFINED (MPICH, Open MPI)
_COLLECTIVE_TAG = 0  # the tag of the lowercase collectives' messages (their own context keeps them apart)
_SENDABLE_KINDS = "biufc"  # bool, int, uint, float, complex: the kinds mpi4py maps to MPI datatypes


class Comm:
    """One rank's view of a communicator of a :class:`World`, with mpi4py's method names:
    the world's own (what ``run`` passes to each rank), or one made by :meth:`Split`.
    ``rank``/``size`` are this communicator's (``Get_rank()``/``Get_size()``), ``world_rank``
    the rank in the world, ``context_id`` its id (``()`` for the world's: no message of one
    communicator matches a receive of another). ``cuda_aware`` is True: collectives may pass
    cupy arrays straight to it (see ``minidist.p2p.stage_to_host``)."""

    cuda_aware = True

    def __init__(self, world, rank, ranks=None, context=()):
        # ranks: this communicator's rank -> world rank; context: its id, () for the world
        self._ranks = tuple(range(world.size)) if ranks is None else tuple(ranks)
        self._local_rank = {w: r for r, w in enumerate(self._ranks)}  # world rank -> ours
        self.world, self.rank, self.size = world, rank, len(self._ranks)
        self.world_rank, self.context_id, self._splits = self._ranks[rank], context, 0

    def __repr__(self):
        if self.context_id == ():
            return f"<sim.Comm rank {self.rank} of {self.size}>"
        return f"<sim.Comm rank {self.rank} of {self.size} (world ranks {', '.join(map(str, self._ranks))})>"

    def _to_world(self, rank, what):
        """The world rank of this communicator's ``rank`` (a destination or a source >= 0)."""
        if not is_rank(rank, self.size):
            raise ValueError(f"rank {self.rank}: {what} must be a rank in 0..{self.size - 1}, got {rank!r}")
        return self._ranks[rank]

    def local_rank(self, world_rank):
        """This communicator's rank of world rank ``world_rank``."""
        return self._local_rank[world_rank]

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    # -- arrays --------------------------------------------------------------------------
    def Isend(self, buf, dest, tag=0):
        """Start sending a copy of ``buf`` to ``dest``. The request is complete at once for an
        eager message (at most ``world.eager_limit`` bytes, not strict), else once a receive
        has matched it."""
        return self._isend_array(buf, dest, tag, synchronous=False)

    def Send(self, buf, dest, tag=0):
        """Send a copy of ``buf`` to ``dest``: returns at once for an eager message, else
        blocks until ``dest`` has posted a matching receive (module docstring)."""
        self.Isend(buf, dest, tag).Wait()

    def Issend(self, buf, dest, tag=0):
        """Synchronous ``Isend``: the request completes once a receive has matched it."""
        return self._isend_array(buf, dest, tag, synchronous=True)

    def Ssend(self, buf, dest, tag=0):
        """Synchronous send: blocks until ``dest`` has posted a matching receive (any size)."""
        self.Issend(buf, dest, tag).Wait()

    def _isend_array(self, buf, dest, tag, synchronous):
        array = _array_of(buf, f"rank {self.rank}: Send")
        dest = self._to_world(dest, "dest")
        env = self.world.post(self.world_rank, dest, tag, array.copy(), "array", (self.context_id, P2P))
        return Request(self, send=(env, synchronous or not self.world.eager(array.nbytes)))

    def Irecv(self, buf, source=ANY_SOURCE, tag=ANY_TAG):
        """Post a receive into ``buf``; completed by ``Wait()``/``Test()``."""
        array = _array_of(buf, f"rank {self.rank}: Recv")
        source = source if source < 0 else self._to_world(source, "source")
        return self.world.post_receive(Request(self, array, source, tag), self.world_rank)

    def Recv(self, buf, source=ANY_SOURCE, tag=ANY_TAG, status=None):
        """Block until a matching message arrives and copy it into ``buf``."""
        self.Irecv(buf, source, tag).Wait(status)

    def Sendrecv(self, sendbuf, dest, sendtag=0, recvbuf=None, source=ANY_SOURCE, recvtag=ANY_TAG, status=None):
        """Send ``sendbuf`` to ``dest`` and receive into ``recvbuf`` at the same time (never
        deadlocks with the partner's Sendrecv, whatever the size)."""
        send = self.Isend(sendbuf, dest, sendtag)
        self.Irecv(recvbuf, source, recvtag).Wait(status)
        send.Wait()

    def Barrier(self):
        """Block until every rank of this communicator has entered the barrier."""
        self.world.barrier(self.world_rank, self._ranks, self.context_id)

    def wait_all(self, requests, timeout=None, expire_on_deadlock=False):
        """Complete every request, waiting ``timeout`` seconds at most in all (None: only the
        world's timeout). A minidist extension, not in mpi4py (MPI has no wait with a deadline):
        ``minidist.p2p.wait_all`` uses it where the communicator has it, and polls ``Test``
        otherwise. Deadlock detection applies while it waits; ``expire_on_deadlock=True`` (a
        wait whose caller names the culprit itself) lets a deadlock end it as WaitTimeout at its
        deadline's turn instead of DeadlockError (``minidist.sim.postoffice``). Returns the
        list of results (the object for a lowercase ``irecv``, else None). Raises
        :class:`WaitTimeout` with the indices of the requests still pending and the ranks they
        wait on."""
        return wait_all(self, requests, timeout, expire_on_deadlock)

    # -- pickled Python objects (small metadata) -----------------------------------------
    def isend(self, obj, dest, tag=0):
        """Start sending a pickled ``obj``; eager or not by the pickle's size, as ``Isend``."""
        data = pickle.dumps(obj)
        dest = self._to_world(dest, "dest")
        env = self.world.post(self.world_rank, dest, tag, data, "object", (self.context_id, P2P))
        return Request(self, send=(env, not self.world.eager(len(data))))

    def send(self, obj, dest, tag=0):
        """Send a pickled ``obj`` (blocks past the eager limit, as ``Send``)."""
        self.isend(obj, dest, tag).Wait()

    def irecv(self, buf=None, source=ANY_SOURCE, tag=ANY_TAG):
        """Post a receive of a pickled object (``buf``, mpi4py's size hint, is not needed)."""
        source = source if source < 0 else self._to_world(source, "source")
        return self.world.post_receive(Request(self, None, source, tag), self.world_rank)

    def recv(self, buf=None, source=ANY_SOURCE, tag=ANY_TAG, status=None):
        return self.irecv(buf, source, tag).Wait(status)

    def _csend(self, obj, dest):  # inside the lowercase collectives: always buffered, as MPI's own
        self.world.post(self.world_rank, self._ranks[dest], _COLLECTIVE_TAG, pickle.dumps(obj), "object",
                        (self.context_id, COLLECTIVE))

    def _crecv(self, source):
        request = Request(self, None, self._ranks[source], _COLLECTIVE_TAG, (self.context_id, COLLECTIVE))
        return self.world.post_receive(request, self.world_rank).Wait()

    def bcast(self, obj, root=0):
        """Root's object on every rank (linear: root sends to each rank in turn)."""
        self._to_world(root, "root")
        if self.rank != root:
            return self._crecv(root)
        for r in range(self.size):
            if r != root:
                self._csend(obj, r)
        return obj

    def gather(self, obj, root=0):
        """The list of every rank's object on root, None elsewhere (linear)."""
        self._to_world(root, "root")
        if self.rank != root:
            self._csend(obj, root)
            return None
        return [obj if r == root else self._crecv(r) for r in range(self.size)]

    def allgather(self, obj):
        """The list of every rank's object on every rank (gather to 0, then bcast)."""
        return self.bcast(self.gather(obj, 0), 0)

    def barrier(self):
        self.Barrier()

    # -- communicators -------------------------------------------------------------------
    # MPI_Comm_split: the ranks that pass the same colour form a new communicator, ranked by
    # (key, rank here); UNDEFINED gives none. Collective: every rank of this communicator
    # calls it, in the same order as its other collectives. Each rank's (colour, key) goes
    # to every other by one allgather (pickled metadata in the trace, 2(p-1) messages); the
    # new communicator's context id is (this one's, how many Splits came before, colour):
    # every member computes the same one, and no other communicator has it.
    def Split(self, color=0, key=0):
        """A new communicator of the ranks that pass the same ``color`` (mpi4py's
        ``Comm.Split``): its ranks ordered by ``key``, ties by rank in this communicator.

        color: an int >= 0, or ``UNDEFINED`` (``sim.UNDEFINED`` or mpi4py's
        ``MPI.UNDEFINED``) for a rank that joins none: it gets None (mpi4py gives
        ``MPI.COMM_NULL``). key: an int. Every rank of this communicator must call it.
        The new communicator's messages go into the same ``world.trace``, with world ranks
        (``Message.source``/``dest``), as do the sim's error messages (deadlock, timeouts);
        ``Get_rank()``/``Status``/collectives speak its own ranks.
        Raises ValueError on every rank if any rank passes a colour that is neither >= 0 nor
        UNDEFINED, or a colour or key that is not an int."""
        problem = None
        for name, value in (("color", color), ("key", key)):
            if problem is None and (isinstance(value, bool) or not isinstance(value, (int, numpy.integer))):
                problem = f"{name} must be an int, got {value!r}"
        if problem is None and color < 0 and color != UNDEFINED:
            problem = f"color must be >= 0 or UNDEFINED ({UNDEFINED}), got {color}"
        entries = self.allgather((problem, None if problem else (int(color), int(key))))
        for r, (their_problem, _) in enumerate(entries):
            if their_problem is not None:
                raise ValueError(f"Split: rank {r} of {self.size}: {their_problem}")
        self._splits += 1
        if color == UNDEFINED:
            return None
        members = sorted((k, r) for r, (_, (c, k)) in enumerate(entries) if c == color)
        ranks = [self._ranks[r] for _, r in members]
        return Comm(self.world, ranks.index(self.world_rank), ranks, (*self.context_id, (self._splits, int(color))))

    def Free(self):
        """mpi4py's ``Comm.Free``: nothing to release in the sim (a no-op)."""

    # -- virtual time (a world with a topology; minidist extensions, not in mpi4py) --------
    @property
    def cluster_topology(self):
        """The :class:`~minidist.sim.topology.Topology` of this communicator's ranks (in its rank
        order: ``world.topology.restricted``), or None in a world without one. A minidist
        extension (not mpi4py's ``Comm.topology``, the kind of MPI process topology);
        ``minidist.node_layout`` reads it to find the nodes, and
        ``minidist.topology_delay.DelayComm`` has one too."""
        topology = self.world.topology
        if topology is None or self.context_id == ():
            return topology
        return topology.restricted(self._ranks)

    def compute(self, seconds, label="compute"):
        """Advance this rank's virtual clock by ``seconds`` of local work, recorded in
        ``world.timeline`` as a "compute" interval named ``label`` (for Gantt pictures of
        overlap). A minidist extension (``minidist.topology_delay.DelayComm.compute`` sleeps
        instead, under mpiexec). Raises ValueError for seconds that are not a finite number
        >= 0, or in a world without a topology (no virtual clock: pass
        ``World(n, topology=sim.Topology.nodes(...))``)."""
        seconds = check_seconds(seconds)
        if self.world.virtual is None:
            raise ValueError("compute: this world has no virtual clock; create it with World(n, topology=...) "
                             "(minidist.sim.Topology) to time local work")
        with self.world.cond:
            self.world.virtual.compute(self.world_rank, seconds, str(label))


def _array_of(buf, what):
    """The array inside an mpi4py buffer spec (``array`` or ``[array, datatype, ...]``)."""
    if isinstance(buf, (list, tuple)):
        buf = buf[0] if buf else None
    if not (hasattr(buf, "dtype") and hasattr(buf, "flags")) or isinstance(buf, numpy.generic):
        raise TypeError(f"{what} needs a numpy or cupy array (or [array, datatype]), got {type(buf).__name__}")
    if buf.dtype.kind not in _SENDABLE_KINDS or not buf.dtype.isnative:
        raise TypeError(f"{what} cannot send dtype {buf.dtype.str!r} ({buf.dtype}): MPI sends bool, integer, "
                        "float or complex arrays in native byte order; convert with x.astype(x.dtype.newbyteorder('='))"
                        if buf.dtype.kind in _SENDABLE_KINDS else
                        f"{what} cannot send dtype {buf.dtype}: MPI sends bool, integer, float or complex arrays "
                        "(use the lowercase send/recv for Python objects)")
    if not buf.flags.c_contiguous:
        raise ValueError(f"{what} needs a C-contiguous array (MPI sends raw memory); "
                         "pass numpy.ascontiguousarray(x) or a contiguous slice")
    return buf
