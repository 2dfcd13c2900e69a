"""The main job from the command line, as a user runs it, and the one training loop, train.fit."""
import dataclasses
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from scenarios import assert_usage_error
from test_data import write_idx

from minidist import cli, data, p2p, sim, train
from minidist.checkpoint_io import CheckpointMismatchError
from minidist.cli import train as train_cli
from minidist.parallel.data_parallel.train import train_ddp
from minidist.parallel.parameter_server import train as ps_train
from minidist.parallel.parameter_server.train import train_ps


def run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "minidist", *args], capture_output=True, text=True, timeout=timeout)


def test_default_training_reaches_95_percent_on_digits():
    result = run("train", "--strategy", "single")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert re.fullmatch(r"final test_accuracy=0\.\d{4}", lines[-1])
    assert float(lines[-1].split("=")[1]) >= 0.95
    assert sum(line.startswith("epoch ") and "loss=" in line and "test_accuracy=" in line for line in lines) == 20


@pytest.mark.parametrize("args,message", [
    (["train", "--bogus"], "unrecognized arguments: --bogus"),
    (["train", "--strategy", "magic"], "invalid choice: 'magic'"),
    (["train", "--epochs", "0"], "must be a positive integer"),
    (["train", "--lr", "abc"], "argument --lr"),
    (["train", "--momentum", "1.5"], "argument --momentum: must be in [0, 1)"),
    (["train", "--dataset", "mnist"], "needs --data-dir"),
    (["frobnicate"], "unknown command 'frobnicate'"),
])
def test_usage_errors_not_tracebacks(args, message):
    result = run(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_mnist_files_is_a_usage_error_naming_the_file(tmp_path):
    result = run("train", "--dataset", "mnist", "--data-dir", str(tmp_path))
    assert result.returncode == 2 and "train-images-idx3-ubyte" in result.stderr and "Traceback" not in result.stderr


def test_a_corrupt_mnist_file_is_a_usage_error_naming_it(tmp_path):
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        (tmp_path / f"{name}.gz").write_bytes(b"\x1f\x8b this is not gzip")
    result = run("train", "--dataset", "mnist", "--data-dir", str(tmp_path))
    assert result.returncode == 2 and ".gz" in result.stderr and "Traceback" not in result.stderr


def test_trains_on_mnist_idx_files(tmp_path):
    rng = np.random.default_rng(0)
    for split, n in (("train", 40), ("t10k", 20)):
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        images = np.zeros((n, 28, 28), np.uint8)
        images[np.arange(n), labels, labels] = 255  # a learnable pixel per class
        write_idx(tmp_path / f"{split}-images-idx3-ubyte.gz", images, 0x08, True)
        write_idx(tmp_path / f"{split}-labels-idx1-ubyte.gz", labels, 0x08, True)
    result = run("train", "--dataset", "mnist", "--data-dir", str(tmp_path), "--epochs", "2", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1].startswith("final test_accuracy=")


def test_help_lists_commands():
    result = run("--help")
    assert result.returncode == 0 and "train" in result.stdout and "doctor" in result.stdout


# ----------------------------------------------------------------------------- flags checked in-process


@pytest.mark.parametrize("args,message", [
    (["--lr", "nan"], "argument --lr: must be a finite number > 0, got nan"),
    (["--lr", "inf"], "argument --lr: must be a finite number > 0, got inf"),
    (["--lr", "0"], "argument --lr: must be a finite number > 0, got 0"),
    (["--lr", "-0.1"], "argument --lr: must be a finite number > 0, got -0.1"),
    (["--momentum", "nan"], "argument --momentum: must be in [0, 1), got nan"),
    (["--momentum", "1"], "argument --momentum: must be in [0, 1), got 1"),
    (["--momentum", "-0.5"], "argument --momentum: must be in [0, 1), got -0.5"),
    (["--weight-decay", "-0.001"], "argument --weight-decay: must be a finite number >= 0, got -0.001"),
    (["--weight-decay", "nan"], "argument --weight-decay: must be a finite number >= 0, got nan"),
    (["--warmup-epochs", "inf"], "argument --warmup-epochs: must be a finite number >= 0, got inf"),
    (["--seed", "-1"], "argument --seed: must be an integer >= 0, got -1"),
    (["--strategy", "ddp", "--timeout", "nan"], "argument --timeout: must be a finite number > 0, got nan"),
    (["--strategy", "ddp", "--timeout", "0"], "argument --timeout: must be a finite number > 0, got 0"),
    # flags the chosen strategy would ignore
    (["--ps-mode", "async"], "--ps-mode applies to --strategy ps only, not to --strategy single"),
    (["--num-servers", "1"], "--num-servers applies to --strategy ps only, not to --strategy single"),
    (["--strategy", "ddp", "--staleness", "2"], "--staleness applies to --strategy ps only, not to --strategy ddp"),
    (["--strategy", "ps", "--staleness", "1"], "--staleness applies to --ps-mode ssp only"),
    (["--strategy", "ps", "--ps-mode", "async", "--scale-lr"], "--scale-lr/--no-scale-lr apply to ddp, ps sync/ssp"),
    (["--no-scale-lr"], "--scale-lr/--no-scale-lr apply to ddp, ps sync/ssp and pipeline or 3d with --dp > 1 only "
                        "(--strategy single"),
    (["--timeout", "60"], "--timeout applies to --strategy ddp, ps, fsdp, tp, pipeline, 3d, cp, ep and diloco only"),
    (["--data-dir", "somewhere"], "--data-dir applies to --dataset mnist only"),
    # pipeline flags: ranges, and refused with another strategy or schedule
    (["--strategy", "pipeline", "--microbatches", "0"], "argument --microbatches: must be a positive integer, got 0"),
    (["--strategy", "pipeline", "--dp", "0"], "argument --dp: must be a positive integer, got 0"),
    (["--strategy", "pipeline", "--schedule", "pipedream-1f1b"],
     "argument --schedule: invalid choice: 'pipedream-1f1b'"),
    (["--vertical-sync"], "--vertical-sync applies to --strategy pipeline only, not to --strategy single"),
    (["--strategy", "pipeline", "--no-weight-stashing"], "--no-weight-stashing applies to --schedule pipedream only"),
    (["--strategy", "pipeline", "--schedule", "pipedream-2bw", "--vertical-sync"],
     "--vertical-sync applies to --schedule pipedream only"),
    (["--strategy", "pipeline", "--schedule", "pipedream", "--microbatches", "4"],
     "--microbatches does not apply to --schedule pipedream"),
    (["--strategy", "pipeline", "--schedule", "interleaved", "--stages-per-rank", "0"],
     "argument --stages-per-rank: must be a positive integer, got 0"),
    (["--schedule", "gpipe"], "--schedule applies to --strategy pipeline and 3d only, not to --strategy single"),
    (["--strategy", "ddp", "--microbatches", "4"], "--microbatches applies to --strategy pipeline and 3d only, not to "
                                                   "--strategy ddp"),
    (["--strategy", "ps", "--dp", "2"], "--dp applies to --strategy pipeline, 3d, cp, ep and diloco only, not to "
                                        "--strategy ps"),
    (["--stages-per-rank", "2"], "--stages-per-rank applies to --strategy pipeline and 3d only"),
    (["--strategy", "pipeline", "--stages-per-rank", "2"], "--stages-per-rank applies to --schedule interleaved only"),
    (["--strategy", "pipeline", "--schedule", "gpipe", "--stages-per-rank", "3"],
     "--stages-per-rank applies to --schedule interleaved only (the other schedules hold one stage per rank), not to "
     "--schedule gpipe"),
    (["--strategy", "pipeline", "--scale-lr"], "(one pipeline (--dp 1) has one batch per step: nothing to scale)"),
])
def test_bad_or_ignored_flags_are_usage_errors(args, message, capsys, monkeypatch):
    assert_usage_error(args, message, capsys, monkeypatch)


def test_flags_become_a_train_config():
    parser = cli.train_parser()
    config = cli.train_config(parser.parse_args(["--strategy", "ps", "--ps-mode", "ssp", "--staleness", "0",
                                                 "--lr", "0.1", "--hidden", "32", "16", "--no-progress"]))
    assert config == train.TrainConfig(strategy="ps", ps_mode="ssp", staleness=0, lr=0.1, hidden=(32, 16),
                                       progress=False)
    assert cli.train_config(parser.parse_args([])) == train.TrainConfig()


def test_a_diverging_run_stops_naming_epoch_step_and_lr():
    # An lr of 1e12 overflows float32 within a few steps: the loss becomes nan.
    result = run("train", "--lr", "1e12", "--epochs", "2", "--no-progress")
    assert result.returncode == 1
    assert re.search(r"minidist train: error: the loss became (nan|inf) at epoch 1, step \d+: training diverged",
                     result.stderr)
    assert "try a smaller --lr (now 1e+12)" in result.stderr and "Traceback" not in result.stderr
    assert "final test_accuracy" not in result.stdout


# ----------------------------------------------------------------------------- train.fit


class ToyLoader:
    """Three batches per epoch; records set_epoch calls."""

    def __init__(self):
        self.epochs = []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)

    def __iter__(self):
        return iter([(np.full(2, i), np.array([i])) for i in range(3)])


def test_fit_calls_the_step_per_batch_and_set_epoch_per_epoch():
    loader, calls = ToyLoader(), []

    def step_fn(x, y):
        calls.append(int(y[0]))
        return float(len(calls))  # losses 1, 2, 3, then 4, 5, 6

    seen = []
    history = train.fit(step_fn, loader, 2, on_epoch_end=lambda e, loss, s: seen.append((e, loss)) or {"extra": e})
    assert calls == [0, 1, 2, 0, 1, 2]
    assert loader.epochs == [0, 1]
    assert seen == [(1, 2.0), (2, 5.0)]
    assert [(r["epoch"], r["loss"], r["steps"], r["extra"]) for r in history] == [(1, 2.0, 3, 1), (2, 5.0, 3, 2)]


def test_fit_sets_the_epoch_of_a_loader_s_sampler():
    class Sampler:
        def __init__(self):
            self.epochs = []

        def set_epoch(self, epoch):
            self.epochs.append(epoch)

    class Loader(list):
        sampler = Sampler()

    loader = Loader([(0, 0)])
    train.fit(lambda x, y: 0.0, loader, 3)
    assert loader.sampler.epochs == [0, 1, 2]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_fit_stops_at_the_first_non_finite_loss(bad):
    losses, calls = [1.0, 0.5, 0.4, 0.3, bad, 0.1], []

    def step_fn(x, y):
        calls.append(1)
        return losses[len(calls) - 1]

    with pytest.raises(train.NonFiniteLossError, match=r"at epoch 2, step 2") as error:
        train.fit(step_fn, ToyLoader(), 3)
    assert (error.value.epoch, error.value.step) == (2, 2) and len(calls) == 5
    assert str(bad) in str(error.value)


@pytest.mark.mpi
def test_a_diverging_ddp_run_stops_every_rank_with_exit_1():
    from mpitools import mpiexec_or_skip

    command = [mpiexec_or_skip(), "-n", "2", sys.executable, "-m", "mpi4py", "-m", "minidist", "train",
               "--strategy", "ddp", "--lr", "1e12", "--epochs", "2", "--no-progress"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)  # a hang fails here
    assert result.returncode == 1
    assert re.search(r"the loss became (nan|inf) at epoch 1, step \d+", result.stderr)
    assert "try a smaller --lr" in result.stderr
    assert "Traceback" not in result.stderr and "final test_accuracy" not in result.stdout


def test_timeout_reaches_the_collectives_of_ddp_and_the_parameter_servers(monkeypatch):
    config = cli.train_config(cli.train_parser().parse_args(["--strategy", "ddp", "--timeout", "7.5", "--epochs", "1",
                                                             "--hidden", "8", "--no-progress"]))
    assert config.timeout == 7.5
    deadlines = []

    def set_timeout(seconds):
        deadlines.append(seconds)
        return 300.0

    monkeypatch.setattr(p2p, "set_timeout", set_timeout, raising=False)
    digits = data.load_digits(seed=0)
    results = sim.run(lambda comm: train_ddp(comm, config, digits), 2)
    assert results[0].figures["ranks"] == 2 and results[1] is None
    assert sorted(deadlines) == [7.5, 7.5, 300.0, 300.0]  # set on both ranks, then restored
    passed = {}
    monkeypatch.setattr(ps_train, "train_parameter_server", lambda *args, **kwargs: passed.update(kwargs))
    world = type("World", (), {"Get_size": lambda self: 3, "Get_rank": lambda self: 0})()
    assert train_ps(world, train.TrainConfig(strategy="ps", timeout=9.0), digits) is None
    assert passed["timeout"] == 9.0


# ----------------------------------------------------------------------------- issue 18: checked before training


def readonly_folder(tmp_path):
    """A folder where no file can be created: a chmod 555 one, or /proc for root (whom
    permission bits do not stop)."""
    if os.geteuid() == 0:
        return "/proc"
    folder = tmp_path / "readonly"
    folder.mkdir()
    folder.chmod(0o555)
    return str(folder)


def test_save_model_in_a_read_only_folder_fails_before_the_first_epoch(tmp_path):
    # before: the whole run trained, then numpy.savez raised (a traceback, exit 1)
    path = os.path.join(readonly_folder(tmp_path), "minidist-weights.npz")
    result = run("train", "--epochs", "1", "--no-progress", "--save-model", path)
    assert result.returncode == 2, result.stderr
    assert f"--save-model {path}: cannot create a file in" in result.stderr and "Traceback" not in result.stderr
    assert "epoch 1" not in result.stdout


@pytest.mark.parametrize("name, message", [
    ("", "is a folder; give a file name, such as"),          # before: trained, then failed to save
    ("weights", "must end in .npz (numpy.savez would write"),  # before: wrote weights.npz, not weights
    ("weights.txt", "must end in .npz"),
])
def test_save_model_paths_that_would_not_hold_the_weights_are_usage_errors(tmp_path, name, message, capsys,
                                                                          monkeypatch):
    monkeypatch.setattr(train, "load_dataset", lambda config: pytest.fail("training started despite a bad path"))
    assert cli.main(["train", "--save-model", str(tmp_path / name) if name else str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # the write check left nothing behind


def test_a_writable_save_model_path_passes_and_leaves_nothing_behind(tmp_path):
    config = cli.train_config(cli.train_parser().parse_args(["--save-model", str(tmp_path / "w.npz")]))
    assert config.save_model == str(tmp_path / "w.npz") and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["1e-45", "5e-8", "65537", "1e6", "1e300"])
def test_static_loss_scales_outside_the_range_are_usage_errors(value, capsys, monkeypatch):
    # before: 1e-45 and 1e300 became 0 and inf in float32; 1e6 skipped 83 of 86 steps (test accuracy 0.18)
    monkeypatch.setattr(train, "load_dataset", lambda config: pytest.fail("training started despite a bad scale"))
    assert cli.main(["train", "--precision", "fp16", "--loss-scale", value]) == 2
    assert f"argument --loss-scale: a static loss scale must lie in [2^-24, 2^16] = [5.96e-08, 65536], got {value}" \
        in capsys.readouterr().err


@pytest.mark.parametrize("value", [2.0 ** -24, 1.0, 1024.0, 65536.0])
def test_static_loss_scales_inside_the_range_are_taken(value):
    args = cli.train_parser().parse_args(["--precision", "fp16", "--loss-scale", repr(value)])
    assert cli.train_config(args).loss_scale == value


def test_a_checkpoint_of_another_run_is_a_usage_error_on_one_line(monkeypatch, capsys):
    def driver(comm, config, dataset, **kwargs):
        raise CheckpointMismatchError("checkpoint ckpt/ckpt-5.npz was written by another run (lr: 0.1 there, 0.05 "
                                      "here)")

    monkeypatch.setitem(train_cli.DRIVERS, "single", (driver, None))
    assert cli.main(["train", "--epochs", "1", "--no-progress"]) == 2  # 2: launch never retries it
    assert capsys.readouterr().err.splitlines() == [
        "python -m minidist train: error: checkpoint ckpt/ckpt-5.npz was written by another run (lr: 0.1 there, "
        "0.05 here)"]


def test_the_run_fields_leave_out_only_what_does_not_shape_the_run():
    base = train.TrainConfig()
    names = {f.name for f in dataclasses.fields(base)}
    assert set(train.run_fields(base)) == names - set(train.NOT_RUN_FIELDS) | {"checkpointing"}
    assert train.run_digest(base) == train.run_digest(dataclasses.replace(base, progress=False, timeout=5.0,
                                                                         save_model="w.npz"))
    for change in ({"seed": 1}, {"batch_size": 16}, {"hidden": (8,)}, {"checkpoint_dir": "ckpt"}, {"lr": 0.1}):
        assert train.run_digest(dataclasses.replace(base, **change)) != train.run_digest(base), change


def test_a_mismatch_names_each_differing_field_with_its_ranks():
    configs = [train.TrainConfig(seed=0), train.TrainConfig(seed=1, hidden=(8, 8)), train.TrainConfig(seed=0)]
    message = train_cli.describe_mismatch([train.run_fields(c) for c in configs])
    assert "--seed is 0 on ranks 0,2 and 1 on rank 1" in message
    assert "--hidden is 128 on ranks 0,2 and 8 8 on rank 1" in message
    assert "--lr" not in message
