"""Memory accounting: bytes held for backward (checked against tracemalloc and hand counts),
parameters, gradients, optimizer state; the tracker's bookkeeping (per op, per module,
threads, graphs dropped without backward)."""
import gc
import threading
import tracemalloc

import numpy as np
import pytest

from minidist import backend, memory, nn, optim
from minidist.tensor import Tensor

B, W = 512, 64  # one activation: B * W * 8 bytes = 256 KiB (float64)
ACT = B * W * 8


def mlp(n=4):
    return nn.mlp([W] * (n + 1), nn.Tanh, rng=0, dtype="float64")  # Linear, Tanh, ..., Linear


def test_bytes_held_after_the_forward_agree_with_tracemalloc():
    """NumPy reports its allocations to tracemalloc: what the forward allocated and the
    graph still holds must be what the tracker counts (within the Python objects' bytes)."""
    model = mlp(4)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        with memory.track() as tracker:
            x = Tensor(np.random.default_rng(0).standard_normal((B, W)))  # allocated inside
            loss = model(x).sum()
            held = tracemalloc.get_traced_memory()[0] - before
            assert tracker.live_bytes == memory.saved_bytes(loss)
            # x, 4 pre-activations, 3 tanh outputs (the last Linear's output is the sum's input)
            assert tracker.live_bytes == 8 * ACT
            assert held == pytest.approx(tracker.live_bytes, rel=0.02)
            loss.backward()
            assert tracker.live_bytes == 0
        assert tracker.peak_bytes == 8 * ACT
        del x, loss
        gc.collect()
        # after the backward only the parameters' new gradients remain allocated
        left = tracemalloc.get_traced_memory()[0] - before
        # (and some Python objects: far less than one activation)
        assert left == pytest.approx(memory.gradient_bytes(model), abs=ACT / 4)
    finally:
        tracemalloc.stop()


def test_allocations_follow_the_held_bytes_through_a_checkpointed_backward():
    """tracemalloc's peak over a whole step stays within gradients and a few temporaries of
    the tracker's peak: backward frees each array when its last node is done, so a
    recomputed segment does not sit on top of the last segment's activations."""
    from minidist.recompute import checkpoint_sequential

    n, k = 8, 2
    model = nn.Sequential(*[nn.Sequential(nn.Linear(W, W, rng=i, dtype="float64"), nn.Tanh()) for i in range(n)])
    x = Tensor(np.ones((B, W)))
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        with memory.track() as tracker:
            checkpoint_sequential(model, k, x).sum().backward()
        allocated_peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert tracker.peak_bytes == (1 + 2 * 4 + 1) * ACT  # segment input, 4 blocks of 2, last segment's input
    assert tracker.peak_bytes < allocated_peak < tracker.peak_bytes + memory.gradient_bytes(model) + 3 * ACT


def test_per_op_and_per_module_split_by_hand():
    model = mlp(2)  # 0: Linear, 1: Tanh, 2: Linear
    x = Tensor(np.ones((B, W)))
    with memory.track(model) as tracker:
        loss = model(x).sum()
    # Linear 0 holds x; Tanh 1 holds its input (the pre-activation) and its output (which
    # Linear 2 also holds: counted once); the sum holds Linear 2's output.
    assert tracker.live_by_op == {"Linear": ACT, "Tanh": 2 * ACT, "Sum": ACT}
    assert tracker.peak_by_module == {"0": ACT, "1": 2 * ACT, memory.OUTSIDE_MODULES: ACT}
    assert all("forward" not in m.__dict__ for m in model.modules())  # the labels are removed
    loss.backward()
    assert tracker.peak_bytes == 4 * ACT and tracker.saves == 4


def test_parameters_are_not_activations_and_views_count_their_own_bytes_once():
    weight = nn.Parameter(np.ones((W, W)))
    x = Tensor(np.ones((B, W)), requires_grad=True)
    with memory.track() as tracker:
        y = (x @ weight.T).reshape(B * W)  # MatMul holds x and a view of the weight (a Parameter)
        z = y[: B * W // 4] * 2.0  # GetItem holds y: the same bytes as the MatMul's output,
        # which Reshape holds; Mul holds a slice (its own quarter) and a constant (8 bytes)
    assert tracker.live_by_op == {"MatMul": ACT, "Reshape": ACT, "Mul": ACT // 4 + 8}
    assert memory.saved_bytes(z) == tracker.live_bytes
    micro_batches = [Tensor(x.data[i:i + B // 4], requires_grad=True).tanh() for i in range(0, B, B // 4)]
    assert memory.saved_bytes(*micro_batches[:2]) == ACT  # two inputs (views of x: their rows) and outputs


def test_a_graph_dropped_without_backward_is_freed_and_threads_are_apart():
    model = mlp(2)
    with memory.track() as tracker:
        out = model(Tensor(np.ones((B, W)), requires_grad=True))  # holds x, z1, tanh(z1)
        assert tracker.live_bytes == 3 * ACT
        other = threading.Thread(target=lambda: model(Tensor(np.ones((B, W)), requires_grad=True)))
        other.start()
        other.join()
        assert tracker.live_bytes == 3 * ACT  # the other thread's ops are not ours
        with memory.track() as inner:  # trackers nest
            out2 = out.tanh()
        assert inner.live_bytes == 2 * ACT and tracker.live_bytes == 5 * ACT
        del out, out2
        gc.collect()
        assert tracker.live_bytes == 0 and tracker.peak_bytes == 5 * ACT


def test_parameter_gradient_and_optimizer_state_bytes():
    model = nn.Linear(3, 4, dtype="float32")  # 12 + 4 values
    assert memory.parameter_bytes(model) == 64 == memory.parameter_bytes(model.parameters())
    assert memory.gradient_bytes(model) == 0
    plain, heavy = optim.SGD(model.parameters(), lr=0.1), optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(Tensor(np.ones((2, 3), dtype="float32"))).sum().backward()
    assert memory.gradient_bytes(model) == 64
    plain.step()
    heavy.step()
    assert memory.optimizer_state_bytes(plain) == 0
    assert memory.optimizer_state_bytes(heavy) == 64  # one velocity per parameter


def test_bad_module_is_a_clear_error():
    with pytest.raises(TypeError, match="nn.Module or None"):
        memory.track(lambda x: x)


@pytest.mark.skipif(backend.cuda_available(), reason="a GPU is present")
def test_device_memory_is_none_without_a_gpu():
    assert memory.device_memory_bytes() is None
    with memory.track() as tracker:
        mlp(1)(Tensor(np.ones((2, W)), requires_grad=True))
    assert tracker.device_peak_bytes is None


@pytest.mark.skipif(not backend.cuda_available(), reason="needs CuPy and a GPU")
def test_cupy_pool_grows_by_the_bytes_held():
    import cupy

    model = mlp(4).to("cuda")
    x = Tensor(np.ones((B, W)), device="cuda")
    cupy.cuda.Device().synchronize()
    before = memory.device_memory_bytes()
    with memory.track() as tracker:
        loss = model(x).sum()
    grown = memory.device_memory_bytes() - before
    # x (saved by the first Linear), 4 pre-activations, 3 tanh outputs: as on the CPU
    assert tracker.live_bytes == 8 * ACT
    # ... but x was allocated before: the pool grew by the other 7 at least
    assert grown >= tracker.live_bytes - ACT and tracker.device_peak_bytes >= before + tracker.live_bytes - ACT
    del loss
