"""Point-to-point with deadlines, and the agreement round: what every collective stands on.

MPI's blocking ``Wait`` cannot time out, and a rank that died or called another collective
would leave the others waiting forever. So the engine never calls it: every message is posted
(``Isend``/``Irecv``, or the pickled ``isend``/``irecv`` for small records) and completed by
:func:`wait_all`, which polls ``Test`` -- busy (yielding the core every 16 polls, as MPICH's own
blocking wait does) for the first ``SPIN_SECONDS`` = 50 ms, then sleeping between polls, 10 us
doubling to 1 ms -- until ``get_timeout()`` seconds (default 300, or the environment variable
``MINIDIST_TIMEOUT``; :func:`set_timeout` changes it). Measured against MPI's blocking calls on
2 ranks (MPICH 5.0.2, 4 B to 256 KiB): about 1 us more per collective. A communicator that can
wait with a deadline itself (``minidist.sim``'s ``Comm.wait_all``, which keeps its deadlock
detection) is asked to. On expiry every waiting rank raises :class:`CollectiveTimeout` naming
the ranks it has not heard from, and cancels its pending receives so that a late message
cannot land in a later call.

:func:`agree` is the one "agree or raise on every rank" round: every rank sends its pickled
``(problem, payload)`` straight to every other rank; if any rank found a problem, every rank
raises the same error. The collectives (:mod:`minidist.collectives`, which re-exports these
names), ``DistributedDataParallel``, the pipeline executor, checkpoints and the exercise checks
use it, so bad arguments on one rank end every rank with one message instead of a hang.
"""
from __future__ import annotations

import math
import os
import pickle
import time

from minidist.backend import device_of, get_array_module

DEFAULT_TIMEOUT = 300.0  # seconds; MINIDIST_TIMEOUT or set_timeout() change it
SPIN_SECONDS = 0.05  # busy-poll this long before sleeping between polls
_POLLS_BEFORE_YIELD = 16  # while spinning, give the core away this often (MPICH does too)
_MAX_PAUSE = 1e-3
_AGREE_MESSAGE_BYTES = 8192  # a bigger agreement record follows its size in a second message
AGREE_TAG = 7700  # collectives.TAGS["agree"]: the agreement round's messages

_timeout = None  # the deadline in seconds, once known (set_timeout, or MINIDIST_TIMEOUT read once)


class CollectiveError(ValueError):
    """The ranks passed arguments to a collective that cannot work (raised on every rank)."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A collective waited past its deadline (``get_timeout()``). Raised on every rank that
    was waiting; ``missing`` lists the ranks this one had not heard from, ``rank`` this rank."""

    def __init__(self, message, rank=None, missing=()):
        super().__init__(message)
        self.rank, self.missing = rank, list(missing)


def set_timeout(seconds):
    """Set the deadline of every wait inside the collectives (and ``agree``), in seconds:
    a positive finite number. ``None`` goes back to the default: ``MINIDIST_TIMEOUT`` (read
    again now) or ``DEFAULT_TIMEOUT`` = 300. Per process: under MPI, set it on every rank.
    Raises ValueError for anything else (or for a bad ``MINIDIST_TIMEOUT`` when given None).
    Returns the previous setting, for ``set_timeout(previous)`` to restore (None: the default)."""
    global _timeout
    previous = _timeout
    if seconds is None:
        _timeout = None
        get_timeout()
    else:
        _timeout = _positive_seconds(seconds, "collectives.set_timeout")
    return previous


def get_timeout():
    """The deadline of each wait in seconds: ``set_timeout``'s value, else the environment
    variable ``MINIDIST_TIMEOUT`` (read at the first call), else ``DEFAULT_TIMEOUT``.
    Raises ValueError if ``MINIDIST_TIMEOUT`` is not a positive, finite number."""
    global _timeout
    if _timeout is None:  # read once: os.environ costs microseconds, and every wait asks
        text = os.environ.get("MINIDIST_TIMEOUT", "").strip()
        _timeout = _positive_seconds(text, "the environment variable MINIDIST_TIMEOUT") if text else DEFAULT_TIMEOUT
    return _timeout


def _positive_seconds(value, what):
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if isinstance(value, bool) or not (0 < seconds < math.inf):
        raise ValueError(f"{what} needs a positive, finite number of seconds, got {value!r}")
    return seconds


# One exchange, posted: (requests, the rank each talks to, how many of the first are receives).
def _post_send(comm, buf, dest, tag):
    _ready(buf)
    return [comm.Isend(buf, dest=dest, tag=tag)], [dest], 0


def _post_recv(comm, buf, source, tag):
    return [comm.Irecv(buf, source=source, tag=tag)], [source], 1


def _post_exchange(comm, sendbuf, dest, recvbuf, source, tag):
    _ready(sendbuf)
    return [comm.Irecv(recvbuf, source=source, tag=tag), comm.Isend(sendbuf, dest=dest, tag=tag)], [source, dest], 1


def _ready(buf):
    """A GPU array handed to MPI must be finished computing: wait for the current stream."""
    if device_of(buf) == "cuda":
        get_array_module(buf).cuda.get_current_stream().synchronize()


# Waiting with a deadline. MPI's Wait cannot time out, so each request is polled with Test:
# busily for SPIN_SECONDS (MPI's blocking Wait spins too, and a small message arrives well
# within it, so a healthy collective pays only a few Test calls), then with sleeps that
# double from 10 us to 1 ms (a long wait costs little CPU and at most 1 ms of extra latency).
# Past get_timeout() seconds, the ranks of the requests still pending are the ones not heard
# from; their receives are cancelled (so that a late message cannot land in a later call).
# A communicator with its own ``wait_all(requests, timeout)`` (minidist.sim, which then
# keeps its deadlock detection) waits itself. ``peers[j]``: the rank request j talks to;
# ``what``: the collective, for the error; the first ``receives`` requests are receives.
# ``pickled``: lowercase requests, whose ``test()`` returns ``(flag, object)``; the
# received objects are returned in order.
def wait_all(comm, requests, peers, what, *, receives=0, timeout=None) -> list:
    """Wait for point-to-point requests with a deadline: the one way the engine waits.

    Args:
        comm: an mpi4py or ``minidist.sim`` communicator.
        requests: ``Isend``/``Irecv`` requests, the receives first.
        peers: the rank each request talks to (named when it times out).
        what: what is being waited for, for the message (e.g. ``"stage 2 waiting for ..."``).
        receives: how many of the first requests are receives (cancelled on expiry).
        timeout: seconds; default the collectives' deadline (:func:`get_timeout`).

    On the sim the wait joins its deadlock detection (``comm.wait_all``); under MPI it polls
    ``Test``: a short busy spin, then sleeps doubling up to 1 ms. Returns the requests'
    results. Raises CollectiveTimeout (a TimeoutError) naming the ranks not heard from.
    """
    return _wait_all(comm, requests, peers, what, receives, timeout=timeout)


def _wait_all(comm, requests, peers, what, receives, pickled=False, timeout=None):
    timeout = get_timeout() if timeout is None else timeout
    wait_all = getattr(comm, "wait_all", None)
    if wait_all is not None:
        try:
            return wait_all(requests, timeout)
        except TimeoutError as exc:
            pending = list(getattr(exc, "pending", range(len(requests))))
            raise _timed_out(comm, what, requests[:receives], pending, peers, timeout) from None
    results = [None] * len(requests)
    pending = list(range(len(requests)))
    start, pause, polls = time.perf_counter(), 0.0, 0
    while True:
        if pickled:
            waiting = []
            for j in pending:
                done, obj = requests[j].test()
                if done:
                    results[j] = obj
                else:
                    waiting.append(j)
            pending = waiting
        else:
            pending = [j for j in pending if not requests[j].Test()]
        if not pending:
            return results
        elapsed = time.perf_counter() - start
        if elapsed > timeout:
            raise _timed_out(comm, what, requests[:receives], pending, peers, timeout)
        polls += 1
        if elapsed > SPIN_SECONDS:
            pause = min(max(2 * pause, 1e-5), _MAX_PAUSE)
            time.sleep(pause)
        elif polls % _POLLS_BEFORE_YIELD == 0:
            os.sched_yield()


def _timed_out(comm, what, receives, pending, peers, timeout):
    """Cancel the pending receives; the CollectiveTimeout naming the ranks not heard from."""
    for j in pending:
        if j < len(receives):
            _cancel(receives[j])
    rank, missing = comm.Get_rank(), sorted({peers[j] for j in pending})
    who = ", ".join(map(str, missing))
    return CollectiveTimeout(
        f"{what}: rank {rank} has not heard from rank{'s' if len(missing) > 1 else ''} {who} within "
        f"{timeout:g} s (the deadline of every wait: collectives.set_timeout(seconds) or MINIDIST_TIMEOUT). "
        "Is that rank dead, stuck, or calling a different collective?", rank, missing)


def _cancel(request):
    """Cancel a pending receive and complete it (MPI_Cancel, then Wait). Sends are left
    alone: MPI 4 deprecates cancelling them, and a Wait on one could block."""
    try:
        request.Cancel()
        request.Wait()
    except Exception:  # best effort: the timeout is the error to report
        pass


def agree(comm, problem=None, payload=None, *, raise_problem=None) -> list:
    """The one "agree or raise on every rank" round: every rank learns every rank's
    ``(problem, payload)`` and, if any rank found a problem, all of them raise the same error.

    One small pickled allgather of ``(problem, payload)`` (skipped when the world has one
    rank): every rank sends its pickled record straight to every other rank (p - 1 messages
    each, one round of latency, with the collectives' deadline; a record over 8 KiB
    follows its size in a second message). ``problem``: None, or anything picklable that
    describes what this rank found wrong (usually a string). If any rank's problem is not
    None, every rank raises for the lowest such rank r: ``raise_problem(problem, r, p)`` when
    given (it must raise), else ``CollectiveError(f"{problem} (on rank {r} of {p})")``.
    ``payload``: any small picklable value to share. Returns the payloads in rank order (a
    list of p values). Raises CollectiveTimeout, naming the ranks not heard from, if some
    rank does not take part within ``get_timeout()`` seconds.

    Collectives, DistributedDataParallel and the exercise checks all use this round, so that
    bad arguments on one rank end every rank with the same message instead of a hang.
    """
    return _agreement(comm, problem, payload, raise_problem, "agree")


def _agreement(comm, problem, payload, raise_problem, what):
    p = comm.Get_size()
    records = [(problem, payload)] if p == 1 else _allgather_objects(comm, (problem, payload), what)
    for rank, (their_problem, _) in enumerate(records):
        if their_problem is not None:
            if raise_problem is not None:
                raise_problem(their_problem, rank, p)
                raise CollectiveError(f"agree: raise_problem returned instead of raising for {their_problem!r}")
            raise CollectiveError(f"{their_problem} (on rank {rank} of {p})")
    return [their_payload for _, their_payload in records]


# Every rank's object on every rank, in one round: each rank posts a receive from every
# other rank, then sends its own pickle to each (p(p-1) small messages in all, and the
# latency of one: alpha + n beta per rank on a full-duplex network, against 2 ceil(lg p)
# alpha for a gather and a broadcast; fine for the small worlds of this course). mpi4py's
# pickled irecv needs a buffer as large as the message, so a record larger than
# _AGREE_MESSAGE_BYTES goes as its size first, then itself.
def _allgather_objects(comm, obj, what):
    rank, p = comm.Get_rank(), comm.Get_size()
    tag, others = AGREE_TAG, [r for r in range(p) if r != rank]
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    first = data if len(data) <= _AGREE_MESSAGE_BYTES else len(data)
    receives = [comm.irecv(bytearray(_AGREE_MESSAGE_BYTES + 1024), source=r, tag=tag) for r in others]
    sends = [comm.isend(first, dest=r, tag=tag) for r in others]
    got = _wait_all(comm, receives + sends, others + others, what, len(receives), pickled=True)[:len(others)]
    large = [(r, n) for r, n in zip(others, got) if isinstance(n, int)]
    if large or len(data) > _AGREE_MESSAGE_BYTES:
        receives = [comm.irecv(bytearray(n + 1024), source=r, tag=tag) for r, n in large]
        sends = [comm.isend(data, dest=r, tag=tag) for r in others] if len(data) > _AGREE_MESSAGE_BYTES else []
        more = _wait_all(comm, receives + sends, [r for r, _ in large] + others[:len(sends)], what, len(receives),
                         pickled=True)
        late = dict(zip([r for r, _ in large], more))
        got = [late.get(r, g) for r, g in zip(others, got)]
    records = [pickle.loads(g) for g in got]
    return records[:rank] + [obj] + records[rank:]
