"""The same expressions in PyTorch (float64): values and gradients must agree.
Skipped when torch is not installed (it is not a dependency)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import minidist.functions as F  # noqa: E402
from minidist import Tensor, nn, optim  # noqa: E402

rng = np.random.default_rng(3)

def both(fn_md, fn_t, *arrays):
    md = [Tensor(a.copy(), requires_grad=True) for a in arrays]
    th = [torch.tensor(a, requires_grad=True) for a in arrays]
    out_md, out_t = fn_md(*md), fn_t(*th)
    np.testing.assert_allclose(out_md.data, out_t.detach().numpy(), rtol=1e-10, atol=1e-12)
    v = rng.standard_normal(out_md.shape)
    out_md.backward(v)
    out_t.backward(torch.tensor(v))
    for a, b in zip(md, th):
        np.testing.assert_allclose(a.grad, b.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_elementwise_and_broadcasting():
    both(lambda a, b: (a * b - a / b + 2) ** 2 - (-a).exp() + b.log(),
         lambda a, b: (a * b - a / b + 2) ** 2 - (-a).exp() + b.log(),
         rng.standard_normal((3, 4)), rng.uniform(0.5, 2, (4,)))


def test_activations_and_reductions():
    both(lambda a: a.relu().sum(axis=0) + a.tanh().mean(axis=1, keepdims=True) + a.sigmoid().max(axis=0),
         lambda a: a.relu().sum(dim=0) + a.tanh().mean(dim=1, keepdim=True) + a.sigmoid().amax(dim=0),
         rng.standard_normal((5, 4)))


def test_matmul_batched_and_transpose():
    both(lambda a, b: (a @ b).transpose(0, 2, 1).reshape(2, -1),
         lambda a, b: (a @ b).permute(0, 2, 1).reshape(2, -1),
         rng.standard_normal((2, 3, 4)), rng.standard_normal((4, 5)))


def test_indexing():
    idx = np.array([2, 0, 2])
    both(lambda a: a[idx, 1:] * 2 + a[1, 1:], lambda a: a[torch.tensor(idx), 1:] * 2 + a[1, 1:],
         rng.standard_normal((3, 4)))


def test_log_softmax_and_cross_entropy():
    targets = np.array([1, 0, 3])
    both(lambda a: a.log_softmax(axis=-1), lambda a: torch.log_softmax(a, dim=-1), rng.standard_normal((3, 4)))
    both(lambda a: F.cross_entropy(a, targets),
         lambda a: torch.nn.functional.cross_entropy(a, torch.tensor(targets)), rng.standard_normal((3, 4)))


def test_training_steps_match_torch_sgd_with_momentum_and_weight_decay():
    model = nn.mlp([6, 8, 3], rng=0, dtype="float64")
    reference = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).double()
    with torch.no_grad():
        for (_, p), q in zip(model.named_parameters(), reference.parameters()):
            q.copy_(torch.from_numpy(p.data))
    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)
    opt_t = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)
    for _ in range(5):
        x = rng.standard_normal((10, 6))
        y = rng.integers(0, 3, 10)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt_t.zero_grad()
        torch.nn.functional.cross_entropy(reference(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt_t.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        np.testing.assert_allclose(p.data, q.detach().numpy(), rtol=1e-10, atol=1e-12)
