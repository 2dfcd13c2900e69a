"""minidist.course.checks.precision (exercise 11): the reference rule agrees with
minidist.precision.GradScaler (written separately, after torch.amp.GradScaler) on random
overflow sequences; a correct scaler passes; versions wrong in each way the check looks for
fail with their own hint; a stub says it is one."""
import inspect

import numpy as np
import pytest

from minidist import precision
from minidist.course.checks import STUB_HINT, LearnerError
from minidist.course.checks import precision as precision_checks


class LossScaler:
    """The exercise's class, written out."""

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self.scale, self.good_steps = float(init_scale), 0
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval

    def update(self, found_inf):
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return False
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0
        return True


class _FakeOptimizer:
    """Just enough optimizer for GradScaler: one parameter whose gradient is finite or not."""

    def __init__(self):
        self.params, self.stepped = [type("P", (), {"grad": np.zeros(1, np.float32)})()], 0

    def step(self):
        self.stepped += 1


@pytest.mark.parametrize("seed, interval", [(0, 1), (1, 3), (2, 7)])
def test_the_reference_rule_matches_minidist_precision_gradscaler(seed, interval):
    flags = np.random.default_rng(seed).random(300) < 0.15
    scaler = precision.GradScaler(init_scale=2.0 ** 10, growth_interval=interval)
    optimizer = _FakeOptimizer()
    scale, good = 2.0 ** 10, 0
    for found_inf in flags:
        optimizer.params[0].grad = np.array([np.inf if found_inf else 1.0], np.float32)
        with np.errstate(invalid="ignore"):  # GradScaler unscales the inf: inf * 2**-10
            stepped = scaler.step(optimizer)
        scaler.update()
        scale, good, step = precision_checks.reference_update(scale, good, bool(found_inf), 2.0, 0.5, interval)
        assert (stepped, scaler.get_scale()) == (step, scale)


def typed_again(cls):
    """``cls`` defined again from its source outside minidist, as a learner who typed it would."""
    namespace = {**vars(inspect.getmodule(cls)), "__name__": "a_learners_notebook"}
    exec(compile(inspect.getsource(cls), f"<a copy of {cls.__name__}>", "exec"), namespace)
    return namespace[cls.__name__]


def test_a_correct_scaler_and_the_reference_typed_again_pass():
    for scaler_class in (LossScaler, typed_again(precision_checks.ReferenceScaler)):
        verdict = precision_checks.check_loss_scaler(scaler_class)
        assert verdict.startswith("LossScaler: ok") and "10 of 129 steps skipped" in verdict, verdict
        assert "test accuracy 0.9556" in verdict


def test_the_checks_reference_is_not_an_answer():
    """The old check passed `LossScaler = precision_checks.ReferenceScaler`, and a subclass of it."""
    with pytest.raises(AssertionError, match="LossScaler: this is minidist.course.checks.precision.ReferenceScaler, "
                                             "the checks' own implementation, not yours"):
        precision_checks.check_loss_scaler(precision_checks.ReferenceScaler)

    class Inherits(precision_checks.ReferenceScaler):
        pass

    with pytest.raises(AssertionError, match="LossScaler: its __init__ is minidist.course.checks.precision."
                                             "ReferenceScaler.__init__, the checks' own implementation"):
        precision_checks.check_loss_scaler(Inherits)


def test_the_float16_training_skips_its_first_steps_then_learns():
    run = precision_checks.train_with_scaler(precision_checks.ReferenceScaler(2.0 ** 24, 2.0, 0.5, 20))
    # 2**24 overflows; halving 5 times reaches 2**19 (about 2**20 fits this model's gradients)
    assert run["skipped"][:5] == [0, 1, 2, 3, 4] and run["scales"][5] == 2.0 ** 19
    assert run["accuracy"] >= precision_checks.MIN_ACCURACY
    never_backs_off = precision_checks.train_with_scaler(type("Static", (), {
        "scale": 2.0 ** 24, "update": lambda self, found_inf: not found_inf})())
    assert len(never_backs_off["skipped"]) == len(never_backs_off["scales"])  # every step overflows: nothing learnt
    assert never_backs_off["accuracy"] < 0.2


def with_update(update):
    return type("Wrong", (LossScaler,), {"update": update})


def grows_late(self, found_inf):
    if found_inf:
        self.scale *= self.backoff_factor
        self.good_steps = 0
        return False
    self.good_steps += 1
    if self.good_steps > self.growth_interval:
        self.scale *= self.growth_factor
        self.good_steps = 0
    return True


def no_reset(self, found_inf):
    if found_inf:
        self.scale *= self.backoff_factor
        return False
    self.good_steps += 1
    if self.good_steps % self.growth_interval == 0:
        self.scale *= self.growth_factor
    return True


def steps_anyway(self, found_inf):
    LossScaler.update(self, found_inf)
    return True


def static(self, found_inf):
    return not found_inf


def returns_nothing(self, found_inf):
    LossScaler.update(self, found_inf)


@pytest.mark.parametrize("update, problem, hint", [
    (grows_late, "scale is 1024, expected 2048", "when it reaches self.growth_interval (not one step later)"),
    (no_reset, "after update 4 of the sequence [ok, ok, inf, ok]: scale is 1024, expected 512",
     "an overflow sets the count of good steps back to 0"),
    (steps_anyway, "update returned True, expected False", "False after an overflow"),
    (static, "scale is 1024, expected 2048", "multiply self.scale by self.growth_factor"),
    (returns_nothing, "update returned None", "update returns whether the optimizer may step"),
])
def test_wrong_scalers_fail_with_their_hint(update, problem, hint):
    with pytest.raises(AssertionError) as failure:
        precision_checks.check_loss_scaler(with_update(update))
    assert problem in str(failure.value) and hint in str(failure.value), str(failure.value)


def test_a_stub_and_a_crash_are_learner_errors():
    def stub(self, found_inf):
        raise NotImplementedError()

    with pytest.raises(LearnerError, match=STUB_HINT.split(":")[0]):
        precision_checks.check_loss_scaler(with_update(stub))
    with pytest.raises(LearnerError, match="your update raised ZeroDivisionError"):
        precision_checks.check_loss_scaler(with_update(lambda self, found_inf: 1 / 0))
    with pytest.raises(AssertionError, match="scale is 'big', expected a number"):
        precision_checks.check_loss_scaler(type("Str", (LossScaler,), {"update": lambda self, f: setattr(
            self, "scale", "big") or True}))
