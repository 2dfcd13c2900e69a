"""Which link a message takes: ranks on nodes, and a link class (latency, bandwidth) per pair.

A real cluster is not a flat ring of equal links. GPUs in one node talk over NVLink or
NVSwitch (hundreds of GB/s); nodes talk over the network (100 or 400 Gb/s, a few to fifty
GB/s); some nodes give every GPU its own network card, others share one. A :class:`Topology`
says that much, and ``minidist.sim.World(n, topology=...)`` runs a program on it in *virtual
time* (``World``'s docstring): every message of b bytes on a link class costs
``alpha + b / bandwidth`` seconds, so a program's makespan and its Gantt timeline come out
exact, the same on every machine and under any load.

    from minidist import sim
    topo = sim.Topology.nodes(2, 4, intra=(2e-6, 300e9), inter=(6e-6, 12.5e9), nic="shared")
    topo.node_of(5), topo.link(0, 5)      # 1, LinkClass(name='inter', alpha=6e-06, bandwidth=12500000000.0)

The model (alpha-beta, store and forward, as in Thakur, Rabenseifner and Gropp 2005): each
rank has one outgoing port per link class, which carries one message at a time, start to
arrival (alpha included); with ``nic="shared"`` the ranks of a node share one outgoing
port for their inter-node messages (the node's one network card), which serves the messages
in the order they became ready (ties: lower rank first). Receiving is free of contention:
a rank takes any number of messages at once. A message to oneself takes the "intra" class.

``Topology(node_of, intra, inter, nic)`` takes any assignment of ranks to nodes (uneven
ones too); a later kind of topology (a graph of links, e.g. a DGX-1's hybrid cube-mesh) can
subclass it and override :meth:`Topology.link` and :meth:`Topology.port`, the two things the
sim asks. ``restricted(ranks)`` is the topology seen by a sub-communicator.
"""
from __future__ import annotations

import math
import operator
from typing import NamedTuple

NICS = ("per_rank", "shared")


class LinkClass(NamedTuple):
    """A kind of link: ``name`` ("intra" or "inter"), ``alpha`` (seconds per message) and
    ``bandwidth`` (bytes per second, one direction). A message of b bytes takes
    :meth:`time` = alpha + b / bandwidth seconds."""

    name: str
    alpha: float
    bandwidth: float

    def time(self, nbytes) -> float:
        """Seconds a message of ``nbytes`` bytes takes on this link: alpha + nbytes / bandwidth."""
        return self.alpha + nbytes / self.bandwidth


def link_class(name, spec) -> LinkClass:
    """A :class:`LinkClass` from ``(alpha_seconds, bytes_per_second)`` (or a LinkClass).
    Raises ValueError naming the link for a negative or non-finite alpha, or a bandwidth that
    is not > 0 (``float("inf")`` is allowed: bytes cost nothing, only alpha)."""
    if isinstance(spec, LinkClass):
        spec = (spec.alpha, spec.bandwidth)
    try:
        alpha, bandwidth = spec
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be (alpha_seconds, bytes_per_second), got {spec!r}") from None
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha < 0:
        raise ValueError(f"{name}: alpha must be a finite number of seconds >= 0, got {alpha!r}")
    if isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)) or not bandwidth > 0:
        raise ValueError(f"{name}: bandwidth must be a number of bytes per second > 0 (inf: no limit), "
                         f"got {bandwidth!r}")
    return LinkClass(name, float(alpha), float(bandwidth))


class Topology:
    """Ranks on nodes, two link classes, and how the nodes' network cards are shared.

    node_of: a sequence, rank -> node id (ints >= 0; ranks of a node need not be adjacent).
    intra, inter: ``(alpha_seconds, bytes_per_second)`` of a link inside a node and between
    nodes. nic: "per_rank" (every rank has its own network port: a DGX's one NIC per GPU) or
    "shared" (one port per node carries all its ranks' outgoing inter-node messages, one at a
    time). Immutable and hashable (a cost model may key a cache with it).

    Attributes: ``size`` (ranks), ``num_nodes``, ``ranks_per_node`` (None when the nodes hold
    different numbers of ranks), ``intra``/``inter`` (:class:`LinkClass`), ``nic``.
    Raises ValueError for an empty or non-integer ``node_of``, a bad link or an unknown nic.
    """

    def __init__(self, node_of, intra, inter, nic="per_rank"):
        try:
            nodes = tuple(operator.index(v) for v in node_of)
        except TypeError:
            raise ValueError(f"node_of must be a sequence of node ids (ints), got {node_of!r}") from None
        if not nodes or min(nodes) < 0:
            raise ValueError(f"node_of must name a node id >= 0 for each of at least one rank, got {nodes!r}")
        if nic not in NICS:
            raise ValueError(f"nic must be one of {', '.join(map(repr, NICS))}, got {nic!r}")
        self._node_of = nodes
        self.intra, self.inter, self.nic = link_class("intra", intra), link_class("inter", inter), nic
        self.size = len(nodes)
        counts = {}
        for v in nodes:
            counts[v] = counts.get(v, 0) + 1
        self.num_nodes = len(counts)
        self.ranks_per_node = next(iter(counts.values())) if len(set(counts.values())) == 1 else None
        self._counts = counts

    @classmethod
    def nodes(cls, num_nodes, ranks_per_node, intra, inter, nic="per_rank") -> Topology:
        """``num_nodes`` nodes of ``ranks_per_node`` ranks each, numbered node by node (ranks
        0..l-1 on node 0, l..2l-1 on node 1, ...), as ``mpiexec`` places them by default.
        Raises ValueError for counts that are not positive integers (and as :class:`Topology`)."""
        for name, value in (("num_nodes", num_nodes), ("ranks_per_node", ranks_per_node)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        return cls([r // ranks_per_node for r in range(num_nodes * ranks_per_node)], intra, inter, nic)

    def node_of(self, rank) -> int:
        """The node id of ``rank``. Raises ValueError for a rank outside 0..size-1."""
        try:
            if 0 <= operator.index(rank) < self.size:
                return self._node_of[rank]
        except TypeError:
            pass
        raise ValueError(f"rank must be in 0..{self.size - 1}, got {rank!r}")

    def link(self, src, dst) -> LinkClass:
        """The link class a message from rank ``src`` to rank ``dst`` takes."""
        return self.intra if self.node_of(src) == self.node_of(dst) else self.inter

    def port(self, src, dst):
        """``(key, shared)``: the outgoing port a message from ``src`` to ``dst`` occupies while
        it travels (any hashable key), and whether other ranks' messages may take it too (then
        the sim orders them by virtual time; a port only ``src`` uses is served in program
        order)."""
        if self.node_of(src) == self.node_of(dst):
            return ("intra", src), False
        if self.nic == "shared":
            node = self.node_of(src)
            return ("nic", node), self._counts[node] > 1
        return ("inter", src), False

    def restricted(self, ranks) -> Topology:
        """The topology of the ranks ``ranks`` (a sub-communicator's, in its rank order): the
        same links, their nodes renumbered in order of first appearance."""
        ids = {}
        nodes = [ids.setdefault(self.node_of(r), len(ids)) for r in ranks]
        return Topology(nodes, self.intra, self.inter, self.nic)

    def _key(self):
        return (type(self), self._node_of, self.intra, self.inter, self.nic)

    def __eq__(self, other):
        return isinstance(other, Topology) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        if self.ranks_per_node is not None and self._node_of == tuple(r // self.ranks_per_node
                                                                    for r in range(self.size)):
            shape = f"{self.num_nodes} nodes x {self.ranks_per_node} ranks"
        else:
            shape = f"node_of={list(self._node_of)}"
        return (f"<Topology {shape}; intra alpha={self.intra.alpha:g} s, {self.intra.bandwidth:g} B/s; "
                f"inter alpha={self.inter.alpha:g} s, {self.inter.bandwidth:g} B/s; nic={self.nic}>")
