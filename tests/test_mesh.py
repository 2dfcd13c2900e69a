"""The device mesh (issue 22): its groups equal picotron's enumeration for every shape of 8
ranks, each rank's sub-communicators hold exactly those ranks in coordinate order, and bad
shapes, mismatched meshes and a missing rank are clear errors on every rank."""
import itertools
import time

import numpy as np
import pytest

from minidist import p2p, sim
from minidist.collectives import all_gather, all_reduce
from minidist.parallel.mesh import DeviceMesh, check_mesh, mesh_groups
from minidist.tracing import CountingComm

NAMES = ("dp", "pp", "tp")
SHAPES_OF_8 = [s for s in itertools.product((1, 2, 4, 8), repeat=3) if np.prod(s) == 8]


def picotron_groups(dp, pp, tp):
    """picotron's ProcessGroupManager enumeration (grid = arange(P).view(dp, pp, tp)), written
    out as it writes it: the oracle for mesh_groups."""
    grid = np.arange(dp * pp * tp).reshape(dp, pp, tp)
    return {"tp": [grid[d, p, :].tolist() for d in range(dp) for p in range(pp)],
            "pp": [grid[d, :, t].tolist() for d in range(dp) for t in range(tp)],
            "dp": [grid[:, p, t].tolist() for p in range(pp) for t in range(tp)]}


@pytest.mark.parametrize("shape", SHAPES_OF_8, ids=lambda s: "x".join(map(str, s)))
def test_groups_equal_picotrons_enumeration(shape):
    expected = picotron_groups(*shape)
    for dim, name in enumerate(NAMES):
        assert mesh_groups(shape, dim) == expected[name]


def test_the_mesh_of_the_docstring():
    assert mesh_groups((2, 2, 2), 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh_groups((2, 2, 2), 1) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh_groups((2, 2, 2), 0) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_every_rank_of_every_shape_of_8_gets_its_lines_as_communicators():
    def rank(comm, shape):
        mesh = DeviceMesh(comm, shape, NAMES)
        found = {}
        for name in NAMES:
            group = mesh.get_group(name)
            members = all_gather(group, np.array([comm.Get_rank()]))  # in the group's rank order
            found[name] = (group.Get_rank(), group.Get_size(), members.ravel().tolist(), mesh.get_local_rank(name))
        mesh.free()
        return mesh.coordinate, found

    world = sim.World(8)
    for shape in SHAPES_OF_8:
        for r, (coordinate, found) in enumerate(world.run(rank, shape)):
            assert coordinate == tuple(int(c) for c in np.unravel_index(r, shape))
            for dim, name in enumerate(NAMES):
                local, size, members, local_rank = found[name]
                line = next(g for g in mesh_groups(shape, dim) if r in g)
                assert members == line and local == coordinate[dim] == local_rank and size == shape[dim]


def test_two_and_one_dimensional_meshes_and_sizes():
    def rank(comm):
        flat = DeviceMesh(comm, (6,), ("dp",))
        grid = DeviceMesh(comm, (3, 2), ("dp", "tp"))
        return (flat.get_group("dp").Get_size(), grid.size(), grid.size("dp"), grid.coordinate,
                grid.groups("tp"), repr(grid), grid.rank_names("tp"), grid.rank_names("dp"))

    results = sim.run(rank, 6)
    assert [r[3] for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert results[0][:3] == (6, 6, 3) and results[0][4] == [[0, 1], [2, 3], [4, 5]]
    assert results[5][5] == "DeviceMesh(dp=3, tp=2; this rank 5 at dp=2, tp=1)"
    assert results[5][6:] == (["4 (tp rank 0)", "5 (tp rank 1)"], ["1 (dp rank 0)", "3 (dp rank 1)", "5 (dp rank 2)"])


@pytest.mark.parametrize("shape, names, match", [
    ((2, 2), ("dp", "tp"), r"holds 4 ranks, but the communicator has 6; choose sizes whose product is 6"),
    ((3, 0), ("dp", "tp"), r"positive integers"),
    ((6,), ("dp", "tp"), r"one distinct name per dimension"),
    ((3, 2), ("dp", "dp"), r"one distinct name per dimension"),
    ((), (), r"positive integers"),
    ((2.0, 3), ("dp", "tp"), r"positive integers"),
])
def test_bad_shapes_are_refused_before_any_message(shape, names, match):
    with pytest.raises(ValueError, match=match):
        check_mesh(6, shape, names)
    world = sim.World(6)

    def rank(comm):
        with pytest.raises(ValueError, match=match):
            DeviceMesh(comm, shape, names)
        return True

    assert world.run(rank) == [True] * 6 and world.trace == []


def test_unknown_dimension_names_the_known_ones():
    def rank(comm):
        mesh = DeviceMesh(comm, (2, 1), ("dp", "tp"))
        with pytest.raises(ValueError, match="no dimension 'pp'; its dimensions are dp, tp"):
            mesh.get_group("pp")
        return True

    assert sim.run(rank, 2) == [True, True]


def test_ranks_that_ask_for_different_meshes_fail_alike():
    def rank(comm):
        shape = (2, 2) if comm.Get_rank() == 1 else (1, 4)
        with pytest.raises(p2p.CollectiveError, match=r"different meshes \(rank 0: \{'dp': 1, 'tp': 4\}, "
                                                        r"rank 1: \{'dp': 2, 'tp': 2\}"):
            DeviceMesh(comm, shape, ("dp", "tp"))
        return True

    assert sim.run(rank, 4) == [True] * 4


def test_a_rank_that_never_arrives_is_named_within_the_deadline():
    def rank(comm):
        if comm.Get_rank() == 2:
            time.sleep(1.5)
            return None
        try:
            DeviceMesh(comm, (2, 2), ("pp", "tp"))
        except p2p.CollectiveTimeout as error:
            return error.missing, str(error)

    previous = p2p.set_timeout(0.4)  # once, here: the deadline is the process's, shared by the rank threads
    try:
        results = sim.run(rank, 4)
    finally:
        p2p.set_timeout(previous)
    for missing, message in [r for r in results if r is not None]:
        assert missing == [2] and message.startswith("device mesh (before comm.Split): ")


def test_a_group_that_carries_rank_names_times_out_naming_the_rank_as_the_job_numbers_it():
    """A tp group wrapped in a CountingComm that carries mesh.rank_names: rank 2's all-reduce over
    it gives up naming rank 3 as the job numbers it, with its number in the group."""
    def rank(comm):
        mesh = DeviceMesh(comm, (2, 2), ("dp", "tp"))
        group = CountingComm(mesh.get_group("tp"), allow_collectives=True)
        group.rank_names = mesh.rank_names("tp")
        if comm.Get_rank() == 3:
            time.sleep(1.0)  # silent past the deadline
        elif comm.Get_rank() == 2:
            with pytest.raises(p2p.CollectiveTimeout) as info:
                all_reduce(group, np.ones(4))
            return str(info.value), info.value.missing
        return None

    previous = p2p.set_timeout(0.3)
    try:
        message, missing = sim.run(rank, 4)[2]
    finally:
        p2p.set_timeout(previous)
    assert "rank 2 (tp rank 0) has not heard from rank 3 (tp rank 1)" in message and missing == [1]
