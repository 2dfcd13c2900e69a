"""minidist.course.checks.topology (exercise 17): the solution's hierarchical all-reduce passes
on 2 x 2, 2 x 3 and 4 x 2 simulated ranks in exactly the closed form's virtual time; versions
wrong in each way the check looks for fail, each with its own hint (a flat ring, a gather to
one root, recursive doubling over every rank, the whole vector across the nodes, the
sub-communicators swapped, an all-reduce inside the node, a ring across two nodes, the
cross-node step, the all-gather or the padding forgotten, a 2-D result, x changed); the
engine's hierarchical and torus all-reduces are refused, also when "auto" picks them; a stub
says it is one; a sum that never went through the communicator (the checks' reference, the
vectors drawn again, memory the simulated ranks share) fails. The closed form the check holds
the learner to is checked by hand. The puzzle (issue 35): on one network card per node the
solution (one crossing rank per node with the node's sum) beats 0.9 of the engine's fastest, in
the time worked out by hand; the three phases, NCCL's rings, a flat ring and the crossing ranks'
sums through one root miss the target, each with its hint; the engine and sums that skip the messages fail."""
import threading

import numpy as np
import pytest

from minidist import collectives, sim
from minidist.collectives import all_gather, all_reduce, broadcast, gather, reduce, reduce_scatter
from minidist.course.checks import STUB_HINT, LearnerError
from minidist.course.checks import topology as topology_checks

OWN = "own implementation, not yours"


def hierarchical(mistake=None):
    """The exercise's function, the solution's or with one mistake."""

    def hierarchical_all_reduce(comm, x, ranks_per_node):
        rank, l = comm.Get_rank(), ranks_per_node
        if mistake in ("ring", "recursive_doubling", "hierarchical", "torus", "auto"):
            return all_reduce(comm, x, algorithm=mistake)
        if mistake == "root":
            everything = gather(comm, x)
            return broadcast(comm, everything.sum(axis=0) if rank == 0 else np.zeros_like(x))
        node_comm, cross_comm = comm.Split(rank // l, rank), comm.Split(rank % l, rank // l)
        if mistake == "swapped":
            node_comm, cross_comm, l = cross_comm, node_comm, comm.Get_size() // l
        if mistake == "whole":
            return all_reduce(cross_comm, all_reduce(node_comm, x))
        n = x.size
        s = -(-n // l)
        if mistake == "padding":
            chunk = all_reduce(cross_comm, reduce_scatter(node_comm, x))
            return all_gather(node_comm, chunk).reshape(-1)
        if mistake == "in_place":
            x[:] = 0.0
        padded = np.concatenate([x, np.zeros(l * s - n)])
        if mistake == "inside":
            local = node_comm.Get_rank()
            chunk = all_reduce(node_comm, padded)[local * s:(local + 1) * s]
        else:
            chunk = reduce_scatter(node_comm, padded)
        if mistake == "cross_ring":
            chunk = all_reduce(cross_comm, chunk, algorithm="ring")
        elif mistake != "no_cross":
            chunk = all_reduce(cross_comm, chunk)
        if mistake == "no_gather":
            return chunk
        gathered = all_gather(node_comm, chunk)
        return gathered if mistake == "two_d" else gathered.reshape(-1)[:n]

    return hierarchical_all_reduce


def test_the_solution_passes_in_the_closed_forms_time():
    verdict = topology_checks.check_hierarchical_all_reduce(hierarchical())
    lines = verdict.splitlines()
    assert lines[0] == "hierarchical_all_reduce: ok" and len(lines) == 4
    for (nodes, l), line in zip(topology_checks.LAYOUTS, lines[1:]):
        limit = topology_checks.bound(nodes, l) * 1e6
        assert line.startswith(f"{nodes} nodes x {l} ranks: sums equal for n = 13, 1001, 7, 1, 0; "
                               f"n = 24,000 in {limit:.2f} us <= {limit:.2f} us"), line


def test_the_bound_is_the_three_phases_by_hand():
    (a_intra, b_intra), (a_inter, b_inter) = topology_checks.INTRA, topology_checks.INTER
    n = 8 * topology_checks.TIMED_NUMEL
    # 2 x 2: a reduce-scatter and an all-gather of one step each in the node, and one
    # exchange of the half across (recursive doubling on 2 nodes beats the ring's two steps)
    assert topology_checks.bound(2, 2) == pytest.approx(2 * (a_intra + n / 2 / b_intra) + a_inter + n / 2 / b_inter,
                                                        rel=1e-12)
    # 4 x 2: the half all-reduced over 4 nodes by recursive doubling, 2 exchanges (the ring's
    # 6 steps of an eighth would take 41.5 us against 25.4)
    inside = 2 * (a_intra + n / 2 / b_intra)
    assert topology_checks.bound(4, 2) == pytest.approx(inside + 2 * (a_inter + n / 2 / b_inter), rel=1e-12)
    assert inside + 6 * (a_inter + n / 8 / b_inter) > topology_checks.bound(4, 2) + 15e-6


def test_the_engine_hierarchical_all_reduce_takes_the_same_time():
    """The bound is reachable: the engine's own algorithm meets it on the check's cluster."""
    topo = topology_checks.topology(2, 3)
    world = sim.World(6, topology=topo)
    world.run(lambda comm: collectives.all_reduce(comm, topology_checks.vector(comm.Get_rank(), 24_000),
                                                  algorithm="hierarchical"))
    assert world.makespan == pytest.approx(topology_checks.bound(2, 3), rel=1e-12)
    intra, inter, messages = topology_checks.sent_by_link(world, 6)
    assert intra == [2 * 2 * 8 * 8_000] * 6 and inter == [8 * 8_000] * 6 and messages == [1] * 6


@pytest.mark.parametrize("mistake, hint", [
    ("ring", "some ranks sent nothing over the network"),
    ("root", "some ranks sent nothing over the network"),
    ("recursive_doubling", "only 1/l of the vector should leave a rank"),
    ("whole", "only 1/l of the vector should leave a rank"),
    ("swapped", "only 1/l of the vector should leave a rank"),
    ("inside", "inside the node a reduce-scatter is enough"),
    ("cross_ring", "let all_reduce(cross_comm, chunk) choose"),
    ("no_cross", "sums over this rank's node only"),
    ("no_gather", "finish with the all-gather inside the node"),
    ("two_d", "return a flat vector of n numbers"),
    ("padding", "pad x with zeros"),
    ("in_place", "do not change x"),
])
def test_each_mistake_gets_its_hint(mistake, hint):
    with pytest.raises((AssertionError, LearnerError)) as caught:
        topology_checks.check_hierarchical_all_reduce(hierarchical(mistake))
    assert hint in str(caught.value), str(caught.value)


@pytest.mark.parametrize("algorithm", ["hierarchical", "torus", "auto"])
def test_the_engine_is_refused_and_a_stub_says_so(algorithm):
    with pytest.raises(LearnerError) as caught:
        topology_checks.check_hierarchical_all_reduce(hierarchical(algorithm))
    assert OWN in str(caught.value) and "engine's hierarchical all-reduce" in str(caught.value)

    def stub(comm, x, ranks_per_node):
        raise NotImplementedError()

    with pytest.raises(LearnerError) as caught:
        topology_checks.check_hierarchical_all_reduce(stub)
    assert STUB_HINT in str(caught.value)


def test_the_engine_as_the_answer_is_refused():
    with pytest.raises(AssertionError) as caught:
        topology_checks.check_hierarchical_all_reduce(collectives.all_reduce)
    assert OWN in str(caught.value)


def answer_from_the_checks(comm, x, ranks_per_node):
    """The sum without a message: the checks' own reference for this size."""
    return topology_checks.reference(comm.Get_size(), x.size)


def answer_redrawn(comm, x, ranks_per_node):
    """The sum without a message: every rank's vector drawn again from the checks' seeds."""
    return np.sum([np.random.default_rng(1000 * x.size + r).standard_normal(x.size) for r in range(comm.Get_size())],
                  axis=0).reshape(x.size)


def answer_through_shared_memory():
    """The sum without a message: the simulated ranks are threads, and add through a shared dict."""
    shared, lock = {}, threading.Lock()

    def hierarchical_all_reduce(comm, x, ranks_per_node):
        p = comm.Get_size()
        with lock:
            barrier, vectors = shared.setdefault((p, x.size), (threading.Barrier(p), {}))
            vectors[comm.Get_rank()] = x.copy()
        barrier.wait()
        total = np.sum([vectors[r] for r in range(p)], axis=0).reshape(x.size)
        if barrier.wait() == 0:
            shared.pop((p, x.size))
        return total

    return hierarchical_all_reduce


@pytest.mark.parametrize("answer, caught", [
    (answer_from_the_checks, "differs from the sum"),
    (answer_redrawn, "differs from the sum"),
    (answer_through_shared_memory(), "fewer than its own vector's 192,000"),
])
def test_a_sum_not_sent_through_comm_fails(answer, caught):
    """Each passed before the inputs were drawn afresh at every call and every rank had to send at
    least its own vector's bytes (all three in 0 us of virtual time)."""
    with pytest.raises(AssertionError) as failure:
        topology_checks.check_hierarchical_all_reduce(answer)
    assert caught in str(failure.value), str(failure.value)
    if "fewer" in caught:
        assert "not from memory the simulated ranks share" in str(failure.value)


# -- the puzzle: one network card per node (issue 35 item 3) ----------------------------------


def shared_card(mistake=None):
    """The puzzle's function: one crossing rank per node with the node's sum (the solution), or a
    usual wrong turn: the exercise's three phases, a flat ring, NCCL's rings, an all-reduce inside
    the node (as fast as the reduce on these nodes: it passes), the crossing ranks' all-reduce
    through one root (the naive all-reduce)."""

    def shared_card_all_reduce(comm, x, ranks_per_node):
        rank, l = comm.Get_rank(), ranks_per_node
        if mistake == "three_phases":
            return hierarchical()(comm, x, l)
        if mistake in ("ring", "multi_ring"):
            return all_reduce(comm, x, algorithm=mistake)
        node_comm, crossing_comm = comm.Split(rank // l, rank), comm.Split(rank % l, rank // l)
        total = all_reduce(node_comm, x) if mistake == "inside" else reduce(node_comm, x)
        if rank % l == 0:
            total = all_reduce(crossing_comm, total, algorithm="naive" if mistake == "root" else "auto")
        else:
            total = np.empty_like(x)
        return broadcast(node_comm, total)

    return shared_card_all_reduce


def test_the_puzzles_solution_beats_the_target_and_its_time_is_one_crossing_per_node():
    verdict = topology_checks.check_shared_card_all_reduce(shared_card())
    lines = verdict.splitlines()
    assert lines[0] == "shared_card_all_reduce: ok" and len(lines) == 3
    (a_intra, b_intra), (a_inter, b_inter) = topology_checks.INTRA, topology_checks.INTER
    n = 8 * topology_checks.TIMED_NUMEL
    for (nodes, l), line in zip(topology_checks.SHARED_LAYOUTS, lines[1:]):
        # a binomial reduce and broadcast inside (lg l steps of the whole vector each) and recursive
        # doubling of the whole vector over the N crossing ranks (lg N exchanges on the one card)
        lg_l, lg_n = l.bit_length() - 1, nodes.bit_length() - 1
        by_hand = 2 * lg_l * (a_intra + n / b_intra) + lg_n * (a_inter + n / b_inter)
        limit, best, best_time = topology_checks.target(nodes, l)
        assert best == "hierarchical" and limit == pytest.approx(0.9 * best_time)
        assert by_hand < limit and f"n = 24,000 in {by_hand * 1e6:.2f} us <= {limit * 1e6:.2f} us" in line, line
        assert line.startswith(f"{nodes} nodes x {l} ranks, one card per node: sums equal")


@pytest.mark.parametrize("mistake, hint", [
    ("three_phases", "the crossings of a node's ranks take turns"),
    ("multi_ring", "the crossings of a node's ranks take turns"),
    ("ring", "in every step of a ring over all P ranks"),
    ("root", "let all_reduce"),
])
def test_each_wrong_turn_of_the_puzzle_gets_its_hint(mistake, hint):
    with pytest.raises((AssertionError, LearnerError)) as caught:
        topology_checks.check_shared_card_all_reduce(shared_card(mistake))
    text = str(caught.value)
    if mistake == "multi_ring":  # the engine's rings need the node layout: refused as the engine's own
        assert OWN in text
    else:
        assert hint in text and "more than the target" in text, text


def test_an_all_reduce_inside_the_node_is_no_wrong_turn_here():
    """Recursive doubling inside a node of 4 takes what the binomial reduce does: it passes."""
    assert topology_checks.check_shared_card_all_reduce(shared_card("inside")).startswith("shared_card_all_reduce: ok")


def test_the_puzzle_refuses_the_engine_and_a_sum_through_shared_memory():
    for answer in (lambda comm, x, l: all_reduce(comm, x, algorithm="hierarchical"), collectives.all_reduce):
        with pytest.raises(AssertionError) as caught:
            topology_checks.check_shared_card_all_reduce(answer)
        assert OWN in str(caught.value)
    with pytest.raises(AssertionError) as caught:
        topology_checks.check_shared_card_all_reduce(answer_through_shared_memory())
    assert "fewer than its own vector's 192,000" in str(caught.value)
    with pytest.raises(AssertionError) as caught:
        topology_checks.check_shared_card_all_reduce(answer_from_the_checks)
    assert "differs from the sum" in str(caught.value) and "sum inside the node" in str(caught.value)
