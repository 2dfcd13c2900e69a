"""The check of exercise 17: a hierarchical all-reduce built from two sub-communicators
(the three phases Horovod runs with HOROVOD_HIERARCHICAL_ALLREDUCE=1 since uber/horovod pull
request #411, 2018; the idea in P. Goyal et al., "Accurate, Large Minibatch SGD", arXiv:1706.02677,
2017, section 4).

:func:`check_hierarchical_all_reduce` takes your ``hierarchical_all_reduce(comm, x,
ranks_per_node)``: ``x`` this rank's flat float64 vector (n numbers, another on every rank),
``ranks_per_node`` l, the ranks numbered node by node (ranks 0..l-1 on node 0, l..2l-1 on node
1, ..., as ``mpiexec`` places them); it returns the sum of every rank's x, on every rank. The
algorithm, on N nodes of l ranks::

    node_comm  = the l ranks of this rank's node          comm.Split(rank // l, rank)
    cross_comm = the N ranks with this rank's local index  comm.Split(rank % l, rank // l)
    pad x with zeros to l s numbers, s = ceil(n / l)
    1. reduce-scatter inside the node: this rank's chunk of s, summed over its node
    2. all-reduce that chunk across the nodes (cross_comm, all_reduce's default "auto": ring
       or recursive doubling, whichever is faster for the chunk): summed over every node
    3. all-gather the chunks inside the node, drop the padding

It runs your function on simulated clusters of N x l = 2 x 2, 2 x 3 and 4 x 2 ranks
(``sim.Topology.nodes``: links inside a node of :data:`INTRA`, between nodes of :data:`INTER`,
one network card per rank) and checks, on every rank:

- values: the result equals the sum of the ranks' vectors (to :data:`RTOL`) for n in
  :data:`SIZES` (0, and lengths that no l or N divides), shape (n,). The vectors are drawn
  afresh at every call of the check (:func:`vector` with a random ``salt``), so that a sum
  computed without the other ranks (from :func:`reference`, or by redrawing the vectors) fails;
- traffic: in the timed run every rank sends at least the bytes of its own vector (8 n): the
  others cannot have its numbers otherwise. The simulated ranks are threads of one process, so
  an answer that adds the vectors through memory they share gets the right sum in no time
  without a message; under ``mpiexec`` it could not run at all;
- time: for n = :data:`TIMED_NUMEL` (which every l N divides), the run's virtual-time makespan
  is at most ``costmodel.two_tier_time("hierarchical", 8 n, topology)``, the closed form of the
  three phases: 2(l-1)(a_intra + n/l b_intra) + the cross-node all-reduce of n/l. A flat ring,
  a gather to one root, recursive doubling over all ranks, an all-reduce where the
  reduce-scatter belongs, the whole vector sent across the nodes, or a ring across two nodes
  where one exchange does, all take longer; each gets its hint, found from what every rank
  sent on each kind of link (``world.timeline``).

Known mistakes get their hint: the all-gather forgotten (a chunk comes back), the cross-node
all-reduce forgotten (the node's sum only), the padding forgotten (``all_gather`` refuses
chunks of different sizes), the 2-D result returned, the input changed. The engine's own
hierarchical and torus all-reduces (``all_reduce(..., algorithm="hierarchical" | "torus")``,
or ``"auto"`` on the whole communicator, which picks them on a cluster) may not be the answer:
while your code runs, ``minidist.node_layout.node_layout``, which they need, raises. The ring
collectives of ``minidist.collectives`` (``reduce_scatter``, ``all_reduce``, ``all_gather``)
may be called on the sub-communicators. A failure raises ``AssertionError("what: problem\\nHint:
...")`` on every rank; your code raising gives a :class:`minidist.course.checks.LearnerError`
with your line. On success it returns one verdict line per cluster::

    from minidist.course.checks import topology as topology_checks
    print(topology_checks.check_hierarchical_all_reduce(hierarchical_all_reduce))

The puzzle, :func:`check_shared_card_all_reduce`: your ``shared_card_all_reduce(comm, x,
ranks_per_node)`` (the same arguments and result) on clusters of :data:`SHARED_LAYOUTS` whose
nodes have one network card for all their ranks (``nic="shared"``: their crossings take turns
on it), the same values, and a target in time: for n = :data:`TIMED_NUMEL`, at most
:data:`TARGET_FRACTION` of the fastest all-reduce the engine has there
(``costmodel.two_tier_times``: the flat ring, NCCL's rings, the tree, recursive doubling,
hierarchical, the torus; :func:`target`). The three phases of the exercise do not make it: the
l columns take turns on the card, carrying the flat ring's bytes with l times the latencies; nor
do NCCL's rings. What does: one crossing rank per node with the node's whole sum. The usual
wrong turns get their hints, from who sent what across (every rank crossing; one rank crossing
in every step of a flat ring; too many bytes across).

Longer than 400 lines: exercise 17's two checks (the three phases, then the puzzle on one card per
node) share the cluster, the inputs, the runs on the simulator's clock and the reading of who sent
what across; each hint sits beside the check that gives it.
"""
from __future__ import annotations

import functools
import secrets
import sys

import numpy as np

from minidist import collectives, costmodel, sim
from minidist.course.checks import (
    DEADLOCK_HINT,
    LearnerError,
    armed,
    check_own_code,
    engine_called,
    fail,
    fail_together,
    forbidding,
    learner_error,
)
from minidist.course.checks.crossing import any_right, check_received
from minidist.course.checks.integrity import unchanged
from minidist.node_layout import node_layout

LAYOUTS = ((2, 2), (2, 3), (4, 2))  # (nodes N, ranks per node l)
SIZES = (13, 1001, 7, 1, 0)  # uneven first: no l in 2, 3 and no N in 2, 4 divides 13, 1001 or 7
TIMED_NUMEL = 24_000  # float64: 192,000 bytes; every l N of LAYOUTS divides it
INTRA = (2e-6, 150e9)  # seconds, bytes/s: a V100's six NVLink-2 links, 150 GB/s each way (DGX-1 whitepaper)
INTER = (5e-6, 12.5e9)  # a 100 Gb/s network card per GPU (EDR InfiniBand): 12.5 GB/s each way
RTOL = 1e-12
SLACK = 1e-9  # relative: the makespan may exceed the closed form by rounding only
SHARED_LAYOUTS = ((2, 4), (4, 4))  # the puzzle's clusters: one network card per node
TARGET_FRACTION = 0.9  # the puzzle's target: 10 % under the fastest all-reduce the engine has there

HINTS = {
    "all_gather": ("finish with the all-gather inside the node: all_gather(node_comm, chunk) returns the l "
                   "summed chunks as (l, s); .reshape(-1)[:n] is the whole result"),
    "cross": ("these are the sums over this rank's node only: after the reduce-scatter, all-reduce your chunk "
              "across the nodes, all_reduce(cross_comm, chunk), before the all-gather"),
    "flatten": "return a flat vector of n numbers: all_gather(...) gives shape (l, s); .reshape(-1)[:n]",
    "padding": ("pad x with zeros to l * s numbers, s = ceil(n / l), before the reduce-scatter: reduce_scatter cuts "
                "n numbers into chunks of different sizes when l does not divide n, and all_gather needs the same "
                "shape on every rank; drop the padding at the end"),
    "values": ("three phases: reduce_scatter(node_comm, padded x), all_reduce(cross_comm, chunk), "
               "all_gather(node_comm, chunk); node_comm = comm.Split(rank // l, rank) (the ranks of this node), "
               "cross_comm = comm.Split(rank % l, rank // l) (this local rank on every node)"),
    "input": "do not change x: work on a padded copy (np.concatenate makes one)",
    "return": "return the summed vector (did you forget the return?)",
    "flat": ("every rank should carry 1/l of the vector across the nodes, and here some ranks sent nothing over "
             "the network: a flat ring (or a gather to one root) runs every step at the speed of its slowest "
             "link, the network; reduce-scatter inside the node first, so that the l ranks of a node share the "
             "cross-node work"),
    "whole": ("only 1/l of the vector should leave a rank across the nodes: reduce-scatter inside the node first "
              "(node_comm = comm.Split(rank // l, rank), the ranks of your node), then all-reduce only your chunk "
              "across the nodes (cross_comm = comm.Split(rank % l, rank // l))"),
    "inside": ("inside the node a reduce-scatter is enough: each rank needs only its own chunk summed before the "
               "cross-node step, and an all-reduce there sends twice the bytes (then the all-gather a third time)"),
    "cross_algorithm": ("let all_reduce(cross_comm, chunk) choose its algorithm (the default, 'auto'): on a chunk "
                        "this size recursive doubling's lg N exchanges beat the ring's 2(N-1) steps, and the closed "
                        "form takes the faster of the two"),
    "time": ("one reduce_scatter and one all_gather on node_comm and one all_reduce of the chunk on cross_comm, "
             "and nothing else"),
    "silent": ("every rank's vector must reach the others through the communicator: add the vectors from what the "
               "ranks send each other (reduce_scatter, all_reduce, all_gather on your sub-communicators), not from "
               "memory the simulated ranks share or numbers computed without them"),
    "engine": ("write the three phases yourself from reduce_scatter, all_reduce and all_gather on the two "
               "sub-communicators; call all_reduce on cross_comm with its default algorithm, not 'hierarchical' "
               "or 'torus', and not on the whole communicator"),
}
PUZZLE_HINTS = {
    "values": ("every rank returns the sum of all P ranks' vectors, a flat vector of n numbers: sum inside the node, "
               "add the nodes' sums across the nodes, hand the total back to every rank of the node"),
    "cross": "these are the sums over this rank's node only: the nodes' sums must still be added across the nodes",
    "return": HINTS["return"], "input": HINTS["input"], "silent": HINTS["silent"], "engine": HINTS["engine"],
    "columns": ("on one card the crossings of a node's ranks take turns: whoever sends them, the card carries the "
                "same bytes, and every crossing pays the card's latency again (the exercise's l columns pay l times "
                "a column's; NCCL's rings, one per card, l times a flat ring's). Let one rank per node cross, with "
                "the node's whole sum: reduce to it inside the node, all-reduce among the N crossing ranks, "
                "broadcast back"),
    "steps": ("one rank per node crosses, but in every step of a ring over all P ranks: sum inside the node first, "
              "then all-reduce among one rank per node (2(N-1) crossings with a ring, lg N with recursive "
              "doubling: let all_reduce choose)"),
    "bytes": ("the crossing ranks send more than the all-reduce of the node sums needs (a gather to one root, or "
              "the whole vector in every step): let all_reduce on the crossing ranks' communicator choose its "
              "algorithm"),
    "time": ("one rank per node crossing with the node's sum is right; now make each phase cheap: a reduce and a "
             "broadcast inside the node (binomial trees, lg l steps each), and across the nodes let all_reduce "
             "choose (recursive doubling's lg N exchanges run both ways at once, where a sum through one root "
             "waits for each message in turn)"),
}
ENGINE_PROBLEM = ("your code ran the engine's hierarchical all-reduce (all_reduce(..., algorithm='hierarchical' or "
                  "'torus'), or 'auto' on the whole communicator, which picks them on a cluster): the engine's own "
                  "implementation, not yours")


def topology(num_nodes: int, ranks_per_node: int) -> sim.Topology:
    """The check's cluster: ``num_nodes`` nodes of ``ranks_per_node`` ranks, :data:`INTRA` and
    :data:`INTER` links, one network card per rank."""
    return sim.Topology.nodes(num_nodes, ranks_per_node, intra=INTRA, inter=INTER, nic="per_rank")


def vector(rank: int, n: int, salt: int | None = None) -> np.ndarray:
    """Rank ``rank``'s input of ``n`` float64 numbers, seeded by rank and n (and ``salt``, which
    the check draws at random at every call: its inputs cannot be computed in advance)."""
    seed = 1000 * n + rank if salt is None else [salt, n, rank]
    return np.random.default_rng(seed).standard_normal(n)


def reference(p: int, n: int, ranks=None, salt: int | None = None) -> np.ndarray:
    """The sum of the vectors of ``ranks`` (default all ``p``; ``salt`` as :func:`vector`), added
    in rank order."""
    return np.sum([vector(r, n, salt) for r in (range(p) if ranks is None else ranks)], axis=0).reshape(n)


def bound(num_nodes: int, ranks_per_node: int) -> float:
    """Seconds: the hierarchical closed form for :data:`TIMED_NUMEL` float64 on the check's cluster."""
    return costmodel.two_tier_time("hierarchical", 8 * TIMED_NUMEL, topology(num_nodes, ranks_per_node))


def _call(what, fn, comm, x, l, name="hierarchical_all_reduce"):
    """The learner's function ``name`` on this rank; the engine's hierarchical all-reduce named when it ran."""
    try:
        with armed():
            return fn(comm, x, l)
    except (AssertionError, sim.RankAborted):
        raise
    except Exception as error:  # every learner error becomes a check failure
        if engine_called(error).endswith("node_layout"):
            raise LearnerError(f"{what}: {ENGINE_PROBLEM}\nHint: {HINTS['engine']}") from None
        text = str(error)
        padding = "all_gather" in text and "shape" in text and name == "hierarchical_all_reduce"
        hint = HINTS["padding"] if padding else ""
        raise learner_error(what, error, f"your {name}", hint) from None


def _value_problem(what, got, x_before, x, p, l, rank, salt, hints=HINTS):
    """(what, problem, hint) for this rank's result, or None (``hints``: :data:`HINTS` or
    :data:`PUZZLE_HINTS`)."""
    if hints is PUZZLE_HINTS:
        hints = {**HINTS, **PUZZLE_HINTS, "flatten": PUZZLE_HINTS["values"], "all_gather": PUZZLE_HINTS["values"]}
    n = x.size
    if got is None:
        return what, "returned None", hints["return"]
    if not np.array_equal(x, x_before):
        return what, "x changed", hints["input"]
    got = np.asarray(got)
    if got.shape != (n,):
        s = -(-n // l) if n else 0
        if got.ndim == 2 and got.size >= n:
            hint = hints["flatten"]
        elif got.shape in ((s,), (n // l,), (n // l + 1,)) and l > 1:
            hint = hints["all_gather"]
        else:
            hint = hints["values"]
        return what, f"expected shape ({n},), got {got.shape}", hint
    want = reference(p, n, salt=salt)
    if not np.allclose(got, want, rtol=RTOL, atol=RTOL):
        node = range(rank - rank % l, rank - rank % l + l)
        hint = hints["cross"] if p > l and np.allclose(got, reference(p, n, node, salt), rtol=RTOL, atol=RTOL) \
            else hints["values"]
        return what, (f"the result differs from the sum of the {p} ranks' vectors by up to "
                      f"{float(np.max(np.abs(got - want))):.3g}"), hint
    return None


def _values_rank(comm, fn, num_nodes, l, salt, name="hierarchical_all_reduce", hints=HINTS):
    p, rank = comm.Get_size(), comm.Get_rank()
    for n in SIZES:
        what = f"{name} on {num_nodes} nodes x {l} ranks, n = {n}"
        x = vector(rank, n, salt)
        before = x.copy()
        got = _call(what, fn, comm, x, l, name)
        fail_together(comm, _value_problem(what, got, before, x, p, l, rank, salt, hints))


def _timed_rank(comm, fn, num_nodes, l, salt, name="hierarchical_all_reduce", hints=HINTS):
    what = f"{name} on {num_nodes} nodes x {l} ranks, n = {TIMED_NUMEL:,}"
    x = vector(comm.Get_rank(), TIMED_NUMEL, salt)
    got = _call(what, fn, comm, x, l, name)
    fail_together(comm, _value_problem(what, got, x.copy(), x, comm.Get_size(), l, comm.Get_rank(), salt, hints))


def sent_by_link(world, p: int) -> tuple[list[int], list[int], list[int]]:
    """Per rank of ``world``'s last run: (bytes sent inside its node, bytes sent across nodes,
    messages sent across nodes)."""
    intra, inter, messages = [0] * p, [0] * p, [0] * p
    for interval in world.timeline:
        if interval.kind == "send":
            (intra if interval.link == "intra" else inter)[interval.rank] += interval.nbytes
            messages[interval.rank] += interval.link == "inter"
    return intra, inter, messages


def _quiet_rank(what, intra, inter, nbytes, hint):
    """(what, problem, hint) for the first rank that sent fewer bytes in all (``intra`` + ``inter``,
    per rank) than its own vector's ``nbytes``, yet every rank got the sum; None when every rank
    sent at least that much."""
    quiet = [r for r in range(len(intra)) if intra[r] + inter[r] < nbytes]
    if not quiet:
        return None
    r = quiet[0]
    return what, (f"rank {r} sent {intra[r] + inter[r]:,} bytes in all, fewer than its own vector's {nbytes:,}, "
                  "yet every rank got the sum: the other ranks cannot have its numbers"), hint


def _time_problem(world, num_nodes, l):
    """(what, problem, hint) when a rank of the timed run sent fewer bytes than its own vector
    holds, or the run was slower than the closed form; else None."""
    topo = topology(num_nodes, l)
    nbytes, limit = 8 * TIMED_NUMEL, bound(num_nodes, l)
    intra, inter, messages = sent_by_link(world, topo.size)
    what = f"hierarchical_all_reduce of {TIMED_NUMEL:,} float64 on {num_nodes} nodes x {l} ranks (virtual time)"
    quiet = _quiet_rank(what, intra, inter, nbytes, HINTS["silent"])
    if quiet:
        return quiet
    if world.makespan <= limit * (1 + SLACK):
        return None
    terms = costmodel.two_tier_terms("hierarchical", nbytes, topo)
    if min(inter) == 0:
        hint = HINTS["flat"]
    elif max(inter) > 1.5 * terms["inter"][1]:
        hint = HINTS["whole"]
    elif max(intra) > 1.25 * terms["intra"][1]:
        hint = HINTS["inside"]
    elif max(messages) > terms["inter"][0]:
        hint = HINTS["cross_algorithm"]
    else:
        hint = HINTS["time"]
    return what, (f"took {world.makespan * 1e6:.2f} us, more than the three phases' {limit * 1e6:.2f} us "
                  f"(ranks sent {min(intra):,}-{max(intra):,} bytes inside their node, expected "
                  f"{terms['intra'][1]:,.0f}; {min(inter):,}-{max(inter):,} across nodes, expected "
                  f"{terms['inter'][1]:,.0f})"), hint


def _still_right(comm, fn, l, salt, n):
    """Whether this rank's answer, run with every message spoiled in transit
    (``crossing.check_received``), still holds a right value of the sum: it did not come through
    the communicator."""
    return any_right(fn(comm, vector(comm.Get_rank(), n, salt), l), reference(comm.Get_size(), n, salt=salt),
                     atol=1e-9)


def _run(world, rank_fn, fn, num_nodes, l, salt, name="hierarchical_all_reduce"):
    try:
        world.run(rank_fn, fn, num_nodes, l, salt)
    except (sim.DeadlockError, sim.SimTimeoutError) as error:
        fail(f"{name} on {num_nodes} nodes x {l} simulated ranks", str(error), DEADLOCK_HINT)


@forbidding(node_layout)
@unchanged(sys.modules[__name__], costmodel, collectives, sim, np)
def check_hierarchical_all_reduce(hierarchical_all_reduce) -> str:
    """Check your ``hierarchical_all_reduce(comm, x, ranks_per_node)`` (module docstring):
    values on 2 x 2, 2 x 3 and 4 x 2 simulated ranks for n in :data:`SIZES`, and the makespan
    of n = :data:`TIMED_NUMEL` against the hierarchical closed form. Returns the verdict
    (one line per cluster); raises AssertionError with a hint, or LearnerError."""
    check_own_code(hierarchical_all_reduce, "hierarchical_all_reduce")
    salt = secrets.randbits(64)  # inputs nobody can compute ahead of the call
    lines = []
    for num_nodes, l in LAYOUTS:
        topo = topology(num_nodes, l)
        world = sim.World(topo.size, timeout=60, strict=True, topology=topo)
        _run(world, _values_rank, hierarchical_all_reduce, num_nodes, l, salt)
        _run(world, _timed_rank, hierarchical_all_reduce, num_nodes, l, salt)
        problem = _time_problem(world, num_nodes, l)
        if problem:
            fail(*problem)
        ring = costmodel.two_tier_time("ring", 8 * TIMED_NUMEL, topo)
        check_received(f"hierarchical_all_reduce on {num_nodes} nodes x {l} simulated ranks", topo.size, _still_right,
                       hierarchical_all_reduce, l, salt, max(SIZES))
        lines.append(f"{num_nodes} nodes x {l} ranks: sums equal for n = {', '.join(map(str, SIZES))}; "
                     f"n = {TIMED_NUMEL:,} in {world.makespan * 1e6:.2f} us <= {bound(num_nodes, l) * 1e6:.2f} us "
                     f"(a flat ring: {ring * 1e6:.2f} us)")
    return "hierarchical_all_reduce: ok\n" + "\n".join(lines)


# -- the puzzle: one network card per node ------------------------------------------------------


def shared_topology(num_nodes: int, ranks_per_node: int) -> sim.Topology:
    """The puzzle's cluster: as :func:`topology`, but one network card per node (``nic="shared"``)."""
    return sim.Topology.nodes(num_nodes, ranks_per_node, intra=INTRA, inter=INTER, nic="shared")


def target(num_nodes: int, ranks_per_node: int) -> tuple[float, str, float]:
    """(seconds, name, seconds): the puzzle's target for :data:`TIMED_NUMEL` float64 on
    :func:`shared_topology`, :data:`TARGET_FRACTION` of the fastest all-reduce of
    ``costmodel.two_tier_times`` there, that algorithm's name and its time."""
    times = costmodel.two_tier_times(8 * TIMED_NUMEL, shared_topology(num_nodes, ranks_per_node))
    best = min(times, key=times.get)
    return TARGET_FRACTION * times[best], best, times[best]


def _shared_time_problem(world, num_nodes, l):
    """(what, problem, hint) when the puzzle's timed run sent too little or missed the target."""
    topo, nbytes = shared_topology(num_nodes, l), 8 * TIMED_NUMEL
    limit, best, best_time = target(num_nodes, l)
    intra, inter, messages = sent_by_link(world, topo.size)
    what = f"shared_card_all_reduce of {TIMED_NUMEL:,} float64 on {num_nodes} nodes x {l} ranks, one card per node"
    quiet = _quiet_rank(what, intra, inter, nbytes, PUZZLE_HINTS["silent"])
    if quiet:
        return quiet
    if world.makespan <= limit:
        return None
    nodes = [[r for r in range(topo.size) if topo.node_of(r) == node] for node in range(num_nodes)]
    crossing = max(sum(1 for r in ranks if inter[r]) for ranks in nodes)
    card = max(sum(inter[r] for r in ranks) for ranks in nodes)
    crossings = max(sum(messages[r] for r in ranks) for ranks in nodes)
    if crossing > 1:
        hint = PUZZLE_HINTS["columns"]
    elif max(messages) > 2 * (num_nodes - 1):
        hint = PUZZLE_HINTS["steps"]
    elif card > 2 * nbytes:
        hint = PUZZLE_HINTS["bytes"]
    else:
        hint = PUZZLE_HINTS["time"]
    return what, (f"took {world.makespan * 1e6:.2f} us, more than the target {limit * 1e6:.2f} us ({TARGET_FRACTION} "
                  f"of the engine's fastest here, {best}: {best_time * 1e6:.2f} us); the busiest card sent "
                  f"{card:,} bytes in {crossings} messages, from {crossing} of the node's {l} ranks"), hint


@forbidding(node_layout)
@unchanged(sys.modules[__name__], costmodel, collectives, sim, np)
def check_shared_card_all_reduce(shared_card_all_reduce) -> str:
    """Check the puzzle's ``shared_card_all_reduce(comm, x, ranks_per_node)`` (module
    docstring): values on the clusters of :data:`SHARED_LAYOUTS` (one network card per node) for
    n in :data:`SIZES`, and the makespan of n = :data:`TIMED_NUMEL` against :func:`target`.
    Returns the verdict (one line per cluster); raises AssertionError with a hint, or LearnerError."""
    name = "shared_card_all_reduce"
    check_own_code(shared_card_all_reduce, name)
    salt = secrets.randbits(64)
    lines = []
    for num_nodes, l in SHARED_LAYOUTS:
        topo = shared_topology(num_nodes, l)
        world = sim.World(topo.size, timeout=60, strict=True, topology=topo)
        for rank_fn in (_values_rank, _timed_rank):
            _run(world, functools.partial(rank_fn, name=name, hints=PUZZLE_HINTS), shared_card_all_reduce,
                 num_nodes, l, salt, name)
        problem = _shared_time_problem(world, num_nodes, l)
        if problem:
            fail(*problem)
        check_received(f"{name} on {num_nodes} nodes x {l} simulated ranks", topo.size, _still_right,
                       shared_card_all_reduce, l, salt, max(SIZES))
        times = costmodel.two_tier_times(8 * TIMED_NUMEL, topo)
        limit = target(num_nodes, l)[0]
        lines.append(f"{num_nodes} nodes x {l} ranks, one card per node: sums equal for n = "
                     f"{', '.join(map(str, SIZES))}; n = {TIMED_NUMEL:,} in {world.makespan * 1e6:.2f} us <= "
                     f"{limit * 1e6:.2f} us (hierarchical {times['hierarchical'] * 1e6:.2f} us, NCCL's rings "
                     f"{times['multi_ring'] * 1e6:.2f} us, a flat ring {times['ring'] * 1e6:.2f} us)")
    return "shared_card_all_reduce: ok\n" + "\n".join(lines)


__all__ = ["HINTS", "INTER", "INTRA", "LAYOUTS", "PUZZLE_HINTS", "SHARED_LAYOUTS", "SIZES", "TARGET_FRACTION",
           "TIMED_NUMEL", "bound", "check_hierarchical_all_reduce", "check_shared_card_all_reduce", "reference",
           "sent_by_link", "shared_topology", "target", "topology", "vector"]
