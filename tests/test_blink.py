"""Idle links (issue 23 item 3): the DGX-1 graph topology, max-flow bounds by hand, Edmonds
packings that reach them, the 5-GPU allocation with no NVLink ring, broadcast/all-reduce over
trees equal to the plain collectives, virtual-time makespans equal to the pipelined-tree
closed form, and PCIe making a broadcast faster."""
import networkx
import numpy as np
import pytest

from minidist import blink, collectives, sim
from minidist.p2p import CollectiveError

GB = 1e9
PART = (0, 1, 2, 3, 5)  # GPU 5's only NVLink in this set goes to GPU 1


# -- the topology ---------------------------------------------------------------------------


def test_dgx1_has_six_nvlinks_per_gpu_each_direction_its_own_port_and_pcie_elsewhere():
    t = sim.Topology.dgx1()
    links = t.links()
    assert len(links) == 32  # 16 pairs, both directions
    for g in range(8):
        assert sum(c.bandwidth for (a, _), c in links.items() if a == g) == 150 * GB  # 6 x 25 GB/s
    assert t.link(0, 3) == sim.LinkClass("nvlink", 3.4e-6, 50 * GB) and t.link(0, 1).bandwidth == 25 * GB
    assert t.port(0, 3) == (("link", 0, 3), False) and t.port(3, 0) == (("link", 3, 0), False)
    assert t.link(0, 5) == sim.LinkClass("pcie", 5.7e-6, 12 * GB)  # no NVLink: PCIe through the host
    assert t.port(0, 5) == (("pcie_uplink", 0), True) and t.port(2, 3) == (("link", 2, 3), False)
    assert t.channel(0, 1, sim.PCIE_TAGS.start) == (t.pcie, ("pcie", 0), False)  # asked for PCIe on purpose
    assert t.channel(0, 1, 7) == (t.link(0, 1), ("link", 0, 1), False)
    part = sim.Topology.dgx1(gpus=PART, pcie=False)
    assert part.labels == PART and sorted(part.links()) == sorted(
        [(a, b) for a, b in [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3), (1, 4)]]
        + [(b, a) for a, b in [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3), (1, 4)]])
    with pytest.raises(ValueError, match=r"rank 0 \(GPU 0\) cannot send to rank 4 \(GPU 5\)"):
        part.link(0, 4)
    assert part.restricted([4, 1]).links() == {(0, 1): part.link(4, 1), (1, 0): part.link(1, 4)}
    assert sim.Topology.dgx1() == sim.Topology.dgx1() and sim.Topology.dgx1() != part
    for bad in [(0, 0), (0, 8), ()]:
        with pytest.raises(ValueError, match="gpus must be"):
            sim.Topology.dgx1(gpus=bad)
    with pytest.raises(ValueError, match="two different ranks"):
        sim.Topology.graph(2, {(0, 0): (0, 1)})


def test_a_message_without_a_link_is_refused_and_with_pcie_takes_it():
    def send(comm):
        x = np.zeros(1000, np.uint8)
        if comm.Get_rank() == 0:
            comm.Send(x, 4)
        elif comm.Get_rank() == 4:
            comm.Recv(x, 0)

    with pytest.raises(ValueError, match="no nvlink link between them"):
        sim.World(5, topology=sim.Topology.dgx1(gpus=PART, pcie=False)).run(send)
    world = sim.World(5, topology=sim.Topology.dgx1(gpus=PART))
    world.run(send)
    assert world.makespan == pytest.approx(5.7e-6 + 1000 / 12e9, rel=1e-12)


# -- bounds and packings --------------------------------------------------------------------


@pytest.mark.parametrize("gpus, nvlink, root", [
    (tuple(range(8)), 150, 0),  # the root's 6 NVLinks (and every GPU's 6 in)
    (tuple(range(8)), 150, 5),
    (PART, 50, 0),              # GPU 5 receives only over its 2 NVLinks from GPU 1
    (PART, 50, 4),              # from GPU 5: its 2 NVLinks out
    ((0, 1, 2), 50, 0),         # to GPU 1: 0-1 direct (25) + 0-2-1 (25)
    ((0, 1, 4, 5, 6), 75, 0),   # GPU 0 has 0-1 (1) and 0-4 (2) in the set: 3 links out
])
def test_max_flow_bound_by_hand_and_the_packing_reaches_it_within_the_links(gpus, nvlink, root):
    topo = sim.Topology.dgx1(gpus=gpus)
    assert blink.broadcast_bound(topo, root) == nvlink * GB
    assert blink.broadcast_bound(topo, root, pcie=True) == (nvlink + 12) * GB  # + the root's one x16 link
    for pcie in (False, True):
        packing = blink.pack_trees(topo, root, pcie=pcie)
        assert packing.rate == packing.bound == (nvlink + 12 * pcie) * GB  # Edmonds: exactly the bound
        load = {}
        for tree in packing.trees:
            assert tree.root == root and tree.parent[root] is None and tree.height() < len(gpus)
            if tree.channel == "nvlink":
                for r, p in enumerate(tree.parent):
                    if p is not None:
                        load[(p, r)] = load.get((p, r), 0) + tree.rate
        links = topo.links()
        assert all(rate <= links[arc].bandwidth for arc, rate in load.items())  # every arc is a link, not over


def test_five_gpus_have_no_nvlink_ring_but_trees_use_the_links():
    part, full = sim.Topology.dgx1(gpus=PART), sim.Topology.dgx1()
    assert blink.hamiltonian_cycles(part) == [] and blink.ring_rate(part) == 0.0
    assert blink.pack_trees(part).rate == 50 * GB
    # the oracle: networkx's own cycle enumeration, rings = simple cycles through all 8 GPUs
    graph = networkx.Graph(list(full.links()))
    rings = {frozenset(zip(c, c[1:] + c[:1])) | frozenset(zip(c[1:] + c[:1], c))
             for c in networkx.simple_cycles(graph, length_bound=8) if len(c) == 8}
    found = blink.hamiltonian_cycles(full)
    assert len(found) == len(rings) > 0
    assert {frozenset(zip(c, c[1:] + c[:1])) | frozenset(zip(c[1:] + c[:1], c)) for c in found} == rings
    assert blink.ring_rate(full) == 150 * GB  # the doubled ring twice, then the single links' ring twice
    print(f"\nGPUs {PART}: ring over NVLink {blink.ring_rate(part) / GB:g} GB/s, trees "
          f"{blink.pack_trees(part).rate / GB:g} GB/s (max-flow bound {blink.broadcast_bound(part) / GB:g})")


def test_packing_errors():
    with pytest.raises(ValueError, match="cannot be reached"):
        blink.pack_trees(sim.Topology.dgx1(gpus=(0, 5), pcie=False))
    with pytest.raises(ValueError, match="has no PCIe"):
        blink.pack_trees(sim.Topology.dgx1(pcie=False), pcie=True)
    with pytest.raises(ValueError, match="root must be"):
        blink.broadcast_bound(sim.Topology.dgx1(), 8)
    with pytest.raises(ValueError, match="sim.LinkGraph"):
        blink.broadcast_bound(sim.Topology.nodes(2, 2, (0, 1e9), (0, 1e9)))


# -- the collectives: values ----------------------------------------------------------------


def plain(p, fn):
    return sim.World(p).run(fn)


@pytest.mark.parametrize("gpus, pcie", [(PART, True), (tuple(range(8)), False)])
def test_broadcast_and_all_reduce_over_trees_equal_the_plain_collectives(gpus, pcie):
    topo, p = sim.Topology.dgx1(gpus=gpus), len(gpus)
    world = sim.World(p, topology=topo)
    sizes = (0, 1, 7, 1001) if p == 5 else (0, 13, 1001)
    for n in sizes:
        rng = np.random.default_rng(n)
        xs = [rng.integers(-5, 6, n).astype(np.int64) for _ in range(p)]
        for root in (0, p - 1):
            packing = blink.pack_trees(topo, root, pcie=pcie)
            got = world.run(lambda comm, x=xs, r=root, t=packing: blink.broadcast_trees(comm, x[comm.Get_rank()], r, t))
            want = plain(p, lambda comm, xs=xs, root=root: collectives.broadcast(comm, xs[comm.Get_rank()], root))
            assert all(np.array_equal(g, w) and g.dtype == w.dtype for g, w in zip(got, want))
        packing = blink.pack_trees(topo, 0, pcie=pcie)
        for op in ("sum", "prod", "max", "min"):
            got = world.run(lambda comm, x=xs, t=packing, o=op: blink.all_reduce_trees(comm, x[comm.Get_rank()], t, o))
            want = plain(p, lambda comm, xs=xs, op=op: collectives.all_reduce(comm, xs[comm.Get_rank()], op))
            assert all(np.array_equal(g, w) for g, w in zip(got, want)), (n, op)
        fs = [rng.standard_normal((n, 1)).astype(np.float32) for _ in range(p)]
        got = world.run(lambda comm, fs=fs, t=packing: blink.all_reduce_trees(comm, fs[comm.Get_rank()], t))
        assert all(g.shape == (n, 1) and g.dtype == np.float32 and np.array_equal(g, got[0]) for g in got)
        np.testing.assert_allclose(got[0], sum(f.astype(np.float64) for f in fs), rtol=1e-5, atol=1e-5)


def test_collective_errors_on_every_rank():
    topo = sim.Topology.dgx1(gpus=PART)
    packing = blink.pack_trees(topo)
    world = sim.World(5, topology=topo)
    with pytest.raises(CollectiveError, match="rooted at rank 0, not at the root 1"):
        world.run(lambda comm: blink.broadcast_trees(comm, np.zeros(3), 1, packing))
    with pytest.raises(CollectiveError, match="disagree"):
        world.run(lambda comm: blink.broadcast_trees(comm, np.zeros(3 + (comm.Get_rank() == 2)), 0, packing))
    with pytest.raises(CollectiveError, match="unknown op"):
        world.run(lambda comm: blink.all_reduce_trees(comm, np.zeros(3), packing, op="mean"))
    cyclic = blink.Tree(0, (None, 2, 1, 0, 1), 1.0, "nvlink")
    with pytest.raises(CollectiveError, match="cycle"):
        world.run(lambda comm: blink.all_reduce_trees(comm, np.zeros(3), [cyclic]))
    with pytest.raises(CollectiveError, match="chunks must be"):
        world.run(lambda comm: blink.broadcast_trees(comm, np.zeros(3), 0, packing, chunks=0))


# -- virtual time ---------------------------------------------------------------------------

ALPHA, BW = 2e-6, 10e9


@pytest.mark.parametrize("chunks", [1, 4, 8])
def test_one_pipelined_tree_takes_c_plus_d_minus_1_steps(chunks):
    # a chain 0 -> 1 -> 2 -> 3 (height 3) and its reverse for the reduce
    topo = sim.Topology.graph(4, {(0, 1): (ALPHA, BW), (1, 2): (ALPHA, BW), (2, 3): (ALPHA, BW)})
    chain = blink.Tree(0, (None, 0, 1, 2), BW, "link")
    n = 8 * 1000
    world = sim.World(4, topology=topo)
    world.run(lambda comm: blink.broadcast_trees(comm, np.ones(n), 0, [chain], chunks=chunks))
    piece = ALPHA + n * 8 / chunks / BW
    assert world.makespan == pytest.approx((chunks + 3 - 1) * piece, rel=1e-12)
    world.run(lambda comm: blink.all_reduce_trees(comm, np.ones(n), [chain], chunks=chunks))
    assert world.makespan == pytest.approx((chunks + 2 * 3 - 1) * piece, rel=1e-12)


def test_two_packed_trees_each_carry_their_share_at_once():
    # a triangle: root 0 sends half down 0->1->2 and half down 0->2->1 (disjoint arcs): bound 2 BW
    topo = sim.Topology.graph(3, {(0, 1): (ALPHA, BW), (0, 2): (ALPHA, BW), (1, 2): (ALPHA, BW)})
    packing = blink.pack_trees(topo)
    assert packing.rate == packing.bound == 2 * BW and len(packing.trees) == 2
    n, chunks = 8 * 1000, 8
    world = sim.World(3, topology=topo)
    world.run(lambda comm: blink.broadcast_trees(comm, np.ones(n), 0, packing, chunks=chunks))
    assert world.makespan == pytest.approx((chunks + 2 - 1) * (ALPHA + n * 8 / 2 / chunks / BW), rel=1e-12)
    assert world.makespan > n * 8 / packing.bound  # nothing beats the bound


def test_pcie_too_is_faster_than_nvlink_alone_on_five_gpus():
    topo = sim.Topology.dgx1(gpus=PART)
    x = np.zeros(1 << 20)  # 8 MiB
    world = sim.World(5, topology=topo)
    times = {}
    for pcie in (False, True):
        packing = blink.pack_trees(topo, pcie=pcie)
        world.run(lambda comm, t=packing: blink.broadcast_trees(comm, x, 0, t))
        times[pcie] = world.makespan
        assert world.makespan > x.nbytes / packing.bound
    assert times[True] < times[False]
    print(f"\n8 MiB broadcast on GPUs {PART}: NVLink trees {x.nbytes / times[False] / GB:.1f} GB/s, "
          f"NVLink + PCIe {x.nbytes / times[True] / GB:.1f} GB/s")
