"""The MoE GPT under ``--strategy ep`` (parallel.expert_parallel): on the sim, three AdamW steps in
float64 (warm-up, cosine, clipping, the balance loss, with dp) equal to the one-process MoE GPT
trained by ``train_single`` on the global batch (the dense dispatcher, the dense clip) to 1e-10;
--save-model's file; the layouts it refuses; the command line's flags; and
tests/mpi/expert_parallel.py under mpiexec."""
import dataclasses
from pathlib import Path

import pytest
import test_gpt_train
from mpitools import JOB_ENV, mpiexec_or_skip
from test_gpt_train import TINY, differences_from

from minidist import launch, sim, strategy, train, workloads
from minidist.cli import train_flags
from minidist.models.gpt import GPT
from minidist.parallel.expert_parallel import moe_layers
from minidist.parallel.expert_parallel.train import (
    check_expert_parallel,
    moe_gpt_config,
    train_expert_parallel,
)

text = test_gpt_train.text  # the GPT tests' fixture
EP = dict(TINY, n_layer=2, steps=3, eval_every=3, scale_lr=False, strategy="ep", n_expert=5, top_k=2,
          capacity_factor=1.0, aux_loss_coef=0.01)


def moe_float64_model(work):
    """The workload's GPT with its config's experts, in float64 (what single and ep both train here)."""
    return GPT(moe_gpt_config(work.gpt_config, work.config), rng=work.config.seed, dtype="float64",
               device=work.config.device)


@pytest.fixture
def moe64(monkeypatch):
    monkeypatch.setattr(workloads.LanguageModelWorkload, "model", moe_float64_model)


@pytest.mark.parametrize("ranks,dp,change", [(2, 1, {}), (4, 1, dict(bias_update_rate=0.01)),
                                             (4, 2, dict(top_k=1, capacity_factor=1.25))])
def test_the_moe_gpt_under_ep_trains_as_one_process(text, moe64, ranks, dp, change):
    """ep on P ranks with --global-batch-size G equals train_single on G: the weights (experts
    gathered) and every evaluation to 1e-10; tokens split over all P ranks (dp replicas included)."""
    config = train.TrainConfig(**dict(EP, **change), dp=dp, global_batch_size=8)
    single = train.train_single(dataclasses.replace(config, strategy="single", dp=1), text)
    result = sim.run(lambda comm: train_expert_parallel(comm, config, text), ranks)[0]
    assert differences_from(single, result) == []
    figures = result.figures
    assert (figures["dp"], figures["ep"], figures["global_batch"]) == (dp, ranks // dp, 8)
    assert sum(map(int, figures["tokens_per_expert"].split(","))) == 8 * 8 * config.top_k
    assert all(int(b) > 0 for b in figures["ep_bytes_per_step"].split(","))


def test_save_model_writes_the_dense_moe_gpt(text, tmp_path):
    """--save-model on 2 ep ranks: the file loads (as generate loads it) into the MoE GPT the run returns."""
    path = tmp_path / "moe.npz"
    config = train.TrainConfig(**dict(EP, steps=1, eval_every=1), global_batch_size=4, save_model=str(path))
    result = sim.run(lambda comm: train_expert_parallel(comm, config, text), 2)[0]
    model, _ = workloads.load_language_model(str(path))
    assert model.config.n_expert == 5 and len(moe_layers(model)) == 2
    saved, trained = model.state_dict(), result.model.state_dict()
    assert saved.keys() == trained.keys() and all((saved[k] == trained[k]).all() for k in saved)


@pytest.mark.parametrize("world,change,message", [
    (4, dict(dp=3), r"--dp 3 does not divide the 4 ranks"),
    (4, dict(n_expert=3), r"3 experts cannot be spread over 4 ep ranks"),
    (4, dict(n_expert=0), r"needs experts to spread: add --n-expert E"),
    (3, dict(global_batch_size=8), r"--global-batch-size 8 does not split evenly over 3 ranks"),
    (2, dict(dropout=0.1), r"--strategy ep needs --dropout 0"),
    (1, dict(n_expert=2, top_k=3), r"top_k = 3 experts per token, but only n_expert = 2.*--top-k"),
    (2, dict(model="mlp"), r"use --model gpt --n-expert E")])
def test_layouts_ep_cannot_run_are_refused_naming_the_fix(world, change, message):
    with pytest.raises(ValueError, match=message):
        check_expert_parallel(world, train.TrainConfig(**dict(EP, **change)))


def test_the_command_line_takes_the_expert_flags_for_single_and_ep_only():
    parser = train_flags.train_parser()
    config = train_flags.train_config(parser.parse_args(["--model", "gpt", "--strategy", "ep", "--n-expert", "8",
                                                         "--top-k", "1", "--capacity-factor", "2", "--dp", "2"]))
    assert (config.n_expert, config.top_k, config.capacity_factor, config.dp) == (8, 1, 2.0, 2)
    single = train_flags.train_config(parser.parse_args(["--model", "gpt", "--n-expert", "4"]))
    assert (single.strategy, single.n_expert, strategy.resolve(single).name) == ("single", 4, "single-moe")
    with pytest.raises(ValueError, match=r"--n-expert applies to --strategy single and ep only"):
        train_flags.train_config(parser.parse_args(["--model", "gpt", "--strategy", "ddp", "--n-expert", "4"]))


@pytest.mark.mpi
def test_an_ep_run_equals_one_process_under_mpiexec():
    """tests/mpi/expert_parallel.py on 2 and 4 real ranks (float64): the layer against one process,
    and a short ep run (with dp on 4 ranks) against train_single."""
    mpiexec_or_skip()
    script = Path(__file__).parent / "mpi" / "expert_parallel.py"
    for ranks in (2, 4):
        result = launch.launch(script, ranks, timeout=300, env=JOB_ENV)
        assert result.ok and "EP OK" in result.stdout, result.stdout + result.stderr[-3000:]
