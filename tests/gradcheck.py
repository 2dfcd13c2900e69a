"""Numerical gradient checking: the oracle for every op's backward.

For a function f of tensors x_1..x_k with output y, pick a random cotangent v shaped
like y and compare, for each input, the engine's gradient of the scalar <v, f(x)>
(``y.backward(v)``) with central differences

    d<v, f(x)>/dx_i[j] ~ (<v, f(x + h e_j)> - <v, f(x - h e_j)>) / 2h,

in float64 (h = 1e-6, error O(h^2) plus rounding O(eps/h)). Contracting with a random v
instead of summing the output catches errors that cancel in a plain sum (the needle
course's check uses the same trick).
"""
import numpy as np

from minidist import backend
from minidist.course.checks import numerical_gradient
from minidist.tensor import Tensor


def numerical_grads(fn, arrays, v, h=1e-6):
    """Central differences of <v, fn(arrays)> (minidist.course.checks.numerical_gradient)."""
    return numerical_gradient(
        lambda xs: float((backend.to_numpy(fn(*[Tensor(x) for x in xs]).data) * v).sum()), arrays, eps=h)


def check_gradients(fn, *arrays, device="cpu", seed=0, rtol=1e-5, atol=1e-7):
    """Assert that the engine's gradients of ``fn`` match central differences.
    ``arrays`` are float64 NumPy arrays (copied); returns the analytic gradients."""
    arrays = [np.array(a, dtype=np.float64) for a in arrays]
    xp = backend.module_for(device)
    inputs = [Tensor(xp.asarray(a), requires_grad=True) for a in arrays]
    out = fn(*inputs)
    v = np.random.default_rng(seed).standard_normal(out.shape)
    out.backward(xp.asarray(v))
    numeric = numerical_grads(lambda *ts: fn(*[t.to(device) for t in ts]), arrays, v)
    analytic = []
    for i, (t, g_num) in enumerate(zip(inputs, numeric)):
        g = np.zeros_like(arrays[i]) if t.grad is None else backend.to_numpy(t.grad)
        assert g.shape == arrays[i].shape, f"input {i}: grad shape {g.shape} != input shape {arrays[i].shape}"
        np.testing.assert_allclose(g, g_num, rtol=rtol, atol=atol, err_msg=f"gradient of input {i}")
        analytic.append(g)
    return analytic
