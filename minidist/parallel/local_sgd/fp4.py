"""Outer gradients in 4-bit floats: a communication hook for DiLoCo's pseudo-gradients.

Streaming DiLoCo (Douillard et al. 2025, section 2.3) sends the outer gradients in 4-bit floats
and keeps the outer optimizer in float32, with no loss they could measure. This hook does the
same with the 4-bit float of the OCP Microscaling formats, E2M1 (1 sign bit, 2 exponent bits,
1 mantissa bit: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), one float32 scale per fragment and
replica, s = max|v| / 6, so the largest value is exactly 6 s; each value is rounded to the
nearest point of s x the grid (its error at most half the gap there: s / 4 below 2 s, s / 2 up
to 4 s, s between 4 s and 6 s). The paper's own 4-bit format is not reproduced here.

Two codes go in a byte, so n values take ceil(n / 2) bytes, plus the 4-byte scale. As with DDP's
int8 hook (``data_parallel.comm_hooks``), 4-bit sums would overflow and the replicas' scales
differ, so the rows are *all-gathered* (ring: (p - 1)(ceil(n/2) + 4) bytes sent per replica) and
decoded and summed in rank order on every replica: every replica gets the same bytes, so the
replicas stay bit-identical. Against the float32 ring all-reduce's 2 (p - 1)/p 4n bytes that is
p / 16 of it: 8 times fewer bytes at p = 2, 4 times at p = 4, the same at p = 16. Error feedback
(``comm_hooks.ErrorFeedbackState``, keyed by the fragment) carries what rounding dropped into the
next sync of the same fragment.

    DiLoCo(params, replicas, H, comm_hook="fp4")
"""
from __future__ import annotations

import math

import numpy

from minidist import collectives
from minidist.parallel.data_parallel.comm_hooks import ErrorFeedbackState

E2M1 = numpy.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # the magnitudes of the 3 bits after the sign
_MIDPOINTS = (E2M1[1:] + E2M1[:-1]) / 2


def encode_fp4(v) -> tuple[numpy.ndarray, numpy.float32]:
    """``v`` (1-D float array) as E2M1 codes, two per byte (value 2k in the low nibble, 2k + 1 in
    the high one), and its scale s = max|v| / 6 (float32). Raises FloatingPointError for a
    non-finite value."""
    v = numpy.asarray(v)
    peak = float(numpy.max(numpy.abs(v))) if v.size else 0.0
    if not math.isfinite(peak):
        raise FloatingPointError("fp4: the pseudo-gradient holds a non-finite value")
    scale = numpy.float32(peak / 6.0)
    codes = numpy.zeros(v.size + v.size % 2, numpy.uint8)
    if scale > 0:
        codes[:v.size] = numpy.searchsorted(_MIDPOINTS, numpy.abs(v) / v.dtype.type(scale)).astype(numpy.uint8)
        codes[:v.size] |= (v < 0).astype(numpy.uint8) << 3
    return codes[0::2] | (codes[1::2] << 4), scale


def decode_fp4(packed, scale, n, dtype=numpy.float64) -> numpy.ndarray:
    """The n values of :func:`encode_fp4`'s ``packed`` codes times ``scale``, in ``dtype``."""
    codes = numpy.empty(2 * packed.size, numpy.uint8)
    codes[0::2], codes[1::2] = packed & 15, packed >> 4
    codes = codes[:n]
    values = E2M1[codes & 7].astype(dtype) * dtype(scale)
    return numpy.where(codes >> 3 == 1, -values, values)


class Done:
    """A finished Work (``wait()`` gives ``value``): the hook's all-gather is blocking."""

    def __init__(self, value):
        self.value = value

    def wait(self):
        return self.value

    def is_completed(self):
        return True


def fp4_compress_hook(state, bucket) -> Done:
    """Average ``bucket.buffer()`` over ``bucket.comm`` in E2M1 (module docstring): encode (the
    buffer plus the residual of ``state``, an ``ErrorFeedbackState`` or None), all-gather the
    rows, decode and add them in rank order, divide by p. Returns a :class:`Done` of the average
    (the buffer's dtype)."""
    buffer, comm = bucket.buffer(), bucket.comm
    v = state.corrected(bucket) if state is not None else buffer
    packed, scale = encode_fp4(v)
    if state is not None:
        state.remember(bucket, v, decode_fp4(packed, scale, v.size, v.dtype.type))
    row = numpy.concatenate([packed, numpy.array([scale], numpy.float32).view(numpy.uint8)])
    rows = collectives.all_gather(comm, row)
    total = numpy.zeros(v.size, buffer.dtype)
    for r in range(comm.Get_size()):
        total += decode_fp4(rows[r, :-4], rows[r, -4:].copy().view(numpy.float32)[0], v.size, buffer.dtype.type)
    total /= comm.Get_size()
    return Done(total)


def fp4_hook() -> tuple[ErrorFeedbackState, object]:
    """``(state, hook)`` for DiLoCo's ``comm_hook="fp4"``: error feedback on."""
    return ErrorFeedbackState(), fp4_compress_hook
