"""Which node each rank of a communicator is on, and the two sub-communicators that the
topology-aware all-reduces (``collectives.all_reduce(..., algorithm="hierarchical" | "torus")``)
run over: the ranks of this rank's node, and the ranks with this rank's local index on every
node (its "column"); and the grid of ranks by node and local index (:func:`rank_grid`) that
``algorithm="multi_ring"`` finds its neighbours in.

Where the nodes come from, first found wins (every rank of the communicator must see the
same answer, so set things on every rank):

1. ``set_ranks_per_node(comm, l)``: fake nodes of l consecutive ranks, for this communicator;
2. the communicator's ``cluster_topology`` (a ``minidist.sim`` world with a topology, or a
   ``minidist.topology_delay.DelayComm``): its nodes, and its inter-node link, which
   hierarchical's choice of cross-node algorithm then uses;
3. the machines, when the ranks really span several: the ranks with the same host name
   (``socket.gethostname()``) share a node. These are the groups MPI's
   ``Split_type(COMM_TYPE_SHARED)`` makes, found instead in the agreement round below, which
   has the collectives' deadline (as ``minidist.launch``'s count of ranks per node: a rank
   that never arrives is named, instead of a Split_type waiting forever);
4. the environment's ``MINIDIST_RANKS_PER_NODE=l``: fake nodes of l consecutive ranks (to try
   the algorithms, and the delay layer, with ``mpiexec`` on one machine);
5. otherwise one node holds every rank (hierarchical and torus are then a ring in the node).

Every node must hold the same number of ranks (the cross-node phase pairs the ranks with the
same local index); otherwise, and when l does not divide the communicator's size, every rank
raises the same CollectiveError naming the fix. Working out the layout takes one agreement
round (every rank's node) and two ``comm.Split`` calls; it is done once per communicator and
remembered (``minidist.p2p.attached``), so call it, or the first all-reduce that needs it, on
every rank at the same point, as any collective.
"""
from __future__ import annotations

import operator
import os
import socket
from typing import NamedTuple

from minidist.p2p import CollectiveError, agree, attached

ENV = "MINIDIST_RANKS_PER_NODE"
_SETTING, _LAYOUT = "node_layout.ranks_per_node", "node_layout.layout"


class NodeLayout(NamedTuple):
    """A communicator's nodes. ``nodes``: each rank's node index (0..num_nodes-1, numbered in
    order of first appearance); ``num_nodes``, ``ranks_per_node`` (l); ``source`` ("setting",
    "topology", "host names", "environment" or "one node"); ``node_comm``: this rank's node
    (ranks in communicator order); ``cross_comm``: the ranks with this rank's local index, one
    per node (in node order); ``node_ranks``/``cross_ranks``: their ranks in the parent
    communicator, by their own rank; ``inter``: the inter-node link (``alpha``, ``bandwidth``)
    when the communicator knows it, else None."""

    nodes: tuple
    num_nodes: int
    ranks_per_node: int
    source: str
    node_comm: object
    cross_comm: object
    node_ranks: tuple
    cross_ranks: tuple
    inter: object


def set_ranks_per_node(comm, ranks_per_node):
    """Fake nodes of ``ranks_per_node`` consecutive ranks for ``comm`` (None: forget the
    setting); call it on every rank, before the first all-reduce that needs nodes. It wins over
    every other source (module docstring) and forgets a layout already worked out. Raises
    ValueError for a value that is not a positive integer."""
    state = attached(comm)
    if ranks_per_node is not None:
        ranks_per_node = _positive(ranks_per_node, "ranks_per_node")
    state[_SETTING] = ranks_per_node
    state.pop(_LAYOUT, None)


def _positive(value, what):
    try:
        value = operator.index(value)
    except TypeError:
        value = None
    if value is None or isinstance(value, bool) or value < 1:
        raise ValueError(f"{what} must be a positive integer")
    return value


def node_layout(comm) -> NodeLayout:
    """The :class:`NodeLayout` of ``comm`` (collective the first time; remembered). Raises
    CollectiveError on every rank when the nodes hold different numbers of ranks, when fake
    nodes of l ranks do not divide the communicator's size, when MINIDIST_RANKS_PER_NODE is no
    positive integer or differs between the ranks (each value and its ranks named);
    CollectiveTimeout (the collectives' deadline) when a rank does not join."""
    state = attached(comm)
    found = state.get(_LAYOUT)
    if found is not None:
        return found
    rank, p = comm.Get_rank(), comm.Get_size()
    node, source, inter, problem = _my_node(comm, state.get(_SETTING), rank, p)
    raw = _environment_value()
    fake_node, fake_source, fake_problem = _environment_node(raw, rank, p)
    if source is None:
        problem = fake_problem
    agreed = agree(comm, problem, (node, socket.gethostname(), fake_node, raw), what="node_layout")
    ids = [a[0] for a in agreed]
    if source is None:  # neither a setting nor a topology: the machines, else fake nodes, else one node
        hosts = [a[1] for a in agreed]
        if len(set(hosts)) > 1:
            ids, source = hosts, "host names"
        else:
            _check_same_environment([a[3] for a in agreed])
            ids, source = [a[2] for a in agreed], fake_source
    index = {}
    nodes = tuple(index.setdefault(i, len(index)) for i in ids)
    sizes = [nodes.count(k) for k in range(len(index))]
    if len(set(sizes)) != 1:
        raise CollectiveError(f"node_layout: the nodes hold different numbers of ranks ({sizes}, from "
                              f"{source}); hierarchical and torus need the same number on every node: use "
                              "another algorithm, or launch as many ranks on every node")
    local = [nodes[:r].count(nodes[r]) for r in range(p)]
    node_ranks = tuple(r for r in range(p) if nodes[r] == nodes[rank])
    cross_ranks = tuple(sorted((r for r in range(p) if local[r] == local[rank]), key=lambda r: nodes[r]))
    node_comm = comm.Split(nodes[rank], rank)
    cross_comm = comm.Split(local[rank], nodes[rank])
    found = state[_LAYOUT] = NodeLayout(nodes, len(index), sizes[0], source, node_comm, cross_comm,
                                        node_ranks, cross_ranks, inter)
    return found


def rank_grid(layout) -> tuple:
    """The ranks of a :class:`NodeLayout` as a grid: ``grid[node][local]`` is the rank (in the
    communicator) with local index ``local`` on node ``node`` (local indices in rank order, as
    ``node_comm`` numbers them). Shape (num_nodes, ranks_per_node); a new tuple of tuples.
    The multi-ring all-reduce finds its neighbours here."""
    grid = [[] for _ in range(layout.num_nodes)]
    for rank, node in enumerate(layout.nodes):
        grid[node].append(rank)
    return tuple(tuple(row) for row in grid)


def _my_node(comm, setting, rank, p):
    """(this rank's node id, where it came from (None: decide from the host names), the inter
    link or None, a problem or None)."""
    if setting is not None:
        return _fake(setting, rank, p, "setting", "set_ranks_per_node(comm, l)")
    topology = getattr(comm, "cluster_topology", None)
    if topology is not None:
        return topology.node_of(rank), "topology", topology.inter, None
    return 0, None, None, None


def _environment_value() -> str:
    """MINIDIST_RANKS_PER_NODE as this rank sees it, stripped ("" when unset)."""
    return os.environ.get(ENV, "").strip()


def check_environment(world_size: int) -> None:
    """For a command's start-up (before any rank waits for another): raise ValueError, naming
    the fix, when MINIDIST_RANKS_PER_NODE is set to something that cannot be fake nodes of
    ``world_size`` ranks (not a positive integer, or not a divisor of the world size)."""
    problem = _environment_node(_environment_value(), 0, world_size)[2]
    if problem is not None:
        raise ValueError(problem)


def _environment_node(value, rank, p):
    """(node id, source, problem) from MINIDIST_RANKS_PER_NODE's ``value``, or one node when it
    is unset."""
    if not value:
        return 0, "one node", None
    if not value.isascii() or not value.isdigit() or int(value) < 1:
        return 0, "environment", (f"node_layout: {ENV}={value!r} is not a positive integer (the ranks on each fake "
                                  f"node, e.g. {ENV}=2 for nodes of 2 ranks); set it to a divisor of {p} "
                                  f"({_divisors(p)}), or unset it")
    node, source, _, problem = _fake(int(value), rank, p, "environment", f"{ENV}={value}")
    return node, source, problem


def _check_same_environment(values: list) -> None:
    """Raise CollectiveError (on every rank: the same ``values``) when the ranks were started with
    different MINIDIST_RANKS_PER_NODE, naming each value and its ranks."""
    if len(set(values)) == 1:
        return
    groups = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    said = " and ".join(f"{repr(value) if value else 'unset'} on rank{'s' if len(ranks) > 1 else ''} "
                        f"{','.join(map(str, ranks))}" for value, ranks in groups.items())
    raise CollectiveError(f"node_layout: {ENV} differs between the ranks: {said}; set it to the same value on every "
                          f"rank (mpiexec -genv {ENV} l, or export it before mpiexec)")


def _divisors(p: int) -> str:
    found = [d for d in range(1, p + 1) if p % d == 0]
    return ", ".join(map(str, found[:-1])) + (" or " if len(found) > 1 else "") + str(found[-1])


def _fake(l, rank, p, source, where):
    problem = None
    if p % l:
        problem = (f"node_layout: {p} ranks do not split into fake nodes of {l} ranks ({where}); set it to a divisor "
                   f"of {p} ({_divisors(p)}), or unset it")
    return rank // l, source, None, problem
