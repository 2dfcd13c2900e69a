"""``train --strategy fsdp [--sharding-strategy ...]`` and ``train --strategy ddp --zero`` (issue 21,
part 3): the drivers on the simulator against the single process (the GPT in float64, the same
global batch) and against DDP (the MLP), their bytes per step, checkpoints resumed bit for bit and
refused on another layout, the command line's usage errors, and the GPT job under mpiexec."""
import dataclasses

import numpy as np
import pytest
import test_gpt_train
from mpitools import mpirun_minidist
from scenarios import assert_same_weights, assert_usage_error, on_sim, stop_and_resume
from test_gpt_train import TINY, max_difference, weights
from test_tensor_parallel_train import GPT_FLAGS, evaluations

from minidist import sim, train
from minidist.checkpoint_io import CheckpointError
from minidist.cli import train as train_cli
from minidist.parallel.data_parallel.train import train_ddp
from minidist.parallel.fsdp.train import train_fsdp
from minidist.parallel.zero.train import train_zero

text, float64 = test_gpt_train.text, test_gpt_train.float64  # the GPT tests' fixtures: the small text, float64


def zero(comm, config, dataset, **kwargs):
    return train_zero(comm, dataclasses.replace(config, strategy="ddp", zero=True), dataset, **kwargs)


def fsdp(strategy):
    def run(comm, config, dataset, **kwargs):
        return train_fsdp(comm, dataclasses.replace(config, strategy="fsdp", sharding_strategy=strategy), dataset,
                          **kwargs)
    return run


DRIVERS = {"zero": zero, "FULL_SHARD": fsdp("FULL_SHARD"), "SHARD_GRAD_OP": fsdp("SHARD_GRAD_OP"),
           "NO_SHARD": fsdp("NO_SHARD")}


@pytest.mark.parametrize("name", list(DRIVERS))
def test_the_gpt_follows_the_single_process(text, float64, name):
    """Six AdamW steps with warm-up, cosine decay and clipping on 2 ranks of batch 4: one
    process's evaluations and weights on batch 8, to rounding."""
    config = train.TrainConfig(**TINY)
    single = train.train_single(config, text)
    halves = dataclasses.replace(config, batch_size=4, scale_lr=False)
    results = sim.run(lambda comm: DRIVERS[name](comm, halves, text), 2)
    assert results[1] is None
    assert max_difference(weights(single.model), weights(results[0].model)) < 1e-10
    for a, b in zip(single.history, results[0].history, strict=True):
        assert abs(a["val_loss"] - b["val_loss"]) < 1e-10 and abs(a["train_loss"] - b["train_loss"]) < 1e-10
    psi = results[0].figures["optimizer_state_bytes"]  # AdamW's 2 moments of Ψ/2 on each of 2 ranks: Ψ
    sent = [int(b) for b in results[0].figures["bytes_per_step"].split(",")]
    # the ring's (P-1)/P of Ψ per all-gather, reduce-scatter (ZeRO-1's too) or half all-reduce; the norm's number
    forms = {"zero": 2 * psi // 2 + 8, "FULL_SHARD": 3 * psi // 2 + 8, "SHARD_GRAD_OP": 2 * psi // 2 + 8,
             "NO_SHARD": psi // 2}  # NO_SHARD: the whole state (2Ψ), DDP's all-reduce (Ψ on 2 ranks), no norm message
    assert sent == [forms[name]] * 2


def test_the_mlp_follows_ddp():
    """The MLP (one unit) on 3 ranks: FSDP and ZeRO-1 end with DDP's accuracy (float32)."""
    config = train.TrainConfig(epochs=2, hidden=(16,), progress=False, strategy="ddp")
    dataset = train.load_dataset(config)
    reference = sim.run(lambda comm: train_ddp(comm, config, dataset), 3)[0]
    for driver in (DRIVERS["zero"], DRIVERS["FULL_SHARD"], DRIVERS["SHARD_GRAD_OP"]):
        result = sim.run(lambda comm, driver=driver: driver(comm, config, dataset), 3)[0]
        assert abs(result.test_accuracy - reference.test_accuracy) < 2e-3
        assert max_difference(weights(reference.model), weights(result.model)) < 1e-4


@pytest.mark.parametrize("name", ["zero", "FULL_SHARD"])
def test_a_stopped_run_resumes_bit_identical_and_not_on_another_layout(text, tmp_path, name):
    """Checkpoints gather every rank's shards and optimizer state into one file; resuming on the
    same 2 ranks ends with the weights of the run never stopped; on 3 ranks, or with another
    sharding strategy, it is refused by name."""
    config = train.TrainConfig(**dict(TINY, batch_size=4), checkpoint_dir=str(tmp_path), checkpoint_every=2)
    driver = DRIVERS[name]
    assert_same_weights(*stop_and_resume(on_sim(driver, text, 2), config, stop_after=4))
    with pytest.raises(CheckpointError, match="world_size"):
        sim.run(lambda comm: driver(comm, dataclasses.replace(config, resume=True), text), 3)
    if name == "FULL_SHARD":
        with pytest.raises(CheckpointError, match="sharding_strategy"):
            sim.run(lambda comm: DRIVERS["SHARD_GRAD_OP"](comm, dataclasses.replace(config, resume=True), text), 2)


@pytest.mark.parametrize("name", ["zero", "FULL_SHARD", "SHARD_GRAD_OP"])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_keeps_float32_master_shards_and_follows_the_float32_run(text, name, precision):
    """--precision on the sharded strategies: the shards stay float32 (the master weights), the
    forward and loss run under autocast, fp16's dynamic loss scale is kept in the checkpoint's
    parts. The run ends near the float32 one, not equal to it, with float32 weights."""
    config = dataclasses.replace(train.TrainConfig(**TINY), batch_size=4, scale_lr=False)
    reference = sim.run(lambda comm: DRIVERS[name](comm, config, text), 2)[0]
    mixed = dataclasses.replace(config, precision=precision)
    result = sim.run(lambda comm: DRIVERS[name](comm, mixed, text), 2)[0]
    assert 0 < abs(result.val_loss - reference.val_loss) < 0.02
    assert result.figures["precision"] == precision
    assert all(value.dtype == np.float32 for value in result.model.state_dict().values())


def test_the_sharded_step_skips_on_every_rank_when_one_rank_overflows():
    """train.sharded_step with fp16's loss scaler: rank 1's gradient overflows, rank 0's does
    not; the inf flag is agreed over the ranks, so both skip the step (each holds other shards:
    one stepping alone would leave the model half-updated) and both halve the scale."""
    from minidist import nn, optim, precision
    from minidist.tensor import Tensor

    def rank(comm):
        weight = nn.Parameter(np.ones(3, dtype=np.float32))
        optimizer = optim.SGD([weight], lr=0.1)
        scaler = precision.GradScaler()
        factor = 1e36 if comm.Get_rank() == 1 else 1.0  # times the scale 2**16: past float32
        step = train.sharded_step(lambda x, y: (weight * Tensor(np.float32(factor))).sum(), optimizer, None,
                                  scaler=scaler, comm=comm)
        step(None, None)
        return weight.data.copy(), scaler.skipped_steps, scaler.get_scale()

    for weight, skipped, scale in sim.run(rank, 2):
        assert np.array_equal(weight, np.ones(3, dtype=np.float32)) and skipped == 1 and scale == 2.0 ** 15


@pytest.mark.parametrize("args, message", [
    (["--sharding-strategy", "NO_SHARD"], "--sharding-strategy applies to --strategy fsdp only"),
    (["--strategy", "fsdp", "--zero"], "--zero applies to --strategy ddp and 3d only"),
    (["--strategy", "ddp", "--zero", "--comm-hook", "fp16"], "--comm-hook does not apply with --zero"),
    (["--strategy", "fsdp", "--sharding-strategy", "ZERO3"], "argument --sharding-strategy: invalid choice"),
])
def test_flags_that_do_not_apply_are_usage_errors(args, message, capsys, monkeypatch):
    assert_usage_error(args, message, capsys, monkeypatch)


def test_the_table_routes_fsdp_and_ddp_zero():
    assert train_cli.DRIVERS["fsdp"][0] is train_fsdp and train_cli.DRIVERS["zero"][0] is train_zero
    config = train.TrainConfig(strategy="ddp", zero=True)
    assert train_cli.driver_name(config) == "zero"
    assert train_cli.driver_name(dataclasses.replace(config, zero=False)) == "ddp"


@pytest.mark.mpi
def test_the_gpt_jobs_under_mpiexec_reach_the_single_process_loss():
    """The main job on 2 ranks of batch 4: fsdp (FULL_SHARD) and ddp --zero print one process's
    evaluations (batch 8) to 2e-4 and its final val_loss, and each rank's bytes per step."""
    single = mpirun_minidist(1, *GPT_FLAGS, timeout=300)
    assert single.returncode == 0, single.stderr
    halves = [f if f != "8" else "4" for f in GPT_FLAGS]  # --batch-size 8 halved
    for extra in (["--strategy", "fsdp"], ["--strategy", "ddp", "--zero"]):
        job = mpirun_minidist(2, *halves, *extra, timeout=300)
        assert job.returncode == 0, job.stderr
        assert np.allclose(evaluations(single.stdout), evaluations(job.stdout), atol=2e-4, rtol=0)
        assert len(evaluations(job.stdout)) == 2
        assert job.stdout.strip().splitlines()[-1] == single.stdout.strip().splitlines()[-1]
        sent = [line for line in job.stdout.splitlines() if line.startswith("bytes_per_step=")]
        assert len(sent) == 1 and len(sent[0].split("=")[1].split(",")) == 2
