"""The pipeline main job: data x pipeline parallelism against one process (float64, <= 1e-12),
train_pipeline on the sim, `python -m minidist train --strategy pipeline` under mpiexec and
its usage errors."""
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mpitools import mpiexec_or_skip

from minidist import cli, launch, nn, optim, sim, train
from minidist.cli.train import check_layout
from minidist.data import load_digits
from minidist.functions import cross_entropy
from minidist.parallel.pipeline import executor as E
from minidist.parallel.pipeline.grid import ProcessGrid, average_gradients
from minidist.parallel.pipeline.stage import split_model
from minidist.parallel.pipeline.step import PipelineStep
from minidist.parallel.pipeline.train import train_pipeline

SIZES = [6, 9, 8, 7, 5]  # 4 Linear layers: 2 stages, or 2 ranks x 2 interleaved stages
TOL = 1e-12
SCHEDULES = {"gpipe": E.ScheduleGPipe, "1f1b": E.Schedule1F1B, "zero-bubble": E.ScheduleZeroBubble,
             "interleaved": E.ScheduleInterleaved1F1B}


def make_model():
    return nn.mlp(SIZES, activation=nn.Tanh, rng=7, dtype="float64")


def global_batch(rows=16, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(rows, SIZES[0])), rng.integers(0, SIZES[-1], size=rows)


def dp_pp_step(comm, dp, schedule, m, x, y, lr=0.1, momentum=0.9):
    """One training step of D pipelines (each on its contiguous shard of the global batch),
    with the library's grid and step; returns {stage: parameters after the step} and the loss."""
    grid = ProcessGrid.create(comm, dp)
    v = 2 if schedule == "interleaved" else 1
    num_stages = grid.pp_size * v
    stage_modules = split_model(make_model(), num_stages, balance="parameters")
    mine = list(range(grid.pp_rank, num_stages, grid.pp_size))
    stages = [E.PipelineStage(stage_modules[s], s, num_stages, grid.pp_comm, timeout=30) for s in mine]
    sched = SCHEDULES[schedule](stages if v > 1 else stages[0], m, cross_entropy)
    params = [p for st in stages for p in st.submodule.parameters()]
    step = PipelineStep(sched, grid, optim.SGD(params, lr=lr, momentum=momentum))
    shard = np.array_split(np.arange(len(x)), dp)[grid.dp_rank]
    loss = step(x[shard], y[shard])
    return {s: [p.data.copy() for p in stage_modules[s].parameters()] for s in mine}, loss


def one_process_step(x, y, lr=0.1, momentum=0.9):
    model = make_model()
    opt = optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    loss = cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return [p.data for p in model.parameters()], loss.item()


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_dp_x_pp_2x2_equals_one_process_with_the_global_batch(schedule):
    x, y = global_batch()  # 16 rows: 2 pipelines x 8 rows, 2 micro-batches of 4 each
    world = sim.World(4, strict=True)
    results = world.run(dp_pp_step, 2, schedule, 2, x, y)
    expected, expected_loss = one_process_step(x, y)
    for dp_rank in range(2):  # both replicas hold the one-process parameters
        got = {}
        for rank in range(2 * dp_rank, 2 * dp_rank + 2):
            got.update(results[rank][0])
        flat = [a for s in sorted(got) for a in got[s]]
        assert len(flat) == len(expected)
        for a, e in zip(flat, expected):
            assert np.max(np.abs(a - e)) <= TOL
    for _, loss in results:  # every rank returns the global batch's loss
        assert abs(loss - expected_loss) <= TOL
    # activations stay inside a pipeline ({0, 1}, {2, 3}), gradients inside a dp group ({0, 2}, {1, 3})
    pairs = {frozenset((m.source, m.dest)) for m in world.trace if m.kind == "array"}
    assert pairs == {frozenset(p) for p in ((0, 1), (2, 3), (0, 2), (1, 3))}


def test_the_grid_puts_the_ranks_of_a_pipeline_side_by_side():
    def fn(comm):
        g = ProcessGrid.create(comm, 2)
        return (g.dp_rank, g.pp_rank, g.pp_comm.Get_rank(), g.pp_comm.Get_size(), g.dp_comm.Get_rank(),
                g.dp_comm.Get_size())

    assert sim.run(fn, 6) == [(0, 0, 0, 3, 0, 2), (0, 1, 1, 3, 0, 2), (0, 2, 2, 3, 0, 2),
                              (1, 0, 0, 3, 1, 2), (1, 1, 1, 3, 1, 2), (1, 2, 2, 3, 1, 2)]

    def bad(comm):
        with pytest.raises(ValueError, match=r"--dp 4 does not divide the 6 ranks .* use one of 1, 2, 3, 6"):
            ProcessGrid.create(comm, 4)
        return True

    assert sim.run(bad, 6) == [True] * 6


def test_average_gradients_is_the_mean_over_the_group_and_carries_the_loss():
    def fn(comm):
        p = nn.Parameter(np.zeros(3))
        p.grad = np.full(3, float(comm.Get_rank()))
        loss = average_gradients([p], comm, extra=10.0 * comm.Get_rank())
        return p.grad.tolist(), loss

    assert sim.run(fn, 3) == [([1.0, 1.0, 1.0], 10.0)] * 3


SMALL = train.TrainConfig(strategy="pipeline", epochs=1, hidden=(32, 32, 32), batch_size=32, progress=False,
                          timeout=60)


@pytest.mark.parametrize("world_size,changes", [
    (1, {}),  # one rank, one stage: plain sequential training through the same machinery
    (2, {"schedule": "gpipe", "microbatches": 1}),  # naive model parallelism
    (4, {"schedule": "interleaved", "dp": 2}),
])
def test_train_pipeline_on_the_sim_reports_bubble_and_memory(world_size, changes, capsys):
    config = train.TrainConfig(**{**SMALL.__dict__, **changes})
    digits = load_digits(seed=0)
    results = sim.run(lambda comm: train_pipeline(comm, config, digits), world_size)
    result = results[0]
    assert all(r is None for r in results[1:])
    dp = config.dp
    stages = world_size // dp * (2 if config.schedule == "interleaved" else 1)
    assert result.figures["stages"] == stages and result.figures["pipelines"] == dp
    assert len(result.figures["peak_activation_bytes"].split(",")) == stages
    row = result.history[-1]
    assert 0.0 <= row["bubble"] < 1.0 and len(row["peak_activation_bytes"]) == stages
    assert result.test_accuracy > 0.3  # one epoch of a small MLP: well above chance (0.1)
    out = capsys.readouterr().out
    assert re.search(r"epoch 1/1 .* bubble=0\.\d{3} \(simulated 0\.\d{3}\)  activation_kib_per_stage=[\d.,]+$", out,
                     re.M), out
    if world_size == 1:
        assert "one stage on one rank: plain sequential training" in out


# ----------------------------------------------------------------------------- the command line


@pytest.mark.parametrize("size,args,message", [
    (4, ["--dp", "3"], "--dp 3 does not divide the 4 ranks into pipelines of equal length; use one of 1, 2, 4"),
    (4, ["--hidden", "64", "64"], "4 ranks in 1 pipeline make 4 stages, but the MLP has only 3 Linear layers "
                                  "(a stage holds at least one); give --hidden at least 3 sizes"),
    (8, ["--dp", "2", "--hidden", "32"], "8 ranks in 2 pipelines make 4 stages, but the MLP has only 2 Linear"),
    (4, ["--schedule", "interleaved", "--stages-per-rank", "3"],
     "--schedule interleaved puts --stages-per-rank 3 stages on each of the 4 ranks of a pipeline: 12 stages, but "
     "the MLP has only 8 Linear layers"),
    (4, ["--microbatches", "40"], "--microbatches 40 exceeds --batch-size 32 (per pipeline)"),
])
def test_layouts_that_cannot_run_are_usage_errors(size, args, message):
    """What every rank checks before anything starts (``cli.train.check_layout``; the command
    line prints it once as a usage error, exit status 2: the mpiexec test below and
    tests/test_startup_mpi.py)."""
    config = cli.train_config(cli.train_parser().parse_args(["--strategy", "pipeline", *args]))
    with pytest.raises(ValueError, match=re.escape(message)):
        check_layout(config, size)


def test_pipeline_flags_become_a_train_config():
    parser = cli.train_parser()
    config = cli.train_config(parser.parse_args(["--strategy", "pipeline", "--schedule", "interleaved",
                                                 "--stages-per-rank", "3", "--microbatches", "8", "--dp", "2"]))
    assert config == train.TrainConfig(strategy="pipeline", schedule="interleaved", stages_per_rank=3, microbatches=8,
                                       dp=2, hidden=train.PIPELINE_HIDDEN, lr=train.PIPELINE_LR)
    assert cli.train_config(parser.parse_args(["--strategy", "pipeline", "--hidden", "32"])).hidden == (32,)


def mpi_train(n, *args, timeout=180):
    command = [mpiexec_or_skip(), "-n", str(n), sys.executable, "-m", "mpi4py", "-m", "minidist", "train",
               "--strategy", "pipeline", "--no-progress", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          cwd=Path(__file__).resolve().parents[1])


@pytest.mark.mpi
def test_the_main_job_under_mpiexec_prints_bubble_and_memory_per_epoch():
    result = mpi_train(2, "--epochs", "2", "--hidden", "64", "64", "64")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    epochs = [line for line in lines if line.startswith("epoch ")]
    assert len(epochs) == 2, result.stdout
    for line in epochs:
        assert re.search(r"test_accuracy=0\.\d{4} .* bubble=0\.\d{3} \(simulated 0\.200\)  "
                         r"activation_kib_per_stage=\d+\.\d,\d+\.\d$", line), line
    assert "stages=2" in lines and "schedule=1f1b" in lines
    assert re.fullmatch(r"final test_accuracy=0\.\d{4}", lines[-1])
    bad = mpi_train(2, "--dp", "3", timeout=60)
    assert bad.returncode == 2 and "--dp 3 does not divide the 2 ranks" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("dp", [1, 2])
def test_a_diverging_pipeline_stops_every_rank_with_exit_1(dp):
    # The loss reaches every rank (broadcast from the last stage; with --dp 2 averaged over the
    # pipelines), so every rank stops at the same step instead of waiting for one that stopped.
    result = mpi_train(2, "--lr", "1e12", "--epochs", "2", "--dp", str(dp), "--hidden", "16", "--timeout", "30",
                       timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    errors = re.findall(r"minidist train: error: the loss became (?:nan|inf) at epoch 1, step (\d+)", result.stderr)
    # Every rank stops at the same step; the first to print aborts the job (launch.finish), so on a
    # loaded machine the other may be ended before its own line is out: one line, or two that agree.
    assert len(errors) in (1, 2) and len(set(errors)) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "final test_accuracy" not in result.stdout


@pytest.mark.mpi
def test_dp_x_pp_2x2_equals_one_process_under_mpiexec():
    mpiexec_or_skip()
    script = Path(__file__).parent / "mpi" / "pipeline_dp.py"
    result = launch.launch(script, 4, timeout=120)
    assert result.ok and "DPxPP OK" in result.stdout, result.stdout + result.stderr[-3000:]


@pytest.mark.mpi
@pytest.mark.slow
def test_four_ranks_reach_95_percent_on_digits():
    result = mpi_train(4, "--schedule", "1f1b", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    last = result.stdout.strip().splitlines()[-1]
    assert float(last.split("=")[1]) >= 0.95, result.stdout
