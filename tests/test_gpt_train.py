"""Training the GPT with the drivers of ``python -m minidist train --model gpt`` (issue 19, part 5):
the command line's checks, ddp and the pipeline against the single process (the oracle), resume
bit for bit, the tied embedding kept equal across stages. On the simulator and in-process; the
mpiexec runs are in test_gpt_train_mpi.py."""
import dataclasses

import numpy as np
import pytest
from scenarios import assert_same_weights, assert_usage_error, on_sim, stop_and_resume

from minidist import cli, sim, train, workloads
from minidist.checkpoint_io import CheckpointMismatchError
from minidist.cli import train as train_cli
from minidist.fault import TrainingStopped
from minidist.models.gpt import GPT
from minidist.models.gpt_pipeline import block_balance, gpt_sequential, tied_parameters
from minidist.parallel.data_parallel.train import train_ddp
from minidist.parallel.pipeline.train import check_pipeline, train_pipeline

# A small text (every letter, some punctuation) so the runs take a second; its tokenizer has 40-odd ids.
TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
        "First Citizen:\nYou are all resolved rather to die than to famish?\n\nAll:\nResolved. resolved.\n\n"
        "The quick brown fox jumps over the lazy dog; THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG!\n") * 8
TINY = dict(model="gpt", dataset="shakespeare", n_layer=4, n_head=2, n_embd=16, block_size=8, batch_size=8, steps=6,
            eval_every=3, lr=1e-2, weight_decay=0.1, warmup_steps=2, grad_clip=0.5, progress=False)


@pytest.fixture(scope="module")
def text():
    return workloads.load_text(TEXT)


def float64_model(work):
    """``LanguageModelWorkload.model`` in float64 (the :func:`float64` fixture's, and the mpiexec
    scripts' in tests/mpi), so that single and parallel runs agree to rounding."""
    return GPT(work.gpt_config, rng=work.config.seed, dtype="float64", device=work.config.device)


@pytest.fixture
def float64(monkeypatch):
    """The workload's GPT in float64 (:func:`float64_model`)."""
    monkeypatch.setattr(workloads.LanguageModelWorkload, "model", float64_model)


def record_dense_clip_norms(monkeypatch) -> list:
    """Wrap ``nn.clip_grad_norm_`` (what the one-process run clips with) so that every norm it
    returns is appended, as a float, to the list returned."""
    norms, dense_clip = [], train.nn.clip_grad_norm_

    def recorded(parameters, max_norm, *args, **kwargs):
        norm = dense_clip(parameters, max_norm, *args, **kwargs)
        norms.append(float(norm))
        return norm

    monkeypatch.setattr(train.nn, "clip_grad_norm_", recorded)
    return norms


def weights(model):
    return {k: np.asarray(v, dtype=np.float64) for k, v in model.state_dict().items()}


def max_difference(a, b):
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def differences_from(single, result, tolerance: float = 1e-10) -> list[str]:
    """What differs between a parallel run's TrainResult and one process's (the mpiexec scripts
    of tests/mpi, which print these instead of asserting): the weights, then each evaluation's
    train and val loss, beyond ``tolerance``. Empty when they agree."""
    problems = []
    difference = max_difference(weights(single.model), weights(result.model))
    if not difference < tolerance:
        problems.append(f"the weights differ from one process's by up to {difference:.3g}")
    for a, b in zip(single.history, result.history, strict=True):
        if abs(a["val_loss"] - b["val_loss"]) > tolerance or abs(a["train_loss"] - b["train_loss"]) > tolerance:
            problems.append(f"step {a['step']}: losses {b['train_loss']}, {b['val_loss']} != {a['train_loss']}, "
                            f"{a['val_loss']}")
    return problems


# ----------------------------------------------------------------------------- the command line


@pytest.mark.parametrize("args,message", [
    (["--model", "gpt", "--hidden", "64"], "--hidden applies to --model mlp only, not to --model gpt"),
    (["--model", "gpt", "--epochs", "3"], "--epochs applies to --model mlp only, not to --model gpt"),
    (["--model", "gpt", "--momentum", "0.5"], "--momentum applies to --model mlp only"),
    (["--model", "gpt", "--warmup-epochs", "1"], "--warmup-epochs applies to --model mlp only"),
    (["--n-layer", "2"], "--n-layer applies to --model gpt only, not to --model mlp"),
    (["--steps", "10"], "--steps applies to --model gpt only, not to --model mlp"),
    (["--grad-clip", "1"], "--grad-clip applies to --model gpt only"),
    (["--dropout", "0.1"], "--dropout applies to --model gpt only"),
    (["--model", "gpt", "--strategy", "ps"], "--strategy ps trains --model mlp only; --model gpt trains with "
                                             "--strategy single, ddp, fsdp, tp, pipeline"),
    (["--strategy", "tp"], "--strategy tp trains --model gpt only (it splits the transformer's layers)"),
    (["--model", "gpt", "--sequence-parallel"], "--sequence-parallel applies to --strategy fsdp, tp, 3d and cp only"),
    (["--model", "gpt", "--strategy", "tp", "--precision", "bf16"], "--strategy tp trains in fp32"),
    (["--model", "gpt", "--strategy", "tp", "--scale-lr"], "--strategy tp splits the model, every rank reads"),
    (["--model", "gpt", "--strategy", "pipeline", "--schedule", "pipedream"], "--schedule pipedream trains the MLP"),
    (["--model", "gpt", "--dataset", "digits"], "--dataset digits is not a data set of --model gpt; use shakespeare"),
    (["--dataset", "shakespeare"], "--dataset shakespeare is not a data set of --model mlp; use digits or mnist"),
    (["--model", "gpt", "--n-embd", "30", "--n-head", "4"], "--n-embd 30 is not divisible by --n-head 4"),
    (["--model", "gpt", "--dropout", "1"], "argument --dropout: must be in [0, 1), got 1"),
    (["--model", "gpt", "--steps", "0"], "argument --steps: must be a positive integer, got 0"),
    (["--model", "gpt", "--grad-clip", "-1"], "argument --grad-clip: must be a finite number >= 0, got -1"),
    (["--model", "bert"], "argument --model: invalid choice: 'bert'"),
])
def test_flags_that_do_not_apply_to_the_model_are_usage_errors(args, message, capsys, monkeypatch):
    assert_usage_error(args, message, capsys, monkeypatch)


def test_a_pipeline_with_more_stages_than_blocks_is_a_usage_error_naming_n_layer():
    config = dataclasses.replace(train.TrainConfig(**TINY), strategy="pipeline", n_layer=2, microbatches=2)
    with pytest.raises(ValueError, match=r"the GPT has only 2 blocks .* give --n-layer 4 or more"):
        check_pipeline(4, config)
    with pytest.raises(ValueError, match="--microbatches 9 exceeds --batch-size 8"):
        check_pipeline(2, dataclasses.replace(config, microbatches=9))
    check_pipeline(2, config)


def test_gpt_flags_become_a_train_config_with_the_model_s_defaults():
    config = cli.train_config(cli.train_parser().parse_args(["--model", "gpt", "--n-layer", "2", "--steps", "30",
                                                             "--eval-every", "7"]))
    assert (config.model, config.dataset, config.n_layer, config.steps, config.eval_every) == (
        "gpt", "shakespeare", 2, 30, 7)
    assert (config.lr, config.weight_decay, config.batch_size) == (train.GPT_LR, train.GPT_WEIGHT_DECAY,
                                                                   train.GPT_BATCH_SIZE)
    assert config.epochs == 5  # ceil(30 / 7) evaluation intervals, one fit epoch each
    assert cli.train_config(cli.train_parser().parse_args([])) == train.TrainConfig()  # the MLP's untouched


def test_the_gpt_run_prints_evaluations_a_sample_and_the_final_val_loss(text, monkeypatch, capsys):
    monkeypatch.setattr(train, "load_dataset", lambda config: text)
    assert cli.main(["train", "--model", "gpt", "--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size",
                     "8", "--batch-size", "4", "--steps", "4", "--eval-every", "2", "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    evaluations = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in evaluations] == ["2/4", "4/4"]
    for field in ("train_loss=", "val_loss=", "time/step=", "ms", "tokens/s="):
        assert all(field in line for line in evaluations), field
    assert lines[-1].startswith("final val_loss=") and len(lines[-1].split("=")[1]) == 6  # X.XXXX
    assert float(lines[-1].split("=")[1]) == pytest.approx(float(evaluations[-1].split("val_loss=")[1].split()[0]))
    assert lines.index("sample:") < len(lines) - 1


# ----------------------------------------------------------------------------- ddp and pipeline follow one process


def test_ddp_on_two_simulated_ranks_follows_the_single_process(text, float64):
    config = train.TrainConfig(**TINY)
    single = train.train_single(config, text)
    ddp = dataclasses.replace(config, strategy="ddp", batch_size=4, scale_lr=False)  # the same global batch
    results = sim.run(lambda comm: train_ddp(comm, ddp, text), 2)
    assert results[1] is None
    assert max_difference(weights(single.model), weights(results[0].model)) < 1e-10
    for a, b in zip(single.history, results[0].history):
        assert abs(a["val_loss"] - b["val_loss"]) < 1e-10 and abs(a["train_loss"] - b["train_loss"]) < 1e-10


def test_ddp_in_float32_follows_the_single_process_to_1e_4(text):
    config = dataclasses.replace(train.TrainConfig(**TINY), steps=20, eval_every=10)
    single = train.train_single(config, text)
    ddp = dataclasses.replace(config, strategy="ddp", batch_size=4, scale_lr=False)
    results = sim.run(lambda comm: train_ddp(comm, ddp, text), 2)
    assert [round(r["step"]) for r in results[0].history] == [10, 20]
    for a, b in zip(single.history, results[0].history):
        assert abs(a["val_loss"] - b["val_loss"]) < 1e-4 and abs(a["train_loss"] - b["train_loss"]) < 1e-4
    assert abs(single.val_loss - results[0].val_loss) < 1e-4


def test_each_ddp_rank_reads_its_rows_of_the_single_process_batch(text):
    config = train.TrainConfig(**TINY)
    work = train.workload_for(config, text)
    whole = work.loader()
    halves = [train.workload_for(dataclasses.replace(config, batch_size=4), text).loader(rank, 2) for rank in (0, 1)]
    for loader in (whole, *halves):
        loader.set_epoch(1)
    for (x, y), (x0, y0), (x1, y1) in zip(whole, *halves):
        assert np.array_equal(x, np.concatenate([x0, x1])) and np.array_equal(y, np.concatenate([y0, y1]))
    assert whole.windows.step == halves[0].windows.step == 6  # the stream's position after epoch 2 (steps 3-5)


@pytest.mark.parametrize("schedule,ranks,extra", [
    ("1f1b", 2, {}),
    ("gpipe", 4, {}),                                # one block per stage: embeddings + 1, 1, 1, 1 + head
    ("interleaved", 2, {"stages_per_rank": 2}),      # the first and last stage on different ranks, two each
    ("zero-bubble", 2, {}),
    ("1f1b", 4, {"dp": 2, "batch_size": 4, "scale_lr": False}),  # 2 pipelines: the tied sum after averaging
    ("1f1b", 1, {}),                                 # one rank, one stage: wte and lm_head one Parameter
    ("interleaved", 1, {"stages_per_rank": 2}),      # one rank, two stages: the tied weight in both
])
def test_the_pipelined_gpt_follows_the_single_process(text, float64, schedule, ranks, extra):
    config = train.TrainConfig(**TINY)
    single = train.train_single(config, text)
    piped = dataclasses.replace(config, strategy="pipeline", schedule=schedule, microbatches=2, **extra)
    results = sim.run(lambda comm: train_pipeline(comm, piped, text), ranks)
    assert all(r is None for r in results[1:])
    assert max_difference(weights(single.model), weights(results[0].model)) < 1e-10
    assert [round(r["loss"], 10) for r in results[0].history] == [round(r["loss"], 10) for r in single.history]
    assert abs(single.val_loss - results[0].val_loss) < 1e-10


def test_without_the_tied_sum_the_pipeline_would_drift(text, float64, monkeypatch):
    # the oracle above must be able to fail: skip the exchange and the copies of wte part ways
    from minidist.parallel.pipeline.step import PipelineStep

    monkeypatch.setattr(PipelineStep, "_sum_tied_gradients", lambda self: None)
    config = train.TrainConfig(**TINY)
    single = train.train_single(config, text)
    piped = dataclasses.replace(config, strategy="pipeline", schedule="1f1b", microbatches=2)
    results = sim.run(lambda comm: train_pipeline(comm, piped, text), 2)
    assert max_difference(weights(single.model), weights(results[0].model)) > 1e-4


def test_the_tied_copies_stay_equal_on_the_first_and_last_stage(text, monkeypatch):
    from minidist.parallel.pipeline import train as pipeline_train

    config = dataclasses.replace(train.TrainConfig(**TINY), strategy="pipeline", microbatches=2)
    seen, build = {}, pipeline_train.build_stages

    def spy(work, config, dataset, grid, num_stages):  # each rank (a thread of the sim) notes its copy
        built = build(work, config, dataset, grid, num_stages)
        seen[grid.pp_rank] = built[0].transformer.wte.weight
        return built

    monkeypatch.setattr(pipeline_train, "build_stages", spy)
    sim.run(lambda comm: train_pipeline(comm, config, text), 2)
    assert seen[0] is not seen[1] and np.array_equal(seen[0].data, seen[1].data)  # two copies, bit-equal
    assert not np.array_equal(seen[0].data, train.workload_for(config, text).model().transformer.wte.weight.data)


def test_the_chain_computes_the_gpt_s_logits_and_cuts_whole_blocks(text):
    config = train.TrainConfig(**TINY)
    model = train.workload_for(config, text).model()
    chain = gpt_sequential(model)
    x = np.arange(16).reshape(2, 8) % text.vocab_size
    assert np.array_equal(chain(x).data, model(x)[0].data)
    assert block_balance(4, 4) == [2, 1, 1, 2] and block_balance(5, 2) == [4, 3] and block_balance(4, 1) == [6]
    with pytest.raises(ValueError, match="give --n-layer 3 or more"):
        block_balance(2, 3)
    assert tied_parameters(chain[:2], chain[2:]) == [model.transformer.wte.weight]
    assert tied_parameters(chain, chain) == []


# ----------------------------------------------------------------------------- checkpoints


def test_resume_is_bit_identical_and_holds_the_optimizer_schedule_windows_and_vocabulary(text, tmp_path):
    config = dataclasses.replace(train.TrainConfig(**TINY), checkpoint_dir=str(tmp_path), checkpoint_every=2)
    from minidist.checkpoint_io import load_checkpoint

    def saved():  # checkpoint at 4, killed after 5
        state = load_checkpoint(tmp_path / "ckpt-00000004.npz")
        assert state["extra"]["windows"]["step"] == 4 and state["extra"]["vocabulary"] == text.tokenizer.state_dict()
        assert state["lr_schedule"]["count"] == 4 and state["optimizer"]["step"][0] == 4
        assert state["metadata"]["gpt_config"]["n_embd"] == 16

    whole, resumed = stop_and_resume(lambda config: train.train_single(config, text), config, 5, saved)
    assert_same_weights(whole, resumed)
    assert [r["val_loss"] for r in resumed.history] == [r["val_loss"] for r in whole.history]


def test_ddp_resume_on_the_simulator_is_bit_identical(text, tmp_path):
    config = dataclasses.replace(train.TrainConfig(**TINY), strategy="ddp", batch_size=4, checkpoint_dir=str(tmp_path),
                                 checkpoint_every=2)
    assert_same_weights(*stop_and_resume(on_sim(train_ddp, text, 2), config, stop_after=3))


@pytest.mark.parametrize("change,field", [({"n_embd": 32}, "n_embd"), ({"n_layer": 2}, "n_layer"),
                                          ({"block_size": 16}, "block_size"), ({"steps": 12}, "steps")])
def test_resume_with_other_model_sizes_is_refused_naming_the_field(text, tmp_path, change, field):
    config = dataclasses.replace(train.TrainConfig(**TINY), checkpoint_dir=str(tmp_path), checkpoint_every=2)
    with pytest.raises(TrainingStopped):
        train.train_single(dataclasses.replace(config, stop_after_steps=2), text)
    with pytest.raises(CheckpointMismatchError, match=rf"{field}: .* there, .* here"):
        train.train_single(dataclasses.replace(config, resume=True, **change), text)


def test_an_mlp_checkpoint_folder_is_not_resumed_as_a_gpt(text, tmp_path):
    mlp = train.TrainConfig(epochs=1, checkpoint_dir=str(tmp_path), checkpoint_every=5, progress=False)
    with pytest.raises(TrainingStopped):
        train.train_single(dataclasses.replace(mlp, stop_after_steps=5), train.load_dataset(mlp))
    gpt = dataclasses.replace(train.TrainConfig(**TINY), checkpoint_dir=str(tmp_path), resume=True)
    with pytest.raises(CheckpointMismatchError, match="model: 'mlp' there, 'gpt' here"):
        train.train_single(gpt, text)


def test_the_checkpoint_mismatch_is_one_usage_line_on_the_command_line(text, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(train, "load_dataset", lambda config: text)
    common = ["train", "--model", "gpt", "--n-head", "2", "--n-embd", "16", "--block-size", "8", "--steps", "4",
              "--no-progress", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "2"]
    assert cli.main([*common, "--n-layer", "2", "--stop-after-steps", "2"]) == 0
    assert cli.main([*common, "--n-layer", "3", "--resume"]) == 2
    assert "n_layer: 2 there, 3 here" in capsys.readouterr().err


def test_the_table_is_keyed_by_strategy_and_serves_both_models():
    assert set(train_cli.DRIVERS) == {"single", "single-moe", "ddp", "ps", "pipeline", "pipedream", "tp", "fsdp",
                                      "zero", "3d", "cp", "ep", "diloco"}
    gpt = train.TrainConfig(**TINY)
    assert train_cli.driver_name(dataclasses.replace(gpt, strategy="ddp")) == "ddp"
    assert isinstance(train.workload_for(gpt, workloads.load_text(TEXT)), workloads.LanguageModelWorkload)
    with pytest.raises(ValueError, match="model must be one of mlp, gpt"):
        train.workload_for(dataclasses.replace(gpt, model="bert"), None)


@pytest.mark.parametrize("change", [{"comm_hook": "fp16"}, {"comm_hook": "int8"}, {"precision": "bf16"},
                                    {"precision": "fp16"}])
def test_ddp_trains_the_gpt_with_compressed_gradients_and_mixed_precision(text, change):
    config = train.TrainConfig(**TINY)
    single = train.train_single(config, text)
    ddp = dataclasses.replace(config, strategy="ddp", batch_size=4, scale_lr=False, **change)
    result = sim.run(lambda comm: train_ddp(comm, ddp, text), 2)[0]
    assert 0 < abs(result.val_loss - single.val_loss) < 0.02  # near the float32 run, not equal to it
    assert result.figures.get("comm_hook") == change.get("comm_hook")
    assert result.figures.get("precision", "fp32") == change.get("precision", "fp32")


def test_the_config_of_the_gpt_is_the_command_lines_run():
    """Issue 30: the per-model defaults live in TrainConfig (``train.MODEL_DEFAULTS``), so
    ``TrainConfig(model="gpt")`` is the run ``train --model gpt`` starts, field for field, and the
    MLP's default config the run of ``train``; a value given is kept."""
    from minidist.cli.train_flags import train_config, train_parser
    for model in ("gpt", "mlp"):
        assert train.run_fields(train.TrainConfig(model=model)) == train.run_fields(
            train_config(train_parser().parse_args(["--model", model])))
    gpt = train.TrainConfig(model="gpt")
    assert (gpt.lr, gpt.weight_decay, gpt.batch_size, gpt.dataset) == (train.GPT_LR, train.GPT_WEIGHT_DECAY,
                                                                       train.GPT_BATCH_SIZE, "shakespeare")
    assert train.TrainConfig(model="gpt", lr=0.5, weight_decay=0.0).lr == 0.5

