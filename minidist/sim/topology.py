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
ones too). ``restricted(ranks)`` is the topology seen by a sub-communicator. The sim asks a
topology one thing per message, :meth:`Topology.channel` (its link class and port; by default
from :meth:`Topology.link` and :meth:`Topology.port`), so another kind of topology subclasses
it and overrides those.

A graph of links (:class:`LinkGraph`): ``Topology.graph(n, links={(a, b): (alpha, B/s), ...})``
joins ranks by point-to-point links, each direction its own port; ``Topology.dgx1(gpus=range(8),
pcie=True)`` is a V100 DGX-1's hybrid cube-mesh of NVLinks plus PCIe (``minidist.blink`` packs
spanning trees on it): GPUs joined point to point by NVLink, and PCIe through the host for
the pairs that have none.

    topo = sim.Topology.dgx1()                      # 8 V100s: NVLink cube-mesh + PCIe
    topo.link(0, 3)     # LinkClass(name='nvlink', alpha=3.4e-06, bandwidth=50000000000.0): 2 NVLinks
    topo.link(0, 5)     # LinkClass(name='pcie', alpha=5.7e-06, bandwidth=12000000000.0): no NVLink
    part = sim.Topology.dgx1(gpus=(0, 1, 2, 3, 5))  # a partial allocation: ranks 0..4 = GPUs 0,1,2,3,5
    world = sim.World(5, topology=part)             # virtual time on it

A graph's model. Every link ``(a, b)`` is two directed links, a->b and b->a, and each is its own port: messages on
different links travel at once, two on one link take turns (in program order). A message
from a to b takes the direct link when there is one. Otherwise, and for a message whose tag
is in :data:`PCIE_TAGS` (how an algorithm asks for the host path on purpose, as Blink's
hybrid transfers do), it goes over PCIe: class "pcie", through the PCIe switch both GPUs
hang off, or up that switch's uplink to the CPU(s) and down another switch. Its port: the
sender's own x16 link when both GPUs share a switch; the switch's uplink, shared by the
GPUs under it and served in virtual-time order, when they do not. Receiving is free of
contention (the sim's rule), so a switch's downlink and the CPUs' link (QPI, faster than
one x16 link) are not modelled, and a GPU sending to its switch-mate and across switches
at once gets both at full speed: an algorithm should not (Blink's PCIe chain does not). A
topology without PCIe refuses a message between two ranks with no link: ValueError naming
them (route it over ranks that have one).

To the two-tier cost model and ``node_layout`` a LinkGraph is one node (a DGX-1 is one
machine) whose ``intra`` link class is the slowest path (PCIe when present); only the
graph-aware algorithms of ``minidist.blink`` use its links.
"""
from __future__ import annotations

import math
import operator
from typing import NamedTuple

NICS = ("per_rank", "shared")


class LinkClass(NamedTuple):
    """A kind of link: ``name`` ("intra" or "inter"; a LinkGraph's "nvlink", "pcie", ...),
    ``alpha`` (seconds per message) and ``bandwidth`` (bytes per second, one direction). A message of b bytes takes
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

    @classmethod
    def graph(cls, n, links, pcie=None, switch_of=None, name="link", labels=None):
        """Ranks joined by a graph of links: a :class:`LinkGraph`
        (its docstring: arguments, ports, PCIe, errors)."""
        return LinkGraph(n, links, pcie=pcie, switch_of=switch_of, name=name, labels=labels)

    @classmethod
    def dgx1(cls, gpus=range(8), pcie=True):
        """The GPUs ``gpus`` of an NVIDIA DGX-1 (V100): NVLink hybrid cube-mesh plus PCIe
        (:func:`dgx1`: the links, their sources, the PCIe model)."""
        return dgx1(gpus, pcie)

    def channel(self, src, dst, tag):
        """``(link class, port key, shared)`` of a message from ``src`` to ``dst`` with ``tag``:
        what the sim times it by. Here :meth:`link` and :meth:`port` (the tag does not matter);
        a :class:`LinkGraph` lets a tag pick its PCIe path."""
        key, shared = self.port(src, dst)
        return self.link(src, dst), key, shared

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


PCIE_TAGS = range(30000, 31000)  # a message with one of these tags travels over PCIe

# The V100 DGX-1's NVLinks: (GPU, GPU) -> number of NVLink-2 links between them. Each V100 has
# 6 links: GPUs 0-3 and 4-7 form two fully connected quads, GPU i is joined to i+4, and eight
# pairs have two links. A cube with all 12 edges plus the diagonals of two faces, as the DGX-1
# System Architecture white paper (NVIDIA WP-08437-002, section 3.1 and its figure "DGX-1 uses
# an 8-GPU hybrid cube-mesh") describes it; the pairs and counts are those ``nvidia-smi topo -m``
# prints on a DGX-1V (NV1/NV2), the topology of Wang et al., Blink (MLSys 2020), Figure 1(b).
DGX1_NVLINKS = {(0, 1): 1, (0, 2): 1, (0, 3): 2, (0, 4): 2, (1, 2): 2, (1, 3): 1, (1, 5): 2, (2, 3): 2,
                (2, 6): 1, (3, 7): 1, (4, 5): 1, (4, 6): 1, (4, 7): 2, (5, 6): 2, (5, 7): 1, (6, 7): 2}
# PCIe: GPUs 0-1, 2-3, 4-5, 6-7 each share a PCIe switch (PLX), two switches per CPU socket (the
# white paper's figure of the DGX-1 system: four switches, each with two GPUs and a NIC).
DGX1_SWITCH_OF = (0, 0, 1, 1, 2, 2, 3, 3)
# Sourced numbers: NVLink 2 carries 25 GB/s each way per link (the white paper, 3.1; Blink 2.1);
# PCIe 3.0 x16 about 12 GB/s each way in practice (15.75 GB/s raw; Blink's figure, 2.1).
# Latencies: NCCL's tuning model (src/graph/tuning.cc, hwLat, Ring/Simple): 3.4 us on NVLink,
# 5.7 us on PCIe (as minidist.planner's Cluster takes NVLink's).
NVLINK2 = (3.4e-6, 25e9)
PCIE3_X16 = (5.7e-6, 12e9)


class LinkGraph(Topology):
    """Ranks joined by a graph of links (module docstring: the model).

    size: number of ranks. links: ``{(a, b): (alpha_seconds, bytes_per_second), ...}``, each
    an undirected link between ranks a != b (both directions, each its own port, the same
    class). pcie: None (no other path) or ``(alpha, bytes_per_second)`` of the PCIe path every
    pair has; switch_of: with pcie, rank -> PCIe switch id (None: one switch per rank). name:
    the links' class name ("nvlink" for a DGX-1). labels: what to call each rank (a DGX-1's GPU
    numbers; default 0..size-1). Immutable and hashable.

    Attributes: ``size``, ``name``, ``pcie`` (a LinkClass or None), ``labels``; from
    :class:`Topology`: one node, ``intra`` = ``inter`` = the slowest path.
    Raises ValueError for a bad size, a link naming a rank outside 0..size-1 or itself, a
    pair given twice, a bad (alpha, bandwidth), or a switch_of of the wrong length.
    """

    def __init__(self, size, links, pcie=None, switch_of=None, name="link", labels=None):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be a positive integer, got {size!r}")
        directed = {}
        for pair, spec in dict(links).items():
            a, b = _pair(pair, size)
            if (a, b) in directed:
                raise ValueError(f"the link {a}-{b} is given twice; give each pair once (links go both ways)")
            directed[(a, b)] = directed[(b, a)] = link_class(name, spec)
        self.name = name
        self.pcie = None if pcie is None else link_class("pcie", pcie)
        if switch_of is None:
            switch_of = range(size)
        switch_of = tuple(operator.index(s) for s in switch_of)
        if len(switch_of) != size:
            raise ValueError(f"switch_of must name a PCIe switch for each of the {size} ranks, got {switch_of!r}")
        self.labels = tuple(range(size)) if labels is None else tuple(labels)
        if len(self.labels) != size:
            raise ValueError(f"labels must name each of the {size} ranks, got {self.labels!r}")
        self._links, self._switch_of = directed, switch_of
        slowest = self.pcie or min(directed.values(), key=lambda c: c.bandwidth,
                                   default=LinkClass(name, 0.0, math.inf))
        super().__init__([0] * size, slowest, slowest)
        self._mates = {s: sum(1 for t in switch_of if t == s) for s in switch_of}

    def links(self) -> dict:
        """The directed links: ``{(a, b): LinkClass}``, both directions of every link (a new dict)."""
        return dict(self._links)

    def switch_of(self, rank) -> int:
        """The PCIe switch of ``rank``. Raises ValueError for a rank outside 0..size-1."""
        self.node_of(rank)
        return self._switch_of[rank]

    def link(self, src, dst) -> LinkClass:
        """The class of the path a message from ``src`` to ``dst`` takes: their link, else PCIe.
        Raises ValueError when they have no link and the topology has no PCIe."""
        self.node_of(src), self.node_of(dst)  # ValueError for a rank out of range
        found = self._links.get((src, dst))
        if found is not None:
            return found
        return self._pcie_or_refuse(src, dst)

    def port(self, src, dst):
        """``(key, shared)``: the directed link ``("link", src, dst)`` (only src sends on it);
        over PCIe, ``("pcie", src)`` inside a switch or ``("pcie_uplink", switch)`` across,
        shared when another rank hangs off that switch."""
        if (src, dst) in self._links:
            return ("link", src, dst), False
        return self._pcie_port(src, dst)

    def channel(self, src, dst, tag):
        """As :meth:`Topology.channel`; a tag in :data:`PCIE_TAGS` takes PCIe even where a
        link exists (ValueError without PCIe)."""
        if tag in PCIE_TAGS:
            return (self._pcie_or_refuse(src, dst, tag), *self._pcie_port(src, dst))
        return super().channel(src, dst, tag)

    def _pcie_or_refuse(self, src, dst, tag=None):
        self.node_of(src), self.node_of(dst)
        if self.pcie is None:
            why = (f"a tag in sim.PCIE_TAGS ({tag}) asks for PCIe" if tag is not None
                   else f"there is no {self.name} link between them")
            raise ValueError(f"rank {src} (GPU {self.labels[src]}) cannot send to rank {dst} (GPU "
                             f"{self.labels[dst]}): {why} and this topology has no PCIe; route the "
                             "message over ranks that are linked, or build the topology with pcie=...")
        return self.pcie

    def _pcie_port(self, src, dst):
        switch = self._switch_of[src]
        if switch == self._switch_of[dst]:
            return ("pcie", src), False
        return ("pcie_uplink", switch), self._mates[switch] > 1

    def restricted(self, ranks) -> LinkGraph:
        """The graph among ``ranks`` (a sub-communicator's, in its rank order): their links,
        renumbered; PCIe, switches and labels kept."""
        ranks = list(ranks)
        for r in ranks:
            self.node_of(r)
        index = {r: i for i, r in enumerate(ranks)}
        links = {(index[a], index[b]): (c.alpha, c.bandwidth) for (a, b), c in self._links.items()
                 if a < b and a in index and b in index}
        pcie = None if self.pcie is None else (self.pcie.alpha, self.pcie.bandwidth)
        return LinkGraph(len(ranks), links, pcie, [self._switch_of[r] for r in ranks], self.name,
                         [self.labels[r] for r in ranks])

    def _key(self):
        return (type(self), self.size, tuple(sorted(self._links.items())), self.pcie, self._switch_of, self.name,
                self.labels)

    def __repr__(self):
        pairs = sorted((a, b) for a, b in self._links if a < b)
        pcie = "no PCIe" if self.pcie is None else f"PCIe {self.pcie.bandwidth:g} B/s"
        return f"<LinkGraph {self.size} ranks {list(self.labels)}; {len(pairs)} {self.name} links; {pcie}>"


def _pair(pair, size):
    try:
        a, b = (operator.index(v) for v in pair)
    except (TypeError, ValueError):
        raise ValueError(f"a link is a pair of ranks (a, b), got {pair!r}") from None
    if not (0 <= a < size and 0 <= b < size) or a == b:
        raise ValueError(f"a link must join two different ranks in 0..{size - 1}, got {pair!r}")
    return a, b


def dgx1(gpus=range(8), pcie=True) -> LinkGraph:
    """The GPUs ``gpus`` of a V100 DGX-1 as a :class:`LinkGraph`: rank i is GPU ``gpus[i]``.

    NVLink: :data:`DGX1_NVLINKS` (the hybrid cube-mesh; a pair with two NVLinks is one link of
    2 x 25 GB/s each way, as a copy between them uses both), alpha 3.4 us. pcie: True adds the
    PCIe path of :data:`PCIE3_X16` (12 GB/s each way) with :data:`DGX1_SWITCH_OF`'s switches;
    False leaves NVLink only (a message between GPUs with no NVLink is then refused).
    Sources: the module's constants. Raises ValueError for GPUs outside 0..7, repeated, or
    fewer than one.
    """
    gpus = tuple(gpus)
    if not gpus or len(set(gpus)) != len(gpus) or any(isinstance(g, bool) or g not in range(8) for g in gpus):
        raise ValueError(f"gpus must be distinct GPU numbers in 0..7 (a DGX-1 has 8), got {gpus!r}")
    index = {g: i for i, g in enumerate(gpus)}
    alpha, per_link = NVLINK2
    links = {(index[a], index[b]): (alpha, count * per_link) for (a, b), count in DGX1_NVLINKS.items()
             if a in index and b in index}
    return LinkGraph(len(gpus), links, PCIE3_X16 if pcie else None,
                     [DGX1_SWITCH_OF[g] for g in gpus] if pcie else None, "nvlink", gpus)
