"""minidist.detect_anomaly: the first NaN/inf of a forward or a backward is named, with the op's call site."""
import inspect
import threading

import numpy as np
import pytest

import minidist
import minidist.functions as F
from minidist import Tensor, nn, tensor
from minidist.anomaly import AnomalyError
from minidist.tensor import Function


def _line_of(text: str) -> int:
    """The line number in this file of the first line containing ``text`` (after this function)."""
    lines = inspect.getsource(inspect.getmodule(_line_of)).splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line and "_line_of" not in line)


class LogModel(nn.Module):
    """Linear -> ReLU -> log: ReLU's zeros make log's output -inf (NumPy: log(0) = -inf)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3, rng=0)

    def forward(self, x):
        return F.log(F.relu(self.fc(x)))  # LOG-SITE


class NanBackward(Function):
    """Identity forward, a backward that returns NaN: the bug only a backward check sees."""

    @staticmethod
    def forward(ctx, a):
        return a.copy()

    @staticmethod
    def backward(ctx, grad):
        return (grad * np.nan,)


def test_log_of_zero_in_a_model_forward_is_named_with_its_line():
    x = Tensor(-np.ones((2, 4)))
    model = LogModel()
    model.fc.weight.data[...] = 1.0  # every pre-activation is -4 + bias < 0: ReLU gives 0, log gives -inf
    model.fc.bias.data[...] = 0.0
    with np.errstate(divide="ignore"):
        assert np.isneginf(np.log(np.float64(0.0)))  # the oracle: NumPy's log(0)
    expected = r"^Log \(forward\) produced inf in output 0"
    with np.errstate(divide="ignore"), minidist.detect_anomaly(), pytest.raises(AnomalyError, match=expected) as e:
        model(x)
    assert (e.value.op, e.value.phase, e.value.kind) == ("Log", "forward", "inf")
    assert f"line {_line_of('# LOG-SITE')}" in str(e.value)  # the model's line, not the engine's
    assert "tensor.py" not in str(e.value)
    with np.errstate(divide="ignore"):
        out = model(x)  # off again: no check, the -inf flows on
    assert np.isneginf(out.data).all()


def test_backward_only_inf_of_sqrt_at_zero_names_pow_and_the_forward_site():
    x = Tensor(np.array([0.0, 4.0]), requires_grad=True)
    with minidist.detect_anomaly():
        y = x**0.5  # SQRT-SITE
        assert np.isfinite(y.data).all()  # the forward is fine: sqrt(0) = 0
        with pytest.raises(AnomalyError, match=r"the backward of Pow returned inf in the gradient of input 0") as e:
            with np.errstate(divide="ignore"):
                y.sum().backward()
    assert e.value.phase == "backward" and e.value.forward_stack is not None
    assert f"line {_line_of('# SQRT-SITE')}" in str(e.value)
    assert [f.lineno for f in e.value.forward_stack if f.filename == __file__][-1] == _line_of("# SQRT-SITE")


def test_a_custom_function_returning_nan_in_backward_is_named():
    x = Tensor(np.arange(3.0), requires_grad=True)

    @minidist.detect_anomaly()  # the decorator form
    def step():
        loss = (NanBackward.apply(x) * 2.0).sum()  # NAN-SITE
        loss.backward()

    with pytest.raises(AnomalyError, match=r"the backward of NanBackward returned nan in the gradient of input 0"
                                           r"; its forward was called at") as e:
        step()
    assert f"line {_line_of('# NAN-SITE')}" in str(e.value)
    assert x.grad is None  # stopped before anything reached the leaf
    assert not minidist.is_anomaly_enabled()  # the decorator restored the mode


def test_forward_before_the_mode_gives_no_call_site_but_still_names_the_op():
    x = Tensor(np.arange(3.0), requires_grad=True)
    loss = NanBackward.apply(x).sum()
    with minidist.detect_anomaly(), pytest.raises(AnomalyError, match="call site is unknown"):
        loss.backward()


def test_finite_values_raise_nothing_and_give_bit_identical_gradients():
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((16, 8)), rng.integers(0, 4, 16)

    def grads(anomaly: bool):
        model = nn.mlp([8, 16, 16, 4], rng=1)
        if anomaly:
            with minidist.detect_anomaly():
                F.cross_entropy(model(Tensor(X)), y).backward()
        else:
            F.cross_entropy(model(Tensor(X)), y).backward()
        return [p.grad.copy() for p in model.parameters()]

    plain, checked = grads(False), grads(True)
    assert len(plain) == 6
    for a, b in zip(plain, checked):
        assert a.tobytes() == b.tobytes()


def test_the_mode_nests_restores_and_is_per_thread():
    seen = []
    assert not minidist.is_anomaly_enabled()
    with minidist.detect_anomaly():
        with minidist.detect_anomaly(check_nan=False):  # records call sites, checks nothing
            assert minidist.is_anomaly_enabled()
            with np.errstate(divide="ignore"):
                assert np.isneginf(F.log(Tensor(np.zeros(2))).data).all()
        thread = threading.Thread(target=lambda: seen.append(minidist.is_anomaly_enabled()))
        thread.start()
        thread.join(timeout=10)
        with pytest.raises(AnomalyError), np.errstate(divide="ignore"):
            F.log(Tensor(np.zeros(2)))
    assert seen == [False] and not minidist.is_anomaly_enabled()
    assert tensor.anomaly_threads() == 0  # the engine's hooks are back to one global read


def test_a_thread_in_the_mode_does_not_check_the_others():
    entered, release, raised = threading.Event(), threading.Event(), []

    def debugging_thread():
        with minidist.detect_anomaly(), np.errstate(divide="ignore"):  # errstate is per thread too
            entered.set()
            release.wait(timeout=10)
            try:
                F.log(Tensor(np.zeros(1)))
            except AnomalyError as error:
                raised.append(error.op)

    thread = threading.Thread(target=debugging_thread)
    with np.errstate(divide="ignore"):
        thread.start()
        assert entered.wait(timeout=10)
        assert tensor.anomaly_threads() == 1 and not minidist.is_anomaly_enabled()
        assert np.isneginf(F.log(Tensor(np.zeros(1))).data).all()  # this thread is not checked
        release.set()
        thread.join(timeout=10)
    assert raised == ["Log"] and tensor.anomaly_threads() == 0
    minidist.set_detect_anomaly(True)
    try:
        with pytest.raises(AnomalyError, match="Exp"), np.errstate(over="ignore"):
            F.exp(Tensor(np.array([1000.0])))
    finally:
        minidist.set_detect_anomaly(False)
    assert not minidist.is_anomaly_enabled()
