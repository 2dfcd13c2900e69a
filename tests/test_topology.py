"""Topology-aware collectives on the sim (issue 23): virtual time on a sim.Topology against
hand-computed times and the two-tier closed forms of costmodel, hierarchical, torus and
multi-ring (issue 35) all-reduce against numpy, the delay layer. Their mpiexec half: test_hierarchical_mpi.py."""
import subprocess
import sys
import time

import numpy as np
import pytest

from minidist import async_collectives, collectives, costmodel, sim
from minidist.node_layout import node_layout, set_ranks_per_node
from minidist.p2p import CollectiveError
from minidist.topology_delay import DelayComm

INTRA, INTER = (1e-6, 1e10), (1e-5, 1e9)  # 1 us and 10 GB/s in a node, 10 us and 1 GB/s between


def topo(num_nodes, ranks_per_node, nic="per_rank", intra=INTRA, inter=INTER):
    return sim.Topology.nodes(num_nodes, ranks_per_node, intra=intra, inter=inter, nic=nic)


# -- the topology ---------------------------------------------------------------------------


def test_topology_nodes_links_ports_and_errors():
    t = topo(2, 3, nic="shared")
    assert (t.size, t.num_nodes, t.ranks_per_node) == (6, 2, 3)
    assert [t.node_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert t.link(0, 2) == sim.LinkClass("intra", 1e-6, 1e10) and t.link(2, 3).name == "inter"
    assert t.link(1, 4).time(1000) == pytest.approx(1e-5 + 1e-6)
    assert t.port(1, 4) == (("nic", 0), True) and t.port(1, 2) == (("intra", 1), False)
    assert topo(2, 3).port(1, 4) == (("inter", 1), False)
    assert topo(2, 1, nic="shared").port(0, 1) == (("nic", 0), False)  # nobody to share the card with
    sub = t.restricted([5, 0, 3])
    assert [sub.node_of(r) for r in range(3)] == [0, 1, 0] and sub.ranks_per_node is None
    assert sim.Topology([0, 1, 0, 1], INTRA, INTER) == sim.Topology([0, 1, 0, 1], INTRA, INTER)
    with pytest.raises(ValueError, match="nic must be"):
        topo(2, 2, nic="one")
    with pytest.raises(ValueError, match="bandwidth must be"):
        topo(2, 2, inter=(1e-6, 0))
    with pytest.raises(ValueError, match="alpha must be"):
        topo(2, 2, intra=(-1, 1e9))
    with pytest.raises(ValueError, match="rank must be in 0..5"):
        t.node_of(6)
    with pytest.raises(ValueError, match="world has 5 ranks but the topology has 6"):
        sim.World(5, topology=t)
    with pytest.raises(ValueError, match="not both"):
        sim.World(6, topology=t, bandwidth=1e9)
    with pytest.raises(ValueError, match="no virtual clock"):
        sim.run(lambda comm: comm.compute(1.0), 1)
    with pytest.raises(ValueError, match="no virtual clock"):
        sim.World(2).makespan  # noqa: B018


# -- virtual time, by hand ------------------------------------------------------------------


def test_messages_cost_alpha_plus_bytes_over_bandwidth_on_their_link_and_wait_for_the_port():
    def program(comm):
        x = np.zeros(1000, np.uint8)  # 1000 B: 0.1 us in a node, 1 us between
        if comm.Get_rank() == 0:
            comm.compute(5e-6, "forward")
            comm.Send(x, 1)   # intra: 5 + 1.1 us
            r = comm.Isend(x, 2)  # inter: its own port, from 6.1 us
            s = comm.Isend(x, 3)  # inter again: waits for the port until 17.1 us
            r.Wait()
            s.Wait()
        else:
            comm.Recv(x, 0)
        comm.Barrier()

    world = sim.World(4, topology=topo(2, 2))
    world.run(program)
    bars = [(i.kind, i.start, i.end, i.peer, i.link, i.label) for i in world.timeline if i.rank == 0]
    expected = [("compute", 0, 5e-6, None, None, "forward"), ("send", 5e-6, 6.1e-6, 1, "intra", ""),
                ("send", 6.1e-6, 17.1e-6, 2, "inter", ""), ("send", 17.1e-6, 28.1e-6, 3, "inter", "")]
    assert len(bars) == len(expected)
    for got, want in zip(bars, expected):
        assert got[0] == want[0] and got[3:] == want[3:]
        assert got[1:3] == pytest.approx(want[1:3], abs=1e-15)
    assert world.clocks == pytest.approx([28.1e-6] * 4)  # the Barrier syncs every clock to the latest
    assert world.makespan == pytest.approx(28.1e-6)


def test_a_shared_nic_serialises_a_node_and_pickled_metadata_costs_nothing_but_carries_the_clock():
    def program(comm):
        rank = comm.Get_rank()
        x = np.zeros(1000, np.uint8)
        if rank < 2:   # ranks 0 and 1 (node 0) send across at once, through one card
            comm.Send(x, rank + 2)
        else:
            comm.Recv(x, rank - 2)
        if rank == 3:
            comm.send("done", 0)  # free, but rank 0 cannot receive it before rank 3's clock
        if rank == 0:
            comm.recv(source=3)
        return None

    for nic, arrivals in (("shared", [11e-6, 22e-6]), ("per_rank", [11e-6, 11e-6])):
        world = sim.World(4, topology=topo(2, 2, nic=nic))
        world.run(program)
        assert world.clocks[2:] == pytest.approx(arrivals), nic
        assert world.clocks[0] == pytest.approx(arrivals[1]), nic  # rank 3's clock came with its pickle
        assert [i.kind for i in world.timeline].count("send") == 2  # the pickle is not on the timeline


def _busy_cpu():
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def test_virtual_time_is_exact_whatever_the_scheduling_and_the_load():
    """The same shared-NIC hierarchical all-reduce three times: as is, with random real-time
    sleeps in every rank (another thread order each time), and beside a busy CPU."""
    topology = topo(2, 4, nic="shared")

    def program(comm, jitter):
        rng = np.random.default_rng()
        for _ in range(3):
            if jitter:
                time.sleep(rng.uniform(0, 2e-3))
            collectives.all_reduce(comm, np.ones(800), algorithm="hierarchical")
            comm.compute(1e-6 * (comm.Get_rank() + 1))

    runs = []
    for jitter, load in ((False, False), (True, False), (False, True)):
        busy = _busy_cpu() if load else None
        try:
            world = sim.World(8, topology=topology)
            world.run(program, jitter)
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
        runs.append((world.makespan, world.clocks, world.timeline))
    assert runs[0] == runs[1] == runs[2]
    # per rank and all-reduce: 3 + 3 ring steps in the node, 1 recursive-doubling step across: a send and a recv each
    assert len(runs[0][2]) == 3 * 8 * 7 * 2 + 3 * 8


# -- makespans against the two-tier closed forms --------------------------------------------

CASES = [(2, 2, "per_rank"), (2, 2, "shared"), (4, 2, "shared"), (2, 4, "per_rank"), (2, 4, "shared"),
         (4, 4, "per_rank")]


@pytest.mark.parametrize("num_nodes, ranks_per_node, nic", CASES)
def test_virtual_makespans_equal_the_two_tier_closed_forms(num_nodes, ranks_per_node, nic):
    topology = topo(num_nodes, ranks_per_node, nic)
    p = topology.size
    n = 64 * p  # float64: 512 p bytes, chunks divide evenly
    for algorithm in costmodel.TWO_TIER_ALGORITHMS:
        world = sim.World(p, topology=topology)
        world.run(lambda comm, a=algorithm: collectives.all_reduce(comm, np.ones(n), algorithm=a))
        assert world.makespan == pytest.approx(costmodel.two_tier_time(algorithm, 8 * n, topology), rel=1e-12), \
            algorithm


def test_rings_match_on_three_nodes_and_hierarchical_on_sixty_four_ranks():
    for topology, algorithms in ((topo(3, 2, "shared"), ("ring", "torus")),
                                 (topo(8, 8, "shared"), ("hierarchical",)),
                                 (topo(16, 4, "per_rank"), ("hierarchical",))):
        p = topology.size
        for algorithm in algorithms:
            world = sim.World(p, topology=topology)
            world.run(lambda comm, a=algorithm, n=4 * p: collectives.all_reduce(comm, np.ones(n, np.float32),
                                                                                algorithm=a))
            assert world.makespan == pytest.approx(costmodel.two_tier_time(algorithm, 16 * p, topology),
                                                   rel=1e-12), (topology, algorithm)


def test_hierarchy_cuts_the_network_term_l_fold_with_a_card_per_rank_and_only_alphas_with_a_shared_one():
    """Network bytes only (free intra links, alpha 0): per-rank cards give hierarchical an l x
    smaller network term than the flat ring (up to (P-1)/P against (N-1)/N); one shared card
    gives none. Alphas only (infinite bandwidth): the shared card's hierarchical pays 2l(N-1)
    network alphas against the ring's 2(P-1)."""
    free = (0.0, float("inf"))
    n_nodes, l, beta = 4, 4, 1e-9
    p, n = n_nodes * l, 8 * 64 * 16

    def makespan(algorithm, nic, inter):
        world = sim.World(p, topology=topo(n_nodes, l, nic, intra=free, inter=inter))
        world.run(lambda comm: collectives.all_reduce(comm, np.ones(n // 8), algorithm=algorithm))
        return world.makespan

    bytes_only = (0.0, 1 / beta)
    ring = makespan("ring", "per_rank", bytes_only)
    assert ring == pytest.approx(2 * (p - 1) / p * n * beta)
    per_rank = makespan("torus", "per_rank", bytes_only)
    assert per_rank == pytest.approx(2 * (n_nodes - 1) / n_nodes * n / l * beta)
    assert ring / per_rank == pytest.approx(l * ((p - 1) / p) / ((n_nodes - 1) / n_nodes))
    shared = makespan("torus", "shared", bytes_only)
    assert shared == pytest.approx(2 * (n_nodes - 1) / n_nodes * n * beta)
    assert ring / shared == pytest.approx(((p - 1) / p) / ((n_nodes - 1) / n_nodes))  # < 1.25: no l-fold gain
    alpha_only = (1e-5, float("inf"))
    assert makespan("ring", "shared", alpha_only) == pytest.approx(2 * (p - 1) * 1e-5)
    assert makespan("torus", "shared", alpha_only) == pytest.approx(2 * l * (n_nodes - 1) * 1e-5)
    assert makespan("torus", "per_rank", alpha_only) == pytest.approx(2 * (n_nodes - 1) * 1e-5)


def test_multi_ring_crosses_on_every_card_and_its_makespan_is_the_slower_link_per_step():
    """The multi-ring (NCCL's rings, one per card) on 2, 3 and 4 nodes: every rank sends
    2(P-1) messages across, one per step, each a chunk of n/(lP), all to one peer on the next
    node (ring k leaves from local rank k: every card carries one ring), and 2(P-1) inside its
    node to local rank + 1; the makespan is 2(P-1) times the slower of the two messages (l
    crossings on a shared card), whichever link is slower, for sizes l P does not divide too."""
    for (num_nodes, l, nic, intra), n in zip(((2, 4, "per_rank", INTRA), (3, 2, "per_rank", (2e-6, 1e8)),
                                              (4, 2, "shared", INTRA), (2, 3, "shared", (5e-5, 1e9))),
                                             (64 * 8 * 4, 6 * 2 * 100, 8 * 2 * 40, 333)):
        topology = topo(num_nodes, l, nic, intra=intra)
        p = topology.size
        world = sim.World(p, topology=topology)
        world.run(lambda comm, n=n: collectives.all_reduce(comm, np.ones(n), algorithm="multi_ring"))
        c = 8 * n / (l * p)
        step = max(topology.intra.time((l - 1) * c), (l if nic == "shared" else 1) * topology.inter.time(c))
        if n % (l * p) == 0:
            assert world.makespan == pytest.approx(2 * (p - 1) * step, rel=1e-12)
            assert world.makespan == pytest.approx(costmodel.two_tier_time("multi_ring", 8 * n, topology), rel=1e-12)
        for rank in range(p):
            sends = [i for i in world.timeline if i.rank == rank and i.kind == "send"]
            across = [i for i in sends if i.link == "inter"]
            assert len(across) == len(sends) - len(across) == 2 * (p - 1), (num_nodes, l, rank)
            assert {i.peer for i in across} == {((rank // l + 1) % num_nodes) * l + (rank + 1) % l}
            assert {i.peer for i in sends if i.link == "intra"} == {rank // l * l + (rank + 1) % l}
            if n % (l * p) == 0:  # each card: 2(P-1)/P n/l bytes
                assert sum(i.nbytes for i in across) == 2 * (p - 1) * c


def test_multi_ring_cuts_each_card_as_hierarchy_does_and_pays_the_ring_latencies():
    """Bytes only (free NVLink): each card carries 2(P-1)/P n/l, against the flat ring's
    2(P-1)/P n and the torus's 2(N-1)/N n/l: l times less than the ring, ((P-1)/P)/((N-1)/N)
    more than hierarchy (1.25 on 4 nodes of 4). Alphas only: 2(P-1) network latencies, as the
    flat ring, against the torus's 2(N-1)."""
    free = (0.0, float("inf"))
    n_nodes, l, beta = 4, 4, 1e-9
    p, n = n_nodes * l, 8 * 64 * 16

    def makespan(algorithm, inter):
        world = sim.World(p, topology=topo(n_nodes, l, "per_rank", intra=free, inter=inter))
        world.run(lambda comm: collectives.all_reduce(comm, np.ones(n // 8), algorithm=algorithm))
        return world.makespan

    bytes_only, alpha_only = (0.0, 1 / beta), (1e-5, float("inf"))
    rings = makespan("multi_ring", bytes_only)
    assert rings == pytest.approx(2 * (p - 1) / p * n / l * beta)
    assert makespan("ring", bytes_only) / rings == pytest.approx(l)
    assert rings / makespan("torus", bytes_only) == pytest.approx(((p - 1) / p) / ((n_nodes - 1) / n_nodes))
    assert makespan("multi_ring", alpha_only) == pytest.approx(2 * (p - 1) * 1e-5)
    assert makespan("torus", alpha_only) == pytest.approx(2 * (n_nodes - 1) * 1e-5)


# -- values -----------------------------------------------------------------------------------


UFUNCS = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}
CASES_N = [(n, op, dtype) for n in (0, 1, 7, 1001) for op in UFUNCS for dtype in ("int64", "float64")]


def _every_case(comm, algorithm, fake):
    """Every (n, op, dtype) of CASES_N: (this rank's input, the all-reduce's result)."""
    if fake:
        set_ranks_per_node(comm, fake)
    out = []
    for n, op, dtype in CASES_N:
        rng = np.random.default_rng(comm.Get_rank() + 10 * n)
        x = rng.integers(-3, 4, n).astype(dtype) if op != "prod" else rng.choice([-1, 1, 2], n).astype(dtype)
        out.append((x, collectives.all_reduce(comm, x, op=op, algorithm=algorithm)))
    return out


@pytest.mark.parametrize("algorithm", costmodel.TOPOLOGY_ALL_REDUCE_ALGORITHMS)
def test_topology_algorithms_equal_numpy_for_every_op_size_and_layout(algorithm):
    layouts = [(topo(2, 3), None, 6), (topo(3, 1, "shared"), None, 3), (None, 2, 6), (None, 3, 6), (None, 1, 5),
               (None, 5, 5)]
    for topology, fake, p in layouts:
        results = sim.World(p, topology=topology).run(_every_case, algorithm, fake)
        for k, (n, op, dtype) in enumerate(CASES_N):
            expected = UFUNCS[op].reduce(np.stack([rank[k][0] for rank in results]), axis=0)
            for rank in results:  # small integers in floats: every order of additions is exact
                y = rank[k][1]
                assert y.dtype == np.dtype(dtype) and np.array_equal(y, expected), (topology, fake, n, op, dtype)


def test_node_layouts_and_their_errors():
    def layout(comm, fake):
        if fake is not None:
            set_ranks_per_node(comm, fake)
        found = node_layout(comm)
        return found.nodes, found.source, found.node_ranks, found.cross_ranks

    got = sim.World(6, topology=sim.Topology([0, 1, 0, 1, 0, 1], INTRA, INTER)).run(layout, None)
    assert got[2] == ((0, 1, 0, 1, 0, 1), "topology", (0, 2, 4), (2, 3))
    assert sim.run(layout, 4, None)[3] == ((0, 0, 0, 0), "one node", (0, 1, 2, 3), (3,))
    assert sim.run(layout, 4, 2)[1][1] == "setting"
    with pytest.raises(CollectiveError, match="6 ranks do not split into fake nodes of 4"):
        sim.run(layout, 6, 4)
    with pytest.raises(CollectiveError, match=r"different numbers of ranks \(\[3, 1\]"):
        sim.World(4, topology=sim.Topology([0, 0, 0, 1], INTRA, INTER)).run(
            lambda comm: collectives.all_reduce(comm, np.ones(3), algorithm="torus"))
    with pytest.raises(ValueError, match="positive integer"):
        sim.run(lambda comm: set_ranks_per_node(comm, 0), 1)


def test_async_and_auto_with_a_topology():
    topology = topo(2, 4, "shared")

    def program(comm):
        x = np.arange(100.0) * (comm.Get_rank() + 1)
        works = [async_collectives.all_reduce(comm, x, algorithm=a, async_op=True) for a in ("hierarchical", "torus")]
        return [w.wait() for w in works], collectives.all_reduce(comm, x, algorithm="hierarchical")

    for (async_results, blocking) in sim.World(8, topology=topology).run(program):
        assert all(np.array_equal(a, blocking) for a in async_results)
        assert np.array_equal(blocking, np.arange(100.0) * 36)
    for nbytes in (8, 8 << 20):
        chosen = costmodel.choose_all_reduce_on(nbytes, topology)
        times = costmodel.two_tier_times(nbytes, topology)
        assert set(times) == set(costmodel.TWO_TIER_ALGORITHMS)
        assert times[chosen] == min(times[a] for a in costmodel.AUTO_TWO_TIER_ALGORITHMS)
        world = sim.World(8, topology=topology)
        world.run(lambda comm, n=nbytes // 8: collectives.all_reduce(comm, np.ones(n)))
        assert world.makespan == pytest.approx(times[chosen], rel=1e-12), (nbytes, chosen)
    assert costmodel.choose_all_reduce_on(8, topology) == "tree"
    assert costmodel.choose_all_reduce_on(8 << 20, topology) == "hierarchical"


# -- the delay layer, and the cost model's tables --------------------------------------------


def test_the_delay_layer_slows_cross_node_messages_only():
    def program(comm):
        slow = DelayComm(comm, ranks_per_node=2, inter=(0.03, 1e6))
        x = np.zeros(4000, np.uint8)  # eager (below the sim's 4096 B), + 4 ms on the network
        seconds, delayed = [], []
        if comm.Get_rank() == 0:
            for dest in (1, 2):
                start = time.perf_counter()
                slow.Send(x, dest)
                seconds.append(time.perf_counter() - start)
                delayed.append(slow.delayed_seconds)
        elif comm.Get_rank() in (1, 2):
            slow.Recv(x, 0)
        column = slow.Split(comm.Get_rank() % 2, comm.Get_rank())
        y = collectives.all_reduce(slow, np.arange(5.0) * comm.Get_rank(), algorithm="hierarchical")
        return seconds, delayed, slow.delayed_messages, column.cluster_topology.link(0, 1).name, y

    results = sim.run(program, 4)
    (intra, inter), delayed, messages, link, y = results[0]
    assert delayed == [0.0, pytest.approx(0.034)] and messages == 1  # the all-reduce's sub-communicators count theirs
    assert intra < inter and 0.034 <= inter < 2.0
    assert link == "inter" and np.array_equal(y, np.arange(5.0) * 6)
    with pytest.raises(ValueError, match="positive divisor of the 3 ranks"):
        sim.run(lambda comm: DelayComm(comm, ranks_per_node=2), 3)


def test_two_tier_terms_and_the_what_if_table():
    t = topo(4, 8, "shared")
    n = 1 << 20
    assert costmodel.two_tier_terms("torus", n, t) == {"intra": (14, 14 / 8 * n), "inter": (48, 6 / 4 * n)}
    assert costmodel.two_tier_terms("ring", n, t) == {"intra": (0, 0), "inter": (62, 62 / 32 * n)}
    assert costmodel.two_tier_terms("tree", n, t) == {"intra": (6, 6 * n), "inter": (4, 4 * n)}
    # 8 crossings of a 4 KiB chunk take turns on the shared card: 8 (10 us + 4.1 us) a step
    assert costmodel.two_tier_terms("multi_ring", n, t) == {"intra": (0, 0), "inter": (62 * 8, 62 * 8 * n / 256)}
    assert costmodel.two_tier_terms("multi_ring", n, topo(4, 8)) == {"intra": (0, 0), "inter": (62, 62 * n / 256)}
    assert costmodel.two_tier_terms("multi_ring", n, topo(4, 8, intra=(1e-6, 1e8))) == \
        {"intra": (62, 62 * 7 * n / 256), "inter": (0, 0)}  # NVLink slower than the card: it sets the steps
    rows = costmodel.what_if_topology()
    assert len(rows) == 2 * 2 * 2 * 3 * 3
    row = next(r for r in rows if (r["gpu"], r["network"], r["nic"], r["nodes"], r["nbytes"])
               == ("H100 NVLink4", "400 Gb/s", "per_rank", 8, 1 << 30))
    assert row["best"] == "multi_ring"  # NCCL's rings: NVLink and the cards at once, 2 MiB chunks
    assert row["multi_ring"] == pytest.approx(2 * 63 * (9.6e-6 + (1 << 30) / 8 / 64 / 50e9))
    assert row["hierarchical"] == pytest.approx(2 * 7 * (3.4e-6 + (1 << 30) / 8 / 450e9)
                                                + 2 * 7 * (9.6e-6 + (1 << 30) / 64 / 50e9))
    assert costmodel.choose_cross_all_reduce(64, 8, sim.LinkClass("inter", 1e-5, 1e9)) == "recursive_doubling"
    assert costmodel.choose_cross_all_reduce(64 << 20, 8, sim.LinkClass("inter", 1e-5, 1e9)) == "ring"
    with pytest.raises(ValueError, match="same number of ranks on every node"):
        costmodel.two_tier_terms("hierarchical", n, sim.Topology([0, 0, 1], INTRA, INTER))
    with pytest.raises(ValueError, match="unknown algorithm 'naive'"):
        costmodel.two_tier_terms("naive", n, t)


def test_a_rank_polling_test_does_not_stall_virtual_time():
    """Rank 2 spins on Test while ranks 0 and 1 wait for their messages through a shared card
    to be timed: the sim times them (the poller counts as waiting), in ready order."""
    def program(comm):
        rank, x = comm.Get_rank(), np.zeros(1000, np.uint8)
        if rank in (0, 1):
            comm.Send(x, 2 + rank)
        elif rank == 2:
            request = comm.Irecv(x, 0)
            while not request.Test():
                pass
        else:
            comm.Recv(x, 1)

    world = sim.World(4, topology=topo(2, 2, "shared"))
    start = time.perf_counter()
    world.run(program)
    assert time.perf_counter() - start < 5
    assert world.clocks == pytest.approx([11e-6, 22e-6, 11e-6, 22e-6])
