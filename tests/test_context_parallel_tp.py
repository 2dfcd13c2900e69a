"""Context parallelism around tensor parallelism (issue 31, parts 2 and 4): ``train --strategy cp
--tp T [--dp D] [--sequence-parallel]`` on the simulator, in float64, against one process on the
global batch (weights and evaluations to 1e-10 after three AdamW steps with warm-up, cosine and
clipping); what each rank sent inside its cp and tp groups against closed forms; the mesh's
groups; a checkpoint stopped and resumed; layouts it cannot run refused naming the fix; and at the
model's level, FSDP over dp x cp in place of DDP against one process. The same under mpiexec:
tests/mpi/context_parallel.py (run by test_context_parallel.py)."""
import copy
import dataclasses

import numpy as np
import pytest
import test_gpt_train
from test_context_parallel import CP, single_on_global_batch
from test_gpt_train import differences_from

from minidist import nn, optim, sim, train
from minidist.cli import train_flags
from minidist.fault import TrainingStopped
from minidist.models.gpt import GPT, GPTConfig
from minidist.parallel.context_parallel.compose import dp_cp_group
from minidist.parallel.context_parallel.train import (
    MESH_NAMES,
    check_context_parallel,
    parallelize,
    train_context_parallel,
)
from minidist.parallel.fsdp.compose import dense_state
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.tensor_parallel import is_sharded

text, float64 = test_gpt_train.text, test_gpt_train.float64  # the GPT tests' fixtures
CPTP = dict(CP, tp=2)  # 2 layers, 4 heads of 4 channels (n_embd 16), T = 8, batch 8 windows per dp group


def run(config, ranks, dataset):
    return sim.run(lambda comm: train_context_parallel(comm, config, dataset), ranks)[0]


def tp_bytes(config, cp):
    """Values each rank sends in its tp group per step (T = 2: a ring all-reduce of n values
    sends n per rank), Megatron's layout on the t = T / cp positions of a cp rank, without
    sequence parallelism: the embedding's g (B t C), per layer two all-reduces forward (g after
    both row-parallel layers) and two backward (f before both column-parallel ones), the head's f
    backward (B t C), the vocabulary-parallel loss's three (max, sum of exponentials with the
    width, the target's logit: 3 B t + 1), the clipping norm's one number; 8 bytes each."""
    b, t, c = config.batch_size, config.block_size // cp, config.n_embd
    return 8 * (b * t * c * (1 + 4 * config.n_layer + 1) + 3 * b * t + 1 + 1)


@pytest.mark.parametrize("ranks,dp,variant,sp,pairs", [(4, 1, "ring", False, "2,2,4,4"),
                                                       (4, 1, "ulysses", False, "2,2,2,2"),
                                                       (4, 1, "zigzag", True, "10,10,10,10"),
                                                       (8, 2, "allgather", False, "2,2,2,2,2,2,2,2")])
def test_the_gpt_under_cp_and_tp_trains_as_one_process(text, float64, ranks, dp, variant, sp, pairs):
    """cp 2 x tp 2 (and dp 2 x cp 2 x tp 2 on 8 ranks), with sequence parallelism once: the
    weights and evaluations of one process on the global batch to 1e-10; each rank's attention
    chunk pairs (its cp rank's, as without tp: ranks 2r and 2r + 1 are cp rank r); cp bytes
    per step the wing's closed forms (tests/test_context_parallel.py) on a tp rank's C / 2
    channels, plus the loss's one number; tp bytes Megatron's (:func:`tp_bytes`)."""
    config = train.TrainConfig(**CPTP, cp_variant=variant, dp=dp, sequence_parallel=sp)
    result = run(config, ranks, text)
    assert differences_from(single_on_global_batch(config, text), result) == []
    figures = result.figures
    assert (figures["dp"], figures["cp"], figures["tp"], figures["global_batch"]) == (dp, 2, 2, 8 * dp)
    assert figures["block_pairs_per_step"] == pairs
    assert figures["sequence_parallel"] == ("on" if sp else "off")
    # b: one rank's K of one layer, B (T / P) (C / tp) values of 8 bytes; P = 2 cp ranks
    p, b = 2, config.batch_size * (config.block_size // 2) * (config.n_embd // 2) * 8
    per_layer = {"ring": 2 * (p - 1) * b + 2 * (p - 1) * b + 2 * p * b, "zigzag": (6 * p - 4) * b,
                 "allgather": 4 * (p - 1) * b, "ulysses": 2 * 4 * (p - 1) * b * p // p ** 2}[variant]
    assert figures["cp_bytes_per_step"] == ",".join([str(config.n_layer * per_layer + 8)] * ranks)
    if not sp:
        assert figures["tp_bytes_per_step"] == ",".join([str(tp_bytes(config, 2))] * ranks)


def test_the_mesh_puts_tp_fastest_and_ddp_over_the_ranks_of_one_tp_coordinate():
    """P = 8 as (dp, cp, tp) = (2, 2, 2): each rank's tp, cp and dp x cp groups, as MPI's own
    Split would make them by hand."""
    def groups(comm):
        mesh = DeviceMesh(comm, (2, 2, 2), MESH_NAMES)
        dp_cp = dp_cp_group(comm, mesh)
        seen = {name: sorted(mesh.groups(name)) for name in ("tp", "cp")}
        return seen, dp_cp.Get_size(), dp_cp.Get_rank()

    results = sim.run(groups, 8)
    assert results[0][0] == {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "cp": [[0, 2], [1, 3], [4, 6], [5, 7]]}
    assert [(size, rank) for _, size, rank in results] == [(4, r // 2) for r in range(8)]


def test_a_stopped_run_resumes_from_its_checkpoint_as_one_process(text, float64, tmp_path, capsys):
    """Every rank's tp shards are gathered into the checkpoint: stopped after 2 of 3 steps and
    resumed on the same mesh (from step 2, as its log says), the run ends with one process's
    weights."""
    config = train.TrainConfig(**CPTP, cp_variant="ring", checkpoint_every=2, checkpoint_dir=str(tmp_path / "run"),
                               timeout=30)
    with pytest.raises(TrainingStopped):
        run(dataclasses.replace(config, stop_after_steps=2), 4, text)
    capsys.readouterr()
    resumed = run(dataclasses.replace(config, resume=True), 4, text)
    assert "(step 2" in capsys.readouterr().out
    single = single_on_global_batch(train.TrainConfig(**CPTP, cp_variant="ring"), text)
    assert test_gpt_train.max_difference(test_gpt_train.weights(single.model),
                                         test_gpt_train.weights(resumed.model)) < 1e-10


@pytest.mark.parametrize("world,change,message", [
    (4, dict(tp=3), r"--tp 3 does not divide the 4 ranks of a dp group"),
    (6, dict(tp=3), r"--tp 3: --n-head = 4 is not divisible by 3 .* use --tp among \[1, 2\]"),
    (8, dict(cp_variant="ulysses", tp=2, n_head=4), r"ulysses on 4 cp ranks \(--n-head 4 / --tp 2: the heads of one "
                                                    r"tp rank\): .*H = 2 heads do not divide by 4"),
    (2, dict(tp=1, sequence_parallel=True), r"--sequence-parallel .* give --tp 2 or more"),
    (4, dict(sequence_parallel=True, block_size=6), r"cp rank's part of the --block-size 6 positions \(ring over 2 "
                                                    r"cp ranks: \[3, 3\]\) into --tp 2 equal blocks; use a "
                                                    r"--block-size whose cp parts 2 divides \(a multiple of 4\)")])
def test_layouts_cp_with_tp_cannot_run_are_refused_naming_the_fix(world, change, message):
    with pytest.raises(ValueError, match=message):
        check_context_parallel(world, train.TrainConfig(**dict(CPTP, **change)))


def test_the_command_line_takes_tp_and_sequence_parallel_for_cp():
    parser = train_flags.train_parser()
    config = train_flags.train_config(parser.parse_args(["--model", "gpt", "--strategy", "cp", "--cp-variant", "ring",
                                                         "--tp", "2", "--dp", "2", "--sequence-parallel"]))
    assert (config.strategy, config.tp, config.dp, config.sequence_parallel) == ("cp", 2, 2, True)
    with pytest.raises(ValueError, match=r"--sharding-strategy applies to --strategy fsdp only"):
        train_flags.train_config(parser.parse_args(["--model", "gpt", "--strategy", "cp", "--sharding-strategy",
                                                    "FULL_SHARD"]))


# ------------------------------------------------------------------ FSDP over dp x cp (model level)

ADAMW, CLIP, STEPS = dict(lr=1e-2, weight_decay=0.1), 0.05, 3


def one_process(dense, ids, targets):
    """The oracle: three AdamW steps of the dense GPT on the whole batch, the norm clipped."""
    model = copy.deepcopy(dense)
    optimizer = optim.AdamW(model.parameters(), **ADAMW)
    for _ in range(STEPS):
        optimizer.zero_grad()
        model(ids, targets)[1].backward()
        nn.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
    return model.state_dict()


def fsdp_rank(comm, dense, ids, targets, shape, variant, sharding_strategy):
    """One rank of the (dp, cp, tp) mesh ``shape``: the GPT laid out by ``parallelize`` with FSDP
    over dp x cp, three AdamW steps on its dp rank's rows (FSDP's norm, tp shards counted once),
    then the dense state joined over dp x cp and tp."""
    mesh = DeviceMesh(comm, shape, MESH_NAMES)
    config = train.TrainConfig(**CPTP, cp_variant=variant)
    _, model, dp_cp = parallelize(dense, mesh, comm, config, sharding_strategy=sharding_strategy)
    rows = np.array_split(np.arange(len(ids)), shape[0])[mesh.get_local_rank("dp")]
    optimizer = optim.AdamW(model.parameters(), **ADAMW)
    tp = mesh.get_group("tp") if shape[2] > 1 else None
    for _ in range(STEPS):
        optimizer.zero_grad()
        model(ids[rows], targets[rows])[1].backward()
        model.clip_grad_norm_(CLIP, tp_comm=tp, is_cut=is_sharded if tp is not None else None)
        optimizer.step()
    return dense_state(model, mesh)


@pytest.mark.parametrize("shape,variant,sharding_strategy", [((1, 2, 1), "ring", "FULL_SHARD"),
                                                             ((2, 2, 1), "zigzag", "FULL_SHARD"),
                                                             ((1, 2, 2), "ulysses", "SHARD_GRAD_OP"),
                                                             ((2, 2, 2), "allgather", "FULL_SHARD")])
def test_fsdp_over_dp_x_cp_with_tp_inside_trains_as_one_process(shape, variant, sharding_strategy):
    """torchtitan's composition with FSDP in place of DDP (``parallelize(...,
    sharding_strategy=)``, shards cut over the dp x cp ranks of each tp coordinate): three AdamW
    steps with clipping (float64) give the dense weights of one process on the whole batch to
    1e-10 on every rank."""
    dense = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=4, n_embd=16), rng=5, dtype="float64")
    rng = np.random.default_rng(0)
    ids, targets = rng.integers(0, 11, (4, 8)), rng.integers(0, 11, (4, 8))
    expected = one_process(dense, ids, targets)
    for state in sim.run(fsdp_rank, int(np.prod(shape)), dense, ids, targets, shape, variant, sharding_strategy):
        assert max(float(np.abs(np.asarray(state[name]) - value).max()) for name, value in expected.items()) < 1e-10
