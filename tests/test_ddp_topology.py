"""DDP over the topology-aware all-reduces, and the shared network card in hierarchical's cross-node
choice (issue 23's leftovers). On the sim with a ``sim.Topology``: every algorithm's DDP run
against one process on the global batch, the bytes per link class against ``costmodel``, several
buckets in flight at once; ``choose_cross_all_reduce`` against virtual-time makespans; under
``mpiexec -n 4`` in fake nodes of 2, ``train --all-reduce hierarchical`` against ``ring``."""
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mpitools import mpirun_minidist, saved_weights
from scenarios import assert_usage_error

from minidist import cli, collectives, costmodel, data, fault, nn, optim, sim, train
from minidist.async_collectives import ASYNC_TAG_BASE
from minidist.functions import cross_entropy
from minidist.node_layout import node_layout
from minidist.p2p import CollectiveError
from minidist.parallel.data_parallel.ddp import DDP_ALGORITHMS, DistributedDataParallel
from minidist.parallel.data_parallel.train import train_ddp
from minidist.tensor import Tensor

sys.path.insert(0, str(Path(__file__).parent / "mpi"))
import ddp_cases as cases  # (the data-parallel cases: an MLP, its data, one process's run)

INTRA, INTER = (1e-6, 1e10), (1e-5, 1e9)  # 1 us and 10 GB/s in a node, 10 us and 1 GB/s between


def topo(num_nodes, ranks_per_node, nic="per_rank"):
    return sim.Topology.nodes(num_nodes, ranks_per_node, intra=INTRA, inter=INTER, nic=nic)


def sent_by_link(world, first_tag=ASYNC_TAG_BASE):
    """Per rank: (bytes sent inside its node, bytes sent across nodes), messages tagged >= first_tag
    only (DDP's bucket all-reduces, not the broadcast at construction)."""
    intra, inter = [0] * world.size, [0] * world.size
    for bar in world.timeline:
        if bar.kind == "send" and bar.tag >= first_tag:
            (intra if bar.link == "intra" else inter)[bar.rank] += bar.nbytes
    return intra, inter


# -- every algorithm: the values, and the counter ---------------------------------------------


@pytest.mark.parametrize("num_nodes", [2, 3])
def test_every_algorithm_equals_one_process_and_ddp_counts_every_message(num_nodes):
    """2 and 3 nodes of 2 ranks, 4 buckets (54, 160, 16, 192 float64), two steps. DDP's counter
    sees the messages hierarchical and torus send on the node and cross communicators too
    (they are Split from it): its bytes equal the sim's trace (before, it missed them)."""
    topology = topo(num_nodes, 2)
    p = topology.size
    reference = cases.reference_parameters(p, 4, 2)
    for algorithm in DDP_ALGORITHMS:
        world = sim.World(p, topology=topology)
        runs = world.run(lambda comm, a=algorithm: cases.ddp_parameters(comm, 4, 2, cases.SMALL_BUCKET_MB, a))
        for rank, run in enumerate(runs):
            assert cases.max_difference(run["final"], reference) < 1e-10, (algorithm, rank)
            stats, n = run["stats"], sum(run["buckets"])
            assert stats.bytes_sent + stats.broadcast_bytes == world.bytes_sent(rank), (algorithm, rank)
            assert stats.bytes_received + (rank != 0) * 8 * n == world.bytes_received(rank), (algorithm, rank)
            assert stats.messages_sent > 0 and stats.all_reduce_calls == 2 * len(run["buckets"])


def _odd_model(seed):
    return nn.mlp([5, 7, 3], rng=seed, dtype="float64")  # 35, 7, 21, 3 parameters: buckets of odd sizes


def _train_odd(comm, algorithm, overlap, world_size, steps=3, batch=4):
    """SGD with momentum on the odd model, rank r reading rows r*batch.. of each global batch of
    world_size * batch (comm None: one process on the whole global batch, the oracle). Returns
    the final parameters and the buckets' sizes (None for the oracle)."""
    rng = np.random.default_rng(5)
    X, y = rng.standard_normal((steps * world_size * batch, 5)), rng.integers(0, 3, steps * world_size * batch)
    rank = 0 if comm is None else comm.Get_rank()
    model = _odd_model(11 + 100 * rank)
    net = model if comm is None else DistributedDataParallel(model, comm, bucket_cap_mb=None, algorithm=algorithm,
                                                             overlap=overlap)
    opt = optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
    rows = world_size * batch if comm is None else batch
    for t in range(steps):
        start = t * world_size * batch + rank * rows
        opt.zero_grad()
        cross_entropy(net(Tensor(X[start:start + rows])), y[start:start + rows]).backward()
        opt.step()
    return [q.data.copy() for q in model.parameters()], None if comm is None else [b.numel for b in net.buckets]


@pytest.mark.parametrize("num_nodes", [2, 3])
def test_buckets_that_the_ranks_per_node_do_not_divide(num_nodes):
    """Buckets of 3, 21, 7 and 35 float64 (one per parameter): none splits evenly over the 2 ranks
    of a node, nor, on 3 nodes, over the column; overlapped and not, equal to one process."""
    topology = topo(num_nodes, 2)
    p = topology.size
    reference, _ = _train_odd(None, None, True, p)
    for algorithm in ("hierarchical", "torus"):
        for overlap in (True, False):
            for final, buckets in sim.World(p, topology=topology).run(_train_odd, algorithm, overlap, p):
                assert buckets == [3, 21, 7, 35]
                assert cases.max_difference(final, reference) < 1e-10, (algorithm, overlap)


# -- the bytes across nodes -------------------------------------------------------------------


class _Wide(nn.Module):
    """One Linear(143, 12), float64: one bucket of 1728 elements (13 824 B), a multiple of 12."""

    def __init__(self, seed):
        super().__init__()
        self.fc = nn.Linear(143, 12, rng=seed, dtype="float64")

    def forward(self, x):
        return self.fc(x)


def _one_step(comm, algorithm):
    ddp = DistributedDataParallel(_Wide(comm.Get_rank()), comm, algorithm=algorithm)
    rng = np.random.default_rng(comm.Get_rank())
    cross_entropy(ddp(Tensor(rng.standard_normal((3, 143)))), rng.integers(0, 12, 3)).backward()
    return ddp.buckets[0].nbytes


@pytest.mark.parametrize("num_nodes", [2, 3])
def test_bytes_across_nodes_are_the_cost_models_and_1_over_l_of_the_rings(num_nodes):
    """Per rank and step, the bytes each rank sends across nodes (the sim's link classes): the
    busiest rank's equal costmodel.two_tier_terms for hierarchical and for the ring; hierarchical
    sends 1/l of the ring's, up to the factor (N-1)/N against (P-1)/P (the ring's busiest rank is
    a node's last, which sends 2(P-1)/P n across; a hierarchical rank 2(N-1)/N n/l)."""
    topology, l = topo(num_nodes, 2), 2
    p = topology.size
    busiest = {}
    for algorithm in ("ring", "hierarchical"):
        world = sim.World(p, topology=topology)
        nbytes = world.run(_one_step, algorithm)[0]
        intra, inter = sent_by_link(world)
        predicted = costmodel.two_tier_terms(algorithm, nbytes, topology)
        busiest[algorithm] = max(inter)
        assert busiest[algorithm] == predicted["inter"][1], (algorithm, inter, predicted)
        if algorithm == "hierarchical":  # every rank the same: its column's ring, its node's ring
            assert inter == [predicted["inter"][1]] * p and intra == [predicted["intra"][1]] * p
        else:  # only the ranks whose successor is on the next node cross
            assert [r for r in range(p) if inter[r]] == [r for r in range(p) if r % l == l - 1]
    assert busiest["ring"] / busiest["hierarchical"] == pytest.approx(l * ((p - 1) / p) / ((num_nodes - 1) / num_nodes))


# -- several buckets in flight ----------------------------------------------------------------


class _Square(nn.Module):
    """Three bias-free Linear(6, 6), float64: three buckets of 36 elements each, so a message of
    one bucket would fit another's receive (a tag mix-up would not raise, it would sum wrong)."""

    def __init__(self, seed):
        super().__init__()
        self.layers = nn.Sequential(*[m for k in range(3) for m in (nn.Linear(6, 6, bias=False, rng=seed + k,
                                                                               dtype="float64"), nn.Tanh())])

    def forward(self, x):
        return self.layers(x)


def _late_rank_one(comm, algorithm, X, y):
    """One overlapped step; rank 1 starts 0.2 s late, so every other rank starts all its buckets
    before bucket 0 can finish (it needs rank 1's part)."""
    rank = comm.Get_rank()
    ddp = DistributedDataParallel(_Square(rank), comm, bucket_cap_mb=None, algorithm=algorithm, overlap=True)
    if rank == 1:
        time.sleep(0.2)
    cross_entropy(ddp(Tensor(X[2 * rank:2 * rank + 2])), y[2 * rank:2 * rank + 2]).backward()
    return [q.grad.copy() for q in ddp.parameters()], ddp.timeline.buckets


def test_several_buckets_in_flight_on_the_node_and_cross_communicators_do_not_mix():
    """Three equal buckets in flight at once (overlap=True) through hierarchical and torus: each
    bucket's messages carry its own tag on both sub-communicators (the queue's k-th Work), and
    every rank's gradients equal one process's on the global batch."""
    rng = np.random.default_rng(2)
    X, y = rng.standard_normal((8, 6)), rng.integers(0, 6, 8)
    model = _Square(0)
    cross_entropy(model(Tensor(X)), y).backward()
    expected = [q.grad for q in model.parameters()]
    for algorithm in ("hierarchical", "torus"):
        world = sim.World(4, topology=topo(2, 2))
        results = world.run(_late_rank_one, algorithm, X, y)
        for grads, _ in results:
            assert cases.max_difference(grads, expected) < 1e-14, algorithm
        buckets = results[0][1]
        assert len(buckets) == 3 and all(ready < buckets[0][3] for _, _, ready, _ in buckets)  # all in flight
        tags = [m.tag for m in world.trace if m.kind == "array" and m.tag >= ASYNC_TAG_BASE]
        assert sorted(set(tags)) == [ASYNC_TAG_BASE + k for k in range(3)]
        counts = {tag: tags.count(tag) for tag in set(tags)}
        assert len(set(counts.values())) == 1 and all(m.nbytes <= 36 * 8 for m in world.trace if m.tag in counts)


# -- the command line, the resume rule ---------------------------------------------------------


@pytest.mark.parametrize("args,message", [
    (["--strategy", "fsdp", "--all-reduce", "ring"], "--all-reduce applies to --strategy ddp only"),
    (["--strategy", "ddp", "--zero", "--all-reduce", "hierarchical"], "--all-reduce does not apply with --zero"),
    (["--strategy", "ddp", "--comm-hook", "int8", "--all-reduce", "torus"],
     "--all-reduce does not apply with --comm-hook int8: it chooses DDP's all-reduce, and the hook replaces it"),
    (["--strategy", "ddp", "--all-reduce", "butterfly"], "invalid choice: 'butterfly'"),
])
def test_all_reduce_flag_refusals(args, message, capsys, monkeypatch):
    assert_usage_error(args, message, capsys, monkeypatch)


def test_the_flag_reaches_the_config_and_a_resume_with_another_algorithm_is_noted():
    parser = cli.train_parser()
    config = cli.train_config(parser.parse_args(["--strategy", "ddp", "--comm-hook", "bf16", "--all-reduce", "torus"]))
    assert config == train.TrainConfig(strategy="ddp", comm_hook="bf16", all_reduce="torus")
    assert cli.train_config(parser.parse_args(["--strategy", "ddp"])).all_reduce == "auto"
    mine = {"strategy": "ddp", "world_size": 4, "all_reduce": "hierarchical"}
    lines = fault.compare_runs({**mine, "all_reduce": "ring"}, mine, "ckpt-10.npz")
    assert lines == ["resume: all_reduce 'ring' in the checkpoint, 'hierarchical' now: the gradients are summed in "
                     "another order, so the weights may differ from an uninterrupted run's in the last bits"]
    assert fault.compare_runs({"strategy": "ddp", "world_size": 4}, mine, "ckpt-10.npz") == []  # older checkpoints


# -- the shared card in the cross-node choice --------------------------------------------------


def _cross_makespan(topology, chunk_bytes, algorithm):
    """Virtual seconds of hierarchical's cross-node phase alone: every column all-reduces
    ``chunk_bytes`` across the nodes at once."""
    world = sim.World(topology.size, topology=topology)
    world.run(lambda comm: collectives.all_reduce(node_layout(comm).cross_comm, np.ones(chunk_bytes // 8),
                                                  algorithm=algorithm))
    return world.makespan


def test_a_shared_card_flips_the_cross_choice_on_three_nodes_and_the_choice_is_the_faster_measured():
    """3 nodes of 2, 8400 B chunks: with a card per rank the ring is faster (51.2 against 55.2 us),
    with one card per node recursive doubling (92 against 102.4 us: its fold rounds leave cards
    idle that the other column fills). cross_terms is the sim's makespan exactly, the choice
    follows it, and hierarchical now runs it (its makespan is the two-tier closed form, below
    the torus's, which keeps the ring)."""
    link, chunk = sim.LinkClass("inter", *INTER), 8400
    for nic, k, faster in (("per_rank", 1, "ring"), ("shared", 2, "recursive_doubling")):
        measured = {a: _cross_makespan(topo(3, 2, nic), chunk, a) for a in ("ring", "recursive_doubling")}
        for algorithm, seconds in measured.items():
            messages, sent = costmodel.cross_terms(algorithm, chunk, 3, k)
            assert seconds == pytest.approx(messages * link.alpha + sent / link.bandwidth, rel=1e-12), (nic, algorithm)
        assert min(measured, key=measured.get) == faster == costmodel.choose_cross_all_reduce(chunk, 3, link, k), nic
    assert costmodel.choose_cross_all_reduce(chunk, 3, link) == "ring"  # what it chose on a shared card before
    shared = topo(3, 2, "shared")
    makespans = {}
    for algorithm in ("hierarchical", "torus"):
        world = sim.World(6, topology=shared)
        world.run(lambda comm, a=algorithm: collectives.all_reduce(comm, np.ones(2 * chunk // 8), algorithm=a))
        makespans[algorithm] = world.makespan
        assert world.makespan == pytest.approx(costmodel.two_tier_time(algorithm, 2 * chunk, shared), rel=1e-12)
    assert makespans["hierarchical"] == pytest.approx(2 * (1e-6 + 8400 / 1e10) + 92e-6) and makespans["torus"] > 100e-6


def test_on_a_power_of_two_of_nodes_a_shared_card_multiplies_both_and_one_over_l_bandwidth_would_mislead():
    """4 nodes of 4, 32 000 B chunks: a shared card makes each cross exactly 4 times slower, so
    the choice stays recursive doubling, the faster measured. Charging the card as 1/l of the
    bandwidth with alpha unchanged would choose the ring."""
    link, chunk = sim.LinkClass("inter", *INTER), 32000
    per_rank = {a: _cross_makespan(topo(4, 4), chunk, a) for a in ("ring", "recursive_doubling")}
    shared = {a: _cross_makespan(topo(4, 4, "shared"), chunk, a) for a in ("ring", "recursive_doubling")}
    assert per_rank == pytest.approx({"ring": 108e-6, "recursive_doubling": 84e-6}, rel=1e-12)
    assert shared == pytest.approx({a: 4 * t for a, t in per_rank.items()}, rel=1e-12)
    assert costmodel.choose_cross_all_reduce(chunk, 4, link, 4) == "recursive_doubling"
    assert costmodel.choose_cross_all_reduce(chunk, 4, sim.LinkClass("inter", INTER[0], INTER[1] / 4)) == "ring"
    with pytest.raises(ValueError, match="ranks_per_nic must be an integer >= 1"):
        costmodel.cross_terms("ring", 8, 4, 0)
    with pytest.raises(ValueError, match="unknown cross-node algorithm 'tree'"):
        costmodel.cross_terms("tree", 8, 4)


# -- under mpiexec ----------------------------------------------------------------------------


DIGITS = data.load_digits(seed=0)


@pytest.mark.mpi
def test_train_hierarchical_under_mpiexec_in_fake_nodes_ends_where_the_ring_does(tmp_path, monkeypatch):
    """mpiexec -n 4, MINIDIST_RANKS_PER_NODE=2: train --all-reduce hierarchical runs (its first line
    and figures name it) and its final weights equal the ring's to float32 rounding. The ring's
    run is train_ddp on 4 sim ranks with the same flags (one launch less; its weights were bit for
    bit those of mpiexec -n 4 train --all-reduce ring when this test was written)."""
    monkeypatch.setenv("MINIDIST_RANKS_PER_NODE", "2")
    done = mpirun_minidist(4, "train", "--strategy", "ddp", "--all-reduce", "hierarchical", "--epochs", "2",
                           "--no-progress", "--save-model", tmp_path / "hierarchical.npz")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("ddp: 4 ranks") and lines[0].endswith(", all-reduce hierarchical"), lines[0]
    assert "all_reduce=hierarchical" in lines and int(dict(x.split("=", 1) for x in lines if "=" in x and
                                                           " " not in x)["bytes_communicated"]) > 0
    config = train.TrainConfig(strategy="ddp", epochs=2, all_reduce="ring", progress=False)
    ring = sim.run(lambda comm: train_ddp(comm, config, DIGITS), 4)[0]
    assert lines[-1] == f"final test_accuracy={ring.test_accuracy:.4f}"
    hierarchical = saved_weights(tmp_path / "hierarchical.npz")
    for name, weights in ring.model.state_dict().items():
        np.testing.assert_allclose(hierarchical[name], np.asarray(weights), rtol=1e-5, atol=1e-6, err_msg=name)


def test_nodes_of_different_sizes_are_refused_at_construction_on_every_rank():
    uneven = sim.Topology([0, 0, 0, 1], INTRA, INTER)
    with pytest.raises(CollectiveError, match=r"different numbers of ranks \(\[3, 1\]"):
        sim.World(4, topology=uneven).run(lambda comm: DistributedDataParallel(_odd_model(0), comm, algorithm="torus"))
    # auto does not need nodes there (two_tier_times leaves hierarchical and torus out): it trains
    assert len(sim.World(4, topology=uneven).run(lambda comm: DistributedDataParallel(_odd_model(0), comm).buckets))


# -- MINIDIST_RANKS_PER_NODE that cannot be nodes (issue 36, item 4) ------------------------------


@pytest.mark.parametrize("value,message", [
    ("3", "4 ranks do not split into fake nodes of 3 ranks (MINIDIST_RANKS_PER_NODE=3); set it to a divisor of 4 "
          "(1, 2 or 4), or unset it"),
    ("0", "MINIDIST_RANKS_PER_NODE='0' is not a positive integer"),
    ("-2", "MINIDIST_RANKS_PER_NODE='-2' is not a positive integer"),
    ("abc", "MINIDIST_RANKS_PER_NODE='abc' is not a positive integer"),
    ("2.0", "MINIDIST_RANKS_PER_NODE='2.0' is not a positive integer"),
    (str(10**20), "4 ranks do not split into fake nodes of 100000000000000000000 ranks"),
])
def test_a_ranks_per_node_that_cannot_be_nodes_is_one_line_naming_the_fix(value, message, monkeypatch):
    """Every rank raises the same one-line CollectiveError naming the value and the fix, and
    ``check_environment`` (for a command's start-up, before any rank waits) the same ValueError."""
    from minidist import node_layout as layout_module

    monkeypatch.setenv("MINIDIST_RANKS_PER_NODE", value)
    with pytest.raises(CollectiveError) as caught:
        sim.run(node_layout, 4)
    assert message in str(caught.value) and "\n" not in str(caught.value).split(" (on rank")[0]
    assert "divisor of 4" in str(caught.value) or "e.g. MINIDIST_RANKS_PER_NODE=2" in str(caught.value)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        layout_module.check_environment(4)
    monkeypatch.setenv("MINIDIST_RANKS_PER_NODE", "2")
    layout_module.check_environment(4)  # good: nothing


@pytest.mark.parametrize("values", [("2", "2", "4", "4"), ("2", "2", "1", "1"), ("2", "2", "", "")])
def test_a_ranks_per_node_set_differently_on_the_ranks_is_refused_naming_them(values, monkeypatch):
    """Ranks 0-1 with 2 and ranks 2-3 with 4 made one node of 4 ranks, silently; with 1, nodes of
    2, 1 and 1 ranks (a misleading message). Now every rank names the values and their ranks."""
    import threading

    from minidist import node_layout as layout_module

    local = threading.local()
    monkeypatch.setattr(layout_module, "_environment_value", lambda: local.value)

    def layout(comm):
        local.value = values[comm.Get_rank()]
        return node_layout(comm)

    with pytest.raises(CollectiveError, match="MINIDIST_RANKS_PER_NODE differs between the ranks: "):
        sim.run(layout, 4)
    with pytest.raises(CollectiveError) as caught:
        sim.run(layout, 4)
    shown = [f"'{v}'" if v else "unset" for v in (values[0], values[2])]
    assert f"{shown[0]} on ranks 0,1 and {shown[1]} on ranks 2,3" in str(caught.value)
    assert "set it to the same value on every rank" in str(caught.value)


@pytest.mark.parametrize("value", ["3", "0", "abc", "2.0"])
def test_a_bad_ranks_per_node_is_a_usage_error_of_train_under_mpiexec(value, monkeypatch):
    """Issue 36: MINIDIST_RANKS_PER_NODE that cannot cut 4 ranks into nodes ended train --all-reduce
    hierarchical in a traceback; now every rank checks it at start-up and rank 0 prints one usage
    line (exit 2)."""
    monkeypatch.setenv("MINIDIST_RANKS_PER_NODE", value)
    result = mpirun_minidist(4, "train", "--strategy", "ddp", "--all-reduce", "hierarchical", "--epochs", "1",
                             "--no-progress")
    assert result.returncode == 2 and "MINIDIST_RANKS_PER_NODE" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and result.stderr.count("error:") == 1
