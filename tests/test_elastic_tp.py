"""Elastic tensor parallelism (issue 24, items 1-2: "TP where it exists"; --global-batch-size for
tp and 3d): a tp checkpoint written on T ranks resumes on T' with every parameter's shards and
AdamW's two moments cut again, sequence parallelism on or off, and the run ends as one process's.

Oracles: the single-process run on the global batch in float64 (to 1e-10); the model that
``parallelize_gpt`` builds on T ranks (its shards are what :func:`shard_of` must give); the
refusals' messages, each naming the fix.
"""
import dataclasses

import numpy as np
import pytest
import test_gpt_train
from test_gpt_train import TINY, max_difference, weights

from minidist import sim, train, workloads
from minidist.checkpoint_io import CheckpointError, CheckpointMismatchError
from minidist.cli.train import train_config, train_parser
from minidist.fault import TrainingStopped
from minidist.models.gpt import GPT, GPTConfig
from minidist.parallel.tensor_parallel import join_shards, parallelize_gpt
from minidist.parallel.tensor_parallel.train import reshard_tensor_parallel, shard_of, train_tensor_parallel
from minidist.parallel.three_d.train import check_3d, train_3d
from minidist.resharding import ReshardError

float64 = test_gpt_train.float64  # the GPT tests' fixture: the workload's GPT in float64

# 12 heads of width 2 and 96 MLP features split evenly over 2, 3 and 4 ranks; the text's 62 tokens
# do not (4 ranks hold 16, 16, 15, 15 rows of the tied embedding, 3 ranks 21, 21, 20); a context of
# 12 positions splits over 2, 3 and 4 ranks under sequence parallelism.
ELASTIC = dict(TINY, strategy="tp", n_head=12, n_embd=24, n_layer=1, block_size=12, steps=6, eval_every=3,
               batch_size=None)
G = 6


@pytest.fixture(scope="module")
def text():
    """The GPT tests' small text and two more characters: 62 tokens."""
    return workloads.load_text(test_gpt_train.TEXT + "#%")


def tp_run(config, ranks, dataset, **more):
    """The tp driver of ``config`` (with ``more``) on ``ranks`` simulated ranks: rank 0's result,
    or None when stopped (--stop-after-steps)."""
    try:
        return sim.run(lambda comm: train_tensor_parallel(comm, dataclasses.replace(config, **more), dataset),
                       ranks)[0]
    except TrainingStopped:
        return None


def config_of(tmp_path, **more):
    fields = {k: v for k, v in ELASTIC.items() if v is not None}
    return train.TrainConfig(**fields, global_batch_size=G, checkpoint_every=2, checkpoint_dir=str(tmp_path / "run"),
                             timeout=30, **more)


def test_shard_of_cuts_as_parallelize_gpt_and_join_shards_undoes_it():
    """For T = 1, 2, 3, 4 (and 7 for the vocabulary alone: an uneven cut, 60 = 4 x 9 + 3 x 8;
    the GPT's heads and features must split evenly): every parameter's shard from the
    dense tensor is the one the split model holds, and joining them gives the dense tensor back."""
    dense = GPT(GPTConfig(60, 12, 1, 12, 24), rng=3, dtype="float64")
    whole = dense.state_dict()
    for size in (1, 2, 3, 4):
        models = sim.run(lambda comm: parallelize_gpt(dense, comm).state_dict(), size)
        for name, value in whole.items():
            cut = [shard_of(name, value, rank, size, 12) for rank in range(size)]
            for rank in range(size):
                assert np.array_equal(cut[rank], models[rank][name]), (name, size, rank)
            assert np.array_equal(join_shards(name, cut), value), name
    rows = [shard_of("transformer.wte.weight", whole["transformer.wte.weight"], r, 7, 12).shape[0] for r in range(7)]
    assert rows == [9, 9, 9, 9, 8, 8, 8]


def test_stopped_on_2_resumed_on_4_with_sequence_parallelism_then_on_3_ends_as_one_process(text, float64, tmp_path,
                                                                                          capsys):
    """Six AdamW steps (warm-up, cosine, clipping) of G = 6 windows: 2 steps on 2 ranks, 2 on 4
    with --sequence-parallel, the last 2 on 3; the weights and every evaluation equal the
    single-process run on the global batch to 1e-10, each change said in one line."""
    config = config_of(tmp_path)
    single = train.train_single(dataclasses.replace(config, strategy="single", checkpoint_dir=None), text)
    assert tp_run(config, 2, text, stop_after_steps=2) is None
    assert tp_run(config, 4, text, stop_after_steps=4, resume=True, sequence_parallel=True) is None
    result = tp_run(config, 3, text, resume=True)
    out = capsys.readouterr().out
    assert "resume: world_size 2 in the checkpoint, 4 now: the state is resharded" in out
    assert "resume: sequence_parallel False in the checkpoint, True now: the activations" in out
    assert "resume: world_size 4 in the checkpoint, 3 now" in out
    assert "resume: sequence_parallel True in the checkpoint, False now" in out
    assert text.vocab_size == 62
    assert "tp: 4 ranks, 3 heads and 24 MLP features each, vocabulary rows 0:16 on rank 0" in out
    assert "tp: 3 ranks, 4 heads and 32 MLP features each, vocabulary rows 0:21 on rank 0, batch 6" in out
    assert max_difference(weights(single.model), weights(result.model)) < 1e-10
    assert abs(single.val_loss - result.val_loss) < 1e-10
    assert abs(single.history[-1]["loss"] - result.history[-1]["loss"]) < 1e-10


def test_a_tp_checkpoint_continues_on_one_rank_and_names_that_fix_to_single(text, float64, tmp_path):
    """Stopped on 2 ranks: --strategy single is refused naming tp on 1 rank, which then ends at
    the single-process weights; without --global-batch-size another number of ranks is refused
    naming the strategies that reshard."""
    config = config_of(tmp_path)
    single = train.train_single(dataclasses.replace(config, strategy="single", checkpoint_dir=None), text)
    assert tp_run(config, 2, text, stop_after_steps=4) is None
    with pytest.raises(CheckpointMismatchError, match=r"strategy: 'tp' there, 'single' here; world_size: 2 there, 1 "
                                                      r"here\); .* \(a tp checkpoint holds each rank's shards; it "
                                                      r"continues on one process as --strategy tp on 1 rank"):
        train.train_single(dataclasses.replace(config, strategy="single", resume=True), text)
    result = tp_run(config, 1, text, resume=True)
    assert max_difference(weights(single.model), weights(result.model)) < 1e-10
    fixed = {k: v for k, v in ELASTIC.items() if v is not None}
    batch = train.TrainConfig(**{**fixed, "batch_size": G}, checkpoint_every=2, checkpoint_dir=str(tmp_path / "b"),
                              timeout=30)
    assert tp_run(batch, 2, text, stop_after_steps=2) is None
    with pytest.raises(CheckpointError, match=r"world_size: 2 there, 4 here\); resume with the same flags and number "
                                              r"of ranks \(a checkpoint resumes on another number of ranks with "
                                              r"--global-batch-size, for --strategy ddp, ddp --zero, fsdp, tp, "
                                              r"pipeline .* a ps checkpoint on its own layout only\)"):
        tp_run(batch, 4, text, resume=True)


def test_parts_that_do_not_fit_are_refused_by_name():
    """reshard_tensor_parallel by hand: a whole parameter that differs between the ranks' parts,
    a part without an entry, moments for another number of parameters."""
    def part(bias, moments=1):
        return {"model": {"transformer.ln_f.bias": np.full(2, bias)},
                "optimizer": {"exp_avg": [np.zeros(2)] * moments, "exp_avg_sq": [np.zeros(2)] * moments}}

    names = ["transformer.ln_f.bias"]
    assert np.array_equal(reshard_tensor_parallel([part(1.0), part(1.0)], 3, names, 2)[2]["model"]
                          ["transformer.ln_f.bias"], [1.0, 1.0])
    with pytest.raises(ReshardError, match="transformer.ln_f.bias is whole on every rank, but rank 1's copy differs"):
        reshard_tensor_parallel([part(1.0), part(2.0)], 3, names, 2)
    with pytest.raises(ReshardError, match="a rank's part of the checkpoint lacks 'transformer.ln_f.bias'"):
        reshard_tensor_parallel([part(1.0), {"model": {}, "optimizer": {}}], 3, names, 2)
    with pytest.raises(ReshardError, match="optimizer/exp_avg holds another number of moments than the 1 parameters"):
        reshard_tensor_parallel([part(1.0, 2), part(1.0, 2)], 3, names, 2)


# -- 3d: the global batch (its resharding: test_elastic_pipeline.py) ----------------------------------

def test_3d_on_a_global_batch_is_one_process_and_with_zero_resumes_on_its_own_mesh_only(text, float64, tmp_path):
    """dp 2 x tp 2 (one stage, ZeRO-1 over dp) with G = 6, 3 micro-batches of one window per
    pipeline: the single-process weights on G to 1e-10; its checkpoint (AdamW's moments in ZeRO-1
    shards) is refused on another mesh, naming the strategies that reshard."""
    fields = {k: v for k, v in ELASTIC.items() if v is not None}
    config = train.TrainConfig(**{**fields, "strategy": "3d"}, dp=2, tp=2, microbatches=3, global_batch_size=G,
                               checkpoint_every=2, checkpoint_dir=str(tmp_path / "run"), timeout=30, zero=True)
    single = train.train_single(dataclasses.replace(config, strategy="single", checkpoint_dir=None), text)
    result = sim.run(lambda comm: train_3d(comm, config, text), 4)[0]
    assert result.figures["global_batch"] == G and result.figures["lr"] == f"{config.lr:g}"
    assert max_difference(weights(single.model), weights(result.model)) < 1e-10
    with pytest.raises(CheckpointMismatchError, match=r"dp: 2 there, 1 here; world_size: 4 there, 2 here\); .* and 3d "
                                                      r"\(also another --tp; not with --zero\); a ps checkpoint on its "
                                                      r"own layout only"):
        sim.run(lambda comm: train_3d(comm, dataclasses.replace(config, dp=1, resume=True), text), 2)


@pytest.mark.parametrize("change,message", [
    ({"global_batch_size": 6, "dp": 4, "tp": 1}, r"--global-batch-size 6 is not divisible by --dp 4 \(each pipeline "
                                                 r"reads G / dp windows a step\); use a multiple of 4, or --dp among "
                                                 r"\[1, 2\]"),
    ({"global_batch_size": 12, "dp": 2, "microbatches": 4},
     r"gives each of the 2 pipelines 6 windows a step, which --microbatches 4 does not divide .* among \[1, 2, 3, 6\]"),
])
def test_3d_refuses_a_global_batch_its_pipelines_cannot_split(change, message):
    with pytest.raises(ValueError, match=message):
        check_3d(8, train.TrainConfig(**{**TINY, "strategy": "3d", "n_head": 4, **change}))
    check_3d(8, train.TrainConfig(**{**TINY, "strategy": "3d", "n_head": 4, "global_batch_size": 12, "dp": 2,
                                     "microbatches": 3}))


# -- the flags ----------------------------------------------------------------------------------

@pytest.mark.parametrize("args,message", [
    (["--strategy", "ps", "--global-batch-size", "8"],
     r"--global-batch-size applies to --strategy single, ddp \(also --zero\), fsdp, tp, pipeline, 3d, cp and ep, "
     r"not to --strategy ps; give it --batch-size instead \(the batch of each worker: in async and ssp modes"),
    (["--model", "gpt", "--strategy", "tp", "--global-batch-size", "8", "--batch-size", "4"],
     "give --global-batch-size G or --batch-size B, not both"),
])
def test_the_strategies_without_a_global_batch_are_refused_by_name(args, message):
    with pytest.raises(ValueError, match=message):
        train_config(train_parser().parse_args(args))
    for strategy in ("tp", "3d", "pipeline"):  # taken
        config = train_config(train_parser().parse_args(["--model", "gpt", "--strategy", strategy,
                                                         "--global-batch-size", "8"]))
        assert config.global_batch_size == 8


def test_a_tp_checkpoint_consolidates_to_the_dense_model(text, float64, tmp_path, capsys):
    """`checkpoint consolidate` joins each parameter's 3 shards (the 62-token vocabulary cut 21,
    21, 20) into the dense state_dict the run itself ends with, bit for bit."""
    from minidist import checkpoint_io, cli

    config = dataclasses.replace(config_of(tmp_path), steps=2)
    result = tp_run(config, 3, text)
    assert cli.main(["checkpoint", "consolidate", str(tmp_path / "run"), str(tmp_path / "dense.npz")]) == 0
    assert "(step 2, --strategy tp on 3 ranks)" in capsys.readouterr().out
    dense, metadata = checkpoint_io.load_weights(tmp_path / "dense.npz")
    final = result.model.state_dict()
    assert dense.keys() == final.keys() and metadata["model"] == "gpt"
    for name, value in final.items():
        assert np.array_equal(dense[name], np.asarray(value)), name
