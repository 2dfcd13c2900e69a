"""Modules, state dicts, SGD against hand-computed updates, schedules."""
import numpy as np
import pytest

import minidist.functions as F
from minidist import Tensor, nn, optim


def test_named_parameters_follow_pytorch_names_and_order():
    model = nn.mlp([4, 5, 3], rng=0)
    assert [n for n, _ in model.named_parameters()] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert model[0].weight.shape == (5, 4) and model[0].bias.shape == (5,)
    assert model.num_parameters() == 4 * 5 + 5 + 5 * 3 + 3
    assert model[0].weight.dtype == np.float32


def test_same_seed_same_weights_and_init_range():
    a, b, c = nn.mlp([64, 32, 10], rng=7), nn.mlp([64, 32, 10], rng=7), nn.mlp([64, 32, 10], rng=8)
    for (_, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert p.data.tobytes() == q.data.tobytes()
    assert a[0].weight.data.tobytes() != c[0].weight.data.tobytes()
    assert np.abs(a[0].weight.data).max() <= 1 / np.sqrt(64)


def test_state_dict_roundtrip_is_a_copy():
    model = nn.mlp([3, 4, 2], rng=0)
    state = model.state_dict()
    other = nn.mlp([3, 4, 2], rng=1)
    other.load_state_dict(state)
    state["0.weight"][:] = 0  # editing the saved copy must not touch either model
    for p, q in zip(model.parameters(), other.parameters()):
        np.testing.assert_array_equal(p.data, q.data)
        assert p.data is not q.data
    assert np.abs(model[0].weight.data).sum() > 0


def test_zero_grad_and_sequential_slicing():
    model = nn.mlp([3, 4, 2], rng=0)
    F.cross_entropy(model(np.ones((2, 3), np.float32)), np.array([0, 1])).backward()
    assert all(p.grad is not None for p in model.parameters())
    model.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    head, tail = model[:2], model[2:]
    x = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(tail(head(x)).data, model(x).data)
    assert "Linear(in_features=3, out_features=4, bias=True)" in repr(model)


def test_module_without_super_init_is_explained():
    class Broken(nn.Module):
        def __init__(self):
            self.layer = nn.Linear(2, 2)

    with pytest.raises(AttributeError, match="super"):
        Broken()


def test_custom_module_registers_in_assignment_order():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(np.ones(1))
            self.body = nn.Linear(2, 2, rng=0)

        def forward(self, x):
            return self.body(x) * self.scale

    net = Net()
    assert [n for n, _ in net.named_parameters()] == ["scale", "body.weight", "body.bias"]
    net(np.ones((1, 2))).sum().backward()
    assert net.scale.grad.shape == (1,)


def sgd_reference(p, grads, lr, momentum, weight_decay, nesterov):
    """The update written out by hand (PyTorch's documented algorithm)."""
    v = None
    for g in grads:
        g = g + weight_decay * p
        v = g.copy() if v is None else momentum * v + g
        p = p - lr * ((g + momentum * v) if nesterov else v)
    return p


@pytest.mark.parametrize("momentum,weight_decay,nesterov", [(0.0, 0.0, False), (0.9, 0.0, False),
                                                            (0.9, 0.01, False), (0.5, 0.1, True)])
def test_sgd_matches_the_written_out_update(momentum, weight_decay, nesterov):
    rng = np.random.default_rng(0)
    start = rng.standard_normal(5)
    grads = [rng.standard_normal(5) for _ in range(4)]
    p = nn.Parameter(start.copy())
    opt = optim.SGD([p], lr=0.1, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
    for g in grads:
        p.grad = g.copy()
        opt.step()
    np.testing.assert_allclose(p.data, sgd_reference(start, grads, 0.1, momentum, weight_decay, nesterov), rtol=1e-12)


def test_sgd_skips_parameters_without_grad_and_state_roundtrip():
    p, q = nn.Parameter(np.ones(2)), nn.Parameter(np.ones(2))
    opt = optim.SGD([p, q], lr=0.5, momentum=0.9)
    p.grad = np.ones(2)
    opt.step()
    np.testing.assert_array_equal(q.data, [1.0, 1.0])
    np.testing.assert_array_equal(p.data, [0.5, 0.5])
    state = opt.state_dict()
    opt2 = optim.SGD([p, q], lr=0.1, momentum=0.9)
    opt2.load_state_dict(state)
    assert opt2.lr == 0.5 and opt2.steps == 1
    np.testing.assert_array_equal(opt2.velocity[0], [1.0, 1.0])


def test_schedules():
    opt = optim.SGD([nn.Parameter(np.ones(1))], lr=0.8)
    warm = optim.WarmupLR(opt, warmup_steps=4)
    lrs = []
    for _ in range(6):
        warm.step()
        lrs.append(opt.lr)
    np.testing.assert_allclose(lrs, [0.2, 0.4, 0.6, 0.8, 0.8, 0.8])
    opt.lr = 1.0
    step = optim.StepLR(opt, step_size=2, gamma=0.5)
    seen = []
    for _ in range(5):
        step.step()
        seen.append(opt.lr)
    np.testing.assert_allclose(seen, [1.0, 0.5, 0.5, 0.25, 0.25])
    assert optim.scale_lr(0.1, 1024) == pytest.approx(0.4)


def test_training_reduces_loss(device):
    rng = np.random.default_rng(0)
    X = rng.standard_normal((64, 5)).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.int64)
    model = nn.mlp([5, 16, 2], rng=0, device=device)
    opt = optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = F.cross_entropy(model(Tensor(X, device=device)), Tensor(y, device=device))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


# -- flat parameter vectors (torch.nn.utils.parameters_to_vector / vector_to_parameters) --------

def test_parameters_to_vector_is_the_manual_concatenation_in_order():
    model = nn.mlp([3, 4, 2], rng=0, dtype="float64")
    vector = nn.parameters_to_vector(model.parameters())
    w0, b0, w1, b1 = (p.data for p in model.parameters())
    manual = np.concatenate([w0.ravel(), b0, w1.ravel(), b1])  # row-major, registration order
    assert vector.shape == (3 * 4 + 4 + 4 * 2 + 2,) and vector.dtype == np.float64
    np.testing.assert_array_equal(vector, manual)
    assert vector[4] == w0[1, 1]  # element (1, 1) of a (4, 3) weight: 1 * 3 + 1
    vector[:] = 0  # a copy: the parameters are untouched
    assert np.abs(w0).sum() > 0
    # gradients (raw arrays here, as torch's .grad Tensors there) flatten the same way
    model(np.ones((2, 3))).sum().backward()
    grads = nn.parameters_to_vector(p.grad for p in model.parameters())
    np.testing.assert_array_equal(grads, np.concatenate([p.grad.ravel() for p in model.parameters()]))


def test_vector_to_parameters_round_trip_and_copies():
    model, other = nn.mlp([3, 4, 2], rng=0), nn.mlp([3, 4, 2], rng=1)
    vector = nn.parameters_to_vector(model.parameters())
    nn.vector_to_parameters(vector, other.parameters())
    for p, q in zip(model.parameters(), other.parameters()):
        np.testing.assert_array_equal(p.data, q.data)
        assert q.shape == p.shape and q.dtype == np.float32
    vector[:] = 7  # the vector may be reused (a receive buffer): the parameters hold copies
    assert not np.any(other.parameters()[0].data == 7)
    values = np.arange(other.num_parameters(), dtype=np.float32)
    nn.vector_to_parameters(Tensor(values), other.parameters())  # a Tensor works too
    np.testing.assert_array_equal(nn.parameters_to_vector(other.parameters()), values)
    np.testing.assert_array_equal(other[0].weight.data, values[:12].reshape(4, 3))


def test_flat_vectors_match_torch_when_available():
    torch = pytest.importorskip("torch")
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    model = nn.mlp([5, 3, 2], rng=4, dtype="float64")
    theirs = [torch.nn.Parameter(torch.from_numpy(p.data.copy())) for p in model.parameters()]
    np.testing.assert_array_equal(nn.parameters_to_vector(model.parameters()),
                                  parameters_to_vector(theirs).detach().numpy())
    values = np.random.default_rng(0).standard_normal(model.num_parameters())
    nn.vector_to_parameters(values, model.parameters())
    vector_to_parameters(torch.from_numpy(values), theirs)
    for p, q in zip(model.parameters(), theirs):
        np.testing.assert_array_equal(p.data, q.detach().numpy())


def test_flat_vector_errors_name_the_problem():
    model = nn.mlp([3, 4, 2], rng=0)
    with pytest.raises(ValueError, match="no parameters"):
        nn.parameters_to_vector([])
    with pytest.raises(ValueError, match="without a gradient"):
        nn.parameters_to_vector(p.grad for p in model.parameters())
    with pytest.raises(ValueError, match="mix dtypes"):
        nn.parameters_to_vector([np.zeros(2, np.float32), np.zeros(2, np.float64)])
    n = model.num_parameters()
    with pytest.raises(ValueError, match=f"1-D vector of {n} elements"):
        nn.vector_to_parameters(np.zeros(n + 1, np.float32), model.parameters())
    with pytest.raises(ValueError, match=f"1-D vector of {n} elements"):
        nn.vector_to_parameters(np.zeros((1, n), np.float32), model.parameters())
    before = model[0].weight.data.copy()
    with pytest.raises(ValueError, match="the vector is float64, a parameter is float32"):
        nn.vector_to_parameters(np.zeros(n), model.parameters())
    np.testing.assert_array_equal(model[0].weight.data, before)  # nothing changed
    with pytest.raises(TypeError, match="not a Tensor"):
        nn.vector_to_parameters(np.zeros(2), [np.zeros(2)])
