"""The CuPy path, checked against the NumPy path (the oracle): the same op, model or training
run on ``device="cuda"`` gives what it gives on the CPU, to float64/float32 rounding.

Skipped without CuPy and a GPU (as in CI). Run on a lent GPU with ``pytest tests/test_cuda.py``.
"""
import numpy as np
import pytest

from minidist import Tensor, backend, collectives, data, functions, memory, nn, optim, recompute, sim, train
from minidist.parallel.data_parallel.train import train_ddp
from minidist.parallel.pipeline.train import train_pipeline

pytestmark = pytest.mark.skipif(not backend.cuda_available(), reason="needs CuPy and a GPU")

RNG = np.random.default_rng(0)
A = RNG.normal(size=(5, 4))
B = RNG.normal(size=(4, 3))
POSITIVE = RNG.uniform(0.5, 2.0, size=(5, 4))

# (name, function of Tensors, inputs): every differentiable op of minidist.functions.
OPS = [
    ("add", lambda a, b: a + b, [A, A[0]]),
    ("sub", lambda a, b: a - b, [A, A[:, :1]]),
    ("mul", lambda a, b: a * b, [A, A[0]]),
    ("div", lambda a, b: a / b, [A, POSITIVE]),
    ("pow", lambda a: a ** 3, [A]),
    ("neg", lambda a: -a, [A]),
    ("exp", lambda a: a.exp(), [A]),
    ("log", lambda a: a.log(), [POSITIVE]),
    ("relu", lambda a: a.relu(), [A]),
    ("tanh", lambda a: a.tanh(), [A]),
    ("sigmoid", lambda a: a.sigmoid(), [A]),
    ("matmul", lambda a, b: a @ b, [A, B]),
    ("linear", lambda x, w, b: functions.linear(x, w, b), [A, B.T, B[0]]),
    ("sum", lambda a: a.sum(axis=0), [A]),
    ("mean", lambda a: a.mean(axis=1, keepdims=True), [A]),
    ("max", lambda a: a.max(axis=1), [A]),
    ("reshape", lambda a: a.reshape((2, 10)), [A]),
    ("transpose", lambda a: a.T, [A]),
    ("getitem", lambda a: a[1:4, ::2], [A]),
    ("log_softmax", lambda a: a.log_softmax(axis=-1), [A]),
    ("softmax", lambda a: functions.softmax(a), [A]),
]


def _run(fn, arrays, device):
    tensors = [Tensor(a.copy(), requires_grad=True).to(device) for a in arrays]
    out = fn(*tensors)
    weights = backend.to_device(np.linspace(-1.0, 1.0, int(np.prod(out.shape))).reshape(out.shape), device)
    (out * Tensor(weights)).sum().backward()
    return backend.to_numpy(out.data), [backend.to_numpy(t.grad) for t in tensors]


@pytest.mark.parametrize("name, fn, arrays", OPS, ids=[op[0] for op in OPS])
def test_every_op_forward_and_backward_match_numpy(name, fn, arrays):
    cpu_out, cpu_grads = _run(fn, arrays, "cpu")
    gpu_out, gpu_grads = _run(fn, arrays, "cuda")
    np.testing.assert_allclose(gpu_out, cpu_out, rtol=1e-12, atol=1e-12)
    for g, c in zip(gpu_grads, cpu_grads):
        np.testing.assert_allclose(g, c, rtol=1e-12, atol=1e-12)


def test_cross_entropy_on_cuda():
    logits = RNG.normal(size=(6, 10))
    targets = RNG.integers(0, 10, size=6)
    results = []
    for device in ("cpu", "cuda"):
        x = Tensor(logits.copy(), requires_grad=True).to(device)
        loss = functions.cross_entropy(x, backend.to_device(targets, device))
        loss.backward()
        results.append((loss.item(), backend.to_numpy(x.grad)))
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-12)
    np.testing.assert_allclose(results[1][1], results[0][1], rtol=1e-12, atol=1e-14)


def test_single_training_on_cuda_matches_cpu():
    """Two epochs of the main job's single strategy: the weights agree to float32 rounding
    (cuBLAS and OpenBLAS sum in different orders) and so does the test accuracy."""
    digits = data.load_digits(seed=0)
    results = {}
    for device in ("cpu", "cuda"):
        config = train.TrainConfig(epochs=2, progress=False, device=device)
        results[device] = train.train_single(config, digits, report=False)
    cpu, gpu = results["cpu"], results["cuda"]
    for key, value in cpu.model.state_dict().items():
        np.testing.assert_allclose(backend.to_numpy(gpu.model.state_dict()[key]), backend.to_numpy(value),
                                   rtol=1e-3, atol=1e-4)
    assert abs(gpu.test_accuracy - cpu.test_accuracy) <= 0.01


def test_ddp_on_the_sim_with_cuda_arrays():
    """Data parallelism on 2 simulated ranks with the model on the GPU: the collectives stage
    CuPy buffers and the result equals the CPU run's."""
    digits = data.load_digits(seed=0)
    accuracies = {}
    for device in ("cpu", "cuda"):
        config = train.TrainConfig(strategy="ddp", epochs=1, progress=False, device=device, timeout=60)
        accuracies[device] = sim.run(lambda comm, c=config: train_ddp(comm, c, digits), 2)[0].test_accuracy
    assert abs(accuracies["cuda"] - accuracies["cpu"]) <= 0.01


def test_pipeline_on_the_sim_with_cuda_arrays():
    digits = data.load_digits(seed=0)
    accuracies = {}
    for device in ("cpu", "cuda"):
        config = train.TrainConfig(strategy="pipeline", epochs=1, progress=False, device=device, timeout=60,
                                   hidden=train.PIPELINE_HIDDEN, lr=train.PIPELINE_LR, schedule="1f1b")
        accuracies[device] = sim.run(lambda comm, c=config: train_pipeline(comm, c, digits),
                                     2)[0].test_accuracy
    assert abs(accuracies["cuda"] - accuracies["cpu"]) <= 0.02


def test_all_reduce_algorithms_on_cupy():
    import cupy

    xs = [RNG.normal(size=1000) for _ in range(4)]
    for algorithm in collectives.ALL_REDUCE_ALGORITHMS:
        out = sim.run(lambda c, a=algorithm: collectives.all_reduce(c, cupy.asarray(xs[c.rank]), algorithm=a), 4)
        for result in out:
            assert isinstance(result, cupy.ndarray)
            np.testing.assert_allclose(cupy.asnumpy(result), np.sum(xs, axis=0), rtol=1e-12)


def test_checkpoint_recompute_on_cuda_matches_plain_backward():
    model = nn.mlp([16, 32, 32, 4], rng=0, device="cuda")
    x = Tensor(RNG.normal(size=(8, 16))).to("cuda")
    model(x).sum().backward()
    plain = [backend.to_numpy(p.grad).copy() for p in model.parameters()]
    model.zero_grad()
    recompute.checkpoint_sequential(list(model), 2, x).sum().backward()
    for p, g in zip(model.parameters(), plain):
        np.testing.assert_allclose(backend.to_numpy(p.grad), g, rtol=1e-6)


def test_memory_track_counts_cupy_bytes():
    model = nn.mlp([64, 256, 10], rng=0, device="cuda")
    x = Tensor(RNG.normal(size=(128, 64)).astype(np.float32)).to("cuda")
    with memory.track() as tracker:
        model(x).sum().backward()
    assert tracker.peak_bytes > 0


def test_sgd_step_on_cuda():
    layer = nn.Linear(3, 2, rng=0, device="cuda")
    opt = optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    before = backend.to_numpy(layer.weight.data).copy()
    layer(Tensor(np.ones((1, 3), dtype=np.float32)).to("cuda")).sum().backward()
    opt.step()
    assert backend.get_array_module(layer.weight.data).__name__ == "cupy"
    np.testing.assert_allclose(backend.to_numpy(layer.weight.data), before - 0.1, rtol=1e-6)


def test_inputs_on_two_devices_are_a_clear_error():
    a = Tensor(np.ones(3)).to("cuda")
    with pytest.raises(RuntimeError, match=r"same device, but Mul got inputs on cuda, cpu; move them"):
        a * Tensor(np.ones(3))


@pytest.mark.parametrize("strategy", ["ddp", "pipeline"])
def test_train_under_mpiexec_on_cuda(strategy):
    """Real MPI with the model on the GPU: an MPI that is not CUDA-aware (the usual wheel or
    distribution build) is handed host copies, so the run ends and reaches the CPU's accuracy
    (a GPU pointer handed to such an MPI crashes it with a segmentation fault)."""
    import subprocess

    from mpitools import mpiexec_or_skip

    from minidist import launch

    command = launch.mpiexec_command("-m", 2, ["minidist", "train", "--strategy", strategy, "--device", "cuda",
                                              "--epochs", "3", "--no-progress"], mpiexec=mpiexec_or_skip())
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    accuracy = float(result.stdout.strip().splitlines()[-1].split("=")[1])
    assert accuracy >= 0.85
