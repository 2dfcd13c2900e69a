"""Elastic pipelines (issue 24, items 1-2): ``--strategy pipeline --global-batch-size G`` for both
workloads, and pipeline and 3d checkpoints resumed on another layout (another --dp, number of
stages, --tp, --microbatches, flushing schedule), the stages joined into the dense model and cut
again (``parallel.pipeline.elastic``).

Oracles: a single-process run on the global batch in float64 (to 1e-10); the epoch's
permutation (``default_rng([seed, epoch])``, the one-process loader's), recorded from every
pipeline's first stage; the dense model a run ends with, for ``checkpoint consolidate``; the
refusals' messages, each naming the fix.
"""
import dataclasses
import re

import numpy as np
import pytest
import test_gpt_train
from test_gpt_train import TINY, max_difference, weights

from minidist import checkpoint_io, cli, data, fault, nn, sim, train, workloads
from minidist.checkpoint_io import CheckpointMismatchError
from minidist.cli.train import train_config, train_parser
from minidist.parallel.pipeline import elastic
from minidist.parallel.pipeline import train as pipeline_train
from minidist.parallel.pipeline.step import PipelineStep
from minidist.parallel.three_d.train import train_3d
from minidist.resharding import ReshardError

float64, text = test_gpt_train.float64, test_gpt_train.text  # the GPT tests' fixtures

G, SAMPLES, FEATURES = 12, 96, 8  # 8 steps of 12 an epoch
MLP = train.TrainConfig(strategy="pipeline", epochs=2, global_batch_size=G, lr=0.05, momentum=0.9, hidden=(12, 10, 9),
                        warmup_epochs=0, microbatches=2, progress=False, timeout=30)


@pytest.fixture
def mlp(monkeypatch):
    """A data set of unique rows, the pipeline's and the single run's MLP (4 Linear layers) in
    float64, and the rows every pipeline's first stage read: {id(step): (dp_rank, [indices of
    each step])}, cleared by the caller between runs."""
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((SAMPLES, FEATURES)), rng.integers(0, 3, SAMPLES)
    index = {row.tobytes(): i for i, row in enumerate(X)}
    seen = {}
    model = lambda config: nn.mlp([FEATURES, *config.hidden, 3], rng=config.seed, dtype="float64")
    monkeypatch.setattr(pipeline_train, "build_pipeline_model", lambda config, dataset: model(config))
    monkeypatch.setattr(train.ClassifierWorkload, "model", lambda self: model(self.config))
    call = PipelineStep.__call__

    def recording(self, x, y):
        if self.has_first:
            seen.setdefault(id(self), (self.grid.dp_rank, []))[1].append([index[r.tobytes()] for r in np.asarray(x)])
        return call(self, x, y)

    monkeypatch.setattr(PipelineStep, "__call__", recording)
    return data.Dataset(X, y, X[:20], y[:20]), seen


def global_steps(seen: dict, dp: int) -> list[list[int]]:
    """One run's global batches: step t is the t-th batch of pipelines 0, 1, ... (dp of them), each
    G / dp rows; ``seen`` emptied."""
    runs = sorted(seen.values())
    seen.clear()
    assert [d for d, _ in runs] == list(range(dp))
    assert all(len(batch) == G // dp for _, batches in runs for batch in batches)
    return [[i for batch in batches for i in batch] for batches in zip(*[b for _, b in runs], strict=True)]


def epoch_steps(epochs: int) -> list[list[int]]:
    """What one process reads: each epoch's permutation in slices of G."""
    return [list(np.random.default_rng([0, e]).permutation(SAMPLES)[s * G:(s + 1) * G]) for e in range(epochs)
            for s in range(SAMPLES // G)]


def run(driver, ranks, config, dataset, **more):
    """Rank 0's result of ``driver`` on ``ranks`` simulated ranks, or None when stopped."""
    try:
        return sim.run(lambda comm: driver(comm, dataclasses.replace(config, **more), dataset), ranks)[0]
    except fault.TrainingStopped:
        return None


@pytest.mark.parametrize("schedule,dp,ranks", [("gpipe", 1, 2), ("gpipe", 2, 4), ("1f1b", 1, 4), ("1f1b", 2, 4)])
def test_a_pipeline_on_a_global_batch_is_one_process(mlp, schedule, dp, ranks):
    """Each of dp pipelines reads its contiguous G / dp rows of each global batch at --lr; the
    weights after two epochs equal one process's on G to 1e-10."""
    dataset, seen = mlp
    single = train.train_single(dataclasses.replace(MLP, strategy="single"), dataset, report=False)
    result = run(pipeline_train.train_pipeline, ranks, MLP, dataset, schedule=schedule, dp=dp)
    assert global_steps(seen, dp) == epoch_steps(2)
    assert result.figures["global_batch"] == G and result.figures["lr"] == "0.05"
    assert max_difference(weights(single.model), weights(result.model)) < 1e-10


def test_a_pipeline_stopped_on_2x2_resumes_on_1x4_then_interleaved_as_one_process(mlp, tmp_path, capsys):
    """2 pipelines x 2 stages (gpipe, 2 micro-batches) stop at step 5, 1 x 4 stages (1f1b, 3) at
    step 10, then 2 ranks x 2 interleaved stages each (4 micro-batches) end the second epoch:
    every sample of each epoch read once, in one process's steps, and its weights to 1e-10."""
    dataset, seen = mlp
    config = dataclasses.replace(MLP, checkpoint_dir=str(tmp_path / "run"), checkpoint_every=5)
    single = train.train_single(dataclasses.replace(MLP, strategy="single"), dataset, report=False)
    assert run(pipeline_train.train_pipeline, 4, config, dataset, dp=2, schedule="gpipe", stop_after_steps=5) is None
    steps = global_steps(seen, 2)
    assert run(pipeline_train.train_pipeline, 4, config, dataset, schedule="1f1b", microbatches=3,
               stop_after_steps=10, resume=True) is None
    steps += global_steps(seen, 1)
    result = run(pipeline_train.train_pipeline, 2, config, dataset, schedule="interleaved", stages_per_rank=2,
                 microbatches=4, resume=True)
    steps += global_steps(seen, 1)
    assert steps == epoch_steps(2)
    out = capsys.readouterr().out
    for line in ("resume: dp 2 in the checkpoint, 1 now: another number of pipelines",
                 "resume: schedule 'gpipe' in the checkpoint, '1f1b' now: another flushing schedule",
                 "resume: microbatches 3 in the checkpoint, 4 now: each pipeline's G / dp samples are cut",
                 "resume: world_size 4 in the checkpoint, 2 now: the state is resharded",
                 "(step 10, epoch 2, batch 2 of it, global sample 24 of the epoch)",
                 "2 ranks = 1 pipeline x 2 ranks, 4 stages (Linear layers per stage: 1,1,1,1), schedule interleaved"):
        assert line in out
    assert max_difference(weights(single.model), weights(result.model)) < 1e-10
    assert cli.main(["checkpoint", "consolidate", str(tmp_path / "run"), str(tmp_path / "dense.npz")]) == 0
    dense, _ = checkpoint_io.load_weights(tmp_path / "dense.npz")  # the last checkpoint: step 15, one before the end
    assert dense.keys() == result.model.state_dict().keys()


def test_a_gpt_pipeline_and_a_3d_run_resume_on_other_layouts_as_one_process(text, float64, tmp_path, monkeypatch):
    """The GPT (AdamW, warm-up, cosine, clipping; 4 blocks, 4 heads) on G = 8 windows, 4 steps:
    a pipeline of 2 x 2 stages (gpipe, 2 micro-batches) stopped at step 2 ends on 1 x 4 stages
    (1f1b, 4 micro-batches); a 3d run of dp 2 x pp 2 x tp 2 ends on dp 1 x pp 2 x tp 4 (the tp shards
    and the tied embedding joined and cut again): both equal one process to 1e-10, and
    `checkpoint consolidate` gives the final model bit for bit."""
    monkeypatch.setattr(workloads.LanguageModelWorkload, "sample", lambda self, model: "")  # not what is tested
    fields = {k: v for k, v in TINY.items() if k != "batch_size"}
    config = train.TrainConfig(**{**fields, "n_head": 4, "steps": 4, "eval_every": 4}, strategy="pipeline",
                               global_batch_size=8, dp=2, microbatches=2, checkpoint_every=2, timeout=60)
    single = train.train_single(dataclasses.replace(config, strategy="single"), text, report=False)
    for driver, name, first, second, ranks in (
            (pipeline_train.train_pipeline, "pipeline", {"schedule": "gpipe"}, {"dp": 1, "microbatches": 4}, 4),
            (train_3d, "3d", {"tp": 2}, {"dp": 1, "tp": 4, "microbatches": 4}, 8)):
        directory = tmp_path / name
        resumed = dataclasses.replace(config, strategy=name, checkpoint_dir=str(directory), **first)
        assert run(driver, ranks, resumed, text, stop_after_steps=2) is None
        result = run(driver, ranks, resumed, text, resume=True, **second)
        assert max_difference(weights(single.model), weights(result.model)) < 1e-10, name
        assert cli.main(["checkpoint", "consolidate", str(directory), str(tmp_path / f"{name}.npz")]) == 0
        dense, _ = checkpoint_io.load_weights(tmp_path / f"{name}.npz")
        final = result.model.state_dict()
        assert dense.keys() == final.keys()
        assert all(np.array_equal(dense[k], np.asarray(v)) for k, v in final.items()), name


# -- the refusals -------------------------------------------------------------------------------

@pytest.mark.parametrize("change,message", [
    ({"dp": 5}, r"--global-batch-size 12 is not divisible by --dp 5 \(each pipeline reads G / dp samples a step\); "
                r"use a multiple of 5, or --dp among \[1, 2\]"),
    ({"dp": 2, "microbatches": 4}, r"gives each of the 2 pipelines 6 samples a step, which --microbatches 4 does not "
                                   r"divide .* use --microbatches among \[1, 2, 3, 6\], or another G"),
    ({"schedule": "pipedream", "microbatches": 4}, r"applies to the flushing schedules \(gpipe, 1f1b, interleaved, "
                                                   r"zero-bubble\), not to --schedule pipedream: .* stashed weight "
                                                   r"versions, with no flush"),
])
def test_a_global_batch_the_pipelines_cannot_split_is_refused(change, message):
    config = dataclasses.replace(MLP, hidden=(8,) * 7, **change)
    with pytest.raises(ValueError, match=message):
        pipeline_train.check_pipeline(10, config)
    pipeline_train.check_pipeline(12, dataclasses.replace(MLP, hidden=(8,) * 7, dp=6, microbatches=2))


def test_the_flags_take_a_pipelines_global_batch_but_not_a_parameter_servers():
    args = ["--strategy", "pipeline", "--global-batch-size", "8", "--dp", "2"]
    config = train_config(train_parser().parse_args(args))
    assert config.global_batch_size == 8 and fault.is_elastic(config)
    with pytest.raises(ValueError, match=r"applies to --strategy single, ddp \(also --zero\), fsdp, tp, pipeline, "
                                         r"3d, cp and ep, not to --strategy ps; give it --batch-size instead"):
        train_config(train_parser().parse_args(["--strategy", "ps", "--global-batch-size", "8"]))
    assert not fault.is_elastic(dataclasses.replace(config, strategy="3d", zero=True))


def test_without_a_global_batch_a_pipeline_resumes_on_its_own_layout_only(mlp, tmp_path):
    dataset, _ = mlp
    config = dataclasses.replace(MLP, global_batch_size=None, batch_size=6, checkpoint_dir=str(tmp_path / "run"),
                                 checkpoint_every=2, epochs=1)
    assert run(pipeline_train.train_pipeline, 2, config, dataset, stop_after_steps=2) is None
    with pytest.raises(CheckpointMismatchError, match=r"dp: 1 there, 2 here\); .* \(a checkpoint resumes on another "
                                                      r"number of ranks with --global-batch-size, for .* pipeline "
                                                      r"\(also on another --dp, number of stages"):
        run(pipeline_train.train_pipeline, 2, config, dataset, dp=2, resume=True)


def test_parts_that_cannot_be_cut_again_are_refused_by_name():
    """reshard_pipeline by hand: a 3d --zero checkpoint, parts of another cut or model, more
    stages than the model has layers."""
    model = nn.mlp([4, 5, 3], rng=0)
    split = lambda n: pipeline_train.split_stages(model, n)
    here = elastic.PipelineLayout(1, 2)
    saved = {"strategy": "pipeline", "world_size": 2, "dp": 1, "schedule": "1f1b"}
    with pytest.raises(ReshardError, match="a 3d run with --zero keeps AdamW's moments as ZeRO-1 shards"):
        elastic.reshard_pipeline([{"config": {**saved, "zero": True}}] * 2, here, model, split)
    with pytest.raises(ReshardError, match=r"pipeline rank 0's part holds .* that its stages do not"):
        elastic.reshard_pipeline([{"config": saved, "model": {"0.0.bias": 0}}] * 2, here, model, split)
    with pytest.raises(ReshardError, match=r"its 4 stages \(dp 1 x pp 4\) do not cut this model"):
        elastic.reshard_pipeline([{"config": {**saved, "world_size": 4}}] * 4, here, model, split)
    with pytest.raises(ReshardError, match="2 ranks' parts, but its layout"):
        elastic.join_stages([{}] * 2, elastic.PipelineLayout(2, 2), [])


@pytest.mark.parametrize("args,message", [
    (["--strategy", "pipeline", "--dp", "2"], r"--min-ranks 3: no number of ranks from 3 down to 3 can run this job "
                                              r"\(--strategy pipeline needs a multiple of --dp 2"),
    (["--strategy", "3d", "--model", "gpt", "--zero", "--dp", "2"], r"fsdp, tp, pipeline .* or 3d \(also another "
                                                                     r"--tp; not with --zero\), not this job "
                                                                     r"\(--strategy 3d\)"),
])
def test_launch_min_ranks_keeps_the_pipelines_flags(args, message, capsys):
    assert cli.main(["launch", "-n", "4", "--min-ranks", "3", "--", "train", *args, "--global-batch-size", "8",
                     "--checkpoint-dir", "d"]) == 2
    assert re.search(message, capsys.readouterr().err)
