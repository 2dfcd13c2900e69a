"""The checks of exercise 13: LayerNorm as one op (forward and backward), a causal mask, and a
training step that fits a memory budget.

1. :func:`check_layer_norm` takes your ``layer_norm(x, weight, bias, eps=1e-5)``, which calls
   your ``Function`` (layer normalisation over the last axis; Ba, Kiros & Hinton, "Layer
   Normalization", 2016; torch's ``nn.functional.layer_norm``: the *biased* variance, eps
   inside the square root). It checks, in this order, with a hint for each failure:

   - values against a NumPy reference on float64 inputs of shapes (2, 3, 8) and (5, 6), with
     eps 1e-5 and 0.1, and a constant row (the output is then the bias, finite);
   - one recorded op: ``memory.track`` must see a single op holding arrays (a LayerNorm
     composed of ``mean``, ``-``, ``**`` ... records several);
   - the gradients of x, weight and bias against the closed form (llm.c's ``doc/layernorm``),
     contracted with a random cotangent, then against central differences
     (:func:`minidist.course.checks.check_gradient`), the oracle that shares no code with it;
   - training: a 2-layer GPT in float64 on Shakespeare whose four LayerNorms run your
     function, :data:`STEPS` AdamW steps: every step's loss equal to the engine's run to
     1e-9 (relative), and the mean loss of the last 10 steps at most :data:`MAX_FINAL_LOSS`.

   A wrong answer that matches a known mistake gets that mistake's hint (mean over the wrong
   axis, the unbiased variance, eps added to the standard deviation, the weight forgotten in
   the backward, the 1/N terms of the backward left out, the sums of dweight and dbias over
   the wrong axes).

2. :func:`check_causal_attention` takes your ``causal_attention(q, k, v)`` on Tensors (B, H, T, d)
   built from the engine's Tensor ops (``@``, ``transpose``, ``+``, ``nn.functional.softmax``):
   the values against softmax(q kᵀ / sqrt(d) + mask) v (Vaswani et al., "Attention Is All You
   Need", 2017, eq. 1, with the decoder's mask), for T = 5 and T = 1; that no output depends on
   a later position (the last key and value changed, the earlier outputs unchanged); the
   gradients of q, k and v against central differences. Known mistakes (the mask applied after
   the softmax, the wrong triangle, the diagonal masked, the scale left out) get their hint.
   The engine's fused ``scaled_dot_product_attention`` may not be called.

3. :func:`check_activation_budget` takes your ``training_step(model, idx, targets)``: one
   training step's forward and backward of :data:`PUZZLE_BATCH` sequences of
   :data:`PUZZLE_BLOCK` tokens on the GPT of :func:`puzzle_model`, returning the mean loss.
   ``memory.track`` must see at most :data:`BUDGET` bytes of activations held at the peak,
   and the gradients left in the parameters must be the plain step's (``model(idx,
   targets)``, then ``loss.backward()``), to float32 rounding. ``memory.track`` counts the ops
   of the thread that runs it, so the step must run there and be seen: the batch is drawn
   afresh at every check (gradients computed by an earlier call cannot be replayed), an op
   recorded in another thread during the step fails, and the ops seen must hold, summed over
   the step, at least :data:`SEEN_FRACTION` of what the plain step's hold (an honest step
   holds as much or more: micro-batches hold the same arrays in pieces, recomputation holds
   the blocks' twice).

Each failure raises ``AssertionError("what: problem\\nHint: ...")``; when your code raises (a
stub, an error inside your backward), :class:`minidist.course.checks.LearnerError` with your
line. The engine's ``layer_norm`` or its fused attention as the answer, or called by it, fails.
On success each returns a one-line verdict::

    from minidist.course.checks import transformer as transformer_checks
    print(transformer_checks.check_layer_norm(layer_norm))

Longer than 400 lines: exercise 13's checks, each with the hints for the usual wrong turns, as the
runner calls them in order.
"""
from __future__ import annotations

import contextlib
import math
import secrets
import threading

import numpy as np
from threadpoolctl import threadpool_limits

from minidist import attention, data, memory, nn, optim, tensor
from minidist import functions as F
from minidist.course.checks import call_learner, check_gradient, check_own_code, fail, forbidding
from minidist.models.gpt import GPT, GPTConfig
from minidist.tensor import Tensor

MiB = 2**20

# ----------------------------------------------------------------------------- LayerNorm

LN_SHAPES = ((2, 3, 8), (5, 6))
LN_EPS = (1e-5, 0.1)
STEPS, LR, BATCH, BLOCK = 150, 1e-2, 8, 32
TINY = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": BLOCK}
TEXT_CHARS = 200_000  # the first characters of data.shakespeare() the tiny GPT trains on
MAX_FINAL_LOSS = 3.0  # the reference's mean over its last 10 steps is 2.92 (it starts at 4.13)

LN_HINTS = {
    "axis": ("normalise each row over its last axis only: mean = x.mean(axis=-1, keepdims=True) and the variance "
             "likewise, so that every vector of C channels gets its own mean and standard deviation"),
    "unbiased": ("use the biased variance, ((x - mean)**2).mean(axis=-1): divided by C, not by C - 1 "
                 "(np.var's default, torch's LayerNorm, not np.std(ddof=1))"),
    "eps": "eps goes inside the square root: rstd = 1 / np.sqrt(var + eps), not 1 / (np.sqrt(var) + eps)",
    "affine": "the output is (x - mean) * rstd * weight + bias: scale by the weight, then add the bias",
    "values": ("compute mean and var over the last axis (keepdims=True), rstd = 1 / np.sqrt(var + eps), and return "
               "(x - mean) * rstd * weight + bias"),
    "weight": ("the gradient that reaches the normalised value n is dn = dy * weight: the weight scaled n on the "
               "way out, so it scales the gradient on the way back"),
    "one_over_n": ("n depends on every x of its row through the mean and the variance, so dx is not just "
                   "rstd * dn: dx = rstd * (dn - mean(dn) - n * mean(dn * n)), the two means over the last axis "
                   "(they are the 1/N terms of the derivative)"),
    "sums": ("the weight and the bias are shared by every row: dweight = (dy * n) summed over every axis but the "
             "last, dbias = dy summed over every axis but the last (shape (C,))"),
    "dweight": "dweight = sum of dy * n, with n = (x - mean) * rstd the normalised input (not x itself)",
    "gradients": ("dn = dy * weight; dx = rstd * (dn - mean(dn) - n * mean(dn * n)) with the means over the last "
                  "axis; dweight = sum(dy * n) and dbias = sum(dy) over every axis but the last"),
    "one_op": ("write LayerNorm as one Function: its forward computes on raw arrays and saves what the backward "
               "needs (ctx.save_for_backward(x, weight, mean, rstd)); composing Tensor ops records one node per op, "
               "each holding its own input"),
}


def reference_layer_norm(x, weight, bias, eps=1e-5):
    """LayerNorm over the last axis, NumPy float64: ``(y, mean, rstd)`` with y = (x - mean) · rstd
    · weight + bias, mean and rstd = 1/sqrt(var + eps) of shape (..., 1), var the biased variance
    (torch's ``nn.functional.layer_norm``; Ba et al. 2016)."""
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(var + eps)
    return (x - mean) * rstd * weight + bias, mean, rstd


def reference_layer_norm_backward(x, weight, eps, dy):
    """The gradients ``(dx, dweight, dbias)`` of :func:`reference_layer_norm` for the output
    gradient ``dy``, in closed form (Karpathy, llm.c ``doc/layernorm``): with n = (x - mean) ·
    rstd and dn = dy · weight, dx = rstd · (dn - mean(dn) - n · mean(dn · n)) (means over the
    last axis), dweight = Σ dy · n and dbias = Σ dy over the leading axes."""
    _, mean, rstd = reference_layer_norm(x, weight, 0.0, eps)
    n = (x - mean) * rstd
    dn = dy * weight
    dx = rstd * (dn - dn.mean(axis=-1, keepdims=True) - n * (dn * n).mean(axis=-1, keepdims=True))
    leading = tuple(range(x.ndim - 1))
    return dx, (dy * n).sum(axis=leading), dy.sum(axis=leading)


def _forward_mistakes(x, weight, bias, eps):
    """The outputs of the usual wrong forwards: {hint key: array}."""
    everywhere = (x - x.mean()) / np.sqrt(x.var() + eps) * weight + bias
    first_axis = (x - x.mean(axis=0)) / np.sqrt(x.var(axis=0) + eps) * weight + bias
    mean, std = x.mean(axis=-1, keepdims=True), x.std(axis=-1, keepdims=True)
    unbiased = (x - mean) / np.sqrt(x.var(axis=-1, ddof=1, keepdims=True) + eps) * weight + bias
    std_plus_eps = (x - mean) / (std + eps) * weight + bias
    normalised = (x - mean) / np.sqrt(std**2 + eps)
    return {"axis": [everywhere, first_axis], "unbiased": [unbiased], "eps": [std_plus_eps],
            "affine": [normalised, normalised * weight, normalised + bias, normalised * bias + weight]}


def _backward_mistakes(x, weight, eps, dy):
    """The gradients of the usual wrong backwards: {hint key: [(dx, dweight, dbias), ...]}."""
    dx, dw, db = reference_layer_norm_backward(x, weight, eps, dy)
    _, mean, rstd = reference_layer_norm(x, weight, 0.0, eps)
    n = (x - mean) * rstd
    dn = dy * weight
    no_weight = reference_layer_norm_backward(x, np.ones_like(weight), eps, dy)[0]
    only_first = rstd * (dn - dn.mean(axis=-1, keepdims=True))
    only_second = rstd * (dn - n * (dn * n).mean(axis=-1, keepdims=True))
    return {"weight": [(no_weight, dw, db)],
            "one_over_n": [(rstd * dn, dw, db), (only_first, dw, db), (only_second, dw, db)],
            "dweight": [(dx, (dy * x).sum(axis=tuple(range(x.ndim - 1))), db)]}


def _inputs(shape, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 2.0 + 0.5
    weight, bias = 1.0 + 0.5 * rng.standard_normal(shape[-1]), rng.standard_normal(shape[-1])
    return x, weight, bias


def _run_layer_norm(layer_norm, what, x, weight, bias, eps, dy=None):
    """Your layer_norm on float64 copies: ``(y, tracker, leaves)``; with ``dy``, after
    ``y.backward(dy)`` (the leaves' ``.grad`` hold the gradients). weight and bias are
    Parameters, so ``memory.track`` counts only what the op holds besides them."""
    leaves = (Tensor(x.copy(), requires_grad=True), nn.Parameter(weight.copy()), nn.Parameter(bias.copy()))
    with memory.track() as tracker:
        out = call_learner(what, layer_norm, *leaves, eps=eps, name="your layer_norm")
    if out is None:
        fail(what, "layer_norm returned None", "return the Tensor that LayerNorm.apply(x, weight, bias, eps=eps) gives")
    if not isinstance(out, Tensor):
        fail(what, f"expected a Tensor, got {type(out).__name__}",
             "return the Tensor that LayerNorm.apply(x, weight, bias, eps=eps) gives (a Function's forward returns "
             "a raw array; apply wraps it)")
    if out.shape != x.shape:
        fail(what, f"expected shape {x.shape}, got {out.shape}", "LayerNorm keeps the shape of its input")
    if dy is not None:
        call_learner(what + ", backward", out.backward, dy, name="your LayerNorm.backward")
    return np.asarray(out.data, dtype=np.float64), tracker, leaves


def _matches(got, candidates, rtol=1e-7, atol=1e-9) -> bool:
    return any(np.shape(got) == np.shape(c) and np.allclose(got, c, rtol=rtol, atol=atol) for c in candidates)


def _check_ln_values(layer_norm) -> None:
    for shape in LN_SHAPES:
        for eps in LN_EPS:
            x, weight, bias = _inputs(shape, seed=len(shape))
            if eps > 1e-3:  # rows of small variance, where eps matters
                x = x * 0.2
            what = f"layer_norm(x, weight, bias, eps={eps:g}) for x of shape {shape} (float64)"
            got, tracker, _ = _run_layer_norm(layer_norm, what, x, weight, bias, eps)
            expected, _, _ = reference_layer_norm(x, weight, bias, eps)
            if np.allclose(got, expected, rtol=1e-7, atol=1e-9):
                if tracker.saves != 1:
                    fail(what, f"memory.track saw {tracker.saves} recorded ops holding arrays, expected 1",
                         LN_HINTS["one_op"])
                continue
            hint = next((LN_HINTS[key] for key, wrong in _forward_mistakes(x, weight, bias, eps).items()
                         if _matches(got, wrong)), LN_HINTS["values"])
            worst = float(np.nanmax(np.abs(got - expected)))
            fail(what, f"the output differs from (x - mean) / sqrt(var + eps) * weight + bias by up to {worst:.3g}",
                 hint)
    x = np.tile(np.array([[3.0, 3.0, 3.0, 3.0]]), (2, 1))
    weight, bias = np.array([1.0, 2.0, 3.0, 4.0]), np.array([0.5, -1.0, 0.0, 2.0])
    what = "layer_norm on rows that are constant (3, 3, 3, 3)"
    with np.errstate(all="ignore"):
        got, _, _ = _run_layer_norm(layer_norm, what, x, weight, bias, 1e-5)
    if not np.allclose(got, np.broadcast_to(bias, x.shape), atol=1e-9):
        fail(what, f"expected the bias in every row, {bias.tolist()}, got {got[0].tolist()}",
             "a constant row has variance 0: with eps inside the square root, rstd = 1/sqrt(eps) stays finite, "
             "x - mean is 0, and the output is the bias")


def _check_ln_gradients(layer_norm) -> None:
    names = ("x", "weight", "bias")
    for shape in LN_SHAPES:
        eps = 1e-5
        x, weight, bias = _inputs(shape, seed=10 + len(shape))
        dy = np.random.default_rng(3).standard_normal(shape)
        what = f"the backward of your LayerNorm for x of shape {shape} (float64, a random output gradient)"
        _, _, leaves = _run_layer_norm(layer_norm, what, x, weight, bias, eps, dy)
        expected = reference_layer_norm_backward(x, weight, eps, dy)
        got = []
        for name, leaf, want in zip(names, leaves, expected):
            if leaf.grad is None:
                fail(what, f"no gradient reached {name} (.grad is None)",
                     "backward returns one gradient per input of forward, in order: (dx, dweight, dbias)")
            if np.shape(leaf.grad) != want.shape:
                hint = LN_HINTS["sums"] if name != "x" else "dx has the shape of x"
                fail(what, f"the gradient of {name} has shape {np.shape(leaf.grad)}, expected {want.shape}", hint)
            got.append(np.asarray(leaf.grad, dtype=np.float64))
        if all(np.allclose(g, w, rtol=1e-7, atol=1e-9) for g, w in zip(got, expected)):
            continue
        wrong = next(name for name, g, w in zip(names, got, expected) if not np.allclose(g, w, rtol=1e-7, atol=1e-9))
        hint = next((LN_HINTS[key] for key, variants in _backward_mistakes(x, weight, eps, dy).items()
                     if any(all(np.allclose(g, v, rtol=1e-7, atol=1e-9) for g, v in zip(got, variant))
                            for variant in variants)), LN_HINTS["gradients"])
        index = names.index(wrong)
        fail(what, f"the gradient of {wrong} differs from the closed form by up to "
                   f"{float(np.max(np.abs(got[index] - expected[index]))):.3g}", hint)
    x, weight, bias = _inputs((3, 4, 5), seed=7)
    check_gradient(lambda a, w, b: layer_norm(a, w, b, eps=1e-5), [x, weight, bias],
                   what="your LayerNorm against central differences (x of shape (3, 4, 5))", hint=LN_HINTS["gradients"])


def shakespeare_windows(batch_size=BATCH, block_size=BLOCK, seed=0):
    """``(vocab_size, TokenWindows)`` over the first :data:`TEXT_CHARS` characters of the plays,
    character-level (``data.CharTokenizer``)."""
    text = data.shakespeare()[:TEXT_CHARS]
    tokenizer = data.CharTokenizer(text)
    return tokenizer.vocab_size, data.TokenWindows(tokenizer.encode(text), block_size, batch_size, seed=seed)


def train_tiny_gpt(layer_norm=None, steps: int = STEPS) -> list[float]:
    """Train the check's 2-layer GPT (:data:`TINY`, float64, seed 0) for ``steps`` AdamW steps
    (lr :data:`LR`, weight decay 0.1) on Shakespeare windows of :data:`BATCH` x :data:`BLOCK`
    characters; return the loss of every step. With ``layer_norm`` (your function), every
    ``nn.LayerNorm`` of the model runs ``layer_norm(x, weight, bias, eps=...)`` instead of the
    engine's op. Errors raised by ``layer_norm`` propagate."""
    vocab, windows = shakespeare_windows()
    model = GPT(GPTConfig(vocab_size=vocab, **TINY), rng=0, dtype="float64")
    with threadpool_limits(limits=1):  # small products: one BLAS thread is several times faster
        return _train(model, windows, layer_norm, steps)


def _train(model, windows, layer_norm, steps) -> list[float]:
    if layer_norm is not None:
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                object.__setattr__(module, "forward",
                                   lambda x, m=module: layer_norm(x, m.weight, m.bias, eps=m.eps))
    optimizer = optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses = []
    for _ in range(steps):
        x, y = windows.next_batch()
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.data))
    return losses


def _check_ln_training(layer_norm) -> list[float]:
    what = (f"training a {TINY['n_layer']}-layer GPT (float64) on Shakespeare for {STEPS} AdamW steps with your "
            "layer_norm in its four LayerNorms")
    reference = train_tiny_gpt()
    yours = call_learner(what, train_tiny_gpt, layer_norm, name="your layer_norm")
    for step, (got, want) in enumerate(zip(yours, reference)):
        if not math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12):
            fail(what, f"at step {step} the loss is {got:.10g}, the engine's LayerNorm gives {want:.10g}",
                 LN_HINTS["gradients"])
    final = float(np.mean(yours[-10:]))
    if not final <= MAX_FINAL_LOSS:
        fail(what, f"the mean loss of the last 10 steps is {final:.4f}, expected at most {MAX_FINAL_LOSS}",
             LN_HINTS["gradients"])
    return yours


@forbidding(F.layer_norm, nn.LayerNorm.forward, attention.LayerNorm.forward, attention.LayerNorm.backward)
def check_layer_norm(layer_norm) -> str:
    """Check ``layer_norm(x, weight, bias, eps=1e-5) -> Tensor`` (the exercise's) as the module
    docstring lists: values, one recorded op, gradients (closed form, then central differences),
    and a training run equal to the engine's.

    Returns a one-line verdict. Raises AssertionError naming the case and what differs, with a
    hint; :class:`~minidist.course.checks.LearnerError` when ``layer_norm`` raises.
    """
    check_own_code(layer_norm, "layer_norm")
    _check_ln_values(layer_norm)
    _check_ln_gradients(layer_norm)
    losses = _check_ln_training(layer_norm)
    return (f"layer_norm: ok (values for {len(LN_SHAPES)} shapes and eps {', '.join(f'{e:g}' for e in LN_EPS)}, one "
            f"recorded op, gradients equal to the closed form and to central differences; a {TINY['n_layer']}-layer "
            f"GPT trains from loss {losses[0]:.3f} to {np.mean(losses[-10:]):.3f} in {STEPS} steps, as with the "
            "engine's LayerNorm)")


# ----------------------------------------------------------------------------- causal attention

ATTENTION_HINTS = {
    "after": ("apply the mask before the softmax: add -inf to the scores of later positions, so that the softmax "
              "gives them weight exactly 0 and each row's remaining weights still sum to 1; zeroing weights after "
              "the softmax leaves rows that sum to less than 1"),
    "triangle": ("position i may attend to positions j <= i: mask the scores above the diagonal (j > i), "
                 "e.g. np.triu(np.full((T, T), -np.inf), k=1), not those below it"),
    "diagonal": ("keep the diagonal: a position attends to itself (j = i), so the mask is -inf only where j > i "
                 "(np.triu(..., k=1)); masking j >= i leaves the first row with nothing to attend to"),
    "scale": "divide the scores by sqrt(d), d = q.shape[-1] (the head size), before the mask and the softmax",
    "no_mask": ("without a mask position i also attends to later positions: the future leaks into the prediction; "
                "add -inf above the diagonal before the softmax"),
    "values": ("scores = q @ kᵀ / sqrt(d) (k.transpose(0, 1, 3, 2)); add a (T, T) mask with -inf where j > i; "
               "weights = softmax(scores, dim=-1); return weights @ v"),
    "graph": ("build the output from Tensor ops (@, transpose, +, nn.functional.softmax) so that the engine records "
              "the graph: working on .data or NumPy arrays cuts the gradient"),
}


def _softmax(a):
    with np.errstate(invalid="ignore"):
        e = np.exp(a - np.max(a, axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)


def reference_causal_attention(q, k, v, scale=None, keep="lower", after=False):
    """softmax(q kᵀ · scale + mask) v in NumPy (Vaswani et al. 2017, eq. 1), q, k, v (..., T, d),
    scale 1/sqrt(d) by default, the mask -inf where j > i (``keep="lower"``; "upper" and
    "strict" give the usual wrong masks, ``after=True`` the mask applied after the softmax)."""
    t, d = q.shape[-2], q.shape[-1]
    scores = q @ np.swapaxes(k, -1, -2) * (1.0 / math.sqrt(d) if scale is None else scale)
    allowed = {"lower": np.tril(np.ones((t, t), bool)), "upper": np.triu(np.ones((t, t), bool)),
               "strict": np.tril(np.ones((t, t), bool), k=-1), "none": np.ones((t, t), bool)}[keep]
    if after:
        return (_softmax(scores) * allowed) @ v
    return _softmax(np.where(allowed, scores, -np.inf)) @ v


def _attention_inputs(shape, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape) for _ in range(3)]


def _run_attention(causal_attention, what, q, k, v):
    out = call_learner(what, causal_attention, Tensor(q), Tensor(k), Tensor(v), name="your causal_attention")
    if out is None:
        fail(what, "causal_attention returned None", "return the Tensor weights @ v")
    if not isinstance(out, Tensor):
        fail(what, f"expected a Tensor, got {type(out).__name__}", ATTENTION_HINTS["graph"])
    if out.shape != q.shape[:-1] + v.shape[-1:]:
        fail(what, f"expected shape {q.shape[:-1] + v.shape[-1:]}, got {out.shape}",
             "the output has one row per query position and v's width: (B, H, T, d)")
    return np.asarray(out.data, dtype=np.float64)


def _check_attention_values(causal_attention) -> None:
    for shape in ((2, 3, 5, 4), (1, 2, 1, 3)):
        q, k, v = _attention_inputs(shape, seed=shape[2])
        what = f"causal_attention(q, k, v) for q, k, v of shape {shape} (float64)"
        with np.errstate(all="ignore"):
            got = _run_attention(causal_attention, what, q, k, v)
        expected = reference_causal_attention(q, k, v)
        if np.allclose(got, expected, rtol=1e-7, atol=1e-9):
            continue
        d = shape[-1]
        mistakes = {"after": [reference_causal_attention(q, k, v, after=True)],
                    "triangle": [reference_causal_attention(q, k, v, keep="upper")],
                    "diagonal": [reference_causal_attention(q, k, v, keep="strict")],
                    "scale": [reference_causal_attention(q, k, v, scale=s) for s in (1.0, 1.0 / d, math.sqrt(d))],
                    "no_mask": [reference_causal_attention(q, k, v, keep="none")]}
        if np.isnan(got).any():
            hint = ATTENTION_HINTS["diagonal"]
        else:
            hint = next((ATTENTION_HINTS[key] for key, wrong in mistakes.items() if _matches(got, wrong)),
                        ATTENTION_HINTS["values"])
        fail(what, f"the output differs from softmax(q kᵀ / sqrt(d) + mask) v by up to "
                   f"{float(np.nanmax(np.abs(got - expected))):.3g}", hint)


def _check_causality(causal_attention) -> None:
    q, k, v = _attention_inputs((1, 2, 6, 4), seed=11)
    what = "causal_attention with the last position's key and value changed"
    before = _run_attention(causal_attention, what, q, k, v)
    k2, v2 = k.copy(), v.copy()
    k2[..., -1, :] += 3.0
    v2[..., -1, :] -= 5.0
    after = _run_attention(causal_attention, what, q, k2, v2)
    moved = [t for t in range(5) if not np.allclose(before[..., t, :], after[..., t, :], rtol=0, atol=1e-12)]
    if moved:
        fail(what, f"the outputs at positions {moved} changed: they depend on a later position",
             ATTENTION_HINTS["no_mask"])


@forbidding(F.scaled_dot_product_attention, attention.ScaledDotProductAttention.forward,
            attention.ScaledDotProductAttention.backward)
def check_causal_attention(causal_attention) -> str:
    """Check ``causal_attention(q, k, v) -> Tensor`` (the exercise's) as the module docstring
    lists: values for T = 5 and T = 1, no dependence on later positions, gradients of q, k and v
    against central differences. Returns a one-line verdict; raises AssertionError with a hint,
    :class:`~minidist.course.checks.LearnerError` when ``causal_attention`` raises."""
    check_own_code(causal_attention, "causal_attention")
    _check_attention_values(causal_attention)
    _check_causality(causal_attention)
    check_gradient(causal_attention, _attention_inputs((1, 2, 4, 3), seed=5),
                   what="your causal_attention against central differences (q, k, v of shape (1, 2, 4, 3))",
                   hint=ATTENTION_HINTS["graph"])
    return ("causal_attention: ok (values for T = 5 and T = 1, no output depends on a later position, gradients of "
            "q, k and v equal to central differences)")


# ----------------------------------------------------------------------------- the puzzle: a step in a budget

PUZZLE = {"vocab_size": 75, "block_size": 256, "n_layer": 2, "n_head": 4, "n_embd": 64}
PUZZLE_BATCH, PUZZLE_BLOCK = 16, 256  # 4096 tokens a step, sequences of the model's whole block size
BUDGET = 4 * MiB  # activations held at the peak of the step, as memory.track counts them
SEEN_FRACTION = 0.5  # of the bytes the plain step's ops hold, summed over the step (an honest step: 1.0 or more)
# The hint points the way (what the peak grows with, where to measure, the chapters to look in) from the
# learner's own numbers, without naming the design that fits: the puzzle is the exercise.
BUDGET_WHY = ("the peak is what a forward keeps alive for its backward: it grows with the tokens one forward "
              "carries at once and with what each block keeps of them")


def budget_hint(peak: float, plain_peak: float) -> str:
    """The hint of a step whose peak (bytes) is over :data:`BUDGET`: where the learner stands
    against the plain step's ``plain_peak`` and what to look at next, not how to fit."""
    over = f"{peak / BUDGET:.1f} times the budget"
    if peak > 0.7 * plain_peak:
        return (f"your step keeps about what the plain step keeps ({over}), with the same 4096 tokens to train on; "
                f"{BUDGET_WHY}. Which of the two can you make smaller without changing the gradients? Chapters 07 "
                "and 10 each have a tool for one; measure_step(training_step) shows what a try holds")
    return (f"your step keeps {plain_peak / peak:.1f} times less than the plain step, still {over}; {BUDGET_WHY}. "
            "Ask which of the two your step still pays in full, and how far the one you shrank can go: "
            "measure_step(training_step) shows what a try holds")


SEEN_HINT = ("run the forward and backward of the whole batch inside training_step, in the thread that calls it, "
             "through the model's own modules and the engine's ops: memory.track measures what this thread's ops "
             "hold (not another thread's or process's), and the check draws a new batch at every call, so gradients "
             "kept from an earlier call do not fit it")


def puzzle_model() -> GPT:
    """The puzzle's GPT: :data:`PUZZLE` (2 blocks of width 64, 4 heads, context 256), float32, seed 0."""
    return GPT(GPTConfig(**PUZZLE), rng=0)


def puzzle_batch(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(idx, targets)``: :data:`PUZZLE_BATCH` x :data:`PUZZLE_BLOCK` random token ids (int64)
    and the ids that follow them, from ``seed``."""
    ids = np.random.default_rng(seed).integers(0, PUZZLE["vocab_size"], (PUZZLE_BATCH, PUZZLE_BLOCK + 1))
    return ids[:, :-1], ids[:, 1:]


def plain_step(model, idx, targets) -> float:
    """The step the puzzle starts from: ``model(idx, targets)``, ``loss.backward()``; returns the loss."""
    _, loss = model(idx, targets)
    loss.backward()
    return float(loss.data)


class _HeldInAll:
    """A memory observer (``tensor.add_memory_observer``): the bytes every op recorded in this
    thread holds (``memory.contexts_bytes`` of each), summed over the block, and the ops."""

    def __init__(self):
        self.bytes = self.ops = 0

    def saved(self, ctx):
        self.bytes += memory.contexts_bytes([ctx])
        self.ops += 1

    def released(self, ctx):
        pass


@contextlib.contextmanager
def _ops_in_other_threads():
    """The names of the threads, other than this one, in which an op was recorded for backward
    during the block (a set, filled as they come): ``tensor.notify_saved``, which every recorded
    op calls, wrapped for the block only."""
    here, found, original = threading.get_ident(), set(), tensor.notify_saved

    def noting(ctx):
        if threading.get_ident() != here:
            found.add(threading.current_thread().name)
        original(ctx)

    tensor.notify_saved = noting
    try:
        yield found
    finally:
        tensor.notify_saved = original


def measure_step(training_step, batch=None) -> dict:
    """Run ``training_step(model, idx, targets)`` on a fresh :func:`puzzle_model` and ``batch``
    (``(idx, targets)``, copied; default :func:`puzzle_batch`) under ``memory.track``:
    ``{"peak_bytes", "loss", "grads", "held_bytes", "other_threads"}`` (the loss it returned as a
    float, or None; the parameters' gradients in ``named_parameters`` order; the bytes the ops
    recorded in this thread held, summed over the step; the threads other than this one that
    recorded ops meanwhile). Errors raised by ``training_step`` propagate."""
    model = puzzle_model()
    idx, targets = (np.array(a, copy=True) for a in (puzzle_batch() if batch is None else batch))
    held = _HeldInAll()
    with threadpool_limits(limits=1), _ops_in_other_threads() as elsewhere, memory.track() as tracker:
        tensor.add_memory_observer(held)
        try:
            loss = training_step(model, idx, targets)
        finally:
            tensor.remove_memory_observer(held)
    value = None
    if loss is not None:
        value = float(np.asarray(loss.data if isinstance(loss, Tensor) else loss))
    return {"peak_bytes": tracker.peak_bytes, "loss": value,
            "grads": [(name, p.grad) for name, p in model.named_parameters()],
            "held_bytes": held.bytes, "other_threads": sorted(elsewhere)}


def _check_gradients(what, yours, reference) -> None:
    for (name, got), (_, want) in zip(yours["grads"], reference["grads"]):
        if got is None:
            fail(what, f"{name} has no gradient (.grad is None)",
                 "your step must leave the gradient of the whole batch in every parameter: call backward on a loss")
        got = np.asarray(got, dtype=np.float64)
        scale = float(np.max(np.abs(want))) or 1.0
        if np.allclose(got, want, rtol=1e-4, atol=1e-5 * scale):
            continue
        ratio = float(np.sum(got * want) / np.sum(want * want))
        if abs(ratio - round(ratio)) < 0.01 and round(ratio) > 1:
            hint = (f"your gradients are {round(ratio)} times the plain step's: the plain step's loss is the mean "
                    "over all the batch's tokens, so weight each micro-batch's loss by its share of the batch (divide "
                    "by the number of micro-batches when they are equal) before its backward")
        elif 0 < ratio < 0.99:
            hint = ("part of the batch is missing from your gradients: gradients accumulate in .grad across "
                    "backward calls, so do not clear them between micro-batches, and run every sequence")
        else:
            hint = ("the gradients must be those of the plain step, model(idx, targets) then loss.backward(): the "
                    "same model, the same tokens, float32")
        fail(what, f"the gradient of {name} differs from the plain step's (by up to "
                   f"{float(np.max(np.abs(got - want))):.3g}, largest entry {scale:.3g})", hint)


def check_activation_budget(training_step) -> str:
    """Check ``training_step(model, idx, targets)`` (the exercise's puzzle): on the GPT of
    :func:`puzzle_model` and the batch of :func:`puzzle_batch` (16 x 256 tokens), the returned
    loss and every parameter's gradient equal the plain step's (relative 1e-4 in float32), and
    ``memory.track`` sees at most :data:`BUDGET` bytes held at the peak.

    Returns a one-line verdict. Raises AssertionError with a hint, naming the peak and the
    budget; :class:`~minidist.course.checks.LearnerError` when ``training_step`` raises.
    """
    what = (f"your training_step on {PUZZLE_BATCH} x {PUZZLE_BLOCK} tokens of a {PUZZLE['n_layer']}-block GPT "
            f"(width {PUZZLE['n_embd']}, {PUZZLE['n_head']} heads)")
    batch = puzzle_batch(secrets.randbits(64))  # new at every call: no earlier call's gradients fit it
    reference = measure_step(plain_step, batch)
    yours = call_learner(what, measure_step, training_step, batch, name="your training_step")
    if yours["other_threads"]:
        fail(what, f"ops of your step were recorded in another thread ({', '.join(yours['other_threads'][:3])}), "
                   "where memory.track, which counts the ops of the thread that runs it, does not see them",
             SEEN_HINT)
    if yours["loss"] is None:
        fail(what, "training_step returned None", "return the mean loss of the batch (a float or the loss Tensor)")
    if not math.isclose(yours["loss"], reference["loss"], rel_tol=1e-5):
        fail(what, f"it returned the loss {yours['loss']:.6f}, the plain step's is {reference['loss']:.6f}",
             "return the mean loss over the whole batch (the mean of equal micro-batches' losses)")
    _check_gradients(what, yours, reference)
    if yours["held_bytes"] < SEEN_FRACTION * reference["held_bytes"]:
        fail(what, f"memory.track saw your step's ops hold {yours['held_bytes'] / MiB:.1f} MiB in all (summed over "
                   f"the step), the plain step's hold {reference['held_bytes'] / MiB:.1f} MiB: most of the forward "
                   "and backward that made these gradients did not run where memory.track sees it", SEEN_HINT)
    if yours["peak_bytes"] > BUDGET:
        fail(what, f"memory.track saw {yours['peak_bytes'] / MiB:.2f} MiB of activations held at the peak, over the "
                   f"budget of {BUDGET / MiB:g} MiB (the plain step holds {reference['peak_bytes'] / MiB:.1f} MiB)",
             budget_hint(yours["peak_bytes"], reference["peak_bytes"]))
    return (f"training_step: ok ({PUZZLE_BATCH * PUZZLE_BLOCK} tokens, peak {yours['peak_bytes'] / MiB:.2f} MiB of "
            f"activations within {BUDGET / MiB:g} MiB, against {reference['peak_bytes'] / MiB:.1f} MiB for the plain "
            "step; loss and gradients equal to the plain step's)")

