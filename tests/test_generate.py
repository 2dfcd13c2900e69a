"""``python -m minidist generate`` (issue 19, part 5): text from a trained GPT, read back from a
``--save-model`` file or a checkpoint (folder or file, single or pipeline), deterministic with a
seed; a prompt outside the vocabulary, an MLP's weights, a missing file are clear errors."""
import dataclasses
import errno

import numpy as np
import pytest

from minidist import cli, sim, train, workloads
from minidist.checkpoint_io import METADATA_KEY, CheckpointError, load_weights
from minidist.fault import TrainingStopped
from minidist.parallel.pipeline.train import train_pipeline

TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 20
TINY = dict(model="gpt", dataset="shakespeare", n_layer=2, n_head=2, n_embd=16, block_size=8, batch_size=4, steps=4,
            eval_every=2, lr=1e-2, weight_decay=0.1, warmup_steps=1, progress=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A trained GPT's --save-model file and the model itself."""
    path = tmp_path_factory.mktemp("gpt") / "gpt.npz"
    config = train.TrainConfig(**TINY, save_model=str(path))
    result = train.train_single(config, workloads.load_text(TEXT))
    return path, result.model


def generate(capsys, *args):
    status = cli.main(["generate", *map(str, args)])
    out, err = capsys.readouterr()
    return status, out, err


def test_the_saved_file_holds_the_weights_the_config_and_the_vocabulary(saved):
    path, model = saved
    weights, metadata = load_weights(path)
    assert metadata["model"] == "gpt" and metadata["gpt_config"]["n_layer"] == 2
    assert metadata["tokenizer"]["vocab"] == workloads.load_text(TEXT).tokenizer.vocab
    assert weights.keys() == model.state_dict().keys() and METADATA_KEY not in weights
    with np.load(path) as npz:  # the state dict's arrays as np.savez writes them: evaluate --checkpoint reads it
        assert np.array_equal(npz["transformer.wte.weight"], model.transformer.wte.weight.data)


def test_generate_is_deterministic_with_a_seed_and_continues_the_prompt(saved, capsys):
    path, model = saved
    first = generate(capsys, "--checkpoint", path, "--prompt", "To be", "--max-new-tokens", 30, "--seed", 3)
    again = generate(capsys, "--checkpoint", path, "--prompt", "To be", "--max-new-tokens", 30, "--seed", 3)
    other = generate(capsys, "--checkpoint", path, "--prompt", "To be", "--max-new-tokens", 30, "--seed", 4)
    assert first[0] == 0 and first == again and first[1] != other[1]
    text = first[1].rstrip("\n")
    assert text.startswith("To be") and len(text) == len("To be") + 30
    # the same text as the model in memory draws with that seed
    tokenizer = workloads.load_text(TEXT).tokenizer
    assert text == workloads.generate_text(model, tokenizer, "To be", 30, seed=3)


def test_temperature_and_top_k_reach_the_sampler(saved, capsys):
    path, _ = saved
    greedy = [generate(capsys, "--checkpoint", path, "--prompt", "the", "--top-k", 1, "--seed", s)[1]
              for s in (0, 1)]
    assert greedy[0] == greedy[1]  # top-k 1 is greedy: the seed no longer matters
    cold = generate(capsys, "--checkpoint", path, "--prompt", "the", "--temperature", "0.01", "--seed", 5)[1]
    assert cold == greedy[0]


def test_a_prompt_outside_the_vocabulary_is_a_usage_error_naming_the_character(saved, capsys):
    path, _ = saved
    status, out, err = generate(capsys, "--checkpoint", path, "--prompt", "To be, Z€")
    assert status == 2 and out == ""
    assert "--prompt: 'Z', '€' are not in the model's vocabulary of" in err and "Traceback" not in err
    status, _, err = generate(capsys, "--checkpoint", path, "--prompt", "")
    assert status == 2 and "--prompt is empty" in err


def test_an_mlp_s_weights_or_a_missing_file_are_errors(tmp_path, capsys):
    mlp = tmp_path / "mlp.npz"
    np.savez(mlp, **{"0.weight": np.zeros((2, 3), np.float32)})
    status, _, err = generate(capsys, "--checkpoint", mlp, "--prompt", "a")
    assert status == 2 and "holds no GPT" in err
    status, _, err = generate(capsys, "--checkpoint", tmp_path / "missing.npz", "--prompt", "a")
    assert status == 1 and "no such file" in err and "Traceback" not in err
    status, _, err = generate(capsys, "--checkpoint", tmp_path, "--prompt", "a")  # a folder without checkpoints
    assert status == 1 and "holds no checkpoint" in err


def test_generate_reads_a_checkpoint_folder_and_file(tmp_path, capsys):
    config = train.TrainConfig(**TINY, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    with pytest.raises(TrainingStopped):
        train.train_single(dataclasses.replace(config, stop_after_steps=3), workloads.load_text(TEXT))
    capsys.readouterr()
    folder = generate(capsys, "--checkpoint", tmp_path, "--prompt", "To", "--max-new-tokens", 12)
    file = generate(capsys, "--checkpoint", tmp_path / "ckpt-00000002.npz", "--prompt", "To", "--max-new-tokens", 12)
    assert folder[0] == 0 and folder == file  # the folder's newest is step 2


def test_generate_puts_a_pipeline_checkpoint_back_together(tmp_path):
    text = workloads.load_text(TEXT)
    config = train.TrainConfig(**{**TINY, "n_layer": 4}, strategy="pipeline", schedule="interleaved",
                               stages_per_rank=2, microbatches=2, checkpoint_dir=str(tmp_path), checkpoint_every=4)
    results = sim.run(lambda comm: train_pipeline(comm, config, text), 2)
    model, tokenizer = workloads.load_language_model(tmp_path)
    for name, value in results[0].model.state_dict().items():
        assert np.array_equal(model.state_dict()[name], value), name
    assert tokenizer.vocab == text.tokenizer.vocab and not model.training


def test_a_corrupt_weights_file_is_a_checkpoint_error(tmp_path):
    path = tmp_path / "bad.npz"
    path.write_bytes(b"not a zip")
    with pytest.raises(CheckpointError, match="not a readable .npz"):
        workloads.load_language_model(path)


# ----------------------------------------------------------------------------- issue 36, item 4: bad input


@pytest.mark.parametrize("name,more", [("tp", {}), ("fsdp", {}), ("ddp", {"zero": True})])
def test_generate_reads_a_sharded_checkpoint_as_consolidate_would(name, more, tmp_path, capsys):
    """A tp, FSDP or ZeRO-1 checkpoint holds each rank's part, not the model's state_dict: generate
    consolidates it on the fly (the strategy record's ``consolidate``) and draws the same text as
    from the file ``checkpoint consolidate`` writes (before: "missing keys '0.0.wpe.weight'")."""
    from minidist import strategy

    config = train.TrainConfig(**TINY, strategy=name, checkpoint_dir=str(tmp_path / "run"), checkpoint_every=2,
                               **more)
    record = strategy.resolve(config)
    sim.run(lambda comm: record.driver(comm, config, workloads.load_text(TEXT)), 2)
    assert cli.main(["checkpoint", "consolidate", str(tmp_path / "run"), str(tmp_path / "dense.npz")]) == 0
    said = capsys.readouterr().out  # the tied weight counted once (it was twice)
    numbers = workloads.load_language_model(tmp_path / "dense.npz")[0].num_parameters()
    flags = record.label  # a variant by its flags: "ddp --zero" (aa11bfe)
    assert f"--strategy {flags} on 2 ranks): 29 tensors, {numbers} numbers (the tied lm_head.weight counted " \
           "once) -> " in said, said
    folder = generate(capsys, "--checkpoint", tmp_path / "run", "--prompt", "To", "--max-new-tokens", 12)
    dense = generate(capsys, "--checkpoint", tmp_path / "dense.npz", "--prompt", "To", "--max-new-tokens", 12)
    assert folder[0] == 0 and folder == dense, folder[2]


def test_a_truncated_weights_file_is_a_one_line_error(saved, tmp_path, capsys):
    path, _ = saved
    cut = tmp_path / "cut.npz"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    status, out, err = generate(capsys, "--checkpoint", cut, "--prompt", "To")
    assert status == 1 and out == "" and "Traceback" not in err
    assert "truncated or corrupt" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("temperature", ["1e-320", "1e-300", "1e-12"])
def test_a_temperature_too_small_to_divide_by_is_a_usage_error(saved, capsys, temperature):
    """Logits divided by 1e-320 overflow: the text was only newlines (or spaces); now a usage
    error naming greedy decoding (--top-k 1) and the smallest temperature taken."""
    path, _ = saved
    status, out, err = generate(capsys, "--checkpoint", path, "--prompt", "To", "--temperature", temperature)
    assert status == 2 and out == "" and "Traceback" not in err
    assert f"--temperature {temperature} is too small" in err and "--top-k 1" in err
    assert generate(capsys, "--checkpoint", path, "--prompt", "To", "--temperature", "1e-6", "--top-k", "1")[0] == 0


def test_weights_that_are_not_finite_are_refused_naming_the_tensor(saved, tmp_path, capsys):
    """A diverged run's NaN weights sampled garbage silently; now an error naming the tensor."""
    from minidist.checkpoint_io import save_weights

    path, _ = saved
    weights, metadata = load_weights(path)
    weights["transformer.h.1.mlp.c_fc.weight"][0, 3] = np.nan
    save_weights(tmp_path / "nan.npz", weights, metadata)
    status, out, err = generate(capsys, "--checkpoint", tmp_path / "nan.npz", "--prompt", "To")
    assert status == 1 and out == "" and "Traceback" not in err
    assert "transformer.h.1.mlp.c_fc.weight" in err and "NaN or infinite" in err


def test_a_checkpoint_s_strategy_is_found_for_configs_older_than_a_variant_s_field():
    """A ddp checkpoint written before --zero existed has no "zero" field: ddp's own record
    (it raised AttributeError from ZeRO-1's rule)."""
    from minidist import strategy

    assert workloads.checkpoint_strategy({"strategy": "ddp"}) is strategy.get("ddp")
    assert workloads.checkpoint_strategy({"strategy": "ddp", "zero": True}).label == "ddp --zero"
    assert workloads.checkpoint_strategy({"strategy": "nonesuch"}) is None


def full_disk(file, **arrays):
    """``np.savez`` on a full disk: part of the file written, then ENOSPC."""
    file.write(b"PK\x03\x04 the first bytes of a zip")
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("name", ["single", "tp"])
def test_save_model_onto_a_full_disk_is_one_line_and_leaves_no_half_file(name, tmp_path, monkeypatch, capsys):
    """Issue 36, item 4: --save-model onto a full disk was an OSError traceback. Now the run ends with
    CheckpointError naming the path, the cause and the fix (train prints it as one line, exit 1); no
    half-written file or temporary is left, and a previous file keeps its content."""
    from minidist import checkpoint_io, strategy

    out = tmp_path / "gpt.npz"
    out.write_bytes(b"the previous weights")
    config = train.TrainConfig(**TINY, strategy=name, save_model=str(out))
    record = strategy.resolve(config)
    monkeypatch.setattr(checkpoint_io.np, "savez", full_disk)
    with pytest.raises(CheckpointError) as failure:
        if name == "single":
            train.train_single(config, workloads.load_text(TEXT))
        else:
            sim.run(lambda comm: record.driver(comm, config, workloads.load_text(TEXT)), 2)
    assert str(failure.value) == (f"cannot write --save-model {out}: the disk is full; nothing was written there (a "
                                  f"previous {out}, if any, is intact): free some space there or give --save-model a "
                                  "path on another disk")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt.npz"] and out.read_bytes() == b"the previous weights"


def test_train_prints_a_full_disk_as_one_line(tmp_path, monkeypatch, capsys):
    from minidist import checkpoint_io

    monkeypatch.setattr(checkpoint_io.np, "savez", full_disk)
    status = cli.main(["train", "--epochs", "1", "--no-progress", "--save-model", str(tmp_path / "mlp.npz")])
    err = capsys.readouterr().err
    assert status == 1 and err.startswith("minidist train: error: cannot write --save-model ") and \
        err.count("\n") == 1 and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


def test_consolidate_onto_a_full_disk_is_one_line_and_leaves_no_half_file(tmp_path, monkeypatch, capsys):
    """Issue 36, item 4: `checkpoint consolidate` of a tp checkpoint onto a full disk was an OSError
    traceback: now one line naming OUT and the fix, exit 1, and nothing half-written."""
    from minidist import checkpoint_io, strategy

    config = train.TrainConfig(**TINY, strategy="tp", checkpoint_dir=str(tmp_path / "run"), checkpoint_every=2)
    sim.run(lambda comm: strategy.resolve(config).driver(comm, config, workloads.load_text(TEXT)), 2)
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "dense.npz"
    monkeypatch.setattr(checkpoint_io.np, "savez", full_disk)
    assert cli.main(["checkpoint", "consolidate", str(tmp_path / "run"), str(out)]) == 1
    said, err = capsys.readouterr()
    assert err == (f"minidist checkpoint: error: cannot write OUT {out}: the disk is full; nothing was written there "
                   f"(a previous {out}, if any, is intact): free some space there or give OUT a path on another "
                   "disk\n") and "consolidated" not in said, err
    assert list(out.parent.iterdir()) == []
