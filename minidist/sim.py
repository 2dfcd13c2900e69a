"""An in-process world: N ranks as threads that speak mpi4py's point-to-point API.

Every algorithm in the course is written against a communicator with mpi4py's method
names (``Get_rank``, ``Send``, ``Recv``, ``Sendrecv``, ``Isend``/``Irecv`` + ``Wait``, ...).
This module implements that subset for N ranks in one Python process, so an algorithm can
be stepped through in a notebook, tested without MPI, and *watched*: every message is
recorded in a trace. Then the very same function runs on ``mpi4py.MPI.COMM_WORLD``.

    from minidist import sim

    def ping(comm):
        x = numpy.arange(4.0)
        if comm.Get_rank() == 0:
            comm.Send(x, dest=1, tag=7)
        else:
            comm.Recv(x, source=0, tag=7)
        return x

    sim.run(ping, 2)                       # -> [array, array], one result per rank
    world = sim.World(2); world.run(ping)  # the same, and keep the trace:
    print(world.summary()); world.trace    # [Message(seq=0, source=0, dest=1, tag=7, ...)]

Semantics (where they differ from a real MPI, the sim is the stricter one):

- Eager and rendezvous sends. A ``Send`` (or ``send``, ``Isend``...) of at most
  ``EAGER_LIMIT`` = 4096 bytes is copied and returns at once (MPI's "eager" protocol); a larger
  one blocks until the receiver has posted a matching receive (the "rendezvous" protocol), and
  an ``Isend`` request of that size completes only then. A correct MPI program must not depend
  on buffering: the MPI standard lets any ``Send`` block until it is matched. Measured with this
  course's MPICH 5.0.2 wheel (shared memory, one machine): a ring where every rank first Sends
  to rank+1 and then Recvs from rank-1 completes up to 8112 bytes per message and hangs from
  8113 bytes on, with 2 and with 4 ranks -- MPICH's eager cell is
  ``MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_CELL_SIZE`` = 8192 bytes, less its 80-byte header. The sim
  takes the round number below that, so a Send-then-Recv ring that hangs under ``mpiexec``
  raises :class:`DeadlockError` here (naming the wait-for cycle). Other MPIs and networks use
  other limits, so no limit proves a program correct: ``World(n, strict=True)`` makes every
  send synchronous (``Ssend``), whatever its size: the mode for checking a learner's code.
  ``Ssend``/``Issend`` are always synchronous. Many small eager sends in a row are all
  buffered (MPICH buffered 2000 x 1 KiB unreceived sends in the same test).
- Receives match in MPI's order: a message goes to the earliest posted matching receive,
  and messages between two ranks with the same tag never overtake each other.
- A negative ``source`` or ``tag`` in a receive means "any" (so ``sim.ANY_SOURCE`` and
  mpi4py's ``MPI.ANY_SOURCE``/``MPI.ANY_TAG`` both work); ``PROC_NULL`` is not supported.
- Buffers are C-contiguous numpy or cupy arrays (``[array, MPI.DOUBLE]`` is accepted and the
  datatype ignored) of a dtype MPI can send: bool, integer, float or complex in native byte
  order (mpi4py refuses object, string and byte-swapped arrays; so does the sim). A receive
  buffer must have the message's dtype and element count (MPI would silently reinterpret or
  accept a longer buffer; here it is an error naming both).
- Deadlock: when every rank that has not returned is blocked (``Recv``, ``Wait``, ``Barrier``,
  ...) and none can proceed, they all raise :class:`DeadlockError` saying who waits on whom,
  and the wait-for cycle if there is one ("rank 0 -> rank 1 -> rank 0"). A rank that polls
  ``Test`` is not blocked (it might do something else next): only a timeout ends that.
- Timeouts. ``World(timeout=...)`` bounds a whole run: ranks still waiting raise
  :class:`SimTimeoutError`; a rank still computing is interrupted (an exception is raised in
  its thread at its next Python instruction), so it does not go on eating the CPU of later
  runs; one that cannot be interrupted (inside a long C call or ``time.sleep``) is named in
  the error and in ``World.stranded``, and every later ``run`` warns while it is alive.
  ``Comm.wait_all(requests, timeout)`` (a minidist extension, used by
  ``minidist.collectives``) waits for requests with a deadline of its own and raises
  :class:`WaitTimeout` naming what it still waits for.
- An exception on one rank stops the others (they raise :class:`RankAborted` at their next
  communication call, like ``MPI_Abort``) and ``run`` re-raises the original exception, with
  the rank named in a note and in ``exc.rank``.
- ``comm.Split(color, key)`` makes sub-communicators as mpi4py's (``UNDEFINED`` gives None;
  ``Free()`` does nothing). Their messages join the same trace, named by *world* ranks, as are
  the ranks in the sim's errors; ``Get_rank()``, ``Status`` and the lowercase collectives speak
  the sub-communicator's ranks. Deadlock detection spans every communicator.
- The lowercase calls (``send``, ``recv``, ``isend``, ``irecv``, ``bcast``, ``gather``,
  ``allgather``, ``barrier``) pickle Python objects, for small metadata. They are traced with
  ``kind="object"``; the counters count ``kind="array"`` messages unless told otherwise.

``World(n, timeout=60, strict=False, bandwidth=None)`` holds the ranks (``bandwidth`` in bytes/s
makes every link slow, to watch overlap: see ``World``); after ``world.run(fn, *args, **kwargs)``:
``world.trace`` (list of :class:`Message`), ``world.messages_sent(rank)``,
``bytes_sent(rank)``, ``messages_received(rank)``, ``bytes_received(rank)``,
``num_steps()``, ``summary()`` (a table to print) and ``world.errors`` (rank -> exception).
Each run starts a fresh trace; ``sim.run(fn, n, ...)`` is ``World(n).run(fn, ...)``.

The trace gives each message a logical ``step``: the round in which it travels if each
rank can send one message and receive one message per round (the single-port,
full-duplex model of the cost formulas). A rank's sends take successive rounds and start
after the round of the last message it received (a Lamport clock); a message travels no
earlier than the round after its receiver's previous receive. So the number of steps is
the number of latency (alpha) terms an algorithm pays: a ring all-reduce on p ranks takes
2(p-1), a binomial broadcast ceil(log2 p), a linear gather p-1.
"""
from __future__ import annotations

import ctypes
import operator
import pickle
import threading
import time
import warnings
from dataclasses import dataclass

import numpy
from threadpoolctl import threadpool_limits

from minidist.backend import device_of, to_device

ANY_SOURCE = -1
ANY_TAG = -1
UNDEFINED = -32766  # Split's "no new communicator" colour: the value of mpi4py's MPI.UNDEFINED (MPICH, Open MPI)
EAGER_LIMIT = 4096  # bytes a Send may buffer; a larger one waits for its receive (module docstring)
# A message's context is (communicator, kind): kind _P2P for user messages, _COLLECTIVE inside the
# lowercase collectives, so those never match user receives, and no message of one communicator
# matches a receive of another (MPI's context ids). The world communicator's is ().
_P2P, _COLLECTIVE = "p2p", "collective"
_COLLECTIVE_TAG = 0
_SENDABLE_KINDS = "biufc"  # bool, int, uint, float, complex: the kinds mpi4py maps to MPI datatypes
_stranded: list[threading.Thread] = []  # rank threads of timed-out worlds that could not be interrupted


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
    the requests that did not complete, ``peers`` the ranks they wait on (None: any rank)."""

    def __init__(self, message, pending=(), peers=()):
        super().__init__(message)
        self.pending, self.peers = list(pending), list(peers)


class _RankInterrupted(BaseException):
    """Raised inside a rank thread that was still computing when its world timed out (a
    BaseException, like KeyboardInterrupt, so that ``except Exception`` does not swallow it)."""


def _warn_if_stranded():
    """Warn while rank threads of an earlier timed-out world are still alive."""
    _stranded[:] = [t for t in _stranded if t.is_alive()]
    if _stranded:
        names = ", ".join(t.name for t in _stranded)
        warnings.warn(f"{len(_stranded)} rank thread(s) of an earlier sim world that timed out are still running "
                      f"({names}): they share the CPU with this run, which may be slower. Restart the Python "
                      "process (the notebook's kernel) to stop them.", RuntimeWarning, stacklevel=3)


class MessageMismatchError(ValueError):
    """A receive buffer does not fit the message (dtype, element count or kind)."""


@dataclass
class Message:
    """One message in the trace. ``nbytes``/``count``/``dtype`` describe the payload
    (for ``kind="object"``: the pickle's bytes, count 0, dtype ``"pickle"``); ``t_start`` is
    when it was sent and ``t_end`` when the receiver got it (None if never received), in
    seconds since the run started; ``step`` is its logical round (module docstring), final
    once it is received."""

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


class Status:
    """What a receive found: ``source``, ``tag`` and ``count`` (bytes), read with mpi4py's
    ``Get_source()``, ``Get_tag()``, ``Get_count()`` (bytes, as mpi4py's default ``MPI.BYTE``)."""

    def __init__(self):
        self.source, self.tag, self.count = ANY_SOURCE, ANY_TAG, 0

    def Get_source(self):
        return self.source

    def Get_tag(self):
        return self.tag

    def Get_count(self, datatype=None):
        return self.count


class _Envelope:
    """A message in flight: its trace record, its payload, its matching context, and whether
    a receive has taken it (a synchronous send waits for that)."""

    __slots__ = ("record", "payload", "context", "matched", "arrives")

    def __init__(self, record, payload, context):
        self.record, self.payload, self.context = record, payload, context
        self.matched = False
        self.arrives = 0.0  # perf_counter time it has crossed the link (World(bandwidth=...))


def _matches(env, source, tag, context):
    r = env.record
    return (env.context == context and (source < 0 or r.source == source)
            and (tag < 0 or r.tag == tag))


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


def _describe(count, dtype, nbytes):
    return f"{count} x {dtype} ({nbytes} bytes)"


def _plural_ranks(ranks):
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


class Request:
    """A pending ``Isend``/``Irecv`` (or lowercase ``isend``/``irecv``), completed by
    ``Wait()``/``Test()`` (``wait()``/``test()`` for pickled objects), as mpi4py's.

    A receive is complete once a message has matched it. A send is complete at once when it
    is eager (at most the world's eager limit, and not synchronous), else once a receive has
    matched its message."""

    def __init__(self, comm, buf=None, source=ANY_SOURCE, tag=ANY_TAG, context=None, send=None):
        # source: a world rank (the communicator translated it), or negative for any
        context = (comm._context, _P2P) if context is None else context
        self.comm, self.buf, self.source, self.tag, self.context = comm, buf, source, tag, context
        self.send = send  # for a send: (envelope, synchronous)
        self.envelope = send[0] if send else None  # a receive's is set (under the world's lock) when matched
        self.done = bool(send) and not send[1]
        self.cancelled = False
        self.result = None

    @property
    def is_send(self):
        return self.send is not None

    def _matched(self):
        env = self.envelope
        if self.is_send:
            return env.matched and (not env.arrives or env.arrives <= time.perf_counter())
        return env is not None and (not env.arrives or env.arrives <= time.perf_counter())

    def _peers(self):
        """The ranks this request waits on (None: any rank)."""
        if self.is_send:
            return (self.envelope.record.dest,)
        return None if self.source < 0 else (self.source,)

    def _waiting_for(self):
        if self.is_send:
            r, world = self.envelope.record, self.comm.world
            if world.strict:
                why = "strict mode: every send waits for its receive, as Ssend"
            elif r.nbytes > world.eager_limit:
                why = (f"{r.nbytes} bytes > the eager limit of {world.eager_limit} bytes: MPI may block such a "
                       "send until the receive is posted; use Sendrecv or Isend/Irecv")
            else:
                why = "a synchronous send waits for its receive"
            what = "its pickled send" if r.kind == "object" else "its Send"
            return f"rank {r.dest} to receive {what} (tag {r.tag}; {why})"
        src = "any rank" if self.source < 0 else f"rank {self.source}"
        tag = "any tag" if self.tag < 0 else f"tag {self.tag}"
        what = "a message" if self.context[1] == _P2P else "a lowercase collective's message"
        return f"{what} from {src} ({tag})"

    def Wait(self, status=None):
        """Block until the operation completes; for a receive, fill the buffer (and status).
        Returns True (as mpi4py), or the object for a lowercase ``irecv``."""
        if not self.done:
            world = self.comm.world
            with world._cond:
                world._wait_until(self.comm.world_rank, self._matched,
                                  lambda: f"waits for {self._waiting_for()}", self._peers())
            self._complete()
        self._fill(status)
        return self.result if self.buf is None and not self.is_send else True

    def Test(self, status=None):
        """True (and the operation completed) if it can complete now, else False."""
        if not self.done:
            world = self.comm.world
            with world._cond:
                world._raise_if_stopped(self.comm.world_rank)
                if not self._matched():
                    return False
            self._complete()
        self._fill(status)
        return True

    def wait(self, status=None):
        """mpi4py's lowercase ``wait``: the received object (None for a send)."""
        result = self.Wait(status)
        return None if self.is_send else result

    def test(self, status=None):
        """mpi4py's lowercase ``test``: ``(flag, object)``; the object is None until complete."""
        if not self.Test(status):
            return False, None
        return True, (None if self.is_send else self.result)

    def Cancel(self):
        """Cancel a receive that has not matched a message yet (a later message will not
        land in it); complete it with ``Wait()``, as in MPI. A send, or a receive that has
        matched, is not cancelled (and completes normally)."""
        if self.is_send or self.done:
            return
        world = self.comm.world
        with world._cond:
            if not self._matched() and self in world._posted[self.comm.world_rank]:
                world._posted[self.comm.world_rank].remove(self)
                self.done, self.cancelled = True, True

    @classmethod
    def Waitall(cls, requests, statuses=None):
        """Wait for every request in the list (as ``MPI.Request.Waitall``)."""
        for i, req in enumerate(requests):
            req.Wait(None if statuses is None else statuses[i])
        return True

    def _fill(self, status):
        if status is not None and not self.is_send and not self.cancelled:
            r = self.envelope.record
            status.source, status.tag, status.count = self.comm._local_rank[r.source], r.tag, r.nbytes

    def _complete(self):
        """Deliver the matched message into the receive buffer (in the receiver's thread)."""
        if self.is_send:
            self.done = True
            return
        env, world, rank = self.envelope, self.comm.world, self.comm.world_rank
        record = env.record
        expects_object = self.buf is None
        if expects_object != (record.kind == "object"):
            sent = "a pickled object (lowercase send)" if record.kind == "object" else "an array (Send)"
            call = "lowercase recv" if expects_object else "Recv with an array buffer"
            raise MessageMismatchError(f"rank {rank}: {call} matched {sent} from rank {record.source} "
                                       f"(tag {record.tag})")
        if expects_object:
            self.result = pickle.loads(env.payload)
        else:
            buf, payload = self.buf, env.payload
            if buf.dtype != payload.dtype or buf.size != payload.size:
                raise MessageMismatchError(
                    f"rank {rank}: Recv buffer does not fit the message from rank {record.source} "
                    f"(tag {record.tag}): message is {_describe(payload.size, payload.dtype, payload.nbytes)}, "
                    f"buffer is {_describe(buf.size, buf.dtype, buf.nbytes)}")
            if buf.size:
                buf.reshape(-1)[...] = to_device(payload, device_of(buf)).reshape(-1)
        record.t_end = time.perf_counter() - world._t0
        if not expects_object:  # the logical clock (module docstring): one receive per step
            record.step = max(record.step, world._recv_clock[rank])
            world._recv_clock[rank] = record.step + 1
            world._clock[rank] = max(world._clock[rank], record.step + 1)
        self.done = True


def _is_rank(value, size) -> bool:
    """True when ``value`` is an integer (anything ``operator.index`` accepts) in [0, size)."""
    try:
        return 0 <= operator.index(value) < size
    except TypeError:
        return False


class Comm:
    """One rank's view of a communicator of a :class:`World`, with mpi4py's method names:
    the world's own (what ``run`` passes to each rank), or one made by :meth:`Split`.
    ``rank``/``size`` are this communicator's (``Get_rank()``/``Get_size()``), ``world_rank``
    the rank in the world. ``cuda_aware`` is True: collectives may pass cupy arrays straight
    to it (see ``minidist.collectives``)."""

    cuda_aware = True

    def __init__(self, world, rank, ranks=None, context=()):
        # ranks: this communicator's rank -> world rank; context: its id, () for the world
        self._ranks = tuple(range(world.size)) if ranks is None else tuple(ranks)
        self._local_rank = {w: r for r, w in enumerate(self._ranks)}  # world rank -> ours
        self.world, self.rank, self.size = world, rank, len(self._ranks)
        self.world_rank, self._context, self._splits = self._ranks[rank], context, 0

    def __repr__(self):
        if self._context == ():
            return f"<sim.Comm rank {self.rank} of {self.size}>"
        return f"<sim.Comm rank {self.rank} of {self.size} (world ranks {', '.join(map(str, self._ranks))})>"

    def _to_world(self, rank, what):
        """The world rank of this communicator's ``rank`` (a destination or a source >= 0)."""
        if not _is_rank(rank, self.size):
            raise ValueError(f"rank {self.rank}: {what} must be a rank in 0..{self.size - 1}, got {rank!r}")
        return self._ranks[rank]

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
        env = self.world._post(self.world_rank, dest, tag, array.copy(), "array", (self._context, _P2P))
        return Request(self, send=(env, synchronous or not self.world._eager(array.nbytes)))

    def Irecv(self, buf, source=ANY_SOURCE, tag=ANY_TAG):
        """Post a receive into ``buf``; completed by ``Wait()``/``Test()``."""
        array = _array_of(buf, f"rank {self.rank}: Recv")
        source = source if source < 0 else self._to_world(source, "source")
        return self.world._post_receive(Request(self, array, source, tag))

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
        self.world._barrier(self.world_rank, self._ranks, self._context)

    def wait_all(self, requests, timeout=None):
        """Complete every request, waiting ``timeout`` seconds at most in all (None: only the
        world's timeout). A minidist extension, not in mpi4py (MPI has no wait with a deadline):
        ``minidist.collectives`` uses it where the communicator has it, and polls ``Test``
        otherwise. Deadlock detection applies while it waits. Returns the list of results
        (the object for a lowercase ``irecv``, else None). Raises :class:`WaitTimeout` with
        the indices of the requests still pending and the ranks they wait on."""
        deadline = None if timeout is None else time.perf_counter() + float(timeout)
        world, results = self.world, []
        for i, req in enumerate(requests):
            if not req.done:
                try:
                    with world._cond:
                        world._wait_until(self.world_rank, req._matched,
                                          lambda req=req: f"waits for {req._waiting_for()}", req._peers(), deadline)
                except WaitTimeout:
                    with world._cond:
                        pending = [j for j in range(i, len(requests))
                                   if not requests[j].done and not requests[j]._matched()]
                    peers = sorted({r for j in pending for r in (requests[j]._peers() or (None,))},
                                   key=lambda r: -1 if r is None else r)
                    waits = "; ".join(requests[j]._waiting_for() for j in pending)
                    raise WaitTimeout(f"rank {self.rank} waited {timeout:g} s for: {waits}", pending, peers) from None
                req._complete()
            results.append(None if req.is_send else req.result)
        return results

    # -- pickled Python objects (small metadata) -----------------------------------------
    def isend(self, obj, dest, tag=0):
        """Start sending a pickled ``obj``; eager or not by the pickle's size, as ``Isend``."""
        data = pickle.dumps(obj)
        dest = self._to_world(dest, "dest")
        env = self.world._post(self.world_rank, dest, tag, data, "object", (self._context, _P2P))
        return Request(self, send=(env, not self.world._eager(len(data))))

    def send(self, obj, dest, tag=0):
        """Send a pickled ``obj`` (blocks past the eager limit, as ``Send``)."""
        self.isend(obj, dest, tag).Wait()

    def irecv(self, buf=None, source=ANY_SOURCE, tag=ANY_TAG):
        """Post a receive of a pickled object (``buf``, mpi4py's size hint, is not needed)."""
        source = source if source < 0 else self._to_world(source, "source")
        return self.world._post_receive(Request(self, None, source, tag))

    def recv(self, buf=None, source=ANY_SOURCE, tag=ANY_TAG, status=None):
        return self.irecv(buf, source, tag).Wait(status)

    def _csend(self, obj, dest):  # inside the lowercase collectives: always buffered, as MPI's own
        self.world._post(self.world_rank, self._ranks[dest], _COLLECTIVE_TAG, pickle.dumps(obj), "object",
                         (self._context, _COLLECTIVE))

    def _crecv(self, source):
        request = Request(self, None, self._ranks[source], _COLLECTIVE_TAG, (self._context, _COLLECTIVE))
        return self.world._post_receive(request).Wait()

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
        return Comm(self.world, ranks.index(self.world_rank), ranks, (*self._context, (self._splits, int(color))))

    def Free(self):
        """mpi4py's ``Comm.Free``: nothing to release in the sim (a no-op)."""


class World:
    """N simulated ranks. ``run(fn, *args, **kwargs)`` calls ``fn(comm, *args, **kwargs)`` on
    every rank (one thread each) and returns the per-rank results; afterwards ``trace``
    holds every message of that run, and ``messages_sent``, ``bytes_sent``, ... count them.
    ``timeout`` (seconds) bounds a whole run. ``strict=True`` makes every send synchronous
    (MPI's ``Ssend``); otherwise sends of more than ``eager_limit`` bytes (default
    ``EAGER_LIMIT``) wait for their receive (module docstring). ``stranded`` lists the ranks
    of the last run that timed out while computing and could not be interrupted.

    ``bandwidth`` (bytes per second, None: instant) makes the links slow: every ordered pair
    of ranks has a link that carries one message at a time, so a message of n bytes arrives
    n / bandwidth seconds after the link is free (at the earliest, after its send). A
    receive completes (and a synchronous send too) only once its message has arrived; an
    eager send still returns at once. Used to watch communication overlap with compute.
    Raises ValueError for a bandwidth that is not a positive number."""

    def __init__(self, size, timeout=60.0, strict=False, eager_limit=EAGER_LIMIT, bandwidth=None):
        if isinstance(size, bool) or int(size) != size or size < 1:
            raise ValueError(f"world size must be a positive integer, got {size!r}")
        if not (isinstance(timeout, (int, float)) and 0 < timeout < float("inf")):
            raise ValueError(f"timeout must be a positive, finite number of seconds, got {timeout!r}")
        if isinstance(eager_limit, bool) or operator.index(eager_limit) < 0:
            raise ValueError(f"eager_limit must be a number of bytes >= 0, got {eager_limit!r}")
        self.size, self.timeout = int(size), float(timeout)
        self.strict, self.eager_limit = bool(strict), int(eager_limit)
        if bandwidth is not None and (isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float))
                                      or not 0 < bandwidth < float("inf")):
            raise ValueError(f"bandwidth must be a positive number of bytes per second or None, got {bandwidth!r}")
        self.bandwidth = None if bandwidth is None else float(bandwidth)
        self.stranded: list[int] = []
        self._cond = threading.Condition()
        self._reset()

    def _eager(self, nbytes):
        """Whether a send of ``nbytes`` is buffered (returns at once) rather than synchronous."""
        return not self.strict and nbytes <= self.eager_limit

    def _reset(self):
        n = self.size
        self.trace: list[Message] = []
        self.errors: dict[int, BaseException] = {}
        self._unexpected = [[] for _ in range(n)]  # arrived, not yet matched (arrival order)
        self._posted = [[] for _ in range(n)]  # receives posted, not yet matched (post order)
        self._blocked = [None] * n  # rank -> (ready, description, ranks waited on or None) while it waits
        self._clock = [0] * n  # the step of a rank's next send
        self._recv_clock = [0] * n  # the first step in which a rank can receive again
        self._finished: set[int] = set()
        self._failure = None  # (rank, exception) that stops the world
        self._deadlock = None
        self._barrier_arrived: dict[tuple, set[int]] = {}  # communicator context -> world ranks arrived
        self._barrier_generation: dict[tuple, int] = {}
        self._t0 = time.perf_counter()
        self._deadline = self._t0 + self.timeout
        self._link_free = {}  # (source, dest) -> perf_counter time the link is free (bandwidth)
        self._in_flight_until = 0.0  # the latest arrival of any message on a slow link

    # -- running -------------------------------------------------------------------------
    def run(self, fn, *args, **kwargs):
        """Run ``fn(comm, *args, **kwargs)`` on every rank; return the list of results.

        If any rank raises, the others are stopped and the exception of the lowest rank
        that failed first-hand (not merely stopped) is re-raised here, with ``exc.rank``
        set and a note naming the rank. All per-rank exceptions stay in ``self.errors``."""
        _warn_if_stranded()
        self._reset()
        results = [None] * self.size
        threads = [threading.Thread(target=self._rank_main, args=(r, fn, args, kwargs, results),
                                    name=f"sim-rank-{r}", daemon=True) for r in range(self.size)]
        # The ranks already share the cores; a multi-threaded BLAS inside every rank would
        # oversubscribe them (20x slower for 4 ranks of small matmuls on 2 cores), so the
        # world runs with one BLAS thread, as one-process-per-core MPI jobs do.
        with threadpool_limits(limits=1):
            for t in threads:
                t.start()
            for t in threads:
                t.join(max(0.0, self._deadline - time.perf_counter()))
        if any(t.is_alive() for t in threads):  # past the timeout: stop the world; waiting ranks
            with self._cond:                    # raise at once, computing ones are interrupted
                self._failure = self._failure or (None, SimTimeoutError("timeout"))
                self._cond.notify_all()
            end = time.perf_counter() + 0.5
            for t in threads:
                t.join(max(0.0, end - time.perf_counter()))
            alive = [r for r, t in enumerate(threads) if t.is_alive()]
            self._stop_timed_out(threads, alive)
        if self.errors:
            firsthand = {r: e for r, e in self.errors.items() if not isinstance(e, RankAborted)}
            rank = min(firsthand or self.errors)
            exc = self.errors[rank]
            note = f"raised on rank {rank} of {self.size} (minidist.sim)"
            if hasattr(exc, "add_note") and note not in getattr(exc, "__notes__", []):
                exc.add_note(note)
            exc.rank = rank
            raise exc
        return results

    def _stop_timed_out(self, threads, alive):
        """The run is past its timeout and ranks ``alive`` are still computing (outside any
        communication call). Stop the world, interrupt those threads (an exception raised at
        their next Python instruction), and raise SimTimeoutError naming every rank's state.
        A thread that cannot be interrupted (in a long C call or a sleep) is kept in
        ``self.stranded`` and every later run warns while it lives: it would share the CPU."""
        for r in alive:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(threads[r].ident),
                                                       ctypes.py_object(_RankInterrupted))
        end = time.perf_counter() + 0.5
        for r in alive:
            threads[r].join(max(0.0, end - time.perf_counter()))
        self.stranded = [r for r in alive if threads[r].is_alive()]
        _stranded.extend(threads[r] for r in self.stranded)
        parts = []
        for r in range(self.size):
            if r in self.stranded:
                parts.append(f"rank {r} was computing and could not be interrupted (inside C code or a sleep): "
                             "it still runs in the background and slows later runs until it ends "
                             "(restart the Python process to stop it)")
            elif r in alive:
                parts.append(f"rank {r} was computing (outside communication) and has been interrupted")
            elif isinstance(self.errors.get(r), SimTimeoutError):
                suffix = f", and the sim world timed out after {self.timeout:g} s"
                parts.append(str(self.errors[r]).removesuffix(suffix))
        raise SimTimeoutError(f"sim world timed out after {self.timeout:g} s: " + "; ".join(parts))

    def _rank_main(self, rank, fn, args, kwargs, results):
        try:
            results[rank] = fn(Comm(self, rank), *args, **kwargs)
        except BaseException as exc:  # reported to the caller by run
            self.errors[rank] = exc
            with self._cond:
                if self._failure is None and not isinstance(exc, RankAborted):
                    self._failure = (rank, exc)
        finally:
            with self._cond:
                self._finished.add(rank)
                self._cond.notify_all()

    # -- the trace -----------------------------------------------------------------------
    def _select(self, kind):
        if kind not in ("array", "object", "all"):
            raise ValueError(f"kind must be 'array', 'object' or 'all', got {kind!r}")
        return [m for m in self.trace if kind == "all" or m.kind == kind]

    def messages_sent(self, rank, kind="array"):
        """Number of messages ``rank`` sent (``kind``: "array", "object" or "all")."""
        return sum(1 for m in self._select(kind) if m.source == rank)

    def bytes_sent(self, rank, kind="array"):
        return sum(m.nbytes for m in self._select(kind) if m.source == rank)

    def messages_received(self, rank, kind="array"):
        return sum(1 for m in self._select(kind) if m.dest == rank and m.t_end is not None)

    def bytes_received(self, rank, kind="array"):
        return sum(m.nbytes for m in self._select(kind) if m.dest == rank and m.t_end is not None)

    def num_steps(self, kind="array"):
        """Logical steps the run's messages span (the latency terms of the algorithm)."""
        return 1 + max((m.step for m in self._select(kind)), default=-1)

    def summary(self):
        """A table of array messages and bytes per rank (pickled metadata on the last line)."""
        head = f"{'rank':>4} {'msgs sent':>10} {'bytes sent':>12} {'msgs recv':>10} {'bytes recv':>12}"
        rows = [head]
        for r in range(self.size):
            rows.append(f"{r:>4} {self.messages_sent(r):>10} {self.bytes_sent(r):>12} "
                        f"{self.messages_received(r):>10} {self.bytes_received(r):>12}")
        total = sum(self.bytes_sent(r) for r in range(self.size))
        rows.append(f"{'all':>4} {len(self._select('array')):>10} {total:>12}   "
                    f"in {self.num_steps()} steps")
        objects = self._select("object")
        if objects:
            rows.append(f"(+ {len(objects)} pickled metadata messages, {sum(m.nbytes for m in objects)} bytes)")
        return "\n".join(rows)

    # -- message passing (called by Comm/Request) ----------------------------------------
    def _check_rank(self, rank, what):
        if not _is_rank(rank, self.size):
            raise ValueError(f"{what} must be a rank in 0..{self.size - 1}, got {rank!r}")

    def _post(self, source, dest, tag, payload, kind, context):
        self._check_rank(dest, f"rank {source}: dest")
        if tag < 0:
            raise ValueError(f"rank {source}: a send needs a tag >= 0, got {tag}")
        if kind == "array":
            count, dtype, nbytes = payload.size, str(payload.dtype), payload.nbytes
        else:
            count, dtype, nbytes = 0, "pickle", len(payload)
        with self._cond:
            self._raise_if_stopped(source)
            record = Message(len(self.trace), source, dest, tag, nbytes, count, dtype, kind,
                             self._clock[source], time.perf_counter() - self._t0)
            if kind == "array":  # pickled metadata does not move the logical clock
                self._clock[source] += 1
            self.trace.append(record)
            env = _Envelope(record, payload, context)
            if self.bandwidth is not None:
                start = max(time.perf_counter(), self._link_free.get((source, dest), 0.0))
                env.arrives = self._link_free[(source, dest)] = start + max(nbytes, 1) / self.bandwidth
                self._in_flight_until = max(self._in_flight_until, env.arrives)
            for i, req in enumerate(self._posted[dest]):
                if _matches(env, req.source, req.tag, req.context):
                    del self._posted[dest][i]
                    req.envelope, env.matched = env, True
                    break
            else:
                self._unexpected[dest].append(env)
            self._cond.notify_all()
        return env

    def _post_receive(self, req):
        rank = req.comm.world_rank
        if req.source >= 0:
            self._check_rank(req.source, f"rank {rank}: source")
        with self._cond:
            self._raise_if_stopped(rank)
            for i, env in enumerate(self._unexpected[rank]):
                if _matches(env, req.source, req.tag, req.context):
                    del self._unexpected[rank][i]
                    req.envelope, env.matched = env, True
                    self._cond.notify_all()  # a synchronous sender may be waiting for this
                    break
            else:
                self._posted[rank].append(req)
        return req

    def _barrier(self, rank, members, context):
        """World rank ``rank`` enters the barrier of the communicator ``context`` whose
        world ranks are ``members``."""
        with self._cond:
            self._raise_if_stopped(rank)
            generation = self._barrier_generation.setdefault(context, 0)
            arrived = self._barrier_arrived.setdefault(context, set())
            arrived.add(rank)
            if len(arrived) == len(members):
                arrived.clear()
                self._barrier_generation[context] += 1
                self._cond.notify_all()
                return

            def absent():
                return tuple(sorted(set(members) - arrived))

            def missing():
                return f"waits in Barrier ({_plural_ranks(absent())} not arrived)"

            self._wait_until(rank, lambda: self._barrier_generation[context] != generation, missing, absent)

    # -- blocking, deadlock detection, teardown (called with self._cond held) -------------
    def _raise_if_stopped(self, rank, description=None):
        if self._deadlock is not None:
            raise DeadlockError(self._deadlock)
        if self._failure is not None:
            failed, exc = self._failure
            if isinstance(exc, SimTimeoutError):
                waiting = f"rank {rank} {description()}, and" if description else f"rank {rank}:"
                raise SimTimeoutError(f"{waiting} the sim world timed out after {self.timeout:g} s")
            raise RankAborted(f"rank {rank} stopped because rank {failed} raised "
                              f"{type(exc).__name__}: {exc}")

    def _wait_until(self, rank, ready, description, peers=None, deadline=None):
        """Wait on the condition until ``ready()``; raise on deadlock, failure or timeout.
        ``description()`` says what the rank waits for; ``peers`` (ranks, a function giving
        them, or None for "any rank") is who could release it, for the wait-for cycle.
        ``deadline`` (perf_counter seconds): raise WaitTimeout then (Comm.wait_all)."""
        self._blocked[rank] = (ready, description, peers)
        try:
            while not ready():
                self._raise_if_stopped(rank, description)
                self._detect_deadlock()
                self._raise_if_stopped(rank, description)
                now = time.perf_counter()
                if deadline is not None and now >= deadline and now < self._deadline:
                    raise WaitTimeout(f"rank {rank} {description()}")
                remaining = self._deadline - now
                if remaining <= 0:
                    self._failure = self._failure or (rank, SimTimeoutError("timeout"))
                    self._cond.notify_all()
                    raise SimTimeoutError(f"rank {rank} {description()}, and the sim world timed "
                                          f"out after {self.timeout:g} s")
                wake = remaining if deadline is None else min(remaining, deadline - now)
                if self._in_flight_until > now:  # a message on a slow link may arrive before anyone notifies
                    wake = min(wake, max(self._in_flight_until - now, 1e-4), 1e-3)
                self._cond.wait(min(wake, 1.0))
        finally:
            self._blocked[rank] = None

    def _detect_deadlock(self):
        """If every live rank is blocked and none is ready, declare a deadlock, naming what
        each rank waits for and, if there is one, a cycle of ranks waiting on each other."""
        live = [r for r in range(self.size) if r not in self._finished]
        if self._in_flight_until > time.perf_counter():  # a slow link is still delivering
            return
        if not all(self._blocked[r] is not None and not self._blocked[r][0]() for r in live):
            return
        parts = []
        for r in range(self.size):
            if r in self._finished:
                parts.append(f"rank {r} has returned" if r not in self.errors else f"rank {r} has failed")
            else:
                parts.append(f"rank {r} {self._blocked[r][1]()}")
        waits_on = {}
        for r in live:
            peers = self._blocked[r][2]
            peers = peers() if callable(peers) else peers
            waits_on[r] = [q for q in live if q != r] if peers is None else [q for q in peers if q in live]
        cycle = _find_cycle(waits_on)
        head = "deadlock, no rank can proceed"
        if cycle:
            head += " (wait-for cycle: " + " -> ".join(f"rank {r}" for r in cycle) + ")"
        self._deadlock = head + ": " + "; ".join(parts)
        self._cond.notify_all()


def _find_cycle(waits_on):
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


def run(fn, world_size, *args, **kwargs):
    """Run ``fn(comm, *args, **kwargs)`` on ``world_size`` simulated ranks; return the list of
    per-rank results (**contract**). For the message trace, use ``World(n).run(fn)``."""
    return World(world_size).run(fn, *args, **kwargs)
