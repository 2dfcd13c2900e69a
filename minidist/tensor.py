"""Tensor: an array that remembers how it was made, so gradients can flow back.

A ``Tensor`` wraps a raw NumPy (or CuPy) array in ``.data``. When an op is applied to
tensors of which at least one has ``requires_grad=True``, the result keeps a *context*
(``_ctx``): which :class:`Function` made it, from which parent
tensors, and whatever that op saved for its backward. Those contexts form a directed
acyclic graph from the loss back to the leaves (the parameters and inputs).

``loss.backward()`` walks that graph once in reverse topological order (every node
after all the nodes that use it), calling each op's ``backward`` with the gradient of
the loss with respect to the op's output, and summing what comes back into the
gradients of its inputs: the chain rule, applied in the order that lets each node's
gradient be complete before it is used. This is reverse-mode automatic
differentiation (Griewank & Walther, *Evaluating Derivatives*, 2nd ed., 2008, ch. 3;
Baydin et al., "Automatic differentiation in machine learning: a survey", JMLR 2018).

Rules, as in PyTorch:

- Gradients *accumulate* into leaves' ``.grad`` (raw arrays): two backward passes over
  two micro-batches add up. Clear them with ``zero_grad()`` on the module or optimizer.
- Only leaves keep ``.grad``; interior nodes' gradients are dropped once used.
- After ``backward()`` the graph's saved state is freed. Calling ``backward()`` again
  through the same graph raises ``RuntimeError`` (run the forward again, or pass
  ``retain_graph=True`` the first time: then a second call adds the same gradients
  again).
- Under ``with no_grad():`` no graph is recorded (evaluation, optimizer updates).
  The switch is per thread, so ranks simulated as threads don't disturb each other.

Longer than 400 lines: Tensor, Function and backward must be readable alone and import no op (no
import cycle); the methods that only forward to ``functions`` keep it this long.
"""
from __future__ import annotations

import sys
import threading

import numpy

from minidist import backend


class _ThreadState(threading.local):
    """The engine's per-thread switches (each simulated rank is a thread): whether ops record
    a graph, the callbacks of the running backward, the memory observers, the anomaly
    checker. Read and set only through the public functions below."""

    grad_enabled = True
    callbacks = None        # list while a backward pass runs
    memory_observers = ()   # minidist.memory.track objects
    anomaly = None          # minidist.anomaly's checker, or None


_state = _ThreadState()
_anomaly_threads = 0  # threads with an anomaly checker: while 0, the engine's hooks cost one global read
_anomaly_lock = threading.Lock()


def is_grad_enabled() -> bool:
    """True unless the current thread is inside ``no_grad()``."""
    return _state.grad_enabled


def set_grad_enabled(mode: bool) -> bool:
    """Turn graph recording on or off in this thread (``torch.set_grad_enabled``); returns the
    previous mode, so a caller can restore it. Raises TypeError for anything but a bool."""
    if not isinstance(mode, bool):
        raise TypeError(f"set_grad_enabled: mode must be True or False, got {mode!r}")
    previous, _state.grad_enabled = _state.grad_enabled, mode
    return previous


class no_grad:
    """Context manager (and decorator) that stops graph recording in this thread.

    Inside it, ops on tensors return results with ``requires_grad=False`` and keep no
    context, so no memory is held for a backward pass. Used for evaluation and for the
    optimizer's in-place updates. Mirrors ``torch.no_grad``.
    """

    mode = False

    def __enter__(self):
        self._previous = set_grad_enabled(self.mode)
        return self

    def __exit__(self, *exc):
        set_grad_enabled(self._previous)
        return False

    def __call__(self, fn):
        def wrapper(*args, **kwargs):
            with type(self)():
                return fn(*args, **kwargs)

        wrapper.__name__, wrapper.__doc__ = fn.__name__, fn.__doc__
        return wrapper


class enable_grad(no_grad):
    """Context manager (and decorator) that turns graph recording back on in this thread,
    even inside ``no_grad()`` (``torch.enable_grad``): recomputation records the forward
    again while the backward that called it runs."""

    mode = True


def queue_callback(callback) -> None:
    """Call ``callback()`` once the running backward pass ends (after every leaf's ``.grad``
    and post-accumulate-grad hook), in this thread; PyTorch's
    ``Variable._execution_engine.queue_callback``. Data parallelism queues its "wait for the
    buckets' all-reduces" here, from a gradient hook. Callbacks run in queue order, at the
    end of the outermost backward when backwards nest (a checkpointed segment recomputed
    inside backward), and are dropped if the backward raises. Raises RuntimeError outside a
    backward pass."""
    queue = _state.callbacks
    if queue is None:
        raise RuntimeError("queue_callback() can only be called during a backward pass (from a hook)")
    queue.append(callback)


def _backward_scope(run, *args):
    """Run one backward pass ``run(*args)``, then the callbacks it queued (outermost only)."""
    if _state.callbacks is not None:  # nested: the outer backward runs them
        return run(*args)
    _state.callbacks = queue = []
    try:
        result = run(*args)
        while queue:
            queue.pop(0)()
        return result
    finally:
        _state.callbacks = None


# Memory observers (minidist.memory.track): objects with saved(ctx) and released(ctx),
# told when a recorded op keeps arrays for its backward and when backward frees them.
# Per thread, like no_grad; there are none unless a tracker is running.
def add_memory_observer(observer) -> None:
    """Tell ``observer`` (with ``saved(ctx)`` and ``released(ctx)`` methods) about every
    Context this thread's ops save for backward and every one backward frees, until
    :func:`remove_memory_observer`. Used by ``minidist.memory.track``."""
    _state.memory_observers = (*_state.memory_observers, observer)


def remove_memory_observer(observer) -> None:
    """Stop telling ``observer`` (see :func:`add_memory_observer`); absent: nothing happens."""
    _state.memory_observers = tuple(o for o in _state.memory_observers if o is not observer)


def notify_saved(ctx) -> None:
    """Tell this thread's memory observers that ``ctx`` now holds arrays for backward (the
    engine calls it for every recorded op; ``minidist.recompute`` for its own contexts)."""
    for observer in _state.memory_observers:
        observer.saved(ctx)


def _notify_released(ctx):
    for observer in _state.memory_observers:
        observer.released(ctx)


def anomaly_checker():
    """This thread's anomaly checker (``minidist.anomaly``), or None when the mode is off."""
    return _state.anomaly


def set_anomaly_checker(checker) -> None:
    """Install ``checker`` (an object with ``forward(cls, ctx, out)`` and ``backward(ctx,
    grads)``, called for every op; None: off) in this thread, keeping the count of threads
    that have one, so the engine's hooks cost one global read while no thread does."""
    global _anomaly_threads
    with _anomaly_lock:
        _anomaly_threads += (checker is not None) - (_state.anomaly is not None)
    _state.anomaly = checker


def anomaly_threads() -> int:
    """How many threads have an anomaly checker installed (0: the hooks are skipped)."""
    return _anomaly_threads


class Tensor:
    """An n-dimensional array with an optional gradient (**contract**).

    Args:
        data: a NumPy/CuPy array (kept as is, not copied), a Tensor (its array is
            shared), or anything ``xp.asarray`` accepts (Python numbers and lists;
            NumPy infers the dtype, so ``Tensor([1.0, 2.0])`` is float64).
        requires_grad: record operations on this tensor so ``backward()`` can fill
            ``.grad``. Only floating-point tensors can require gradients.
        dtype: optional dtype to convert to (e.g. ``"float32"``).
        device: ``"cpu"`` or ``"cuda"``; default ``$MINIDIST_DEVICE`` or ``"cpu"``
            for data given as Python objects, else the device the array lives on.

    Attributes:
        data: the raw array (assignable; shape and dtype are the array's).
        grad: a raw array of ``data``'s shape, or None before any backward.
        requires_grad: bool.

    Raises:
        TypeError: ``requires_grad=True`` on an integer or boolean array.
        backend.DeviceError: ``device="cuda"`` without CuPy or a GPU.
    """

    __slots__ = ("data", "grad", "requires_grad", "_ctx", "_hooks", "__weakref__")
    __array_priority__ = 1000  # so ndarray + Tensor defers to Tensor.__radd__

    def __init__(self, data, requires_grad=False, dtype=None, device=None):
        if isinstance(data, Tensor):
            data = data.data
        if not (isinstance(data, numpy.ndarray) or _is_cupy(data)):  # numbers, lists, NumPy scalars
            data = backend.module_for(device or backend.default_device()).asarray(data, dtype=dtype)
        elif device is not None:
            data = backend.to_device(data, device)
        if dtype is not None and data.dtype != dtype:
            data = data.astype(dtype)
        if requires_grad and data.dtype.kind not in "fc" and data.dtype.name != "bfloat16":  # ml_dtypes: kind "V"
            raise TypeError(
                f"only floating-point tensors can require gradients; got dtype {data.dtype}. "
                "Convert first, e.g. Tensor(x, dtype='float32', requires_grad=True)."
            )
        self.data = data
        self.grad = None
        self.requires_grad = bool(requires_grad)
        self._ctx = None
        self._hooks = None

    # ------------------------------------------------------------------ properties
    @property
    def shape(self):
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def ndim(self):
        return self.data.ndim

    @property
    def size(self):
        return self.data.size

    @property
    def device(self) -> str:
        return backend.device_of(self.data)

    @property
    def is_leaf(self) -> bool:
        """True for tensors made by the user (parameters, inputs), not by an op."""
        return self._ctx is None

    def __len__(self):
        return len(self.data)

    def __repr__(self):
        grad = ", requires_grad=True" if self.requires_grad else ""
        body = repr(backend.to_numpy(self.data)).replace("array(", "").rstrip(")")
        return f"Tensor({body}{grad})"

    # ------------------------------------------------------------------ conversions
    def numpy(self):
        """The data as a NumPy array (copied from the GPU if needed; shared on the CPU)."""
        return backend.to_numpy(self.data)

    def item(self):
        """The value of a one-element tensor as a Python number."""
        if self.data.size != 1:
            raise ValueError(f"item() needs a tensor with one element; this one has shape {self.shape}")
        return self.data.reshape(()).item()

    def detach(self) -> Tensor:
        """A new leaf tensor sharing this one's data, cut from the graph."""
        return Tensor(self.data)

    def to(self, device: str) -> Tensor:
        """A copy on ``device`` (``"cpu"`` or ``"cuda"``); self when already there.
        The copy is a leaf that keeps ``requires_grad``."""
        if backend.check_device(device) == self.device:
            return self
        return Tensor(backend.to_device(self.data, device), requires_grad=self.requires_grad)

    def astype(self, dtype) -> Tensor:
        """A new leaf tensor with data converted to ``dtype`` (not differentiable)."""
        return Tensor(self.data.astype(dtype))

    # ------------------------------------------------------------------ backward
    def backward(self, grad=None, retain_graph=False):
        """Compute the gradient of this tensor with respect to every leaf it depends on.

        Args:
            grad: the gradient of some scalar with respect to this tensor (same shape
                and device; a raw array or Tensor). May be omitted only when this
                tensor has a single element (a loss); then it is 1.
            retain_graph: keep the graph's saved state so backward can run again.

        Leaves' ``.grad`` is *added to* (created on first use). The graph is walked in
        a topological order built with an explicit stack, so a chain of 100,000 ops
        needs no recursion; the order is deterministic (it follows each op's inputs in
        order), so two runs sum gradients in the same order and agree to the bit.

        Raises:
            RuntimeError: this tensor does not require grad; it has more than one
                element and ``grad`` is missing; or the graph was already freed by an
                earlier ``backward()`` (pass ``retain_graph=True`` the first time).
            ValueError: ``grad`` has a different shape than this tensor.
        """
        if not self.requires_grad:
            raise RuntimeError(
                "backward(): this tensor does not require grad and has no graph. Create the "
                "leaves with requires_grad=True (parameters do) and do not run the forward "
                "pass under no_grad()."
            )
        xp = backend.get_array_module(self.data)
        if grad is None:
            if self.data.size != 1:
                raise RuntimeError(
                    f"backward(): grad can be implied only for a tensor with one element (a loss); "
                    f"this one has shape {self.shape}. Reduce it first (e.g. .sum() or .mean()) or "
                    f"pass grad= an array of shape {self.shape}."
                )
            grad = xp.ones_like(self.data)
        else:
            grad = grad.data if isinstance(grad, Tensor) else xp.asarray(grad, dtype=self.dtype)
            if grad.shape != self.shape:
                raise ValueError(f"backward(): grad has shape {grad.shape}, but the tensor has shape {self.shape}")

        _backward_scope(self._backprop, grad, retain_graph)

    def backward_input(self, grad, inputs) -> DeferredWeightGrads:
        """The input-gradient half of ``backward`` (the *I* pass of zero-bubble pipelines).

        Zero-bubble pipeline parallelism (Qi et al., "Zero Bubble Pipeline Parallelism",
        ICLR 2024) splits a layer's backward in two: the gradient with respect to its input
        (needed at once by the previous stage) and the gradient with respect to its weights
        (needed only by the optimizer, so it can wait and fill an idle slot). This runs the
        chain rule from this tensor down to ``inputs`` and accumulates their ``.grad``, but for
        every op with a *weight* input (a leaf that requires grad and is not in ``inputs``) it
        only records the op and the gradient that reached its output. The returned object's
        ``run()`` is the *W* pass: it computes those weight gradients and accumulates them,
        exactly as one ``backward`` would have (the same ops, the same order of sums).

        Args:
            grad: gradient with respect to this tensor (same shape), as for ``backward``.
            inputs: the tensors whose gradient is wanted now (e.g. a stage's input).

        Returns:
            DeferredWeightGrads: call ``run()`` once to finish the backward.

        Raises the errors of ``backward``.
        """
        grad = self._initial_grad(grad)
        keep = {id(t) for t in inputs}
        deferred = []
        _backward_scope(self._backprop, grad, False, deferred, keep)
        return DeferredWeightGrads(deferred, keep)

    def _initial_grad(self, grad):
        if not self.requires_grad:
            raise RuntimeError("backward(): this tensor does not require grad and has no graph.")
        xp = backend.get_array_module(self.data)
        if grad is None:
            if self.data.size != 1:
                raise RuntimeError(f"backward(): grad can be implied only for a tensor with one element; "
                                   f"this one has shape {self.shape}")
            return xp.ones_like(self.data)
        grad = grad.data if isinstance(grad, Tensor) else xp.asarray(grad, dtype=self.dtype)
        if grad.shape != self.shape:
            raise ValueError(f"backward(): grad has shape {grad.shape}, but the tensor has shape {self.shape}")
        return grad

    def _backprop(self, grad, retain_graph, deferred=None, keep=None):
        """The chain rule over the graph below self. With ``deferred`` (a list), the
        gradients of weight leaves (leaves not in ``keep``) are not computed: each op that
        has one is recorded as (ctx, gradient of its output) for a later W pass."""
        order = self._topological_order()
        grads = {id(self): grad}
        handed_to_leaves = {id(grad)}
        for i, node in enumerate(order):
            order[i] = None  # once done, a node nobody else holds is freed with its array
            g = grads.pop(id(node), None)
            if g is None:
                continue
            ctx = node._ctx
            if ctx is None:  # a leaf: accumulate
                node._accumulate(g, handed_to_leaves)
                continue
            defer = deferred is not None and any(_is_weight(p, keep) for p in ctx.parents)
            if defer:  # the I pass: input gradients now, weight gradients later
                deferred.append((ctx, g))
                wanted = ctx.needs_input_grad
                ctx.needs_input_grad = tuple(w and not _is_weight(p, keep) for w, p in zip(wanted, ctx.parents))
                input_grads = ctx.fn.backward(ctx, g)
                ctx.needs_input_grad = wanted
            else:
                input_grads = ctx.fn.backward(ctx, g)
            if not isinstance(input_grads, tuple):
                input_grads = (input_grads,)
            if _anomaly_threads and _state.anomaly is not None:  # minidist.anomaly.detect_anomaly
                _state.anomaly.backward(ctx, input_grads)
            for parent, pg in zip(ctx.parents, input_grads):
                if pg is None or not parent.requires_grad or (defer and _is_weight(parent, keep)):
                    continue
                key = id(parent)
                # Never add in place: the same array may have been passed to two inputs.
                grads[key] = pg if key not in grads else grads[key] + pg
            if not retain_graph and not defer:
                ctx.release()
                node._ctx = _FREED_CONTEXT

    def register_post_accumulate_grad_hook(self, hook):
        """Call ``hook(tensor)`` each time backward() has finished adding into this
        leaf's ``.grad`` (PyTorch's hook of the same name). Data parallelism uses it to
        start averaging a bucket of gradients as soon as the bucket is complete, while
        the backward pass goes on with earlier layers. Returns a handle with
        ``remove()``. Raises RuntimeError on a non-leaf tensor."""
        if not self.is_leaf:
            raise RuntimeError("post-accumulate-grad hooks can only be registered on leaf tensors")
        if self._hooks is None:
            self._hooks = []
        self._hooks.append(hook)
        hooks = self._hooks

        class Handle:
            def remove(self):
                if hook in hooks:
                    hooks.remove(hook)

        return Handle()

    def _accumulate(self, g, handed_to_leaves):
        # A leaf keeps the array it is given unless that array may be shared: a view of
        # another array, read-only (a broadcast), or already given to another leaf in
        # this pass (x + x, or w1 + w2). Copying only then keeps the fast path free.
        if self.grad is None:
            shared = id(g) in handed_to_leaves or g.base is not None or not _writeable(g)
            self.grad = g.copy() if shared else g
            handed_to_leaves.add(id(self.grad))
        else:
            self.grad = self.grad + g
        if self._hooks:
            for hook in list(self._hooks):
                hook(self)

    def _topological_order(self):
        """Nodes reachable from self, each before all of its parents (an explicit-stack
        depth-first search; deterministic because parents are visited in order)."""
        order, visited = [], set()
        stack = [(self, False)]
        while stack:
            node, parents_done = stack.pop()
            if parents_done:
                order.append(node)
                continue
            if id(node) in visited:
                continue
            visited.add(id(node))
            ctx = node._ctx
            if ctx is _FREED_CONTEXT:
                raise RuntimeError(
                    "backward(): the graph was already freed by an earlier backward(). Run the "
                    "forward pass again to build a new graph, or call the first backward with "
                    "retain_graph=True."
                )
            stack.append((node, True))
            if ctx is not None:
                for parent in reversed(ctx.parents):
                    if parent.requires_grad and id(parent) not in visited:
                        stack.append((parent, False))
        order.reverse()  # post-order reversed: outputs first, leaves last
        return order

    # The operators (+ - * / ** @, unary minus, indexing) and the methods sum, mean, max,
    # reshape, transpose/.T, exp, log, relu, tanh, sigmoid and log_softmax are installed by
    # minidist.functions, at its end, next to the ops they call: this file never imports the
    # ops, so it reads (and imports) on its own.


def _is_cupy(x) -> bool:
    return type(x).__module__.startswith("cupy")


def _writeable(array) -> bool:
    flags = getattr(array, "flags", None)
    return True if flags is None else bool(getattr(flags, "writeable", True))


def _is_weight(tensor, keep) -> bool:
    """A leaf whose gradient the W pass computes: requires grad, not made by an op, not kept."""
    return tensor.requires_grad and tensor._ctx is None and id(tensor) not in keep


class DeferredWeightGrads:
    """The W pass left over by :meth:`Tensor.backward_input`: ``run()`` computes and
    accumulates the weight gradients of the recorded ops (each op's backward asked only for
    its weight inputs), then frees the ops' saved arrays. Running it twice raises."""

    def __init__(self, work, keep):
        self._work, self._keep = work, keep

    def __len__(self):
        return len(self._work)

    @property
    def contexts(self) -> list:
        """The recorded ops (their contexts still hold what the W pass needs)."""
        return [ctx for ctx, _ in self._work or ()]

    @property
    def output_grads(self) -> list:
        """The gradient that reached each recorded op's output (raw arrays, held until run)."""
        return [g for _, g in self._work or ()]

    def run(self) -> None:
        if self._work is None:
            raise RuntimeError("DeferredWeightGrads.run(): the weight gradients were already computed")
        _backward_scope(self._run)

    def _run(self):
        handed = set()
        for ctx, g in self._work:
            wanted = ctx.needs_input_grad
            ctx.needs_input_grad = tuple(w and _is_weight(p, self._keep) for w, p in zip(wanted, ctx.parents))
            input_grads = ctx.fn.backward(ctx, g)
            if not isinstance(input_grads, tuple):
                input_grads = (input_grads,)
            if _anomaly_threads and _state.anomaly is not None:  # minidist.anomaly.detect_anomaly
                _state.anomaly.backward(ctx, input_grads)
            for parent, pg, want in zip(ctx.parents, input_grads, ctx.needs_input_grad):
                if want and pg is not None:
                    parent._accumulate(pg, handed)
            ctx.release()
        self._work = None


class _FreedContext:
    """Stands in for a context whose saved arrays were released by backward()."""

    parents = ()


_FREED_CONTEXT = _FreedContext()


# ================================================================ ops: Function and Context


class Context:
    """What one op application remembers for its backward pass.

    ``fn`` (the Function class) and ``parents`` (the input Tensors) are set by
    :meth:`Function.apply`, and ``needs_input_grad`` (one bool per input, as in
    PyTorch) lets a backward skip work nobody will use, such as the gradient of the
    data fed to the first layer; ops add ``saved`` through :meth:`save_for_backward` and any
    other attribute they need (an axis, a shape). ``release()`` drops all of it once
    the backward pass has used it, so the arrays can be freed.
    """

    def save_for_backward(self, *arrays):
        self.saved = arrays

    def release(self):
        _notify_released(self)
        self.__dict__.clear()
        self.parents = ()


class Function:
    """Base class of the differentiable ops (see the module docstring)."""

    @staticmethod
    def forward(ctx, *arrays, **options):
        raise NotImplementedError

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError

    @classmethod
    def apply(cls, *inputs, **options) -> Tensor:
        """Run the op on Tensors (or raw arrays / Python numbers, treated as constants)
        and return a Tensor that remembers how it was made when gradients are on."""
        tensors = as_tensors(inputs)
        if len(tensors) > 1 and "cupy" in sys.modules:  # only CuPy can put arrays on two devices
            _check_same_device(cls, tensors)
        ctx = Context()
        ctx.needs_input_grad = tuple(t.requires_grad for t in tensors)
        out = Tensor(cls.forward(ctx, *[t.data for t in tensors], **options))
        if is_grad_enabled() and any(t.requires_grad for t in tensors):
            ctx.fn, ctx.parents = cls, tensors
            out.requires_grad, out._ctx = True, ctx
            notify_saved(ctx)
        if _anomaly_threads and _state.anomaly is not None:  # minidist.anomaly: check, note call site
            _state.anomaly.forward(cls, ctx, out)
        return out


def _check_same_device(cls, tensors):
    """Raise RuntimeError (PyTorch's wording) when an op's inputs are on different devices:
    CuPy's own error ("Unsupported type numpy.ndarray") would not say which op or how to fix it."""
    devices = [t.device for t in tensors]
    if len(set(devices)) > 1:
        raise RuntimeError(f"expected all tensors to be on the same device, but {cls.__name__} got inputs on "
                           f"{', '.join(devices)}; move them with .to('cuda') (or .to('cpu')), or create them with "
                           "device=")


def as_tensors(inputs):
    """Wrap raw arrays and Python numbers as constant Tensors. A Python number takes the
    dtype NumPy's promotion gives it next to the first tensor (float32 stays float32)."""
    like = next((x for x in inputs if isinstance(x, Tensor)), None)
    out = []
    for x in inputs:
        if isinstance(x, Tensor):
            out.append(x)
        elif isinstance(x, (int, float, bool)) and like is not None:
            xp = backend.get_array_module(like.data)
            out.append(Tensor(xp.asarray(x, dtype=xp.result_type(like.data, x))))
        else:
            out.append(Tensor(x))
    return out
