"""minidist.collectives on the simulated world: results against numpy and against a replay
of each algorithm's order of operations, traffic counted on the trace, bad input, deadlock."""
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minidist import Tensor, collectives, p2p, sim

sys.path.insert(0, str(Path(__file__).parent / "mpi"))
import collective_cases as cc

# -- the same cases as under mpiexec, with numpy (and the replays) as the oracle --------

@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_every_case_matches_numpy_and_the_replayed_order(p):
    case_list = cc.cases(p)
    lock, cache = threading.Lock(), {}

    def prepared(i, case):  # one copy of the inputs, shared by the rank threads
        with lock:
            if i not in cache:
                cache.clear()  # every rank is past case i-1 (they met at its barrier)
                cache[i] = cc.prepare(case, p)
            return cache[i]

    # strict: every send is synchronous, so no collective may depend on MPI buffering its sends
    per_rank = sim.World(p, timeout=300, strict=True).run(cc.run_cases, collectives, case_list, prepared, barrier=True)
    problems = [m for rank_problems, _ in per_rank for m in rank_problems]
    problems += cc.digest_problems([digests for _, digests in per_rank])
    assert not problems, f"{len(problems)} problems, first: " + "\n".join(problems[:10])


# -- traffic, counted on the trace -------------------------------------------------------

def elements_sent(world, rank, itemsize):
    return world.bytes_sent(rank) // itemsize


def assert_ring_traffic(world, n, p, itemsize):
    """The ring all-reduce's traffic: 2(p-1) messages per rank in 2(p-1) steps, and
    2(p-1)/p n elements per rank, up to chunk rounding (each rank sends every chunk but
    its own in the reduce-scatter and every chunk but its right neighbour's in the
    all-gather: 2n - c[r] - c[r+1] elements)."""
    chunks = [len(c) for c in np.array_split(np.arange(n), p)]
    for r in range(p):
        assert world.messages_sent(r) == 2 * (p - 1), f"rank {r} sent {world.messages_sent(r)} messages"
        sent = elements_sent(world, r, itemsize)
        assert sent == 2 * n - chunks[r] - chunks[(r + 1) % p], f"rank {r} sent {sent} elements"
        assert abs(sent - 2 * n * (p - 1) / p) <= 2, f"rank {r} sent {sent} elements, not ~2n(p-1)/p"
    assert world.num_steps() == 2 * (p - 1)


def array_messages(world):
    return sum(world.messages_sent(r) for r in range(world.size))


def all_received(world):
    return all(m.t_end is not None for m in world.trace)


@pytest.mark.parametrize("p,n", [(2, 10), (3, 1001), (4, 1000), (5, 7), (5, 3), (4, 0)])
def test_ring_all_reduce_sends_the_bandwidth_optimal_traffic(p, n):
    world = sim.World(p)
    world.run(lambda comm: collectives.all_reduce(comm, np.ones(n), algorithm="ring"))
    assert_ring_traffic(world, n, p, itemsize=8)
    assert all_received(world)


def whole_tensor_ring(comm, x):
    """A "ring" all-reduce that is correct, has 2(p-1) messages, and ships whole tensors:
    p-1 steps pass every rank's vector around (everyone adds them all up), then p-1 more
    steps pass the result around again for no reason."""
    p, r = comm.Get_size(), comm.Get_rank()
    total, passing, incoming = x.copy(), x.copy(), np.empty_like(x)
    for _ in range(p - 1):
        comm.Sendrecv(passing, dest=(r + 1) % p, recvbuf=incoming, source=(r - 1) % p)
        total += incoming
        passing = incoming.copy()
    for _ in range(p - 1):
        comm.Sendrecv(total, dest=(r + 1) % p, recvbuf=incoming, source=(r - 1) % p)
    return total


def test_a_ring_that_ships_whole_tensors_fails_the_traffic_check():
    p, n = 4, 1000
    world = sim.World(p)
    results = world.run(whole_tensor_ring, np.ones(n))
    assert all(np.array_equal(res, np.full(n, 4.0)) for res in results)  # the answer is right...
    with pytest.raises(AssertionError, match="elements"):  # ...but the traffic is not
        assert_ring_traffic(world, n, p, itemsize=8)


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_latency_terms_of_each_algorithm(p):
    """Steps on the trace = the alpha terms of the cost model; messages and elements too."""
    n, lg = 12, (p - 1).bit_length()  # lg = ceil(log2 p)
    q = 1 << (p.bit_length() - 1)

    def traced(fn):
        world = sim.World(p)
        world.run(lambda comm: fn(comm, np.arange(n, dtype=np.float64) + comm.rank))
        assert all_received(world)
        return world

    world = traced(lambda c, x: collectives.broadcast(c, x, root=p - 1))
    assert world.num_steps() == lg and array_messages(world) == p - 1
    assert all(world.messages_received(r) == (r != p - 1) for r in range(p))
    world = traced(lambda c, x: collectives.broadcast(c, x, algorithm="linear"))
    assert world.num_steps() == p - 1 and world.messages_sent(0) == p - 1
    world = traced(lambda c, x: collectives.all_reduce(c, x, algorithm="tree"))
    assert world.num_steps() == 2 * lg and array_messages(world) == 2 * (p - 1)
    world = traced(lambda c, x: collectives.all_reduce(c, x, algorithm="recursive_doubling"))
    assert world.num_steps() == (q.bit_length() - 1) + (0 if q == p else 2)
    world = traced(lambda c, x: collectives.all_reduce(c, x, algorithm="naive"))
    assert world.messages_sent(0) == p - 1 and world.bytes_received(0) == (p - 1) * n * 8
    assert world.num_steps() == 2 * (p - 1)
    world = traced(collectives.all_gather)
    assert world.num_steps() == p - 1
    assert all(world.messages_sent(r) == p - 1 and world.bytes_sent(r) == (p - 1) * n * 8 for r in range(p))
    world = traced(collectives.reduce_scatter)
    chunks = [len(c) for c in np.array_split(np.arange(n), p)]
    assert all(world.bytes_sent(r) == (n - chunks[r]) * 8 for r in range(p))
    world = traced(lambda c, x: collectives.gather(c, x, root=1))
    assert world.messages_received(1) == p - 1 and array_messages(world) == p - 1
    assert world.num_steps() == p - 1  # the root receives one message per step


# -- properties over shapes and dtypes ----------------------------------------------------

DTYPES = ["int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64", "complex128"]


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 5), shape=st.lists(st.integers(0, 4), max_size=3), dtype=st.sampled_from(DTYPES),
       op=st.sampled_from(list(cc.OPS)), algorithm=st.sampled_from(cc.ALL_REDUCE_ALGORITHMS), seed=st.integers(0, 99))
def test_all_reduce_any_shape_and_dtype(p, shape, dtype, op, algorithm, seed):
    if dtype.startswith("complex") and op in ("max", "min"):
        op = "sum"
    rng = np.random.default_rng(seed)
    imaginary = 1j if dtype.startswith("complex") else 0
    xs = [(rng.integers(-3, 4, size=shape) + imaginary).astype(dtype) for _ in range(p)]
    originals = [x.copy() for x in xs]
    results = sim.run(lambda comm: collectives.all_reduce(comm, xs[comm.rank], op=op, algorithm=algorithm), p)
    flat = [x.reshape(-1) for x in xs]
    want = cc.replay_all_reduce(flat, op, algorithm).reshape(shape)
    for res in results:
        assert res.shape == tuple(shape) and res.dtype == np.dtype(dtype)
        assert res.tobytes() == want.tobytes()
    if dtype not in ("float16",):  # small integers: every order is exact except in float16
        np.testing.assert_array_equal(results[0], cc.oracle(flat, op).reshape(shape))
    assert all(np.array_equal(x, o) for x, o in zip(xs, originals))


@settings(max_examples=25, deadline=None)
@given(p=st.integers(1, 5), shape=st.lists(st.integers(0, 3), max_size=3), dtype=st.sampled_from(DTYPES),
       root=st.integers(0, 4))
def test_data_movement_any_shape_and_dtype(p, shape, dtype, root):
    root %= p
    xs = [np.full(shape, r + 1).astype(dtype) for r in range(p)]
    stacked = np.stack(xs)

    def fn(comm):
        r = comm.rank
        return (collectives.broadcast(comm, xs[r], root=root),
                collectives.scatter(comm, stacked if r == root else xs[r], root=root),
                collectives.gather(comm, xs[r], root=root),
                collectives.all_gather(comm, xs[r]))

    for r, (b, s, g, a) in enumerate(sim.run(fn, p)):
        assert b.tobytes() == xs[root].tobytes() and b.shape == xs[root].shape
        assert s.tobytes() == xs[r].tobytes() and s.shape == xs[r].shape
        assert (g is None) if r != root else (g.shape == stacked.shape and g.tobytes() == stacked.tobytes())
        assert a.shape == stacked.shape and a.tobytes() == stacked.tobytes()


def test_non_contiguous_and_zero_dimensional_inputs():
    base = np.arange(20.0).reshape(4, 5)

    def fn(comm):
        view = base[:, ::2] * (comm.rank + 1)  # not contiguous
        scalar = np.float64(comm.rank)
        return collectives.all_reduce(comm, view.T, algorithm="ring"), collectives.all_reduce(comm, scalar)

    for view_sum, scalar_sum in sim.run(fn, 3):
        np.testing.assert_array_equal(view_sum, (base[:, ::2] * 6).T)
        assert scalar_sum.shape == () and scalar_sum == 3.0


# -- bad input: the same clear error on every rank ------------------------------------------

def errors_on_every_rank(p, fn):
    """Run fn on p ranks; return each rank's CollectiveError message (fails if a rank had none)."""
    def wrapped(comm):
        try:
            fn(comm)
        except p2p.CollectiveError as exc:
            return str(exc)
        return None

    messages = sim.World(p, timeout=20).run(wrapped)
    assert all(m is not None for m in messages), messages
    assert len(set(messages)) == 1, messages
    return messages[0]


@pytest.mark.parametrize("algorithm", cc.ALL_REDUCE_ALGORITHMS)
def test_mismatched_shapes_and_dtypes(algorithm):
    message = errors_on_every_rank(
        4, lambda c: collectives.all_reduce(c, np.zeros(3 + (c.rank == 2)), algorithm=algorithm))
    assert "disagree on the shape" in message and "rank 2: (4,)" in message
    message = errors_on_every_rank(3, lambda c: collectives.reduce_scatter(c, np.zeros(5, "f4" if c.rank else "f8")))
    assert "disagree on the dtype" in message and "rank 0: float64" in message and "rank 1: float32" in message
    errors_on_every_rank(3, lambda c: collectives.all_gather(c, np.zeros((2, c.rank))))
    errors_on_every_rank(3, lambda c: collectives.gather(c, np.zeros(2 + c.rank)))


def test_bad_roots():
    for fn in (collectives.broadcast, collectives.reduce, collectives.gather):
        message = errors_on_every_rank(3, lambda c, fn=fn: fn(c, np.zeros(2), root=3))
        assert "root must be a rank in 0..2, got 3" in message
    message = errors_on_every_rank(3, lambda c: collectives.broadcast(c, np.zeros(2), root=-1 if c.rank == 1 else 0))
    assert "(on rank 1 of 3)" in message
    message = errors_on_every_rank(3, lambda c: collectives.reduce(c, np.zeros(2), root=c.rank))
    assert "disagree on the arguments" in message
    message = errors_on_every_rank(
        3, lambda c: collectives.scatter(c, np.zeros((2, 4)) if c.rank == 0 else np.zeros(4)))
    assert "root's x must have shape (p, ...) = (3, ...), got (2, 4)" in message


def test_unknown_op_and_algorithm():
    message = errors_on_every_rank(
        3, lambda c: collectives.all_reduce(c, np.zeros(2), op="avg" if c.rank == 2 else "sum"))
    assert message.startswith("all_reduce: unknown op 'avg'") and "(on rank 2 of 3)" in message
    message = errors_on_every_rank(2, lambda c: collectives.all_reduce(c, np.zeros(2), algorithm="butterfly"))
    assert "unknown algorithm 'butterfly'" in message
    errors_on_every_rank(2, lambda c: collectives.broadcast(c, np.zeros(2), algorithm="ring"))
    errors_on_every_rank(2, lambda c: collectives.reduce_scatter(c, np.zeros(2), op=None))
    errors_on_every_rank(2, lambda c: collectives.all_reduce(c, np.zeros(2), algorithm="ring" if c.rank else "tree"))
    with pytest.raises(p2p.CollectiveError, match="unknown op"):  # checked locally without validation
        sim.run(lambda c: collectives.all_reduce(c, np.zeros(2), op="avg", validate=False), 1)


def test_validation_is_one_small_round_and_can_be_skipped():
    world = sim.World(4)
    world.run(lambda c: collectives.all_reduce(c, np.zeros(100), algorithm="ring"))
    objects = [m for m in world.trace if m.kind == "object"]  # one round: each rank sends to each other rank
    assert sorted((m.source, m.dest) for m in objects) == [(s, d) for s in range(4) for d in range(4) if s != d]
    assert all(m.nbytes < 400 for m in objects)
    world.run(lambda c: collectives.all_reduce(c, np.zeros(100), algorithm="ring", validate=False))
    assert world.messages_sent(0, kind="object") == 0


def test_a_rank_that_skips_a_collective_is_a_deadlock_not_a_hang():
    def fn(comm):
        if comm.rank != 1:
            collectives.all_reduce(comm, np.ones(4), algorithm="ring", validate=False)

    with pytest.raises(sim.DeadlockError, match="rank 1 has returned"):
        sim.World(3, timeout=20).run(fn)


def test_cuda_awareness_decision(monkeypatch):
    class MPILike:  # an mpi4py communicator has no cuda_aware attribute
        pass

    assert p2p.cuda_aware(sim.World(1).run(lambda c: c)[0])
    monkeypatch.delenv("MINIDIST_CUDA_AWARE_MPI", raising=False)
    assert not p2p.cuda_aware(MPILike())
    monkeypatch.setenv("MINIDIST_CUDA_AWARE_MPI", "1")
    assert p2p.cuda_aware(MPILike())


def test_cupy_arrays_directly_and_staged_through_the_host():
    backend = pytest.importorskip("minidist.backend")
    if not backend.cuda_available():
        pytest.skip("CuPy with a GPU is not available")
    import cupy

    class HostOnly:  # a communicator that is not CUDA-aware: collectives must stage
        cuda_aware = False

        def __init__(self, comm):
            self._comm = comm

        def __getattr__(self, name):
            return getattr(self._comm, name)

    xs = [np.arange(7.0) * (r + 1) for r in range(3)]
    for wrap in (lambda c: c, HostOnly):
        results = sim.run(lambda c, wrap=wrap: collectives.all_reduce(wrap(c), cupy.asarray(xs[c.rank]),
                                                                     algorithm="ring"), 3)
        for res in results:
            assert isinstance(res, cupy.ndarray)
            np.testing.assert_array_equal(res.get(), sum(xs))


@pytest.mark.parametrize("algorithm", ["naive", "ring", "tree", "recursive_doubling", "auto"])
def test_all_reduce_into_out_matches_and_returns_out(algorithm):
    def fn(comm):
        rng = np.random.default_rng(comm.Get_rank())
        x = rng.standard_normal(1001).astype(np.float32)
        out = np.full_like(x, np.nan)
        got = collectives.all_reduce(comm, x, algorithm=algorithm, out=out)
        again = collectives.all_reduce(comm, x, algorithm=algorithm)
        return got is out, out.tobytes() == again.tobytes(), out.tobytes()

    results = sim.run(fn, 5)
    assert all(same and equal for same, equal, _ in results)
    assert len({raw for _, _, raw in results}) == 1


@pytest.mark.parametrize("bad", ["shape", "dtype", "overlap"])
def test_all_reduce_bad_out_fails_on_every_rank(bad):
    def fn(comm):
        x = np.ones(6)
        out = {"shape": np.empty(5), "dtype": np.empty(6, np.float32), "overlap": x}[bad]
        if comm.Get_rank() != 1:
            out = np.empty(6)  # only rank 1 passes a bad buffer: every rank must still fail
        try:
            collectives.all_reduce(comm, x, out=out)
        except p2p.CollectiveError as exc:
            return str(exc)
        return None

    messages = sim.run(fn, 3)
    assert all(m is not None and "out must" in m and "rank 1" in m for m in messages)


# -- input the collectives refuse: the same CollectiveError on every rank (and under MPI) --

def test_refused_input_raises_the_same_collective_error_on_every_rank():
    per_rank = sim.World(3, timeout=20).run(lambda comm: cc.refusals(collectives, comm, Tensor))
    assert all(messages == per_rank[0] for messages in per_rank)
    messages = per_rank[0]
    assert messages["object dtype"].startswith(
        "all_reduce: x has dtype object ('|O'), which the collectives cannot send")
    assert messages["object dtype"].endswith("(on rank 2 of 3)")
    assert "non-native byte order (dtype '>f8')" in messages["non-native byte order"]
    assert "x.astype(x.dtype.newbyteorder('='))" in messages["non-native byte order"]
    assert "x is a minidist Tensor" in messages["Tensor"] and "pass tensor.data" in messages["Tensor"]
    assert messages["Tensor everywhere"].startswith("reduce: x is a minidist Tensor")
    assert "x has dtype <U1" in messages["string dtype"]
    assert messages["read-only out"] == ("all_reduce: out must be writable (it is read-only: out.flags.writeable "
                                         "is False); pass a writable array (on rank 1 of 3)")
    assert "got True (a bool is not a rank) (on rank 0 of 3)" in messages["root=True"]
    assert "got False (a bool is not a rank) (on rank 2 of 3)" in messages["root=False on one rank"]


def test_a_lone_rank_refuses_the_same_input():
    messages = sim.run(lambda comm: cc.refusals(collectives, comm, Tensor), 1)[0]
    assert all(m.startswith(("all_reduce:", "broadcast:", "all_gather:", "reduce:", "reduce_scatter:", "gather:"))
               and "instead of" not in m and m != "no error" for m in messages.values()), messages


# -- deadlines: a rank that never arrives is named by every rank waiting for it -----------

class Polling:
    """An mpi4py-like view of a sim communicator: no ``wait_all``, so the collectives take
    their MPI path (Isend/Irecv polled with Test until the deadline)."""

    def __init__(self, comm):
        self._comm = comm

    def __getattr__(self, name):
        if name == "wait_all":
            raise AttributeError(name)
        return getattr(self._comm, name)


@pytest.fixture
def short_timeout():
    previous = p2p.set_timeout(0.5)
    yield 0.5
    p2p.set_timeout(previous)


@pytest.mark.parametrize("wrap", [lambda c: c, Polling], ids=["sim wait_all", "polling Test"])
@pytest.mark.parametrize("validate", [True, False])
def test_a_rank_that_never_arrives_is_named_within_the_deadline(short_timeout, wrap, validate):
    waiting = threading.Semaphore(0)

    def fn(comm):
        if comm.rank == 2:  # busy elsewhere (not blocked in the sim): never calls the collective
            for _ in range(2):
                waiting.acquire(timeout=5)
            return None
        start = time.perf_counter()
        try:
            collectives.all_reduce(wrap(comm), np.ones(3), algorithm="naive", validate=validate)
        except p2p.CollectiveTimeout as exc:
            return time.perf_counter() - start, exc.missing, str(exc), isinstance(exc, TimeoutError)
        finally:
            waiting.release()
        return None

    results = sim.World(3, timeout=20).run(fn)
    took, missing, message, is_timeout = results[0]  # rank 0 waits for rank 2 itself in both rounds
    assert short_timeout <= took < short_timeout + 0.4 and is_timeout
    assert missing == [2] and message.startswith("all_reduce: rank 0 has not heard from rank 2 within 0.5 s")
    assert "p2p.set_timeout" in message
    if validate:  # the agreement round waits for every rank: rank 1 names rank 2 too
        assert results[1][1] == [2] and results[1][0] < short_timeout + 0.4


def test_set_timeout_and_the_environment_variable(monkeypatch):
    previous = p2p.set_timeout(None)
    try:
        for bad in (0, -1, float("nan"), float("inf"), True, "soon", None.__class__):
            with pytest.raises(ValueError, match="positive, finite number of seconds"):
                p2p.set_timeout(bad)
        monkeypatch.delenv("MINIDIST_TIMEOUT", raising=False)
        p2p.set_timeout(None)
        assert p2p.get_timeout() == p2p.DEFAULT_TIMEOUT == 300
        monkeypatch.setenv("MINIDIST_TIMEOUT", "12.5")
        p2p.set_timeout(None)  # None re-reads the environment
        assert p2p.get_timeout() == 12.5
        p2p.set_timeout(3)
        assert p2p.get_timeout() == 3.0 and p2p.set_timeout(None) == 3.0
        monkeypatch.setenv("MINIDIST_TIMEOUT", "0")
        with pytest.raises(ValueError, match="MINIDIST_TIMEOUT"):
            p2p.set_timeout(None)
    finally:
        monkeypatch.delenv("MINIDIST_TIMEOUT", raising=False)
        p2p.set_timeout(previous)


# -- agree: the one agree-or-raise round -------------------------------------------------

@pytest.mark.parametrize("wrap", [lambda c: c, Polling], ids=["sim wait_all", "polling Test"])
def test_agree_returns_payloads_in_rank_order_even_large_ones(wrap):
    def fn(comm):
        payload = ("x" * (20_000 if comm.rank == 1 else 10), comm.rank)  # rank 1's record exceeds 8 KiB
        return p2p.agree(wrap(comm), None, payload)

    for result in sim.World(3, timeout=20).run(fn):
        assert [(len(text), rank) for text, rank in result] == [(10, 0), (20_000, 1), (10, 2)]
    assert sim.run(lambda comm: p2p.agree(comm, payload="alone"), 1) == [["alone"]]


def test_agree_raises_the_lowest_ranks_problem_everywhere():
    def fn(comm, raise_problem=None):
        problem = f"bad thing {comm.rank}" if comm.rank in (1, 2) else None
        try:
            p2p.agree(comm, problem, comm.rank, raise_problem=raise_problem)
        except (p2p.CollectiveError, KeyError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    assert sim.run(fn, 3) == ["CollectiveError: bad thing 1 (on rank 1 of 3)"] * 3

    def raise_key(problem, rank, p):
        raise KeyError(f"{problem}/{rank}/{p}")

    assert sim.run(fn, 3, raise_key) == ["KeyError: 'bad thing 1/1/3'"] * 3
    assert sim.run(fn, 3, lambda *args: None) == [
        "CollectiveError: agree: raise_problem returned instead of raising for 'bad thing 1'"] * 3


# -- Python objects: gather_objects, scatter_objects ---------------------------------------

def test_object_collectives_refuse_a_bad_root_on_every_rank_and_pass_root_problems_as_the_callers_error():
    def fn(comm):
        out = []
        for call in (lambda: collectives.gather_objects(comm, {"r": comm.rank}, root=3),
                     lambda: collectives.scatter_objects(comm, [1, 2, 3], root=-1),
                     lambda: collectives.scatter_objects(comm, [1, 2] if comm.rank == 0 else None, root=0),
                     lambda: collectives.scatter_objects(comm, None, root=0, problem="no file" if comm.rank == 0
                                                         else None, error=FileNotFoundError)):
            try:
                call()
                out.append(None)
            except (p2p.CollectiveError, FileNotFoundError) as exc:
                out.append(f"{type(exc).__name__}: {exc}")
        return out

    first, *others = sim.run(fn, 3)
    assert all(o == first for o in others)  # the same error on every rank
    assert first[0] == "CollectiveError: gather_objects: root must be a rank in 0..2, got 3 (on rank 0 of 3)"
    assert first[1].startswith("CollectiveError: scatter_objects: root must be a rank in 0..2, got -1")
    assert first[2] == "CollectiveError: scatter_objects: 2 objects for 3 ranks; pass one per rank"
    assert first[3] == "FileNotFoundError: no file"


def test_object_collectives_end_at_the_deadline_naming_a_silent_rank():
    """Rank 2 computes and never takes part (so the sim sees no deadlock): the others raise
    CollectiveTimeout naming it within p2p's deadline (0.3 s here), not the sim's 20 s."""
    done = threading.Semaphore(0)

    def fn(comm):
        if comm.rank == 2:
            done.acquire(timeout=20)
            done.acquire(timeout=20)  # return only once both others gave up
            return None
        try:
            collectives.gather_objects(comm, "mine")
        except p2p.CollectiveTimeout as exc:
            return exc.missing
        finally:
            done.release()

    previous = p2p.set_timeout(0.3)
    start = time.perf_counter()
    try:
        assert sim.World(3, timeout=20).run(fn)[:2] == [[2], [2]]
    finally:
        p2p.set_timeout(previous)
    assert time.perf_counter() - start < 10
