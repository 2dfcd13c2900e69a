"""Elastic training on the simulator (issue 24): checkpoints written on N ranks resume on M
(resharded), the data of each epoch is read exactly once across the change, and the weights end
as one process's on the global batch.

Oracles: the epoch's permutation (``default_rng([seed, epoch])``, the one-process loader's),
recorded sample by sample from every rank's forward; a single-process run on the global batch in
float64 (to 1e-10); the dense model a run ends with, for ``checkpoint consolidate``. The
mpiexec half (a job killed on 4 ranks, relaunched on 2 by the supervisor): test_elastic_mpi.py.
"""
import dataclasses
import re

import numpy as np
import pytest
import test_gpt_train
from test_gpt_train import TINY, max_difference, weights

from minidist import checkpoint_io, cli, data, fault, launch, nn, resharding, sim, train
from minidist.checkpoint_io import CheckpointError, CheckpointMismatchError
from minidist.cli.train import DRIVERS, train_config, train_parser
from minidist.parallel.fsdp.train import train_fsdp
from minidist.parallel.zero.train import train_zero

text, float64 = test_gpt_train.text, test_gpt_train.float64  # the GPT tests' fixtures

G = 12  # the global batch: 4, 2 and 3 ranks each read an equal part
SAMPLES, FEATURES = 240, 8  # 20 steps of 12 an epoch: every sample of an epoch is read


def driver(name):
    """The driver of ``name`` (ddp, zero, fsdp, single) as ``f(comm, config, dataset)``."""
    if name == "zero":
        return lambda comm, c, d: train_zero(comm, dataclasses.replace(c, strategy="ddp", zero=True), d)
    if name == "single":
        return lambda comm, c, d: train.train_single(dataclasses.replace(c, strategy="single"), d)
    return DRIVERS[name][0]


@pytest.fixture
def recorded(monkeypatch):
    """A random data set of unique rows, an MLP in float64, and every forward's sample indices,
    one list per workload (that is, per rank and run), in order."""
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((SAMPLES, FEATURES)), rng.integers(0, 3, SAMPLES)
    index = {row.tobytes(): i for i, row in enumerate(X)}
    seen = {}
    forward = train.ClassifierWorkload.forward

    def recording_forward(self, model, x):
        seen.setdefault(id(self), []).append([index[row.tobytes()] for row in np.asarray(x)])
        return forward(self, model, x)

    monkeypatch.setattr(train.ClassifierWorkload, "forward", recording_forward)
    monkeypatch.setattr(train.ClassifierWorkload, "model",
                        lambda self: nn.mlp([FEATURES, 16, 3], rng=self.config.seed, dtype="float64"))
    return data.Dataset(X, y, X[:30], y[:30]), seen


def global_steps(seen: dict, ranks: int, g: int = G) -> list[list[int]]:
    """The global batches of one run on ``ranks`` ranks: step t is every rank's t-th part (one
    workload per rank, in the order they first ran: not the ranks' order), the parts of the sizes
    ``numpy.array_split`` gives (G / ranks each when ranks divide G)."""
    parts = list(seen.values())
    assert len(parts) == ranks
    steps = []
    for batches in zip(*parts, strict=True):
        assert sorted(len(b) for b in batches) == sorted(len(a) for a in np.array_split(np.arange(g), ranks))
        steps.append([i for b in batches for i in b])
    return steps


def run(name, ranks, config, dataset):
    try:
        results = sim.run(driver(name), ranks, config, dataset)
    except fault.TrainingStopped:
        return None
    return next(r for r in results if r is not None)


@pytest.mark.parametrize("name", ["ddp", "zero", "fsdp"])
def test_stopped_on_4_resumed_on_2_then_3_reads_each_sample_once_and_ends_as_one_process(recorded, tmp_path,
                                                                                         name, capsys):
    dataset, seen = recorded
    config = train.TrainConfig(strategy="fsdp" if name == "fsdp" else "ddp", epochs=2, global_batch_size=G, lr=0.1,
                               hidden=(16,), progress=False, checkpoint_every=5, timeout=30,
                               checkpoint_dir=str(tmp_path / "run"))
    reference = run("single", 1, dataclasses.replace(config, checkpoint_dir=None), dataset).model.state_dict()
    seen.clear()
    steps = []
    for ranks, more in ((4, {"stop_after_steps": 10}), (2, {"stop_after_steps": 25, "resume": True}),
                        (3, {"resume": True})):
        result = run(name, ranks, dataclasses.replace(config, **more), dataset)
        steps += global_steps(seen, ranks)
        seen.clear()
    out = capsys.readouterr().out
    assert "resume: world_size 4 in the checkpoint, 2 now" in out
    assert "resume: world_size 2 in the checkpoint, 3 now" in out
    assert "global sample 120 of the epoch" in out and "global sample 60 of the epoch" in out
    # exactly once, in one process's order: epoch e's 20 global batches are its permutation
    assert len(steps) == 40
    for epoch in range(2):
        order = np.random.default_rng([0, epoch]).permutation(SAMPLES)
        got = [i for step in steps[epoch * 20 : (epoch + 1) * 20] for i in step]
        per_step = [sorted(order[t * G : (t + 1) * G]) for t in range(20)]
        assert [sorted(s) for s in steps[epoch * 20 : (epoch + 1) * 20]] == per_step
        assert sorted(got) == list(range(SAMPLES))
    final = result.model.state_dict()
    assert max(float(np.abs(np.asarray(final[k]) - reference[k]).max()) for k in reference) < 1e-10
    # consolidate: the newest checkpoint (step 40, the last) is the final model, whatever its layout
    out_path = tmp_path / "dense.npz"
    assert cli.main(["checkpoint", "consolidate", str(tmp_path / "run"), str(out_path)]) == 0
    assert capsys.readouterr().out.startswith(f"consolidated {tmp_path / 'run'}/ckpt-00000040.npz (step 40")
    dense = checkpoint_io.load_weights(out_path)[0]
    assert sorted(dense) == sorted(final)
    for k in final:
        assert np.array_equal(dense[k], np.asarray(final[k])), k


@pytest.mark.parametrize("name", ["ddp", "zero", "fsdp"])
def test_ranks_that_do_not_divide_the_global_batch_read_parts_off_by_one_and_end_as_one_process(recorded, tmp_path,
                                                                                                name, capsys):
    """G = 10 on 4 ranks (parts 3, 3, 2, 2), stopped after step 7, resumed on 3 (4, 3, 3): every
    sample of the epoch's first 240 read once, and the weights (each rank's gradient weighted by
    its rows, ``train.loss_weight``) those of one process on the global batch, to 1e-10."""
    dataset, seen = recorded
    g = 10
    config = train.TrainConfig(strategy="fsdp" if name == "fsdp" else "ddp", epochs=1, global_batch_size=g, lr=0.1,
                               hidden=(16,), progress=False, checkpoint_every=7, timeout=30,
                               checkpoint_dir=str(tmp_path / "run"))
    reference = run("single", 1, dataclasses.replace(config, checkpoint_dir=None), dataset).model.state_dict()
    seen.clear()
    run(name, 4, dataclasses.replace(config, stop_after_steps=7), dataset)
    steps = global_steps(seen, 4, g)
    seen.clear()
    result = run(name, 3, dataclasses.replace(config, resume=True), dataset)
    steps += global_steps(seen, 3, g)
    out = capsys.readouterr().out
    assert "per-rank batch 3 or 2, global batch 10" in out and "per-rank batch 4 or 3, global batch 10" in out
    order = np.random.default_rng([0, 0]).permutation(SAMPLES)
    assert [sorted(s) for s in steps] == [sorted(order[t * g : (t + 1) * g]) for t in range(24)]
    final = result.model.state_dict()
    assert max(float(np.abs(np.asarray(final[k]) - reference[k]).max()) for k in reference) < 1e-10
    # the weighting is what makes it exact: unweighted, the 3-row parts would count as much as the 2-row ones
    assert train.loss_weight(dataclasses.replace(config, global_batch_size=g), 4, 0) == 1.2


def test_each_rank_reads_a_contiguous_part_of_the_step():
    """The sampler by hand: 10 samples, G = 4, 2 steps (2 samples left out, the same on every
    world size); rank r of M holds its ``numpy.array_split`` part of each step (on 3 ranks: 2,
    1, 1 samples)."""
    order = np.random.default_rng([3, 1]).permutation(10)
    for ranks in (1, 2, 3, 4):
        sizes = [len(a) for a in np.array_split(np.arange(4), ranks)]
        parts = []
        for rank in range(ranks):
            sampler = data.GlobalBatchSampler(10, 4, ranks, rank, seed=3)
            sampler.set_epoch(1)
            parts.append(list(sampler))
            assert sampler.batch_size == sizes[rank] and len(sampler) == 2 * sizes[rank] and sampler.position(2) == 8
        for step in range(2):
            joined = [i for p, k in zip(parts, sizes) for i in p[step * k : (step + 1) * k]]
            assert joined == list(order[step * 4 : (step + 1) * 4])
    assert list(data.GlobalBatchSampler(5, 2, 2, 1, shuffle=False)) == [1, 3]
    assert list(data.split_global_batch(16, 3)) == [0, 6, 11, 16]
    with pytest.raises(ValueError, match="global batch 3 cannot be split over 4 ranks .* at most 3 ranks"):
        data.GlobalBatchSampler(10, 3, 4, 0)
    with pytest.raises(ValueError, match="larger than the 10 training samples"):
        data.GlobalBatchSampler(10, 12, 2, 0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        data.GlobalBatchSampler(10, 4, 2, 2)


def test_the_gpt_sharded_in_units_resumes_on_more_ranks_as_one_process(text, float64, tmp_path):
    """FSDP of a 2-block GPT (3 units: each unit's shard and AdamW moments resharded): stopped
    on 2 ranks after step 2, resumed on 4 (windows 2, 2, 1, 1 of each step's 6, the gradients
    weighted by them), equal to one process on the global batch of 6, and its last checkpoint
    consolidated equals the dense model."""
    tiny = {**TINY, "batch_size": 32, "n_layer": 2, "steps": 4, "eval_every": 2}
    config = train.TrainConfig(**tiny, global_batch_size=6, checkpoint_every=2,
                               checkpoint_dir=str(tmp_path / "run"), strategy="fsdp")
    single = train.train_single(dataclasses.replace(config, strategy="single", checkpoint_dir=None), text)
    with pytest.raises(fault.TrainingStopped):
        sim.run(lambda comm: train_fsdp(comm, dataclasses.replace(config, stop_after_steps=2), text), 2)
    result = sim.run(lambda comm: train_fsdp(comm, dataclasses.replace(config, resume=True), text), 4)[0]
    assert max_difference(weights(single.model), weights(result.model)) < 1e-10
    assert abs(single.val_loss - result.val_loss) < 1e-10
    state = checkpoint_io.latest_valid_checkpoint(tmp_path / "run")[1]
    dense = resharding.consolidate(state)
    assert dense.keys() == result.model.state_dict().keys()
    for k, v in result.model.state_dict().items():
        assert np.array_equal(dense[k], v), k


# -- what cannot carry over is refused, or reset with a line ------------------------------------

def ddp_run(dataset, tmp_path, ranks, **more):
    config = train.TrainConfig(strategy="ddp", epochs=1, hidden=(16,), progress=False, checkpoint_every=4,
                               timeout=30, checkpoint_dir=str(tmp_path / "run"), **more)
    return run("ddp", ranks, config, dataset)


def test_another_world_size_without_a_global_batch_is_refused_naming_the_fix(recorded, tmp_path):
    dataset, _ = recorded
    ddp_run(dataset, tmp_path, 2, stop_after_steps=4)
    with pytest.raises(CheckpointMismatchError, match=r"world_size: 2 there, 4 here\); resume with the same flags and "
                                                      r"number of ranks \(a checkpoint resumes on another number of "
                                                      r"ranks with --global-batch-size"):
        ddp_run(dataset, tmp_path, 4, resume=True)


def test_a_changed_model_or_strategy_is_named_even_when_the_ranks_may_change(recorded, tmp_path):
    dataset, _ = recorded
    ddp_run(dataset, tmp_path, 2, stop_after_steps=4, global_batch_size=G)
    with pytest.raises(CheckpointMismatchError, match=r"hidden: \[16\] there, \[8\] here"):
        run("ddp", 4, train.TrainConfig(strategy="ddp", epochs=1, hidden=(8,), progress=False, timeout=30,
                                        global_batch_size=G, checkpoint_dir=str(tmp_path / "run"), resume=True),
            dataset)
    with pytest.raises(CheckpointMismatchError, match="strategy: 'ddp' there, 'fsdp' here"):
        run("fsdp", 4, train.TrainConfig(strategy="fsdp", epochs=1, hidden=(16,), progress=False, timeout=30,
                                         global_batch_size=G, checkpoint_dir=str(tmp_path / "run"), resume=True),
            dataset)
    with pytest.raises(CheckpointMismatchError, match="global_batch_size: 12 there, 24 here"):
        ddp_run(dataset, tmp_path, 4, resume=True, global_batch_size=24)


def test_a_comm_hooks_residuals_start_afresh_with_one_line(recorded, tmp_path, capsys):
    dataset, _ = recorded
    ddp_run(dataset, tmp_path, 2, stop_after_steps=4, global_batch_size=G, comm_hook="int8")
    capsys.readouterr()
    assert ddp_run(dataset, tmp_path, 3, resume=True, global_batch_size=G, comm_hook="int8") is not None
    out = capsys.readouterr().out
    assert "resume: comm_hook's state was saved by 2 ranks, one each, and cannot be split for 3: it starts " \
           "afresh" in out


def test_an_older_checkpoint_resumes_on_its_own_ranks_and_is_refused_on_others(recorded, tmp_path):
    """A ZeRO-1 checkpoint without the shard metadata (as written before it existed; the file
    rewritten with a fresh checksum): read on 2 ranks, refused on 4 naming why."""
    dataset, _ = recorded
    config = train.TrainConfig(strategy="ddp", zero=True, epochs=1, hidden=(16,), progress=False, checkpoint_every=4,
                               timeout=30, global_batch_size=G, checkpoint_dir=str(tmp_path / "run"))
    run("zero", 2, dataclasses.replace(config, stop_after_steps=4), dataset)
    path = checkpoint_io.list_checkpoints(tmp_path / "run")[-1][1]
    state = checkpoint_io.load_checkpoint(path)
    for part in state["ranks"]:
        del part["shards"]
    del state["config"]["global_batch_size"]  # older still: before the field
    checkpoint_io.save_checkpoint(path, state)
    with pytest.raises(CheckpointMismatchError, match="global_batch_size: None there, 12 here"):
        run("zero", 2, dataclasses.replace(config, resume=True), dataset)
    state["config"]["global_batch_size"] = G
    checkpoint_io.save_checkpoint(path, state)
    with pytest.raises(CheckpointError, match="cannot be resharded: it was written without shard metadata .* resumes "
                                              "only on its own 2 ranks"):
        run("zero", 4, dataclasses.replace(config, resume=True), dataset)
    assert run("zero", 2, dataclasses.replace(config, resume=True, epochs=1), dataset) is not None


def test_pieces_are_assembled_from_their_offsets_and_gaps_are_errors():
    """DCP's picture by hand: numel 10 saved as 3 shards of 4 (padding 2), read as 2 of 5."""
    saved = [{"shards": [{"path": ["v"], "numel": 10, "offset": 4 * r, "length": 4}],
              "v": np.r_[np.arange(4 * r, 4 * r + 4) % 10 if r < 2 else [8, 9, 0, 0]].astype(float)} for r in range(3)]
    assert list(resharding.assemble(saved, ["v"], 10, 5, 5)) == [5, 6, 7, 8, 9]
    assert list(resharding.assemble(saved, ["v"], 10, 8, 4)) == [8, 9, 0, 0]  # the new padding: zeros
    with pytest.raises(resharding.ReshardError, match="v holds 10 numbers in the checkpoint, 12 in this run"):
        resharding.assemble(saved, ["v"], 12, 0, 6)
    with pytest.raises(resharding.ReshardError, match=r"positions 4\.\. of 10 are in no saved piece"):
        resharding.assemble([saved[0], saved[2]], ["v"], 10, 0, 10)

def test_pieces_whose_offsets_do_not_tile_the_vector_in_rank_order_are_refused():
    """Two ranks' offsets swapped (each piece where the other's belongs: a valid checksum, the
    whole vector covered once) scrambled the weights; two pieces over one range, or a piece
    whose numbers are not as many as its metadata says, are refused too, naming the ranks."""
    saved = [{"shards": [{"path": ["v"], "numel": 10, "offset": 4 * r, "length": 4}],
              "v": np.r_[np.arange(4 * r, 4 * r + 4) % 10 if r < 2 else [8, 9, 0, 0]].astype(float)} for r in range(3)]
    swapped = [dict(p, shards=[dict(p["shards"][0])]) for p in saved]
    swapped[0]["shards"][0]["offset"], swapped[1]["shards"][0]["offset"] = 4, 0
    with pytest.raises(resharding.ReshardError, match=r"v: rank 0's piece starts at 4, not 0: .* do not tile"):
        resharding.assemble(swapped, ["v"], 10, 0, 5)
    overlapping = [dict(p, shards=[dict(p["shards"][0])]) for p in saved]
    overlapping[2]["shards"][0]["offset"] = 6
    with pytest.raises(resharding.ReshardError, match=r"v: rank 2's piece starts at 6, where rank 1's ends at 8"):
        resharding.assemble(overlapping, ["v"], 10, 0, 5)
    short = [dict(p) for p in saved]
    short[1]["v"] = short[1]["v"][:3]
    with pytest.raises(resharding.ReshardError, match=r"v: rank 1's piece holds 3 numbers, its metadata says 4"):
        resharding.assemble(short, ["v"], 10, 0, 5)
    whole = [{"shards": [{"path": ["v"], "numel": 10, "offset": 0, "length": 12}], "v": np.arange(12.0)}] * 2
    assert list(resharding.assemble(whole, ["v"], 10, 5, 5)) == [5, 6, 7, 8, 9]  # NO_SHARD: every rank whole


def test_an_fsdp_checkpoint_with_two_ranks_offsets_swapped_does_not_resume_on_other_ranks(recorded, tmp_path):
    """The file rewritten with rank 0's and rank 1's offsets swapped and a fresh checksum: on 3
    ranks it resumed with scrambled weights; now it is refused naming the pieces."""
    dataset, _ = recorded
    config = train.TrainConfig(strategy="fsdp", epochs=1, hidden=(16,), progress=False, checkpoint_every=4, timeout=30,
                               global_batch_size=G, checkpoint_dir=str(tmp_path / "run"))
    run("fsdp", 2, dataclasses.replace(config, stop_after_steps=4), dataset)
    path = checkpoint_io.list_checkpoints(tmp_path / "run")[-1][1]
    state = checkpoint_io.load_checkpoint(path)
    first, second = (part["shards"][0] for part in state["ranks"][:2])
    first["offset"], second["offset"] = second["offset"], first["offset"]
    checkpoint_io.save_checkpoint(path, state)
    with pytest.raises(CheckpointError, match=r"rank 0's piece starts at \d+, not 0: .* do not tile"):
        run("fsdp", 3, dataclasses.replace(config, resume=True), dataset)


# -- the flags -----------------------------------------------------------------------------------

@pytest.mark.parametrize("args,message", [
    (["--strategy", "ps", "--global-batch-size", "8"], "--global-batch-size applies to --strategy single, ddp"),
    (["--strategy", "ddp", "--global-batch-size", "8", "--batch-size", "4"], "give --global-batch-size G or"),
    (["--strategy", "ddp", "--global-batch-size", "8", "--scale-lr"], "--scale-lr/--no-scale-lr do not apply with"),
])
def test_global_batch_usage_errors(args, message):
    with pytest.raises(ValueError, match=message):
        train_config(train_parser().parse_args(args))


def test_the_global_batch_must_split_over_the_ranks_and_fit_the_data():
    config = train.TrainConfig(strategy="ddp", global_batch_size=10)
    with pytest.raises(ValueError, match="--global-batch-size 10 cannot be split over 11 ranks .* or at most 10 ranks"):
        train.check_global_batch(config, 11)
    with pytest.raises(ValueError, match="larger than the 7 training samples of --dataset digits; use at most 7"):
        train.check_global_batch(config, 2, data.Dataset(np.zeros((7, 2)), np.zeros(7), None, None))
    assert train.per_rank_config(config, 5).batch_size == 2
    assert [train.per_rank_config(config, 4, r).batch_size for r in range(4)] == [3, 3, 2, 2]
    weights_ = [train.loss_weight(config, 4, r) for r in range(4)]
    assert weights_ == [1.2, 1.2, 0.8, 0.8] and sum(weights_) == 4  # the ranks' average of weighted means: the mean
    assert train.loss_weight(config, 5, 3) == 1.0 and train.loss_weight(train.TrainConfig(), 3, 0) == 1.0
    assert train.batch_description(config, 4) == "per-rank batch 3 or 2, global batch 10"
    assert train.data_parallel_lr(train.ClassifierWorkload(config, None), config, 5) == config.lr  # no scaling


@pytest.mark.parametrize("args,message", [
    (["-n", "4", "--min-ranks", "2", "--", "train", "--strategy", "ddp", "--checkpoint-dir", "d"],
     "give train --global-batch-size G"),
    (["-n", "4", "--min-ranks", "2", "--", "train", "--strategy", "ps", "--checkpoint-dir", "d"],
     r"--strategy ddp, ddp --zero, fsdp, tp, pipeline .* or 3d \(also another --tp; not with --zero\), not this job "
     r"\(--strategy ps\)"),
    (["-n", "4", "--min-ranks", "3", "--", "train", "--strategy", "tp", "--model", "gpt", "--n-head", "4",
      "--global-batch-size", "8", "--checkpoint-dir", "d"],
     r"--min-ranks 3: no number of ranks from 3 down to 3 can run this job \(--strategy tp needs one that divides "
     r"--n-head and 4 x --n-embd\)"),
    (["-n", "2", "--min-ranks", "3", "--", "train", "--strategy", "ddp", "--global-batch-size", "6",
      "--checkpoint-dir", "d"], r"--min-ranks must be in \[1, 2\]"),
])
def test_launch_min_ranks_usage_errors(args, message, capsys):
    assert cli.main(["launch", *args]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_the_elastic_policy_walks_down_one_rank_at_a_time_and_says_so(tmp_path):
    """supervise with --min-ranks and a stand-in mpiexec that fails twice then succeeds: the
    attempts run on 4, 3, 2 ranks (G = 8: 3 ranks read 3, 3 and 2), each relaunch with --resume
    and one line; never more ranks than G; without --global-batch-size, refused."""
    assert launch.elastic_sizes(4, 2, "8") == [4, 3, 2] and launch.elastic_sizes(6, 1, 3) == [6, 3, 2, 1]
    assert launch.elastic_sizes(8, 1, 2, fits=lambda m: 12 % m == 0) == [8, 6, 4, 3, 2, 1]  # tp: the heads' rule
    fake = tmp_path / "mpiexec"
    calls = tmp_path / "calls"
    fake.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] && exit 0\necho \"$2 $*\" >> {calls}\n"
                    f"[ $(wc -l < {calls}) -ge 3 ]\n")
    fake.chmod(0o755)
    lines = []
    args = ["--strategy", "ddp", "--global-batch-size", "8", "--checkpoint-dir", str(tmp_path / "run")]
    assert launch.supervise(4, args, 3, mpiexec=str(fake), log=lines.append, min_ranks=2) == 0
    attempts = calls.read_text().splitlines()
    assert [a.split()[0] for a in attempts] == ["4", "3", "2"]
    assert ["--resume" in a for a in attempts] == [False, True, True]
    assert lines[0] == ("relaunching on 3 ranks (was 4): restart 1/3 after exit code 1, from the checkpoints with "
                        "--resume")
    assert lines[1].startswith("relaunching on 2 ranks (was 3): restart 2/3")
    with pytest.raises(ValueError, match="need --global-batch-size G"):
        launch.supervise(4, args[:2] + args[4:], 3, mpiexec=str(fake), min_ranks=2)
