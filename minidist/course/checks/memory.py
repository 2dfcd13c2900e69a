"""The checks of exercise 10: a ``checkpoint`` you wrote, checked against a network run without
checkpointing, by counting forward calls and by the bytes ``minidist.memory.track`` sees held.

Your ``checkpoint(function, x)`` runs ``function`` (a segment of layers) on the Tensor ``x``
keeping only ``x``, and runs ``function`` again when backward reaches it (activation
recomputation; Chen, Xu, Zhang & Guestrin, "Training Deep Nets with Sublinear Memory Cost",
2016). :func:`check_checkpoint` builds an MLP of :data:`BLOCKS` blocks (Linear then Tanh,
float64, each block counting its forward calls), and checks, in this order, with a hint for
each:

1. one block through your checkpoint: a Tensor of the block's output values (bitwise), which
   requires grad, and gradients switched on again afterwards (under an outer ``no_grad``:
   still off), so the layers after it record their graph;
2. the whole network in k = 1, 2, 4, 8 segments, the first k - 1 through your checkpoint (as
   ``torch.utils.checkpoint.checkpoint_sequential``): the parameters' and the input's
   gradients are **bitwise** equal to those of the same network without checkpointing (the
   recomputation runs the same ops on the same numbers);
3. forward calls: n during the forward (each block once), n + (k - 1)floor(n/k) after the
   backward (each checkpointed block once more, the last segment not);
4. memory, counted by :func:`minidist.memory.track`: after the forward of a 4-block segment
   through your checkpoint, only its input is held (one activation), and no more was held
   while it ran; over a whole step in k segments, the peak is Chen et al.'s count,
   (k - 1) + 2 max(n - (k - 1)s, s) + 1 activations (s = floor(n/k); a block holds its
   pre-activation and its output), against 2n + 1 without checkpointing.

The input ``x`` requires grad throughout (a segment after the first receives such an input):
a ``Function`` records its node only when one of its inputs requires grad, the limitation of
torch's reentrant checkpoint too.

Each failure raises ``AssertionError("what: problem\\nHint: ...")``; when your code raises (a
stub, an error inside your backward), :class:`minidist.course.checks.LearnerError` with your
line. The engine's :func:`minidist.recompute.checkpoint` as the answer, or called by it, fails.
On success it returns a one-line verdict::

    from minidist.course.checks import memory as memory_checks
    print(memory_checks.check_checkpoint(checkpoint))
"""
from __future__ import annotations

import numpy as np

from minidist import memory, nn, recompute
from minidist.course.checks import call_learner, check_own_code, fail, forbidding
from minidist.tensor import Tensor, is_grad_enabled, no_grad

BLOCKS, WIDTH, BATCH = 8, 16, 32  # n blocks of Linear(WIDTH, WIDTH) + Tanh, float64
SEGMENTS = (1, 2, 4, 8)
ACTIVATION = BATCH * WIDTH * 8  # bytes of one (BATCH, WIDTH) float64 array

NO_GRAD_HINT = ("run function inside 'with no_grad():' in your forward, so its ops record nothing and save "
                "nothing; keep only the input (ctx.save_for_backward(x))")
RECOMPUTE_HINT = ("in backward, call function again on a fresh Tensor(x, requires_grad=True) of the saved input, "
                  "call .backward(grad) on its output with the gradient that reached your node, and return "
                  "(that Tensor's .grad,)")
GRAD_MODE_HINT = ("switch gradients off with 'with no_grad():' around the call of function only: the block "
                  "restores the mode it found when it ends (setting a flag by hand and forgetting to set it "
                  "back leaves every later layer without a graph)")


class _Counted(nn.Module):
    """A block that counts its forward calls."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, x):
        self.calls += 1
        return self.inner(x)


def _network(n=BLOCKS):
    return nn.Sequential(*[_Counted(nn.Sequential(nn.Linear(WIDTH, WIDTH, rng=i, dtype="float64"), nn.Tanh()))
                           for i in range(n)])


def _input():
    return Tensor(np.random.default_rng(1).standard_normal((BATCH, WIDTH)), requires_grad=True)


def _segments(checkpoint, blocks, k, x):
    """The network in k segments, the first k - 1 through ``checkpoint`` (checkpoint_sequential's rule)."""
    layers = list(blocks)
    size = len(layers) // k

    def run(start, end):
        def segment(t):
            for layer in layers[start:end]:
                t = layer(t)
            return t
        return segment

    for start in range(0, size * (k - 1), size):
        x = checkpoint(run(start, start + size), x)
    return run(size * (k - 1), len(layers))(x)


def _as_output(what: str, out, shape) -> Tensor:
    if out is None:
        fail(what, "returned None", "return the Tensor that Checkpoint.apply(x, function=function) gives")
    if not isinstance(out, Tensor):
        fail(what, f"expected a Tensor, got {type(out).__name__}",
             "checkpoint must return a Tensor, as function does: Checkpoint.apply(x, function=function)")
    if out.shape != shape:
        fail(what, f"expected shape {shape}, got {out.shape}", "return function's output, not its input")
    return out


def _check_one_block(checkpoint) -> None:
    block, x = _network(1)[0], _input()
    expected = block.inner(Tensor(x.data)).data
    what = "checkpoint(block, x) for one Linear + Tanh block"
    out = _as_output(what, call_learner(what, checkpoint, block, x, name="your checkpoint"), expected.shape)
    if not is_grad_enabled():
        fail(what, "gradients are still switched off after your checkpoint returned", GRAD_MODE_HINT)
    if not np.array_equal(out.data, expected):
        fail(what, "the output differs from block(x)", "your forward returns function(Tensor(x)).data")
    if not out.requires_grad:
        fail(what, "the output does not require grad, so backward will never reach your node",
             "create the output with Checkpoint.apply(x, function=function) (a Function records its node when "
             "an input requires grad); do not call function directly")
    with no_grad():
        call_learner(what, checkpoint, block, x, name="your checkpoint")
        still_off = not is_grad_enabled()
    if not still_off:
        fail(what + " inside no_grad()", "gradients were switched on by your checkpoint", GRAD_MODE_HINT)


def _check_gradients_and_calls(checkpoint, k: int) -> None:
    n, s = BLOCKS, BLOCKS // k
    what = f"an MLP of {n} blocks in k = {k} segments, the first {k - 1} through your checkpoint"
    reference, x_ref = _network(), _input()
    (reference(x_ref) * _cotangent()).sum().backward()
    blocks, x = _network(), _input()
    out = _as_output(what, call_learner(what, _segments, checkpoint, blocks, k, x, name="your checkpoint"),
                     (BATCH, WIDTH))
    calls = sum(b.calls for b in blocks)
    if calls != n:
        fail(what, f"the forward called the blocks {calls} times, expected n = {n} (each once)",
             "your forward calls function exactly once; backward calls it again")
    loss = (out * _cotangent()).sum()
    call_learner(what + ", backward", loss.backward, name="the backward through your Checkpoint")
    for name, got, expected in [(f"the gradient of parameter {i}", p.grad, q.grad) for i, (p, q) in
                                enumerate(zip(blocks.parameters(), reference.parameters()))] + \
                               [("the input's gradient", x.grad, x_ref.grad)]:
        if got is None:
            fail(what, f"{name} is None: no gradient reached it", RECOMPUTE_HINT)
        if not np.array_equal(got, expected):
            diff = float(np.max(np.abs(np.asarray(got) - expected))) if np.shape(got) == expected.shape else None
            fail(what, f"{name} differs from the network without checkpointing"
                       + (f" (largest difference {diff:.3g}; they must be equal to the last bit)" if diff is not None
                          else f" (shape {np.shape(got)}, expected {expected.shape})"), RECOMPUTE_HINT)
    calls = sum(b.calls for b in blocks)
    expected_calls = n + (k - 1) * s
    if calls != expected_calls:
        hint = RECOMPUTE_HINT
        if calls == n and k > 1:
            hint = ("your backward did not run function again: it used a graph kept from the forward, which holds "
                    "every activation and saves nothing; " + RECOMPUTE_HINT)
        fail(what, f"{calls} forward calls of the blocks after the backward; recomputation makes "
                   f"n + (k - 1)floor(n/k) = {expected_calls} (each checkpointed block twice, the last segment once)",
             hint)


def _cotangent():
    return np.random.default_rng(2).standard_normal((BATCH, WIDTH))


def chen_peak_activations(n: int, k: int) -> int:
    """Activations held at the peak of a step of n Linear + Tanh blocks in k segments (the first
    k - 1 checkpointed): (k - 1) segment inputs, 2 per block of the largest of the last segment
    and a recomputed one, and the input of the last segment (Chen et al. 2016's count)."""
    s = n // k
    return (k - 1) + 2 * max(n - (k - 1) * s, s) + 1


def _check_memory(checkpoint) -> str:
    size = 4
    blocks, x = _network(size), _input()
    what = f"memory.track around checkpoint(a segment of {size} blocks, x), before the backward"
    with memory.track() as tracker:
        out = call_learner(what, checkpoint, blocks, x, name="your checkpoint")
        held = tracker.live_bytes
    if tracker.peak_bytes > ACTIVATION:
        hint = NO_GRAD_HINT if tracker.saves > 1 else "keep the input array itself (no copy) and nothing else"
        fail(what, f"{tracker.peak_bytes / ACTIVATION:g} activations held at the peak of the forward "
                   f"({tracker.saves} recorded ops held arrays); a checkpoint holds its input only: 1, against "
                   f"{2 * size + 1} without checkpointing", hint)
    if held != ACTIVATION:
        fail(what, f"{held / ACTIVATION:g} activations held after the forward, expected 1 (the input)",
             "save the input for backward: ctx.save_for_backward(x)")
    del out
    n = BLOCKS
    peaks = {}
    for k in SEGMENTS:
        blocks, x = _network(), _input()
        with memory.track() as tracker:
            loss = call_learner(what, _segments, checkpoint, blocks, k, x, name="your checkpoint").sum()
            call_learner(what, loss.backward, name="the backward through your Checkpoint")
        peaks[k] = tracker.peak_bytes // ACTIVATION
        expected = chen_peak_activations(n, k)
        if tracker.peak_bytes != expected * ACTIVATION:
            fail(f"memory.track over a step of {n} blocks in k = {k} segments",
                 f"peak {tracker.peak_bytes / ACTIVATION:g} activations held, Chen et al.'s count is "
                 f"(k - 1) + 2 max(n - (k - 1)s, s) + 1 = {expected} (without checkpointing {2 * n + 1})",
                 "keep only each segment's input in forward, and let backward free the recomputed graph as it goes "
                 "(do not store the recomputed output or its graph on ctx)")
    return ", ".join(f"k = {k}: {p}" for k, p in peaks.items())


@forbidding(recompute.checkpoint, recompute.checkpoint_sequential, recompute.CheckpointFunction.forward,
            recompute.CheckpointFunction.backward)
def check_checkpoint(checkpoint) -> str:
    """Check ``checkpoint(function, x) -> Tensor`` (the exercise's) as the module docstring lists:
    values and grad mode, gradients bitwise equal to no checkpointing for k = 1, 2, 4, 8 segments,
    forward calls n + (k - 1)floor(n/k), bytes held (``memory.track``) as Chen et al. count them.

    Returns a one-line verdict. Raises AssertionError naming the case and what differs, with a
    hint; :class:`~minidist.course.checks.LearnerError` when ``checkpoint`` raises.
    """
    check_own_code(checkpoint, "checkpoint")
    _check_one_block(checkpoint)
    for k in SEGMENTS:
        _check_gradients_and_calls(checkpoint, k)
    peaks = _check_memory(checkpoint)
    return (f"checkpoint: ok (gradients bitwise equal for k = {', '.join(map(str, SEGMENTS))} segments of an "
            f"{BLOCKS}-block MLP, forward calls n + (k - 1)floor(n/k), peak activations held {peaks})")
