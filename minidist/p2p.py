"""Point-to-point with deadlines: posting, THE one wait, and the agreement round.

Every message of the engine goes through this module: the collectives
(:mod:`minidist.collectives`, blocking or not), the pipeline executor's activations and
gradients, and the parameter server's requests and answers. It owns three things.

Posting. :func:`post_send`, :func:`post_recv` and :func:`post_exchange` post the ``Isend``/
``Irecv`` of one round and return an *exchange*, the tuple ``(requests, peers, receives)``:
the requests (receives first), the rank each one talks to, and how many of the first are
receives. The step generators of :mod:`minidist.collectives` yield exchanges; whoever drives
them waits for each with :func:`wait_all`. A GPU (CuPy) array handed to MPI must be finished
computing, so posting waits for its stream first. An MPI library that is not CUDA-aware must
never see GPU memory (it crashes, it does not fail): :func:`stage_to_host` gives a host copy
to send and :func:`receive_buffer` a host buffer to receive into, unless the communicator is
CUDA-aware (:func:`cuda_aware`).

The one wait. MPI's blocking ``Wait`` cannot time out, and a rank that died or called
another collective would leave the others waiting forever. So the engine never calls it:
:func:`wait_all` polls ``Test`` -- busy (yielding the core every 16 polls, as MPICH's own
blocking wait does) for the first ``SPIN_SECONDS`` = 50 ms, then sleeping between polls,
10 us doubling to 1 ms -- until its deadline: ``get_timeout()`` seconds, the ONE default of
the engine (``DEFAULT_TIMEOUT`` = 300, or the environment variable ``MINIDIST_TIMEOUT``;
:func:`set_timeout` changes it), or the caller's own ``timeout``. Measured against MPI's
blocking calls on 2 ranks (MPICH 5.0.2, 4 B to 256 KiB): about 1 us more per collective. On
expiry the waiting rank cancels its pending receives (so that a late message cannot land in
a later call) and raises :class:`CollectiveTimeout` naming the ranks it has not heard from,
or what the caller's ``blame`` returns (a parameter server waiting for "any worker" knows
better than its requests which worker is silent). :func:`test_all` is the same check without
waiting, for the non-blocking collectives. A communicator that waits with a deadline itself
(``minidist.sim``'s ``Comm.wait_all``, which keeps its deadlock detection) is asked to.

Agreement. :func:`agree` is the one "agree or raise on every rank" round: every rank sends
its pickled ``(problem, payload)`` straight to every other rank; if any rank found a problem,
every rank raises the same error. The collectives, ``DistributedDataParallel``, the pipeline
executor, checkpoints and the exercise checks use it, so bad arguments on one rank end every
rank with one message instead of a hang. On mpi4py's own communicators the collectives first
try a cheaper form of the same round, a 32-byte binary header (:mod:`minidist.agreement_header`,
which posts its own Isend/Irecv and waits with :func:`wait_all`), and come here when it differs.

Sources: MPI 4.0 standard, sections 3.7 (nonblocking communication, ``MPI_Test``) and 3.8.4
(``MPI_Cancel``); MPICH's progress engine for the spin-then-yield wait.

Longer than 400 lines: the one message layer: posting, THE one deadline-bounded wait and the
agreement round use each other's state, and every wing's timeouts come from here.
"""
from __future__ import annotations

import math
import os
import pickle
import time
import weakref

import numpy

from minidist.backend import device_of, get_array_module, to_device, to_numpy

DEFAULT_TIMEOUT = 300.0  # seconds: the engine's one default deadline (MINIDIST_TIMEOUT, set_timeout change it)
SPIN_SECONDS = 0.05  # busy-poll this long before sleeping between polls
_POLLS_BEFORE_YIELD = 16  # while spinning, give the core away this often (MPICH does too)
_MAX_PAUSE = 1e-3
_AGREE_MESSAGE_BYTES = 8192  # a bigger agreement record follows its size in a second message
AGREE_TAG = 7700  # the agreement round's messages (collectives.TAGS["agree"])
_AGREE_BUFFERS = "p2p.agree_buffers"  # the key of a communicator's agreement receive buffers in attached(comm)

_timeout = None  # the deadline in seconds, once known (set_timeout, or MINIDIST_TIMEOUT read once)
_attached = weakref.WeakKeyDictionary()  # communicator -> its dict (attached)
_attached_by_id = {}  # id -> (communicator, its dict), for communicators that cannot be hashed (mpi4py's)


class CollectiveError(ValueError):
    """The ranks passed arguments to a collective that cannot work (raised on every rank)."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A wait ran past its deadline (``get_timeout()``, or the caller's). Raised on every rank
    that was waiting; ``missing`` lists the ranks this one had not heard from, ``rank`` this
    rank."""

    def __init__(self, message, rank=None, missing=()):
        super().__init__(message)
        self.rank, self.missing = rank, list(missing)


# ---------------------------------------------------------------------------------------
# The deadline
# ---------------------------------------------------------------------------------------


def set_timeout(seconds):
    """Set the deadline of every wait that does not name its own (the collectives, ``agree``,
    DDP, the pipeline executor, the parameter servers), in seconds: a positive finite number.
    ``None`` goes back to the default: ``MINIDIST_TIMEOUT`` (read again now) or
    ``DEFAULT_TIMEOUT`` = 300. Per process: under MPI, set it on every rank. Raises ValueError
    for anything else (or for a bad ``MINIDIST_TIMEOUT`` when given None). Returns the previous
    setting, for ``set_timeout(previous)`` to restore (None: the default)."""
    global _timeout
    previous = _timeout
    if seconds is None:
        _timeout = None
        get_timeout()
    else:
        _timeout = _positive_seconds(seconds, "p2p.set_timeout")
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


# ---------------------------------------------------------------------------------------
# Posting one round, and host staging
# ---------------------------------------------------------------------------------------


def post_send(comm, buf, dest, tag):
    """Post ``Isend(buf)`` to ``dest``: returns the exchange ``([request], [dest], 0)``.
    ``buf``: a C-contiguous array MPI can send (on the GPU only for a CUDA-aware ``comm``:
    :func:`stage_to_host`); it must stay unchanged until the request completes."""
    _ready(buf)
    return [comm.Isend(buf, dest=dest, tag=tag)], [dest], 0


def post_recv(comm, buf, source, tag):
    """Post ``Irecv(buf)`` from ``source``: returns the exchange ``([request], [source], 1)``."""
    return [comm.Irecv(buf, source=source, tag=tag)], [source], 1


def post_exchange(comm, sendbuf, dest, recvbuf, source, tag):
    """Post a receive from ``source`` and a send to ``dest`` at once (MPI's ``Sendrecv``, but
    non-blocking): returns ``([recv, send], [source, dest], 1)``. Neither side can deadlock
    on the other's send, whatever the size."""
    _ready(sendbuf)
    return [comm.Irecv(recvbuf, source=source, tag=tag), comm.Isend(sendbuf, dest=dest, tag=tag)], [source, dest], 1


def _ready(buf):
    """A GPU array handed to MPI must be finished computing: wait for the current stream."""
    if type(buf) is not numpy.ndarray and device_of(buf) == "cuda":
        get_array_module(buf).cuda.get_current_stream().synchronize()


def cuda_aware(comm) -> bool:
    """Whether ``comm`` may be handed GPU (CuPy) buffers: its ``cuda_aware`` attribute when it has
    one (``minidist.sim`` says True), else ``MINIDIST_CUDA_AWARE_MPI=1`` in the environment (an MPI
    built with CUDA support; mpi4py cannot tell). Default: False."""
    aware = getattr(comm, "cuda_aware", None)  # minidist.sim says True; mpi4py has no such attribute
    if isinstance(aware, bool):
        return aware
    return os.environ.get("MINIDIST_CUDA_AWARE_MPI", "0") == "1"


def stage_to_host(comm, x):
    """(array to communicate, function that moves a result back to x's device): a CuPy array
    goes through host memory (a copy) unless the communicator is CUDA-aware (:func:`cuda_aware`);
    a NumPy array, or any array on a CUDA-aware communicator, is returned as it is (and the
    function returns its argument). An MPI that is not CUDA-aware handed a GPU pointer crashes
    (a segmentation fault), it does not fail."""
    if type(x) is numpy.ndarray or device_of(x) == "cpu" or cuda_aware(comm):
        return x, _identity
    return to_numpy(x), _to_cuda


def receive_buffer(comm, shape, dtype, like):
    """(an empty array of ``shape`` and ``dtype`` that MPI may receive into, function that moves
    it to ``like``'s device): on ``like``'s device, or on the host when ``like`` is a GPU array
    and ``comm`` is not CUDA-aware (the receiving half of :func:`stage_to_host`)."""
    if device_of(like) == "cuda" and not cuda_aware(comm):
        return numpy.empty(shape, dtype=dtype), _to_cuda
    return get_array_module(like).empty(shape, dtype=dtype), _identity


def _identity(y):
    return y


def _to_cuda(y):
    return None if y is None else to_device(y, "cuda")


# ---------------------------------------------------------------------------------------
# The one wait, with a deadline
# ---------------------------------------------------------------------------------------


def wait_all(comm, requests, peers, what, *, receives=0, timeout=None, blame=None) -> list:
    """Complete point-to-point requests within a deadline: the one way the engine waits.

    Args:
        comm: an mpi4py or ``minidist.sim`` communicator.
        requests: ``Isend``/``Irecv`` requests, the receives first (an exchange's first item).
        peers: the rank each request talks to (named when it times out; None: any rank).
        what: what is being waited for, for the message (e.g. ``"stage 2 waiting for ..."``).
        receives: how many of the first requests are receives (cancelled on expiry).
        timeout: seconds; None: :func:`get_timeout`; ``math.inf``: no deadline.
        blame: optional ``blame(pending) -> exception``, called on expiry with the indices of
            the requests still pending; its exception is raised instead of CollectiveTimeout.
            Give one when you know better than the requests who is at fault. On the sim such
            a wait speaks in a deadlock: instead of every rank raising ``DeadlockError``, the
            earliest deadline among the blocked ranks that gave a blame expires at once (nothing
            could arrive before it), so its blame is the error the run ends with.

    Under MPI it polls ``Test``: a short busy spin, then sleeps doubling up to 1 ms. On the sim
    it waits in ``comm.wait_all`` (deadlock detection included). Returns the requests' results
    (None for each, as ``Waitall``). Raises CollectiveTimeout (a TimeoutError) naming the ranks
    not heard from, or blame's exception.
    """
    return _wait(comm, requests, peers, what, receives, False, timeout, blame)


def _wait(comm, requests, peers, what, receives, pickled, timeout, blame=None):
    """wait_all; ``pickled``: lowercase requests, whose ``test()`` gives ``(flag, object)``."""
    sim_wait = getattr(comm, "wait_all", None)
    if sim_wait is not None:
        timeout = get_timeout() if timeout is None else timeout
        try:
            return sim_wait(requests, timeout, expire_on_deadlock=True) if blame else sim_wait(requests, timeout)
        except TimeoutError as exc:
            pending = list(getattr(exc, "pending", range(len(requests))))
            raise _expired(comm, what, requests[:receives], pending, peers, timeout, blame) from None
    results, pending = [None] * len(requests), range(len(requests))
    testall = getattr(type(requests[0]), "testall", None) if pickled and requests else None
    for _ in range(_POLLS_BEFORE_YIELD):  # most waits end within a few polls: no clock, no bookkeeping yet
        if testall is not None:  # mpi4py's MPI_Testall: one call, completes none unless all are done
            done, objects = testall(requests)
            if done:
                return objects
        elif pickled:
            pending = [j for j in pending if not _took(requests[j], results, j)]
            if not pending:
                return results
        else:
            for request in requests:  # stops at the first pending request; Test of a done one is cheap
                if not request.Test():
                    break
            else:
                return results
    timeout = get_timeout() if timeout is None else timeout
    return _poll(comm, requests, peers, what, receives, pickled, timeout, blame, results, list(pending))


def _poll(comm, requests, peers, what, receives, pickled, timeout, blame, results, pending):
    """The rest of a wait that did not end at once: poll, yield the core every 16 polls for
    SPIN_SECONDS, then sleep between polls (10 us doubling to 1 ms), until the deadline."""
    start, pause, polls = time.perf_counter(), 0.0, 0
    while True:
        if pickled:
            pending = [j for j in pending if not _took(requests[j], results, j)]
        else:
            pending = [j for j in pending if not requests[j].Test()]
        if not pending:
            return results
        elapsed = time.perf_counter() - start
        if elapsed > timeout:
            raise _expired(comm, what, requests[:receives], pending, peers, timeout, blame)
        polls += 1
        if elapsed > SPIN_SECONDS:
            pause = min(max(2 * pause, 1e-5), _MAX_PAUSE)
            time.sleep(pause)
        elif polls % _POLLS_BEFORE_YIELD == 0:
            os.sched_yield()


def _took(request, results, j):
    done, obj = request.test()
    if done:
        results[j] = obj
    return done


def test_all(comm, requests, peers, what, *, receives=0, since, timeout=None) -> bool:
    """Whether every request is complete, without waiting (``MPI_Testall``, with the deadline).

    ``since``: the ``time.perf_counter()`` at which the requests were posted; once they have
    been pending longer than ``timeout`` (None: :func:`get_timeout`), the pending receives are
    cancelled and CollectiveTimeout names the ranks not heard from, as :func:`wait_all`.
    Other arguments as :func:`wait_all`. The non-blocking collectives poll with it."""
    if all(r.Test() for r in requests):  # stops at the first pending one; the next call goes on
        return True
    timeout = get_timeout() if timeout is None else timeout
    if time.perf_counter() - since > timeout:
        pending = [j for j, r in enumerate(requests) if not r.Test()]
        raise _expired(comm, what, requests[:receives], pending, peers, timeout)
    return False


def _expired(comm, what, receives, pending, peers, timeout, blame=None):
    """Cancel the pending receives; the error to raise: blame's, or the CollectiveTimeout
    naming the ranks not heard from."""
    for j in pending:
        if j < len(receives):
            _cancel(receives[j])
    if blame is not None:
        return blame(pending)
    rank = comm.Get_rank()
    missing = sorted({peers[j] for j in pending}, key=lambda r: -1 if r is None else r)
    # a group of a larger job may name its ranks as the job knows them (the 3-D driver's mesh groups:
    # "5 (pp rank 1)"); ``missing`` stays in the group's own numbers
    names = getattr(comm, "rank_names", None)
    name = str if names is None else names.__getitem__
    who = ", ".join("any rank" if r is None else name(r) for r in missing)
    return CollectiveTimeout(
        f"{what}: rank {name(rank)} has not heard from rank{'s' if len(missing) > 1 else ''} {who} within "
        f"{timeout:g} s (the deadline of every wait: p2p.set_timeout(seconds) or MINIDIST_TIMEOUT). "
        "Is that rank dead, stuck, or calling a different collective?", rank, missing)


def _cancel(request):
    """Cancel a pending receive and complete it (MPI_Cancel, then Wait). Sends are left
    alone: MPI 4 deprecates cancelling them, and a Wait on one could block."""
    try:
        request.Cancel()
        request.Wait()
    except Exception:  # best effort: the timeout is the error to report
        pass


# ---------------------------------------------------------------------------------------
# State kept per communicator
# ---------------------------------------------------------------------------------------


def attached(comm) -> dict:
    """A dict that lives as long as ``comm``, for state kept per communicator (the arguments
    the collectives have agreed on, the queue of the non-blocking collectives): weakly keyed
    for a hashable communicator (``minidist.sim``'s), by ``id`` for mpi4py's, which cannot be
    hashed (kept alive with its dict, so that its id stays its own)."""
    if type(comm).__hash__ is None:
        entry = _attached_by_id.get(id(comm))
        if entry is None:
            entry = _attached_by_id[id(comm)] = (comm, {})
        return entry[1]
    state = _attached.get(comm)
    if state is None:
        state = _attached[comm] = {}
    return state


# ---------------------------------------------------------------------------------------
# The agreement round
# ---------------------------------------------------------------------------------------


def agree(comm, problem=None, payload=None, *, raise_problem=None, what="agree") -> list:
    """The one "agree or raise on every rank" round: every rank learns every rank's
    ``(problem, payload)`` and, if any rank found a problem, all of them raise the same error.

    One small pickled allgather of ``(problem, payload)`` (skipped when the world has one
    rank): every rank sends its pickled record straight to every other rank (p - 1 messages
    each, one round of latency, with the deadline of :func:`get_timeout`; a record over
    8 KiB follows its size in a second message). ``problem``: None, or anything picklable
    that describes what this rank found wrong (usually a string). If any rank's problem is
    not None, every rank raises for the lowest such rank r: ``raise_problem(problem, r, p)``
    when given (it must raise), else ``CollectiveError(f"{problem} (on rank {r} of {p})")``.
    ``payload``: any small picklable value to share. ``what``: the name a timeout gives the
    round (e.g. the collective that agrees). Returns the payloads in rank order (a list of p
    values). Raises CollectiveTimeout, naming the ranks not heard from, if some rank does not
    take part within the deadline.
    """
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
    others, buffers, peers = _agree_buffers(comm, rank, p)
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    small = len(data) <= _AGREE_MESSAGE_BYTES
    first = data if small else len(data)
    if p == 2:  # the common case, without the loops
        requests = [comm.irecv(buffers[0], source=others[0], tag=AGREE_TAG),
                    comm.isend(first, dest=others[0], tag=AGREE_TAG)]
    else:
        requests = [comm.irecv(buf, source=r, tag=AGREE_TAG) for r, buf in zip(others, buffers)]
        requests += [comm.isend(first, dest=r, tag=AGREE_TAG) for r in others]
    got = _wait(comm, requests, peers, what, len(others), True, None)[:len(others)]
    if not small or any(type(g) is int for g in got):
        got = _large_records(comm, others, got, data, what)
    records = [pickle.loads(g) for g in got]
    records.insert(rank, obj)
    return records


def _large_records(comm, others, got, data, what):
    """The second message of the records over _AGREE_MESSAGE_BYTES: ``got`` holds each other
    rank's record, or its size (an int) when it is large; this rank's own large ``data`` goes
    to every other rank. Returns the records in the order of ``others``."""
    large = [(r, n) for r, n in zip(others, got) if type(n) is int]
    requests = [comm.irecv(bytearray(n + 1024), source=r, tag=AGREE_TAG) for r, n in large]
    sends = [comm.isend(data, dest=r, tag=AGREE_TAG) for r in others] if len(data) > _AGREE_MESSAGE_BYTES else []
    more = _wait(comm, requests + sends, [r for r, _ in large] + others[:len(sends)], what, len(requests),
                 True, None)
    late = dict(zip([r for r, _ in large], more))
    return [late.get(r, g) for r, g in zip(others, got)]


def _agree_buffers(comm, rank, p):
    """(the other ranks, a receive buffer for each, the peers of the round's requests): made
    once per communicator and reused by every agreement round on it (each round completes, or
    cancels, its receives before it returns)."""
    state = attached(comm)
    found = state.get(_AGREE_BUFFERS)
    if found is None or len(found[0]) != p - 1:
        others = [r for r in range(p) if r != rank]
        found = state[_AGREE_BUFFERS] = (others, [bytearray(_AGREE_MESSAGE_BYTES + 1024) for _ in others],
                                         others + others)
    return found
