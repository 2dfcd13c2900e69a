"""``train --strategy fsdp --sharding-strategy HYBRID_SHARD`` (issue 35, item 6): FULL_SHARD inside
each node, the nodes replicas of each other (torch's name; hybrid sharding in Zhao et al. 2023). On the
simulator's two-tier topology in float64 against one process on the global batch; the bytes that
cross between the nodes, counted and in the sim's trace, against FULL_SHARD's over all ranks;
checkpoints; the usage errors; one job of 4 ranks in fake nodes under real mpiexec."""
import dataclasses
from pathlib import Path

import pytest
import test_gpt_train
from mpitools import JOB_ENV, mpiexec_or_skip
from scenarios import assert_same_weights, on_sim, stop_and_resume
from test_gpt_train import TINY, max_difference, weights

from minidist import launch, sim, strategy, train
from minidist.parallel.fsdp.train import check_fsdp, train_fsdp

text, float64 = test_gpt_train.text, test_gpt_train.float64  # the GPT tests' fixtures: the small text, float64
GLOBAL_BATCH = 12
INTRA, INTER = (1e-6, 1e11), (5e-6, 1e10)


def hybrid(ranks: int, **change) -> train.TrainConfig:
    """TINY (4 blocks, clipping at 0.5) under HYBRID_SHARD, each of ``ranks`` reading its part of
    the global batch of 12 (the lr not scaled: the global batch is one process's)."""
    config = train.TrainConfig(**{**TINY, "batch_size": GLOBAL_BATCH // ranks}, strategy="fsdp",
                               sharding_strategy="HYBRID_SHARD", scale_lr=False)
    return dataclasses.replace(config, **change)


def on_nodes(nodes: int, per_node: int, config, data):
    """The run of ``config`` on a sim world of ``nodes`` x ``per_node`` ranks with a two-tier
    topology; (rank 0's result, the world: its trace)."""
    world = sim.World(nodes * per_node, topology=sim.Topology.nodes(nodes, per_node, intra=INTRA, inter=INTER))
    return world.run(lambda comm: train_fsdp(comm, config, data))[0], world


def cross_node_bytes(world, per_node: int) -> int:
    """Bytes of the trace's messages between ranks of different nodes (consecutive ranks share one)."""
    return sum(m.nbytes for m in world.trace if m.source // per_node != m.dest // per_node)


@pytest.mark.parametrize("nodes,per_node", [(2, 2), (3, 2), (2, 3)])
def test_hybrid_shard_equals_one_process(text, float64, nodes, per_node):
    """The weights, the evaluations and the reported layout of HYBRID_SHARD on N nodes of l equal
    one process's on the global batch of 12 to 1e-10 (clipping on: the norm sums one node's
    shards only, the replicas hold the same)."""
    single = train.train_single(dataclasses.replace(hybrid(1), strategy="single", batch_size=GLOBAL_BATCH), text)
    result, _ = on_nodes(nodes, per_node, hybrid(nodes * per_node), text)
    assert max_difference(weights(single.model), weights(result.model)) < 1e-10
    for a, b in zip(single.history, result.history, strict=True):
        assert abs(a["val_loss"] - b["val_loss"]) < 1e-10 and abs(a["train_loss"] - b["train_loss"]) < 1e-10
    assert result.figures["sharding_strategy"] == "HYBRID_SHARD" and result.figures["ranks"] == nodes * per_node


def test_bytes_across_the_nodes_are_a_shards_all_reduce_and_fewer_than_full_shards(text, float64):
    """Per rank and step HYBRID_SHARD sends 2 (N - 1) / N of a node's shard (Ψ / l) across the
    nodes (to a few float64 numbers: uneven chunks), and the sim's trace sees the same crossing
    bytes; FULL_SHARD over all 6 ranks of 3 nodes of 2 sends more than twice as many across (its
    rings cross between nodes at every step)."""
    nodes, per_node = 3, 2
    result, world = on_nodes(nodes, per_node, hybrid(6), text)
    shard = result.figures["parameter_bytes"]  # Ψ / l: the node's shard of the padded vectors
    steps = TINY["steps"]
    cross = [int(b) for b in result.figures["cross_bytes_per_step"].split(",")]
    # each column (a local rank's N replicas) ring-all-reduces the shard: 2 (N - 1) chunks a rank, the chunks
    # of uneven units off by one number between ranks; over a column exactly 2 (N - 1) shards
    assert sum(cross) == per_node * 2 * (nodes - 1) * shard
    assert all(abs(c - 2 * (nodes - 1) / nodes * shard) <= 8 * 2 * (nodes - 1) * 5 for c in cross)  # 5 units
    node = [int(b) for b in result.figures["node_bytes_per_step"].split(",")]
    assert all(n >= 3 * (per_node - 1) / per_node * shard * per_node for n in node)  # 3 (l-1)/l Ψ, plus the clip
    evaluation = cross_node_bytes(world, per_node) - sum(cross) * steps  # what crossed outside the steps
    assert 0 <= evaluation < sum(cross)  # start-up broadcast and evaluations: small against the training
    full, full_world = on_nodes(nodes, per_node, hybrid(6, sharding_strategy="FULL_SHARD"), text)
    assert cross_node_bytes(full_world, per_node) > 2 * cross_node_bytes(world, per_node)
    assert max_difference(weights(full.model), weights(result.model)) < 1e-10


def test_a_stopped_hybrid_run_resumes_bit_identical_and_only_on_its_layout(text, float64, tmp_path):
    config = hybrid(4, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    world = sim.World(4, topology=sim.Topology.nodes(2, 2, intra=INTRA, inter=INTER))
    assert_same_weights(*stop_and_resume(on_sim(train_fsdp, text, world=world), config, stop_after=3))
    assert not strategy.is_elastic(dataclasses.replace(config, global_batch_size=GLOBAL_BATCH))


def test_usage_errors():
    with pytest.raises(ValueError, match="HYBRID_SHARD shards within each node .* with --tp 2 use FULL_SHARD"):
        check_fsdp(4, hybrid(4, tp=2))
    assert "HYBRID_SHARD" in strategy.get("fsdp").flags[0].options["choices"]


def test_hybrid_shard_in_fake_nodes_under_mpiexec():
    """tests/mpi/hsdp.py on 4 real ranks in fake nodes of 2 (MINIDIST_RANKS_PER_NODE=2): the
    weights equal one process's to 1e-10, the crossing bytes per rank one node's shard."""
    mpiexec_or_skip()
    script = Path(__file__).parent / "mpi" / "hsdp.py"
    result = launch.launch(script, 4, timeout=300, env={**JOB_ENV, "MINIDIST_RANKS_PER_NODE": "2"})
    assert result.ok and "HSDP OK" in result.stdout, result.stdout + result.stderr[-3000:]
