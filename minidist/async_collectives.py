"""Non-blocking all-reduce: start it now, keep computing, wait for it later.

``all_reduce(comm, x, async_op=True)`` (PyTorch's name) returns a :class:`Work` at once;
``work.wait()`` returns the result, ``work.is_completed()`` says whether it is there yet.
Data parallelism uses it to average one bucket of gradients while the backward pass goes on
computing the gradients of earlier layers (``minidist.parallel.data_parallel``).

How the messages make progress. MPI moves a large message only while someone is inside an
MPI call on each side (MPICH has no background thread of its own), and each step of an
all-reduce needs the step before it (the ring's step s+1 sends what step s received). Two
ways to get there:

- a communication thread that runs the blocking algorithm while the main thread computes
  (MPI initialised with ``MPI_THREAD_MULTIPLE``), or
- a **state machine**: each algorithm is written as a sequence of steps; a step posts its
  ``Isend``/``Irecv`` and hands back the requests; whoever asks ``is_completed()`` (DDP does
  at every gradient hook) tests them and, once they are done, runs the local reduction and
  posts the next step.

This module takes the state machine. It needs nothing from the MPI library beyond what the
blocking collectives use (no thread level to check, the same code on ``minidist.sim`` and
under ``mpiexec``); it adds no thread to share the GIL and the cores with the compute (on a
2-core machine running 2 ranks, a polling thread per rank steals the compute's core);
failures surface in the caller's thread, where the deadline and the sim's deadlock
detection already work; and the steps are the blocking algorithms' own
(``collectives.all_reduce_steps``: each algorithm is written once, as steps, and the blocking
call drives them at once), so the result is **bitwise equal** to the blocking
``collectives.all_reduce`` with the same algorithm. The price: progress happens only when the
program asks (at each hook, at ``wait()``), so a step that finishes between two asks waits
for the next one. A backward pass asks once per parameter: on the sim's slow link, with one
bucket per layer, that hides most of the exchange (``benchmarks/bench_data_parallel.py``); a
bucket started before one long layer (the MLP of that benchmark under ``mpiexec``) moves
little until the layer's hook, since MPICH moves a large message only inside MPI calls.

Several at once. Every rank must start its non-blocking all-reduces on a communicator in
the same order (MPI's rule for non-blocking collectives). The k-th one gets the tag
``ASYNC_TAG_BASE + k % ASYNC_TAGS`` on every rank, so the messages of different all-reduces
never meet in a receive, and within one all-reduce the messages of one tag between two ranks
stay in order (MPI's rule) as in the blocking algorithm. All the Works in flight on a
communicator advance together: each ``is_completed()`` or ``wait()`` moves every one of them
as far as it can go, so a bucket started early keeps moving while later ones start (with
one Work at a time, each step of each bucket would need its own call). At most
``ASYNC_TAGS`` may be in flight at once. ``wait()`` waits only for a step of the *oldest*
Work in flight (then advances them all, and again), whichever Work it was called on: the
oldest unfinished all-reduce of the whole world is then always advanced by every rank that
has not finished it, so ranks that wait for different Works first cannot deadlock. (Polling
all of them instead would spin: on the sim, whose ranks share the GIL, a spinning rank
slows the others' compute.) ``wait()`` returns once its Work *and every Work started before
it* are done, as on one NCCL stream.

The limit of progress by the caller. A rank advances its Works only inside these calls. A rank
blocked in anything else -- a blocking collective, a ``Recv``, a long computation -- moves
none of its Works, so its peers' Works stall too; if that rank in turn waits for one of
those peers, they deadlock (the sim detects it; under MPI the deadline ends it). A
communication thread would not have this limit. So between starting Works and waiting for
them, do not block on messages that other ranks can send only after finishing those Works.
DDP starts and waits inside one backward pass, which has no other communication.

Deadlines. Every wait has the engine's deadline (``p2p.get_timeout()``):
``wait()`` waits for each step with it (on the sim, with its deadlock detection), and
``is_completed()`` raises :class:`~minidist.p2p.CollectiveTimeout` once a step has
been pending longer than the deadline (``p2p.test_all``), naming the ranks not heard from.

Sources: the algorithms and costs are ``minidist.collectives``' (Thakur, Rabenseifner and
Gropp 2005; Patarasuk and Yuan 2009); the work handle mirrors ``torch.distributed.Work``.
"""
from __future__ import annotations

import time

from minidist import collectives
from minidist.collectives import all_reduce_steps, prepare_all_reduce
from minidist.p2p import CollectiveError, attached, test_all, wait_all

ASYNC_TAG_BASE, ASYNC_TAGS = 9000, 1000  # the k-th all-reduce on a comm uses tag 9000 + k % 1000
_WHAT = "all_reduce(async_op=True)"
_QUEUE = "async_collectives.queue"  # the key of a communicator's queue in p2p.attached(comm)


class Work:
    """A non-blocking all-reduce in progress (``torch.distributed.Work``).

    ``wait()`` -> the result (a new array of x's shape and dtype, or ``out``), waiting with
    the collectives' deadline; ``is_completed()`` -> bool, after making what progress is
    possible without waiting. ``start_time`` / ``end_time``: ``time.perf_counter()`` seconds
    when the Work was created and when its last message completed (None before), for
    timelines. Raises what the blocking all-reduce raises (CollectiveTimeout past the
    deadline), from whichever of the two calls notices.
    """

    def __init__(self, comm, steps, result, back):
        self._comm, self._steps, self._result, self._back = comm, steps, result, back
        self._requests = None  # the current step: (requests, peers, receives), posted at since
        self._since = None
        self._done = steps is None
        self.seq, self._queue = 0, None  # its start number and its communicator's queue (none on one rank)
        self.start_time = time.perf_counter()
        self.end_time = self.start_time if self._done else None

    def is_completed(self):
        """True once the result is ready. Advances every Work in flight on this communicator
        as far as it can go without waiting."""
        if not self._done:
            self._queue.progress()
        return self._done

    def wait(self):
        """Wait (with the deadline) until this all-reduce, and every one started before it on
        the communicator, is done (NCCL's stream order); return its result."""
        if self._queue is not None:  # even when done: the Works started before it must be too
            self._queue.wait(self)
        return self._back(self._result)

    # The state machine: while the current step's requests are complete, run the step's
    # local work and post the next step's messages. block: first wait (with the deadline)
    # for the current step. Returns True when the whole algorithm has finished.
    def _advance(self, block=False):
        while True:
            if self._requests is not None:
                requests, peers, receives = self._requests
                if block:
                    wait_all(self._comm, requests, peers, _WHAT, receives=receives)
                    block = False
                elif not test_all(self._comm, requests, peers, _WHAT, receives=receives, since=self._since):
                    return False
            try:
                self._requests = next(self._steps)
                self._since = time.perf_counter()
            except StopIteration:
                self._requests, self._steps, self._done = None, None, True
                self.end_time = time.perf_counter()
                return True


class _Queue:
    """The non-blocking all-reduces in flight on one communicator, and how many were started
    (which numbers the tags)."""

    def __init__(self):
        self.works, self.started = [], 0

    def next_tag(self):
        """(the start number of the next Work, its tag)."""
        if len(self.works) >= ASYNC_TAGS:
            raise CollectiveError(f"all_reduce(async_op=True): {ASYNC_TAGS} all-reduces already in flight on this "
                                  "communicator; wait() for some before starting more")
        seq = self.started
        self.started += 1
        return seq, ASYNC_TAG_BASE + seq % ASYNC_TAGS

    def progress(self):
        """Advance every Work in flight as far as it goes without waiting."""
        self.works = [w for w in self.works if not w._advance(block=False)]

    def wait(self, work):
        """Until ``work`` and every Work started before it are done: advance every Work, then
        wait for one step of the oldest (p2p.wait_all: the deadline, and on the sim
        its deadlock detection)."""
        while True:
            self.progress()
            if not self.works or self.works[0].seq > work.seq:
                return
            head = self.works[0]
            if head._advance(block=True):
                self.works.remove(head)


def _queue_of(comm):
    """The communicator's queue of Works in flight (kept in ``p2p.attached(comm)``)."""
    state = attached(comm)
    queue = state.get(_QUEUE)
    if queue is None:
        queue = state[_QUEUE] = _Queue()
    return queue


def all_reduce(comm, x, op="sum", algorithm="auto", validate=True, out=None, async_op=False):
    """``collectives.all_reduce``, optionally non-blocking (``async_op=True``: returns a
    :class:`Work` whose ``wait()`` gives the result; False: returns the result, as the
    blocking call does). Arguments, algorithms, costs and errors are the blocking call's;
    the result is bitwise equal to it for the same algorithm. ``x`` must not be modified
    until ``wait()`` returns (it is read while the messages move); ``out``, when given,
    receives the result. The argument checks (and the agreement round of ``p2p.agree``, the
    first time a communicator sees these arguments with validate=True) run before this
    returns, blocking; only the data moves later.
    Raises CollectiveError on bad arguments (on every rank with validate=True),
    CollectiveTimeout past the deadline (module docstring).
    """
    if not async_op:
        return collectives.all_reduce(comm, x, op, algorithm, validate, out)
    plan = prepare_all_reduce(comm, x, op, algorithm, validate, out)
    return start(comm, lambda tag: all_reduce_steps(comm, plan.algorithm, plan.mine, plan.result, plan.ufunc, tag),
                 plan.result, plan.finish)


def start(comm, make_steps, result, finish=None) -> Work:
    """Start any step-driven collective (``make_steps(tag)`` -> a generator of
    ``collectives``' steps, each ``yield`` posting one exchange, e.g. ``all_reduce_steps`` or
    ``collectives.ring_all_gather_steps``) as a :class:`Work` on ``comm``'s queue: it takes the
    queue's next tag and advances together with the collectives already in flight, in order.
    ``result``: the array the steps fill, which ``wait()`` returns through ``finish`` (default:
    as it is). On one rank the steps run at once and must post nothing (CollectiveError if
    they do). ``minidist.parallel.data_parallel.comm_hooks`` starts its all-gathers with it."""
    finish = finish or (lambda y: y)
    if comm.Get_size() == 1:  # nothing to wait for: run the (local) steps now
        for _ in make_steps(ASYNC_TAG_BASE):
            raise CollectiveError("internal: a one-rank collective posted messages")
        return Work(comm, None, result, finish)
    queue = _queue_of(comm)
    seq, tag = queue.next_tag()
    work = Work(comm, make_steps(tag), result, finish)
    work.seq, work._queue = seq, queue
    queue.works.append(work)
    queue.progress()  # post the first messages now (and move the others along)
    return work
