"""Count and draw what a distributed algorithm sends.

A collective that returns the right numbers can still be the wrong algorithm: a "ring"
all-reduce that passes whole tensors around gets the sum right and sends p/2 times too
much. So every check in chapters 03 and 04 also counts the traffic, and this module holds
the two tools for that.

:class:`CountingComm` wraps any communicator with mpi4py's method names (a
``minidist.sim`` rank or ``mpi4py.MPI.COMM_WORLD``) and writes down every message this
rank sends: to whom, how many elements, how many bytes. Everything else is passed through
unchanged, except MPI's own collectives, which it refuses: an exercise that asks for a
broadcast built from ``Send``/``Recv`` should not be solved with ``Bcast``.

    counted = CountingComm(comm)
    y = my_broadcast(counted, x)          # the algorithm under test talks through the wrapper
    counted.messages, counted.elements    # what *this* rank sent
    counted.destinations                  # [2, 1]: rank 0 of 4 in a binomial tree

:func:`plot_timeline` draws a ``minidist.sim`` trace as a space-time diagram: one
horizontal line per rank, one arrow per message, from the sender at its logical step to the
receiver one step later. The steps are the sim's Lamport clock (``minidist.sim``), not wall
time, so the picture is the same on every machine. (Pipeline schedules are drawn beside them,
by ``minidist.parallel.pipeline.plot.plot_schedule``: this module imports nothing from the
parallel wings, which build on it.)
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

# MPI's collectives (mpi4py's spellings): an exercise builds these from point-to-point.
MPI_COLLECTIVES = frozenset(
    name for base in ("bcast", "scatter", "gather", "allgather", "alltoall", "reduce", "allreduce",
                      "reduce_scatter", "reduce_scatter_block", "scan", "exscan", "scatterv",
                      "gatherv", "allgatherv", "alltoallv")
    for name in (base, base.capitalize(), "I" + base, "I" + base.capitalize()))


@dataclass(frozen=True)
class Sent:
    """One message this rank sent: ``dest``, ``count`` (elements), ``nbytes``, ``dtype``."""

    dest: int
    count: int
    nbytes: int
    dtype: str


class CountingComm:
    """A communicator that counts what this rank sends and receives and otherwise does what
    ``comm`` does (the one counting communicator: the exercise checks and
    ``DistributedDataParallel``'s statistics both use it).

    Sent (counted): ``Send``, ``Ssend``, ``Isend``, ``Issend``, ``Sendrecv``,
    ``Sendrecv_replace`` (array messages: totals :attr:`messages`, :attr:`elements`,
    :attr:`nbytes`, and one :class:`Sent` per message in :attr:`sent`), and the pickling
    ``send``/``isend``/``sendrecv`` (in :attr:`object_messages`). Received:
    :attr:`bytes_received` and :attr:`messages_received` add up the array buffers of ``Recv``,
    ``Irecv`` (counted when posted), ``Sendrecv`` and ``Sendrecv_replace``.
    MPI's collectives (``Bcast``, ``Allreduce``, ``bcast``, ...) raise AttributeError with a
    hint; ``Barrier`` and every other attribute pass through.

    ``keep_payloads=True`` also keeps a copy of each message's data in :attr:`payloads` (to
    draw what travelled, not only how much); ``keep_messages=False`` keeps only the totals
    (no :attr:`sent` list, so a long training run does not grow a list per message);
    ``allow_collectives=True`` lets MPI's collectives through (uncounted), for wrapping code
    that uses them for metadata, such as ``minidist.collectives``' argument check.

    Time: code that runs whole collectives through the wrapper may wrap each in
    ``with counted.timed():``, which adds its wall-clock seconds to :attr:`seconds` (the
    tensor-parallel operators do, so their driver can report the share of a step spent
    communicating).
    """

    def __init__(self, comm, keep_payloads: bool = False, allow_collectives: bool = False,
                 keep_messages: bool = True):
        self.comm = comm
        self.keep_payloads = keep_payloads
        self.allow_collectives = allow_collectives
        self.keep_messages = keep_messages
        self.reset()

    def __repr__(self):
        return f"<CountingComm of {self.comm!r}: {self.messages} messages, {self.elements} elements sent>"

    def __getattr__(self, name):
        if name == "comm":  # not set yet (copy, pickle): do not recurse
            raise AttributeError(name)
        if name in MPI_COLLECTIVES and not self.__dict__.get("allow_collectives"):
            raise AttributeError(f"comm.{name} is MPI's own collective, and this exercise builds the "
                                 "collective from point-to-point messages: use comm.Send / comm.Recv "
                                 "(or Sendrecv, Isend/Irecv)")
        return getattr(self.comm, name)

    # -- what this rank sent and received --------------------------------------------------
    # messages: array messages sent; elements / nbytes: their elements and bytes, added up;
    # messages_received / bytes_received: array receive buffers posted and their bytes.

    @property
    def destinations(self) -> list[int]:
        """The destination of every array message, in the order they were sent."""
        if not self.keep_messages:
            raise AttributeError("destinations: this CountingComm keeps totals only (keep_messages=False)")
        return [s.dest for s in self.sent]

    def reset(self):
        """Start counting again from zero."""
        self.sent, self.payloads, self.object_messages = [], [], 0
        self.messages = self.elements = self.nbytes = 0
        self.messages_received = self.bytes_received = 0
        self.seconds = 0.0

    @contextlib.contextmanager
    def timed(self):
        """Add the wall-clock seconds (``time.perf_counter``) of the ``with`` block to
        :attr:`seconds`, even when it raises."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start

    @staticmethod
    def _array(buf):
        array = buf[0] if isinstance(buf, (list, tuple)) and buf else buf
        if not hasattr(array, "nbytes"):
            raise TypeError(f"Send and Recv need a numpy array (or [array, datatype]), got {type(array).__name__}; "
                            "the lowercase send pickles Python objects and is for small metadata only")
        return array

    def _count(self, buf, dest):
        array = self._array(buf)
        self.messages += 1
        self.elements += int(array.size)
        self.nbytes += int(array.nbytes)
        if self.keep_messages:
            self.sent.append(Sent(int(dest), int(array.size), int(array.nbytes), str(array.dtype)))
        if self.keep_payloads:
            self.payloads.append(array.copy())

    def _count_received(self, buf):
        if buf is not None:
            self.messages_received += 1
            self.bytes_received += int(self._array(buf).nbytes)

    # -- array point-to-point (counted) ---------------------------------------------------
    def Send(self, buf, dest, *args, **kwargs):
        self._count(buf, dest)
        return self.comm.Send(buf, dest, *args, **kwargs)

    def Ssend(self, buf, dest, *args, **kwargs):
        self._count(buf, dest)
        return self.comm.Ssend(buf, dest, *args, **kwargs)

    def Isend(self, buf, dest, *args, **kwargs):
        self._count(buf, dest)
        return self.comm.Isend(buf, dest, *args, **kwargs)

    def Issend(self, buf, dest, *args, **kwargs):
        self._count(buf, dest)
        return self.comm.Issend(buf, dest, *args, **kwargs)

    def Sendrecv(self, sendbuf, dest, *args, **kwargs):  # args: sendtag, recvbuf, source, recvtag, status
        self._count(sendbuf, dest)
        self._count_received(args[1] if len(args) > 1 else kwargs.get("recvbuf"))
        return self.comm.Sendrecv(sendbuf, dest, *args, **kwargs)

    def Sendrecv_replace(self, buf, dest, *args, **kwargs):
        self._count(buf, dest)
        self._count_received(buf)
        return self.comm.Sendrecv_replace(buf, dest, *args, **kwargs)

    # -- array receives (their buffers counted) --------------------------------------------
    def Recv(self, buf, *args, **kwargs):
        self._count_received(buf)
        return self.comm.Recv(buf, *args, **kwargs)

    def Irecv(self, buf, *args, **kwargs):
        self._count_received(buf)
        return self.comm.Irecv(buf, *args, **kwargs)

    # -- pickled objects (counted apart: they are not how tensors should travel) ----------
    def send(self, obj, dest, *args, **kwargs):
        self.object_messages += 1
        return self.comm.send(obj, dest, *args, **kwargs)

    def isend(self, obj, dest, *args, **kwargs):
        self.object_messages += 1
        return self.comm.isend(obj, dest, *args, **kwargs)

    def sendrecv(self, sendobj, dest, *args, **kwargs):
        self.object_messages += 1
        return self.comm.sendrecv(sendobj, dest, *args, **kwargs)


# --------------------------------------------------------------------------- pictures


def plot_timeline(trace, world_size, ax=None, title=None, label=None, colors=None):
    """Draw a space-time diagram of a ``minidist.sim`` trace (``World.trace``).

    One horizontal line per rank (rank 0 at the top); each array message is an arrow from
    (its step, sender) to (step + 1, receiver), where step is the sim's logical clock: a
    message sent at step s is received at step s + 1 at the earliest. ``label(message)``
    gives the text written on each arrow (default: its size in elements);
    ``colors(message)`` its colour (default: by sender). Returns the matplotlib Axes.
    """
    import matplotlib.pyplot as plt  # noqa: PLC0415 (drawing is optional)

    messages = [m for m in trace if m.kind == "array"]
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.55 * world_size + 1.2))
    steps = 1 + max((m.step for m in messages), default=0)
    palette = plt.get_cmap("tab10")
    for r in range(world_size):
        ax.axhline(r, color="0.85", lw=1, zorder=0)
    for m in messages:
        color = colors(m) if colors else palette(m.source % 10)
        ax.annotate("", xy=(m.step + 1, m.dest), xytext=(m.step, m.source),
                    arrowprops={"arrowstyle": "->", "color": color, "lw": 1.4, "shrinkA": 3, "shrinkB": 3})
        text = label(m) if label else f"{m.count}"
        if text:
            ax.text(m.step + 0.5, (m.source + m.dest) / 2, text, fontsize=7, ha="center", va="center",
                    color=color, bbox={"boxstyle": "round,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.8})
    ax.set_yticks(range(world_size), [f"rank {r}" for r in range(world_size)])
    ax.set_ylim(world_size - 0.5, -0.5)
    ax.set_xticks(range(steps + 1))
    ax.set_xlim(-0.3, steps + 0.3)
    ax.set_xlabel("logical step (sim clock)")
    if title:
        ax.set_title(title)
    return ax


# Names that lived here once: a clear error instead of a bare AttributeError.
MOVED = {"plot_schedule": "minidist.parallel.pipeline.plot", "SCHEDULE_COLORS": "minidist.parallel.pipeline.plot"}


def __getattr__(name):
    if name in MOVED:
        raise AttributeError(f"minidist.tracing.{name} moved beside the schedules: "
                             f"from {MOVED[name]} import {name} (or from minidist.parallel.pipeline)")
    raise AttributeError(f"module 'minidist.tracing' has no attribute {name!r}")
