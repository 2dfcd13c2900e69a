"""Tensor parallelism's first part (issue 20): f and g, ColumnParallelLinear and
RowParallelLinear, against the dense layers they are cut from, on the simulator, in float64.

The oracle is the dense MLP block (Linear -> GELU -> Linear) run in one process with the same
weights: every rank's output and input gradient must equal the dense ones, and the shards'
weight gradients put side by side must equal the dense weight gradients. Widths that no T
divides are the default here (the audit's lesson from exercise 07), and the number of
all-reduces and their bytes are counted: one forward (g), one backward (f) per pair.
"""
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mpitools import JOB_ENV, mpiexec_or_skip

from minidist import functions as F
from minidist import memory, nn, optim, sim
from minidist.collectives import chunk_bounds
from minidist.models.gpt import GPT, GPTConfig
from minidist.p2p import CollectiveError
from minidist.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    parallelize_gpt,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    shard_bounds,
    vocab_parallel_cross_entropy,
)
from minidist.tensor import Tensor
from minidist.tracing import CountingComm

IN, HIDDEN, OUT = 6, 10, 5  # 10 hidden features: uneven on 3 and 4 ranks


def dense_block(seed=0, bias=True):
    return (nn.Linear(IN, HIDDEN, bias, rng=seed, dtype="float64"),
            nn.Linear(HIDDEN, OUT, bias, rng=seed + 1, dtype="float64"))


def inputs(seed=2):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(3, 4, IN)), rng.normal(size=(3, 4, OUT))  # x (B, T, C) and the loss's weights


def run_block(first, second, x, w):
    """Forward the block, loss = sum(y * w), backward. Returns (y, dx)."""
    xt = Tensor(x, requires_grad=True)
    y = second(F.gelu(first(xt), approximate="tanh"))
    (y * Tensor(w)).sum().backward()
    return y.data, xt.grad


def dense_reference(bias=True):
    first, second = dense_block(bias=bias)
    x, w = inputs()
    y, dx = run_block(first, second, x, w)
    return y, dx, first, second


def tensor_parallel_rank(comm, bias=True):
    first, second = dense_block(bias=bias)
    col = ColumnParallelLinear.from_dense(first, comm)
    row = RowParallelLinear.from_dense(second, comm)
    x, w = inputs()
    y, dx = run_block(col, row, x, w)
    grads = {"col.weight": col.weight.grad, "row.weight": row.weight.grad}
    if bias:
        grads |= {"col.bias": col.bias.grad, "row.bias": row.bias.grad}
    return y, dx, grads


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_the_split_block_equals_the_dense_block(world_size, bias):
    y, dx, first, second = dense_reference(bias)
    results = sim.run(tensor_parallel_rank, world_size, bias)
    for ty, tdx, _ in results:  # every rank holds the whole output and the whole input gradient
        np.testing.assert_allclose(ty, y, rtol=0, atol=1e-12)
        np.testing.assert_allclose(tdx, dx, rtol=0, atol=1e-12)
    bounds = chunk_bounds(HIDDEN, world_size)
    assert [g["col.weight"].shape[0] for _, _, g in results] == [stop - start for start, stop in bounds]
    np.testing.assert_allclose(np.concatenate([g["col.weight"] for _, _, g in results]), first.weight.grad, atol=1e-12)
    np.testing.assert_allclose(np.concatenate([g["row.weight"] for _, _, g in results], axis=1), second.weight.grad,
                               atol=1e-12)
    if bias:
        np.testing.assert_allclose(np.concatenate([g["col.bias"] for _, _, g in results]), first.bias.grad,
                                   atol=1e-12)
        for _, _, g in results:  # the row layer's bias is added once, after the sum: whole on every rank
            np.testing.assert_allclose(g["row.bias"], second.bias.grad, atol=1e-12)


def test_sgd_steps_on_the_shards_follow_the_dense_block():
    first, second = dense_block()
    x, w = inputs()
    for _ in range(3):
        first.zero_grad(), second.zero_grad()
        run_block(first, second, x, w)
        for p in (*first.parameters(), *second.parameters()):
            p.data -= 0.1 * p.grad

    def rank(comm):
        a, b = dense_block()
        col, row = ColumnParallelLinear.from_dense(a, comm), RowParallelLinear.from_dense(b, comm)
        for _ in range(3):
            col.zero_grad(), row.zero_grad()
            run_block(col, row, x, w)
            for p in (*col.parameters(), *row.parameters()):
                p.data -= 0.1 * p.grad
        return col.weight.data, row.weight.data

    shards = sim.run(rank, 3)
    np.testing.assert_allclose(np.concatenate([c for c, _ in shards]), first.weight.data, atol=1e-12)
    np.testing.assert_allclose(np.concatenate([r for _, r in shards], axis=1), second.weight.data, atol=1e-12)


def test_one_all_reduce_forward_and_one_backward_with_their_bytes():
    """On 2 ranks "auto" all-reduces a small activation by recursive doubling: one message of
    the whole (B, T, C) float64 array each way per all-reduce, so rank 0 sends 2 data messages
    per step: g's output (3·4·5 values) forward, f's input gradient (3·4·6) backward."""

    def rank(comm):
        counted = CountingComm(comm)
        first, second = dense_block()
        col, row = ColumnParallelLinear.from_dense(first, counted), RowParallelLinear.from_dense(second, counted)
        x, w = inputs()
        run_block(col, row, x, w)
        return [(m.count, m.dtype) for m in counted.sent if np.dtype(m.dtype) == np.float64]

    sent = sim.run(rank, 2)[0]
    assert sent == [(3 * 4 * OUT, np.dtype("float64")), (3 * 4 * IN, np.dtype("float64"))], sent


def test_f_and_g_are_each_others_mirror():
    def rank(comm):
        x = Tensor(np.full((2, 3), comm.Get_rank() + 1.0), requires_grad=True)
        y = copy_to_tensor_parallel_region(x, comm)
        z = reduce_from_tensor_parallel_region(y * 2.0, comm)
        z.sum().backward()
        return y.data, z.data, x.grad

    for r, (y, z, dx) in enumerate(sim.run(rank, 3)):
        np.testing.assert_array_equal(y, np.full((2, 3), r + 1.0))  # f: identity forward
        np.testing.assert_array_equal(z, np.full((2, 3), 2.0 * (1 + 2 + 3)))  # g: summed forward
        np.testing.assert_array_equal(dx, np.full((2, 3), 2.0 * 3))  # g's gradient passed on, f's summed


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_the_sequence_parallel_operators_are_each_others_mirror(world_size):
    """All-gather forward / reduce-scatter backward and its conjugate, along axis 1 of (B, t, C)
    with 2 positions per rank: the gathered array is the ranks' blocks in rank order; the
    reduce-scatter keeps this rank's block of the sum; each one's backward is the other."""
    rng = np.random.default_rng(7)
    blocks = rng.normal(size=(world_size, 2, 2, 3))  # rank r's (B=2, 2 positions, C=3)
    weights = rng.normal(size=(world_size, 2, 2 * world_size, 3))  # each rank's weights of the whole sequence

    def rank(comm):
        r = comm.Get_rank()
        x = Tensor(blocks[r], requires_grad=True)
        whole = gather_from_sequence_parallel_region(x, comm)
        mine = reduce_scatter_to_sequence_parallel_region(whole * Tensor(weights[r]), comm)
        (mine * mine).sum().backward()
        return whole.data, mine.data, x.grad

    full = np.concatenate(list(blocks), axis=1)  # (2, 2T, 3)
    summed = full * weights.sum(axis=0)
    for r, (whole, mine, dx) in enumerate(sim.run(rank, world_size)):
        np.testing.assert_array_equal(whole, full)
        np.testing.assert_allclose(mine, summed[:, 2 * r:2 * r + 2], rtol=1e-12)
        # d/dx of sum over ranks q of (sum_s w_s * full)[q's block]^2: 2 * summed * sum_s w_s, at r's block
        np.testing.assert_allclose(dx, (2 * summed * weights.sum(axis=0))[:, 2 * r:2 * r + 2], rtol=1e-12)


def test_more_ranks_than_features_and_a_wrong_input_are_clear_errors():
    def too_many(comm):
        return ColumnParallelLinear.from_dense(nn.Linear(4, 3, rng=0), comm)

    with pytest.raises(ValueError, match="cannot split 3 features over 4 tensor-parallel ranks"):
        sim.run(too_many, 4)

    def wrong_input(comm):
        row = RowParallelLinear.from_dense(nn.Linear(6, 2, rng=0), comm)
        row(Tensor(np.ones((1, 6))))  # the whole input, not this rank's 3 features

    with pytest.raises(ValueError, match="feed it the output of the matching ColumnParallelLinear"):
        sim.run(wrong_input, 2)

    def gappy(comm):  # a row-parallel layer reads one block of input features, never a scattered set
        RowParallelLinear.from_dense(nn.Linear(6, 2, rng=0), comm, columns=[0, 2, 3])

    with pytest.raises(ValueError, match="columns must be consecutive integers"):
        sim.run(gappy, 1)

    def mismatched(comm):  # ranks disagree on the shape of what g sums: every rank raises, none hangs
        reduce_from_tensor_parallel_region(Tensor(np.ones(2 + comm.Get_rank())), comm)

    with pytest.raises(CollectiveError, match="disagree"):
        sim.run(mismatched, 2)
    assert shard_bounds(10, type("C", (), {"Get_size": lambda self: 4, "Get_rank": lambda self: 3})()) == (8, 10)


MPI_SCRIPT = """
import numpy as np
from mpi4py import MPI
import test_tensor_parallel as t
comm = MPI.COMM_WORLD
y, dx, grads = t.tensor_parallel_rank(comm)
ref_y, ref_dx, first, second = t.dense_reference()
start, stop = t.shard_bounds(t.HIDDEN, comm)
assert np.abs(y - ref_y).max() < 1e-12 and np.abs(dx - ref_dx).max() < 1e-12
assert np.abs(grads["col.weight"] - first.weight.grad[start:stop]).max() < 1e-12
assert np.abs(grads["row.weight"] - second.weight.grad[:, start:stop]).max() < 1e-12
dense, dense_losses, _ = t.dense_gpt_steps(3)
for sequence_parallel in (False, True):
    state, losses, _, _ = t.tensor_parallel_gpt_steps(comm, 3, sequence_parallel)
    assert np.abs(np.array(losses) - dense_losses).max() < 1e-10, (losses, dense_losses)
    assert all(np.abs(state[name] - value).max() < 1e-10 for name, value in dense.state_dict().items())
print(f"rank {comm.Get_rank()} ok {start}:{stop}", flush=True)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("world_size", [2, 4])
def test_the_split_block_and_gpt_equal_the_dense_ones_under_mpiexec(world_size, tmp_path):
    """The block, and three AdamW steps of the GPT (losses and full_state_dict), with and without
    sequence parallelism, on real MPI."""
    script = tmp_path / "tp_block.py"
    script.write_text(MPI_SCRIPT)
    env = {**os.environ, **JOB_ENV, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                                                     os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([mpiexec_or_skip(), "-n", str(world_size), sys.executable, "-m", "mpi4py", str(script)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    bounds = chunk_bounds(HIDDEN, world_size)
    # mpiexec merges the ranks' lines in any order (and may split one): find them, not the lines
    assert sorted(re.findall(r"rank \d+ ok \d+:\d+", run.stdout)) == [f"rank {r} ok {a}:{b}"
                                                                     for r, (a, b) in enumerate(bounds)]


# ------------------------------------------------------------------ the GPT's blocks, split

# Vocabulary 11: no T in 2..4 divides it. 4 heads of 2 channels on 1, 2, 4 ranks; 3 heads of 2 on 3
# ranks (the model must split evenly: check_split), with sequences of 6 there (sequence parallelism
# cuts the positions into T equal blocks).
GPT_CONFIG = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=4, n_embd=8)
GPT_CONFIG_3 = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=3, n_embd=6)


def gpt_config(world_size):
    return GPT_CONFIG_3 if world_size == 3 else GPT_CONFIG


def gpt_batch(t=8, b=2):
    rng = np.random.default_rng(3)
    return rng.integers(0, 11, size=(b, t)), rng.integers(0, 11, size=(b, t))


def training_steps(model, steps, t=8, clip=None, optimizer="adamw"):
    """``steps`` AdamW (or SGD with momentum) steps of ``model`` on one fixed batch of length
    ``t`` (with the gradient's norm clipped to ``clip``: ``model.clip_grad_norm_`` on the split
    model); returns the losses and the norms before clipping."""
    if optimizer == "adamw":
        optimizer = optim.AdamW(model.parameters(), lr=1e-2)
    else:
        optimizer = optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    idx, targets = gpt_batch(t)
    losses, norms = [], []
    for _ in range(steps):
        optimizer.zero_grad()
        _, loss = model(idx, targets)
        loss.backward()
        if clip is not None:
            split = hasattr(model, "full_state_dict")
            norms.append(model.clip_grad_norm_(clip) if split else nn.clip_grad_norm_(model.parameters(), clip))
        optimizer.step()
        losses.append(float(loss.data))
    return losses, norms


def dense_gpt_steps(steps, config=GPT_CONFIG, t=8, clip=None, optimizer="adamw"):
    model = GPT(config, rng=0, dtype="float64")
    return model, *training_steps(model, steps, t, clip, optimizer)


def tensor_parallel_gpt_steps(comm, steps, sequence_parallel=False, config=GPT_CONFIG, t=8, clip=None,
                              optimizer="adamw"):
    model = parallelize_gpt(GPT(config, rng=0, dtype="float64"), comm, sequence_parallel=sequence_parallel)
    losses, norms = training_steps(model, steps, t, clip, optimizer)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    return model.full_state_dict(), losses, norms, shapes


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_the_split_gpt_trains_as_the_dense_gpt(world_size, sequence_parallel, optimizer):
    """Four AdamW (or SGD with momentum) steps in float64, the gradient's norm clipped: the
    same loss and norm on every rank as the dense GPT's, and full_state_dict (the shards put
    back together, attention's c_attn from the q, k and v rows of each rank's heads) equal to
    the dense weights on every rank, ready for a dense GPT; with and without sequence
    parallelism."""
    config, t = gpt_config(world_size), 6 if world_size == 3 else 8
    dense, losses, norms = dense_gpt_steps(4, config, t, clip=0.5, optimizer=optimizer)
    assert max(norms) > 0.5  # the clipping acts
    results = sim.run(tensor_parallel_gpt_steps, world_size, 4, sequence_parallel, config, t, 0.5, optimizer)
    reference = dense.state_dict()
    for state, their_losses, their_norms, _ in results:
        np.testing.assert_allclose(their_losses, losses, rtol=0, atol=1e-10)
        np.testing.assert_allclose(their_norms, norms, rtol=1e-12)
        assert list(state) == list(reference)
        for name, value in reference.items():
            np.testing.assert_allclose(state[name], value, rtol=0, atol=1e-10, err_msg=name)
    GPT(config, rng=1, dtype="float64").load_state_dict(results[-1][0])  # the dense names and shapes
    shapes = [shapes for *_, shapes in results]
    c, v = config.n_embd, config.vocab_size
    assert [s["transformer.h.0.attn.c_attn.weight"] for s in shapes] == [(3 * c // world_size, c)] * world_size
    assert [s["transformer.h.1.mlp.c_proj.weight"] for s in shapes] == [(c, 4 * c // world_size)] * world_size
    assert [s["transformer.wte.weight"][0] for s in shapes] == [b - a for a, b in chunk_bounds(v, world_size)]


def test_parallelize_gpt_refuses_a_model_it_cannot_split_evenly_and_dropout():
    """The contract's error: n_head (or 4 n_embd) not divisible by T, naming the sizes that work;
    more ranks than tokens; dropout; a sequence that T equal blocks cannot cover (sequence
    parallelism), raised by every rank before any message."""
    def uneven(comm):
        parallelize_gpt(GPT(GPTConfig(vocab_size=5, block_size=4, n_layer=1, n_head=2, n_embd=4), rng=0), comm)

    with pytest.raises(ValueError, match=r"n_head = 2 is not divisible by 3 .* among \[1, 2\]"):
        sim.run(uneven, 3)

    def small_vocabulary(comm):
        parallelize_gpt(GPT(GPTConfig(vocab_size=3, block_size=4, n_layer=1, n_head=4, n_embd=4), rng=0), comm)

    with pytest.raises(ValueError, match="vocabulary of 3 tokens over 4 ranks"):
        sim.run(small_vocabulary, 4)

    def dropout(comm):
        parallelize_gpt(GPT(GPTConfig(vocab_size=5, block_size=4, n_layer=1, n_head=2, n_embd=4, dropout=0.1),
                            rng=0), comm)

    with pytest.raises(ValueError, match="dropout = 0"):
        sim.run(dropout, 2)

    def odd_sequence(comm):
        model = parallelize_gpt(GPT(GPT_CONFIG, rng=0), comm, sequence_parallel=True)
        model(*gpt_batch(t=7))

    with pytest.raises(ValueError, match="its length is 7; use a sequence length"):
        sim.run(odd_sequence, 2)
    sim.run(lambda comm: parallelize_gpt(GPT(GPT_CONFIG, rng=0), comm)(*gpt_batch(t=7)), 2)  # fine without SP

    def sample(comm):
        parallelize_gpt(GPT(GPT_CONFIG, rng=0), comm).generate(np.zeros((1, 1), dtype=int), 3)

    with pytest.raises(NotImplementedError, match="full_state_dict"):
        sim.run(sample, 2)


def counted_step(comm, sequence_parallel, b=3):
    """One forward and backward of the split GPT through a CountingComm: the element counts
    of the float64 messages this rank sent, forward and backward."""
    counted = CountingComm(comm)
    model = parallelize_gpt(GPT(GPT_CONFIG, rng=0, dtype="float64"), counted, sequence_parallel=sequence_parallel)
    _, loss = model(*gpt_batch(b=b))
    forward = [m.count for m in counted.sent if np.dtype(m.dtype) == np.float64]
    loss.backward()
    return forward, [m.count for m in counted.sent if np.dtype(m.dtype) == np.float64][len(forward):]


def test_two_all_reduces_forward_and_two_backward_per_block_and_three_numbers_per_position():
    """Megatron's count without sequence parallelism. Forward: the embedding's g, then per
    block g after attention and after the MLP, each an all-reduce of a (B, T, C) activation,
    then the loss's three all-reduces of one number per position (maximum, sum of exponentials
    with one number more, the rank's width, summed to V; target logit). Backward: f before the
    output layer, then f before each split layer, (B, T, C) each; the loss's backward sends
    nothing. On 2 ranks "auto" sends each array whole
    (recursive doubling): one float64 message per all-reduce."""
    forward, backward = sim.run(counted_step, 2, False)[0]
    b, t, c, layers = 3, 8, GPT_CONFIG.n_embd, GPT_CONFIG.n_layer
    assert forward == [b * t * c] * (1 + 2 * layers) + [b * t, b * t + 1, b * t]
    assert backward == [b * t * c] * (1 + 2 * layers)


def test_sequence_parallelism_sends_half_activations_and_sums_the_layernorm_gradients():
    """Korthikanti et al.'s count on 2 ranks: each all-reduce of a (B, T, C) activation becomes
    a reduce-scatter and an all-gather, each one message of half of it (a ring of two).
    Forward: the embedding's reduce-scatter, per block an all-gather and a reduce-scatter around
    attention and around the MLP, the head's all-gather, then the loss's three all-reduces: the
    same bytes as without sequence parallelism (on two ranks an all-reduce sends the whole array
    once, as much as the two halves). Backward: the mirror image, plus one more all-gather per
    column-parallel layer (each gathers its input again instead of keeping it), plus one
    all-reduce per whole parameter used on a block of positions (per block ln_1, ln_2 weight
    and bias and the two c_proj biases, C numbers each; ln_f's two; the position embedding,
    block_size x C)."""
    forward, backward = sim.run(counted_step, 2, True)[0]
    tp_forward, tp_backward = sim.run(counted_step, 2, False)[0]
    b, t, c, layers = 3, 8, GPT_CONFIG.n_embd, GPT_CONFIG.n_layer
    half = b * t * c // 2
    assert forward == [half] * (2 + 4 * layers) + [b * t, b * t + 1, b * t]
    assert sum(forward) == sum(tp_forward)
    activations = [n for n in backward if n == half]
    assert len(activations) == (2 + 4 * layers) + (1 + 2 * layers)  # the mirror image, and the gathers again
    assert sum(activations) == sum(tp_backward) + (1 + 2 * layers) * half
    assert sorted(n for n in backward if n != half) == sorted([c] * (6 * layers + 2) + [GPT_CONFIG.block_size * c])


def test_sequence_parallelism_keeps_a_block_of_the_positions_for_backward():
    """memory.track on one forward, per rank: the split layers keep 1/T of the dense model's
    activations inside attention and the MLP; sequence parallelism also cuts the LayerNorms',
    residuals' and gathered inputs' part, so a rank keeps less than with tensor parallelism
    alone, on 2 and on 4 ranks, and less on 4 than on 2."""
    config = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=4, n_embd=16)
    idx, targets = gpt_batch(b=4)

    def held(comm, sequence_parallel):
        model = parallelize_gpt(GPT(config, rng=0, dtype="float64"), comm, sequence_parallel=sequence_parallel)
        with memory.track() as tracker:
            model(idx, targets)
        return tracker.peak_bytes

    with memory.track() as tracker:
        GPT(config, rng=0, dtype="float64")(idx, targets)
    dense = tracker.peak_bytes
    # the largest rank's (vocabulary 11 is cut unevenly, so the logits' columns differ by one)
    peaks = {(p, sp): max(sim.run(held, p, sp)) for p in (2, 4) for sp in (False, True)}
    for p in (2, 4):
        assert peaks[p, True] < peaks[p, False] < dense
    assert peaks[4, True] < peaks[2, True] and peaks[4, False] < peaks[2, False]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_vocab_parallel_cross_entropy_and_embedding_equal_the_dense_ones(world_size):
    """Vocabulary 7 (uneven on 2, 3, 4 ranks), targets with ignored positions (-1) and
    repeated ids: loss and gradients equal nn.functional.cross_entropy's and embedding's."""
    rng = np.random.default_rng(5)
    logits, weight = rng.normal(size=(9, 7)) * 3, rng.normal(size=(7, 4))
    targets = np.array([0, 6, 6, -1, 3, 2, -1, 5, 1])
    ids = np.array([[0, 6, 6], [2, 2, 5]])
    dense_logits, dense_weight = Tensor(logits, requires_grad=True), Tensor(weight, requires_grad=True)
    loss = F.cross_entropy(dense_logits, targets, ignore_index=-1)
    loss.backward()
    rows = F.embedding(ids, dense_weight)
    (rows * Tensor(np.arange(24.0).reshape(2, 3, 4))).sum().backward()

    def rank(comm):
        start, stop = shard_bounds(7, comm)
        mine = Tensor(logits[:, start:stop], requires_grad=True)
        their_loss = vocab_parallel_cross_entropy(mine, targets, comm, start)
        their_loss.backward()
        table = VocabParallelEmbedding.from_dense(nn.Embedding(7, 4, rng=0), comm)
        table.weight.data = weight[start:stop].copy()
        out = table(ids)
        (out * Tensor(np.arange(24.0).reshape(2, 3, 4))).sum().backward()
        return float(their_loss.data), mine.grad, out.data, table.weight.grad

    results = sim.run(rank, world_size)
    for their_loss, _, out, _ in results:
        assert abs(their_loss - float(loss.data)) < 1e-12
        np.testing.assert_allclose(out, rows.data, rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.concatenate([r[1] for r in results], axis=1), dense_logits.grad, atol=1e-12)
    np.testing.assert_allclose(np.concatenate([r[3] for r in results]), dense_weight.grad, atol=1e-12)


def fail_in_block_1(model, comm):
    """Make rank 1's second block raise from its MLP's forward (after the first block's messages)."""
    if comm.Get_rank() == 1:
        def fail(x):
            raise ValueError("rank 1 failed mid-forward")
        model.transformer.h[1].mlp.forward = fail


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_rank_that_raises_mid_forward_ends_every_rank_with_its_error(sequence_parallel):
    """Rank 1 raises inside the second block while rank 0 goes on to the MLP's collective: the
    run ends on both with rank 1's error, in well under the deadline, not a hang."""
    def rank(comm):
        model = parallelize_gpt(GPT(GPT_CONFIG, rng=0), comm, sequence_parallel=sequence_parallel)
        fail_in_block_1(model, comm)
        model(*gpt_batch())

    start = time.perf_counter()
    with pytest.raises(ValueError, match="rank 1 failed mid-forward") as info:
        sim.World(2, timeout=30).run(rank)
    assert info.value.rank == 1 and time.perf_counter() - start < 10


FAILING_SCRIPT = """
from mpi4py import MPI
import test_tensor_parallel as t
comm = MPI.COMM_WORLD
model = t.parallelize_gpt(t.GPT(t.GPT_CONFIG, rng=0), comm, sequence_parallel=True)
t.fail_in_block_1(model, comm)
model(*t.gpt_batch())
print("finished", flush=True)
"""


@pytest.mark.mpi
def test_a_rank_that_raises_mid_forward_ends_every_rank_under_mpiexec(tmp_path):
    """Under ``mpiexec -n 2 python -m mpi4py``: rank 1's uncaught error aborts the job (exit
    status not 0, the error printed), and rank 0, waiting in a collective, ends with it."""
    script = tmp_path / "tp_fail.py"
    script.write_text(FAILING_SCRIPT)
    env = {**os.environ, **JOB_ENV, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                                                     os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    run = subprocess.run([mpiexec_or_skip(), "-n", "2", sys.executable, "-m", "mpi4py", str(script)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode != 0 and "rank 1 failed mid-forward" in run.stdout + run.stderr
    assert "finished" not in run.stdout and time.perf_counter() - start < 60


def test_a_target_no_rank_holds_is_refused_on_every_rank():
    """An id >= V (or < 0, not ignore_index) has no logit on any rank; each rank learns V from
    the second all-reduce (the widths summed) and every rank raises the same error."""
    logits = np.zeros((2, 7))

    def rank(comm):
        start, stop = shard_bounds(7, comm)
        vocab_parallel_cross_entropy(Tensor(logits[:, start:stop]), np.array([3, 7]), comm, start)

    for world_size in (1, 2, 3):
        with pytest.raises(ValueError, match=r"target ids must be in \[0, V = 7\) or ignore_index = -1; got 7"):
            sim.run(rank, world_size)
