"""minidist.sim: mpi4py's point-to-point semantics, the trace, deadlock and failure handling."""
import time

import numpy as np
import pytest

from minidist import sim


def test_run_returns_results_in_rank_order_and_passes_arguments():
    def fn(comm, a, b=0):
        return (comm.Get_rank(), comm.Get_size(), a, b, comm.rank, comm.size)

    assert sim.run(fn, 3, "x", b=5) == [(r, 3, "x", 5, r, 3) for r in range(3)]


def test_send_copies_the_buffer_at_once():
    def fn(comm):
        x = np.arange(4.0)
        if comm.rank == 0:
            comm.Send(x, dest=1, tag=3)
            x[:] = -1  # the message was copied: this must not reach rank 1
            return x
        comm.Recv(x, source=0, tag=3)
        return x

    sent, got = sim.run(fn, 2)
    np.testing.assert_array_equal(got, [0.0, 1.0, 2.0, 3.0])
    np.testing.assert_array_equal(sent, [-1.0] * 4)


def test_buffer_spec_with_datatype_is_accepted_and_shapes_may_differ():
    def fn(comm):
        if comm.rank == 0:
            comm.Send([np.arange(6, dtype=np.int32).reshape(2, 3), "MPI.INT"], dest=1)
            return None
        out = np.empty(6, np.int32)
        comm.Recv([out, "MPI.INT"], source=0)
        return out

    np.testing.assert_array_equal(sim.run(fn, 2)[1], np.arange(6))


def test_messages_between_two_ranks_do_not_overtake_and_receives_match_in_post_order():
    def fn(comm):
        if comm.rank == 0:
            for k in range(3):
                comm.Send(np.full(2, k), dest=1, tag=9)
            return None
        bufs = [np.empty(2, np.int64) for _ in range(3)]
        requests = [comm.Irecv(b, source=0, tag=9) for b in bufs]
        for req in reversed(requests):  # waiting in reverse order must not change matching
            req.Wait()
        return [int(b[0]) for b in bufs]

    assert sim.run(fn, 2)[1] == [0, 1, 2]


def test_tags_select_messages_and_status_reports_source_tag_count():
    def fn(comm):
        if comm.rank != 0:
            comm.Send(np.full(3, comm.rank, np.float32), dest=0, tag=10 + comm.rank)
            return None
        a = np.empty(3, np.float32)
        comm.Recv(a, source=sim.ANY_SOURCE, tag=12)  # only rank 2's message has tag 12
        status = sim.Status()
        b = np.empty(3, np.float32)
        comm.Recv(b, source=sim.ANY_SOURCE, tag=sim.ANY_TAG, status=status)
        return a[0], b[0], status.Get_source(), status.Get_tag(), status.Get_count()

    assert sim.run(fn, 3)[0] == (2.0, 1.0, 1, 11, 12)


def test_isend_irecv_test_and_waitall():
    def fn(comm):
        p, r = comm.size, comm.rank
        out = np.empty(1, np.int64)
        recv = comm.Irecv(out, source=(r - 1) % p, tag=0)
        if r == 0:
            assert not recv.Test()  # nobody has sent yet: rank 0 is the last to send
            comm.Barrier()
        send = comm.Isend(np.array([r]), dest=(r + 1) % p, tag=0)
        if r != 0:
            comm.Barrier()
        sim.Request.Waitall([send, recv])
        assert recv.Test()
        return int(out[0])

    assert sim.run(fn, 4) == [3, 0, 1, 2]


def test_sendrecv_shifts_a_ring():
    def fn(comm):
        p, r = comm.size, comm.rank
        got = np.empty(2)
        comm.Sendrecv(np.full(2, float(r)), dest=(r + 1) % p, sendtag=1,
                      recvbuf=got, source=(r - 1) % p, recvtag=1)
        return got[0]

    assert sim.run(fn, 5) == [4.0, 0.0, 1.0, 2.0, 3.0]


def test_barrier_holds_every_rank_until_all_arrive():
    arrived = []

    def fn(comm):
        time.sleep(0.01 * comm.rank)
        arrived.append(comm.rank)
        comm.Barrier()
        return len(arrived)

    assert sim.run(fn, 4) == [4, 4, 4, 4]


def test_lowercase_pickle_calls():
    def fn(comm):
        r = comm.rank
        if r == 0:
            comm.send({"hello": [1, 2]}, dest=1, tag=4)
        got = comm.recv(source=0, tag=4) if r == 1 else None
        everything = comm.bcast(("config", r), root=2)
        gathered = comm.gather(r * r, root=1)
        comm.barrier()
        return got, everything, gathered, comm.allgather(str(r))

    results = sim.run(fn, 3)
    assert results[1][0] == {"hello": [1, 2]}
    assert all(res[1] == ("config", 2) for res in results)
    assert results[1][2] == [0, 1, 4] and results[0][2] is None
    assert all(res[3] == ["0", "1", "2"] for res in results)


def test_trace_counts_messages_bytes_and_logical_steps():
    # A binomial broadcast by hand on 8 ranks: 7 messages in ceil(lg 8) = 3 steps.
    def fn(comm):
        x = np.zeros(10, np.float32)
        r, mask = comm.rank, 1
        while mask < comm.size:
            if r & mask:
                comm.Recv(x, source=r - mask)
                break
            mask <<= 1
        mask >>= 1
        while mask:
            if r + mask < comm.size:
                comm.Send(x, dest=r + mask)
            mask >>= 1

    world = sim.World(8)
    world.run(fn)
    assert len(world.trace) == 7 and world.num_steps() == 3
    assert [(m.source, m.dest, m.step) for m in world.trace if m.source == 0] == [(0, 4, 0), (0, 2, 1), (0, 1, 2)]
    assert world.messages_sent(0) == 3 and world.bytes_sent(0) == 120
    assert world.messages_received(7) == 1 and world.bytes_received(7) == 40
    m = world.trace[0]
    assert (m.nbytes, m.count, m.dtype, m.kind) == (40, 10, "float32", "array")
    assert all(m.t_end is not None and m.t_end >= m.t_start for m in world.trace)
    table = world.summary()
    assert "bytes sent" in table and "in 3 steps" in table
    world.run(lambda comm: comm.allgather(comm.rank))  # a second run starts a fresh trace
    assert world.messages_sent(0) == 0 and world.messages_sent(0, kind="all") > 0
    assert "pickled metadata" in world.summary()


def test_recv_into_wrong_buffer_names_both():
    def fn(comm):
        if comm.rank == 0:
            comm.Send(np.zeros(3), dest=1)
        else:
            comm.Recv(np.zeros(4, np.float32), source=0)

    with pytest.raises(sim.MessageMismatchError,
                       match=r"message is 3 x float64 \(24 bytes\), buffer is 4 x float32 \(16 bytes\)"):
        sim.run(fn, 2)


def test_bad_buffers_and_ranks_raise_clear_errors():
    with pytest.raises(ValueError, match="C-contiguous"):
        sim.run(lambda comm: comm.Send(np.zeros((4, 4))[:, 0], dest=0), 1)
    with pytest.raises(TypeError, match="numpy or cupy array"):
        sim.run(lambda comm: comm.Send([1, 2, 3], dest=0), 1)
    with pytest.raises(TypeError, match="numpy or cupy array"):  # a scalar is a copy, not a buffer
        sim.run(lambda comm: comm.Recv(np.zeros(2)[0], source=0), 1)
    with pytest.raises(ValueError, match=r"dest must be a rank in 0\.\.1, got 2"):
        sim.run(lambda comm: comm.Send(np.zeros(1), dest=2), 2)
    with pytest.raises(sim.MessageMismatchError, match="pickled object"):
        sim.run(lambda comm: comm.send(1, 0) or comm.Recv(np.zeros(1), 0), 1)


def test_deadlock_is_reported_on_every_rank_with_who_waits_on_whom():
    def fn(comm):  # both receive first: the classic deadlock
        x = np.zeros(2)
        comm.Recv(x, source=1 - comm.rank, tag=5)
        comm.Send(x, dest=1 - comm.rank, tag=5)

    world = sim.World(2, timeout=20)
    start = time.perf_counter()
    with pytest.raises(sim.DeadlockError) as info:
        world.run(fn)
    assert time.perf_counter() - start < 5  # detected, not timed out
    message = str(info.value)
    assert "rank 0 waits for a message from rank 1 (tag 5)" in message
    assert "rank 1 waits for a message from rank 0 (tag 5)" in message
    assert sorted(world.errors) == [0, 1]
    assert all(isinstance(e, sim.DeadlockError) for e in world.errors.values())


def test_deadlock_when_a_rank_returns_without_sending():
    def fn(comm):
        if comm.rank == 0:
            return "done"
        comm.Barrier() if comm.rank == 2 else comm.Recv(np.zeros(1), source=0)

    with pytest.raises(sim.DeadlockError, match=r"rank 0 has returned; rank 1 waits for a message from rank 0 "
                                                r"\(any tag\); rank 2 waits in Barrier \(ranks 0, 1 not arrived\)"):
        sim.run(fn, 3)


def test_an_exception_on_one_rank_surfaces_and_unblocks_the_others():
    def fn(comm):
        if comm.rank == 2:
            raise KeyError("broken rank")
        comm.Recv(np.zeros(1), source=2)  # would wait forever

    world = sim.World(4, timeout=20)
    with pytest.raises(KeyError, match="broken rank") as info:
        world.run(fn)
    assert info.value.rank == 2
    assert any("rank 2" in note for note in info.value.__notes__)
    others = [world.errors[r] for r in (0, 1, 3)]
    assert all(isinstance(e, sim.RankAborted) and "rank 2 raised KeyError" in str(e) for e in others)


def test_global_timeout_ends_a_rank_that_spins():
    def fn(comm):
        if comm.rank == 0:
            request = comm.Irecv(np.zeros(1), source=1)
            while not request.Test():  # polling is not "blocked": only the timeout can end it
                time.sleep(0.01)

    with pytest.raises(sim.SimTimeoutError):
        sim.World(2, timeout=0.5).run(fn)


def test_world_size_must_be_positive():
    with pytest.raises(ValueError, match="positive integer"):
        sim.World(0)


# -- at least as strict as MPI: sends past the eager limit wait for their receive ---------

def send_then_recv_ring(comm, nbytes):
    """Every rank Sends to rank+1, then Recvs from rank-1: hangs under mpiexec past the
    eager limit (MPICH 5.0.2 here: from 8113 bytes on, with 2 and 4 ranks)."""
    rank, p = comm.Get_rank(), comm.Get_size()
    comm.Send(np.full(nbytes, rank, np.uint8), dest=(rank + 1) % p, tag=1)
    got = np.empty(nbytes, np.uint8)
    comm.Recv(got, source=(rank - 1) % p, tag=1)
    return int(got[0])


@pytest.mark.parametrize("p", [2, 4])
def test_send_then_recv_ring_of_1_mib_is_a_deadlock_naming_the_cycle(p):
    start = time.perf_counter()
    with pytest.raises(sim.DeadlockError) as info:
        sim.World(p, timeout=20).run(send_then_recv_ring, 1 << 20)
    assert time.perf_counter() - start < 5  # detected, not timed out
    cycle = " -> ".join(f"rank {r}" for r in [*range(p), 0])
    message = str(info.value)
    assert f"wait-for cycle: {cycle})" in message, message
    assert ("rank 0 waits for rank 1 to receive its Send (tag 1; 1048576 bytes > the eager limit of 4096 bytes"
            in message)
    assert "Sendrecv" in message  # the fix is named


def test_the_eager_limit_is_4096_bytes_and_below_mpichs_measured_one():
    assert sim.EAGER_LIMIT == 4096 < 8113  # 8113 bytes: the smallest ring message that hung under MPICH 5.0.2
    assert sim.World(3).run(send_then_recv_ring, 4096) == [2, 0, 1]  # small messages are buffered, as in MPICH
    with pytest.raises(sim.DeadlockError, match="4097 bytes > the eager limit of 4096 bytes"):
        sim.World(3, timeout=20).run(send_then_recv_ring, 4097)
    assert sim.World(3, eager_limit=8112).run(send_then_recv_ring, 8112) == [2, 0, 1]


def test_strict_mode_makes_every_send_synchronous():
    with pytest.raises(sim.DeadlockError, match=r"wait-for cycle: rank 0 -> rank 1 -> rank 0\).*strict mode"):
        sim.World(2, strict=True, timeout=20).run(send_then_recv_ring, 8)
    def ssend_first(comm):
        comm.Ssend(np.zeros(1), dest=1 - comm.rank)
        comm.Recv(np.zeros(1), source=1 - comm.rank)

    def send_first(comm):  # the lowercase send pickles, then follows the same rule
        comm.send("hi", dest=1 - comm.rank)
        return comm.recv(source=1 - comm.rank)

    with pytest.raises(sim.DeadlockError, match="a synchronous send waits for its receive"):
        sim.run(ssend_first, 2)
    with pytest.raises(sim.DeadlockError, match="its pickled send"):
        sim.World(2, strict=True, timeout=20).run(send_first)
    assert sim.run(send_first, 2) == ["hi", "hi"]  # small pickles are eager by default


def test_sendrecv_and_isend_irecv_rings_never_depend_on_buffering():
    def exchange(comm, nbytes):
        rank, p = comm.Get_rank(), comm.Get_size()
        got, also = np.empty(nbytes, np.uint8), np.empty(nbytes, np.uint8)
        comm.Sendrecv(np.full(nbytes, rank, np.uint8), dest=(rank + 1) % p, recvbuf=got, source=(rank - 1) % p)
        send = comm.Isend(np.full(nbytes, rank, np.uint8), dest=(rank + 1) % p, tag=2)
        comm.Recv(also, source=(rank - 1) % p, tag=2)
        send.Wait()
        return int(got[0]), int(also[-1])

    expected = [((r - 1) % 3, (r - 1) % 3) for r in range(3)]
    assert sim.World(3, strict=True).run(exchange, 1 << 20) == expected


def test_a_send_past_the_eager_limit_completes_once_the_receive_is_posted():
    def fn(comm):
        big = np.arange(1 << 17, dtype=np.float64)  # 1 MiB
        if comm.rank == 0:
            start = time.perf_counter()
            comm.Send(big, dest=1, tag=4)
            waited = time.perf_counter() - start
            request = comm.Isend(big, dest=1, tag=5)
            pending = not request.Test()
            request.Wait()
            return waited, pending
        time.sleep(0.3)  # receive late: the Send must wait for it (MPI's rendezvous)
        got = np.empty_like(big)
        comm.Recv(got, source=0, tag=4)
        time.sleep(0.1)
        comm.Recv(got, source=0, tag=5)
        return bool(np.array_equal(got, big))

    (waited, pending), received = sim.run(fn, 2)
    assert waited >= 0.25 and pending and received


def test_send_refuses_dtypes_mpi_cannot_send():
    for x, match in [(np.array([1, None], dtype=object), "cannot send dtype object"),
                     (np.zeros(2, ">f8"), "'>f8'.*native byte order"), (np.array(["a"]), "cannot send dtype <U1")]:
        with pytest.raises(TypeError, match=match):
            sim.run(lambda comm, x=x: comm.Send(x, dest=0), 1)


def test_cancel_a_receive_and_wait_all_with_a_deadline():
    def fn(comm):
        if comm.rank == 1:
            time.sleep(0.6)
            return None
        first, second = comm.Irecv(np.zeros(1), source=1, tag=1), comm.irecv(source=1, tag=2)
        start = time.perf_counter()
        try:
            comm.wait_all([first, second], timeout=0.2)
        except sim.WaitTimeout as exc:
            took, pending, peers, message = time.perf_counter() - start, exc.pending, exc.peers, str(exc)
        first.Cancel()
        first.Wait()
        return took, pending, peers, message, first.cancelled, first.Test()

    took, pending, peers, message, cancelled, tested = sim.run(fn, 2)[0]
    assert 0.15 < took < 0.5 and pending == [0, 1] and peers == [1]
    assert "a message from rank 1 (tag 1)" in message and "(tag 2)" in message
    assert cancelled and tested


# -- timeouts: reported, and a timed-out world does not slow later runs --------------------

def _busy_run(comm):
    total = 0
    for i in range(100_000):
        total += i
    return total


def test_a_computing_rank_past_the_timeout_is_reported_and_stopped():
    def spin(comm):
        if comm.rank == 1:
            while True:  # never reaches the barrier, never calls the sim
                pass
        comm.Barrier()

    before = min(_timed(lambda: sim.run(_busy_run, 2)) for _ in range(3))
    world = sim.World(2, timeout=0.3)
    with pytest.raises(sim.SimTimeoutError) as info:
        world.run(spin)
    message = str(info.value)
    assert "rank 0 waits in Barrier (rank 1 not arrived)" in message
    assert "rank 1 was computing (outside communication) and has been interrupted" in message
    assert world.stranded == []
    _join_rank_threads(2.0)
    assert not [t for t in __import__("threading").enumerate() if t.name.startswith("sim-rank-")]
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "still running" warning: nothing was left behind
        after = min(_timed(lambda: sim.run(_busy_run, 2)) for _ in range(3))
    # no thread left (asserted above) is the real check; the timing only guards against a gross slowdown
    assert after < 4 * before + 0.25, (before, after)


def test_a_rank_that_cannot_be_interrupted_is_named_and_later_runs_warn():
    import threading

    release = threading.Event()

    def sleepy(comm):
        if comm.rank == 0:
            release.wait(30)  # inside C: an exception can only land when it returns

    world = sim.World(2, timeout=0.2)
    try:
        with pytest.raises(sim.SimTimeoutError, match="rank 0 was computing and could not be interrupted"):
            world.run(sleepy)
        assert world.stranded == [0]
        with pytest.warns(RuntimeWarning, match="still running"):
            sim.run(lambda comm: None, 1)
    finally:
        release.set()  # the stranded rank returns now, whatever the machine's load
        _join_rank_threads(5.0)


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _join_rank_threads(seconds):
    import threading
    for t in threading.enumerate():
        if t.name.startswith("sim-rank-"):
            t.join(seconds)
