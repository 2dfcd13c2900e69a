"""Memory: where the bytes of a training step go, counted as they come and go.

One device training a model of P parameters holds

- parameters: P values;
- gradients: P more (one per parameter, from the first backward until ``zero_grad``);
- optimizer state: SGD with momentum P more, Adam 2P (Kingma & Ba, ICLR 2015); mixed
  precision adds fp32 master weights (Rajbhandari et al., "ZeRO", SC 2020, count 16 bytes
  per parameter for fp16 Adam);
- activations: the arrays the forward saves for the backward. For an MLP of n layers of
  width w on a batch of B rows that is about n·B·w values: it grows with depth and batch,
  not with P, and is what activation recomputation trades for time (Chen et al.,
  "Training Deep Nets with Sublinear Memory Cost", 2016; :mod:`minidist.recompute`).

The first three sit in arrays that can be looked at (:func:`parameter_bytes`,
:func:`gradient_bytes`, :func:`optimizer_state_bytes`). Activations change op by op, so they
are counted as they happen: every op recorded for backward tells the trackers running in
its thread what it holds (``tensor.Function.apply``), and every step of the backward what it
freed (``Context.release``). :func:`track` is such a tracker: it keeps the live and the peak
bytes of a block, per op and per module.

What a recorded op holds until its backward: the arrays it saved (``ctx.saved``: a Linear
its input, a tanh its output) and, in this engine, the arrays of its input Tensors, which
its context references to walk the graph (``ctx.parents``). PyTorch's graph nodes keep only
what they save; here a Linear + tanh block also keeps its pre-activation alive (the tanh's
input), so it holds two arrays of its width where PyTorch holds one. Counting both is what
makes these figures agree with ``tracemalloc`` (tests/test_memory.py).

Counting rules (the same in :func:`saved_bytes`):

- bytes count once, however many ops hold them (a tanh's output is saved by the tanh and
  by the next Linear) and through however many views (a reshape sees the same bytes):
  arrays are keyed by the memory they view (owner, first byte, size). A view counts its own
  bytes, so the micro-batches of a mini-batch count as their rows; a slice held next to the
  whole array it was cut from counts twice (the one overcount; a slice alone keeps its whole
  owner alive, which this rule does not see);
- a ``nn.Parameter``'s array (a Linear's weight) is a parameter, not an activation, and is
  left out;
- temporaries inside an op, the gradients flowing through backward and the allocator's own
  overhead are not held by the graph. To see everything, use ``tracemalloc`` (NumPy reports
  its allocations to it) or, on a GPU, CuPy's memory pool (:func:`device_memory_bytes`).
"""
from __future__ import annotations

import threading
import weakref
from collections import defaultdict

from minidist import backend, tensor
from minidist.nn import Module, Parameter
from minidist.tensor import Tensor

OUTSIDE_MODULES = "(outside modules)"  # the module label of ops not run by a tracked module


def _base(array):
    """The array that owns ``array``'s memory (follows ``.base`` through views)."""
    while getattr(array, "base", None) is not None and hasattr(array.base, "dtype"):
        array = array.base
    return array


def _region(array):
    """(owner's id, address of the first byte, bytes): the memory ``array`` views."""
    start = array.data.ptr if backend.device_of(array) == "cuda" else array.__array_interface__["data"][0]
    return id(_base(array)), start, int(array.nbytes)


def _arrays(module_or_tensors):
    tensors = module_or_tensors.parameters() if isinstance(module_or_tensors, Module) else module_or_tensors
    return [t.data if isinstance(t, Tensor) else t for t in tensors]


def _unique_nbytes(arrays) -> int:
    return int(sum(nbytes for _, _, nbytes in {_region(a) for a in arrays if a is not None}))


# ----------------------------------------------------------------------------- static sizes


def parameter_bytes(module_or_tensors) -> int:
    """Bytes of the parameters of a Module (or of an iterable of Tensors/arrays), each
    array once."""
    return _unique_nbytes(_arrays(module_or_tensors))


def gradient_bytes(module_or_tensors) -> int:
    """Bytes of the ``.grad`` arrays of a Module's parameters (or of an iterable of
    Tensors); parameters without a gradient (None) count 0."""
    tensors = module_or_tensors.parameters() if isinstance(module_or_tensors, Module) else module_or_tensors
    return _unique_nbytes([t.grad for t in tensors])


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of the arrays an optimizer keeps besides the parameters: every NumPy/CuPy
    array found in its attributes, their lists, tuples and dicts (SGD's momentum
    ``velocity``, an Adam's moments, master weights), and in the optimizer it wraps, if any
    (an attribute with a ``step`` method: ``ZeroRedundancyOptimizer.optim``), each array once.
    The parameters (Tensors) and other objects (a flat layout that only describes sizes) are
    not looked into."""
    found, stack, seen = [], [vars(optimizer)], set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif hasattr(obj, "__array_interface__") or hasattr(obj, "__cuda_array_interface__"):
            found.append(obj)
        elif not isinstance(obj, Tensor) and callable(getattr(obj, "step", None)) and hasattr(obj, "__dict__"):
            stack.append(vars(obj))  # a wrapped optimizer
    return _unique_nbytes(found)


def device_memory_bytes():
    """Bytes in use in CuPy's default memory pool on the current GPU (what CuPy has handed
    out to arrays, ``cupy.get_default_memory_pool().used_bytes()``), or None when CuPy or a
    GPU is missing."""
    if not backend.cuda_available():
        return None
    import cupy  # noqa: PLC0415 (optional dependency; present when cuda_available())

    return int(cupy.get_default_memory_pool().used_bytes())


# ----------------------------------------------------------------------------- held arrays


def _note_parameters(ctx, parameters):
    """Add the owners of the arrays of ``ctx``'s Parameter inputs to ``parameters`` ({id: array})."""
    for p in getattr(ctx, "parents", ()):
        if isinstance(p, Parameter):
            owner = _base(p.data)
            parameters[id(owner)] = owner


def _saved_by(ctx, parameters):
    """{region: array} of the arrays ``ctx`` holds for backward: what it saved and its
    inputs' arrays, leaving out the arrays of Parameters and their views (``weight.T``): the
    owners in ``parameters``, to which this op's Parameter inputs are added first."""
    _note_parameters(ctx, parameters)
    parents = getattr(ctx, "parents", ())
    regions = {}
    for array in (*(getattr(ctx, "saved", ()) or ()), *(p.data for p in parents)):
        if hasattr(array, "nbytes") and hasattr(array, "dtype"):
            region = _region(array)
            if region[0] not in parameters:
                regions[region] = array
    return regions


def saved_bytes(*outputs: Tensor) -> int:
    """Bytes that the graphs below ``outputs`` hold for their backward now: the arrays their
    ops saved and their inputs' arrays, each once (the rules of the module docstring; views of
    one array, such as the micro-batches of a mini-batch, count it once). 0 for tensors
    without a graph. Raises RuntimeError when a graph was freed by a backward."""
    return contexts_bytes(node._ctx for output in outputs for node in output._topological_order()
                          if node._ctx is not None)


def contexts_bytes(contexts) -> int:
    """Bytes held by these op contexts (what they saved and their inputs' arrays, each once,
    Parameters left out): :func:`saved_bytes` for a list of ops rather than a graph, e.g. the
    ops whose weight gradients a zero-bubble W pass still has to compute."""
    contexts = list(contexts)
    parameters, regions = {}, {}
    for ctx in contexts:  # every Parameter first: an op may hold a view of one made deeper down
        _note_parameters(ctx, parameters)
    for ctx in contexts:
        regions.update(_saved_by(ctx, parameters))
    return int(sum(nbytes for _, _, nbytes in regions))


class MemoryTracker:
    """Live and peak bytes of the arrays held for backward while it runs (see :func:`track`).

    Attributes (bytes, ints):
        live_bytes: held now by ops recorded while tracking (and not yet freed): what they
            saved and their inputs' arrays, Parameters left out (module docstring).
        peak_bytes: the largest ``live_bytes`` seen.
        live_by_op, live_by_module: ``live_bytes`` split by the first op that held each array
            (its Function's name: ``"Linear"``, ``"Tanh"``, ``"CheckpointFunction"``...) and by the
            innermost module that ran it (its dotted name, as ``named_parameters``; ops run
            outside the tracked module go to ``OUTSIDE_MODULES``).
        peak_by_op, peak_by_module: the same split at the moment of the peak.
        device_peak_bytes: CuPy's pool at its largest, sampled at each save and free, when
            the arrays are on a GPU; None otherwise.
        saves: how many recorded ops held at least one array.

    Ops recorded before the tracker started are not seen: start it before the forward.
    """

    def __init__(self, module=None):
        self.module = module
        self.live_bytes = self.peak_bytes = self.saves = 0
        self.live_by_op, self.live_by_module = defaultdict(int), defaultdict(int)
        self.peak_by_op, self.peak_by_module = {}, {}
        self.device_peak_bytes = None
        self._arrays = {}  # region -> [array, nbytes, number of contexts holding it, op, module]
        self._contexts = {}  # id(ctx) -> (its regions, finalizer)
        self._parameters = {}  # id -> array: the Parameters' arrays seen as op inputs
        self._restore = []

    # called by tensor.py (Function.apply and Context.release), in the tracking thread
    def saved(self, ctx):
        regions = _saved_by(ctx, self._parameters)
        if not regions:
            return
        op = ctx.fn.__name__
        stack = getattr(_module_names, "stack", None)
        where = stack[-1] if stack else OUTSIDE_MODULES
        for region, array in regions.items():
            entry = self._arrays.get(region)
            if entry is None:
                entry = self._arrays[region] = [array, region[2], 0, op, where]
                self._add(entry, +1)
            entry[2] += 1
        # A graph dropped without a backward frees its arrays too: the finalizer tells us.
        self._contexts[id(ctx)] = (tuple(regions), weakref.finalize(ctx, self._forget, id(ctx)))
        self.saves += 1
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self.peak_by_op, self.peak_by_module = dict(self.live_by_op), dict(self.live_by_module)
        self._sample_device(next(iter(regions.values())))

    def released(self, ctx):
        record = self._contexts.get(id(ctx))
        if record is not None:
            record[1].detach()
            self._forget(id(ctx))

    def _forget(self, ctx_id):
        keys, _ = self._contexts.pop(ctx_id, ((), None))
        for key in keys:
            entry = self._arrays[key]
            entry[2] -= 1
            if entry[2] == 0:
                del self._arrays[key]
                self._add(entry, -1)

    def _add(self, entry, sign):
        _, nbytes, _, op, where = entry
        self.live_bytes += sign * nbytes
        self.live_by_op[op] += sign * nbytes
        self.live_by_module[where] += sign * nbytes

    def _sample_device(self, array):
        if backend.device_of(array) == "cuda":
            used = device_memory_bytes()
            self.device_peak_bytes = max(self.device_peak_bytes or 0, used)

    # the context manager
    def __enter__(self):
        tensor.add_memory_observer(self)
        if self.module is not None:
            self._label_modules(self.module)
        return self

    def __exit__(self, *exc):
        tensor.remove_memory_observer(self)
        for module, forward in reversed(self._restore):
            if forward is None:
                object.__delattr__(module, "forward")
            else:
                object.__setattr__(module, "forward", forward)
        self._restore = []
        for _, finalizer in self._contexts.values():
            finalizer.detach()
        return False

    def _label_modules(self, root):
        """Wrap each submodule's forward (for the block only) so ops know who ran them."""
        todo, seen = [("", root)], set()
        while todo:
            name, module = todo.pop()
            if id(module) in seen:
                continue
            seen.add(id(module))
            self._restore.append((module, module.__dict__.get("forward")))
            object.__setattr__(module, "forward", _labelled(module.forward, name or type(module).__name__))
            todo.extend((f"{name}.{child}" if name else child, m) for child, m in module._modules.items())

    def __repr__(self):
        return f"MemoryTracker(live_bytes={self.live_bytes}, peak_bytes={self.peak_bytes}, saves={self.saves})"


_module_names = threading.local()  # per thread: the names of the tracked modules now running


def _labelled(forward, name):
    def run(*inputs):
        stack = _module_names.__dict__.setdefault("stack", [])
        stack.append(name)
        try:
            return forward(*inputs)
        finally:
            stack.pop()
    return run


def track(module=None) -> MemoryTracker:
    """Count the arrays held for backward during a block: ``with memory.track() as t: ...``.

    Args:
        module: optional ``nn.Module`` whose submodules label the ops they run (for
            ``live_by_module`` / ``peak_by_module``); its ``forward`` methods are wrapped
            for the block only.

    Returns a :class:`MemoryTracker` (live and peak bytes, per op and per module). Only
    ops run by this thread are counted (simulated ranks are threads, and each counts its
    own). Trackers nest.
    """
    if module is not None and not isinstance(module, Module):
        raise TypeError(f"memory.track: module must be an nn.Module or None, got {type(module).__name__}")
    return MemoryTracker(module)
