"""Mixed precision training: low-precision compute, float32 master weights, loss scaling.

Micikevicius et al., "Mixed Precision Training" (ICLR 2018), in PyTorch's modern form
(``torch.autocast`` + ``torch.amp.GradScaler``):

- The parameters stay float32: they *are* the master weights, and the optimizer updates
  them in float32 (a tiny update ``lr * g`` added to a float16 weight would round away).
- Inside :class:`autocast` the matrix products (``functions.linear``, ``functions.matmul``:
  the ops with a one-line hook, ``autocast_dtype()``) cast their inputs to float16 or bfloat16
  through a differentiable :func:`cast` and compute the way tensor cores do: inputs rounded to
  the low dtype, products summed in a wider format (float64 here, float32 on a tensor core:
  :data:`ACCUMULATE` says why), the output rounded to the low dtype
  (:func:`autocast_op`). The elementwise ops that follow (bias, ReLU) then run in the dtype they
  receive; the loss (``cross_entropy``, ``log_softmax``: autocast's float32 list) casts its
  input back to float32. Backward mirrors it: each activation gradient is rounded to the low
  dtype, and :func:`cast`'s backward hands the float32 parameters float32 gradients that were
  computed in low precision. That rounding is what makes float16 gradients underflow to 0.
- :class:`GradScaler` multiplies the loss by S before backward, so small gradients land in
  float16's range, divides the gradients by S before the step, skips the step when a gradient
  is inf or NaN, and (dynamic scaling) halves S after an overflow and doubles it after
  ``growth_interval`` good steps.

bfloat16 (the ``ml_dtypes`` package) has float32's 8 exponent bits, so float32's range, and
8 significant bits instead of float16's 11 (:func:`finfo`, :func:`format_table`): it needs no
loss scaling. NumPy has no fast float16 matmul and none at all for bfloat16; the emulation
"round the inputs, multiply and add in float64, round the output" is faithful, fast and the same
on every CPU. CuPy cannot hold bfloat16 arrays on a GPU: asking for bf16 on cuda raises ValueError.

Longer than 400 lines: autocast, the loss scaler and the float formats they round to are taught as
one idea (chapter 11), each needing the others' definitions.
"""
from __future__ import annotations

import math
import threading

import numpy as np

from minidist import backend
from minidist.collectives import all_reduce
from minidist.tensor import Function, Tensor

FLOAT32 = np.dtype(np.float32)
FLOAT16 = np.dtype(np.float16)
PRECISIONS = ("fp32", "fp16", "bf16")
LOSS_SCALES = ("dynamic", "none")  # or a number > 0: static loss scaling
_NAMES = {"fp32": FLOAT32, "float32": FLOAT32, "fp16": FLOAT16, "float16": FLOAT16, "half": FLOAT16,
          "bf16": "bfloat16", "bfloat16": "bfloat16"}


# bfloat16 comes from ml_dtypes, which takes most of a second of CPU to import (it registers a
# dozen float formats with NumPy): more than NumPy itself, paid by every rank of every job. So it
# is imported the first time bfloat16 is asked for, and ``BFLOAT16`` is a lazy module attribute.
def bfloat16() -> np.dtype:
    """bfloat16 as a NumPy dtype (``ml_dtypes.bfloat16``, imported on first use)."""
    import ml_dtypes  # noqa: PLC0415 (a second to import: only when bfloat16 is used)

    return np.dtype(ml_dtypes.bfloat16)


def is_bfloat16(dtype) -> bool:
    """Whether ``dtype`` (a NumPy dtype) is bfloat16, without importing ml_dtypes (an array
    cannot be bfloat16 unless it was imported)."""
    return getattr(dtype, "name", None) == "bfloat16"


def __getattr__(name):  # PEP 562: precision.BFLOAT16, made on first use
    if name == "BFLOAT16":
        return bfloat16()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
_state = threading.local()  # per thread: the simulator runs each rank in a thread


def resolve_dtype(dtype) -> np.dtype:
    """The NumPy dtype of ``dtype``: "fp32", "fp16", "bf16" (or "float32", "float16",
    "bfloat16"), np.float16, ml_dtypes.bfloat16, np.float32 or their np.dtype. Raises
    ValueError for anything else (float64 included: it is no training precision here)."""
    if isinstance(dtype, str) and dtype.lower() in _NAMES:
        resolved = _NAMES[dtype.lower()]
        return bfloat16() if resolved == "bfloat16" else resolved
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved not in (FLOAT32, FLOAT16) and not is_bfloat16(resolved):
        raise ValueError(f"unknown precision {dtype!r}: use one of {', '.join(PRECISIONS)} "
                         "(or np.float32, np.float16, ml_dtypes.bfloat16)")
    return resolved


def finfo(dtype) -> dict:
    """What a floating-point format can hold (``np.finfo``; ``ml_dtypes.finfo`` for bfloat16):
    ``{"name", "bits", "exponent_bits", "mantissa_bits" (stored, without the implicit 1),
    "max", "smallest_normal", "smallest_subnormal", "eps" (the gap after 1.0)}`` as Python
    numbers. ``dtype`` as :func:`resolve_dtype` takes it (float64 too, for comparison)."""
    import ml_dtypes  # noqa: PLC0415 (see bfloat16())

    dt = np.dtype(np.float64) if dtype in ("fp64", "float64", np.float64) else resolve_dtype(dtype)
    info = ml_dtypes.finfo(dt)
    return {"name": str(dt), "bits": dt.itemsize * 8, "exponent_bits": int(info.nexp),
            "mantissa_bits": int(info.nmant), "max": float(info.max), "smallest_normal": float(info.smallest_normal),
            "smallest_subnormal": float(info.smallest_subnormal), "eps": float(info.eps)}


def format_table(dtypes=("fp32", "fp16", "bf16")) -> str:
    """A text table of :func:`finfo` for ``dtypes``, one row per format."""
    rows = [finfo(d) for d in dtypes]
    head = f"{'format':<9}{'bits':>5}{'exp':>5}{'mant':>5}{'max':>12}{'min normal':>12}{'min subnorm':>13}{'eps':>11}"
    lines = [head]
    for r in rows:
        lines.append(f"{r['name']:<9}{r['bits']:>5}{r['exponent_bits']:>5}{r['mantissa_bits']:>5}{r['max']:>12.3g}"
                     f"{r['smallest_normal']:>12.3g}{r['smallest_subnormal']:>13.3g}{r['eps']:>11.3g}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# autocast
# ---------------------------------------------------------------------------------------


def autocast_dtype() -> np.dtype | None:
    """The low dtype of the innermost :class:`autocast` of this thread (float16 or bfloat16),
    or None outside autocast (or inside ``autocast("fp32")``). The ops' hook."""
    return getattr(_state, "dtype", None)


class autocast:  # mirrors torch.autocast
    """Context manager: inside, matrix products run in ``dtype`` (tensor-core emulation),
    losses in float32 (module docstring). ``torch.autocast(device_type, dtype, enabled)``.

    Args:
        dtype: "fp16", "bf16" or "fp32" (or np.float16, ml_dtypes.bfloat16, np.float32); fp32
            (or ``enabled=False``) turns autocast off inside the block.
        device: "cpu" or "cuda", where the tensors live; bf16 on cuda raises ValueError (CuPy
            has no bfloat16 arrays: use fp16 on a GPU).
        enabled: False makes the block a no-op region (autocast off).

    Nests (the innermost wins) and is per thread; a fresh object per ``with`` is cheapest.
    Within the outermost block each parameter is cast once (a cache, as torch.autocast's): the
    micro-batches of a pipeline step share one low-precision copy of each weight.
    """

    def __init__(self, dtype="fp16", device: str = "cpu", enabled: bool = True):
        low = resolve_dtype(dtype)
        if is_bfloat16(low) and device == "cuda":
            raise ValueError("bf16 cannot run on cuda here: CuPy has no bfloat16 arrays; use --precision fp16 on a "
                             "GPU, or bf16 on the cpu")
        self.dtype = low if enabled and low != FLOAT32 else None
        self._previous = []

    def __enter__(self):
        self._previous.append((autocast_dtype(), getattr(_state, "cache", None)))
        _state.dtype = self.dtype
        if getattr(_state, "cache", None) is None:
            _state.cache = {}  # (id(array), dtype) -> (array, its cast): the parameters' casts, this block
        return self

    def __exit__(self, *exc):
        _state.dtype, _state.cache = self._previous.pop()


class Cast(Function):
    """A differentiable dtype conversion: forward ``a.astype(dtype)`` (round to nearest even),
    backward casts the gradient back to ``a``'s dtype, so a float32 parameter cast to float16
    receives a float32 gradient (computed in float16). ``Tensor.astype`` is not differentiable."""

    @staticmethod
    def forward(ctx, a, dtype, cached=None):
        if is_bfloat16(dtype) and backend.get_array_module(a) is not np:
            raise ValueError("bfloat16 arrays cannot live on a GPU with CuPy; use float16 on cuda")
        ctx.source = a.dtype
        return a.astype(dtype) if cached is None else cached

    @staticmethod
    def backward(ctx, grad):
        return (grad.astype(ctx.source),)


def cast(tensor: Tensor, dtype) -> Tensor:
    """``tensor`` converted to ``dtype`` (:func:`resolve_dtype`'s names) through :class:`Cast`,
    or ``tensor`` itself when it already has that dtype."""
    dtype = resolve_dtype(dtype)
    if tensor.dtype == dtype:
        return tensor
    cache = getattr(_state, "cache", None)
    if cache is None or not (tensor.is_leaf and tensor.requires_grad):
        return Cast.apply(tensor, dtype=dtype)
    key = (id(tensor.data), dtype)
    if key not in cache or cache[key][0] is not tensor.data:  # the array is kept, so its id is not reused
        cache[key] = (tensor.data, tensor.data.astype(dtype))
    return Cast.apply(tensor, dtype=dtype, cached=cache[key][1])


# The width the emulated tensor core adds its products up in before rounding to the low dtype.
# A real fp16/bf16 tensor core accumulates in float32, in an order of its own, and is itself not
# bit-reproducible across hardware. Summed in float32 BLAS here, the sum would depend on which
# OpenBLAS kernel the CPU picked (each adds in its own order), and a last-bit difference flips the
# 16-bit rounding of an output now and then: a training run (chapter 11) would then end elsewhere on
# another CPU. In float64 every product of two 16-bit numbers is exact (22 or 16 significant bits),
# nearly every sum of them is exact too, and an inexact one is off by about 2^-52 of itself, so two
# orders round it to different 16-bit numbers only when it lies that close to a rounding boundary:
# the emulation is reproducible across CPUs, which the tensor core it imitates is not. (issue 36)
ACCUMULATE = np.dtype(np.float64)
_tensor_core_ops: dict = {}


def _tensor_core(op):
    """``op`` (a matrix-product Function) as a tensor core runs it: the inputs (already in the
    low dtype) are widened exactly (to :data:`ACCUMULATE`, float64: see there why not float32),
    ``op``'s own forward and backward compute in that width, and every result is rounded to the
    low dtype (the incoming gradient first too: a gradient has its tensor's dtype). The saved
    arrays are the low-precision inputs (widened again in backward), as a float16 kernel keeps
    them: half of float32's bytes."""
    if op not in _tensor_core_ops:
        def forward(ctx, *arrays, **options):
            ctx.low = arrays[0].dtype
            wide = [a.astype(ACCUMULATE) for a in arrays]
            out = op.forward(ctx, *wide, **options).astype(ctx.low)
            low = {id(w): a for w, a in zip(wide, arrays)}  # keep the low-precision inputs, not their copies
            ctx.saved = tuple(low.get(id(a), a) for a in getattr(ctx, "saved", ()))
            return out

        def backward(ctx, grad):  # the output's gradient in the output's dtype, as PyTorch's autograd keeps it
            ctx.saved = tuple(a.astype(ACCUMULATE) if a.dtype == ctx.low else a for a in ctx.saved)
            grads = op.backward(ctx, grad.astype(ctx.low).astype(ACCUMULATE))
            grads = grads if isinstance(grads, tuple) else (grads,)
            return tuple(None if g is None else g.astype(ctx.low) for g in grads)

        _tensor_core_ops[op] = type(f"TensorCore{op.__name__}", (op,), {
            "forward": staticmethod(forward), "backward": staticmethod(backward), "__doc__": _tensor_core.__doc__})
    return _tensor_core_ops[op]


def autocast_op(op, *tensors, **options) -> Tensor:
    """Run the matrix-product Function ``op`` (``functions.Linear``, ``functions.MatMul``) on
    ``tensors`` in the current autocast dtype: each input cast to it (:func:`cast`), then the
    tensor-core emulation (round inputs, products summed in float64, round the output). The output has
    the low dtype. Called by ``functions.linear``/``matmul`` when :func:`autocast_dtype` is set."""
    low = autocast_dtype()
    if low is None:
        return op.apply(*tensors, **options)
    return _tensor_core(op).apply(*[cast(t, low) for t in tensors], **options)


def autocast_float32(tensor: Tensor) -> Tensor:
    """Inside autocast, ``tensor`` cast to float32 (the losses' input: autocast's float32 list);
    outside, ``tensor`` unchanged."""
    if autocast_dtype() is None or tensor.dtype == FLOAT32:
        return tensor
    return Cast.apply(tensor, dtype=FLOAT32)


# ---------------------------------------------------------------------------------------
# Loss scaling
# ---------------------------------------------------------------------------------------


class GradScaler:
    """Loss scaling (Micikevicius et al. 2018, section 3.2; ``torch.amp.GradScaler``'s API).

    Use::

        scaler.scale(loss).backward()   # gradients of S * loss
        scaler.step(optimizer)          # unscale, skip if any gradient is inf/NaN, else step
        scaler.update()                 # adjust S

    Args:
        init_scale: the first S (> 0).
        growth_factor (> 1), backoff_factor (in (0, 1)), growth_interval (>= 1): dynamic scaling
            multiplies S by ``backoff_factor`` after a step with a non-finite gradient and by
            ``growth_factor`` after ``growth_interval`` consecutive good steps.
        enabled: False makes every method a pass-through (``step`` just steps): fp32, bf16.
        dynamic: False is static loss scaling: S stays ``init_scale``. A step with a non-finite
            gradient is still skipped (one lost step beats inf/NaN written into the float32
            master weights, which would end training); it is counted in ``skipped_steps``.

    Counters: ``steps`` (calls to :meth:`step`), ``skipped_steps`` (of those, skipped).
    Raises FloatingPointError from :meth:`update` when dynamic scaling has halved S below
    ``MIN_SCALE``: the gradients are non-finite at any scale (training diverged).
    """

    MIN_SCALE = 2.0 ** -24

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, dynamic: bool = True):
        if not (math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"GradScaler: init_scale must be a finite number > 0, got {init_scale}")
        if not growth_factor > 1 or not 0 < backoff_factor < 1:
            raise ValueError(f"GradScaler: need growth_factor > 1 and 0 < backoff_factor < 1, got {growth_factor} "
                             f"and {backoff_factor}")
        if int(growth_interval) != growth_interval or growth_interval < 1:
            raise ValueError(f"GradScaler: growth_interval must be an integer >= 1, got {growth_interval}")
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.enabled, self.dynamic = int(growth_interval), bool(enabled), bool(dynamic)
        self._scale, self._growth_tracker = float(init_scale), 0
        self.steps = self.skipped_steps = 0
        self._found_inf = {}  # id(optimizer) -> bool, since the last update()

    def is_enabled(self) -> bool:
        """Whether this scaler scales at all."""
        return self.enabled

    def get_scale(self) -> float:
        """The current scale S (1.0 when disabled)."""
        return self._scale if self.enabled else 1.0

    def scale(self, loss: Tensor) -> Tensor:
        """``loss * S`` (a Tensor, differentiable), or ``loss`` when disabled."""
        return loss * self._scale if self.enabled else loss

    def unscale_(self, optimizer, comm=None) -> bool:
        """Divide the gradients of ``optimizer.params`` by S in place (float32) and note whether
        any is inf or NaN; returns that. Call it once per step, before clipping or
        :meth:`step`. ``comm``: ranks that each hold part of the model (pipeline stages) and
        must agree on skipping: the flag is all-reduced (max) over it. Raises RuntimeError when
        called twice before :meth:`update`."""
        if not self.enabled:
            return False
        if id(optimizer) in self._found_inf:
            raise RuntimeError("unscale_() was already called on this optimizer since the last update()")
        inverse = 1.0 / self._scale
        found = False
        for p in optimizer.params:
            if p.grad is None:
                continue
            xp = backend.get_array_module(p.grad)
            found = found or not bool(xp.isfinite(p.grad).all())
            p.grad *= p.grad.dtype.type(inverse)
        if comm is not None and comm.Get_size() > 1:
            found = bool(all_reduce(comm, np.array([float(found)]), op="max", validate=False)[0] > 0)
        self._found_inf[id(optimizer)] = found
        return found

    def step(self, optimizer, comm=None) -> bool:
        """Unscale (if :meth:`unscale_` was not called) and run ``optimizer.step()`` unless a
        gradient is inf or NaN. Returns whether it stepped. ``comm``: as :meth:`unscale_`."""
        if not self.enabled:
            optimizer.step()
            return True
        if id(optimizer) not in self._found_inf:
            self.unscale_(optimizer, comm)
        self.steps += 1
        if self._found_inf[id(optimizer)]:
            self.skipped_steps += 1
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        """Adjust S after the step (dynamic scaling only) and forget this step's flags."""
        if not self.enabled:
            return
        found = any(self._found_inf.values())
        self._found_inf = {}
        if not self.dynamic:
            return
        if found:
            self._scale *= self.backoff_factor
            self._growth_tracker = 0
            if self._scale < self.MIN_SCALE:
                raise FloatingPointError(f"GradScaler: the loss scale fell to {self._scale:g}: the gradients are inf "
                                         "or NaN at any scale, training diverged (try a smaller --lr)")
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._scale *= self.growth_factor
                self._growth_tracker = 0

    def state_dict(self) -> dict:
        """Everything :meth:`load_state_dict` restores (Python numbers): for checkpoints."""
        return {"scale": self._scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "growth_tracker": self._growth_tracker,
                "enabled": self.enabled, "dynamic": self.dynamic, "steps": self.steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict`. Raises ValueError for a missing key or a scaler of
        another kind (enabled or dynamic differ: the run's --loss-scale changed)."""
        missing = sorted(set(self.state_dict()) - set(state))
        if missing:
            raise ValueError(f"GradScaler.load_state_dict: missing keys {missing}")
        if bool(state["enabled"]) != self.enabled or bool(state["dynamic"]) != self.dynamic:
            raise ValueError(f"GradScaler.load_state_dict: the saved scaler is enabled={state['enabled']}, "
                             f"dynamic={state['dynamic']}, this one enabled={self.enabled}, dynamic={self.dynamic}: "
                             "resume with the same --precision and --loss-scale")
        self._scale, self._growth_tracker = float(state["scale"]), int(state["growth_tracker"])
        self.growth_factor, self.backoff_factor = float(state["growth_factor"]), float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self.steps, self.skipped_steps = int(state["steps"]), int(state["skipped_steps"])

    def describe(self) -> str:
        """`` loss_scale=S skipped=K`` for a per-epoch line ("" when disabled)."""
        return f"  loss_scale={self.get_scale():g}  skipped_steps={self.skipped_steps}" if self.enabled else ""


def default_loss_scale(precision: str) -> str:
    """The loss scaling a precision gets without ``--loss-scale``: "dynamic" for fp16 (its
    5 exponent bits underflow), "none" for bf16 (float32's range) and fp32."""
    return "dynamic" if resolve_dtype(precision) == FLOAT16 else "none"


def grad_scaler_for(precision: str, loss_scale=None) -> GradScaler:
    """The :class:`GradScaler` of ``train --precision P --loss-scale L``: L "dynamic"
    (init 2**16, torch's defaults), "none" (disabled), a number > 0 (static scaling) or None
    (:func:`default_loss_scale`). Raises ValueError for another L."""
    loss_scale = default_loss_scale(precision) if loss_scale is None else loss_scale
    if loss_scale == "dynamic":
        return GradScaler()
    if loss_scale == "none":
        return GradScaler(enabled=False)
    try:
        value = float(loss_scale)
    except (TypeError, ValueError):
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"loss scale must be 'dynamic', 'none' or a number > 0, got {loss_scale!r}")
    return GradScaler(init_scale=value, dynamic=False)


def figures(precision: str, scaler: GradScaler | None) -> dict:
    """The figures a ``train`` run prints for its precision: {} for fp32, else ``precision``
    and, when ``scaler`` scales, the final ``loss_scale`` and ``skipped_steps``."""
    if resolve_dtype(precision) == FLOAT32:
        return {}
    out = {"precision": precision}
    if scaler is not None and scaler.is_enabled():
        out.update(loss_scale=f"{scaler.get_scale():g}", skipped_steps=scaler.skipped_steps)
    return out


def wire_view(array):
    """``array`` as MPI can send it: a bfloat16 array viewed as uint16 (the same bytes; MPI has
    no bfloat16 datatype), any other array unchanged. Sender and receiver both use it."""
    return array.view(np.uint16) if is_bfloat16(array.dtype) else array


def dtype_from_char(char: str) -> np.dtype:
    """The dtype whose ``np.dtype(...).char`` is ``char``; also bfloat16's "E", which
    ``np.dtype`` does not parse (ml_dtypes registers it under its name only)."""
    return bfloat16() if char == "E" else np.dtype(char)  # "E": ml_dtypes' char for bfloat16
