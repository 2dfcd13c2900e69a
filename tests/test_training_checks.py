"""minidist.course.checks.training: the checks of exercises 01 and 02 pass the engine's own code and
reject typical mistakes with a hint, without hanging on a deadlocked loader."""
import inspect
import queue
import threading

import numpy as np
import pytest

from minidist import data
from minidist import functions as F
from minidist.course.checks import training as training_checks
from minidist.tensor import Function


def copied(cls):
    """``cls`` defined again from its source, outside the minidist package (as a learner who
    typed the same code would), in its module's namespace."""
    namespace = {**vars(inspect.getmodule(cls)), "__name__": "a_learners_notebook"}
    exec(compile(inspect.getsource(cls), f"<a copy of {cls.__name__}>", "exec"), namespace)
    return namespace[cls.__name__]


@pytest.mark.parametrize("op, kind", [(F.Add, "add"), (F.Mul, "mul"), (F.Div, "div"), (F.Exp, "exp"),
                                      (F.Tanh, "tanh"), (F.Sum, "sum"), (F.MatMul, "matmul")])
def test_check_backward_passes_the_engines_ops_typed_again(op, kind):
    assert training_checks.check_backward(copied(op), kind).startswith(f"{op.__name__}: backward agrees")
    with pytest.raises(AssertionError, match=f"this is minidist.functions.{op.__name__}, the engine's own"):
        training_checks.check_backward(op, kind)


class MulWithoutUnbroadcast(Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved
        return grad * b, grad * a


class SumIgnoringKeepdims(Function):
    @staticmethod
    def forward(ctx, a, axis=None, keepdims=False):
        ctx.shape, ctx.axis = a.shape, axis
        return a.sum(axis=axis, keepdims=keepdims)

    @staticmethod
    def backward(ctx, grad):
        if ctx.axis is None:
            return (np.broadcast_to(grad, ctx.shape),)
        return (np.broadcast_to(np.expand_dims(grad, ctx.axis), ctx.shape),)


def test_check_backward_names_the_failing_case_and_hints():
    with pytest.raises(AssertionError, match=r"(?s)MulWithoutUnbroadcast on shapes \(3, 4\) and \(4,\), input 1: "
                                             r"expected shape \(4,\).*sum over broadcast axes"):
        training_checks.check_backward(MulWithoutUnbroadcast, "mul")
    with pytest.raises(AssertionError, match=r"(?s)axis=1, keepdims=True: running forward and backward raised "
                                             r"ValueError.*Hint: every input element") as failure:
        training_checks.check_backward(SumIgnoringKeepdims, "sum")
    # The learner's own line (in this file), not the engine's internals, and nothing chained.
    assert "\nyour line " in str(failure.value) and " in backward: return (np.broadcast_to(" in str(failure.value)
    assert failure.value.__cause__ is None and failure.value.__suppress_context__
    with pytest.raises(KeyError, match="unknown kind"):
        training_checks.check_backward(F.Mul, "multiply")


def reference_step(param, grad, velocity, lr, momentum):
    velocity = momentum * velocity + grad
    return param - lr * velocity, velocity


def test_check_sgd_accepts_pytorchs_form_and_rejects_mistakes():
    assert "matches minidist.optim.SGD" in training_checks.check_sgd_momentum_step(reference_step)

    def lr_inside_velocity(param, grad, velocity, lr, momentum):
        velocity = momentum * velocity + lr * grad
        return param - velocity, velocity

    def uses_old_velocity(param, grad, velocity, lr, momentum):
        return param - lr * velocity, momentum * velocity + grad

    def moving_average(param, grad, velocity, lr, momentum):  # dampening: v = μ·v + (1 − μ)·g
        velocity = momentum * velocity + (1 - momentum) * grad
        return param - lr * velocity, velocity

    with pytest.raises(AssertionError, match="velocity"):
        training_checks.check_sgd_momentum_step(lr_inside_velocity)
    with pytest.raises(AssertionError, match=r"(?s)step 1 with momentum 0.0.*Hint: with momentum 0 the update is "
                                             r"plain"):
        training_checks.check_sgd_momentum_step(uses_old_velocity)
    with pytest.raises(AssertionError, match=r"(?s)step 1 with momentum 0.9.*Hint: the velocity starts at zero"):
        training_checks.check_sgd_momentum_step(moving_average)
    with pytest.raises(AssertionError, match="expected a tuple"):
        training_checks.check_sgd_momentum_step(lambda p, g, v, lr, m: p - lr * g)


class SimplePrefetch:
    _END = object()

    def __init__(self, loader, depth=2):
        self.loader, self.depth = loader, depth

    def __iter__(self):
        buffer = queue.Queue(maxsize=self.depth)

        def produce():
            try:
                for batch in self.loader:
                    buffer.put(batch)
                buffer.put(self._END)
            except BaseException as error:
                buffer.put(error)

        threading.Thread(target=produce, daemon=True).start()
        while True:
            item = buffer.get()
            if item is self._END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class NoPrefetch(SimplePrefetch):
    def __iter__(self):
        return iter(self.loader)


class Unbounded(SimplePrefetch):
    def __iter__(self):
        self.depth = 0  # Queue(maxsize=0) has no bound
        return super().__iter__()


class SwallowsErrors(SimplePrefetch):
    def __iter__(self):
        buffer = queue.Queue(maxsize=self.depth)

        def produce():
            for batch in self.loader:
                buffer.put(batch)
            buffer.put(self._END)

        threading.Thread(target=produce, daemon=True).start()
        while (item := buffer.get()) is not self._END:
            yield item


def test_check_prefetch_passes_the_engines_loader_typed_again_and_a_simple_one():
    assert "same batches" in training_checks.check_prefetch_loader(copied(data.PrefetchLoader))
    assert "same batches" in training_checks.check_prefetch_loader(SimplePrefetch)


def test_the_engines_own_loader_is_not_an_answer():
    with pytest.raises(AssertionError, match=r"the prefetching loader: this is minidist.data.PrefetchLoader, the "
                                             r"engine's own implementation, not yours\nHint: the exercise is"):
        training_checks.check_prefetch_loader(data.PrefetchLoader)


@pytest.mark.parametrize("loader_class, message", [
    (NoPrefetch, "only 1 batch"),
    (Unbounded, "at most 3 are allowed"),
])
def test_check_prefetch_rejects_no_prefetch_and_no_bound(loader_class, message):
    with pytest.raises(AssertionError, match=message):
        training_checks.check_prefetch_loader(loader_class)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_check_prefetch_turns_a_lost_error_into_a_timeout_not_a_hang(monkeypatch):
    monkeypatch.setattr(training_checks, "WATCHDOG_S", 1.0)
    monkeypatch.setattr(training_checks._Watchdog.__init__, "__defaults__", (1.0,))
    with pytest.raises(AssertionError, match=r"(?s)fails at batch 3: no batch.*within 1 s.*Hint: is the background"):
        training_checks.check_prefetch_loader(SwallowsErrors)


def test_a_stub_raises_not_implemented_in_the_caller():
    class Stub:
        def __init__(self, loader, depth=2):
            pass

        def __iter__(self):
            raise NotImplementedError()

    with pytest.raises(AssertionError, match="Stub: batches: this is still a stub") as failure:
        training_checks.check_prefetch_loader(Stub)
    assert "your line" in str(failure.value) and "raise NotImplementedError()" in str(failure.value)
