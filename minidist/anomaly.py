"""Anomaly detection: find the first op that made a NaN or an infinity (``torch.autograd.detect_anomaly``).

A loss that turns NaN says that something went wrong, not where: by the time ``fit`` sees it,
the non-finite value has flowed through every later op. Under :class:`detect_anomaly` the
engine checks, as it goes,

- every op's forward output (:meth:`minidist.tensor.Function.apply`): the first NaN or
  infinity raises :class:`AnomalyError` naming the op, e.g. ``Log (forward) produced inf in
  output 0``;
- every op's backward result (the chain-rule loop of ``Tensor.backward``): the first gradient
  with a NaN or infinity raises naming the op and the input, e.g. ``the backward of Sqrt
  returned nan in the gradient of input 0``, followed by where that op's *forward* was called
  (the Python stack recorded, only in this mode, when the op ran forward), because a backward
  runs far from the code that built the graph.

This follows PyTorch's anomaly mode (``torch.autograd.detect_anomaly``, ``set_detect_anomaly``,
``is_anomaly_enabled``), with one difference: PyTorch checks only backward results and only for
NaN; here forward outputs are checked too, and infinities count (an overflow is usually the
first step to a NaN). Like PyTorch's, the mode is slow (every op's output is scanned and every
recorded op stores a stack): turn it on to find a bug, for one step (``train --replay-step``),
not for a whole run. Off in every thread, the engine pays one read of a global per op.

The switch is per thread, as :class:`minidist.tensor.no_grad` is, so a rank simulated as a
thread (:mod:`minidist.sim`) can debug without changing the others.
"""
from __future__ import annotations

import functools
import os
import traceback

from minidist import backend, tensor

# Frames from these files are the engine's own plumbing, not the call site a reader wants.
_ENGINE_FILES = {os.path.join(os.path.dirname(__file__), name) for name in ("tensor.py", "anomaly.py")}
# The innermost frames of a forward call site shown in a backward error.
STACK_FRAMES = 8


class AnomalyError(RuntimeError):
    """An op produced a NaN or an infinity under :class:`detect_anomaly`.

    Attributes: ``op`` (the Function's class name, e.g. ``"Log"``), ``phase`` (``"forward"``
    or ``"backward"``), ``index`` (which output or input gradient), ``kind`` (``"nan"`` or
    ``"inf"``), ``forward_stack`` (a ``traceback.StackSummary`` of where the op's forward was
    called, for a backward anomaly when it was recorded, else None). A RuntimeError, as
    PyTorch's anomaly errors are."""

    def __init__(self, message, *, op, phase, index, kind, forward_stack=None):
        super().__init__(message)
        self.op, self.phase, self.index, self.kind, self.forward_stack = op, phase, index, kind, forward_stack


def is_anomaly_enabled() -> bool:
    """True inside :class:`detect_anomaly` (or after ``set_detect_anomaly(True)``) in this thread."""
    return tensor.anomaly_checker() is not None


class _Checker:
    """What the engine calls while the mode is on (``tensor.set_anomaly_checker``)."""

    def __init__(self, check_nan: bool):
        self.check_nan = check_nan

    def forward(self, fn, ctx, out) -> None:
        """After ``fn.forward``: check the output; keep the call site on a recorded op."""
        if self.check_nan:
            kind = _non_finite(out.data)
            if kind is not None:
                raise AnomalyError(f"{fn.__name__} (forward) produced {kind} in output 0 "
                                   f"(shape {tuple(out.data.shape)}); called at:\n{_format(_call_site())}",
                                   op=fn.__name__, phase="forward", index=0, kind=kind)
        if out._ctx is ctx:  # recorded for a backward: remember where
            ctx.forward_stack = _call_site()

    def backward(self, ctx, input_grads) -> None:
        """After ``ctx.fn.backward``: check each returned gradient (None is skipped)."""
        if not self.check_nan:
            return
        for index, grad in enumerate(input_grads):
            kind = None if grad is None else _non_finite(grad)
            if kind is not None:
                name = ctx.fn.__name__
                stack = getattr(ctx, "forward_stack", None)
                where = (f"; its forward was called at:\n{_format(stack)}" if stack is not None else
                         " (its forward ran before detect_anomaly was on, so its call site is unknown)")
                raise AnomalyError(f"the backward of {name} returned {kind} in the gradient of input {index}{where}",
                                   op=name, phase="backward", index=index, kind=kind, forward_stack=stack)


def _non_finite(array):
    """"nan", "inf" or None for a raw array (integer and boolean arrays are always finite)."""
    if getattr(array, "dtype", None) is None or array.dtype.kind not in "fc":
        return None
    xp = backend.get_array_module(array)
    if bool(xp.isfinite(array).all()):
        return None
    return "nan" if bool(xp.isnan(array).any()) else "inf"


def _call_site() -> traceback.StackSummary:
    """The current stack without the engine's own frames (tensor.py, anomaly.py)."""
    frames = [f for f in traceback.extract_stack() if f.filename not in _ENGINE_FILES]
    return traceback.StackSummary.from_list(frames)


def _format(stack) -> str:
    return "".join(traceback.format_list(stack[-STACK_FRAMES:])).rstrip()


def set_detect_anomaly(mode: bool, check_nan: bool = True) -> None:
    """Turn anomaly detection on or off in this thread (``torch.autograd.set_detect_anomaly``).
    ``check_nan=False`` only records the forward call sites (no checks), as in PyTorch."""
    tensor.set_anomaly_checker(_Checker(bool(check_nan)) if mode else None)


class detect_anomaly:
    """Context manager (and decorator) turning anomaly detection on in this thread
    (``torch.autograd.detect_anomaly``): every op's forward output and every backward gradient
    is checked, and the first NaN or infinity raises :class:`AnomalyError` naming the op (and,
    for a backward, where its forward was called). ``check_nan=False``: only record call sites.
    The previous mode is restored on exit, so blocks nest.

        with minidist.detect_anomaly():
            loss = cross_entropy(model(x), y)
            loss.backward()
    """

    def __init__(self, check_nan: bool = True):
        self.check_nan = check_nan

    def __enter__(self):
        self._previous = tensor.anomaly_checker()
        set_detect_anomaly(True, self.check_nan)
        return self

    def __exit__(self, *exc):
        tensor.set_anomaly_checker(self._previous)
        return False

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with detect_anomaly(self.check_nan):
                return fn(*args, **kwargs)

        return wrapper
