"""``train --model gpt --strategy fsdp --tp T`` (issue 30): FSDP over the dp dimension of a (P / T, T)
mesh with tensor parallelism inside (``minidist.parallel.fsdp.compose``). On the simulator in
float64 against one process on the global batch (weights, evaluations and the clipping norm to
rounding), bytes per step against the closed forms, checkpoints, the usage errors of
``check_fsdp``, and one job of 4 ranks (dp 2 x tp 2) under real mpiexec."""
import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
import test_gpt_train
from mpitools import JOB_ENV, mpiexec_or_skip
from test_gpt_train import TINY, max_difference, record_dense_clip_norms, weights

from minidist import launch, sim, train, workloads
from minidist.checkpoint_io import CheckpointError, latest_valid_checkpoint
from minidist.fault import TrainingStopped
from minidist.parallel.fsdp import compose
from minidist.parallel.fsdp.fsdp import FullyShardedDataParallel
from minidist.parallel.fsdp.train import check_fsdp, train_fsdp

text, float64 = test_gpt_train.text, test_gpt_train.float64  # the GPT tests' fixtures: the small text, float64
GLOBAL_BATCH = 8


@pytest.fixture(scope="module")
def odd_text():
    """The small text with one character more: 61 tokens, which 2 tp ranks cut 31 + 30."""
    dataset = workloads.load_text(test_gpt_train.TEXT + "~")
    assert dataset.vocab_size % 2 == 1
    return dataset


def fsdp_tp(dp: int, tp: int, **change) -> train.TrainConfig:
    """TINY (4 blocks, 2 heads, clipping at 0.5) as ``--strategy fsdp --tp tp`` on dp x tp
    ranks: each replica reads 8 / dp windows, the lr not scaled (the global batch is one
    process's 8)."""
    config = train.TrainConfig(**TINY, strategy="fsdp", tp=tp, scale_lr=False)
    return dataclasses.replace(config, batch_size=GLOBAL_BATCH // dp, **change)


def assert_follows_single(single, result):
    assert max_difference(weights(single.model), weights(result.model)) < 1e-10
    assert len(single.history) == len(result.history) == 2
    for a, b in zip(single.history, result.history, strict=True):
        assert abs(a["val_loss"] - b["val_loss"]) < 1e-10 and abs(a["train_loss"] - b["train_loss"]) < 1e-10


@pytest.mark.parametrize("dp, tp, strategy, sequence_parallel", [
    (1, 2, "FULL_SHARD", False),
    (2, 2, "FULL_SHARD", False),
    (2, 2, "SHARD_GRAD_OP", False),
    (2, 2, "NO_SHARD", False),
    (2, 2, "FULL_SHARD", True),
    (2, 1, "FULL_SHARD", False),
])
def test_fsdp_with_tp_follows_the_single_process(text, float64, dp, tp, strategy, sequence_parallel):
    """Six AdamW steps (warm-up, cosine, clipping) on dp x tp ranks: one process's evaluations
    and weights on the global batch of 8, to rounding. Each tp group's ranks send alike; dp = 1
    sends nothing over dp, tp = 1 nothing over tp (and keeps --strategy fsdp's figures)."""
    single = train.train_single(train.TrainConfig(**TINY), text)
    config = fsdp_tp(dp, tp, sharding_strategy=strategy, sequence_parallel=sequence_parallel)
    results = sim.run(lambda comm: train_fsdp(comm, config, text), dp * tp)
    assert all(r is None for r in results[1:])
    assert_follows_single(single, results[0])
    figures = results[0].figures
    assert figures["ranks"] == dp * tp and figures["units"] == (7 if tp > 1 else 5)
    if tp == 1:
        assert "tp" not in figures and "dp_bytes_per_step" not in figures
        return
    assert (figures["dp"], figures["tp"]) == (dp, tp)
    assert figures["sequence_parallel"] == ("on" if sequence_parallel else "off")
    for group in ("dp", "tp"):
        sent = [int(b) for b in figures[f"{group}_bytes_per_step"].split(",")]
        assert len(set(sent)) == 1 and (sent[0] == 0) == (group == "dp" and dp == 1)


def test_an_uneven_layout_follows_the_single_process(odd_text, float64):
    """dp 3 x tp 2 on a global batch of 8 (replicas of 3, 3 and 2 windows), a vocabulary of 61
    cut 31 + 30 over tp, and 16 positions: the whole parameters (position embedding, last
    LayerNorm) must sum their gradients over dp in the same order on both tp ranks, or the tp
    ranks drift apart in the last bits and their dense weights no longer join."""
    sizes = dict(TINY, block_size=16)
    single = train.train_single(train.TrainConfig(**sizes, global_batch_size=GLOBAL_BATCH), odd_text)
    config = dataclasses.replace(train.TrainConfig(**sizes, strategy="fsdp", tp=2), global_batch_size=GLOBAL_BATCH)
    result = sim.run(lambda comm: train_fsdp(comm, config, odd_text), 6)[0]
    assert_follows_single(single, result)
    tp_sent = [int(b) for b in result.figures["tp_bytes_per_step"].split(",")]
    assert tp_sent[0] == tp_sent[2] > tp_sent[4]  # replica 2 reads 2 windows, not 3: fewer activations


def test_the_clipping_norm_is_the_dense_models_on_every_rank(text, float64, monkeypatch):
    """The norm each step clips by, on each of the 4 ranks of dp 2 x tp 2, is the same number
    to the last bit on every rank, and the dense model's norm of the same gradient (one process
    on the global batch) to rounding; and it clips (above the bound of 0.5)."""
    norms = {"fsdp": [], "single": record_dense_clip_norms(monkeypatch)}
    clip = FullyShardedDataParallel.clip_grad_norm_

    def recorded(self, *args, **kwargs):
        norms["fsdp"].append(clip(self, *args, **kwargs))
        return norms["fsdp"][-1]

    monkeypatch.setattr(FullyShardedDataParallel, "clip_grad_norm_", recorded)
    sim.run(lambda comm: train_fsdp(comm, fsdp_tp(2, 2), text), 4)
    train.train_single(train.TrainConfig(**TINY), text, report=False)
    steps = TINY["steps"]
    assert len(norms["single"]) == steps and len(norms["fsdp"]) == 4 * steps
    for step, expected in enumerate(norms["single"]):
        ranks = norms["fsdp"][4 * step:4 * (step + 1)]
        assert len(set(ranks)) == 1 and np.isclose(ranks[0], expected, rtol=1e-12, atol=0), step
    assert max(norms["single"]) > TINY["grad_clip"]


def test_the_bytes_per_step_are_the_closed_forms(text):
    """Float32, dp 2 x tp 2, 4 windows per replica. Over dp, the ring's (P - 1) / P of Ψ (each tp
    rank's padded units) per all-gather and reduce-scatter (3 for FULL_SHARD, 2 for
    SHARD_GRAD_OP) and the norm's two float64 numbers; over tp, Megatron's (1 + 2L) activations
    of B·T·C forward and as many backward, the vocabulary-parallel loss's 3 numbers per position
    and one more, and the norm's two numbers."""
    for strategy, gathers in (("FULL_SHARD", 3), ("SHARD_GRAD_OP", 2)):
        config = fsdp_tp(2, 2, sharding_strategy=strategy)
        figures = sim.run(lambda comm, config=config: train_fsdp(comm, config, text), 4)[0].figures
        psi = figures["optimizer_state_bytes"]  # AdamW's 2 moments of Ψ/2 on each of 2 replicas: Ψ
        b, t, c, layers = config.batch_size, config.block_size, config.n_embd, config.n_layer
        over_tp = 2 * (1 + 2 * layers) * b * t * c * 4 + (3 * b * t + 1) * 4 + 16
        assert figures["dp_bytes_per_step"] == ",".join([str(gathers * psi // 2 + 16)] * 4)
        assert figures["tp_bytes_per_step"] == ",".join([str(over_tp)] * 4)
        assert figures["bytes_per_step"] == ",".join([str(gathers * psi // 2 + 16 + over_tp)] * 4)


def test_tp_1_prints_what_fsdp_always_printed(text, capsys):
    """tp = 1 is --strategy fsdp unchanged: its first line and its figures' names."""
    config = dataclasses.replace(fsdp_tp(2, 1), progress=True)
    figures = sim.run(lambda comm: train_fsdp(comm, config, text), 2)[0].figures
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("fsdp FULL_SHARD: 2 ranks, per-rank batch 4, global batch 8, lr 0.01, 5 units, ")
    assert list(figures) == ["ranks", "global_batch", "lr", "sharding_strategy", "units", "bytes_per_step",
                             "bytes_communicated", "parameter_bytes", "optimizer_state_bytes"]
    config = dataclasses.replace(fsdp_tp(2, 2), progress=True)
    sim.run(lambda comm: train_fsdp(comm, config, text), 4)
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("fsdp FULL_SHARD: 4 ranks = dp 2 x tp 2 (tp fastest; ")


def test_a_stopped_run_resumes_on_its_mesh_bit_identical_and_on_other_replicas(text, float64, tmp_path, capsys):
    """A checkpoint of dp 2 x tp 2 (--global-batch-size 8) gathers every rank's shards into one
    file. Resumed on the same mesh, the run ends with the weights of the run never stopped, to
    the bit; on dp 3 x tp 2 and dp 1 x tp 2 (each tp coordinate's pieces cut again for the new
    replicas) with them to rounding; with another --tp it is refused by the fingerprint."""
    config = fsdp_tp(2, 2, checkpoint_dir=str(tmp_path / "run"), checkpoint_every=2, global_batch_size=GLOBAL_BATCH)
    whole = sim.run(lambda comm: train_fsdp(comm, dataclasses.replace(config, checkpoint_dir=None), text), 4)[0]

    def stopped(comm):
        with pytest.raises(TrainingStopped):
            train_fsdp(comm, dataclasses.replace(config, stop_after_steps=4), text)

    sim.run(stopped, 4)
    for ranks in (4, 6, 2):
        folder = shutil.copytree(tmp_path / "run", tmp_path / f"on{ranks}")
        again = dataclasses.replace(config, resume=True, checkpoint_dir=str(folder))
        resumed = sim.run(lambda comm, again=again: train_fsdp(comm, again, text), ranks)[0]
        assert f"on{ranks}/ckpt-00000004.npz (step 4" in capsys.readouterr().out  # steps 5 and 6 ran here
        if ranks == 4:
            for key, value in whole.model.state_dict().items():
                assert np.array_equal(value, resumed.model.state_dict()[key]), key
        assert max_difference(weights(whole.model), weights(resumed.model)) < 1e-10
    with pytest.raises(CheckpointError, match="tp: 2 there, 1 here"):
        sim.run(lambda comm: train_fsdp(comm, dataclasses.replace(config, resume=True, tp=1), text), 4)


def test_checkpoint_consolidate_joins_each_tp_rank_s_units(text, tmp_path):
    """``compose.consolidate_fsdp`` (``checkpoint consolidate``) of the last checkpoint of a dp 2
    x tp 2 run: each tp coordinate's units joined over dp, then the tp shards joined: the run's
    dense model, to the bit (tp = 1: ``resharding.consolidate`` as before)."""
    for tp in (2, 1):
        folder = tmp_path / f"tp{tp}"
        config = fsdp_tp(4 // tp, tp, checkpoint_dir=str(folder), checkpoint_every=TINY["steps"])
        result = sim.run(lambda comm, config=config: train_fsdp(comm, config, text), 4)[0]
        _, state = latest_valid_checkpoint(str(folder))
        dense = compose.consolidate_fsdp(state)
        expected = result.model.state_dict()
        assert set(dense) == set(expected)
        for name, value in expected.items():
            assert np.array_equal(dense[name], value), name


@pytest.mark.parametrize("world, change, message", [
    (4, {"model": "mlp", "tp": 2}, r"--strategy fsdp --tp 2 splits the GPT's layers .* use --model gpt"),
    (6, {"tp": 4}, r"--tp 4 does not divide the 6 ranks .* use --tp among \[1, 2\]"),
    (4, {"tp": 4}, r"--tp 4: --n-head = 2 is not divisible by 4 .* use --tp among \[1, 2\]"),
    (4, {"tp": 2, "dropout": 0.1}, "--strategy fsdp with --tp 2 needs --dropout 0"),
    (4, {"tp": 2, "sequence_parallel": True, "block_size": 7}, "cuts each window's 7 positions into --tp 2 equal"),
    (4, {"tp": 1, "sequence_parallel": True}, "with --strategy fsdp give --tp 2 or more"),
    (4, {"tp": 2, "precision": "bf16"}, "--strategy fsdp with --tp 2 trains in float32"),
    (4, {"tp": 0}, "--tp must be a positive integer, got 0"),
    (4, {"sharding_strategy": "ZERO3"}, "--sharding-strategy ZERO3 is not one of"),
])
def test_layouts_fsdp_cannot_run_are_refused_naming_the_fix(world, change, message):
    config = train.TrainConfig(**{**TINY, "strategy": "fsdp", **change})
    with pytest.raises(ValueError, match=message) as error:
        check_fsdp(world, config)
    assert "\n" not in str(error.value)


def test_layouts_fsdp_can_run_pass_the_check():
    for world, tp in ((1, 1), (2, 2), (4, 2), (6, 2), (3, 1)):
        check_fsdp(world, train.TrainConfig(**TINY, strategy="fsdp", tp=tp, sequence_parallel=tp > 1))
    check_fsdp(4, train.TrainConfig(strategy="fsdp"))  # the MLP without tp


def test_parallelize_applies_tp_then_fsdp(text):
    """``compose.parallelize`` on a dp 2 x tp 2 mesh: FSDP's units hold each tp rank's shards
    (the tied embedding and head cut by vocabulary rows, then by dp), and the position embedding
    and last LayerNorm are units of their own."""
    work = train.workload_for(train.TrainConfig(**TINY), text)

    def rank(comm):
        mesh = compose.CountedMesh(comm, 2)
        model = compose.parallelize(work.model(), mesh, train.TrainConfig(**TINY, tp=2))
        names = [unit.name for unit in model.units]
        shapes = {name: shape for unit in model.units for name, shape in zip(
            [model.names[id(p)][0] for p in unit.flat.params], unit.flat.shapes)}
        return names, shapes["transformer.wte.weight"], mesh.mesh.coordinate

    results = sim.run(rank, 4)
    names, wte, _ = results[0]
    assert names == ["root", "transformer.wpe", "transformer.h.0", "transformer.h.1", "transformer.h.2",
                     "transformer.h.3", "transformer.ln_f"]
    assert wte == (text.vocab_size // 2, TINY["n_embd"])
    assert [coordinate for *_, coordinate in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.mpi
def test_dp_2_x_tp_2_equals_one_process_under_mpiexec():
    """tests/mpi/fsdp_tp.py on 4 real ranks: the dense weights and evaluations of dp 2 x tp 2
    (FULL_SHARD, float64) equal one process's on the global batch to 1e-10."""
    mpiexec_or_skip()
    script = Path(__file__).parent / "mpi" / "fsdp_tp.py"
    result = launch.launch(script, 4, timeout=300, env=JOB_ENV)
    assert result.ok and "FSDPxTP OK" in result.stdout, result.stdout + result.stderr[-3000:]
