"""minidist.course.checks.memory (exercise 10): the engine's checkpoint and a plain Function
pass; versions wrong in each way the check looks for fail, each with its own hint (no
recomputation: the graph kept; function's ops recorded; grad mode left off or forced on; the
incoming gradient ignored; the input copied); a stub says it is one."""
import inspect
import sys
import types

import numpy as np
import pytest

from minidist import recompute, tensor
from minidist.course.checks import STUB_HINT, LearnerError
from minidist.course.checks import memory as memory_checks
from minidist.tensor import Function, Tensor, no_grad


class Checkpoint(Function):
    """The exercise's Function, written out: forward under no_grad keeping x, backward reruns."""

    @staticmethod
    def forward(ctx, x, function):
        ctx.save_for_backward(x)
        ctx.function = function
        with no_grad():
            return function(Tensor(x)).data

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved
        inp = Tensor(x, requires_grad=True)
        ctx.function(inp).backward(grad)
        return (inp.grad,)


def through(cls):
    return lambda function, x: cls.apply(x, function=function)


@pytest.fixture(autouse=True)
def grad_mode_back_on():
    yield
    tensor.set_grad_enabled(True)  # a wrong version may leave it off in this thread


def module_copy(module):
    """``module``'s source run again as a new module outside the package: the engine's code as a
    learner who typed all of it would have it (the checks refuse the engine's own objects)."""
    copy = types.ModuleType(f"a_copy_of_{module.__name__.replace('.', '_')}")
    sys.modules[copy.__name__] = copy  # dataclasses look their module up
    try:
        exec(compile(inspect.getsource(module), f"<a copy of {module.__name__}>", "exec"), vars(copy))
    finally:
        del sys.modules[copy.__name__]
    return copy


def test_the_engines_checkpoint_typed_again_and_a_plain_function_pass():
    for checkpoint in (module_copy(recompute).checkpoint, through(Checkpoint)):
        verdict = memory_checks.check_checkpoint(checkpoint)
        assert verdict.startswith("checkpoint: ok") and "k = 1: 17, k = 2: 10, k = 4: 8, k = 8: 10" in verdict


def test_the_engines_checkpoint_is_not_an_answer():
    """The old check passed recompute.checkpoint itself, and a function calling it."""
    with pytest.raises(AssertionError, match="checkpoint: this is minidist.recompute.checkpoint, the engine's own "
                                             "implementation, not yours"):
        memory_checks.check_checkpoint(recompute.checkpoint)

    def calls_the_engine(function, x):
        return recompute.checkpoint(function, x)

    with pytest.raises(LearnerError, match="called minidist.recompute.checkpoint, the engine's own implementation"):
        memory_checks.check_checkpoint(calls_the_engine)
    x = Tensor(np.ones((2, 3)), requires_grad=True)
    recompute.checkpoint(lambda t: t * 2, x).sum().backward()  # the engine works again afterwards
    assert x.grad.tolist() == [[2.0] * 3] * 2


def test_chens_count_for_the_checks_network():
    # n = 8: k = 1 holds every block (2 each) and the input; k = 4 (about sqrt(8)) is the smallest
    assert [memory_checks.chen_peak_activations(8, k) for k in (1, 2, 3, 4, 8)] == [17, 10, 11, 8, 10]


class KeepsTheGraph(Function):
    @staticmethod
    def forward(ctx, x, function):
        ctx.inp = Tensor(x, requires_grad=True)
        ctx.out = function(ctx.inp)
        return ctx.out.data

    @staticmethod
    def backward(ctx, grad):
        ctx.out.backward(grad)
        return (ctx.inp.grad,)


class RecordsTheForward(Checkpoint):
    @staticmethod
    def forward(ctx, x, function):
        ctx.save_for_backward(x)
        ctx.function = function
        return function(Tensor(x)).data  # no no_grad: a graph is built, then dropped


class LeavesGradOff(Checkpoint):
    @staticmethod
    def forward(ctx, x, function):
        ctx.save_for_backward(x)
        ctx.function = function
        no_grad().__enter__()  # never exited
        return function(Tensor(x)).data


class ForcesGradOn(Checkpoint):
    @staticmethod
    def forward(ctx, x, function):
        ctx.save_for_backward(x)
        ctx.function = function
        tensor.set_grad_enabled(False)
        y = function(Tensor(x)).data
        tensor.set_grad_enabled(True)  # not the mode it found
        return y


class IgnoresTheIncomingGradient(Checkpoint):
    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved
        inp = Tensor(x, requires_grad=True)
        ctx.function(inp).sum().backward()
        return (inp.grad,)


class CopiesTheInput(Checkpoint):
    @staticmethod
    def forward(ctx, x, function):
        ctx.save_for_backward(x.copy())  # held next to the input the parent keeps
        ctx.function = function
        with no_grad():
            return function(Tensor(x)).data


@pytest.mark.parametrize("cls, message", [
    (KeepsTheGraph, r"(?s)k = 2 segments.*8 forward calls .* = 12.*Hint: your backward did not run function again"),
    (RecordsTheForward, r"(?s)9 activations held at the peak of the forward.*Hint: run function inside 'with no_grad"),
    (LeavesGradOff, r"(?s)gradients are still switched off after your checkpoint.*Hint: switch gradients off with"),
    (ForcesGradOn, r"(?s)inside no_grad\(\): gradients were switched on.*Hint: switch gradients off with"),
    (IgnoresTheIncomingGradient, r"(?s)parameter 0 differs .*equal to the last bit.*Hint: in backward, call function"),
    (CopiesTheInput, r"(?s)2 activations held at the peak.*Hint: keep the input array itself"),
])
def test_each_wrong_version_fails_with_its_own_hint(cls, message):
    with pytest.raises(AssertionError, match=message):
        memory_checks.check_checkpoint(through(cls))


def test_calling_function_directly_is_not_a_checkpoint():
    with pytest.raises(AssertionError, match=r"(?s)does not require grad.*Hint: create the output with"):
        def plain_call(function, x):
            with no_grad():
                return function(x)

        memory_checks.check_checkpoint(plain_call)
    with pytest.raises(AssertionError, match=r"(?s)returned None"):
        memory_checks.check_checkpoint(lambda function, x: None)


def test_a_stub_says_it_is_one_and_other_errors_name_the_learners_line():
    class Stub(Function):
        @staticmethod
        def forward(ctx, x, function):
            raise NotImplementedError()

    with pytest.raises(LearnerError, match=STUB_HINT.split(":")[0]):
        memory_checks.check_checkpoint(through(Stub))

    class BrokenBackward(Checkpoint):
        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved
            return (np.dot(grad, x[:3]),)

    with pytest.raises(LearnerError, match=r"(?s)raised ValueError.*your line \d+ in backward"):
        memory_checks.check_checkpoint(through(BrokenBackward))
