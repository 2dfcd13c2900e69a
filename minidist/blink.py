"""Idle links: broadcast and all-reduce over packed spanning trees (Blink).

A ring collective runs at its slowest link and needs a ring: a cycle through every GPU over
the fast links. Give a job 5 of a DGX-1's 8 GPUs, say 0, 1, 2, 3 and 5, and there is none
(GPU 5's only NVLink in the set goes to GPU 1), so NCCL falls back to PCIe, and NVLinks sit
idle. Trees need no cycle. Wang et al., "Blink: Fast and Generic Collectives for Distributed
ML" (MLSys 2020) broadcast over several spanning trees at once, each carrying a share of the
data in proportion to its rate, packed so that together they reach the best rate the links
allow; all-reduce is a reduce up the same trees, then a broadcast down; and PCIe, idle too,
carries one more tree.

    import numpy
    from minidist import blink, sim
    topo = sim.Topology.dgx1(gpus=(0, 1, 2, 3, 5))      # ranks 0..4 = GPUs 0, 1, 2, 3, 5
    blink.hamiltonian_cycles(topo)                        # []: no NVLink ring
    blink.broadcast_bound(topo, root=0)                   # 50e9 B/s: GPU 5's two NVLinks to GPU 1
    packing = blink.pack_trees(topo, root=0)              # arborescences reaching it: .rate == .bound
    hybrid = blink.pack_trees(topo, root=0, pcie=True)    # plus a PCIe chain: 62e9 B/s
    world = sim.World(5, topology=topo)
    x = numpy.arange(1 << 20, dtype=numpy.float32)
    world.run(lambda comm: blink.broadcast_trees(comm, x, 0, hybrid))   # x on every rank
    world.makespan   # 206 us: 20 GB/s at 4 MiB, where alphas and the pipeline's fill still count;
                     # 48 GB/s at 64 MiB, 62 GB/s only as chunks and size grow
    world.run(lambda comm: blink.all_reduce_trees(comm, x, hybrid, op="sum"))

What is what (each function's docstring has its cost and source):
- :func:`broadcast_bound`: the best broadcast rate from a root, min over the other ranks of
  the max-flow to them (networkx). No schedule can beat it: every byte reaches every rank
  through that rank's min cut. Edmonds (1973): packed arborescences reach it exactly.
- :func:`pack_trees`: a :class:`Packing` of :class:`Tree`\\ s (arborescences from the root)
  whose rates add up to exactly the bound (Lovász's constructive proof of Edmonds' theorem;
  ``pcie=True`` adds a PCIe chain).
- :func:`broadcast_trees`, :func:`all_reduce_trees`: the collectives, pipelined in chunks
  down (and up) every tree at once, equal to ``collectives.broadcast`` / ``all_reduce``.
- :func:`hamiltonian_cycles`, :func:`ring_rate`: the rings a ring collective could use.

Longer than 400 lines: Blink's method is one argument from the bound (max-flow) to the packing
(Edmonds' arborescences) to the pipelined trees on a clock; each step uses the one before.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import networkx
import numpy

from minidist.backend import get_array_module
from minidist.collectives import OPS, chunk_bounds
from minidist.p2p import CollectiveError, agree, stage_to_host, wait_all
from minidist.sim.topology import PCIE_TAGS, LinkGraph

DEFAULT_CHUNKS = 16  # pieces each tree's share is pipelined in
MAX_UNITS = 256  # a packing of more unit trees than this is refused (the bandwidths' unit is too fine)
BROADCAST_TAG, REDUCE_TAG = 7720, 7760  # + tree index; a PCIe tree: PCIE_TAGS.start (+ 500 for reduce) + index
MAX_TREES = 40


class Tree(NamedTuple):
    """One spanning arborescence: ``root``; ``parent[r]``, the rank r receives from (None for
    the root); ``rate``, bytes per second it carries; ``channel``, the link class its messages
    take ("nvlink", a graph's link name, or "pcie")."""

    root: int
    parent: tuple
    rate: float
    channel: str

    def children(self, rank) -> list:
        """The ranks that receive from ``rank`` in this tree, in rank order."""
        return [r for r, p in enumerate(self.parent) if p == rank]

    def depth(self, rank) -> int:
        """Hops from the root to ``rank`` (0 for the root)."""
        d = 0
        while self.parent[rank] is not None:
            rank, d = self.parent[rank], d + 1
        return d

    def height(self) -> int:
        """The depth of the deepest rank: a pipelined broadcast's fill takes this many steps."""
        return max(self.depth(r) for r in range(len(self.parent)))


class Packing(NamedTuple):
    """Trees from one root used at once: ``trees`` (a tuple of :class:`Tree`), ``rate`` (bytes
    per second, the sum of theirs), ``bound`` (:func:`broadcast_bound` on the same links)."""

    root: int
    trees: tuple
    rate: float
    bound: float


# ---------------------------------------------------------------------------------------
# The bound and the packing
# ---------------------------------------------------------------------------------------


def flow_graph(topology, pcie=False) -> networkx.DiGraph:
    """The topology as a networkx DiGraph with a ``capacity`` (bytes/s) on every directed link.
    pcie=True adds PCIe as a tree of its own: every rank -> its switch ("switch", s) -> the host
    ("host") and back, each hop PCIe's bandwidth (the model of ``sim.LinkGraph``: a GPU's x16
    link, its switch's uplink; the CPUs' QPI is not a limit). Raises ValueError for a topology
    that is not a ``sim.LinkGraph``, or pcie=True on one without PCIe."""
    if not isinstance(topology, LinkGraph):
        raise ValueError(f"topology must be a sim.LinkGraph (sim.Topology.graph or .dgx1), got {topology!r}")
    graph = networkx.DiGraph()
    graph.add_nodes_from(range(topology.size))
    for (a, b), link in topology.links().items():
        graph.add_edge(a, b, capacity=link.bandwidth)
    if pcie:
        if topology.pcie is None:
            raise ValueError(f"pcie=True, but {topology!r} has no PCIe; build it with pcie=...")
        bandwidth = topology.pcie.bandwidth
        for r in range(topology.size):
            switch = ("switch", topology.switch_of(r))
            graph.add_edge(r, switch, capacity=bandwidth)
            graph.add_edge(switch, r, capacity=bandwidth)
            graph.add_edge(switch, "host", capacity=bandwidth)
            graph.add_edge("host", switch, capacity=bandwidth)
    return graph


def broadcast_bound(topology, root=0, pcie=False) -> float:
    """The best rate (bytes per second) at which ``root`` can broadcast on ``topology``'s links
    (plus PCIe with pcie=True): min over the other ranks v of the max-flow from root to v
    (networkx's ``maximum_flow_value``). A cut between root and v carries every byte v gets,
    so no schedule is faster; Edmonds (1973, "Edge-disjoint branchings") proves that packed
    arborescences reach it. math.inf on one rank. Raises ValueError for a bad root (and as
    :func:`flow_graph`)."""
    graph = flow_graph(topology, pcie)
    _check_root(root, topology.size)
    return min((networkx.maximum_flow_value(graph, root, v) for v in range(topology.size) if v != root),
               default=math.inf)


def pack_trees(topology, root=0, pcie=False) -> Packing:
    """Arborescences from ``root`` over the topology's links whose rates sum to exactly
    :func:`broadcast_bound` (pcie=True: plus a PCIe chain, see below).

    The links' bandwidths are counted in units of their greatest common divisor (25 GB/s on a
    DGX-1: one NVLink), so the graph is a multigraph with k = bound / unit arc-disjoint
    arborescences (Edmonds' theorem). They are found one at a time by Lovász's proof ("On two
    minimax theorems in graph", 1976; Schrijver, Combinatorial Optimization, Thm 53.1): grow an
    arborescence T arc by arc, taking an arc out of T's vertex set only if, without T's arcs,
    every rank keeps max-flow >= k - 1 from the root; the lemma says such an arc always
    exists, so the packing is optimal, not an approximation. About k n m max-flows: instant
    on 8 GPUs. Equal trees are merged (their rates added).

    pcie=True adds one :class:`Tree` over PCIe (channel "pcie", rate = PCIe's bandwidth): a
    chain from the root through its switch-mates, then switch by switch, so each GPU's x16 link
    and each switch's uplink carries it once each way; PCIe's own bound is one x16 link (the
    root's), which the chain reaches. The bound returned is then ``broadcast_bound(..., pcie=True)``.
    Raises ValueError for a bad root, bandwidths with no integer unit or more than MAX_UNITS
    units, a graph that does not reach every rank (and as :func:`flow_graph`)."""
    graph = flow_graph(topology)
    _check_root(root, topology.size)
    bound = broadcast_bound(topology, root)
    if topology.size == 1:
        trees = [Tree(root, (None,), math.inf, topology.name)]
    else:
        if bound == 0:
            raise ValueError(f"rank(s) {_unreached(graph, root)} cannot be reached from rank {root} over "
                             f"{topology.name} links: no tree spans them (use pcie=True, or fewer ranks)")
        trees = list(_packed(topology, root, bound))
    if pcie:
        trees.append(pcie_chain(topology, root))
        bound = broadcast_bound(topology, root, pcie=True)
    return Packing(root, tuple(trees), sum(t.rate for t in trees), bound)


@functools.lru_cache(maxsize=64)
def _packed(topology, root, bound):
    """The NVLink (link) trees of :func:`pack_trees`, remembered per topology and root."""
    unit = _unit(topology)
    units = {edge: round(link.bandwidth / unit) for edge, link in topology.links().items()}
    return tuple(_merged(_arborescences(units, topology.size, root, round(bound / unit)), unit, topology.name))


def pcie_chain(topology, root=0) -> Tree:
    """The PCIe chain of :func:`pack_trees`: root, its switch-mates, then every other switch's
    ranks (switches in order of their smallest rank), each rank receiving from the one before;
    rate = PCIe's bandwidth. Raises ValueError without PCIe or for a bad root."""
    if topology.pcie is None:
        raise ValueError(f"{topology!r} has no PCIe; build it with pcie=...")
    _check_root(root, topology.size)
    switch = topology.switch_of
    order = sorted(range(topology.size), key=lambda r: (r != root, switch(r) != switch(root), switch(r), r))
    parent = [None] * topology.size
    for before, r in zip(order, order[1:]):
        parent[r] = before
    return Tree(root, tuple(parent), topology.pcie.bandwidth, "pcie")


def _arborescences(units, n, root, k):
    """k arc-disjoint spanning arborescences from root in the multigraph ``units`` ((u, v) ->
    number of parallel arcs), as parent tuples (Lovász's proof, :func:`pack_trees`)."""
    units, found = dict(units), []
    for left in range(k - 1, -1, -1):  # after this tree, `left` more must still fit
        parent, depth = {root: None}, {root: 0}
        while len(parent) < n:  # shallow trees first (a short pipeline fill): arcs from the shallowest rank
            arcs = sorted((depth[u], -count, u, v) for (u, v), count in units.items()
                          if count and u in parent and v not in parent)
            for _, _, u, v in arcs:
                units[(u, v)] -= 1
                if _min_flow(units, n, root) >= left:
                    parent[v], depth[v] = u, depth[u] + 1
                    break
                units[(u, v)] += 1
            else:  # Lovász's lemma says this cannot happen
                raise RuntimeError(f"no arc extends tree {len(found)} (parent {parent}); report this")
        found.append(tuple(parent.get(r) for r in range(n)))
    return found


def _min_flow(units, n, root):
    graph = networkx.DiGraph()
    graph.add_nodes_from(range(n))
    graph.add_weighted_edges_from(((u, v, c) for (u, v), c in units.items() if c > 0), weight="capacity")
    return min(networkx.maximum_flow_value(graph, root, v) for v in range(n) if v != root)


def _merged(parents, unit, name):
    counts = {}
    for parent in parents:
        counts[parent] = counts.get(parent, 0) + 1
    root = parents[0].index(None)
    return [Tree(root, parent, count * unit, name) for parent, count in counts.items()]


def _unit(topology):
    """The greatest common divisor of the links' bandwidths (integers of bytes/s)."""
    bandwidths = {link.bandwidth for link in topology.links().values()}
    if any(not math.isfinite(b) or b != int(b) for b in bandwidths):
        raise ValueError(f"pack_trees needs bandwidths that are whole numbers of bytes/s, got {sorted(bandwidths)}")
    unit = math.gcd(*(int(b) for b in bandwidths))
    if max(bandwidths) / unit * len(topology.links()) > MAX_UNITS * topology.size:
        raise ValueError(f"the bandwidths {sorted(bandwidths)} have a common unit of {unit} B/s: too many "
                         f"unit trees (over {MAX_UNITS}); round them to a coarser unit")
    return float(unit)


def _unreached(graph, root):
    reached = networkx.descendants(graph, root) | {root}
    return sorted(v for v in graph.nodes if isinstance(v, int) and v not in reached)


def _check_root(root, size):
    if isinstance(root, bool) or not isinstance(root, (int, numpy.integer)) or not 0 <= root < size:
        raise ValueError(f"root must be a rank in 0..{size - 1}, got {root!r}")


# ---------------------------------------------------------------------------------------
# Rings
# ---------------------------------------------------------------------------------------


def hamiltonian_cycles(topology) -> list:
    """Every ring through all ranks over the topology's links (not PCIe): a list of tuples of
    ranks, each starting at rank 0 and listed in one direction only (second rank < last).
    Exhaustive depth-first search, fine for a machine's handful of GPUs. One rank: [(0,)];
    two: [(0, 1)] if they are linked."""
    n = topology.size
    neighbours = {r: sorted({b for a, b in topology.links() if a == r}) for r in range(n)}
    if n <= 2:
        return [tuple(range(n))] if n == 1 or 1 in neighbours[0] else []
    found, path, seen = [], [0], {0}

    def extend():
        last = path[-1]
        if len(path) == n:
            if 0 in neighbours[last] and path[1] < last:
                found.append(tuple(path))
            return
        for v in neighbours[last]:
            if v not in seen:
                path.append(v)
                seen.add(v)
                extend()
                seen.discard(v)
                path.pop()

    extend()
    return found


def ring_rate(topology) -> float:
    """The broadcast rate (bytes/s) of rings over the topology's links, as NCCL-style ring
    channels would get it: greedily, take the directed ring (:func:`hamiltonian_cycles`, both
    directions) with the largest bottleneck of the bandwidth left, run a ring at that rate,
    subtract, repeat. A greedy packing (a lower bound on the best ring packing); 0.0 when there
    is no ring. On a full DGX-1 it finds 150e9 (= the trees' bound); on GPUs 0, 1, 2, 3, 5, 0."""
    left = {edge: link.bandwidth for edge, link in topology.links().items()}
    rings = [c for cycle in hamiltonian_cycles(topology) if len(cycle) > 1 for c in (cycle, cycle[:1] + cycle[:0:-1])]
    total = 0.0
    while rings:
        def bottleneck(ring):
            return min(left[(a, b)] for a, b in zip(ring, ring[1:] + ring[:1]))
        best = max(rings, key=bottleneck)
        rate = bottleneck(best)
        if rate <= 0:
            break
        for a, b in zip(best, best[1:] + best[:1]):
            left[(a, b)] -= rate
        total += rate
    return total


# ---------------------------------------------------------------------------------------
# The collectives over trees
# ---------------------------------------------------------------------------------------
# Pipelining. Tree t's share of the vector (elements in proportion to its rate: a tree of
# rate w_t gets about n w_t / R of them) is cut into `chunks` pieces, and all trees run in
# lock step rounds: in round s a rank at depth d forwards piece s - d to its children, who
# receive it in the same round. A round posts every message of every tree at once (each link
# its own port) and waits for them. With C pieces, a tree of height D takes C + D - 1 rounds;
# when every link of a round carries one piece of b bytes, a round takes alpha + b / bandwidth:
#     T_broadcast = (C + D - 1) (alpha + b / bandwidth),   b = n_t / C bytes
# and since the packing's rates fit the links, the trees' pieces on a shared link add up to
# at most the link's bandwidth times n / (C R): the whole runs at about the packing's rate R
# once C >> D. All-reduce: the reduce runs up each tree (a rank adds its children's pieces to
# its own, lower child first, then sends the sum up; piece k leaves depth d in round
# k + D - d), then the root's sums come down as in the broadcast: C + 2D - 1 rounds, the
# links' two directions both busy. Every rank ends with the root's bytes.


def broadcast_trees(comm, x, root, trees, chunks=DEFAULT_CHUNKS):
    """Root's array on every rank, sent down several spanning trees at once (Blink).

    x: an array of the same shape and dtype on every rank (root's values are used). trees: a
    :class:`Packing` or a sequence of :class:`Tree` rooted at ``root`` spanning the
    communicator's ranks; the flattened x is split among them in proportion to their rates,
    each share pipelined in ``chunks`` pieces (the comment above: cost and schedule). A tree
    with channel "pcie" sends with tags in ``sim.PCIE_TAGS`` (its messages take PCIe on a
    ``sim.LinkGraph``). Returns a new array of x's shape and dtype. Raises CollectiveError on
    every rank when the ranks disagree on the shape, dtype, root, chunks or trees, or the trees
    do not fit (wrong root, not spanning comm's ranks, cycles, no positive rate, more than
    MAX_TREES); CollectiveTimeout past the deadline. Source: Wang et al., Blink (MLSys 2020).
    """
    x, trees = _agreed(comm, "broadcast_trees", x, trees, root, chunks, None)
    x, back = stage_to_host(comm, x)
    rank = comm.Get_rank()
    out = numpy.array(x, order="C", copy=True) if rank == root else numpy.empty(x.shape, x.dtype)
    flat = out.reshape(-1)
    plans = [_TreePlan(tree, rank, part, chunks, i) for i, (tree, part) in enumerate(zip(trees, _shares(flat, trees)))]
    height = max(plan.height for plan in plans)
    for s in range(chunks + height - 1):
        requests, peers, receives = [], [], 0
        for plan in plans:
            piece = plan.piece(s - plan.depth + 1)
            if plan.parent is not None and piece is not None:
                requests.append(comm.Irecv(piece, source=plan.parent, tag=plan.down_tag))
                peers.append(plan.parent)
                receives += 1
        for plan in plans:
            piece = plan.piece(s - plan.depth)
            for child in plan.children if piece is not None else ():
                requests.append(comm.Isend(piece, dest=child, tag=plan.down_tag))
                peers.append(child)
        wait_all(comm, requests, peers, "broadcast_trees", receives=receives)  # the receives come first
    return back(out)


def all_reduce_trees(comm, x, trees, op="sum", chunks=DEFAULT_CHUNKS):
    """The elementwise reduction of every rank's x on every rank, over spanning trees (Blink:
    reduce up each tree, broadcast down the same tree, pipelined; the comment above).

    op: "sum", "prod", "max" or "min" (numpy's ufunc in x's dtype, as ``collectives.all_reduce``).
    trees: a :class:`Packing` or a sequence of :class:`Tree` spanning the ranks (any roots).
    The shares follow the trees' rates, a PCIe chain's halved (the code says why).
    Floats are added in the trees' order (a rank's own piece, then its children's), another
    order than a ring's, so they agree with ``collectives.all_reduce`` to rounding; every rank
    returns identical bytes. Returns a new array of x's shape and dtype. Raises CollectiveError
    (every rank) as :func:`broadcast_trees`, and for an unknown op. Source: Wang et al. 2020."""
    x, trees = _agreed(comm, "all_reduce_trees", x, trees, None, chunks, op)
    x, back = stage_to_host(comm, x)
    rank, ufunc = comm.Get_rank(), getattr(numpy, OPS[op])
    out = numpy.array(x, order="C", copy=True)
    flat = out.reshape(-1)
    # a PCIe chain's reduce goes up the chain while its broadcast comes down it, and both cross
    # the switches' uplinks in the same direction (up to the CPU): it counts at half its rate
    rated = [t._replace(rate=t.rate / 2) if t.channel == "pcie" else t for t in trees]
    plans = [_TreePlan(tree, rank, part, chunks, i) for i, (tree, part) in enumerate(zip(trees, _shares(flat, rated)))]
    height = max(plan.height for plan in plans)
    scratch = {(i, c): numpy.empty(plan.largest, x.dtype) for i, plan in enumerate(plans) for c in plan.children}
    for s in range(chunks + 2 * height - 1):
        requests, peers, sends, sent_to, combine = [], [], [], [], []
        for i, plan in enumerate(plans):
            k = s - height + plan.depth + 1  # the piece my children send up this round
            piece = plan.piece(k)
            for child in plan.children if piece is not None else ():
                buf = scratch[(i, child)][:piece.size]
                requests.append(comm.Irecv(buf, source=child, tag=plan.up_tag))
                peers.append(child)
                combine.append((piece, buf))
            piece = plan.piece(s - height - plan.depth + 1)  # the result coming down to me
            if plan.parent is not None and piece is not None:
                requests.append(comm.Irecv(piece, source=plan.parent, tag=plan.down_tag))
                peers.append(plan.parent)
            piece = plan.piece(s - height + plan.depth)  # my sum going up
            if plan.parent is not None and piece is not None:
                sends.append(comm.Isend(piece, dest=plan.parent, tag=plan.up_tag))
                sent_to.append(plan.parent)
            piece = plan.piece(s - height - plan.depth)  # the result going down from me
            for child in plan.children if piece is not None else ():
                sends.append(comm.Isend(piece, dest=child, tag=plan.down_tag))
                sent_to.append(child)
        wait_all(comm, requests + sends, peers + sent_to, "all_reduce_trees", receives=len(requests))
        for piece, buf in combine:
            ufunc(piece, buf, out=piece)
    return back(out)


class _TreePlan:
    """One rank's part in one tree: its parent, children, depth, the tree's height, tags and
    the pieces of its share of the flat vector."""

    def __init__(self, tree, rank, part, chunks, index):
        self.parent, self.children = tree.parent[rank], tree.children(rank)
        self.depth, self.height = tree.depth(rank), tree.height()
        pcie = tree.channel == "pcie"
        self.down_tag = (PCIE_TAGS.start if pcie else BROADCAST_TAG) + index
        self.up_tag = (PCIE_TAGS.start + 500 if pcie else REDUCE_TAG) + index
        self.pieces = [part[a:b] for a, b in chunk_bounds(part.size, chunks)]
        self.largest = max(piece.size for piece in self.pieces)

    def piece(self, k):
        """Piece k of the share, or None when there is no such piece or it is empty (no message)."""
        if 0 <= k < len(self.pieces) and self.pieces[k].size:
            return self.pieces[k]
        return None


def _shares(flat, trees):
    """The flat vector cut into one contiguous share per tree, sizes in proportion to the
    trees' rates (largest remainders get the leftover elements, lower tree first)."""
    n, rates = flat.size, [t.rate for t in trees]
    if any(math.isinf(r) for r in rates):
        rates = [1.0 if math.isinf(r) else 0.0 for r in rates]
    total = sum(rates)
    exact = [n * r / total for r in rates]
    sizes = [math.floor(e) for e in exact]
    for i in sorted(range(len(trees)), key=lambda i: (sizes[i] - exact[i], i))[:n - sum(sizes)]:
        sizes[i] += 1
    bounds = numpy.cumsum([0] + sizes)
    return [flat[bounds[i]:bounds[i + 1]] for i in range(len(trees))]


def _agreed(comm, name, x, trees, root, chunks, op):
    """(x as an array, the trees as a tuple) once every rank agrees on the arguments (one
    ``p2p.agree`` round); CollectiveError on every rank for any rank's bad argument or a
    disagreement."""
    x = get_array_module(x).asarray(x)
    trees = tuple(trees.trees if isinstance(trees, Packing) else trees)
    problem = None
    if x.dtype.kind not in "biufc" or not x.dtype.isnative:
        problem = f"x has dtype {x.dtype} ({x.dtype.str!r}); pass bool, integer, float or complex numbers"
    elif isinstance(chunks, bool) or not isinstance(chunks, (int, numpy.integer)) or chunks < 1:
        problem = f"chunks must be a positive integer, got {chunks!r}"
    elif op is not None and op not in OPS:
        problem = f"unknown op {op!r}; choose one of {', '.join(map(repr, OPS))}"
    else:
        problem = _check_trees(trees, comm.Get_size(), root)
    payload = (x.shape, x.dtype.str, root, int(chunks) if problem is None else None, op,
               tuple((t.parent, t.rate, t.channel) for t in trees) if problem is None else None)
    payloads = agree(comm, f"{name}: {problem}" if problem else None, payload, what=name)
    if any(other != payload for other in payloads):
        listing = "; ".join(f"rank {r}: shape {o[0]}, dtype {o[1]}, root {o[2]}, chunks {o[3]}, op {o[4]}, "
                            f"{len(o[5])} trees" for r, o in enumerate(payloads))
        raise CollectiveError(f"{name}: the ranks disagree on the arguments (every rank must pass the same x shape "
                              f"and dtype, root, chunks, op and trees): {listing}")
    return x, trees


def _check_trees(trees, p, root):
    """Why ``trees`` cannot carry a collective on p ranks (from ``root``; None: any), or None."""
    if not trees or len(trees) > MAX_TREES or not all(isinstance(t, Tree) for t in trees):
        return f"trees must be a Packing or 1..{MAX_TREES} blink.Tree, got {trees!r:.200}"
    for i, t in enumerate(trees):
        if len(t.parent) != p or [r for r, q in enumerate(t.parent) if q is None] != [t.root]:
            return (f"tree {i} must give a parent for each of the {p} ranks, None for its root {t.root} "
                    f"only, got {t.parent}")
        if root is not None and t.root != root:
            return f"tree {i} is rooted at rank {t.root}, not at the root {root}"
        if not all(q is None or (isinstance(q, int) and 0 <= q < p) for q in t.parent):
            return f"tree {i}'s parents must be ranks in 0..{p - 1}, got {t.parent}"
        for r in range(p):
            seen = set()
            while t.parent[r] is not None:
                if r in seen:
                    return f"tree {i} has a cycle through rank {r}: {t.parent}"
                seen.add(r)
                r = t.parent[r]
        if not (isinstance(t.rate, (int, float)) and t.rate > 0):
            return f"tree {i}'s rate must be a number of bytes/s > 0, got {t.rate!r}"
    return None
