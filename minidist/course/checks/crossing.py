"""Whether a rank's answer came through the communicator, as it must under mpiexec.

On the sim the ranks are threads of one process. A learner's function can therefore leave its
array in a dict the other ranks' threads read (or draw the other ranks' inputs again from the
check's seeds, or return the check's own reference) and send zeros for the look of the traffic:
the sums are right, the bytes counted are right, and under ``mpiexec``, where every rank is a
process of its own, nothing of it works. Counting what was sent cannot see that; what was
*received* can. :func:`check_received` runs the learner's function once more on every rank of
a world whose messages are all spoiled in transit (:class:`ScrambledComm`: every array a rank
sends arrives as NaN, integers and booleans flipped bit for bit) and fails when some rank still
returns any of the right values: they did not depend on what it received. In the answers these
checks ask for (a sum over the ranks, a ZeRO step on their mean gradient) every value depends on
every rank, so an honest answer gets NaN everywhere (or raises, which counts as depending too),
whatever algorithm it uses; a rank whose gradients came through shared memory and whose other
shards came by an honest all-gather keeps its own shard right, and fails.

The checks of exercises 14, 15 and 17 use it; they also draw their inputs afresh at every call
(``secrets``), so that no rank can compute another's from a seed it has read. This is not a
sandbox: code that looks for the wrapper can tell it is there.
"""
from __future__ import annotations

import numpy as np

from minidist import sim
from minidist.course.checks import fail

RECEIVED_HINT = ("send the arrays through comm and compute from what arrives: every simulated rank is a thread of "
                 "this one process, but under mpiexec each rank is a process of its own, so an array left in memory "
                 "the ranks share (a global, a class attribute), another rank's input drawn again from the check's "
                 "seeds, or the check's own answer, is not there; the check's inputs are new at every call anyway")


def spoiled(array: np.ndarray) -> np.ndarray:
    """A copy of ``array`` whose every value is wrong: floats and complex NaN, integers and
    booleans bit-flipped; other dtypes (none that MPI sends) unchanged."""
    array = np.asarray(array)
    if array.dtype.kind in "fc":
        return np.full_like(array, np.nan)
    if array.dtype.kind in "iub":
        return np.invert(array)
    return array.copy()


def _spoiled_buffer(buf):
    """``buf`` (an array or mpi4py's ``[array, datatype]``) with its array :func:`spoiled`."""
    if isinstance(buf, (list, tuple)) and buf and hasattr(buf[0], "dtype"):
        return type(buf)([spoiled(buf[0]), *buf[1:]])
    return spoiled(buf) if hasattr(buf, "dtype") else buf


class ScrambledComm:
    """A communicator that delivers every array message this rank sends spoiled (:func:`spoiled`)
    and is otherwise ``comm``: the receives, the pickled lowercase calls (metadata, such as the
    collectives' agreement) and every other attribute pass through; a communicator ``Split`` from
    it spoils its messages too."""

    def __init__(self, comm):
        self.comm = comm

    def __getattr__(self, name):
        if name == "comm":  # not set yet (copy, pickle): do not recurse
            raise AttributeError(name)
        return getattr(self.comm, name)

    def Split(self, *args, **kwargs):
        """``comm.Split``, the new communicator spoiling its messages too (a hierarchical answer
        talks over the node's and the column's communicators)."""
        sub = self.comm.Split(*args, **kwargs)
        return None if sub is None else ScrambledComm(sub)

    def Send(self, buf, dest, *args, **kwargs):
        return self.comm.Send(_spoiled_buffer(buf), dest, *args, **kwargs)

    def Ssend(self, buf, dest, *args, **kwargs):
        return self.comm.Ssend(_spoiled_buffer(buf), dest, *args, **kwargs)

    def Isend(self, buf, dest, *args, **kwargs):
        return self.comm.Isend(_spoiled_buffer(buf), dest, *args, **kwargs)

    def Issend(self, buf, dest, *args, **kwargs):
        return self.comm.Issend(_spoiled_buffer(buf), dest, *args, **kwargs)

    def Sendrecv(self, sendbuf, dest, *args, **kwargs):
        return self.comm.Sendrecv(_spoiled_buffer(sendbuf), dest, *args, **kwargs)

    def Sendrecv_replace(self, buf, dest, *args, **kwargs):
        array = buf[0] if isinstance(buf, (list, tuple)) else buf
        array[...] = spoiled(array)  # sent spoiled; what arrives replaces it anyway
        return self.comm.Sendrecv_replace(buf, dest, *args, **kwargs)


class PartlyScrambledComm(ScrambledComm):
    """A :class:`ScrambledComm` that spoils only the array messages ``which(array, tag)`` picks
    (the others arrive as sent): to ask whether one part of an answer, such as its gradients'
    sum, came through the communicator while the rest of it did honestly."""

    def __init__(self, comm, which):
        super().__init__(comm)
        self.which = which

    def _picked(self, buf, args, kwargs) -> bool:
        array = buf[0] if isinstance(buf, (list, tuple)) and buf else buf
        tag = kwargs.get("tag", args[0] if args else None)
        return hasattr(array, "dtype") and bool(self.which(array, tag))

    def Split(self, *args, **kwargs):
        sub = self.comm.Split(*args, **kwargs)
        return None if sub is None else PartlyScrambledComm(sub, self.which)

    def Send(self, buf, dest, *args, **kwargs):
        sent = super().Send if self._picked(buf, args, kwargs) else self.comm.Send
        return sent(buf, dest, *args, **kwargs)

    def Ssend(self, buf, dest, *args, **kwargs):
        sent = super().Ssend if self._picked(buf, args, kwargs) else self.comm.Ssend
        return sent(buf, dest, *args, **kwargs)

    def Isend(self, buf, dest, *args, **kwargs):
        sent = super().Isend if self._picked(buf, args, kwargs) else self.comm.Isend
        return sent(buf, dest, *args, **kwargs)

    def Issend(self, buf, dest, *args, **kwargs):
        sent = super().Issend if self._picked(buf, args, kwargs) else self.comm.Issend
        return sent(buf, dest, *args, **kwargs)

    def Sendrecv(self, sendbuf, dest, *args, **kwargs):
        sendtag = kwargs.get("sendtag", args[0] if args else None)
        sent = super().Sendrecv if self._picked(sendbuf, (sendtag,), {}) else self.comm.Sendrecv
        return sent(sendbuf, dest, *args, **kwargs)

    def Sendrecv_replace(self, buf, dest, *args, **kwargs):
        sendtag = kwargs.get("sendtag", args[0] if args else None)
        sent = super().Sendrecv_replace if self._picked(buf, (sendtag,), {}) else self.comm.Sendrecv_replace
        return sent(buf, dest, *args, **kwargs)


def _scrambled_rank(comm, still_right, args, which=None):
    try:
        with np.errstate(all="ignore"):
            scrambled = ScrambledComm(comm) if which is None else PartlyScrambledComm(comm, which)
            return bool(still_right(scrambled, *args))
    except Exception:  # raising on what arrived spoiled is depending on it (AssertionError included)
        return False


def check_received(what: str, world_size: int, still_right, *args, hint: str = RECEIVED_HINT,
                   which=None) -> None:
    """Run ``still_right(comm, *args)`` on every rank of a simulated world of ``world_size`` whose
    array messages all arrive spoiled (``comm`` a :class:`ScrambledComm`); ``still_right`` calls
    the learner's function as the check did and returns True when any value of this rank's answer
    is still the right one (:func:`any_right`). Fails (AssertionError naming the ranks, with
    ``hint``) when any rank's is: those values did not depend on what it received. A rank that
    raises counts as depending; so does a world that ends in a deadlock or a timeout. Nothing to
    check on one rank. ``which(array, tag)``: spoil only the messages it picks
    (:class:`PartlyScrambledComm`), default all."""
    if world_size < 2:
        return
    try:
        same = sim.World(world_size, timeout=30).run(_scrambled_rank, still_right, args, which)
    except Exception:  # the world ended otherwise: what arrived mattered
        return
    ranks = [rank for rank, right in enumerate(same) if right]
    if ranks:
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        fail(what, f"with every array message spoiled in transit (NaN arrives), {who} still returned right values: "
                   "they did not depend on what your rank received", hint)


def any_right(got, want, atol: float) -> bool:
    """Whether ``got`` has ``want``'s shape and any of its values equals ``want``'s there (to
    ``atol``; NaN equals nothing)."""
    got = np.asarray(got, dtype=np.float64) if isinstance(got, np.ndarray) else None
    return got is not None and got.shape == np.shape(want) and bool(np.isclose(got, want, rtol=0, atol=atol).any())


__all__ = ["RECEIVED_HINT", "PartlyScrambledComm", "ScrambledComm", "any_right", "check_received", "spoiled"]
