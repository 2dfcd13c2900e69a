"""minidist.course.checks.mesh (exercise 16): the solution's build_groups passes on every shape of 8
ranks and the uneven ones; versions wrong in each way the check looks for fail, each with its own
hint (tp outermost, the key not the coordinate, colliding colours, colour and key swapped, a
dimension of size 1 forgotten, a Split too many, a Split on some ranks only); groups hard-coded for
one shape fail on the others; the engine's DeviceMesh and the check's own lines are refused; a stub
says it is one."""
import numpy as np
import pytest

from minidist.course.checks import STUB_HINT, LearnerError
from minidist.course.checks import mesh as mesh_checks
from minidist.parallel.mesh import DeviceMesh, mesh_groups

OWN = "own implementation, not yours"


def build(mistake=None):
    """The exercise's build_groups, the solution's or with one mistake."""

    def build_groups(comm, shape):
        rank = comm.Get_rank()
        coordinate = np.unravel_index(rank, shape, order="F" if mistake == "tp_outermost" else "C")
        groups = {}
        for dim, name in enumerate(("dp", "pp", "tp")):
            if mistake == "size_one" and shape[dim] == 1:
                continue
            others = [int(c) for d, c in enumerate(coordinate) if d != dim]
            color = int(np.ravel_multi_index(others, [s for d, s in enumerate(shape) if d != dim]))
            key = int(coordinate[dim])
            if mistake == "collision":
                color = sum(others)
            elif mistake == "key":
                key = -key
            elif mistake == "swapped":
                color, key = key, color
            groups[name] = comm.Split(color=color, key=key)
        if mistake == "extra_split" or (mistake == "some_ranks" and rank == 0):
            comm.Split(0, 0)
        return groups

    return build_groups


def test_the_solution_passes_on_every_shape():
    verdict = mesh_checks.check_build_groups(build())
    lines = verdict.splitlines()
    assert lines[0] == "build_groups: ok" and len(lines) == 1 + len(mesh_checks.SHAPES) == 13
    assert "(3, 2, 2) on 12 ranks: groups of dp 3, pp 2, tp 2" in verdict and "(1, 3, 1) on 3 ranks" in verdict
    assert sorted(s for s in mesh_checks.SHAPES if np.prod(s) == 8) == \
        sorted((d, p, 8 // (d * p)) for d in (1, 2, 4, 8) for p in (1, 2, 4, 8) if 8 % (d * p) == 0)


@pytest.mark.parametrize("mistake, hint", [
    ("tp_outermost", "Yours puts tp outermost"),
    ("key", "the right ranks in the wrong order"),
    ("collision", "two lines share a colour"),
    ("swapped", "colour and key are swapped"),
    ("size_one", "a dimension of size 1 too"),
    ("extra_split", "one comm.Split(color, key) per dimension"),
    ("some_ranks", "comm.Split is collective"),
])
def test_each_mistake_gets_its_hint(mistake, hint):
    with pytest.raises((AssertionError, LearnerError)) as caught:
        mesh_checks.check_build_groups(build(mistake))
    assert hint in str(caught.value), str(caught.value)


def test_groups_hard_coded_for_one_shape_fail_on_the_others():
    table = {name: mesh_groups((2, 2, 2), dim) for dim, name in enumerate(("dp", "pp", "tp"))}

    def hard_coded(comm, shape):  # the 2 x 2 x 2 answer, whatever the shape
        rank = comm.Get_rank()
        return {name: comm.Split(color=next(i for i, line in enumerate(lines) if rank in line), key=rank)
                for name, lines in table.items()}

    with pytest.raises(AssertionError) as caught:
        mesh_checks.check_build_groups(hard_coded)
    assert "shape=(1, 1, 8)" in str(caught.value)


def test_the_diagnosis_against_the_mesh_lines():
    """diagnose names the right mistake from the members alone (shape (3, 2, 2), rank 5 at (1, 0, 1))."""
    assert mesh_checks.diagnose((3, 2, 2), 2, 5, [4, 5]) is None
    assert mesh_checks.diagnose((3, 2, 2), 2, 5, [5, 4])[1] == "key"
    assert mesh_checks.diagnose((3, 2, 2), 0, 5, [1, 9, 5])[1] == "key"
    assert mesh_checks.diagnose((3, 2, 2), 2, 5, [5, 8])[1] == "members"
    column_major = next(line for line in mesh_checks.lines((3, 2, 2), 2, "F") if 5 in line)
    assert column_major == [5, 11] and mesh_checks.diagnose((3, 2, 2), 2, 5, column_major)[1] == "tp_outermost"
    assert mesh_checks.diagnose((3, 2, 2), 1, 5, [5, 7, 9, 11])[1] == "collision"
    assert mesh_checks.diagnose((3, 2, 2), 2, 5, [1, 3, 5, 7, 9, 11])[1] == "swapped"


def test_the_engine_is_refused_and_a_stub_says_so():
    def engine(comm, shape):
        mesh = DeviceMesh(comm, shape, ("dp", "pp", "tp"))
        return {name: mesh.get_group(name) for name in ("dp", "pp", "tp")}

    with pytest.raises((AssertionError, LearnerError)) as caught:
        mesh_checks.check_build_groups(engine)
    assert OWN in str(caught.value)

    def stub(comm, shape):
        raise NotImplementedError()

    with pytest.raises((AssertionError, LearnerError)) as caught:
        mesh_checks.check_build_groups(stub)
    assert STUB_HINT in str(caught.value)


def test_the_checks_own_lines_are_refused():
    """Passed before: the colour taken from the check's own helper, mesh_checks.lines (the mesh's
    lines, as mesh_groups gives them), instead of the other coordinates raveled."""
    def from_the_checks(comm, shape):
        rank = comm.Get_rank()
        return {name: comm.Split(next(i for i, line in enumerate(mesh_checks.lines(shape, dim)) if rank in line), rank)
                for dim, name in enumerate(mesh_checks.NAMES)}

    with pytest.raises(LearnerError) as caught:
        mesh_checks.check_build_groups(from_the_checks)
    assert "called minidist.course.checks.mesh.lines, the checks' own implementation, not yours" in str(caught.value)
