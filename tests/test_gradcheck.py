"""Every op's backward against central differences (float64, random cotangent),
including broadcast shapes drawn by hypothesis."""
import numpy as np
import pytest
from gradcheck import check_gradients
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import minidist.functions as F

rng = np.random.default_rng(1)


def r(*shape):
    return rng.standard_normal(shape)


def positive(*shape):
    return rng.uniform(0.5, 2.0, shape)


UNARY = {
    "neg": (lambda a: -a, r(3, 4)),
    "exp": (lambda a: a.exp(), r(3, 4)),
    "log": (lambda a: a.log(), positive(3, 4)),
    "relu": (lambda a: a.relu(), r(3, 4) + 0.05),  # away from the kink at 0
    "tanh": (lambda a: a.tanh(), r(3, 4)),
    "sigmoid": (lambda a: a.sigmoid(), r(3, 4)),
    "pow2": (lambda a: a**2, r(3, 4)),
    "pow_half": (lambda a: a**0.5, positive(3, 4)),
    "pow_neg": (lambda a: a**-1.5, positive(3, 4)),
    "sum_all": (lambda a: a.sum(), r(3, 4)),
    "sum_axis0": (lambda a: a.sum(axis=0), r(3, 4)),
    "sum_axes_keepdims": (lambda a: a.sum(axis=(0, 2), keepdims=True), r(2, 3, 4)),
    "sum_neg_axis": (lambda a: a.sum(axis=-1), r(2, 3, 4)),
    "mean_all": (lambda a: a.mean(), r(3, 4)),
    "mean_axis1_keepdims": (lambda a: a.mean(axis=1, keepdims=True), r(3, 4)),
    "max_all": (lambda a: a.max(), r(3, 4)),
    "max_axis1": (lambda a: a.max(axis=1), r(3, 4)),
    "max_axis0_keepdims": (lambda a: a.max(axis=0, keepdims=True), r(3, 4)),
    "reshape": (lambda a: a.reshape(4, 3) * F.Tensor(np.arange(12.0).reshape(4, 3), device=a.device), r(3, 4)),
    "reshape_minus1": (lambda a: a.reshape(-1), r(2, 3, 2)),
    "transpose_T": (lambda a: a.T, r(3, 4)),
    "transpose_axes": (lambda a: a.transpose(2, 0, 1), r(2, 3, 4)),
    "getitem_int": (lambda a: a[1], r(3, 4)),
    "getitem_slice": (lambda a: a[1:, ::2], r(3, 4)),
    "getitem_fancy_repeats": (lambda a: a[np.array([0, 2, 0, 0])], r(3, 4)),
    "getitem_pairs": (lambda a: a[np.array([0, 1, 2]), np.array([3, 3, 0])], r(3, 4)),
    "getitem_mask": (lambda a: a[np.array([True, False, True])], r(3, 4)),
    "getitem_none_ellipsis": (lambda a: a[None, ..., 1], r(3, 4)),
    "log_softmax": (lambda a: a.log_softmax(), r(3, 5)),
    "log_softmax_axis0": (lambda a: a.log_softmax(axis=0), r(3, 5)),
    "softmax": (lambda a: F.softmax(a), r(3, 5)),
    "cross_entropy": (lambda a: F.cross_entropy(a, np.array([0, 4, 2])), r(3, 5)),
    "mse_loss": (lambda a: F.mse_loss(a, F.Tensor(np.ones((3, 4)), device=a.device)), r(3, 4)),
}


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_ops(name, device):
    fn, a = UNARY[name]
    check_gradients(fn, a, device=device)


BINARY = {
    "add": (lambda a, b: a + b, r(3, 4), r(3, 4)),
    "sub": (lambda a, b: a - b, r(3, 4), r(3, 4)),
    "mul": (lambda a, b: a * b, r(3, 4), r(3, 4)),
    "div": (lambda a, b: a / b, r(3, 4), positive(3, 4)),
    "add_bias": (lambda a, b: a + b, r(3, 4), r(4)),
    "mul_column": (lambda a, b: a * b, r(3, 4), r(3, 1)),
    "div_row_by_column": (lambda a, b: a / b, r(1, 4), positive(3, 1)),
    "matmul_2d": (lambda a, b: a @ b, r(3, 4), r(4, 5)),
    "matmul_batched": (lambda a, b: a @ b, r(2, 3, 4), r(2, 4, 5)),
    "matmul_broadcast_batch": (lambda a, b: a @ b, r(2, 1, 3, 4), r(5, 4, 2)),
    "matmul_matrix_vector": (lambda a, b: a @ b, r(3, 4), r(4)),
    "matmul_vector_matrix": (lambda a, b: a @ b, r(4), r(4, 5)),
    "matmul_vector_batched": (lambda a, b: a @ b, r(4), r(2, 4, 5)),
    "matmul_vector_vector": (lambda a, b: a @ b, r(4), r(4)),
    "linear_no_bias": (lambda x, w: F.linear(x, w), r(3, 4), r(5, 4)),
    "linear_batched_input": (lambda x, w: F.linear(x, w), r(2, 3, 4), r(5, 4)),
}


@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_ops(name, device):
    fn, a, b = BINARY[name]
    check_gradients(fn, a, b, device=device)


def test_linear_with_bias(device):
    check_gradients(lambda x, w, b: F.linear(x, w, b), r(3, 4), r(5, 4), r(5), device=device)


def test_composite_mlp_loss(device):
    """A whole training step's graph: shared parameters, branches, broadcasting."""

    def fn(x, w1, b1, w2):
        h = (x @ w1 + b1).tanh()
        return F.cross_entropy(h @ w2 + h.sum(axis=1, keepdims=True) * 0.1, np.array([1, 0, 2, 1]))

    check_gradients(fn, r(4, 3), r(3, 5), r(5), r(5, 3), device=device)


def test_same_tensor_used_twice(device):
    check_gradients(lambda a: a * a + a, r(3, 4), device=device)


# Broadcasting: pairs of shapes that broadcast, drawn by hypothesis.
@settings(max_examples=40, deadline=None)
@given(shapes=hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=3, max_side=3),
       op=st.sampled_from(["add", "sub", "mul", "div"]))
def test_broadcasting_binary_ops(shapes, op):
    a_shape, b_shape = shapes.input_shapes
    a = rng.standard_normal(a_shape)
    b = rng.uniform(0.5, 2.0, b_shape)
    fn = {"add": lambda x, y: x + y, "sub": lambda x, y: x - y,
          "mul": lambda x, y: x * y, "div": lambda x, y: x / y}[op]
    grads = check_gradients(fn, a, b)
    assert grads[0].shape == a_shape and grads[1].shape == b_shape


@settings(max_examples=25, deadline=None)
@given(shape=hnp.array_shapes(min_dims=1, max_dims=3, max_side=4), data=st.data())
def test_reductions_over_any_axes(shape, data):
    axes = data.draw(st.lists(st.integers(0, len(shape) - 1), unique=True, max_size=len(shape)))
    axis = tuple(axes) if axes else None
    keepdims = data.draw(st.booleans())
    a = rng.standard_normal(shape)
    check_gradients(lambda t: t.sum(axis=axis, keepdims=keepdims), a)
    check_gradients(lambda t: t.mean(axis=axis, keepdims=keepdims), a)
    check_gradients(lambda t: t.max(axis=axis, keepdims=keepdims), a)


def test_gradcheck_catches_a_wrong_backward(monkeypatch):
    """The oracle can fail: a Tanh whose derivative forgets the square is caught."""
    monkeypatch.setattr(F.Tanh, "backward", staticmethod(lambda ctx, g: (g * (1 - ctx.saved[0]),)))
    with pytest.raises(AssertionError):
        check_gradients(lambda a: a.tanh(), r(3, 4))
