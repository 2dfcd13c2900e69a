"""minidist.course.checks.integrity.unchanged: names of a module or of a class it defines that
are rebound, added or deleted while it is active are put back, and the check fails naming them
(an exception from inside wins); the checks of chapters 16-18 use it, so a learner's function
that changes the check's own names while the check runs fails (a flat ring that set
topology_checks.SLACK = 1e9 passed check 17 before)."""
import types

import numpy as np
import pytest

from minidist.collectives import all_reduce
from minidist.course.checks import elastic as elastic_checks
from minidist.course.checks import mesh as mesh_checks
from minidist.course.checks import topology as topology_checks
from minidist.course.checks.integrity import unchanged


def fake_module():
    module = types.ModuleType("fake_checks")

    class Thing:
        size = 1

    Thing.__module__, Thing.__qualname__ = "fake_checks", "Thing"
    module.LIMIT, module.Thing, module.helper = 1.0, Thing, len
    return module


def test_names_changed_inside_are_put_back_and_named():
    module = fake_module()
    with pytest.raises(AssertionError) as caught:
        with unchanged(module):
            module.LIMIT, module.extra, module.Thing.size = 1e9, "new", 99
            del module.helper
    message = str(caught.value)
    for name in ("fake_checks.LIMIT", "fake_checks.extra", "fake_checks.helper", "fake_checks.Thing.size"):
        assert name in message
    assert (module.LIMIT, module.helper, module.Thing.size, hasattr(module, "extra")) == (1.0, len, 1, False)


def test_nothing_changed_passes_and_an_inner_failure_wins():
    module = fake_module()
    with unchanged(module):
        assert module.Thing().size == 1  # reading is fine
    with pytest.raises(ValueError, match="inner"):
        with unchanged(module):
            module.LIMIT = 2.0
            raise ValueError("inner")
    assert module.LIMIT == 1.0


def test_a_learner_changing_the_checks_while_they_run_fails():
    def flat_ring(comm, x, ranks_per_node):
        topology_checks.SLACK = 1e9  # three times the bound would pass
        return all_reduce(comm, x, algorithm="ring")

    with pytest.raises(AssertionError, match="changed minidist.course.checks.topology.SLACK"):
        topology_checks.check_hierarchical_all_reduce(flat_ring)
    assert topology_checks.SLACK == 1e-9

    def groups_and_a_patch(comm, shape):  # right groups; the patch alone fails it (check 16 is guarded too)
        mesh_checks.diagnose = lambda *args: None
        coordinate = np.unravel_index(comm.Get_rank(), shape)
        return {name: comm.Split(int(np.ravel_multi_index([c for d, c in enumerate(coordinate) if d != dim],
                                                          [s for d, s in enumerate(shape) if d != dim])),
                                 int(coordinate[dim])) for dim, name in enumerate(mesh_checks.NAMES)}

    with pytest.raises(AssertionError, match="changed minidist.course.checks.mesh.diagnose"):
        mesh_checks.check_build_groups(groups_and_a_patch)
    assert mesh_checks.diagnose.__module__ == "minidist.course.checks.mesh"

    class LooseSampler:  # every rank reads the first samples, and every comparison of the check passes
        def __init__(self, num_samples, global_batch_size, world_size, rank, seed=0):
            np.array_equal = lambda *args, **kwargs: True

        def next_indices(self):
            return np.arange(3)

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    real = np.array_equal
    with pytest.raises(AssertionError, match="changed numpy.array_equal"):
        elastic_checks.check_elastic_sampler(LooseSampler)
    assert np.array_equal is real


def test_the_runners_guard_names_what_a_check_could_be_fooled_by_and_not_the_engines_own_state():
    """grading.Snapshot.changed, which fails an exercise cell during which the learner's code
    changed a name: a constant of the checks, a numpy function, an engine class's method, a
    function's code; not the engine's plain data (a deadline set through p2p.set_timeout), nor a
    name added to a module (a submodule imported)."""
    import numpy as np

    from minidist import p2p, sim
    from minidist.course import grading
    from minidist.course.checks import topology as topology_checks

    guard = grading.Snapshot()
    saved = (topology_checks.SLACK, np.array_equal, sim.World.run, p2p.agree.__code__, p2p.get_timeout())
    try:
        p2p.set_timeout(12.5)  # the engine's own state: not counted
        assert guard.changed() == []
        topology_checks.SLACK = 1e9
        np.array_equal = lambda *args, **kwargs: True
        sim.World.run = lambda *args, **kwargs: None
        p2p.agree.__code__ = (lambda *args, **kwargs: None).__code__
        assert guard.changed() == ["minidist.course.checks.topology.SLACK", "minidist.p2p.agree.__code__",
                                   "minidist.sim.world.World.run", "numpy.array_equal"]
    finally:
        topology_checks.SLACK, np.array_equal, sim.World.run, p2p.agree.__code__ = saved[:4]
        p2p.set_timeout(saved[4])
    assert guard.changed() == []


def test_numpy_submodules_are_guarded_by_the_runner_and_by_the_checks():
    """``numpy._core.numeric.isclose = lambda *a, **k: True`` made np.allclose always true and
    passed check 15 (in the answer cell: put back before the check cell; inside the learner's
    function: named by both guards), issue 36."""
    import secrets

    import numpy._core.numeric as numeric

    from minidist.course import grading

    real, randbits = numeric.isclose, secrets.randbits
    guard = grading.Snapshot()
    try:
        numeric.isclose = lambda *args, **kwargs: True
        secrets.randbits = lambda k: 0  # the checks' fresh inputs (13-15, 18) made predictable
        assert np.allclose(0.0, 1.0)  # what the learner's line did
        assert guard.changed() == ["numpy._core.numeric.isclose", "secrets.randbits"]
        guard.restore()
        assert numeric.isclose is real and not np.allclose(0.0, 1.0) and secrets.randbits is randbits
        with pytest.raises(AssertionError, match="changed numpy._core.numeric.isclose"):
            with unchanged(np):
                numeric.isclose = lambda *args, **kwargs: True
        assert numeric.isclose is real
    finally:
        numeric.isclose, secrets.randbits = real, randbits


NUMPY_LAZY = """
import sys

import numpy as np

from minidist.course.checks.integrity import unchanged

assert "numpy.ma" not in sys.modules, "numpy.ma already imported: the test needs a fresh numpy"
with unchanged(np):
    np.unique(np.arange(3))  # numpy imports numpy.ma here and binds np.ma
np.unique(np.arange(3))  # np.ma deleted by the guard made this a RecursionError
print("ok", "ma" in vars(np))
"""


def test_a_submodule_numpy_imports_lazily_is_not_the_learners_doing():
    """numpy binds ``np.ma`` on first use (``np.unique`` reads it): the guard neither reports nor
    deletes it. It deleted it, and exercise 18's next check died with a RecursionError in
    numpy's ``__getattr__`` instead of its hint (issue 36). A fresh interpreter: numpy.ma is
    already loaded in this one."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", NUMPY_LAZY], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["ok", "True"]


def test_a_submodule_added_to_a_guarded_module_is_left_and_other_modules_are_not():
    import sys

    module = fake_module()
    sub = types.ModuleType("fake_checks.sub")
    sys.modules["fake_checks.sub"] = sub
    try:
        with unchanged(module):
            module.sub = sub  # an import of fake_checks.sub
        assert module.sub is sub
        with pytest.raises(AssertionError, match="fake_checks.other"):
            with unchanged(module):
                module.other = types.ModuleType("other")  # a module, but not its submodule
        assert not hasattr(module, "other")
    finally:
        sys.modules.pop("fake_checks.sub", None)


def test_a_scrambled_comm_delivers_every_array_spoiled_and_the_rest_unchanged():
    """checks.crossing.ScrambledComm, which checks 14 and 15 use to see that an answer came
    through the communicator: floats arrive NaN, integers and booleans bit-flipped, whatever
    call sent them; pickled objects (the collectives' agreement) and the rank pass through."""
    from minidist import sim
    from minidist.collectives import ALL_REDUCE_ALGORITHMS
    from minidist.course.checks.crossing import ScrambledComm, spoiled

    assert np.isnan(spoiled(np.arange(3.0))).all()
    assert spoiled(np.array([0, 5], dtype=np.int64)).tolist() == [-1, -6]
    assert spoiled(np.array([True, False])).tolist() == [False, True]

    def exchange(comm):
        scrambled, rank = ScrambledComm(comm), comm.Get_rank()
        other = 1 - rank
        got = {"object": scrambled.allgather({"rank": rank})}
        floats, ints = np.empty(2), np.empty(2, dtype=np.int32)
        scrambled.Sendrecv(np.ones(2), dest=other, recvbuf=floats, source=other)
        if rank == 0:
            scrambled.Send([np.array([1, 2], dtype=np.int32), None], dest=1)
        else:
            scrambled.Recv(ints, source=0)
        got.update(floats=floats.tolist(), ints=ints.tolist() if rank else None)
        got["sums"] = [all_reduce(scrambled, np.full(4, 1.0 + rank), algorithm=a).tolist()
                       for a in ALL_REDUCE_ALGORITHMS]
        return got

    for rank, got in enumerate(sim.World(2).run(exchange)):
        assert got["object"] == [{"rank": 0}, {"rank": 1}] and np.isnan(got["floats"]).all()
        assert got["ints"] == (None if rank == 0 else [-2, -3])
        assert all(np.isnan(s).all() for s in got["sums"]), got["sums"]  # every algorithm: no value right
