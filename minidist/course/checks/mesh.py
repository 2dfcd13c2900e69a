"""The check of exercise 16: a device mesh's three groups, built with ``comm.Split``.

:func:`check_build_groups` takes your ``build_groups(comm, shape)``: ``shape`` = (D, S, T), the
ranks along ("dp", "pp", "tp"), with D x S x T = ``comm.Get_size()``. The ranks are numbered
row-major, tp fastest (Narayanan et al., SC 2021; picotron's and torchtitan's order), so a rank
sits at the coordinate ``numpy.unravel_index(rank, shape)``:

    rank = (dp_rank * S + pp_rank) * T + tp_rank

A dimension's groups are the lines of that grid along it: fix the other two coordinates, sweep
this one. It returns ``{"dp": ..., "pp": ..., "tp": ...}``, each this rank's group along that
dimension, made by one ``comm.Split(color, key)`` (MPI_Comm_split): the colour numbers the line
(the other two coordinates, raveled row-major), the key orders the line's ranks by this
dimension's coordinate, so that ``group.Get_rank()`` is the coordinate. Three Splits per rank, a
dimension of size 1 included (its group is this rank alone).

On simulated worlds of every shape of 8 ranks (the ten ordered factorisations) and two uneven
ones, :data:`SHAPES`, it checks on every rank: the three names are there; ``comm.Split`` was
called exactly three times; each group has the dimension's size and this rank's coordinate as
its rank; and an all_gather of the members' ranks in ``comm`` over the group gives exactly the
line of :func:`minidist.parallel.mesh.mesh_groups`, in coordinate order.

Known mistakes get their hint: tp outermost (the ranks numbered column-major: a tp group's ranks
are no longer neighbours, and a node's fast links carry pipeline or data-parallel traffic), a key
that is not the coordinate (the right ranks in the wrong order), colours that collide (two lines
merged into one group: the other coordinates added, not raveled), colour and key swapped, a
dimension of size 1 forgotten, Split called a different number of times on different ranks (a
deadlock: Split is collective).

The engine's ``DeviceMesh`` and ``mesh_groups`` may not be the answer, nor be called by it, and
neither may this module's :func:`lines` (the same lines, kept for the diagnosis). A
failure raises ``AssertionError("what: problem\\nHint: ...")`` on every rank (the ranks agree first:
:func:`minidist.course.checks.fail_together`); your code raising gives a
:class:`minidist.course.checks.LearnerError` with your line. On success it returns one verdict
line per shape::

    from minidist.course.checks import mesh as mesh_checks
    print(mesh_checks.check_build_groups(build_groups))

The same function runs under real MPI too: :func:`check_build_groups_under_mpi` takes MPI's
``COMM_WORLD`` from the mpirun script ``exercises/16_3d_parallelism.py`` (``mpiexec -n P``) and
checks every (dp, pp, tp) shape of P ranks the same way, on MPI's own ``Comm.Split``.

The puzzle's second part, :func:`check_farthest_link`, takes your ``farthest_link(shape, order,
tiers)``: for the ranks numbered row-major in ``order`` (outermost first) on nodes of ``tiers[0]``
ranks and racks of ``tiers[1]``, the farthest link (0 node, 1 rack, 2 network) that any group of
each dimension spans, against :func:`farthest_tiers` on :data:`TIER_CASES` (GPT-3's (4, 4, 8) in
all six orders; tp = 3 straddling nodes of 8; dimensions of size 1), with a hint for the order read
backwards, a group judged by its span alone, rank 0's group only and a dimension of size 1.
"""
from __future__ import annotations

import math
import sys

import numpy as np

from minidist import collectives, sim
from minidist.collectives import all_gather
from minidist.course.checks import LearnerError, call_learner, check_own_code, fail, fail_together, forbidding
from minidist.course.checks.integrity import unchanged
from minidist.parallel import mesh as engine_mesh
from minidist.parallel.mesh import mesh_groups

NAMES = ("dp", "pp", "tp")
# Every ordered (dp, pp, tp) of 8 ranks, (2, 2, 2) first (every mistake shows there), then uneven
# sizes: 12 ranks of (3, 2, 2), a lone pipeline of 3.
SHAPES = ((2, 2, 2),) + tuple((d, p, 8 // (d * p)) for d in (1, 2, 4, 8) for p in (1, 2, 4, 8)
                              if 8 % (d * p) == 0 and (d, p) != (2, 2)) + ((3, 2, 2), (1, 3, 1))

HINTS = {
    "names": 'return a dict with exactly the keys "dp", "pp" and "tp", each this rank\'s group (a communicator)',
    "size_one": ("every dimension gets its group, a dimension of size 1 too (a communicator of this rank alone): "
                 "call comm.Split for each of the three, so that every rank makes the same calls and the caller "
                 "can use mesh['pp'] whatever the shape"),
    "splits": ("one comm.Split(color, key) per dimension on the comm you are given, three in all, the same on every "
               "rank: each call is collective"),
    "tp_outermost": ("number the ranks row-major with tp fastest: coordinate = np.unravel_index(rank, shape), so "
                     "rank = (dp * S + pp) * T + tp. Yours puts tp outermost: a tp group's ranks are not neighbours, "
                     "and the launcher fills a node with consecutive ranks, so tensor parallelism, which talks at "
                     "every layer, would cross the slow network"),
    "key": ("the right ranks in the wrong order: the key orders a group's ranks, so pass this rank's coordinate "
            "along the dimension (key=coordinate[d]); then group.Get_rank() is that coordinate, which the "
            "pipeline (stage = pp rank) and the tensor-parallel shards (shard = tp rank) rely on"),
    "collision": ("two lines share a colour: the colour must number the line, one number per setting of the two "
                  "other coordinates. Ravel them, e.g. np.ravel_multi_index(others, other_sizes) or a * size_b + b, "
                  "not a + b"),
    "swapped": ("your group holds the ranks with the same coordinate along this dimension: colour and key are "
                "swapped. The colour is the other coordinates (the line), the key this dimension's coordinate"),
    "members": ("a group along dimension d holds the ranks whose other coordinates equal this rank's, ordered by "
                "their coordinate along d: Split with colour = the other coordinates raveled, key = coordinate[d]"),
    "deadlock": ("comm.Split is collective: every rank of comm must call it, the same number of times and in the "
                 "same order, even for a dimension of size 1 (do not skip a Split on some ranks only)"),
}


class SplitCounter:
    """The communicator ``build_groups`` gets in the check: every attribute is ``comm``'s, and
    each ``Split(color, key)`` is counted (``splits``: the (color, key) pairs in call order)."""

    def __init__(self, comm):
        self._comm = comm
        self.splits = []

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def Split(self, color=0, key=0):  # mpi4py's name
        self.splits.append((color, key))
        return self._comm.Split(color, key)


def lines(shape, dim: int, order: str = "C") -> list[list[int]]:
    """The groups along ``dim`` of ranks numbered row-major (``order="C"``, the mesh's) or
    column-major (``"F"``: tp outermost), each in coordinate order."""
    grid = np.arange(math.prod(shape)).reshape(shape, order=order)
    return np.moveaxis(grid, dim, -1).reshape(-1, shape[dim]).tolist()


def diagnose(shape, dim: int, rank: int, members: list[int]) -> tuple[str, str] | None:
    """(problem, hint key) for the world ranks ``members`` that rank ``rank``'s group along
    ``dim`` holds, in group order; None when they are the line of :func:`mesh_groups`."""
    want = next(line for line in mesh_groups(shape, dim) if rank in line)
    if members == want:
        return None
    problem = f"the group holds ranks {members}, expected {want}"
    column_major = next(line for line in lines(shape, dim, "F") if rank in line)
    coordinate = np.unravel_index(rank, shape)[dim]
    if sorted(members) == sorted(want):
        return problem, "key"
    if sorted(members) == sorted(column_major):
        return problem, "tp_outermost"
    if shape[dim] > 1 and len(members) > 1 and all(np.unravel_index(m, shape)[dim] == coordinate for m in members):
        return problem, "swapped"
    if set(want) < set(members):
        return problem, "collision"
    return problem, "members"


def _problem(what, comm, shape, groups, splits):
    """This rank's problem before any group is used (or None): names, communicators, Split count."""
    if not isinstance(groups, dict) or set(groups) != set(NAMES):
        got = sorted(groups) if isinstance(groups, dict) else type(groups).__name__
        missing = [n for n in NAMES if not isinstance(groups, dict) or n not in groups]
        size_one = missing and all(shape[NAMES.index(n)] == 1 for n in missing)
        return what, f"expected a dict with keys dp, pp, tp, got {got}", HINTS["size_one" if size_one else "names"]
    for dim, name in enumerate(NAMES):
        group = groups[name]
        if not all(hasattr(group, m) for m in ("Get_rank", "Get_size", "Send", "Recv")):
            hint = HINTS["size_one"] if shape[dim] == 1 else HINTS["members"]
            return what, f"groups[{name!r}] is {type(group).__name__}, not a communicator", hint
        if group is comm or getattr(group, "_comm", None) is comm:
            return what, f"groups[{name!r}] is comm itself, not a group made by comm.Split", \
                HINTS["size_one" if shape[dim] == 1 else "splits"]
    if len(splits) != len(NAMES):
        hint = HINTS["size_one"] if len(splits) < len(NAMES) and 1 in shape else HINTS["splits"]
        return what, f"comm.Split was called {len(splits)} times, expected {len(NAMES)} (one per dimension)", hint
    return None


def _mesh_rank(comm, build_groups, shape):
    rank, size = comm.Get_rank(), comm.Get_size()
    what = f"build_groups(comm, shape={shape}) on {size} rank{'s' * (size > 1)}"
    counted = SplitCounter(comm)
    try:
        groups = call_learner(what, build_groups, counted, shape, name="your build_groups")
    except LearnerError as error:  # a deadlock in Split: say why Split, not Send/Recv, deadlocks
        head, _, rest = str(error).partition("\nHint: ")
        if not head.startswith(f"{what}: deadlock"):
            raise
        raise LearnerError(f"{head}\nHint: {HINTS['deadlock']}" + "".join(rest.partition("\n")[1:])) from None
    fail_together(comm, _problem(what, comm, shape, groups, counted.splits))
    coordinate = np.unravel_index(rank, shape)
    problems = {}
    for dim, name in enumerate(NAMES):  # every rank gathers over every group, in the same order: no deadlock
        members = all_gather(groups[name], np.array([rank])).ravel().tolist()
        found = diagnose(shape, dim, rank, members)
        if found is None and (groups[name].Get_size(), groups[name].Get_rank()) != (shape[dim], coordinate[dim]):
            found = (f"group.Get_rank() is {groups[name].Get_rank()}, expected the coordinate {coordinate[dim]}",
                     "key")
        if found is not None:
            problems[name] = (f"{what}, rank {rank} at (dp, pp, tp) = {tuple(int(c) for c in coordinate)}, "
                              f"its {name} group", found[0], HINTS[found[1]])
    fail_together(comm, next((problems[n] for n in ("tp", "pp", "dp") if n in problems), None))  # tp's first
    return groups


@forbidding(engine_mesh.DeviceMesh.__init__, engine_mesh.mesh_groups, engine_mesh.DeviceMesh.groups, lines)
@unchanged(sys.modules[__name__], engine_mesh, collectives, sim, np)
def check_build_groups(build_groups) -> str:
    """Check your ``build_groups(comm, shape)`` (module docstring) on every shape of
    :data:`SHAPES`; return one verdict line per shape."""
    check_own_code(build_groups, "build_groups")
    verdicts = ["build_groups: ok"]
    for shape in SHAPES:
        size = math.prod(shape)
        try:
            sim.World(size, timeout=60).run(_mesh_rank, build_groups, shape)
        except (sim.DeadlockError, sim.SimTimeoutError) as error:
            fail(f"build_groups(comm, shape={shape}) on {size} simulated ranks", str(error).split("\n")[0][:400],
                 HINTS["deadlock"])
        sizes = ", ".join(f"{n} {s}" for n, s in zip(NAMES, shape))
        verdicts.append(f"{shape} on {size} ranks: groups of {sizes}, each a line of the mesh in coordinate "
                        "order, 3 Splits per rank")
    return "\n".join(verdicts)


def mesh_shapes(size: int) -> list[tuple[int, int, int]]:
    """Every ordered (dp, pp, tp) whose product is ``size`` (8: the ten of :data:`SHAPES`' first
    part; 4: six), (1, 1, size) first when there is more than one."""
    return sorted(((d, p, size // (d * p)) for d in range(1, size + 1) for p in range(1, size // d + 1)
                   if size % (d * p) == 0), key=lambda shape: (shape != (1, 1, size), shape))


@forbidding(engine_mesh.DeviceMesh.__init__, engine_mesh.mesh_groups, engine_mesh.DeviceMesh.groups, lines)
@unchanged(sys.modules[__name__], engine_mesh, collectives, np)
def check_build_groups_under_mpi(comm, build_groups) -> str:
    """Check your ``build_groups(comm, shape)`` on a real communicator (``mpiexec -n P``, the
    mpirun script ``16_3d_parallelism.py``): every shape of :func:`mesh_shapes` (P), each on every
    rank, as :func:`check_build_groups` checks one on the simulator (names, three Splits, each
    group's size, this rank's coordinate as its rank, the members by an all-gather over the
    group). Returns one verdict line per shape. Collective over ``comm``; raises AssertionError
    on every rank (LearnerError on the rank whose code raised)."""
    check_own_code(build_groups, "build_groups")
    verdicts = ["build_groups: ok under MPI"]
    for shape in mesh_shapes(comm.Get_size()):
        for group in _mesh_rank(comm, build_groups, shape).values():
            if hasattr(group, "Free"):
                group.Free()  # MPI's communicators are a finite resource: 3 per shape and rank
        sizes = ", ".join(f"{n} {s}" for n, s in zip(NAMES, shape))
        verdicts.append(f"{shape} on {comm.Get_size()} MPI ranks: groups of {sizes}, each a line of the mesh in "
                        "coordinate order, 3 Splits per rank")
    return "\n".join(verdicts)


# -- the puzzle's second part: which links a mesh order puts each dimension on ------------------

TIERS = ("node", "rack", "network")
# (shape as {name: size}, order outermost first, (ranks per node, ranks per rack)): GPT-3's mesh of
# chapter 16 on 128 GPUs in all six orders, then sizes that straddle a node (tp = 3 on nodes of 8),
# dimensions of size 1, and a rack that is one node.
TIER_CASES = tuple(({"dp": 4, "pp": 4, "tp": 8}, order, (8, 32)) for order in (
    ("dp", "pp", "tp"), ("pp", "dp", "tp"), ("tp", "pp", "dp"), ("dp", "tp", "pp"), ("pp", "tp", "dp"),
    ("tp", "dp", "pp"))) + (
    ({"dp": 2, "pp": 4, "tp": 3}, ("dp", "pp", "tp"), (8, 16)),
    ({"dp": 3, "pp": 2, "tp": 4}, ("pp", "dp", "tp"), (8, 16)),
    ({"dp": 1, "pp": 8, "tp": 1}, ("dp", "pp", "tp"), (4, 8)),
    ({"dp": 6, "pp": 1, "tp": 2}, ("pp", "dp", "tp"), (4, 4)),
)
TIER_HINTS = {
    "type": 'return a dict {"dp": tier, "pp": tier, "tp": tier}, each 0 (node), 1 (rack) or 2 (network)',
    "stride": ("the ranks are numbered row-major in the order given, outermost first: the last name varies "
               "fastest, and a dimension's neighbours lie (product of the sizes of the names after it) ranks apart"),
    "straddle": ("a group can stay inside a block of ranks per node in size and still straddle two nodes (3 ranks "
                 "from rank 6 on nodes of 8: ranks 6, 7, 8). Look at the node (rank // ranks_per_node) and rack "
                 "(rank // ranks_per_rack) of every member of every group"),
    "every_group": ("the farthest link over *every* group of the dimension, not only rank 0's: with sizes that do "
                    "not divide a node, groups further on straddle a boundary that the first does not"),
    "size_one": "a dimension of size 1 has groups of one rank, which talk to nobody: tier 0",
    "values": ("for each dimension, enumerate its groups (fix the other coordinates, sweep this one), turn each "
               "member's coordinate into its rank, and take the farthest tier any group spans"),
}


def _rank_grid(shape: dict, order) -> np.ndarray:
    """The ranks laid out on the mesh, axes in ``order`` (row-major: the last name fastest)."""
    return np.arange(math.prod(shape.values())).reshape([shape[name] for name in order])


def farthest_tiers(shape: dict, order, tiers, *, every_group: bool = True) -> dict:
    """{name: 0 node, 1 rack, 2 network}: the farthest link any group along ``name`` spans when the
    ranks are numbered row-major in ``order`` on nodes of ``tiers[0]`` ranks and racks of
    ``tiers[1]`` (``every_group=False``: rank 0's group only, for the diagnosis)."""
    grid, found = _rank_grid(shape, order), {}
    for name in NAMES:
        groups = np.moveaxis(grid, order.index(name), -1).reshape(-1, shape[name])
        groups = groups if every_group else groups[:1]
        found[name] = max((2 if len(set(g // tiers[1])) > 1 else 1 if len(set(g // tiers[0])) > 1 else 0)
                          for g in groups.tolist() for g in [np.array(g)])
    return found


def _aligned(shape, order, tiers) -> dict:
    """The mistake of judging a group by its span alone: stride * size within a node's ranks."""
    found = {}
    for name in NAMES:
        stride = math.prod(shape[n] for n in order[order.index(name) + 1:])
        span = stride * (shape[name] - 1) + 1
        found[name] = 0 if shape[name] == 1 or span <= tiers[0] else 1 if span <= tiers[1] else 2
    return found


@forbidding(farthest_tiers, _aligned, _rank_grid)
@unchanged(sys.modules[__name__], np)
def check_farthest_link(farthest_link) -> str:
    """Check your ``farthest_link(shape, order, tiers)`` on :data:`TIER_CASES`; one verdict line per
    case. :func:`farthest_tiers` (the check's own answer) may not be called by yours."""
    check_own_code(farthest_link, "farthest_link")
    lines = ["farthest_link: ok"]
    for shape, order, tiers in TIER_CASES:
        what = f"farthest_link({shape}, order={order}, tiers={tiers})"
        got = call_learner(what, farthest_link, dict(shape), tuple(order), tuple(tiers))
        want = farthest_tiers(shape, order, tiers)
        if not isinstance(got, dict) or set(got) != set(NAMES):
            fail(what, f"expected a dict with keys dp, pp, tp, got {got!r}", TIER_HINTS["type"])
        got = {name: got[name] for name in NAMES}
        if got == want:
            lines.append(f"{order} of {shape} on nodes of {tiers[0]}, racks of {tiers[1]}: "
                         + ", ".join(f"{n} {TIERS[want[n]]}" for n in reversed(order)))
            continue
        key = ("size_one" if any(shape[n] == 1 and got[n] != 0 for n in NAMES) else
               "stride" if got == farthest_tiers(shape, tuple(reversed(order)), tiers) else
               "straddle" if got == _aligned(shape, order, tiers) else
               "every_group" if got == farthest_tiers(shape, order, tiers, every_group=False) else "values")
        fail(what, f"got {got}, expected {want} ({', '.join(f'{n}: {TIERS[want[n]]}' for n in NAMES)})",
             TIER_HINTS[key])
    return "\n".join(lines)


__all__ = ["HINTS", "NAMES", "SHAPES", "TIERS", "TIER_CASES", "TIER_HINTS", "SplitCounter", "check_build_groups",
           "check_farthest_link", "diagnose", "farthest_tiers", "lines"]
