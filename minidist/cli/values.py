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


def loss_scale(text: str):
    """argparse type: "dynamic", "none" or a finite number > 0 (static loss scaling)."""
    if text in ("dynamic", "none"):
        return text
    try:
        return positive_float(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be dynamic, none or a number > 0, got {text!r}") from None


def chapter(text: str) -> str:
    """argparse type: an exercise number such as ``1`` or ``01``, returned as two digits."""
    if not (text.isascii() and text.isdigit() and len(text) <= 2):
        raise argparse.ArgumentTypeError(f"{text!r} is not an exercise number such as 01")
    return text.zfill(2)


def fail(command: str, message: str) -> int:
    """Print a run-time error (not a usage error) and return exit status 1."""
    print(f"minidist {command}: error: {message}", file=sys.stderr)
    return 1
