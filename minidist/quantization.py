"""Int8 post-training quantization for inference: symmetric per-channel weights, dynamic
per-tensor activations, integer matrix products.

A float tensor ``x`` is stored as int8 codes ``q`` and a float32 ``scale`` with
``x ~ q * scale`` (Jacob et al., "Quantization and Training of Neural Networks for Efficient
Integer-Arithmetic-Only Inference", CVPR 2018, eq. 1, with the zero point 0: *symmetric*
quantization, as Krishnamoorthi, "Quantizing deep convolutional networks for efficient
inference: a whitepaper", 2018, section 2.2, recommends for weights).

- The scale maps the largest magnitude to 127: ``scale = max|x| / 127`` and
  ``q = round(x / scale)``, so q lies in [-127, 127] (-128 is left out, which keeps the range
  symmetric and ``-q`` representable). Rounding to the nearest code makes the round-trip
  error ``|x - q * scale|`` at most ``scale / 2`` per element: that is the whole error budget.
- *Per channel* (one scale per output row of a weight matrix, whitepaper section 2.3): a row
  of small weights is not crushed by one large weight elsewhere in the matrix.
- *Dynamic per tensor* for activations: their range is not known before inference, so the
  scale is measured on each input as it arrives (PyTorch's ``quantize_dynamic`` idea: weights
  quantized once ahead of time, activations on the fly, no calibration data).

A quantized linear layer then computes ``y = x @ W.T + b`` as::

    y[i, j] = (sum_k qx[i, k] * qw[j, k]) * sx * sw[j] + b[j]

The sum is of int8 x int8 products accumulated in int32 (exact: each product is at most
127^2 = 16,129 in magnitude, so in_features up to 133,144 cannot overflow), and the float work
is one multiply per output. On hardware with int8 units (x86 VNNI, ARM dot-product, GPU
tensor cores) that is where the speed comes from; NumPy has no integer BLAS, so here the int8
product is usually *slower* than the float32 one (see benchmarks/bench_quantization.py). The
memory saving is real everywhere: a weight takes 1 byte instead of 4.
"""
from __future__ import annotations

import copy

import numpy as _np  # dtype names and host-side checks only

from minidist import backend, nn
from minidist.tensor import Tensor

QMAX = 127  # symmetric int8 range [-QMAX, QMAX]
# Largest in_features whose int32 accumulation of int8 x int8 products cannot overflow.
MAX_IN_FEATURES = (2**31 - 1) // (QMAX * QMAX)


def _check_float(x, who: str):
    """The raw array of ``x`` (a Tensor or an array); TypeError unless floating, ValueError
    for NaN or infinity (they have no int8 code; a silent wrong scale would follow)."""
    x = x.data if isinstance(x, Tensor) else x
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(f"{who}: expected a NumPy/CuPy array or a Tensor, got {type(x).__name__}")
    if not _np.issubdtype(x.dtype, _np.floating):
        raise TypeError(f"{who}: expected a floating array (float16/32/64), got dtype {x.dtype}; "
                        "to dequantize int8 codes use dequantize(q, scale)")
    xp = backend.get_array_module(x)
    if x.size and not bool(xp.isfinite(x).all()):
        raise ValueError(f"{who}: the array holds NaN or infinity, which have no int8 code; "
                         "find where they come from before quantizing")
    return x


def _normalize_axis(axis, ndim: int, who: str) -> int:
    if isinstance(axis, bool) or not isinstance(axis, (int, _np.integer)):
        raise TypeError(f"{who}: axis must be an int, got {axis!r}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{who}: axis {axis} is out of range for an array of {ndim} dimension(s) "
                         f"(use -{ndim} .. {ndim - 1})")
    return int(axis) % ndim


# The largest max|x| a float32 scale can map to QMAX: beyond it max|x| / 127 overflows to inf.
MAX_MAGNITUDE = float(_np.finfo(_np.float32).max) * QMAX


def _scale_for(amax, xp, who: str):
    """float32 scale(s) mapping ``amax`` to QMAX; an all-zero channel gets scale 1 (its codes
    are 0 whatever the scale, and 1 keeps the division finite). The scale is at least float32's
    smallest normal number: a subnormal scale would be rounded so coarsely that max|x| / scale
    could exceed 127.5 and the clip would break the scale / 2 bound. Raises ValueError when
    ``amax`` exceeds MAX_MAGNITUDE (finite float64 values whose scale float32 cannot hold: the
    scale would be inf, the codes 0, and dequantizing would give NaN)."""
    amax = amax.astype(_np.float64)
    largest = float(amax.max()) if amax.size else 0.0
    if largest > MAX_MAGNITUDE:
        raise ValueError(f"{who}: max |x| = {largest:g} needs a scale of {largest / QMAX:g}, beyond what a float32 "
                         f"scale holds (3.4e+38): int8 codes with a float32 scale represent magnitudes at most "
                         f"{MAX_MAGNITUDE:.3g}; rescale the values first")
    scale = xp.maximum(amax / QMAX, float(_np.finfo(_np.float32).tiny))
    return xp.where(amax > 0, scale, 1.0).astype(_np.float32)


def _codes(x, scale, xp):
    """``clip(round(x / scale), -QMAX, QMAX)`` as int8, computed in float64 so the division
    adds no error beyond the rounding (rint: halves to even)."""
    ratio = x.astype(_np.float64) / scale.astype(_np.float64)
    return xp.clip(xp.rint(ratio), -QMAX, QMAX).astype(_np.int8)


def quantize_per_channel(w, axis: int = 0):
    """Symmetric int8 quantization with one scale per slice along ``axis``.

    Args:
        w: float array (NumPy or CuPy) or Tensor, any shape with ``ndim >= 1``; for a
            ``Linear`` weight (out_features, in_features), ``axis=0`` gives one scale per
            output feature.
        axis: the channel axis (negative counts from the end).

    Returns ``(q, scale)``: ``q`` int8 of ``w``'s shape with values in [-127, 127];
    ``scale`` float32 of shape ``(w.shape[axis],)``, ``max |w|`` over the channel divided by
    127 (1.0 for an all-zero channel). ``dequantize(q, scale, axis)`` is within ``scale / 2``
    of ``w`` elementwise. Unlike ``torch.quantize_per_channel``, which takes the scales as
    arguments, this computes them (as a min-max observer would; zero points are all 0).

    Raises TypeError for a non-float array or a non-int axis, ValueError for an axis out of
    range, values that are NaN or infinite, or a channel whose max |w| exceeds MAX_MAGNITUDE
    (about 4.3e40: its scale would overflow float32).
    Source: Krishnamoorthi 2018, sections 2.2-2.3; Jacob et al. 2018, eq. 1.
    """
    w = _check_float(w, "quantize_per_channel")
    if w.ndim == 0:
        raise ValueError("quantize_per_channel: a 0-d array has no channel axis; use quantize_per_tensor")
    axis = _normalize_axis(axis, w.ndim, "quantize_per_channel")
    xp = backend.get_array_module(w)
    channels = w.shape[axis]
    rows = xp.moveaxis(xp.abs(w), axis, 0).reshape(channels, -1) if w.size else None
    amax = rows.max(axis=1) if w.size else xp.zeros(channels, dtype=w.dtype)
    scale = _scale_for(amax, xp, "quantize_per_channel")
    shape = [1] * w.ndim
    shape[axis] = -1
    return _codes(w, scale.reshape(shape), xp), scale


def quantize_per_tensor(x):
    """Dynamic symmetric int8 quantization with one scale for the whole tensor (activations).

    x: float array (NumPy or CuPy) or Tensor, any shape. Returns ``(q, scale)``: ``q`` int8 of
    ``x``'s shape in [-127, 127], ``scale`` a 0-d float32 array (same device) equal to
    ``max |x| / 127`` (1.0 when x is all zeros or empty); ``|x - q * scale| <= scale / 2``.
    "Dynamic": the scale is measured on this very tensor, as ``torch.ao.quantization.
    quantize_dynamic`` does for a layer's input (torch uses uint8 with a zero point there; we
    keep int8 symmetric so one integer product serves weights and inputs).

    Raises TypeError for a non-float input, ValueError for NaN or infinity, or a max |x| beyond
    MAX_MAGNITUDE (about 4.3e40: the scale would overflow float32).
    Source: Krishnamoorthi 2018, section 2.2 (symmetric) and 3.1 (dynamic ranges).
    """
    x = _check_float(x, "quantize_per_tensor")
    xp = backend.get_array_module(x)
    amax = xp.abs(x).max() if x.size else xp.zeros((), dtype=x.dtype)
    scale = _scale_for(xp.asarray(amax), xp, "quantize_per_tensor")
    return _codes(x, scale, xp), scale


def dequantize(q, scale, axis: int | None = None):
    """float32 values ``q * scale`` of int8 codes.

    Args:
        q: int8 array (NumPy or CuPy), any shape.
        scale: float scale(s): a scalar or 0-d array for per-tensor codes (``axis=None``), or a
            1-D array of ``q.shape[axis]`` elements for per-channel codes.
        axis: the channel axis of per-channel codes; None for per-tensor.

    Returns a float32 array of ``q``'s shape on ``q``'s device.
    Raises TypeError when ``q`` is not int8, ValueError when ``scale``'s shape does not fit
    ``q`` and ``axis`` (e.g. per-channel scales passed without their axis).
    """
    if not hasattr(q, "dtype") or q.dtype != _np.int8:
        raise TypeError(f"dequantize: expected int8 codes, got {getattr(q, 'dtype', type(q).__name__)}; "
                        "quantize a float array first (quantize_per_tensor or quantize_per_channel)")
    xp = backend.get_array_module(q)
    scale = xp.asarray(scale, dtype=_np.float32)
    if axis is None:
        if scale.size != 1:
            raise ValueError(f"dequantize: {scale.size} scales given with axis=None; per-channel codes need "
                             "the axis they were quantized along (dequantize(q, scale, axis=0))")
        return q.astype(_np.float32) * scale.reshape(())
    axis = _normalize_axis(axis, q.ndim, "dequantize")
    if scale.shape != (q.shape[axis],):
        raise ValueError(f"dequantize: per-channel scale has shape {scale.shape}, expected "
                         f"({q.shape[axis]},) for axis {axis} of codes shaped {q.shape}")
    shape = [1] * q.ndim
    shape[axis] = -1
    return q.astype(_np.float32) * scale.reshape(shape)


class QuantizedLinear(nn.Module):
    """An inference-only ``Linear`` with int8 weights (``torch.ao.nn.quantized.dynamic.Linear``).

    Holds ``qweight`` (int8, (out_features, in_features)), ``weight_scale`` (float32,
    (out_features,), one per output row) and ``bias`` (float32 (out_features,) or None); none
    of them is a Parameter, so ``parameters()`` is empty and nothing here trains.

    ``forward(x)``: x a Tensor or float array (..., in_features) -> Tensor float32
    (..., out_features), not tracked by autograd. The input is quantized per tensor on the fly
    (one scale for the whole batch, so a sample's output depends slightly on the largest value
    in its batch), multiplied by the int8 weights accumulating in int32, and rescaled:
    ``(qx @ qw.T) * sx * sw + bias``.

    Build one with :meth:`from_float` (or :func:`quantize_dynamic` for a whole model).
    Raises ValueError when in_features exceeds MAX_IN_FEATURES (the int32 sum could overflow)
    or the input's last axis is not in_features.
    Source: Jacob et al. 2018, section 2.2-2.3 (integer matrix product, int32 accumulators).
    """

    def __init__(self, qweight, weight_scale, bias=None):
        super().__init__()
        if getattr(qweight, "dtype", None) != _np.int8 or qweight.ndim != 2:
            raise TypeError("QuantizedLinear: qweight must be a 2-D int8 array (out_features, in_features); "
                            "build one from a float layer with QuantizedLinear.from_float(linear)")
        out_features, in_features = qweight.shape
        if in_features > MAX_IN_FEATURES:
            raise ValueError(f"QuantizedLinear: in_features={in_features} could overflow the int32 accumulator "
                             f"(at most {MAX_IN_FEATURES}); split the layer")
        if tuple(weight_scale.shape) != (out_features,):
            raise ValueError(f"QuantizedLinear: weight_scale has shape {tuple(weight_scale.shape)}, expected "
                             f"({out_features},), one per output feature")
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise ValueError(f"QuantizedLinear: bias has shape {tuple(bias.shape)}, expected ({out_features},)")
        xp = backend.get_array_module(qweight)
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.qweight = qweight
        self.weight_scale = xp.asarray(weight_scale, dtype=_np.float32)
        self.bias = None if bias is None else xp.asarray(bias, dtype=_np.float32)
        self.training = False

    @classmethod
    def from_float(cls, linear: nn.Linear) -> QuantizedLinear:
        """The int8 version of a float ``nn.Linear``: weight quantized per output row, bias
        kept in float32. The float layer is not changed. Raises TypeError for another module."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"QuantizedLinear.from_float: expected an nn.Linear, got {type(linear).__name__}")
        qweight, scale = quantize_per_channel(linear.weight.data, axis=0)
        bias = None if linear.bias is None else linear.bias.data.astype(_np.float32)
        return cls(qweight, scale, bias)

    def weight(self):
        """The dequantized float32 weight (out_features, in_features): what the layer multiplies by."""
        return dequantize(self.qweight, self.weight_scale, axis=0)

    def forward(self, x):
        x = x.data if isinstance(x, Tensor) else x
        if x.shape[-1:] != (self.in_features,):
            raise ValueError(f"QuantizedLinear: input has shape {tuple(x.shape)}, its last axis must be "
                             f"in_features={self.in_features}")
        xp = backend.get_array_module(x)
        qx, x_scale = quantize_per_tensor(x)
        lead = x.shape[:-1]
        # int8 x int8 -> int32: widen first (NumPy/CuPy multiply int8 in int8 and would wrap).
        acc = xp.matmul(qx.reshape(-1, self.in_features).astype(_np.int32), self.qweight.T.astype(_np.int32))
        y = acc.astype(_np.float32) * (x_scale * self.weight_scale)
        if self.bias is not None:
            y += self.bias
        return Tensor(y.reshape(*lead, self.out_features))

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype=int8"


def quantize_dynamic(model: nn.Module, qconfig_spec=None, dtype: str = "int8") -> nn.Module:
    """A new inference-only model with every ``nn.Linear`` replaced by a :class:`QuantizedLinear`
    (``torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)``).

    Args:
        model: a Module (e.g. ``nn.Sequential`` of Linear and activations), or one ``nn.Linear``.
        qconfig_spec: the module types to quantize; None or ``{nn.Linear}`` (the only one we know).
        dtype: ``"int8"`` (or ``"qint8"``), the only one supported.

    Returns a deep copy in eval mode; the original model is unchanged (torch's default
    ``inplace=False``). Raises ValueError for another dtype, TypeError for a module type in
    ``qconfig_spec`` other than nn.Linear.
    """
    if dtype not in ("int8", "qint8"):
        raise ValueError(f"quantize_dynamic: dtype {dtype!r} is not supported; use 'int8'")
    spec = set(qconfig_spec) if qconfig_spec is not None else {nn.Linear}
    unknown = [t for t in spec if t is not nn.Linear]
    if unknown:
        raise TypeError(f"quantize_dynamic: only nn.Linear can be quantized, got {unknown}")
    if isinstance(model, nn.Linear):
        return QuantizedLinear.from_float(model)
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_dynamic: expected an nn.Module, got {type(model).__name__}")
    qmodel = copy.deepcopy(model).eval()
    for module in list(qmodel.modules()):
        for name, child in list(module._modules.items()):
            if isinstance(child, nn.Linear):  # in place in the dict: Sequential runs its modules in dict order
                module._modules[name] = QuantizedLinear.from_float(child)
                object.__setattr__(module, name, module._modules[name])
    return qmodel


def model_bytes(model: nn.Module) -> int:
    """Bytes of a model's weights: its parameters plus every array a module holds as an
    attribute (a QuantizedLinear's int8 codes, scales and bias), each array once. For a float
    model this equals ``minidist.memory.parameter_bytes``; an int8 model of large layers is
    about 4x smaller than its float32 original (plus 4 bytes per output row for the scales)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_bytes: expected an nn.Module, got {type(model).__name__}")
    seen, total = set(), 0
    for module in model.modules():
        arrays = [p.data for p in module._parameters.values()]
        arrays += [v for v in vars(module).values() if hasattr(v, "nbytes") and hasattr(v, "dtype")
                   and not isinstance(v, Tensor)]
        for a in arrays:
            if id(a) not in seen:
                seen.add(id(a))
                total += int(a.nbytes)
    return total
