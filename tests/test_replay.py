"""train --replay-step: the replayed step's gradients equal the uninterrupted run's, bit for bit; a NaN is named.

The oracle is the real run: its driver is run with a Checkpointer that also copies, at the end
of step K, every parameter's gradient and weight (fit's step hook runs after the optimizer's
step and before the next zero_grad, so ``.grad`` still holds step K's gradient).
"""
import dataclasses
import os

import numpy as np
import pytest

from minidist import cli, nn, sim, train
from minidist.anomaly import AnomalyError
from minidist.checkpoint_io import list_checkpoints
from minidist.fault import Checkpointer
from minidist.parallel.data_parallel.train import train_ddp
from minidist.replay import ReplayError, replay

STEPS = (23, 76, 83)  # 23: no checkpoint before it is kept (from the seed); 76: from step 75; 83: from 80


def capturing(steps, store):
    """A Checkpointer class that also records, at the end of each global step in ``steps``,
    ``store[step] = (grads, weights)`` as float64 arrays by parameter name."""

    class Capture(Checkpointer):
        def __call__(self, position):
            step = position["global_step"]
            if step in steps:
                named = list(self.model.named_parameters())
                store[step] = ({n: p.grad.astype(np.float64) for n, p in named},
                               {n: p.data.astype(np.float64) for n, p in named})
            return super().__call__(position)

    return Capture


def single(dataset):
    """The replay's train_fn for --strategy single (the command line passes its driver table's)."""
    return lambda run, **kw: train.train_single(run, dataset, **kw)


def ddp(dataset, comm):
    """The replay's train_fn for --strategy ddp over ``comm``."""
    return lambda run, **kw: train_ddp(comm, run, dataset, **kw)


def config_for(tmp_path, **changes):
    fields = {"epochs": 2, "hidden": (16,), "progress": False, "checkpoint_dir": str(tmp_path / "ckpt"),
              "checkpoint_every": 5, **changes}
    return train.TrainConfig(**fields)


def assert_same_step(report, grads, weights):
    assert list(report.grads) == list(grads) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    for name in grads:
        assert report.grads[name].tobytes() == grads[name].tobytes(), name
        assert report.after[name].tobytes() == weights[name].tobytes(), name


def test_single_replay_gives_the_uninterrupted_runs_gradients_bit_for_bit(tmp_path):
    config = config_for(tmp_path)
    dataset = train.load_dataset(config)
    store = {}
    nn.manual_seed(config.seed)
    train.train_single(config, dataset, checkpointer_class=capturing(set(STEPS) | {k - 1 for k in STEPS}, store))
    steps_per_epoch = -(-len(dataset.X_train) // config.batch_size)
    assert 2 * steps_per_epoch == 86  # so the kept checkpoints are those of steps 75, 80 and 85
    kept = [(step, os.path.getmtime(path)) for step, path in list_checkpoints(config.checkpoint_dir)]
    assert [step for step, _ in kept] == [75, 80, 85]
    for k, start in zip(STEPS, (0, 75, 80)):
        nn.manual_seed(config.seed)
        report = replay(dataclasses.replace(config, replay_step=k), single(dataset))
        assert (report.step, report.start_step) == (k, start)
        assert (report.epoch, report.batch) == ((k - 1) // steps_per_epoch + 1, (k - 1) % steps_per_epoch + 1)
        assert_same_step(report, *store[k])
        for name, before in store[k - 1][1].items():
            assert report.before[name].tobytes() == before.tobytes()
        assert report.rows()[0][1] == pytest.approx(np.linalg.norm(store[k][0]["0.weight"]), rel=1e-12)
    after = [(step, os.path.getmtime(path)) for step, path in list_checkpoints(config.checkpoint_dir)]
    assert after == kept  # a replay writes nothing
    with pytest.raises(ReplayError, match="past the end"):
        replay(dataclasses.replace(config, replay_step=87), single(dataset))


def test_ddp_replay_on_two_simulated_ranks_matches_the_run(tmp_path):
    config = config_for(tmp_path, strategy="ddp", timeout=60.0)
    dataset = train.load_dataset(config)
    store = {}
    sim.run(lambda comm: train_ddp(comm, config, dataset, checkpointer_class=capturing({37}, store)), 2)
    assert [step for step, _ in list_checkpoints(config.checkpoint_dir)] == [30, 35, 40]
    reports = sim.run(lambda comm: replay(dataclasses.replace(config, replay_step=37), ddp(dataset, comm), comm), 2)
    for report in reports:
        assert report.start_step == 35
        assert_same_step(report, *store[37])


def test_a_diverging_step_is_replayed_and_its_first_non_finite_op_named(tmp_path, capsys):
    config = config_for(tmp_path, lr=1e15, momentum=0.0, epochs=1)
    dataset = train.load_dataset(config)
    nn.manual_seed(config.seed)
    with np.errstate(all="ignore"), pytest.raises(train.NonFiniteLossError) as diverged:
        train.train_single(config, dataset)
    assert diverged.value.epoch == 1
    k = diverged.value.step  # the first step whose loss is not finite (epoch 1: the global step)
    with np.errstate(all="ignore"), pytest.raises(AnomalyError, match=r"^\w+ \(forward\) produced (nan|inf)") as e:
        replay(dataclasses.replace(config, replay_step=k), single(dataset))
    assert e.value.phase == "forward" and e.value.op in {"Linear", "MatMul", "ReLU", "CrossEntropy", "LogSoftmax"}
    args = ["train", "--epochs", "1", "--hidden", "16", "--lr", "1e15", "--momentum", "0", "--no-progress",
            "--checkpoint-dir", config.checkpoint_dir, "--replay-step", str(k)]
    assert cli.main(args) == 1
    err = capsys.readouterr().err
    assert f"error: replay of step {k}: {e.value.op} (forward) produced" in err


def test_replay_usage_errors(tmp_path, capsys):
    base = ["train", "--replay-step", "3"]
    for extra, message in (([], "--replay-step needs --checkpoint-dir"),
                           (["--checkpoint-dir", str(tmp_path), "--resume"], "--resume does not apply"),
                           (["--checkpoint-dir", str(tmp_path), "--strategy", "ps"], "single and ddp only")):
        assert cli.main(base + extra) == 2
        assert message in capsys.readouterr().err
