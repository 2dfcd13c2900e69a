"""The checks of exercises 03 and 04: a collective you wrote, run on every rank, checked for
its answer *and* for what it sent.

Each ``check_*`` function is itself collective: call it on every rank of a communicator
(a ``minidist.sim`` world or ``mpi4py.MPI.COMM_WORLD``) with your function::

    from minidist import sim
    from minidist.course.checks import collectives as collective_checks
    sim.run(lambda comm: collective_checks.check_broadcast(comm, broadcast), 4)

It runs your function on a few shapes and roots with seeded float64 data that every rank can
regenerate (rank r's input is ``inputs(r, shape)``), through a
:class:`minidist.tracing.CountingComm`, and checks

- the result against numpy, and against MPI's own call (``Bcast``, ``Gather``,
  ``Allgather``, ``Allreduce``) when the communicator is mpi4py's;
- that your function left its input alone (collectives here are functional);
- the traffic: who sent how many messages of how many elements to whom. A right answer
  from the wrong algorithm (a linear broadcast, a ring that passes whole tensors) fails.

The ranks share what they found (one small pickled ``allgather``) before deciding, so every
rank raises the same ``AssertionError`` ("what: problem\\nHint: ...") and none is left
waiting. On success every rank returns the same one-line verdict, e.g.
``"broadcast: ok (binomial tree, 3 messages in 2 rounds, the root sent 2)"``.
"""
from __future__ import annotations

import hashlib
import math

import numpy as np

from minidist.course.checks import fail
from minidist.tracing import CountingComm

SEED = 2024
UPPERCASE_HINT = ("send arrays with the uppercase comm.Send / comm.Recv (or Sendrecv); the lowercase "
                  "send pickles a Python object and is meant for small metadata")


def inputs(rank: int, shape, seed: int = SEED) -> np.ndarray:
    """Rank ``rank``'s input for a check: seeded standard normal float64 of ``shape``."""
    return np.random.default_rng([seed, rank]).standard_normal(shape)


def _roots(p):
    return sorted({0, p // 2, p - 1})


def _fingerprint(y):
    if y is None:
        return None
    y = np.ascontiguousarray(y)
    return (y.shape, str(y.dtype), hashlib.sha256(y.tobytes()).hexdigest())


def _local_problem(what, y, x, x_before, expected, counted, exact=True):
    """(what, problem, hint) for this rank's result, or None."""
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
    ok = np.array_equal(y, expected) if exact else np.allclose(y, expected, rtol=1e-12, atol=1e-12)
    if not ok:
        diff = np.abs(y.astype(np.float64) - expected)
        worst = np.unravel_index(np.nanargmax(diff), diff.shape) if diff.size else ()
        return (what, f"wrong values (largest difference {np.nanmax(diff) if diff.size else 0:.3g} at index "
                      f"{tuple(int(i) for i in worst)})",
                "print what each rank holds after each step on a small case, e.g. sim.run(fn, 3)")
    return None


def _decide(comm, what, problem, counted, fingerprint=None):
    """Share (problem, traffic) with every rank; raise the lowest rank's problem everywhere.
    Returns the traffic of every rank: a list of (destinations, counts)."""
    records = comm.allgather((problem, counted.destinations, [s.count for s in counted.sent], fingerprint))
    for rank, (found, _, _, _) in enumerate(records):
        if found:
            name, text, hint = found
            raise AssertionError(f"{name}: {text} (on rank {rank} of {len(records)})\nHint: {hint}")
    return [(dests, counts, fp) for _, dests, counts, fp in records]


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


def check_broadcast(comm, broadcast, shapes=((1000,), (3, 5))) -> str:
    """Check ``broadcast(comm, x, root=...)`` (root's x on every rank) for every root in
    {0, p//2, p-1}: the values, and a binomial tree's traffic (every rank but the root
    receives the array once, in ceil(log2 p) rounds). Raises AssertionError on every rank."""
    p, rank = comm.Get_size(), comm.Get_rank()
    rounds_needed = math.ceil(math.log2(p)) if p > 1 else 0
    for root in _roots(p):
        for shape in shapes:
            what = f"broadcast from root {root}, shape {shape}"
            n = math.prod(shape)
            x = inputs(rank, shape)
            x_before = x.copy()
            counted = CountingComm(comm)
            y = broadcast(counted, x, root=root)
            expected = inputs(root, shape)
            problem = _local_problem(what, y, x, x_before, expected, counted)
            if hasattr(comm, "Bcast"):  # under MPI: MPI's own answer too
                native = x.copy()
                comm.Bcast(native, root=root)
                if problem is None and not np.array_equal(np.asarray(y), native):
                    problem = (what, "differs from MPI's Bcast", "every rank must end with root's array")
            traffic = _decide(comm, what, problem, counted)
            for r, (dests, counts, _) in enumerate(traffic):
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


def check_gather(comm, gather, shapes=((1000,), (3, 5))) -> str:
    """Check ``gather(comm, x, root=...)``: root returns every rank's x stacked in rank order,
    shape (p, *x.shape), the others None; each non-root rank sends its x once, to the root."""
    p, rank = comm.Get_size(), comm.Get_rank()
    for root in _roots(p):
        for shape in shapes:
            what = f"gather to root {root}, shape {shape}"
            n = math.prod(shape)
            x = inputs(rank, shape)
            x_before = x.copy()
            counted = CountingComm(comm)
            y = gather(counted, x, root=root)
            expected = np.stack([inputs(r, shape) for r in range(p)]) if rank == root else None
            problem = _local_problem(what, y, x, x_before, expected, counted)
            if hasattr(comm, "Gather"):
                native = np.empty((p,) + tuple(shape)) if rank == root else None
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


def check_all_gather(comm, all_gather, shapes=((1000,), (3, 5))) -> str:
    """Check ``all_gather(comm, x)``: every rank returns every x stacked, shape (p, *x.shape);
    ring traffic: each rank sends p-1 messages of one block to a neighbour."""
    p, rank = comm.Get_size(), comm.Get_rank()
    for shape in shapes:
        what = f"all_gather, shape {shape}"
        n = math.prod(shape)
        x = inputs(rank, shape)
        x_before = x.copy()
        counted = CountingComm(comm)
        y = all_gather(counted, x)
        expected = np.stack([inputs(r, shape) for r in range(p)])
        problem = _local_problem(what, y, x, x_before, expected, counted)
        if hasattr(comm, "Allgather"):
            native = np.empty((p,) + tuple(shape))
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


def check_ring_all_reduce(comm, all_reduce, shapes=((1000,), (10,), (3, 7))) -> str:
    """Check ``all_reduce(comm, x)`` (the sum of every rank's x, on every rank, x's shape):
    values (within 1e-12, and identical bytes on every rank), and a ring's traffic: each
    rank sends 2(p-1) messages to its neighbours with about 2n(p-1)/p elements in all."""
    p, rank = comm.Get_size(), comm.Get_rank()
    summary = ""
    for shape in shapes:
        what = f"ring all-reduce, shape {shape}"
        n = math.prod(shape)
        x = inputs(rank, shape)
        x_before = x.copy()
        counted = CountingComm(comm)
        y = all_reduce(counted, x)
        expected = np.sum([inputs(r, shape) for r in range(p)], axis=0)
        problem = _local_problem(what, y, x, x_before, expected, counted, exact=False)
        if hasattr(comm, "Allreduce"):
            native = np.empty(shape)
            comm.Allreduce(x, native)
            if problem is None and not np.allclose(np.asarray(y), native, rtol=1e-12, atol=1e-12):
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
        if shape == shapes[0]:
            summary = (f"ring all-reduce: ok ({_plural(p, 'rank')}, n = {n}: each rank sent {_plural(2 * (p - 1), 'message')} and "
                       f"{low if low == high else f'{low} to {high}'} elements; 2(p-1)/p * n = {2 * n * (p - 1) / p:g})")
    return summary
