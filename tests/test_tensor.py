"""Backward semantics: accumulation, freeing, calling twice, no_grad, deep graphs."""
import threading

import numpy as np
import pytest

import minidist.functions as F
from minidist import Tensor, is_grad_enabled, no_grad


def test_gradients_accumulate_into_leaves():
    x = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    (x * 3).sum().backward()
    (x * 3).sum().backward()
    np.testing.assert_array_equal(x.grad, [6.0, 6.0])


def test_second_backward_through_freed_graph_raises():
    x = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    y = (x * x).sum()
    y.backward()
    with pytest.raises(RuntimeError, match="already freed"):
        y.backward()
    np.testing.assert_array_equal(x.grad, [2.0, 4.0])  # the failed call changed nothing


def test_shared_subgraph_freed_by_first_backward():
    x = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    h = x.exp()
    a, b = (h * 2).sum(), (h * 3).sum()
    a.backward()
    with pytest.raises(RuntimeError, match="retain_graph"):
        b.backward()


def test_retain_graph_allows_a_second_backward_that_adds():
    x = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    y = (x * x).sum()
    y.backward(retain_graph=True)
    y.backward()
    np.testing.assert_array_equal(x.grad, [4.0, 8.0])


def test_interior_state_is_freed():
    x = Tensor(np.ones(3), requires_grad=True)
    h = x * 2
    y = h.sum()
    ctx = h._ctx
    y.backward()
    assert not hasattr(ctx, "saved") and ctx.parents == ()


def test_only_leaves_keep_grad():
    x = Tensor(np.ones(3), requires_grad=True)
    h = x * 2
    h.sum().backward()
    assert h.grad is None and x.grad is not None


def test_no_grad_records_nothing_and_is_per_thread():
    x = Tensor(np.ones(3), requires_grad=True)
    seen = {}

    def other_thread():
        seen["enabled"] = is_grad_enabled()

    with no_grad():
        y = x * 2
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
    assert not y.requires_grad and y._ctx is None
    assert seen["enabled"] is True
    assert is_grad_enabled()
    with pytest.raises(RuntimeError, match="does not require grad"):
        y.sum().backward()


def test_no_grad_as_decorator():
    @no_grad()
    def f(t):
        return t * 2

    assert not f(Tensor(np.ones(2), requires_grad=True)).requires_grad


def test_deep_chain_needs_no_recursion():
    x = Tensor(np.array([0.5]), requires_grad=True)
    y = x
    for _ in range(20_000):
        y = y * 1.0
    y.sum().backward()
    np.testing.assert_array_equal(x.grad, [1.0])


def test_backward_order_is_deterministic():
    def run():
        rng = np.random.default_rng(0)
        w = Tensor(rng.standard_normal((5, 5)).astype(np.float32), requires_grad=True)
        h = Tensor(rng.standard_normal((7, 5)).astype(np.float32))
        for _ in range(6):
            h = (h @ w).tanh() + h
        h.sum().backward()
        return w.grad

    assert run().tobytes() == run().tobytes()


def test_leaf_grads_never_alias():
    a = Tensor(np.ones(3), requires_grad=True)
    b = Tensor(np.ones(3), requires_grad=True)
    (a + b).sum().backward()
    a.grad *= 10  # in-place change to one leaf's gradient (as gradient averaging does)
    np.testing.assert_array_equal(b.grad, [1.0, 1.0, 1.0])
    c = Tensor(np.ones((2, 3)), requires_grad=True)
    c.sum().backward()  # the gradient of a sum is a read-only broadcast view: copied
    c.grad += 1
    np.testing.assert_array_equal(c.grad, np.full((2, 3), 2.0))


def test_explicit_grad_for_non_scalar():
    x = Tensor(np.arange(3.0), requires_grad=True)
    y = x * 2
    y.backward(np.array([1.0, 0.0, -1.0]))
    np.testing.assert_array_equal(x.grad, [2.0, 0.0, -2.0])


def test_dtype_is_preserved_float32():
    x = Tensor(np.ones((2, 3), dtype=np.float32), requires_grad=True)
    y = ((x * 2.5 + 1) / 3.0 - 0.5) ** 2
    assert y.dtype == np.float32
    y.mean().backward()
    assert x.grad.dtype == np.float32


def test_array_on_the_left_defers_to_tensor():
    x = Tensor(np.ones(3), requires_grad=True)
    y = np.full(3, 2.0) * x
    assert isinstance(y, Tensor)
    y.sum().backward()
    np.testing.assert_array_equal(x.grad, [2.0, 2.0, 2.0])


def test_detach_item_numpy_repr():
    x = Tensor(np.array([[1.5]]), requires_grad=True)
    d = x.detach()
    assert not d.requires_grad and d.data is x.data
    assert x.item() == 1.5 and x.numpy() is x.data
    assert "requires_grad=True" in repr(x)
    with pytest.raises(ValueError, match="one element"):
        Tensor(np.ones(2)).item()


def test_integer_tensor_cannot_require_grad():
    with pytest.raises(TypeError, match="floating-point"):
        Tensor(np.arange(3), requires_grad=True)


def test_softmax_is_stable_for_large_logits():
    out = F.log_softmax(Tensor(np.array([[1000.0, 0.0, -1000.0]])))
    assert np.isfinite(out.data[0, :2]).all() and out.data[0, 0] == 0.0


def test_post_accumulate_grad_hook_fires_once_per_backward_with_the_full_grad():
    x = Tensor(np.ones(2), requires_grad=True)
    seen = []
    handle = x.register_post_accumulate_grad_hook(lambda t: seen.append(t.grad.copy()))
    (x * 2 + x * 3).sum().backward()  # two paths: one hook call, after both are summed
    assert len(seen) == 1 and list(seen[0]) == [5.0, 5.0]
    handle.remove()
    (x * 2).sum().backward()
    assert len(seen) == 1
    with pytest.raises(RuntimeError, match="leaf"):
        (x * 2).register_post_accumulate_grad_hook(print)


def test_backward_input_then_weights_equals_one_backward_bitwise():
    # Zero-bubble's split backward: I pass (input gradient only), then W pass (weights).
    from minidist import nn
    rng = np.random.default_rng(0)
    net = nn.Sequential(nn.Linear(5, 7, rng=1, dtype="float64"), nn.Tanh(), nn.Linear(7, 3, rng=2, dtype="float64"))
    x = Tensor(rng.normal(size=(4, 5)), requires_grad=True)
    g = rng.normal(size=(4, 3))
    net(x).backward(g)
    expected = [p.grad.copy() for p in net.parameters()]
    expected_x = x.grad.copy()
    net.zero_grad()
    x.grad = None
    work = net(x).backward_input(g, [x])
    assert np.array_equal(x.grad, expected_x)
    assert all(p.grad is None for p in net.parameters())  # weights wait for the W pass
    assert len(work) == 2  # one record per Linear
    work.run()
    assert np.array_equal(x.grad, expected_x)  # the W pass does not add to the input again
    for p, e in zip(net.parameters(), expected):
        assert np.array_equal(p.grad, e)
    with pytest.raises(RuntimeError, match="already computed"):
        work.run()
