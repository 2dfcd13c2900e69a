"""The checks of exercise 11: a dynamic loss scaler you wrote, checked against the rule on
scripted overflow sequences and by training the digits MLP in float16 with it.

Dynamic loss scaling (Micikevicius et al., "Mixed Precision Training", ICLR 2018, section 3.2;
the rule of ``torch.amp.GradScaler.update``): the loss is multiplied by a scale S before the
backward pass, so that small float16 gradients do not underflow to 0; the gradients are
divided by S before the optimizer step. After each backward:

- some gradient is inf or NaN (S was too large: a product overflowed float16's 65504): the
  step is **skipped**, S is multiplied by ``backoff_factor`` (0.5), the count of good steps
  goes back to 0;
- otherwise the step is applied and the count grows by one; when it reaches
  ``growth_interval``, S is multiplied by ``growth_factor`` (2) and the count goes back to 0.

Your scaler is a class built as ``LossScaler(init_scale, growth_factor, backoff_factor,
growth_interval)`` with an attribute ``scale`` (the current S, a float) and a method
``update(found_inf) -> bool`` that applies the rule and returns whether the optimizer may step.
:func:`check_loss_scaler` checks, in this order, with a hint for each failure:

1. scripted sequences of overflows (found_inf True/False) against :func:`reference_update`:
   after every call, the returned flag and the scale, for several factors and intervals (the
   first step that differs is named, with the sequence up to it);
2. training: the digits MLP (64-128-10, seed 0) under ``precision.autocast("fp16")`` for
   :data:`EPOCHS` epochs, S starting at 2**24 (far too large, so the first steps overflow) and
   growing every :data:`GROWTH_INTERVAL` good steps, your scaler deciding every step. The scale
   after every step must equal the reference's, and the test accuracy must reach
   :data:`MIN_ACCURACY`.

Each failure raises ``AssertionError("what: problem\\nHint: ...")``; when your code raises (a
stub, an error inside update), :class:`minidist.course.checks.LearnerError` with your line. The
checks' own :class:`ReferenceScaler` (or a subclass of it) as the answer fails, as does calling
the engine's ``GradScaler`` from yours. On
success it returns a one-line verdict::

    from minidist.course.checks import precision as precision_checks
    print(precision_checks.check_loss_scaler(LossScaler))
"""
from __future__ import annotations

import math

import numpy as np

from minidist import data, nn, optim, precision, train
from minidist.course.checks import call_learner, check_own_code, fail, forbidding
from minidist.functions import cross_entropy
from minidist.tensor import Tensor

INIT_SCALE = 2.0 ** 24  # training: far above what float16 holds for this model's gradients (about 2**20)
GROWTH_INTERVAL = 20
EPOCHS, LR, BATCH = 3, 0.05, 32
MIN_ACCURACY = 0.93  # the reference reaches 0.9556 (fp32 with the same settings: 0.9556)

# (growth_factor, backoff_factor, growth_interval, found_inf sequence): hand-written cases, each
# aimed at one mistake (growing one step late or early, not resetting the count on an overflow,
# growing on the overflow step, other factors, a long run past one interval).
SCRIPTS = [
    (2.0, 0.5, 3, [False] * 7),
    (2.0, 0.5, 3, [False, False, True, False, False, False, False]),
    (2.0, 0.5, 3, [True, True, True, False]),
    (2.0, 0.5, 1, [False, True, False, False, True]),
    (4.0, 0.25, 2, [False, False, False, True, False, False]),
    (2.0, 0.5, 2000, [False] * 2500 + [True] + [False] * 2000),
]

HINTS = {
    "flag": "update returns whether the optimizer may step: False after an overflow (found_inf True), True otherwise",
    "backoff": "on an overflow multiply self.scale by self.backoff_factor and set the count of good steps back to 0",
    "growth": ("on a good step add 1 to the count of good steps; when it reaches self.growth_interval (not one step "
               "later), multiply self.scale by self.growth_factor and set the count back to 0"),
    "reset": ("an overflow sets the count of good steps back to 0: the next growth needs growth_interval good steps "
              "in a row after it"),
}


def reference_update(scale: float, good_steps: int, found_inf: bool, growth_factor: float = 2.0,
                     backoff_factor: float = 0.5, growth_interval: int = 2000):
    """The dynamic loss-scaling rule, as a pure function: ``(new_scale, new_good_steps, step)``.

    scale: the current S (> 0). good_steps: good steps in a row since the last change of S.
    found_inf: whether a gradient of this step is inf or NaN. Returns S times backoff_factor,
    0 and False after an overflow; otherwise True, and S times growth_factor with 0 when the
    count reaches growth_interval, else S and the count plus one.
    Source: Micikevicius et al. 2018, section 3.2; ``torch.amp.GradScaler.update``.
    """
    if found_inf:
        return scale * backoff_factor, 0, False
    good_steps += 1
    if good_steps == growth_interval:
        return scale * growth_factor, 0, True
    return scale, good_steps, True


class ReferenceScaler:
    """:func:`reference_update` in the exercise's shape: ``scale``, ``update(found_inf) -> bool``."""

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
        self.scale, self.good_steps = float(init_scale), 0
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval

    def update(self, found_inf: bool) -> bool:
        self.scale, self.good_steps, step = reference_update(self.scale, self.good_steps, found_inf,
                                                             self.growth_factor, self.backoff_factor,
                                                             self.growth_interval)
        return step


def _build(scaler_class, init_scale, growth_factor, backoff_factor, growth_interval):
    what = (f"LossScaler(init_scale={init_scale:g}, growth_factor={growth_factor:g}, "
            f"backoff_factor={backoff_factor:g}, growth_interval={growth_interval})")
    scaler = call_learner(what, scaler_class, init_scale=init_scale, growth_factor=growth_factor,
                          backoff_factor=backoff_factor, growth_interval=growth_interval, name="your LossScaler")
    return what, scaler


def _scale_of(scaler, what) -> float:
    scale = getattr(scaler, "scale", None)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)):
        fail(what, f"scale is {scale!r}, expected a number", "keep the current loss scale in self.scale (a float)")
    if not (math.isfinite(scale) and scale > 0):
        fail(what, f"scale became {scale!r}", "the scale only ever changes by a multiplication by growth_factor or "
                                              "backoff_factor, so it stays a finite number > 0")
    return float(scale)


def _describe(sequence, upto):
    shown = ["inf" if f else "ok" for f in sequence[:upto + 1]]
    if len(shown) > 12:
        ok_run = sequence[:upto].count(False) if not any(sequence[:upto]) else None
        shown = ([f"{ok_run} x ok"] if ok_run is not None else ["..."]) + shown[-4:]
    return ", ".join(shown)


def _check_script(scaler_class, growth_factor, backoff_factor, interval, sequence) -> None:
    init = 1024.0
    what, scaler = _build(scaler_class, init, growth_factor, backoff_factor, interval)
    scale, good = init, 0
    for i, found_inf in enumerate(sequence):
        step = call_learner(what, scaler.update, found_inf, name="your update")
        scale, good, expected_step = reference_update(scale, good, found_inf, growth_factor, backoff_factor, interval)
        got = _scale_of(scaler, what)
        where = f"{what}, after update {i + 1} of the sequence [{_describe(sequence, i)}]"
        if step is None:
            fail(where, "update returned None", HINTS["flag"])
        if bool(step) != expected_step or not isinstance(step, (bool, np.bool_)):
            fail(where, f"update returned {step!r}, expected {expected_step}", HINTS["flag"])
        if got != scale:
            if found_inf:
                hint = HINTS["backoff"]
            elif any(sequence[:i]) and got > scale:
                hint = HINTS["reset"]
            else:
                hint = HINTS["growth"]
            fail(where, f"scale is {got:g}, expected {scale:g}", hint)


def train_with_scaler(scaler, epochs: int = EPOCHS, seed: int = 0) -> dict:
    """Train the digits MLP (64-128-10, ``seed``) under ``precision.autocast("fp16")`` with
    dynamic loss scaling decided by ``scaler`` (an object with ``scale`` and
    ``update(found_inf) -> bool``): each step the loss is multiplied by ``scaler.scale``,
    the float32 gradients divided by it; ``found_inf`` is whether any is inf or NaN; the SGD
    step (lr LR, momentum 0.9, batches of BATCH) runs only when ``update`` returns True.

    Returns ``{"scales": S used at each step, "skipped": the steps (from 0) that were skipped,
    "accuracy": test accuracy at the end}``. Errors raised by ``scaler`` propagate.
    """
    dataset = data.load_digits(seed=seed)
    model = nn.mlp([dataset.num_features, 128, dataset.num_classes], rng=seed)
    params = model.parameters()
    optimizer = optim.SGD(params, lr=LR, momentum=0.9)
    loader = data.DataLoader(dataset.X_train, dataset.y_train, batch_size=BATCH, seed=seed)
    scales, skipped = [], []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            scale = float(scaler.scale)
            optimizer.zero_grad()
            with precision.autocast("fp16"):
                loss = cross_entropy(model(Tensor(x)), y)
            with np.errstate(over="ignore", invalid="ignore"):  # an overflow is what we look for
                (loss * scale).backward()
                found_inf = not all(bool(np.isfinite(p.grad).all()) for p in params)
                for p in params:
                    p.grad /= np.float32(scale)
            if not scaler.update(found_inf):
                skipped.append(len(scales))
            else:
                optimizer.step()
            scales.append(scale)
    return {"scales": scales, "skipped": skipped,
            "accuracy": train.accuracy(model, dataset.X_test, dataset.y_test)}


def _check_training(scaler_class) -> dict:
    what, scaler = _build(scaler_class, INIT_SCALE, 2.0, 0.5, GROWTH_INTERVAL)
    what = f"training the digits MLP in float16 for {EPOCHS} epochs with {what}"
    reference = train_with_scaler(ReferenceScaler(INIT_SCALE, 2.0, 0.5, GROWTH_INTERVAL))
    yours = call_learner(what, train_with_scaler, scaler, name="your LossScaler")
    for step, (got, expected) in enumerate(zip(yours["scales"], reference["scales"])):
        if got != expected:
            fail(what, f"at step {step} the scale was {got:g}, the rule gives {expected:g}",
                 HINTS["backoff"] + "; " + HINTS["growth"])
    if yours["accuracy"] < MIN_ACCURACY:
        fail(what, f"test accuracy {yours['accuracy']:.4f}, expected at least {MIN_ACCURACY}",
             "skip the step (return False) exactly when found_inf is True: a skipped good step slows training, an "
             "applied overflow writes inf into the weights")
    return yours


@forbidding(precision.GradScaler.update, precision.GradScaler.step, precision.GradScaler.unscale_)
def check_loss_scaler(scaler_class) -> str:
    """Check ``scaler_class`` (the exercise's ``LossScaler``) as the module docstring lists:
    scripted overflow sequences against :func:`reference_update`, then float16 training of the
    digits MLP with the scale trace equal to the reference's and the accuracy at least
    :data:`MIN_ACCURACY`.

    Returns a one-line verdict. Raises AssertionError naming the case and what differs, with a
    hint; :class:`~minidist.course.checks.LearnerError` when ``scaler_class`` or its ``update`` raises.
    """
    check_own_code(scaler_class, "LossScaler", methods=("__init__", "update"))
    for growth_factor, backoff_factor, interval, sequence in SCRIPTS:
        _check_script(scaler_class, growth_factor, backoff_factor, interval, sequence)
    run = _check_training(scaler_class)
    return (f"LossScaler: ok ({len(SCRIPTS)} scripted overflow sequences; float16 training: "
            f"{len(run['skipped'])} of {len(run['scales'])} steps skipped, scale from {INIT_SCALE:g} to "
            f"{run['scales'][-1]:g}, test accuracy {run['accuracy']:.4f})")
