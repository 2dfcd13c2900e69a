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
  ``minidist.p2p.wait_all``) waits for requests with a deadline of its own and raises
  :class:`WaitTimeout` naming what it still waits for. A deadlock ends it with
  DeadlockError like any wait, unless the caller asked ``expire_on_deadlock=True`` (it
  names the culprit itself, as a parameter server does): then, since nothing could arrive
  before any deadline, the earliest such deadline expires at once.
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

Virtual time. ``World(n, topology=sim.Topology.nodes(num_nodes, ranks_per_node, intra=(alpha,
bytes_per_s), inter=(alpha, bytes_per_s), nic="per_rank" | "shared"))`` gives every rank a
clock: a message costs alpha + bytes / bandwidth of its link class (inside a node or between
nodes), waiting for its port (a node's one network card with ``nic="shared"``);
``comm.compute(seconds)`` stands for local work. ``world.makespan``, ``world.clocks`` and
``world.timeline`` (Gantt intervals) are exact and reproducible (``minidist.sim.topology``,
``minidist.sim.virtual_time``).

The trace gives each message a logical ``step``: the round in which it travels if each
rank can send one message and receive one message per round (the single-port,
full-duplex model of the cost formulas). A rank's sends take successive rounds and start
after the round of the last message it received (a Lamport clock); a message travels no
earlier than the round after its receiver's previous receive. So the number of steps is
the number of latency (alpha) terms an algorithm pays: a ring all-reduce on p ranks takes
2(p-1), a binomial broadcast ceil(log2 p), a linear gather p-1.

The package, each file one idea: ``postoffice`` (messages in flight, matching, blocking,
deadlock detection, the trace records), ``requests`` (Request, Status and the wait with a
deadline), ``comm`` (the mpi4py API of a rank), ``world`` (the threads, the run, the
trace's counters), ``topology`` (nodes and link classes; a graph of links:
a DGX-1's NVLinks and PCIe), ``virtual_time`` (clocks, ports, timeline). Every public name is here, in ``minidist.sim``.
"""
from minidist.sim.comm import UNDEFINED, Comm
from minidist.sim.postoffice import (
    ANY_SOURCE,
    ANY_TAG,
    EAGER_LIMIT,
    DeadlockError,
    Message,
    MessageMismatchError,
    RankAborted,
    SimError,
    SimTimeoutError,
    WaitTimeout,
)
from minidist.sim.requests import Request, Status
from minidist.sim.topology import PCIE_TAGS, LinkClass, LinkGraph, Topology
from minidist.sim.virtual_time import Interval
from minidist.sim.world import World, run

__all__ = ["ANY_SOURCE", "ANY_TAG", "EAGER_LIMIT", "PCIE_TAGS", "UNDEFINED", "Comm", "DeadlockError", "Interval",
           "LinkClass", "LinkGraph", "Message", "MessageMismatchError", "RankAborted", "Request", "SimError",
           "SimTimeoutError", "Status", "Topology", "WaitTimeout", "World", "run"]
