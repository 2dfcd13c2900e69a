"""sim's Comm.Split against mpi4py's (the same case run under mpiexec is the oracle), and what
a sub-communicator must keep: its own ranks and message context, world ranks in the trace,
deadlock detection, barriers among its members only, the collectives on top of it."""
from pathlib import Path

import numpy as np
import pytest
from mpitools import mpiexec_or_skip

from minidist import collectives, sim

UNDEFINED = sim.UNDEFINED


def split_case(comm, undefined=UNDEFINED):
    """Splits whose answers depend on every rule (colour groups, key order, ties by rank,
    UNDEFINED, a split of a split); returns what each rank sees. Run on the sim and by
    tests/mpi/pipeline_split.py under mpiexec, with mpi4py's UNDEFINED there."""
    rank, size = comm.Get_rank(), comm.Get_size()
    seen = {}
    halves = comm.Split(color=rank % 2, key=-rank)  # reversed order within each colour
    seen["halves"] = (halves.Get_rank(), halves.Get_size())
    ties = comm.Split(color=0, key=rank // 2)  # equal keys: ordered by rank
    seen["ties"] = ties.Get_rank()
    some = comm.Split(color=undefined if rank == 1 else 7, key=0)
    seen["undefined"] = None if some is None or _is_null(some) else (some.Get_rank(), some.Get_size())
    inner = halves.Split(color=0, key=-halves.Get_rank())  # a split of a split: reversed again
    seen["inner"] = (inner.Get_rank(), inner.Get_size())
    # a message on each communicator with the same tag: each lands in its own
    x = np.full(3, float(rank))
    got_world, got_half = np.empty(3), np.empty(3)
    requests = [comm.Irecv(got_world, source=(rank - 1) % size, tag=5),
                halves.Irecv(got_half, source=(halves.Get_rank() - 1) % halves.Get_size(), tag=5),
                halves.Isend(x + 100, dest=(halves.Get_rank() + 1) % halves.Get_size(), tag=5),
                comm.Isend(x, dest=(rank + 1) % size, tag=5)]
    for r in requests:
        r.Wait()
    seen["world_msg"], seen["half_msg"] = float(got_world[0]), float(got_half[0])
    halves.Barrier()
    seen["sum"] = float(collectives.all_reduce(halves, np.array([float(rank)]))[0])
    for c in (inner, halves, ties) + (() if seen["undefined"] is None else (some,)):
        c.Free()
    return seen


def _is_null(comm):
    try:
        from mpi4py import MPI
    except ImportError:
        return False
    return comm == MPI.COMM_NULL


def expected_split_case(size):
    """The answers worked out by hand from MPI's rules, for size 4."""
    assert size == 4
    return [
        {"halves": (1, 2), "ties": 0, "undefined": (0, 3), "inner": (0, 2), "world_msg": 3.0, "half_msg": 102.0,
         "sum": 2.0},
        {"halves": (1, 2), "ties": 1, "undefined": None, "inner": (0, 2), "world_msg": 0.0, "half_msg": 103.0,
         "sum": 4.0},
        {"halves": (0, 2), "ties": 2, "undefined": (1, 3), "inner": (1, 2), "world_msg": 1.0, "half_msg": 100.0,
         "sum": 2.0},
        {"halves": (0, 2), "ties": 3, "undefined": (2, 3), "inner": (1, 2), "world_msg": 2.0, "half_msg": 101.0,
         "sum": 4.0},
    ]


def test_split_follows_mpi_rules_on_the_sim():
    assert sim.World(4, strict=True).run(split_case) == expected_split_case(4)


@pytest.mark.mpi
def test_split_case_gives_the_same_answers_under_mpiexec():
    from minidist import launch

    mpiexec_or_skip()
    script = Path(__file__).parent / "mpi" / "pipeline_split.py"
    result = launch.launch(script, 4, timeout=120)
    assert result.ok and "SPLIT OK" in result.stdout, result.stdout + result.stderr[-3000:]


def test_undefined_is_mpi4py_s_value():
    mpi = pytest.importorskip("mpi4py.MPI")
    assert sim.UNDEFINED == mpi.UNDEFINED


def test_trace_names_world_ranks_and_status_names_the_sub_communicator_s():
    def fn(comm):
        rank = comm.Get_rank()
        odd = comm.Split(color=rank % 2, key=rank)  # odd ranks 1, 3 are ranks 0, 1 there
        if rank == 3:
            odd.Send(np.arange(2.0), dest=0, tag=9)
        if rank == 1:
            status = sim.Status()
            odd.Recv(np.empty(2), source=sim.ANY_SOURCE, tag=9, status=status)
            return status.Get_source()
        return None

    world = sim.World(4)
    assert world.run(fn)[1] == 1  # the sender is rank 1 of the odd communicator
    arrays = [m for m in world.trace if m.kind == "array"]
    assert [(m.source, m.dest, m.tag) for m in arrays] == [(3, 1, 9)]
    assert world.messages_sent(3) == 1 and world.messages_received(1) == 1


def test_a_deadlock_inside_a_sub_communicator_names_world_ranks():
    def fn(comm):
        rank = comm.Get_rank()
        pair = comm.Split(color=rank // 2, key=0)
        if rank >= 2:  # ranks 2, 3 both receive first: a cycle 2 -> 3 -> 2
            pair.Recv(np.empty(1), source=1 - pair.Get_rank(), tag=0)

    with pytest.raises(sim.DeadlockError, match=r"wait-for cycle: rank 2 -> rank 3 -> rank 2"):
        sim.World(4, timeout=20).run(fn)


def test_a_sub_communicator_barrier_waits_for_its_members_only():
    def fn(comm):
        rank = comm.Get_rank()
        group = comm.Split(color=0 if rank < 2 else sim.UNDEFINED)
        if group is not None:
            group.Barrier()  # ranks 2 and 3 never enter: the world barrier would deadlock
            group.Barrier()
        return group is None

    assert sim.run(fn, 4) == [False, False, True, True]

    def missing(comm):
        group = comm.Split(color=0)
        if comm.Get_rank() != 1:
            group.Barrier()

    with pytest.raises(sim.DeadlockError, match=r"rank 0 waits in Barrier \(rank 1 not arrived\)"):
        sim.World(3, timeout=20).run(missing)


def test_messages_of_one_communicator_never_match_receives_of_another():
    def fn(comm):
        rank = comm.Get_rank()
        a, b = comm.Split(color=0, key=rank), comm.Split(color=0, key=rank)  # same members, two contexts
        if rank == 0:
            a.Send(np.array([1.0]), dest=1, tag=3)
            b.Send(np.array([2.0]), dest=1, tag=3)
            return None
        got_b, got_a = np.empty(1), np.empty(1)
        b.Recv(got_b, source=0, tag=3)  # posted first, yet a's message (sent first) must not land here
        a.Recv(got_a, source=0, tag=3)
        return float(got_a[0]), float(got_b[0])

    assert sim.run(fn, 2)[1] == (1.0, 2.0)


@pytest.mark.parametrize("color,key,message", [
    (-5, 0, r"Split: rank 1 of 3: color must be >= 0 or UNDEFINED \(-32766\), got -5"),
    ("a", 0, r"Split: rank 1 of 3: color must be an int, got 'a'"),
    (0, 1.5, r"Split: rank 1 of 3: key must be an int, got 1.5"),
])
def test_a_bad_colour_or_key_on_one_rank_raises_on_every_rank(color, key, message):
    def fn(comm):
        rank = comm.Get_rank()
        with pytest.raises(ValueError, match=message):
            comm.Split(color if rank == 1 else 0, key if rank == 1 else 0)
        return True

    assert sim.run(fn, 3) == [True, True, True]


def test_out_of_range_ranks_of_a_sub_communicator_are_errors():
    def fn(comm):
        pair = comm.Split(color=comm.Get_rank() // 2)
        with pytest.raises(ValueError, match=r"dest must be a rank in 0\.\.1, got 2"):
            pair.Send(np.zeros(1), dest=2)
        with pytest.raises(ValueError, match=r"source must be a rank in 0\.\.1, got 3"):
            pair.Irecv(np.zeros(1), source=3)
        return True

    assert sim.run(fn, 4) == [True] * 4
