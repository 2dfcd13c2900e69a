"""The value types of the command line's flags (each names what it wants; argparse adds the
flag: ``argument --lr: ...``) and the one way a command reports a run-time error."""
from __future__ import annotations

import argparse
import math
import sys

# ---------------------------------------------------------------------------------------
# Value types: each names what it wants, argparse adds the flag ("argument --lr: ...")
# ---------------------------------------------------------------------------------------


def _parse(text: str, kind):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                         f"got {text!r}") from None


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = _parse(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = _parse(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (``nan`` and ``inf`` are refused)."""
    value = _parse(text, float)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def nonnegative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    value = _parse(text, float)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def momentum(text: str) -> float:
    """argparse type: a momentum coefficient in [0, 1)."""
    value = _parse(text, float)
    if not 0 <= value < 1:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def probability(text: str) -> float:
    """argparse type: a probability in [0, 1) (a dropout rate: 1 would drop everything)."""
    value = _parse(text, float)
    if not 0 <= value < 1:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


# The static loss scales train takes (--loss-scale N), both ends included. 2^-24: float16's
# smallest subnormal, below which dynamic scaling gives up too (GradScaler.MIN_SCALE); a scale
# under 1 only makes underflow worse. 2^16 = 65536: torch's GradScaler starts there, just above
# float16's largest value (65504), and the backward pass starts from d(S * loss)/d loss = S, so
# a larger S overflows float16 gradients from the first step: measured on digits (fp16, 2
# epochs), 1e6 skipped 83 of 86 steps and ended at test accuracy 0.18, 65536 skipped none.
LOSS_SCALE_RANGE = (2.0 ** -24, 2.0 ** 16)


def loss_scale(text: str):
    """argparse type: "dynamic", "none" or a static loss scale, a number in
    :data:`LOSS_SCALE_RANGE` = [2^-24, 2^16] (why those ends: the comment above it)."""
    if text in ("dynamic", "none"):
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be dynamic, none or a number, got {text!r}") from None
    low, high = LOSS_SCALE_RANGE
    if not low <= value <= high:  # also refuses nan
        raise argparse.ArgumentTypeError(f"a static loss scale must lie in [2^-24, 2^16] = [{low:.3g}, {high:g}], "
                                         f"got {text} (dynamic, the default for fp16, finds one itself)")
    return value


def chapter(text: str) -> str:
    """argparse type: an exercise number such as ``1`` or ``01``, returned as two digits."""
    if not (text.isascii() and text.isdigit() and len(text) <= 2):
        raise argparse.ArgumentTypeError(f"{text!r} is not an exercise number such as 01")
    return text.zfill(2)


def fail(command: str, message: str) -> int:
    """Print a run-time error (not a usage error) and return exit status 1."""
    print(f"minidist {command}: error: {message}", file=sys.stderr)
    return 1
