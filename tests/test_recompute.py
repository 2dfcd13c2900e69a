"""Activation recomputation: checkpoint and checkpoint_sequential (torch.utils.checkpoint semantics).

Oracles: the same network run without checkpointing (gradients bitwise equal, float64); the
cost formulas of Chen et al. 2016 for forward calls and peak activations (counted with a
counting wrapper and with minidist.memory's tracker); nn.Dropout's masks replayed or not.
"""
import numpy as np
import pytest

from minidist import memory, nn, no_grad
from minidist.recompute import checkpoint, checkpoint_sequential
from minidist.tensor import Tensor

B, W = 8, 5  # batch, width


def blocks(n, seed=0, dropout=None):
    """An MLP of n layers, each a Sequential(Linear, Tanh) (float64), optionally with Dropout."""
    layers = []
    for i in range(n):
        block = [nn.Linear(W, W, rng=seed + i, dtype="float64"), nn.Tanh()]
        if dropout is not None:
            block.append(nn.Dropout(dropout, rng=100 + seed + i))
        layers.append(nn.Sequential(*block))
    return nn.Sequential(*layers)


def data(requires_grad, seed=1):
    return Tensor(np.random.default_rng(seed).standard_normal((B, W)), requires_grad=requires_grad)


def grads(model, x, run):
    """Output, parameter gradients and input gradient of loss = sum(out * c)."""
    out = run(model, x)
    c = np.random.default_rng(2).standard_normal(out.shape)
    (out * c).sum().backward()
    return out.data, [p.grad for p in model.parameters()], x.grad


class Counting(nn.Module):
    """Wraps a module and counts its forward calls."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, x):
        self.calls += 1
        return self.inner(x)


# ----------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("input_requires_grad", [False, True])
def test_gradients_bitwise_equal_with_and_without_checkpointing_for_every_segments(input_requires_grad):
    n = 7
    ref_out, ref_grads, ref_x = grads(blocks(n), data(input_requires_grad), lambda m, x: m(x))
    for k in range(1, n + 1):
        run = lambda m, x, k=k: checkpoint_sequential(m, k, x)
        out, got, gx = grads(blocks(n), data(input_requires_grad), run)
        assert np.array_equal(out, ref_out), k
        assert all(g is not None and np.array_equal(g, r) for g, r in zip(got, ref_grads)), k
        if input_requires_grad:
            assert np.array_equal(gx, ref_x), k
        else:
            assert gx is None


def test_checkpoint_of_a_module_and_a_function_of_several_tensors_and_outputs():
    rng = np.random.default_rng(3)
    a0, b0 = rng.standard_normal((4, 3)), rng.standard_normal((3,))

    def f(a, b, scale):  # two outputs, one non-Tensor argument passed through
        return (a * b).tanh() * scale, (a @ b).sum()

    def loss(u, v):
        return (u * u).sum() + 3 * v

    results = []
    for use_checkpoint in (False, True):
        a, b = Tensor(a0, requires_grad=True), Tensor(b0, requires_grad=True)
        u, v = checkpoint(f, a, b, 2.0) if use_checkpoint else f(a, b, 2.0)
        loss(u, v).backward()
        results.append((u.data, v.data, a.grad, b.grad))
    for plain, checkpointed in zip(*results):
        np.testing.assert_allclose(checkpointed, plain, rtol=1e-14, atol=0)

    # only one of the two outputs used: the other contributes nothing
    a, b = Tensor(a0, requires_grad=True), Tensor(b0, requires_grad=True)
    u, v = checkpoint(f, a, b, 2.0)
    v.backward()
    np.testing.assert_allclose(a.grad, np.broadcast_to(b0, (4, 3)), rtol=1e-15)


def test_nested_checkpoints_and_retain_graph():
    n = 4
    ref_out, ref_grads, _ = grads(blocks(n), data(False), lambda m, x: m(x))
    inner = lambda m: (lambda x: checkpoint(m[1:3], x))
    run = lambda m, x: m[3](checkpoint(lambda y: inner(m)(m[0](y)), x))
    out, got, _ = grads(blocks(n), data(False), run)
    assert np.array_equal(out, ref_out)
    assert all(np.array_equal(g, r) for g, r in zip(got, ref_grads))

    model, x = blocks(n), data(False)
    loss = checkpoint_sequential(model, 2, x).sum()
    loss.backward(retain_graph=True)
    first = [p.grad.copy() for p in model.parameters()]
    loss.backward()  # recomputes again and adds the same gradients
    assert all(np.array_equal(p.grad, 2 * g) for p, g in zip(model.parameters(), first))


def test_under_no_grad_checkpoint_is_a_plain_call():
    model, x = blocks(3), data(True)
    with no_grad():
        out = checkpoint(model, x)
    assert not out.requires_grad and out.is_leaf
    assert np.array_equal(out.data, model(x).data)


# ----------------------------------------------------------------------------- cost formulas


@pytest.mark.parametrize("n", [6, 7])
def test_forward_calls_are_n_plus_k_minus_1_times_floor_n_over_k(n):
    for k in range(1, n + 1):
        layers = [Counting(layer) for layer in blocks(n)]
        out = checkpoint_sequential(nn.Sequential(*layers), k, data(False))
        assert sum(layer.calls for layer in layers) == n  # the forward: each layer once
        out.sum().backward()
        s = n // k
        assert sum(layer.calls for layer in layers) == n + (k - 1) * s, k
        # the first (k-1)s layers ran twice, the last segment once (not checkpointed)
        assert [layer.calls for layer in layers] == [2] * ((k - 1) * s) + [1] * (n - (k - 1) * s)


def peak_held(model, k, x):
    with memory.track() as tracker:
        checkpoint_sequential(model, k, x).sum().backward()
    assert tracker.live_bytes == 0  # everything held was freed by the backward
    # ops recorded: every layer's ops once (the checkpointed ones only when recomputed, their
    # first forward records nothing), k - 1 checkpoints and the sum
    ops_per_layer = 1 if isinstance(model[0], nn.Tanh) else 2
    assert tracker.saves == ops_per_layer * len(model) + (k - 1) + 1
    return tracker.peak_bytes


@pytest.mark.parametrize("layer, arrays_per_layer", [("tanh", 1), ("linear+tanh", 2)])
def test_peak_activations_follow_chens_formula(layer, arrays_per_layer):
    """Peak bytes held for backward = k - 1 segment inputs + max(n - (k-1)s, s) layers' worth
    + 1 array (the input of the last segment: the output of the last checkpointed one, or
    for k = 1 the network's input, which the first op keeps). A tanh layer holds one array
    of the activation size (its output; its input is the previous layer's output), a
    Linear + Tanh block two (pre-activation and output; module docstring of memory)."""
    n = 12
    x = Tensor(np.ones((B, W)), requires_grad=True)  # a chain of tanh has no parameters
    model = nn.Sequential(*[nn.Tanh() for _ in range(n)]) if layer == "tanh" else blocks(n)
    act = x.data.nbytes
    for k in range(1, n + 1):
        s = n // k
        expected = (k - 1) + arrays_per_layer * max(n - (k - 1) * s, s) + 1
        assert peak_held(model, k, x) == expected * act, k
    # the sqrt(n) choice is (near) the best: k = 3 or 4 for n = 12
    peaks = {k: peak_held(model, k, x) for k in range(1, n + 1)}
    assert min(peaks, key=peaks.get) in (3, 4)


# ----------------------------------------------------------------------------- dropout and RNG state


def test_dropout_masks_scaling_eval_and_seeds():
    x = Tensor(np.ones((200, 50)))
    drop = nn.Dropout(0.3, rng=7)
    y = drop(x).data
    assert set(np.unique(y)) == {0.0, 1 / 0.7}  # inverted dropout: kept values scaled by 1/(1-p)
    assert abs((y == 0).mean() - 0.3) < 0.02
    assert np.array_equal(nn.Dropout(0.3, rng=7)(x).data, y)  # same seed, same mask
    assert not np.array_equal(drop(x).data, y)  # the generator moves on
    drop.eval()
    assert drop(x) is x
    drop.train()
    assert np.array_equal(nn.Dropout(0.0)(x).data, x.data)
    assert not nn.Dropout(1.0, rng=0)(x).data.any()
    for bad in (-0.1, 1.5, "0.5", True):
        with pytest.raises(ValueError, match="probability"):
            nn.Dropout(bad)


def test_dropout_gradient_is_the_mask():
    x = Tensor(np.random.default_rng(0).standard_normal((6, 4)), requires_grad=True)
    y = nn.Dropout(0.5, rng=1)(x)
    y.sum().backward()
    np.testing.assert_array_equal(x.grad, np.where(y.data != 0, 2.0, 0.0))


def test_recomputed_dropout_masks_equal_the_originals_only_when_rng_state_is_preserved():
    n, k = 6, 3
    ref_model = blocks(n, dropout=0.5)
    ref_out, ref_grads, _ = grads(ref_model, data(False), lambda m, x: m(x))
    ref_states = [m.generator.bit_generator.state for m in ref_model.modules() if isinstance(m, nn.Dropout)]

    model = blocks(n, dropout=0.5)
    out, got, _ = grads(model, data(False), lambda m, x: checkpoint_sequential(m, k, x))
    assert np.array_equal(out, ref_out)
    assert all(np.array_equal(g, r) for g, r in zip(got, ref_grads))  # same masks in the recompute
    # the recompute replayed the draws, then put every generator back where training left it
    assert [m.generator.bit_generator.state for m in model.modules() if isinstance(m, nn.Dropout)] == ref_states

    model = blocks(n, dropout=0.5)
    out, got, _ = grads(model, data(False), lambda m, x: checkpoint_sequential(m, k, x, preserve_rng_state=False))
    assert np.array_equal(out, ref_out)  # the forward drew the same masks...
    checkpointed = range(2 * (k - 1) * (n // k))  # weight and bias of each checkpointed layer
    # ...but the recomputation drew new ones: the checkpointed layers' gradients differ
    assert all(not np.array_equal(got[i], ref_grads[i]) for i in checkpointed)
    assert all(np.array_equal(g, r) for g, r in list(zip(got, ref_grads))[len(checkpointed):])


def test_recompute_leaves_a_shared_generator_where_training_left_it():
    """Two Dropouts draw from one generator, the first inside a checkpoint: the recompute
    replays the first draw, then must restore the state after the second (torch's fork_rng)."""
    def run(use_checkpoint):
        gen = np.random.default_rng(5)
        first, second = nn.Sequential(nn.Tanh(), nn.Dropout(0.5, rng=gen)), nn.Dropout(0.5, rng=gen)
        x = data(True)
        hidden = checkpoint(first, x) if use_checkpoint else first(x)
        second(hidden).sum().backward()
        return x.grad, gen.random()

    (plain_grad, plain_next), (grad, next_draw) = run(False), run(True)
    assert np.array_equal(grad, plain_grad)
    assert next_draw == plain_next


# ----------------------------------------------------------------------------- errors


def test_bad_arguments_are_clear_errors():
    model, x = blocks(3), data(False)
    with pytest.raises(TypeError, match="callable"):
        checkpoint(42, x)
    with pytest.raises(TypeError, match="none of the arguments is a Tensor"):
        checkpoint(model, x.data)
    with pytest.raises(TypeError, match="preserve_rng_state"):
        checkpoint(model, x, preserve_rng_state="yes")
    with pytest.raises(TypeError, match="must return a Tensor"):
        checkpoint(lambda t: t.data, x)
    with pytest.raises(ValueError, match="between 1 and the number of layers \\(3\\), got 0"):
        checkpoint_sequential(model, 0, x)
    with pytest.raises(ValueError, match="between 1 and the number of layers \\(3\\), got 4"):
        checkpoint_sequential(model, 4, x)
    with pytest.raises(TypeError, match="segments must be an int"):
        checkpoint_sequential(model, 2.0, x)
    with pytest.raises(TypeError, match="segments must be an int"):
        checkpoint_sequential(model, True, x)
    with pytest.raises(TypeError, match="input must be a Tensor"):
        checkpoint_sequential(model, 2, x.data)
    with pytest.raises(TypeError, match="nn.Sequential or a list"):
        checkpoint_sequential(lambda t: t, 1, x)
    with pytest.raises(TypeError, match="layer 1 is a int"):
        checkpoint_sequential([model[0], 3], 1, x)
    with pytest.raises(ValueError, match="no layers"):
        checkpoint_sequential([], 1, x)


# ----------------------------------------------------------------------------- in a pipeline


def run_pipeline_with(comm, schedule, mode, m, x, y):
    """One step of a p-stage pipeline (one stage per rank, 2 blocks each); returns this rank's
    stage: gradients, forward calls of its submodule, peak bytes held, one micro-batch's input bytes."""
    from minidist.functions import cross_entropy
    from minidist.parallel.pipeline import executor as E

    p, rank = comm.Get_size(), comm.Get_rank()
    model = blocks(2 * p, seed=10)
    stage = E.PipelineStage(Counting(model[2 * rank:2 * rank + 2]), rank, p, comm, timeout=30)
    sched = {"gpipe": E.ScheduleGPipe, "1f1b": E.Schedule1F1B, "zero-bubble": E.ScheduleZeroBubble}[schedule](
        stage, m, cross_entropy, checkpoint=mode)
    sched.step(*((x,) if rank == 0 else ()), **({"target": y} if rank == p - 1 else {}))
    return [q.grad for q in stage.submodule.parameters()], stage.submodule.calls, stage.peak_activation_bytes


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble"])
def test_pipeline_checkpoint_modes_recompute_m_m_minus_1_or_0_microbatches_with_equal_gradients(schedule):
    from minidist import sim

    p, m = 3, 4
    x, y = data(False).data, np.arange(B) % W
    results = {mode: sim.run(run_pipeline_with, p, schedule, mode, m, x, y)
               for mode in ("never", "except_last", "always")}
    for mode, recomputed in (("never", 0), ("except_last", m - 1), ("always", m)):
        for rank in range(p):
            grads_, calls, _ = results[mode][rank]
            assert calls == m + recomputed, (mode, rank)
            assert all(np.array_equal(g, r) for g, r in zip(grads_, results["never"][rank][0]))
    # GPipe holds every micro-batch: checkpointed ones only as their stage input. The first
    # stage's inputs are views of the mini-batch (counted once, whole); the middle stage's are
    # the activations it received.
    if schedule == "gpipe":
        assert results["always"][0][2] == x.nbytes
        one_input, full = x[: B // m].nbytes, results["never"][1][2] // m
        assert results["always"][1][2] == m * one_input
        assert results["except_last"][1][2] == (m - 1) * one_input + full
        assert full == 5 * one_input  # its input, then a pre-activation and an output per block


def test_pipeline_checkpoint_mode_is_checked():
    from minidist import sim
    from minidist.functions import cross_entropy
    from minidist.parallel.pipeline import executor as E

    def make(comm):
        E.ScheduleGPipe(E.PipelineStage(blocks(1), 0, 1, comm), 2, cross_entropy, checkpoint="sometimes")

    with pytest.raises(E.PipelineError, match="checkpoint must be one of"):
        sim.run(make, 1)


def test_a_split_backward_through_a_checkpoint_with_a_weight_argument_is_refused():
    """backward_input (zero-bubble's I pass) defers weight gradients; a recomputation cannot be
    split that way when a weight is one of checkpoint's own arguments."""
    weight = nn.Parameter(np.ones((W, 2)))
    x = data(True)
    out = checkpoint(lambda a, w: (a @ w).tanh(), x, weight)
    with pytest.raises(RuntimeError, match="cannot be split"):
        out.backward_input(np.ones(out.shape), [x])
    inside = nn.Linear(W, 2, dtype="float64")  # a weight inside a module is fine: computed in I
    out = checkpoint(inside, x)
    out.backward_input(np.ones(out.shape), [x]).run()
    assert inside.weight.grad is not None and x.grad is not None
