"""The checks of exercises 03 and 04: a collective you wrote, run on every rank, checked for
its answer *and* for what it sent.

Each ``check_*`` function is itself collective: call it on every rank of a communicator
(a ``minidist.sim`` world or ``mpi4py.MPI.COMM_WORLD``) with your function::

    from minidist import sim
    from minidist.course.checks import collectives as collective_checks
    sim.run(lambda comm: collective_checks.check_broadcast(comm, broadcast), 4)

It runs your function on a few cases (:data:`CASES`: float64, int64, and a float32 array of
1 MiB, far past MPI's usual eager limits: MPICH buffers about 8 KiB on one machine) and
roots, with seeded data that every rank can regenerate (rank r's input is ``inputs(r, shape, dtype)``), and checks

- the result against numpy, and against MPI's own call (``Bcast``, ``Gather``,
  ``Allgather``, ``Allreduce``) when the communicator is mpi4py's; its shape and its dtype
  (float32 in, float32 out);
- that your function left its input alone (collectives here are functional);
- the traffic, counted by a :class:`minidist.tracing.CountingComm`: who sent how many
  messages of how many elements to whom. A right answer from the wrong algorithm (a linear
  broadcast, a ring that passes whole tensors) fails;
- that it does not rely on MPI buffering its sends: your function gets a communicator whose
  ``Send`` is ``Ssend`` (and ``Isend`` is ``Issend``), a send that completes only once its
  receive is posted, as MPI may make any ``Send`` past its eager limit. So the ring where
  every rank Sends and then Receives deadlocks here at every size: on the simulated world
  that is a ``DeadlockError``, reported with a hint (use ``Sendrecv``); under ``mpiexec`` it
  hangs until the launcher's timeout, which ``python -m minidist check`` reports with the
  same hint.

The ranks share what they found (one ``p2p.agree`` round) before deciding, so every
rank raises the same ``AssertionError`` ("what: problem\\nHint: ...") and none is left
waiting. When your own code raises (a stub, a deadlock, an IndexError), the check raises
:class:`minidist.course.checks.LearnerError` on that rank: the hint first, then your line,
and none of the simulator's internals. On success every rank returns the same one-line
verdict, e.g. ``"broadcast: ok (binomial tree on 4 ranks: 3 messages in 2 rounds, ...)"``.
"""
from __future__ import annotations

import functools
import hashlib
import math

import numpy as np

from minidist import sim
from minidist.course.checks import LearnerError, SynchronousSends, call_learner, check_own_code, fail
from minidist.p2p import agree
from minidist.tracing import CountingComm

SEED = 2024
MIB_ELEMENTS = (1 << 20) // 4  # float32 elements in 1 MiB
# (shape, dtype) of the arrays every check runs: the first is the one its verdict describes.
CASES = (((1000,), "float64"), ((3, 5), "int64"), ((MIB_ELEMENTS,), "float32"))
UPPERCASE_HINT = ("send arrays with the uppercase comm.Send / comm.Recv (or Sendrecv); the lowercase "
                  "send pickles a Python object and is meant for small metadata")
DTYPE_HINT = ("keep x's dtype: allocate buffers with numpy.empty_like(x) or numpy.empty(shape, x.dtype); "
              "numpy.empty(shape) and x.astype(float) give float64")


def inputs(rank: int, shape, dtype="float64", seed: int = SEED) -> np.ndarray:
    """Rank ``rank``'s input for a check, a new array: seeded standard normal values for a
    float ``dtype``, integers in [-1000, 1000) for an integer one."""
    return _inputs(rank, tuple(shape), np.dtype(dtype).str, seed).copy()


# Every rank needs every rank's input (the expected result): each is made once, read-only.
@functools.lru_cache(maxsize=64)
def _inputs(rank, shape, dtype, seed):
    rng = np.random.default_rng([seed, rank])
    if np.dtype(dtype).kind in "iu":
        x = rng.integers(-1000, 1000, shape).astype(dtype)
    else:
        x = rng.standard_normal(shape).astype(dtype)
    x.setflags(write=False)
    return x


@functools.lru_cache(maxsize=16)
def _everyone(p, shape, dtype):
    """Every rank's input stacked, shape (p, *shape): what a gather returns (read-only)."""
    xs = np.stack([_inputs(r, shape, np.dtype(dtype).str, SEED) for r in range(p)])
    xs.setflags(write=False)
    return xs


def _describe(shape, dtype):
    return f"shape {shape}" + ("" if dtype == "float64" else f" {dtype}")


def _roots(p):
    return sorted({0, p // 2, p - 1})


def _fingerprint(y):
    if y is None:
        return None
    y = np.ascontiguousarray(y)
    return (y.shape, str(y.dtype), hashlib.sha256(y.tobytes()).hexdigest())


def _run(what, fn, comm, x, **kwargs):
    """Call the learner's ``fn(comm, x, **kwargs)`` on a counting, synchronous-send
    communicator; return ``(result, counted)``."""
    counted = CountingComm(comm)
    return call_learner(what, fn, SynchronousSends(counted), x, **kwargs), counted


def _local_problem(what, y, x, x_before, expected, counted, tolerance=None):
    """(what, problem, hint) for this rank's result, or None. ``tolerance``: None for an
    exact comparison, else the largest difference allowed, elementwise."""
    if counted.object_messages:
        return (what, f"{counted.object_messages} message(s) went through the lowercase send", UPPERCASE_HINT)
    if not np.array_equal(x, x_before):
        return (what, "your function changed its input x",
                "leave the caller's array alone: receive into a new one (numpy.empty_like(x)) or work on a copy")
    if expected is None:
        if y is not None:
            return (what, f"expected None on this rank, got {type(y).__name__}",
                    "only the root returns the gathered array; the other ranks return None")
        return None
    if y is None:
        return (what, "got None", "did you forget to return the result?")
    y = np.asarray(y)
    if y.shape != expected.shape:
        return (what, f"expected shape {expected.shape}, got shape {y.shape}",
                "return an array shaped like the expected result (reshape at the end if you worked on a flat copy)")
    if y.dtype != expected.dtype:
        return (what, f"expected dtype {expected.dtype} (the dtype of x), got {y.dtype}", DTYPE_HINT)
    if tolerance is None and np.array_equal(y, expected):
        return None
    diff = np.abs(y.astype(np.float64) - expected.astype(np.float64))
    if tolerance is None:
        tolerance = 0.0
    if diff.size and not (diff <= tolerance).all():
        worst = np.unravel_index(np.argmax(diff - tolerance), diff.shape)
        return (what, f"wrong values (largest difference {np.nanmax(diff):.3g} at index "
                      f"{tuple(int(i) for i in worst)})",
                "print what each rank holds after each step on a small case, e.g. sim.run(fn, 3)")
    return None


def _raise_problem(problem, rank, p):
    name, text, hint = problem
    raise AssertionError(f"{name}: {text} (on rank {rank} of {p})\nHint: {hint}")


def _decide(comm, what, problem, counted, fingerprint=None):
    """Share (problem, traffic) with every rank (``p2p.agree``); raise the lowest
    rank's problem everywhere. Returns the traffic of every rank: a list of
    (destinations, counts, fingerprint)."""
    try:
        return agree(comm, problem, (counted.destinations, [s.count for s in counted.sent], fingerprint),
                     raise_problem=_raise_problem)
    except sim.DeadlockError:  # this rank returned; another still waits inside the learner's function
        raise LearnerError(
            f"{what}: your function returned on this rank while another rank still waits for a message "
            f"from it (a deadlock)\nHint: every Recv needs a matching Send on the rank it names, with the "
            f"same tag; count the messages each rank sends and receives on a small case") from None


def _plural(k, word):
    return f"{k} {word}{'' if k == 1 else 's'}"


# --------------------------------------------------------------------------- broadcast


def tree_rounds(traffic, root):
    """Rounds a broadcast needs, from who sent to whom (in send order): a rank that got the
    data in round t and sends to its children in turn reaches its k-th child in round t + k.
    Returns (rounds, ranks reached)."""
    arrival = {root: 0}
    frontier = [root]
    while frontier:
        rank = frontier.pop()
        for k, dest in enumerate(traffic[rank][0], 1):
            if dest not in arrival:
                arrival[dest] = arrival[rank] + k
                frontier.append(dest)
    return max(arrival.values()), set(arrival)


def check_broadcast(comm, broadcast, cases=CASES) -> str:
    """Check ``broadcast(comm, x, root=...)`` (root's x on every rank, x's shape and dtype) for
    every root in {0, p//2, p-1} and every ``(shape, dtype)`` in ``cases``: the values, and a
    binomial tree's traffic (every rank but the root receives the array once, in
    ceil(log2 p) rounds). Raises AssertionError on every rank (:class:`LearnerError` on the
    ranks where your function raised)."""
    check_own_code(broadcast, "broadcast")
    p, rank = comm.Get_size(), comm.Get_rank()
    rounds_needed = math.ceil(math.log2(p)) if p > 1 else 0
    for root in _roots(p):
        for shape, dtype in cases:
            what = f"broadcast from root {root}, {_describe(shape, dtype)}"
            n = math.prod(shape)
            x = inputs(rank, shape, dtype)
            x_before = x.copy()
            y, counted = _run(what, broadcast, comm, x, root=root)
            expected = inputs(root, shape, dtype)
            problem = _local_problem(what, y, x, x_before, expected, counted)
            if hasattr(comm, "Bcast"):  # under MPI: MPI's own answer too
                native = x.copy()
                comm.Bcast(native, root=root)
                if problem is None and not np.array_equal(np.asarray(y), native):
                    problem = (what, "differs from MPI's Bcast", "every rank must end with root's array")
            traffic = _decide(comm, what, problem, counted)
            for r, (_, counts, _) in enumerate(traffic):
                if any(c != n for c in counts):
                    fail(what, f"rank {r} sent messages of {counts} elements",
                         f"a broadcast forwards the whole array ({n} elements) in each message")
            received = [sum(d == r for dests, _, _ in traffic for d in dests) for r in range(p)]
            for r in range(p):
                want = 0 if r == root else 1
                if received[r] != want:
                    fail(what, f"rank {r} received {received[r]} messages, expected {want}",
                         "in a tree every rank but the root receives the array exactly once, from its parent")
            root_sent = len(traffic[root][0])
            if root_sent > rounds_needed:
                fail(what, f"the root sent {root_sent} messages: that is a linear broadcast",
                     f"in a binomial tree every rank that has the data passes it on, so the number of holders "
                     f"doubles each round and the root sends only ceil(log2 p) = {rounds_needed} messages")
            rounds, reached = tree_rounds(traffic, root)
            if len(reached) != p:
                fail(what, f"ranks {sorted(set(range(p)) - reached)} were never reached from the root",
                     "a rank may only forward the array after it has received it")
            if rounds != rounds_needed:
                fail(what, f"the broadcast takes {rounds} rounds, a binomial tree takes {rounds_needed}",
                     "send to the farthest rank first (the one with the largest subtree): "
                     "relative to the root, rank 0 sends to p/2 first, then p/4, ...")
    return (f"broadcast: ok (binomial tree on {_plural(p, 'rank')}: {_plural(p - 1, 'message')} in "
            f"{_plural(rounds_needed, 'round')}, the root sent {rounds_needed}; "
            f"roots {', '.join(map(str, _roots(p)))})")


# --------------------------------------------------------------------------- gather


def check_gather(comm, gather, cases=CASES) -> str:
    """Check ``gather(comm, x, root=...)`` for every root in {0, p//2, p-1} and every
    ``(shape, dtype)`` in ``cases``: root returns every rank's x stacked in rank order, shape
    (p, *x.shape), x's dtype, the others None; each non-root rank sends its x once, to the root."""
    check_own_code(gather, "gather")
    p, rank = comm.Get_size(), comm.Get_rank()
    for root in _roots(p):
        for shape, dtype in cases:
            what = f"gather to root {root}, {_describe(shape, dtype)}"
            n = math.prod(shape)
            x = inputs(rank, shape, dtype)
            x_before = x.copy()
            y, counted = _run(what, gather, comm, x, root=root)
            expected = _everyone(p, shape, dtype) if rank == root else None
            problem = _local_problem(what, y, x, x_before, expected, counted)
            if hasattr(comm, "Gather"):
                native = np.empty((p,) + tuple(shape), x.dtype) if rank == root else None
                comm.Gather(x, native, root=root)
                if problem is None and rank == root and not np.array_equal(np.asarray(y), native):
                    problem = (what, "differs from MPI's Gather", "row r of the result is rank r's x")
            traffic = _decide(comm, what, problem, counted)
            for r, (dests, counts, _) in enumerate(traffic):
                want = [] if r == root else [root]
                if dests != want:
                    fail(what, f"rank {r} sent to {dests}, expected {want}",
                         "every rank but the root sends its own x to the root, once; the root sends nothing")
                if any(c != n for c in counts):
                    fail(what, f"rank {r} sent {counts} elements, expected {n}", "send the whole x in one message")
    return (f"gather: ok ({_plural(p - 1, 'message')} of n elements, one from each other rank to the root; "
            f"roots {', '.join(map(str, _roots(p)))})")


# --------------------------------------------------------------------------- all-gather


def check_all_gather(comm, all_gather, cases=CASES) -> str:
    """Check ``all_gather(comm, x)`` for every ``(shape, dtype)`` in ``cases``: every rank
    returns every x stacked, shape (p, *x.shape), x's dtype; ring traffic: each rank sends
    p-1 messages of one block to a neighbour."""
    check_own_code(all_gather, "all_gather")
    p, rank = comm.Get_size(), comm.Get_rank()
    for shape, dtype in cases:
        what = f"all_gather, {_describe(shape, dtype)}"
        n = math.prod(shape)
        x = inputs(rank, shape, dtype)
        x_before = x.copy()
        y, counted = _run(what, all_gather, comm, x)
        expected = _everyone(p, shape, dtype)
        problem = _local_problem(what, y, x, x_before, expected, counted)
        if hasattr(comm, "Allgather"):
            native = np.empty((p,) + tuple(shape), x.dtype)
            comm.Allgather(x, native)
            if problem is None and not np.array_equal(np.asarray(y), native):
                problem = (what, "differs from MPI's Allgather", "row r of the result is rank r's x")
        traffic = _decide(comm, what, problem, counted)
        for r, (dests, counts, _) in enumerate(traffic):
            if len(dests) != p - 1:
                fail(what, f"rank {r} sent {len(dests)} messages, a ring needs p - 1 = {p - 1}",
                     "in each of the p - 1 steps every rank passes one block to its right neighbour")
            if any(d not in ((r + 1) % p, (r - 1) % p) for d in dests):
                fail(what, f"rank {r} sent to ranks {dests}",
                     f"in a ring, rank r only talks to its neighbours: rank {r} sends to {(r + 1) % p}")
            if any(c != n for c in counts):
                fail(what, f"rank {r} sent messages of {counts} elements, expected {n} each",
                     "each step passes one block, the one received in the step before")
    return (f"all_gather: ok (ring on {_plural(p, 'rank')}: each rank sent {_plural(p - 1, 'message')} "
            f"of one block to its neighbour)")


# --------------------------------------------------------------------------- ring all-reduce


def ring_elements_bounds(n: int, p: int) -> tuple[int, int]:
    """Fewest and most elements one rank sends in a ring all-reduce of n elements over p
    ranks with ``numpy.array_split`` chunks: every chunk but one in the reduce-scatter and
    every chunk but one in the all-gather, 2n - (two chunk sizes); about 2n(p-1)/p."""
    if p == 1:
        return 0, 0
    return 2 * n - 2 * math.ceil(n / p), 2 * n - 2 * (n // p)


def sum_tolerance(xs: np.ndarray) -> np.ndarray | None:
    """The largest rounding error allowed, elementwise, in the sum over axis 0 of ``xs``
    (shape (p, ...)) added up in any order: (p-1)·u·Σ|x| is the classic bound (Higham,
    *Accuracy and Stability of Numerical Algorithms*, §4.2, u = eps/2), so p·eps·Σ|x| is safe.
    None (exact) for integers."""
    if xs.dtype.kind in "iu":
        return None
    return xs.shape[0] * np.finfo(xs.dtype).eps * np.abs(xs.astype(np.float64)).sum(axis=0)


@functools.lru_cache(maxsize=16)
def _ring_expected(p, shape, dtype):
    everyone = _everyone(p, shape, dtype)
    return everyone.sum(axis=0, dtype=everyone.dtype), sum_tolerance(everyone)


RING_CASES = (((1000,), "float64"), ((10,), "float64"), ((3, 7), "int64"), ((MIB_ELEMENTS,), "float32"))


def check_ring_all_reduce(comm, all_reduce, cases=RING_CASES) -> str:
    """Check ``all_reduce(comm, x)`` (the sum of every rank's x, on every rank, x's shape and
    dtype) for every ``(shape, dtype)`` in ``cases``: values (within the rounding error of a
    sum in any order, :func:`sum_tolerance`; exact for integers; identical bytes on every
    rank), and a ring's traffic: each rank sends 2(p-1) messages to its neighbours with about
    2n(p-1)/p elements in all. The verdict describes the first case."""
    check_own_code(all_reduce, "ring all-reduce")
    p, rank = comm.Get_size(), comm.Get_rank()
    summary = ""
    for shape, dtype in cases:
        what = f"ring all-reduce, {_describe(shape, dtype)}"
        n = math.prod(shape)
        x = inputs(rank, shape, dtype)
        x_before = x.copy()
        y, counted = _run(what, all_reduce, comm, x)
        expected, tolerance = _ring_expected(p, shape, dtype)
        problem = _local_problem(what, y, x, x_before, expected, counted, tolerance)
        if hasattr(comm, "Allreduce"):
            native = np.empty(shape, x.dtype)
            comm.Allreduce(x, native)
            if problem is None and _local_problem(what, y, x, x, native, counted,
                                                  None if tolerance is None else 2 * tolerance):
                problem = (what, "differs from MPI's Allreduce", "every rank must end with the sum over all ranks")
        traffic = _decide(comm, what, problem, counted, _fingerprint(y))
        low, high = ring_elements_bounds(n, p)
        for r, (dests, counts, _) in enumerate(traffic):
            sent = sum(counts)
            if sent >= 2 * (p - 1) * n > high:
                fail(what, f"rank {r} sent {sent} elements: whole tensors of {n} elements went round the ring",
                     "cut x into p chunks (numpy.array_split) and send one chunk per step: "
                     f"about 2n(p-1)/p = {2 * n * (p - 1) / p:g} elements per rank")
            if len(dests) != 2 * (p - 1):
                fail(what, f"rank {r} sent {len(dests)} messages, a ring all-reduce needs 2(p-1) = {2 * (p - 1)}",
                     "p - 1 steps of reduce-scatter, then p - 1 steps of all-gather, one message per step")
            if any(d not in ((r + 1) % p, (r - 1) % p) for d in dests):
                fail(what, f"rank {r} sent to ranks {sorted(set(dests))}",
                     f"in a ring, rank r only talks to its neighbours: rank {r} sends to {(r + 1) % p}")
            if not low <= sent <= high:
                fail(what, f"rank {r} sent {sent} elements, expected {low}..{high} (about 2n(p-1)/p)",
                     "send one numpy.array_split chunk per step: every chunk but one in each phase")
        if len({fp for _, _, fp in traffic}) != 1:
            fail(what, "the ranks ended with different bytes",
                 "in the all-gather phase, copy the finished chunks; do not add them up again on each rank")
        if not summary:
            summary = (f"ring all-reduce: ok ({_plural(p, 'rank')}, n = {n}: each rank sent "
                       f"{_plural(2 * (p - 1), 'message')} and {low if low == high else f'{low} to {high}'} "
                       f"elements; 2(p-1)/p * n = {2 * n * (p - 1) / p:g})")
    return summary
