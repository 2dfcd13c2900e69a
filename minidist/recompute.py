"""Activation recomputation (gradient checkpointing): spend compute to save memory (**contract**).

The backward pass of an op needs arrays from its forward: a Linear its input, a tanh its
output. Kept for every layer of a deep network they are the *activation memory*, which grows
with depth and batch and is often the largest part of training memory. Checkpointing keeps
only the inputs of some segments of the network, runs those segments' forward without
recording a graph, and, when backward reaches a segment, runs its forward a second time
(now recording) and backpropagates through that fresh graph. The idea comes from automatic
differentiation (Griewank, "Achieving logarithmic growth of temporal and spatial complexity
in reverse automatic differentiation", 1992; Griewank & Walther, *Evaluating Derivatives*,
2nd ed., 2008, ch. 12 "Reversal Schedules and Checkpointing"); Chen, Xu, Zhang & Guestrin,
"Training Deep Nets with Sublinear Memory Cost" (arXiv:1604.06174, 2016) brought it to deep
learning. The functions mirror ``torch.utils.checkpoint``'s reentrant variant.

Cost of :func:`checkpoint_sequential` on n layers with ``segments`` = k, s = floor(n/k)
layers per segment; the last segment (n - (k-1)s layers) is not checkpointed, as in torch:

- forward calls: n + (k-1)s (each checkpointed layer runs twice), about one forward more;
- peak activations held: the k-1 segment inputs, plus max(n - (k-1)s, s) layers' worth:
  the last segment's during the forward, then one recomputed segment at a time.

With k near sqrt(n) the peak is about 2 sqrt(n) layers instead of n: Chen et al.'s sqrt(n)
schedule. (Griewank's binomial schedules reach O(log n) memory for O(n log n) compute by
checkpointing recursively; not done here.)

Randomness. A segment with dropout must draw the same mask when it runs again, or the
gradient belongs to a different network. torch saves the global generators' states; here
randomness lives in generators owned by modules (:class:`minidist.nn.Dropout`), which call
:func:`note_random_draw` before each draw. :func:`checkpoint` listens while it runs the
function, remembers each generator's state before its first draw, and before recomputing
sets those generators back to it (then returns them to where they were, so the recompute
does not shift the training run's random stream: torch's ``fork_rng``).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

from minidist import backend
from minidist.tensor import Context, Function, Tensor, enable_grad, is_grad_enabled, no_grad, notify_saved

_listeners = threading.local()  # per thread: the dicts of the checkpoints now running a function


def note_random_draw(generator) -> None:
    """Tell the checkpoints running in this thread that ``generator`` (a
    ``numpy.random.Generator``) is about to draw. Modules that draw random numbers in their
    forward (``nn.Dropout``) call it first, so a recomputation can replay the same draws."""
    for states in getattr(_listeners, "stack", ()):
        states.setdefault(id(generator), (generator, generator.bit_generator.state))


@contextmanager
def _listening():
    """Collect {id: (generator, state before its first draw)} for draws in the block."""
    stack = _listeners.__dict__.setdefault("stack", [])
    states = {}
    stack.append(states)
    try:
        yield states
    finally:
        stack.remove(states)


@contextmanager
def _replaying(states):
    """Set the generators to ``states`` for the block, then back to where they were."""
    now = [(gen, gen.bit_generator.state) for gen, _ in states.values()]
    for gen, state in states.values():
        gen.bit_generator.state = state
    try:
        yield
    finally:
        for gen, state in now:
            gen.bit_generator.state = state


# ----------------------------------------------------------------------------- checkpoint


def checkpoint(function, *args, preserve_rng_state=True):
    """Run ``function(*args)`` keeping only its inputs; rerun it during backward (**contract**).

    As ``torch.utils.checkpoint.checkpoint`` (reentrant): the forward runs under
    ``no_grad``, so none of the arrays ``function``'s ops would save for backward are kept;
    the outputs are tied into the graph by one node that holds the inputs. When backward
    reaches that node it calls ``function`` again, with gradients on, on detached copies of
    the inputs, backpropagates the incoming gradient through this fresh graph and hands the
    inputs' gradients on. Parameters used inside ``function`` receive their gradients
    (added to ``.grad``) during that inner backward, so the first segment of a network,
    whose input needs no gradient, still trains (unlike torch's reentrant variant, the
    output requires grad whenever gradients are on).

    Args:
        function: a callable (a Module, a function of Tensors); it must compute the same
            thing when called again (no in-place changes to its inputs between the forward
            and the backward).
        *args: its arguments; at least one Tensor. Tensors are kept (their arrays, not
            copies) and differentiated where they require grad; other values are passed
            through unchanged to both calls.
        preserve_rng_state: replay the random draws (``nn.Dropout`` masks) of the first
            call in the recomputation (see the module docstring). With False the
            recomputation draws fresh numbers and the gradients belong to other masks.

    Returns:
        ``function``'s output: a Tensor, or a tuple of Tensors, of the shapes and dtypes
        ``function`` returns (floating-point outputs require grad when gradients are on).
        Under ``no_grad`` this is just ``function(*args)``.

    Raises:
        TypeError: ``function`` is not callable, no argument is a Tensor,
            ``preserve_rng_state`` is not a bool, or ``function`` returns something other
            than a Tensor or a non-empty tuple/list of Tensors.
        RuntimeError (during backward): the backward was split into input and weight
            halves (``Tensor.backward_input`` with a weight passed as an argument): the
            recomputation cannot be split; pass weights through a module instead.
    """
    if not callable(function):
        raise TypeError(f"checkpoint: function must be callable (a Module or a function), "
                        f"got {type(function).__name__}")
    if not isinstance(preserve_rng_state, bool):
        raise TypeError(f"checkpoint: preserve_rng_state must be True or False, got {preserve_rng_state!r}")
    if not any(isinstance(a, Tensor) for a in args):
        raise TypeError("checkpoint: none of the arguments is a Tensor. Pass the function's input(s) as Tensors "
                        f"(got {[type(a).__name__ for a in args]}): they are what checkpoint keeps to rerun it.")
    if not is_grad_enabled():  # nothing will be differentiated: no node, no recomputation
        return function(*args)
    with _listening() as rng_states, no_grad():
        result = function(*args)
    outputs = (result,) if isinstance(result, Tensor) else result
    if not (isinstance(outputs, (tuple, list)) and outputs and all(isinstance(o, Tensor) for o in outputs)):
        raise TypeError(f"checkpoint: function must return a Tensor or a tuple of Tensors, got "
                        f"{type(result).__name__}")

    # One node holds the inputs (its parents, and its saved arrays for memory accounting).
    ctx = Context()
    ctx.fn, ctx.function, ctx.args = CheckpointFunction, function, args
    ctx.parents = tuple(a for a in args if isinstance(a, Tensor))
    ctx.needs_input_grad = tuple(t.requires_grad for t in ctx.parents)
    ctx.rng_states = rng_states if preserve_rng_state else {}
    ctx.save_for_backward(*(t.data for t in ctx.parents))
    if isinstance(result, Tensor):
        out = _output(result, ctx)
    else:
        # Several outputs: each is a node whose parent is one shared, empty "hub" tensor made
        # by the recompute node. Backward visits every output before the hub, so each output
        # leaves its gradient in ctx.output_grads and the hub's backward uses them all at once.
        hub = Tensor(backend.get_array_module(outputs[0].data).empty(0), requires_grad=True)
        hub._ctx, ctx.output_grads = ctx, {}
        out = []
        for i, o in enumerate(outputs):
            pick = Context()
            pick.fn, pick.parents, pick.needs_input_grad = _Output, (hub,), (True,)
            pick.index, pick.output_grads = i, ctx.output_grads
            out.append(_output(o, pick))
        out = type(result)(out) if isinstance(result, tuple) else out
    notify_saved(ctx)
    return out


def _output(tensor, ctx) -> Tensor:
    """A new Tensor on ``tensor``'s array that backward reaches through ``ctx``."""
    out = Tensor(tensor.data)
    if tensor.dtype.kind in "fc":  # integer outputs carry no gradient
        out.requires_grad, out._ctx = True, ctx
    return out


class _Output(Function):
    """One of several outputs of a checkpoint: passes its gradient to the shared node."""

    @staticmethod
    def backward(ctx, grad):
        ctx.output_grads[ctx.index] = grad
        return (backend.get_array_module(grad).empty(0, dtype=grad.dtype),)  # the hub's (empty) gradient


class CheckpointFunction(Function):
    """The node :func:`checkpoint` puts in the graph. Its forward is :func:`checkpoint`
    itself (run under no_grad); its backward reruns the function and backpropagates."""

    @staticmethod
    def backward(ctx, grad):
        if ctx.needs_input_grad != tuple(t.requires_grad for t in ctx.parents):
            raise RuntimeError("checkpoint: this backward was split into input and weight gradients "
                               "(Tensor.backward_input with a weight among checkpoint's arguments); a "
                               "recomputation cannot be split. Use the weight inside a module instead.")
        grads = ctx.output_grads if hasattr(ctx, "output_grads") else {0: grad}
        inputs = [Tensor(a.data, requires_grad=a.requires_grad) if isinstance(a, Tensor) else a for a in ctx.args]
        with _replaying(ctx.rng_states), enable_grad():
            result = ctx.function(*inputs)
            outputs = (result,) if isinstance(result, Tensor) else tuple(result)
            roots = [(outputs[i], g) for i, g in sorted(grads.items()) if outputs[i].requires_grad]
            if len(roots) == 1:
                roots[0][0].backward(roots[0][1])
            elif roots:  # one backward from several outputs: a node whose parents they are
                _join(roots).backward(backend.get_array_module(grad).zeros(()))
        if hasattr(ctx, "output_grads"):
            ctx.output_grads.clear()
        return tuple(t.grad if t.requires_grad else None for t in inputs if isinstance(t, Tensor))


class _Join(Function):
    """Backward of several outputs at once: hands each its own gradient."""

    @staticmethod
    def backward(ctx, grad):
        return ctx.grads


def _join(roots) -> Tensor:
    ctx = Context()
    ctx.fn, ctx.parents = _Join, tuple(t for t, _ in roots)
    ctx.needs_input_grad, ctx.grads = (True,) * len(roots), tuple(g for _, g in roots)
    joined = Tensor(backend.get_array_module(roots[0][1]).zeros(()), requires_grad=True)
    joined._ctx = ctx
    return joined


# ----------------------------------------------------------------------------- sequential


def checkpoint_sequential(functions, segments, input, preserve_rng_state=True):  # torch's name
    """Run a sequence of layers in ``segments`` pieces, checkpointing all but the last (**contract**).

    As ``torch.utils.checkpoint.checkpoint_sequential``: with n layers, each of the first
    ``segments - 1`` pieces takes floor(n / segments) consecutive layers and goes through
    :func:`checkpoint`; the last piece takes the remaining layers and runs normally (its
    activations are needed at once by the backward, so recomputing them would only cost
    time). See the module docstring for the forward calls and memory this gives.

    Args:
        functions: an ``nn.Sequential``, or a list/tuple of modules (callables of one
            Tensor), applied in order.
        segments: k, the number of pieces, 1 <= k <= number of layers (k = 1: no
            checkpointing).
        input: the first layer's input, a Tensor of the shape it expects (e.g. (batch,
            features)).
        preserve_rng_state: as for :func:`checkpoint`.

    Returns:
        The last layer's output (a Tensor).

    Raises:
        TypeError: ``functions`` is not a Sequential/list/tuple of callables, ``segments``
            is not an int, or ``input`` is not a Tensor.
        ValueError: ``segments`` < 1 or larger than the number of layers, or no layers.
    """
    if isinstance(functions, (list, tuple)) or hasattr(functions, "_modules"):
        layers = list(functions)
    else:
        raise TypeError(f"checkpoint_sequential: functions must be an nn.Sequential or a list of modules, "
                        f"got {type(functions).__name__}")
    bad = next((i for i, f in enumerate(layers) if not callable(f)), None)
    if bad is not None:
        raise TypeError(f"checkpoint_sequential: layer {bad} is a {type(layers[bad]).__name__}, not callable")
    if not layers:
        raise ValueError("checkpoint_sequential: no layers to run")
    if isinstance(segments, bool) or not isinstance(segments, int):
        raise TypeError(f"checkpoint_sequential: segments must be an int, got {segments!r}")
    if not 1 <= segments <= len(layers):
        raise ValueError(f"checkpoint_sequential: segments must be between 1 and the number of layers "
                         f"({len(layers)}), got {segments}")
    if not isinstance(input, Tensor):
        raise TypeError(f"checkpoint_sequential: input must be a Tensor, got {type(input).__name__} "
                        "(wrap arrays: Tensor(x))")

    def run(start, end):
        def forward(x):
            for layer in layers[start:end]:
                x = layer(x)
            return x
        return forward

    size = len(layers) // segments
    x = input
    for start in range(0, size * (segments - 1), size):
        x = checkpoint(run(start, start + size), x, preserve_rng_state=preserve_rng_state)
    return run(size * (segments - 1), len(layers))(x)
