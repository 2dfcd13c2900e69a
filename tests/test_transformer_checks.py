"""minidist.course.checks.transformer (exercise 13): the solution's LayerNorm, causal attention and
budgeted training step pass; versions wrong in each way the checks look for fail, each with its
own hint; the engine's own layer_norm and fused attention are refused; a stub says it is one."""
import math
import re

import numpy as np
import pytest

from minidist import functions as F
from minidist import memory
from minidist.course.checks import STUB_HINT, LearnerError
from minidist.course.checks import transformer as transformer_checks
from minidist.recompute import checkpoint
from minidist.tensor import Function, Tensor

OWN = "own implementation, not yours"


# ----------------------------------------------------------------------------- LayerNorm

def layer_norm_class(forward_stats=None, backward_dx=None, backward_sums=None, weight_in_backward=True):
    """The exercise's Function, with one part replaceable by a wrong version."""

    def stats(x, eps):
        mean = x.mean(axis=-1, keepdims=True)
        return mean, 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + eps)

    class LayerNorm(Function):
        @staticmethod
        def forward(ctx, x, weight, bias, eps=1e-5):
            mean, rstd = (forward_stats or stats)(x, eps)
            ctx.save_for_backward(x, weight, mean, rstd)
            return (x - mean) * rstd * weight + bias

        @staticmethod
        def backward(ctx, grad):
            x, weight, mean, rstd = ctx.saved
            n = (x - mean) * rstd
            dn = grad * weight if weight_in_backward else grad
            if backward_dx is None:
                dx = rstd * (dn - dn.mean(axis=-1, keepdims=True) - n * (dn * n).mean(axis=-1, keepdims=True))
            else:
                dx = backward_dx(dn, n, rstd)
            if backward_sums is None:
                leading = tuple(range(x.ndim - 1))
                return dx, (grad * n).sum(axis=leading), grad.sum(axis=leading)
            return (dx,) + backward_sums(grad, n, x)

    return LayerNorm


def through(cls):
    def layer_norm(x, weight, bias, eps=1e-5):
        return cls.apply(x, weight, bias, eps=eps)
    return layer_norm


def test_the_solution_passes_and_trains_as_the_engine_does():
    verdict = transformer_checks.check_layer_norm(through(layer_norm_class()))
    assert verdict.startswith("layer_norm: ok") and "trains from loss 4.132 to 2.920 in 150 steps" in verdict


def test_the_training_reference_reaches_the_stated_loss_with_a_margin():
    losses = transformer_checks.train_tiny_gpt()
    assert len(losses) == transformer_checks.STEPS
    assert losses[0] == pytest.approx(4.132, abs=1e-3)
    final = np.mean(losses[-10:])
    assert final == pytest.approx(2.920, abs=1e-3) and final < transformer_checks.MAX_FINAL_LOSS


def composed_layer_norm(x, weight, bias, eps=1e-5):
    """Right values and gradients, but five recorded ops instead of one Function."""
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    var = (centred * centred).mean(axis=-1, keepdims=True)
    return centred / (var + eps) ** 0.5 * weight + bias


def stats_everywhere(x, eps):
    return x.mean(), 1.0 / np.sqrt(x.var() + eps)


def stats_unbiased(x, eps):
    return x.mean(axis=-1, keepdims=True), 1.0 / np.sqrt(x.var(axis=-1, ddof=1, keepdims=True) + eps)


def stats_eps_outside(x, eps):
    return x.mean(axis=-1, keepdims=True), 1.0 / (x.std(axis=-1, keepdims=True) + eps)


class NoAffine(Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps=1e-5):
        mean = x.mean(axis=-1, keepdims=True)
        return (x - mean) / np.sqrt(x.var(axis=-1, keepdims=True) + eps)

    @staticmethod
    def backward(ctx, grad):
        raise AssertionError("not reached")


@pytest.mark.parametrize("layer_norm, message", [
    (through(layer_norm_class(forward_stats=stats_everywhere)), "normalise each row over its last axis only"),
    (through(layer_norm_class(forward_stats=stats_unbiased)), "use the biased variance"),
    (through(layer_norm_class(forward_stats=stats_eps_outside)), "eps goes inside the square root"),
    (through(NoAffine), "scale by the weight, then add the bias"),
    (composed_layer_norm, "memory.track saw 9 recorded ops holding arrays, expected 1"),
    (through(layer_norm_class(weight_in_backward=False)), "dn = dy * weight"),
    (through(layer_norm_class(backward_dx=lambda dn, n, rstd: rstd * dn)), "they are the 1/N terms"),
    (through(layer_norm_class(backward_dx=lambda dn, n, rstd: rstd * (dn - dn.mean(axis=-1, keepdims=True)))),
     "they are the 1/N terms"),
    (through(layer_norm_class(backward_sums=lambda g, n, x: ((g * n).sum(axis=0), g.sum(axis=0)))),
     "the weight and the bias are shared by every row"),
    (through(layer_norm_class(backward_sums=lambda g, n, x: ((g * x).sum(axis=tuple(range(x.ndim - 1))),
                                                             g.sum(axis=tuple(range(x.ndim - 1)))))),
     "not x itself"),
])
def test_each_wrong_layer_norm_fails_with_its_own_hint(layer_norm, message):
    with pytest.raises(AssertionError, match="Hint: ") as failure:
        transformer_checks.check_layer_norm(layer_norm)
    assert message in str(failure.value), str(failure.value)


def test_the_engines_layer_norm_is_not_an_answer():
    with pytest.raises(AssertionError, match=OWN):
        transformer_checks.check_layer_norm(F.layer_norm)

    class CallsTheEngine(Function):
        @staticmethod
        def forward(ctx, x, weight, bias, eps=1e-5):
            return F.layer_norm(Tensor(x), x.shape[-1], Tensor(weight), Tensor(bias), eps).data

        @staticmethod
        def backward(ctx, grad):
            raise AssertionError("not reached")

    with pytest.raises(LearnerError, match="minidist.functions.layer_norm, the engine's own implementation"):
        transformer_checks.check_layer_norm(through(CallsTheEngine))


def test_a_layer_norm_stub_says_it_is_one():
    def layer_norm(x, weight, bias, eps=1e-5):
        raise NotImplementedError()

    with pytest.raises(LearnerError, match=re.escape(STUB_HINT)):
        transformer_checks.check_layer_norm(layer_norm)


def test_the_backward_reference_is_the_finite_difference_gradient():
    rng = np.random.default_rng(0)
    x, weight, dy = rng.standard_normal((3, 5)), rng.standard_normal(5), rng.standard_normal((3, 5))
    dx, dw, db = transformer_checks.reference_layer_norm_backward(x, weight, 1e-5, dy)
    h = 1e-6
    for index in np.ndindex(x.shape):
        plus, minus = x.copy(), x.copy()
        plus[index] += h
        minus[index] -= h
        f = [(transformer_checks.reference_layer_norm(a, weight, 0.0, 1e-5)[0] * dy).sum() for a in (plus, minus)]
        assert dx[index] == pytest.approx((f[0] - f[1]) / (2 * h), rel=1e-6, abs=1e-8)
    n = transformer_checks.reference_layer_norm(x, np.ones(5), 0.0, 1e-5)[0]
    np.testing.assert_allclose(dw, (dy * n).sum(axis=0))
    np.testing.assert_allclose(db, dy.sum(axis=0))


# ----------------------------------------------------------------------------- causal attention

def attention(mask="lower", after=False, scale=True, graph=True):
    """A causal_attention from Tensor ops, with one part replaceable by a wrong version."""

    def causal_attention(q, k, v):
        t, d = q.shape[-2], q.shape[-1]
        scores = q @ k.transpose(0, 1, 3, 2)
        if scale:
            scores = scores * (1.0 / math.sqrt(d))
        masks = {"lower": np.triu(np.full((t, t), -np.inf), k=1), "upper": np.tril(np.full((t, t), -np.inf), k=-1),
                 "strict": np.triu(np.full((t, t), -np.inf), k=0), "none": np.zeros((t, t))}
        if after:
            weights = F.softmax(scores, dim=-1) * np.tril(np.ones((t, t)))
        else:
            weights = F.softmax(scores + masks[mask], dim=-1)
        out = weights @ v
        return out if graph else Tensor(out.data)

    return causal_attention


def test_the_solution_passes_attention():
    assert transformer_checks.check_causal_attention(attention()).startswith("causal_attention: ok")


@pytest.mark.parametrize("causal_attention, message", [
    (attention(after=True), "apply the mask before the softmax"),
    (attention(mask="upper"), "mask the scores above the diagonal"),
    (attention(mask="strict"), "keep the diagonal"),
    (attention(scale=False), "divide the scores by sqrt(d)"),
    (attention(mask="none"), "the future leaks"),
    (attention(graph=False), "working on .data or NumPy arrays cuts the gradient"),
])
def test_each_wrong_attention_fails_with_its_own_hint(causal_attention, message):
    with pytest.raises(AssertionError, match="Hint: ") as failure:
        transformer_checks.check_causal_attention(causal_attention)
    assert message in str(failure.value), str(failure.value)


def test_the_fused_attention_is_not_an_answer():
    def causal_attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    with pytest.raises(LearnerError, match="scaled_dot_product_attention, the engine's own implementation"):
        transformer_checks.check_causal_attention(causal_attention)
    with pytest.raises(AssertionError, match=OWN):
        transformer_checks.check_causal_attention(F.scaled_dot_product_attention)


def test_the_attention_reference_equals_the_engines_fused_op():
    q, k, v = (np.random.default_rng(s).standard_normal((2, 3, 7, 4)) for s in range(3))
    expected = F.scaled_dot_product_attention(Tensor(q), Tensor(k), Tensor(v), is_causal=True).data
    np.testing.assert_allclose(transformer_checks.reference_causal_attention(q, k, v), expected, rtol=1e-12)


# ----------------------------------------------------------------------------- the budget puzzle

def blocks_recomputed(model, idx, targets):
    tr = model.transformer
    h = tr.wte(idx) + tr.wpe(np.arange(idx.shape[1]))
    for block in tr.h:
        h = checkpoint(block, h)
    logits = model.lm_head(tr.ln_f(h))
    b, t, v = logits.shape
    return F.cross_entropy(logits.reshape(b * t, v), targets.reshape(-1))


def micro_batches(size, recompute, scale=True, clear=False):
    def training_step(model, idx, targets):
        count, total = idx.shape[0] // size, 0.0
        for start in range(0, idx.shape[0], size):
            x, y = idx[start:start + size], targets[start:start + size]
            loss = blocks_recomputed(model, x, y) if recompute else model(x, y)[1]
            if clear:
                model.zero_grad()
            (loss * (1.0 / count) if scale else loss).backward()
            total += float(loss.data) / count
        return total
    return training_step


def test_one_sequence_at_a_time_with_blocks_recomputed_fits_the_budget():
    verdict = transformer_checks.check_activation_budget(micro_batches(1, recompute=True))
    assert verdict.startswith("training_step: ok (4096 tokens, peak 2.82 MiB"), verdict


@pytest.mark.parametrize("training_step, message", [
    (transformer_checks.plain_step, "MiB of activations held at the peak, over the budget of 4 MiB"),
    (micro_batches(1, recompute=False), "over the budget of 4 MiB"),
    (micro_batches(16, recompute=True), "over the budget of 4 MiB"),
    (micro_batches(2, recompute=True), "over the budget of 4 MiB"),
    (micro_batches(4, recompute=True, scale=False), "your gradients are 4 times the plain step's"),
    (micro_batches(4, recompute=False, clear=True), "do not clear them between micro-batches"),
    (lambda model, idx, targets: None, "training_step returned None"),
])
def test_each_step_that_misses_fails_with_its_hint(training_step, message):
    with pytest.raises(AssertionError, match="Hint: ") as failure:
        transformer_checks.check_activation_budget(training_step)
    assert message in str(failure.value), str(failure.value)


@pytest.mark.parametrize("training_step, where", [
    (transformer_checks.plain_step, "about what the plain step keeps (22.4 times the budget)"),
    (micro_batches(1, recompute=False), "15.8 times less than the plain step, still 1.4 times the budget"),
    (micro_batches(16, recompute=True), "2.0 times less than the plain step, still 11.0 times the budget"),
    (micro_batches(2, recompute=True), "16.1 times less than the plain step, still 1.4 times the budget"),
], ids=["plain", "micro-batches", "recompute", "both-too-big"])
def test_the_budget_hint_points_the_way_without_the_design(training_step, where):
    """Issue 36: the hint named the one design that fits (micro-batches and recomputation, "or
    both"), the puzzle's answer. It says where the learner's step stands (their peak against the
    plain step's and the budget) and what the peak grows with, and names no design."""
    with pytest.raises(AssertionError, match="Hint: ") as failure:
        transformer_checks.check_activation_budget(training_step)
    hint = str(failure.value).split("Hint: ", 1)[1].lower()
    assert where in hint and "the tokens one forward carries at once" in hint, hint
    for answer in ("micro", "recompute", "checkpoint", "accumulat", "both", "one sequence", "split the batch"):
        assert answer not in hint, f"the hint names {answer!r}: {hint}"


def test_the_budget_needs_both_tricks_as_measured():
    """Micro-batches of one sequence alone, or blocks recomputed alone, stay above the budget;
    together they fit: the puzzle has no one-idea answer."""
    peaks = {name: transformer_checks.measure_step(step)["peak_bytes"] for name, step in [
        ("plain", transformer_checks.plain_step), ("micro", micro_batches(1, recompute=False)),
        ("recompute", micro_batches(16, recompute=True)), ("both", micro_batches(1, recompute=True))]}
    assert peaks["both"] <= transformer_checks.BUDGET < min(peaks["micro"], peaks["recompute"]) < peaks["plain"]


def test_the_puzzle_measures_activations_only():
    model, (idx, targets) = transformer_checks.puzzle_model(), transformer_checks.puzzle_batch()
    with memory.track() as tracker:
        model(idx[:1], targets[:1])[1].backward()
    assert tracker.live_bytes == 0 and memory.parameter_bytes(model) > 0


def out_of_sight(model, idx, targets):
    """The plain step with this thread's memory observers taken away while it runs."""
    from minidist import tensor

    saved, tensor._state.memory_observers = tensor._state.memory_observers, ()
    try:
        return transformer_checks.plain_step(model, idx, targets)
    finally:
        tensor._state.memory_observers = saved


def in_another_thread(model, idx, targets):
    import threading

    found = {}
    worker = threading.Thread(target=lambda: found.update(loss=transformer_checks.plain_step(model, idx, targets)))
    worker.start()
    worker.join()
    return found["loss"]


REPLAYED = {}


def replayed(model, idx, targets):
    """Gradients kept from a first call (on the puzzle's seed-0 batch) and put back at every call."""
    if not REPLAYED:
        REPLAYED["loss"] = transformer_checks.plain_step(model, idx, targets)
        REPLAYED["grads"] = [p.grad.copy() for p in model.parameters()]
        return REPLAYED["loss"]
    for p, g in zip(model.parameters(), REPLAYED["grads"]):
        p.grad = g.copy()
    return REPLAYED["loss"]


def test_a_step_memory_track_does_not_see_fails():
    """Issue 36: each passed before (memory.track saw nothing, so the peak was 0). The step in
    another thread; the step with this thread's observers removed; gradients replayed from a
    first, untracked call (the check's batch is now new at every call)."""
    with pytest.raises(AssertionError, match="ops of your step were recorded in another thread"):
        transformer_checks.check_activation_budget(in_another_thread)
    with pytest.raises(AssertionError) as caught:
        transformer_checks.check_activation_budget(out_of_sight)
    assert "memory.track saw your step's ops hold 0.0 MiB in all (summed over the step), the plain step's hold " \
           "120.8 MiB" in str(caught.value) and transformer_checks.SEEN_HINT in str(caught.value), str(caught.value)
    replayed(transformer_checks.puzzle_model(), *transformer_checks.puzzle_batch())  # the first call
    with pytest.raises(AssertionError, match="the plain step's is"):
        transformer_checks.check_activation_budget(replayed)


def test_an_honest_step_holds_as_much_as_the_plain_step_in_all():
    """The bytes the ops hold, summed over the step: micro-batches hold the plain step's arrays in
    pieces, recomputation the blocks' twice; so SEEN_FRACTION leaves room for a cleverer step."""
    plain = transformer_checks.measure_step(transformer_checks.plain_step)["held_bytes"]
    for step in (micro_batches(1, recompute=True), micro_batches(4, recompute=False)):
        assert transformer_checks.measure_step(step)["held_bytes"] >= 0.99 * plain
