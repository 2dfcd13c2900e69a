"""``train --model gpt --strategy tp [--sequence-parallel]`` (issue 20, part 3): the driver on the
simulator against the single process (the oracle: same flags, same batch), its layout checks,
checkpoints resumed bit for bit and refused on another number of ranks, and the real job under
mpiexec on 2 and 4 ranks, whose bytes per step equal Megatron's count."""
import dataclasses
import re

import numpy as np
import pytest
import test_gpt_train
from mpitools import mpirun_minidist
from scenarios import assert_same_weights, on_sim, stop_and_resume
from test_gpt_train import TINY, max_difference, weights

from minidist import sim, train
from minidist.checkpoint_io import CheckpointError
from minidist.models.gpt import GPT
from minidist.parallel.tensor_parallel.train import check_tensor_parallel, train_tensor_parallel

text, float64 = test_gpt_train.text, test_gpt_train.float64  # the GPT tests' fixtures: the small text, float64
TP = dict(TINY, strategy="tp", n_head=4, n_layer=2)  # 4 heads: 1, 2 and 4 ranks



@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("ranks", [2, 4])
def test_tensor_parallel_training_follows_the_single_process(text, float64, ranks, sequence_parallel):
    """Six AdamW steps with warm-up, cosine decay and clipping (the norm over the split model): the
    same evaluations and weights as one process with the same batch, to rounding, on every rank's
    report; only rank 0 returns a result, whose model is a dense GPT."""
    config = train.TrainConfig(**TP, sequence_parallel=sequence_parallel)
    single = train.train_single(dataclasses.replace(config, strategy="single", sequence_parallel=False), text)
    results = sim.run(lambda comm: train_tensor_parallel(comm, config, text), ranks)
    assert all(r is None for r in results[1:]) and type(results[0].model) is GPT
    assert max_difference(weights(single.model), weights(results[0].model)) < 1e-10
    assert len(single.history) == len(results[0].history) == 2
    for a, b in zip(single.history, results[0].history):
        assert abs(a["val_loss"] - b["val_loss"]) < 1e-10 and abs(a["loss"] - b["loss"]) < 1e-10
    assert results[0].sample == single.sample
    figures = results[0].figures
    assert figures["ranks"] == ranks and figures["sequence_parallel"] == ("on" if sequence_parallel else "off")
    assert len(set(figures["bytes_per_step"].split(","))) == 1  # every rank sends the same


def test_the_bytes_per_step_are_megatrons_count(text):
    """Float32, 2 ranks, no SP: per step each rank sends (1 + 2L) activations of B·T·C forward
    and as many backward (one message each on 2 ranks), the loss's three numbers per position
    (and V, summed once), and the clipping's one float64: the figure equals that sum."""
    config = train.TrainConfig(**TP)
    result = sim.run(lambda comm: train_tensor_parallel(comm, config, text), 2)[0]
    b, t, c, layers = config.batch_size, config.block_size, config.n_embd, config.n_layer
    expected = 2 * (1 + 2 * layers) * b * t * c * 4 + (3 * b * t + 1) * 4 + 8
    assert result.figures["bytes_per_step"] == f"{expected},{expected}"
    assert result.figures["bytes_communicated"] == expected * config.steps


@pytest.mark.parametrize("change,message", [
    ({"model": "mlp"}, "use --model gpt"),
    ({"n_head": 3, "n_embd": 15}, r"--n-head = 3 is not divisible by 2 .* run on one of \[1, 3\] ranks"),
    ({"dropout": 0.1}, "--strategy tp needs --dropout 0"),
    ({"sequence_parallel": True, "block_size": 7}, "--sequence-parallel cuts each window's 7 positions into 2"),
])
def test_layouts_tp_cannot_run_are_refused_naming_the_fix(change, message):
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(2, train.TrainConfig(**{**TP, **change}))
    for ranks in (1, 2, 4):
        check_tensor_parallel(ranks, train.TrainConfig(**TP, sequence_parallel=True))


def test_a_stopped_tp_run_resumes_bit_identical_and_not_on_another_number_of_ranks(text, tmp_path):
    """Checkpoints gather every rank's shards and AdamW state into one file; resuming on the same
    2 ranks ends with the weights of the run never stopped; on 4 ranks it is refused by name."""
    config = train.TrainConfig(**TP, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    assert_same_weights(*stop_and_resume(on_sim(train_tensor_parallel, text, 2), config, stop_after=4))
    with pytest.raises(CheckpointError, match="world_size"):
        sim.run(lambda comm: train_tensor_parallel(comm, dataclasses.replace(config, resume=True), text), 4)


# ----------------------------------------------------------------------------- under mpiexec

GPT_FLAGS = ["train", "--model", "gpt", "--n-layer", "2", "--n-head", "4", "--n-embd", "32", "--block-size", "16",
             "--batch-size", "8", "--steps", "20", "--eval-every", "10", "--no-progress"]


def evaluations(stdout: str) -> list[tuple[float, float]]:
    return [(float(m.group(1)), float(m.group(2)))
            for m in re.finditer(r"train_loss=([\d.]+)\s+val_loss=([\d.]+)", stdout)]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,extra", [(2, []), (4, ["--sequence-parallel"])])
def test_the_tp_job_under_mpiexec_trains_to_the_single_process_loss(ranks, extra):
    """The main job: every evaluation line (4 decimals) and the final val_loss as one process's;
    the lines add each rank's bytes per step and the communication share."""
    single = mpirun_minidist(1, *GPT_FLAGS, timeout=300)
    assert single.returncode == 0, single.stderr
    job = mpirun_minidist(ranks, *GPT_FLAGS, "--strategy", "tp", *extra, timeout=300)
    assert job.returncode == 0, job.stderr
    assert np.allclose(evaluations(single.stdout), evaluations(job.stdout), atol=2e-4, rtol=0)
    assert len(evaluations(job.stdout)) == 2
    assert job.stdout.strip().splitlines()[-1] == single.stdout.strip().splitlines()[-1]  # final val_loss=...
    number = r"[\d.]+"
    assert re.search(rf"sent/step={(number + ',') * (ranks - 1)}{number}MB  comm=\d+%", job.stdout), job.stdout
    heads = 4 // ranks
    assert f"tp: {ranks} ranks, {heads} head{'s' * (heads != 1)} and " in job.stdout  # "1 head", not "1 heads"
