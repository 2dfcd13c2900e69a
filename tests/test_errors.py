"""Each documented error is raised, names the op and the shapes, and never lets a
wrong broadcast through silently."""
import numpy as np
import pytest

import minidist.functions as F
from minidist import Tensor, backend, nn, optim
from minidist.functions import ShapeError


def t(*shape):
    return Tensor(np.ones(shape), requires_grad=True)


def test_matmul_mismatch_names_shapes():
    with pytest.raises(ShapeError, match=r"matmul: shapes \(3, 4\) and \(5, 2\) are not aligned"):
        t(3, 4) @ t(5, 2)


def test_matmul_scalar_and_batch_errors():
    with pytest.raises(ShapeError, match="at least one dimension"):
        F.matmul(t(), t(3))
    with pytest.raises(ShapeError, match="batch dimensions"):
        t(2, 3, 4) @ t(3, 4, 5)


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
def test_non_broadcastable_pair(op):
    with pytest.raises(ShapeError, match=rf"{op}: shapes \(3, 4\) and \(3,\) cannot be broadcast"):
        getattr(F, op)(t(3, 4), t(3))


def test_backward_of_non_scalar_without_grad():
    with pytest.raises(RuntimeError, match=r"shape \(3, 4\)"):
        (t(3, 4) * 2).backward()


def test_backward_grad_of_wrong_shape():
    with pytest.raises(ValueError, match="grad has shape"):
        (t(3) * 2).backward(np.ones(4))


def test_cuda_without_cupy_or_gpu(monkeypatch):
    monkeypatch.setattr(backend, "_import_cupy", lambda: None)
    with pytest.raises(backend.DeviceError, match="CuPy is not installed or no GPU"):
        Tensor([1.0], device="cuda")
    with pytest.raises(backend.DeviceError):
        Tensor([1.0]).to("cuda")
    monkeypatch.setenv("MINIDIST_DEVICE", "cuda")
    with pytest.raises(backend.DeviceError, match="MINIDIST_DEVICE=cpu"):
        backend.default_device()


def test_unknown_device():
    with pytest.raises(backend.DeviceError, match="unknown device 'tpu'"):
        backend.check_device("tpu")


def test_cross_entropy_target_out_of_range():
    with pytest.raises(ValueError, match=r"targets must be in \[0, 3\).*from 0 to 3"):
        F.cross_entropy(t(2, 3), np.array([0, 3]))
    with pytest.raises(ValueError, match=r"from -1 to 1"):
        F.cross_entropy(t(2, 3), np.array([-1, 1]))


def test_cross_entropy_bad_shapes_and_dtypes():
    with pytest.raises(ShapeError, match=r"targets must have shape \(2,\)"):
        F.cross_entropy(t(2, 3), np.array([[0], [1]]))
    with pytest.raises(ShapeError, match=r"logits must have shape \(N, C\)"):
        F.cross_entropy(t(3), np.array([0]))
    with pytest.raises(TypeError, match="integer class indices"):
        F.cross_entropy(t(2, 3), np.array([0.0, 1.0]))


def test_mse_refuses_silent_broadcast():
    with pytest.raises(ShapeError, match="same shape"):
        F.mse_loss(t(4, 1), t(4))


def test_pow_with_tensor_exponent():
    with pytest.raises(TypeError, match="exponent must be a Python int or float"):
        t(3) ** t(3)


def test_reshape_and_axes_errors():
    with pytest.raises(ShapeError, match=r"cannot reshape a tensor of shape \(2, 3\)"):
        t(2, 3).reshape(4, 2)
    with pytest.raises(ShapeError, match="axis 2 is out of range"):
        t(2, 3).sum(axis=2)
    with pytest.raises(ShapeError, match="not a permutation"):
        t(2, 3).transpose(0, 0)
    with pytest.raises(ShapeError, match="empty"):
        Tensor(np.ones((0,))).max()


def test_linear_shape_errors():
    layer = nn.Linear(4, 2)
    with pytest.raises(ShapeError, match=r"linear: input of shape \(3, 5\).*in_features = 4"):
        layer(np.ones((3, 5), dtype=np.float32))


def test_optimizer_argument_errors():
    p = [nn.Parameter(np.ones(2))]
    for kwargs, message in [({"lr": 0}, "lr must be > 0"), ({"lr": 0.1, "momentum": 1.0}, "momentum"),
                            ({"lr": 0.1, "weight_decay": -1}, "weight_decay"),
                            ({"lr": 0.1, "nesterov": True}, "nesterov")]:
        with pytest.raises(ValueError, match=message):
            optim.SGD(p, **kwargs)
    with pytest.raises(ValueError, match="empty parameter list"):
        optim.SGD([], lr=0.1)


def test_load_state_dict_errors():
    model = nn.mlp([3, 4, 2], rng=0)
    state = model.state_dict()
    state.pop("0.bias")
    with pytest.raises(KeyError, match=r"missing keys \['0.bias'\]"):
        model.load_state_dict(state)
    state = model.state_dict()
    state["0.bias"] = np.zeros(5)
    with pytest.raises(ValueError, match="0.bias has shape"):
        model.load_state_dict(state)
