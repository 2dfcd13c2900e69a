"""The differentiable ops: each forward sits a few lines above its derivative.

An op is a :class:`Function` subclass with two static methods on *raw arrays*:

- ``forward(ctx, *arrays, **options)`` computes the output and saves, on ``ctx``,
  whatever the derivative will need (``ctx.save_for_backward(...)`` for arrays, plain
  attributes for shapes and options);
- ``backward(ctx, grad)`` receives dLoss/dOutput and returns dLoss/dInput for each
  input, in order (None for inputs that are not differentiable).

``Function.apply`` wraps the raw call: it unwraps Tensors, runs ``forward``, and, when
gradients are being recorded, attaches the context to the output so
``Tensor.backward`` can find it (the design of minitorch's ``tensor_functions.py`` and
PyTorch's ``torch.autograd.Function``). Every array operation goes through
``xp = get_array_module(...)`` or the arrays' own methods, so the same code runs on
NumPy and CuPy.

Broadcasting follows NumPy. An op whose inputs were broadcast hands back gradients of
the broadcast shape; :func:`unbroadcast` sums them back to each input's shape (the
derivative of a copy is a sum). Shapes that cannot be broadcast raise
:class:`ShapeError` naming the op and both shapes before anything is computed.

The lowercase functions at the bottom (``add``, ``matmul``, ``cross_entropy``, ...) are
the public functional API; ``minidist.nn.functional`` is this module.

Longer than 400 lines: every differentiable op of the engine, forward beside derivative, grouped by
family (elementwise, reductions, matrix products, shapes, losses); one file so Tensor's operators
are installed in one place and a learner finds any op by scrolling, not by guessing its file. The
fused transformer ops are apart, in ``attention``.
"""
from __future__ import annotations

import builtins  # sum, max and pow are redefined below as ops
import math

import numpy as _np  # shapes only (tuples); array math always goes through xp

from minidist import attention, backend, precision, recompute
from minidist.tensor import Function, Tensor, as_tensors


class ShapeError(ValueError):
    """Inputs whose shapes an op cannot combine; the message names the op and shapes."""


def unbroadcast(grad, shape):
    """Sum ``grad`` (shaped like a broadcast result) back to ``shape``.

    Broadcasting copies an input along new leading axes and along axes of length 1;
    the gradient of a copy is the sum of the copies' gradients, so we sum over exactly
    those axes. Returns ``grad`` itself when no axis was broadcast.
    """
    if grad.shape == tuple(shape):
        return grad
    extra = grad.ndim - len(shape)
    if extra > 0:
        grad = grad.sum(axis=tuple(range(extra)))
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    if stretched:
        grad = grad.sum(axis=stretched, keepdims=True)
    return grad


def _broadcast_shape(op, a, b):
    """The broadcast shape of two tensors, or ShapeError naming ``op``."""
    if a.shape == b.shape:
        return a.shape
    try:
        return _np.broadcast_shapes(a.shape, b.shape)
    except ValueError:
        raise ShapeError(
            f"{op}: shapes {a.shape} and {b.shape} cannot be broadcast together (NumPy rules: "
            "align from the right; each pair of sizes must be equal or one of them 1). "
            "Reshape one operand, e.g. x.reshape(-1, 1) for a column."
        ) from None


def _normalize_axes(axis, ndim):
    """``axis`` (None, int or tuple, negatives allowed) as a sorted tuple of axes."""
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    out = []
    for a in axes:
        if not -ndim <= a < builtins.max(ndim, 1):
            raise ShapeError(f"axis {a} is out of range for a tensor with {ndim} dimensions")
        out.append(a % ndim if ndim else 0)
    return tuple(sorted(out))


def _expand_reduced(grad, shape, axes, keepdims):
    """Broadcast the gradient of a reduction back to the input's shape."""
    xp = backend.get_array_module(grad)
    if not keepdims:
        grad = xp.expand_dims(grad, axes) if axes else grad
    return xp.broadcast_to(grad, shape)


# ---------------------------------------------------------------- elementwise, binary


class Add(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.shapes = a.shape, b.shape
        return a + b

    @staticmethod
    def backward(ctx, grad):
        return unbroadcast(grad, ctx.shapes[0]), unbroadcast(grad, ctx.shapes[1])


class Sub(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.shapes = a.shape, b.shape
        return a - b

    @staticmethod
    def backward(ctx, grad):
        return unbroadcast(grad, ctx.shapes[0]), unbroadcast(-grad, ctx.shapes[1])


class Mul(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved
        return unbroadcast(grad * b, a.shape), unbroadcast(grad * a, b.shape)


class Div(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a / b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved
        grad_a = grad / b
        return unbroadcast(grad_a, a.shape), unbroadcast(-grad_a * a / b, b.shape)


class Pow(Function):
    """``a ** p`` for a constant Python number ``p``: d/da = p · a^(p-1)."""

    @staticmethod
    def forward(ctx, a, exponent):
        ctx.save_for_backward(a)
        ctx.exponent = exponent
        return a**exponent

    @staticmethod
    def backward(ctx, grad):
        (a,) = ctx.saved
        p = ctx.exponent
        return (grad * p * a ** (p - 1),)


# ---------------------------------------------------------------- elementwise, unary


class Neg(Function):
    @staticmethod
    def forward(ctx, a):
        return -a

    @staticmethod
    def backward(ctx, grad):
        return (-grad,)


class Exp(Function):
    @staticmethod
    def forward(ctx, a):
        out = backend.get_array_module(a).exp(a)
        ctx.save_for_backward(out)  # d exp(a) / da = exp(a): keep the output
        return out

    @staticmethod
    def backward(ctx, grad):
        return (grad * ctx.saved[0],)


class Log(Function):
    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        return backend.get_array_module(a).log(a)

    @staticmethod
    def backward(ctx, grad):
        return (grad / ctx.saved[0],)


class ReLU(Function):
    @staticmethod
    def forward(ctx, a):
        out = backend.get_array_module(a).maximum(a, 0)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return (grad * (ctx.saved[0] > 0),)  # derivative 0 at a == 0, as PyTorch


class Tanh(Function):
    @staticmethod
    def forward(ctx, a):
        out = backend.get_array_module(a).tanh(a)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = ctx.saved[0]
        return (grad * (1 - out * out),)


class Sigmoid(Function):
    @staticmethod
    def forward(ctx, a):
        xp = backend.get_array_module(a)
        # 1/(1+e^-a) overflows for very negative a; tanh form is stable everywhere.
        out = 0.5 * (xp.tanh(0.5 * a) + 1)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = ctx.saved[0]
        return (grad * out * (1 - out),)


# ---------------------------------------------------------------- matrix products


class MatMul(Function):
    """``a @ b`` with NumPy's rules: 2-D, batched (leading axes broadcast), and 1-D
    operands (a vector is a row on the left, a column on the right).

    For C = A B: dA = dC Bᵀ and dB = Aᵀ dC; batch axes that were broadcast are summed.
    """

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    def backward(ctx, grad):
        xp = backend.get_array_module(grad)
        a, b = ctx.saved
        a2 = a[None, :] if a.ndim == 1 else a  # promote vectors to matrices...
        b2 = b[:, None] if b.ndim == 1 else b
        g = grad
        if b.ndim == 1:  # the column's axis first: for vector @ vector, g is 0-d
            g = xp.expand_dims(g, -1)
        if a.ndim == 1:
            g = xp.expand_dims(g, -2)
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = g @ xp.swapaxes(b2, -1, -2)
            grad_a = unbroadcast(grad_a[..., 0, :] if a.ndim == 1 else grad_a, a.shape)  # ...and back
        if ctx.needs_input_grad[1]:
            grad_b = xp.swapaxes(a2, -1, -2) @ g
            grad_b = unbroadcast(grad_b[..., 0] if b.ndim == 1 else grad_b, b.shape)
        return grad_a, grad_b


class Linear(Function):
    """``x @ weightᵀ + bias`` in one op (PyTorch's ``F.linear``): x (..., in),
    weight (out, in), bias (out,) or None. One node instead of three keeps the engine's
    bookkeeping small next to the two matrix products; gradients:
    dx = g W, dW = gᵀ x (summed over the batch), db = Σ g."""

    @staticmethod
    def forward(ctx, x, weight, bias=None):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        # (B, T, in) as one (B·T, in) matrix: one BLAS call instead of one per leading index
        out = x.reshape(-1, x.shape[-1]) @ weight.T
        if bias is not None:
            out += bias  # out is a fresh array: adding in place saves a temporary
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved
        needs_x, needs_w = ctx.needs_input_grad[:2]
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_x = (g2 @ weight).reshape(x.shape) if needs_x else None  # skipped for the input data
        grad_w = g2.T @ x.reshape(-1, x.shape[-1]) if needs_w else None
        grad_b = g2.sum(axis=0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


# ---------------------------------------------------------------- reductions


class Sum(Function):
    @staticmethod
    def forward(ctx, a, axis=None, keepdims=False):
        ctx.shape, ctx.axes, ctx.keepdims = a.shape, _normalize_axes(axis, a.ndim), keepdims
        return a.sum(axis=ctx.axes, keepdims=keepdims)

    @staticmethod
    def backward(ctx, grad):
        return (_expand_reduced(grad, ctx.shape, ctx.axes, ctx.keepdims),)


class Mean(Function):
    @staticmethod
    def forward(ctx, a, axis=None, keepdims=False):
        ctx.shape, ctx.axes, ctx.keepdims = a.shape, _normalize_axes(axis, a.ndim), keepdims
        ctx.count = int(_np.prod([a.shape[i] for i in ctx.axes]))
        return a.mean(axis=ctx.axes, keepdims=keepdims)

    @staticmethod
    def backward(ctx, grad):
        return (_expand_reduced(grad / ctx.count, ctx.shape, ctx.axes, ctx.keepdims),)


class Max(Function):
    """Maximum over axes. The gradient goes to the entries equal to the maximum, split
    evenly among ties (as ``torch.amax``), so it is the same whatever the order."""

    @staticmethod
    def forward(ctx, a, axis=None, keepdims=False):
        if a.size == 0:
            raise ShapeError(f"max: cannot reduce an empty tensor of shape {a.shape}")
        ctx.axes, ctx.keepdims = _normalize_axes(axis, a.ndim), keepdims
        out = a.max(axis=ctx.axes, keepdims=True)
        ctx.save_for_backward(a, out)
        return out if keepdims else out.reshape([n for i, n in enumerate(a.shape) if i not in ctx.axes])

    @staticmethod
    def backward(ctx, grad):
        a, out = ctx.saved
        mask = a == out
        share = mask / mask.sum(axis=ctx.axes, keepdims=True)
        if not ctx.keepdims:
            grad = backend.get_array_module(grad).expand_dims(grad, ctx.axes)
        return (share * grad,)


# ---------------------------------------------------------------- shape


class Reshape(Function):
    @staticmethod
    def forward(ctx, a, shape):
        ctx.shape = a.shape
        try:
            return a.reshape(shape)
        except ValueError:
            raise ShapeError(f"reshape: cannot reshape a tensor of shape {a.shape} ({a.size} elements) "
                             f"into {tuple(shape)}") from None

    @staticmethod
    def backward(ctx, grad):
        return (grad.reshape(ctx.shape),)


class Transpose(Function):
    @staticmethod
    def forward(ctx, a, axes=None):
        if axes is None:
            axes = tuple(reversed(range(a.ndim)))
        if sorted(ax % a.ndim for ax in axes) != list(range(a.ndim)):
            raise ShapeError(f"transpose: axes {tuple(axes)} are not a permutation of the {a.ndim} axes "
                             f"of shape {a.shape}")
        ctx.inverse = tuple(_np.argsort([ax % a.ndim for ax in axes]))
        return a.transpose(axes)

    @staticmethod
    def backward(ctx, grad):
        return (grad.transpose(ctx.inverse),)


class GetItem(Function):
    """``a[index]`` for ints, slices, None, Ellipsis, integer arrays and boolean masks.
    The gradient is zero except at the selected positions; an entry selected twice by
    an integer array gets both gradients added (``xp.add.at``, not ``=``)."""

    @staticmethod
    def forward(ctx, a, index):
        ctx.shape, ctx.dtype, ctx.index = a.shape, a.dtype, index
        return a[index]

    @staticmethod
    def backward(ctx, grad):
        xp = backend.get_array_module(grad)
        out = xp.zeros(ctx.shape, dtype=ctx.dtype)
        backend.scatter_add(out, ctx.index, grad)
        return (out,)


# ---------------------------------------------------------------- softmax and losses


class LogSoftmax(Function):
    """log softmax(a) = a - max - log Σ exp(a - max) (shifted by the max so exp cannot
    overflow). Backward: g - softmax(a) · Σ g, both along ``axis``."""

    @staticmethod
    def forward(ctx, a, axis=-1):
        xp = backend.get_array_module(a)
        shifted = a - a.max(axis=axis, keepdims=True)
        out = shifted - xp.log(xp.exp(shifted).sum(axis=axis, keepdims=True))
        ctx.save_for_backward(out)
        ctx.axis = axis
        return out

    @staticmethod
    def backward(ctx, grad):
        xp = backend.get_array_module(grad)
        out = ctx.saved[0]
        return (grad - xp.exp(out) * grad.sum(axis=ctx.axis, keepdims=True),)


class CrossEntropy(Function):
    """Mean negative log-likelihood of integer ``targets`` under softmax(``logits``),
    fused: logits (N, C) float, targets (N,) int in [0, C) or equal to ``ignore_index``
    (those rows count for nothing, neither in the sum nor in the mean's N). Forward and
    backward share the softmax: dLoss/dlogits = (softmax(logits) - onehot(targets)) / N
    on the rows kept, 0 on the rows ignored."""

    @staticmethod
    def forward(ctx, logits, targets, ignore_index=-100):
        xp = backend.get_array_module(logits)
        n = logits.shape[0]
        shifted = logits - logits.max(axis=1, keepdims=True)
        exp = xp.exp(shifted)
        total = exp.sum(axis=1, keepdims=True)
        ignored = targets == ignore_index
        kept = None if not ignored.any() else ~ignored  # None: the fast path, every row counts
        safe = targets if kept is None else xp.where(kept, targets, 0)
        picked = shifted[xp.arange(n), safe] - xp.log(total[:, 0])
        count = n if kept is None else int(kept.sum())
        exp /= total
        ctx.save_for_backward(exp, safe, kept)
        ctx.count = count
        if kept is not None:
            picked *= kept
        if n == 0:
            return xp.zeros((), dtype=logits.dtype)
        return -picked.sum() / count if count else xp.asarray(xp.nan, dtype=logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        probs, targets, kept = ctx.saved
        xp = backend.get_array_module(probs)
        n = probs.shape[0]
        out = probs.copy()
        out[xp.arange(n), targets] -= 1
        if kept is not None:
            out *= kept[:, None]
        out *= grad / builtins.max(ctx.count, 1)
        return out, None


# ================================================================ functional API


def add(a, b) -> Tensor:
    """Elementwise ``a + b`` with broadcasting. Raises ShapeError for shapes that
    cannot be broadcast."""
    a, b = as_tensors((a, b))
    _broadcast_shape("add", a, b)
    return Add.apply(a, b)


def sub(a, b) -> Tensor:
    """Elementwise ``a - b`` with broadcasting."""
    a, b = as_tensors((a, b))
    _broadcast_shape("sub", a, b)
    return Sub.apply(a, b)


def mul(a, b) -> Tensor:
    """Elementwise ``a * b`` with broadcasting."""
    a, b = as_tensors((a, b))
    _broadcast_shape("mul", a, b)
    return Mul.apply(a, b)


def div(a, b) -> Tensor:
    """Elementwise ``a / b`` with broadcasting (true division)."""
    a, b = as_tensors((a, b))
    _broadcast_shape("div", a, b)
    return Div.apply(a, b)


def pow(a, exponent) -> Tensor:  # mirrors torch.pow
    """``a ** exponent`` for a constant Python number ``exponent``. Raises TypeError
    for a Tensor exponent (not supported: write exp(b * log(a)))."""
    if isinstance(exponent, Tensor) or not isinstance(exponent, (int, float)):
        raise TypeError(f"pow: the exponent must be a Python int or float, got {type(exponent).__name__}; "
                        "for a tensor exponent write (b * a.log()).exp()")
    return Pow.apply(a, exponent=exponent)


def neg(a) -> Tensor:
    """``-a``."""
    return Neg.apply(a)


def exp(a) -> Tensor:
    """Elementwise e**a."""
    return Exp.apply(a)


def log(a) -> Tensor:
    """Elementwise natural logarithm (``-inf``/``nan`` for a <= 0, as NumPy)."""
    return Log.apply(a)


def relu(a) -> Tensor:
    """Elementwise max(a, 0)."""
    return ReLU.apply(a)


def tanh(a) -> Tensor:
    """Elementwise hyperbolic tangent."""
    return Tanh.apply(a)


def sigmoid(a) -> Tensor:
    """Elementwise 1 / (1 + e**-a), computed stably."""
    return Sigmoid.apply(a)


def matmul(a, b) -> Tensor:
    """Matrix product with NumPy's rules: (n, k) @ (k, m) -> (n, m); batched
    (..., n, k) @ (..., k, m) with broadcast batch axes; 1-D operands allowed.

    Raises:
        ShapeError: a 0-d operand, inner dimensions that differ, or batch axes that
            cannot be broadcast.
    """
    a, b = as_tensors((a, b))
    if a.ndim == 0 or b.ndim == 0:
        raise ShapeError(f"matmul: operands must have at least one dimension, got shapes {a.shape} and "
                         f"{b.shape}; use mul for scalars")
    k_a = a.shape[-1]
    k_b = b.shape[0] if b.ndim == 1 else b.shape[-2]
    if k_a != k_b:
        raise ShapeError(
            f"matmul: shapes {a.shape} and {b.shape} are not aligned: the last dimension of the "
            f"first ({k_a}) must equal the {'only' if b.ndim == 1 else 'second-to-last'} dimension "
            f"of the second ({k_b})"
        )
    if a.ndim > 2 and b.ndim > 2:
        try:
            _np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        except ValueError:
            raise ShapeError(f"matmul: batch dimensions of {a.shape} and {b.shape} cannot be broadcast") from None
    if precision.autocast_dtype() is not None:  # mixed precision: tensor-core emulation (minidist.precision)
        return precision.autocast_op(MatMul, a, b)
    return MatMul.apply(a, b)


def linear(x, weight, bias=None) -> Tensor:
    """``x @ weight.T + bias`` as one op: x (..., in_features), weight
    (out_features, in_features), bias (out_features,) or None -> (..., out_features).
    Raises ShapeError when the feature sizes disagree."""
    x, weight = as_tensors((x, weight))
    if x.ndim == 0 or weight.ndim != 2 or x.shape[-1] != weight.shape[1]:
        raise ShapeError(
            f"linear: input of shape {x.shape} does not fit weight of shape {weight.shape}: the input's "
            f"last dimension must be in_features = {weight.shape[-1] if weight.ndim else '?'}"
        )
    if bias is not None:
        (bias,) = as_tensors((bias,))
        if bias.shape != (weight.shape[0],):
            raise ShapeError(f"linear: bias has shape {bias.shape}, expected ({weight.shape[0]},)")
    inputs = (x, weight) if bias is None else (x, weight, bias)
    if precision.autocast_dtype() is not None:  # mixed precision: tensor-core emulation (minidist.precision)
        return precision.autocast_op(Linear, *inputs)
    return Linear.apply(*inputs)


def sum(a, axis=None, keepdims=False) -> Tensor:  # mirrors torch.sum
    """Sum over ``axis`` (None: all; int or tuple, negatives allowed)."""
    return Sum.apply(a, axis=axis, keepdims=keepdims)


def mean(a, axis=None, keepdims=False) -> Tensor:
    """Mean over ``axis`` (None: all; int or tuple, negatives allowed)."""
    return Mean.apply(a, axis=axis, keepdims=keepdims)


def max(a, axis=None, keepdims=False) -> Tensor:  # mirrors torch.max
    """Maximum over ``axis``; the gradient is shared evenly among tied maxima.
    Raises ShapeError for an empty tensor."""
    return Max.apply(a, axis=axis, keepdims=keepdims)


def reshape(a, shape) -> Tensor:
    """The same elements in a new shape (one entry may be -1). ShapeError if the
    number of elements differs."""
    return Reshape.apply(a, shape=tuple(shape) if not isinstance(shape, int) else (shape,))


def transpose(a, axes=None) -> Tensor:
    """Permute axes (None: reverse them, so a matrix is transposed)."""
    return Transpose.apply(a, axes=axes)


def getitem(a, index) -> Tensor:
    """``a[index]`` (ints, slices, None, Ellipsis, integer arrays, boolean masks;
    Tensors used as indices are unwrapped)."""
    if isinstance(index, Tensor):
        index = index.data
    elif isinstance(index, tuple):
        index = tuple(i.data if isinstance(i, Tensor) else i for i in index)
    return GetItem.apply(a, index=index)


def log_softmax(a, axis=-1) -> Tensor:
    """log(softmax(a)) along ``axis``, computed stably (in float32 under autocast)."""
    (a,) = as_tensors((a,))
    return LogSoftmax.apply(precision.autocast_float32(a), axis=axis)


def softmax(input, dim=-1) -> Tensor:  # mirrors torch.nn.functional.softmax(input, dim)
    """softmax along ``dim`` (an int, negatives allowed): exp(x - max) / Σ exp(x - max), one
    fused op (:class:`minidist.attention.Softmax`), stable for any finite input; in float32
    under ``precision.autocast``. Output: the input's shape, rows summing to 1.
    Raises ShapeError when ``dim`` is out of range."""
    (input,) = as_tensors((input,))
    (axis,) = _normalize_axes(dim, input.ndim)
    return attention.Softmax.apply(precision.autocast_float32(input), axis=axis)


def cross_entropy(logits, targets, ignore_index=-100) -> Tensor:
    """Mean cross-entropy of integer class ``targets`` under ``softmax(logits)``
    (**contract**; ``torch.nn.functional.cross_entropy`` with mean reduction).

    Args:
        logits: float Tensor of shape (N, C), unnormalised scores (a language model's
            (B, T, V) logits reshaped to (B·T, V)).
        targets: integer array or Tensor of shape (N,), each in [0, C) or ``ignore_index``.
        ignore_index: a target value whose rows are left out of the loss and of the mean's
            count, and get no gradient (torch's default -100; nanoGPT passes -1 for padding).

    Returns:
        A scalar Tensor (dtype of ``logits``; float32 under ``precision.autocast``); NaN when
        every row is ignored (0/0, as torch).

    Raises:
        ShapeError: logits not 2-D, or targets not of shape (N,).
        TypeError: targets are not integers.
        ValueError: a target outside [0, C) that is not ``ignore_index``.
    """
    (logits,) = as_tensors((logits,))
    xp = backend.get_array_module(logits.data)
    t = targets.data if isinstance(targets, Tensor) else xp.asarray(targets)
    if logits.ndim != 2:
        raise ShapeError(f"cross_entropy: logits must have shape (N, C), got {logits.shape}; reshape "
                         "(B, T, V) logits to (B*T, V) and the targets to (B*T,)")
    if t.shape != (logits.shape[0],):
        raise ShapeError(f"cross_entropy: targets must have shape ({logits.shape[0]},) to match logits "
                         f"{logits.shape}, got {t.shape}")
    if t.dtype.kind not in "iu":
        raise TypeError(f"cross_entropy: targets must be integer class indices, got dtype {t.dtype}; "
                        "use y.astype('int64')")
    num_classes = logits.shape[1]
    counted = t
    if t.size and (int(t.min()) < 0 or int(t.max()) >= num_classes):  # only then look for ignored rows
        counted = t[t != ignore_index]
    if counted.size and (int(counted.min()) < 0 or int(counted.max()) >= num_classes):
        raise ValueError(
            f"cross_entropy: targets must be in [0, {num_classes}) for logits with {num_classes} classes "
            f"(or equal ignore_index={ignore_index}); got values from {int(counted.min())} to {int(counted.max())}"
        )
    return CrossEntropy.apply(precision.autocast_float32(logits), Tensor(t), ignore_index=ignore_index)


def mse_loss(prediction, target) -> Tensor:
    """Mean squared error. ``prediction`` and ``target`` must have the same shape (no
    broadcasting here: (N, 1) against (N,) would silently make an (N, N) matrix).
    Raises ShapeError otherwise."""
    prediction, target = as_tensors((prediction, target))
    if prediction.shape != target.shape:
        raise ShapeError(f"mse_loss: prediction {prediction.shape} and target {target.shape} must have the same shape")
    diff = prediction - target
    return (diff * diff).mean()


# ---------------------------------------------------------------- the transformer's ops
# The fused Functions are in minidist.attention; these check the inputs and call them.


def embedding(input, weight) -> Tensor:  # mirrors torch.nn.functional.embedding(input, weight)
    """Rows of ``weight`` (V, C) at integer ``input`` (any shape) -> (*input.shape, C)
    (:class:`minidist.attention.Embedding`); a repeated index gets the sum of its rows' gradients.

    Raises:
        TypeError: ``input`` is not an integer array.
        ShapeError: ``weight`` is not 2-D.
        IndexError: an index outside [0, V), naming V.
    """
    (weight,) = as_tensors((weight,))
    xp = backend.get_array_module(weight.data)
    indices = input.data if isinstance(input, Tensor) else xp.asarray(input)
    if indices.dtype.kind not in "iu":
        raise TypeError(f"embedding: indices must be integers, got dtype {indices.dtype}; use idx.astype('int64')")
    if weight.ndim != 2:
        raise ShapeError(f"embedding: weight must have shape (num_embeddings, embedding_dim), got {weight.shape}")
    limit = weight.shape[0]
    if indices.size and (int(indices.min()) < 0 or int(indices.max()) >= limit):
        raise IndexError(f"embedding: indices must be in [0, {limit}) (num_embeddings = {limit}); got values "
                         f"from {int(indices.min())} to {int(indices.max())}")
    return attention.Embedding.apply(weight, indices=indices)


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5) -> Tensor:  # torch's signature
    """Layer normalisation over the trailing ``normalized_shape`` axes (Ba et al. 2016), one op
    (:class:`minidist.attention.LayerNorm`): (x - mean) / sqrt(var + eps) · weight + bias,
    the biased variance. In float32 under ``precision.autocast``.

    Args:
        input: float Tensor (..., *normalized_shape).
        normalized_shape: int or tuple, the trailing axes to normalise over.
        weight, bias: Tensors of shape ``normalized_shape``, or None.
        eps: added to the variance (> 0 keeps a constant row finite).

    Raises ShapeError when the input's trailing axes, the weight or the bias do not match.
    """
    (input,) = as_tensors((input,))
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape or input.shape[input.ndim - len(shape):] != shape or input.ndim < len(shape):
        raise ShapeError(f"layer_norm: normalized_shape {shape} must be the input's trailing axes; "
                         f"the input has shape {input.shape}")
    params = [p for p in (weight, bias) if p is not None]
    for p in as_tensors(params):
        if p.shape != shape:
            raise ShapeError(f"layer_norm: weight and bias must have shape {shape}, got {p.shape}")
    if weight is None and bias is not None:  # a bias alone: scale by constant ones
        weight = Tensor(backend.get_array_module(input.data).ones(shape, dtype=input.dtype))
    inputs = [precision.autocast_float32(input)] + as_tensors([p for p in (weight, bias) if p is not None])
    return attention.LayerNorm.apply(*inputs, ndim=len(shape), eps=eps)


def gelu(input, approximate="none") -> Tensor:  # mirrors torch.nn.functional.gelu
    """GELU(x) = x Φ(x) (Hendrycks & Gimpel 2016), elementwise, one op
    (:class:`minidist.attention.GELU`). ``approximate``: "none" (Φ through erf, exact) or
    "tanh" (GPT-2's approximation). Raises ValueError for any other value."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return attention.GELU.apply(input, approximate=approximate)


FLASH_MIN_SEQUENCE = 2048  # T and S from which scaled_dot_product_attention tiles (see its docstring)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 *, generator=None) -> Tensor:
    """softmax(query keyᵀ · scale + mask) value (Vaswani et al. 2017, eq. 1; torch's
    ``torch.nn.functional.scaled_dot_product_attention``), one fused op
    (:class:`minidist.attention.ScaledDotProductAttention`: it keeps one (T, S) array per head
    for backward, where composed ops would keep three or four).

    The rule, as torch picks its kernel: without ``attn_mask`` and dropout, and with T and S
    both >= ``FLASH_MIN_SEQUENCE`` (2048), the tiled op runs instead
    (:func:`minidist.attention.flash_attention`, tiles of ``attention.FLASH_BLOCK_SIZE``): the
    same result to rounding, O(T·d) bytes held instead of the (T, S) weights. Measured by
    ``benchmarks/bench_attention.py`` (causal, float32, one thread, heads of 16, 2,048 tokens a
    batch): tiled costs about 0.6 of dense at T = 512 and falls to 0.2-0.3 at T = 2048; at
    T = 256 it already costs 0.8, at T = 128 the two were within noise (0.85-1.04) and at T = 64
    dense was faster. The rule starts at 2048, where tiling is 4 to 5 times faster, not at 512
    where it already pays, so that every lesson and course check stays on the dense op: chapter
    13 measures the dense op's T² weights through this function up to T = 1,024 and its memory
    puzzle (``course.checks.transformer``) at 16 x 256 tokens; the default GPT's T is 64. Call
    :func:`minidist.attention.flash_attention` to tile at any length.

    Args:
        query: (B, H, T, d) float Tensor (any leading axes, the same for all three).
        key: (B, H, S, d); value: (B, H, S, e).
        attn_mask: None, a boolean array (True: may attend) or a float array added to the
            scores, broadcastable to (B, H, T, S); a constant (no gradient).
        dropout_p: probability of zeroing an attention weight (the rest scaled by 1/(1-p)),
            drawn from ``generator`` (a ``numpy.random.Generator``, required when > 0).
        is_causal: query i attends to keys 0..i only: the scores above the diagonal are set
            to -inf before the softmax.
        scale: multiplies the scores; default 1/sqrt(d).

    Returns (B, H, T, e), the query's dtype (float32 under ``precision.autocast``).

    Raises:
        ShapeError: fewer than 2 axes, leading axes that differ, d or S that disagree.
        ValueError: ``attn_mask`` together with ``is_causal``; ``dropout_p`` outside [0, 1) or
            > 0 without ``generator``.
    """
    query, key, value = as_tensors((query, key, value))
    if min(query.ndim, key.ndim, value.ndim) < 2 or not query.shape[:-2] == key.shape[:-2] == value.shape[:-2]:
        raise ShapeError(f"scaled_dot_product_attention: query {query.shape}, key {key.shape} and value "
                         f"{value.shape} must be (..., T, d), (..., S, d), (..., S, e) with the same leading axes")
    if query.shape[-1] != key.shape[-1] or key.shape[-2] != value.shape[-2]:
        raise ShapeError(f"scaled_dot_product_attention: query {query.shape} and key {key.shape} need the same d, "
                         f"key and value {value.shape} the same S")
    if attn_mask is not None and is_causal:
        raise ValueError("scaled_dot_product_attention: pass attn_mask or is_causal=True, not both (as torch)")
    if not 0 <= dropout_p < 1:
        raise ValueError(f"scaled_dot_product_attention: dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p > 0 and generator is None:
        raise ValueError("scaled_dot_product_attention: dropout_p > 0 needs generator= (a numpy.random.Generator, "
                         "e.g. an nn.Dropout's .generator), so the draws are reproducible")
    query, key, value = (precision.autocast_float32(t) for t in (query, key, value))
    xp = backend.get_array_module(query.data)
    mask = None
    if attn_mask is not None:
        mask = attn_mask.data if isinstance(attn_mask, Tensor) else xp.asarray(attn_mask)
        mask = mask if mask.dtype == bool else mask.astype(query.dtype)
        try:
            _np.broadcast_shapes(mask.shape, query.shape[:-1] + key.shape[-2:-1])
        except ValueError:
            raise ShapeError(f"scaled_dot_product_attention: attn_mask {mask.shape} does not broadcast to the "
                             f"scores {query.shape[:-1] + key.shape[-2:-1]}") from None
    keep = None
    if dropout_p > 0:
        recompute.note_random_draw(generator)  # a checkpointed segment replays the same draw
        shape = query.shape[:-1] + key.shape[-2:-1]
        keep = xp.asarray(((generator.random(shape) >= dropout_p) / (1.0 - dropout_p)).astype(query.dtype))
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    if mask is None and keep is None and min(query.shape[-2], key.shape[-2]) >= FLASH_MIN_SEQUENCE:
        return attention.FlashAttention.apply(query, key, value, scale=float(scale), is_causal=is_causal)
    return attention.ScaledDotProductAttention.apply(query, key, value, scale=float(scale), is_causal=is_causal,
                                                     mask=mask, keep=keep)


# ================================================================ Tensor's operators and methods
# Installed here rather than written in tensor.py, so that tensor.py never imports this file
# back: ``a + b`` on Tensors is ``add(a, b)``, ``a.sum()`` is ``sum(a)``, and so on.


def _shape_args(args):
    """``t.reshape(2, 3)`` and ``t.reshape((2, 3))`` mean the same, as in NumPy and PyTorch."""
    return args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args


_TENSOR_METHODS = {
    "__add__": add, "__radd__": lambda a, b: add(b, a),
    "__sub__": sub, "__rsub__": lambda a, b: sub(b, a),
    "__mul__": mul, "__rmul__": lambda a, b: mul(b, a),
    "__truediv__": div, "__rtruediv__": lambda a, b: div(b, a),
    "__pow__": pow, "__neg__": neg,
    "__matmul__": matmul, "__rmatmul__": lambda a, b: matmul(b, a),
    "__getitem__": getitem,
    "sum": sum, "mean": mean, "max": max,
    "reshape": lambda a, *shape: reshape(a, _shape_args(shape)),
    "transpose": lambda a, *axes: transpose(a, _shape_args(axes) or None),
    "T": property(lambda a: transpose(a, None)),
    "exp": exp, "log": log, "relu": relu, "tanh": tanh, "sigmoid": sigmoid, "log_softmax": log_softmax,
}
for _name, _method in _TENSOR_METHODS.items():
    setattr(Tensor, _name, _method)
