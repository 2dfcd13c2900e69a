"""DDP communication hooks: what a bucket of gradients sends, and how (PyTorch's
``torch.distributed.algorithms.ddp_comm_hooks``).

A hook is ``hook(state, bucket) -> Work``: ``bucket`` is a :class:`GradBucket` (its flat
gradient ``bucket.buffer()``, this rank's local sum), ``state`` whatever the hook keeps
between calls (None for the stateless ones). The returned object's ``wait()`` gives the
bucket's *averaged* flat gradient, the same dtype and shape as ``bucket.buffer()``;
``is_completed()`` advances it without waiting. Register one with
``DistributedDataParallel.register_comm_hook(state, hook)`` before the first backward.
Every hook here starts its messages at once and returns (they move while backward goes on,
as the default all-reduce does), so the overlap of the buckets with backward is kept.

The hooks, and what each rank sends per bucket of n float32 elements on p ranks (ring
algorithms; ``benchmarks/bench_comm_hooks.py`` measures them):

- :func:`allreduce_hook` (the default): all-reduce the fp32 sum, divide by p afterwards
  (torch divides first; the sum-then-divide order is what minidist's DDP always did).
  2(p-1)/p * 4n bytes.
- :func:`fp16_compress_hook`: cast to float16, divide by p, all-reduce in float16 (the sums
  are float16 on the wire and in the reduction), cast back: exactly half the bytes; relative
  error about 2^-11 per element and rounding, overflow past 65504.
- :func:`bf16_compress_hook`: the same with bfloat16 (``ml_dtypes``; 8 exponent bits, so no
  overflow, 8 mantissa bits, so relative error about 2^-8). Sent as its 16 raw bits and
  summed as bfloat16 (a custom reduction in the ring), so again exactly half the bytes.
  GPU buffers are cast on the host (CuPy has no bfloat16).
- :func:`int8_compress_hook`: quantise to int8 with one scale per bucket and rank,
  s = max|v| / 127, q = rint(v / s). An int8 sum would overflow, and different ranks have
  different scales, so every rank *all-gathers* the p int8 vectors and their scales (4 bytes
  each) and adds up q_r * s_r in rank order: (p-1)(n + 4) bytes sent, (p/8) of the fp32
  all-reduce's (half at p = 4, a quarter at p = 2, *more* than fp32 past p = 8: gathering
  does not shrink as the ring's reduction does). Per element and rank the error is at most
  s_r / 2.
- :func:`topk_compress_hook`: keep the k = ceil(ratio * n) largest |v| of the bucket; the
  p (index int32, value) lists are all-gathered and added up: (p-1) k (4 + itemsize) bytes,
  p * ratio of the fp32 all-reduce for float32.

Error feedback (Seide et al., "1-Bit Stochastic Gradient Descent and its Application to
Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014; Stich, Cordonnier and
Jaggi, "Sparsified SGD with Memory", NeurIPS 2018): what compression dropped this step (the
residual e = v - C(v)) is added to the next step's gradient before compressing, so nothing
is lost, only delayed: summed over steps, the applied updates plus the mean residual equal
the sum of the true average gradients. :class:`ErrorFeedbackState` (int8) and
:class:`TopKState` (top-k) keep one residual per bucket and rank.

Every rank gets identical bytes (the ring all-reduce hands every rank the same chunks; the
all-gathers are decoded in rank order), so the replicas stay identical. Hooks are not
called on one rank (nothing is sent; the local gradient is the average).
"""
from __future__ import annotations

import math

import numpy

from minidist import backend, precision
from minidist.async_collectives import all_reduce, start
from minidist.collectives import all_reduce_steps, chunk_bounds, ring_all_gather_steps
from minidist.costmodel import choose_all_reduce
from minidist.p2p import stage_to_host

DEFAULT_TOPK_RATIO = 0.01


class GradBucket:
    """One bucket as a hook sees it (``torch.distributed.GradBucket``'s methods).

    ``buffer()``: the flat gradient, 1-D, the parameters' dtype (this rank's local sum; a hook
    must not write to it before its Work is done). ``index()``: the bucket's number (0 holds the
    last layers). ``parameters()`` / ``gradients()``: the bucket's Tensors and their gradient
    arrays (views of ``buffer()``). ``is_last()``: the last bucket of the backward pass.
    Attributes (minidist's, since a hook here needs no process group): ``comm``, the
    communicator to send on (DDP's byte-counting one), ``world_size`` and ``algorithm`` (the
    all-reduce algorithm DDP was given).
    """

    def __init__(self, index, buffer, params, offsets, is_last, comm, algorithm="auto"):
        self._index, self._buffer, self._params, self._offsets = index, buffer, params, offsets
        self._is_last, self.comm, self.algorithm = is_last, comm, algorithm
        self.world_size = comm.Get_size()

    def index(self):
        """The bucket's number, an int (0: the first one reduced, holding the last layers)."""
        return self._index

    def buffer(self):
        """The flat local gradient: a 1-D array of the parameters' dtype, on their device."""
        return self._buffer

    def parameters(self):
        """The bucket's parameters (Tensors), in buffer order."""
        return list(self._params)

    def gradients(self):
        """Each parameter's gradient as a view of ``buffer()``, in the parameter's shape."""
        return [self._buffer[a:b].reshape(p.shape) for p, a, b in zip(self._params, self._offsets, self._offsets[1:])]

    def is_last(self):
        """True for the last bucket of the backward pass."""
        return self._is_last


class FutureWork:
    """A hook's result: a Work whose value goes through ``then`` once (torch's
    ``Future.then``). ``wait()`` -> ``then(work.wait())`` (computed once, then cached);
    ``is_completed()``, ``start_time``, ``end_time``: the inner Work's."""

    def __init__(self, work, then):
        self._work, self._then, self._value, self._waited = work, then, None, False

    def is_completed(self):
        """True once the messages are done (advances them without waiting)."""
        return self._work.is_completed()

    def wait(self):
        """The hook's value: ``then`` of the Work's result, waiting with the collectives' deadline."""
        if not self._waited:
            self._value, self._waited = self._then(self._work.wait()), True
        return self._value

    @property
    def start_time(self):
        return self._work.start_time

    @property
    def end_time(self):
        return self._work.end_time


class ErrorFeedbackState:
    """The memory of error feedback (Seide et al. 2014; Stich et al. 2018): one residual per
    bucket (a flat array of the bucket's dtype and size, on this rank), added to the next
    gradient of that bucket before compressing. ``error_feedback=False`` keeps none (plain
    compression). ``residuals``: {bucket index: array}, empty until the first step."""

    def __init__(self, error_feedback=True):
        self.error_feedback = bool(error_feedback)
        self.residuals = {}

    def corrected(self, bucket):
        """The bucket's gradient plus its residual (a new array; the buffer is left as is)."""
        v = bucket.buffer().copy()
        residual = self.residuals.get(bucket.index())
        if self.error_feedback and residual is not None:
            if residual.shape != v.shape:
                raise ValueError(f"{type(self).__name__}: the residual of bucket {bucket.index()} holds "
                                 f"{residual.size} values, the bucket {v.size} (a state of another model?)")
            v += backend.to_device(residual, backend.device_of(v))
        return v

    def remember(self, bucket, corrected, sent):
        """Keep ``corrected - sent`` (what compression dropped) for the bucket's next step."""
        if self.error_feedback:
            self.residuals[bucket.index()] = corrected - sent

    def state_dict(self):
        """What a checkpoint keeps (``torch.distributed.algorithms.ddp_comm_hooks``' PowerSGD
        state is saved the same way): ``{"error_feedback": bool, "residuals": {str(bucket
        index): copy of the residual}}`` (string keys: JSON's). The residuals differ per rank,
        so a data-parallel checkpoint holds one state per rank."""
        return {"error_feedback": self.error_feedback,
                "residuals": {str(index): residual.copy() for index, residual in self.residuals.items()}}

    def load_state_dict(self, state):
        """Restore a :meth:`state_dict` (the residuals move to a bucket's device at its next
        step). Raises ValueError naming the field for a missing key, another
        ``error_feedback`` setting, or a residual that is not a 1-D floating array."""
        _require(state, ("error_feedback", "residuals"), type(self).__name__)
        if bool(state["error_feedback"]) != self.error_feedback:
            raise ValueError(f"{type(self).__name__}.load_state_dict: error_feedback is {state['error_feedback']} "
                             f"in the state, {self.error_feedback} here")
        residuals = {}
        for key, residual in dict(state["residuals"]).items():
            if getattr(residual, "ndim", None) != 1 or residual.dtype.kind != "f":
                raise ValueError(f"{type(self).__name__}.load_state_dict: residuals[{key!r}] must be a 1-D floating "
                                 f"array, got {getattr(residual, 'shape', type(residual).__name__)}")
            residuals[int(key)] = residual.copy()
        self.residuals = residuals


class TopKState(ErrorFeedbackState):
    """State of :func:`topk_compress_hook`: ``ratio`` in (0, 1], the fraction of each bucket's
    elements sent (k = ceil(ratio * n), at least 1), plus the error-feedback residuals.
    Raises ValueError for a ratio outside (0, 1]."""

    def __init__(self, ratio=DEFAULT_TOPK_RATIO, error_feedback=True):
        if not 0 < ratio <= 1:
            raise ValueError(f"TopKState: ratio must be in (0, 1] (the fraction of elements sent), got {ratio!r}")
        super().__init__(error_feedback)
        self.ratio = float(ratio)

    def state_dict(self):
        """The error-feedback state plus ``ratio``."""
        return {**super().state_dict(), "ratio": self.ratio}

    def load_state_dict(self, state):
        """Restore a :meth:`state_dict`. Raises ValueError, as the base class, and when the saved
        ``ratio`` is not this one (``--topk-ratio`` changed)."""
        _require(state, ("ratio",), "TopKState")
        if float(state["ratio"]) != self.ratio:
            raise ValueError(f"TopKState.load_state_dict: ratio is {state['ratio']} in the state, {self.ratio} here")
        super().load_state_dict(state)


# ---------------------------------------------------------------------------------------
# The hooks
# ---------------------------------------------------------------------------------------


def allreduce_hook(state, bucket):
    """The default: all-reduce the bucket's sum in its own dtype, then divide by p
    (``default_hooks.allreduce_hook``; torch divides before). ``state`` must be None.
    Returns a FutureWork of the averaged flat gradient (a new array)."""
    _no_state(state, "allreduce_hook")
    p = bucket.world_size
    work = all_reduce(bucket.comm, bucket.buffer(), op="sum", algorithm=bucket.algorithm, validate=False,
                      async_op=True)

    def average(total):
        total /= p
        return total

    return FutureWork(work, average)


def fp16_compress_hook(state, bucket):
    """Cast to float16, divide by p, all-reduce in float16, cast back to the bucket's dtype
    (``default_hooks.fp16_compress_hook``). Half the bytes of a float32 all-reduce (same
    algorithm and chunks). Values past float16's range (65504 after dividing by p) become inf.
    ``state`` must be None. Returns a FutureWork of the averaged flat gradient."""
    _no_state(state, "fp16_compress_hook")
    buffer, p = bucket.buffer(), bucket.world_size
    compressed = buffer.astype(numpy.float16)
    compressed /= numpy.float16(p)
    work = all_reduce(bucket.comm, compressed, op="sum", algorithm=bucket.algorithm, validate=False, async_op=True)
    return FutureWork(work, lambda total: total.astype(buffer.dtype))


def bf16_compress_hook(state, bucket):
    """Cast to bfloat16 (``ml_dtypes.bfloat16``), divide by p, all-reduce summing in bfloat16,
    cast back (``default_hooks.bf16_compress_hook``). The messages carry the 16 raw bits (MPI
    has no bfloat16 type), so the bytes are exactly half of float32's. ``state`` must be None.
    Returns a FutureWork of the averaged flat gradient. Raises ImportError naming the fix when
    ml_dtypes is missing."""
    _no_state(state, "bf16_compress_hook")
    bf16 = precision.bfloat16()  # ml_dtypes, imported on first use
    buffer, p, comm = bucket.buffer(), bucket.world_size, bucket.comm
    host = backend.to_numpy(buffer)
    compressed = host.astype(bf16)
    compressed /= numpy.array(p, dtype=bf16)
    bits = compressed.view(numpy.uint16)
    algorithm = bucket.algorithm
    if algorithm == "auto":
        algorithm = choose_all_reduce(bits.nbytes, p)
    result = numpy.empty_like(bits)  # all_reduce_steps writes every element of it

    def add_bf16(a, b, out):  # a ufunc as all_reduce_steps wants it: the result is out, returned
        numpy.add(a.view(bf16), b.view(bf16), out=out.view(bf16))
        return out

    work = start(comm, lambda tag: all_reduce_steps(comm, algorithm, bits, result, add_bf16, tag), result)
    device = backend.device_of(buffer)
    return FutureWork(work, lambda total: backend.to_device(total.view(bf16).astype(buffer.dtype), device))


def int8_compress_hook(state, bucket):
    """Quantise (gradient + residual) to int8 with one scale s = max|v| / 127 (a float32) per
    bucket and rank, all-gather the p int8 vectors with their scales, and average
    sum_r q_r * s_r / p in rank order (module docstring: why an all-gather, and its bytes).

    state: an :class:`ErrorFeedbackState` (error feedback on or off) or None (no error
    feedback). Returns a FutureWork of the averaged flat gradient, the bucket's dtype; per
    element it differs from the average of the ranks' (corrected) gradients by at most the
    mean of s_r / 2. Raises TypeError for another state."""
    state = _state(state, ErrorFeedbackState, "int8_compress_hook", "ErrorFeedbackState()")
    xp, buffer, p = backend.get_array_module(bucket.buffer()), bucket.buffer(), bucket.world_size
    v = state.corrected(bucket) if state is not None else buffer
    peak = float(xp.max(xp.abs(v))) if v.size else 0.0
    scale = numpy.float32(peak / 127.0)
    if not math.isfinite(float(scale)):
        raise FloatingPointError(f"int8_compress_hook: bucket {bucket.index()} holds a non-finite gradient")
    q = xp.clip(xp.rint(v / scale), -127, 127).astype(xp.int8) if scale > 0 else xp.zeros(v.size, xp.int8)
    if state is not None:
        state.remember(bucket, v, q.astype(v.dtype) * v.dtype.type(scale))
    n = v.size
    packed = xp.empty((p, n + 4), dtype=xp.int8)
    packed[bucket.comm.Get_rank(), :n] = q
    packed[bucket.comm.Get_rank(), n:] = xp.asarray(numpy.array([scale], numpy.float32).view(numpy.int8))

    def decode(gathered):
        rows = gathered.reshape(p, n + 4)
        scales = backend.to_numpy(rows[:, n:]).copy().view(numpy.float32).reshape(p)
        total = xp.zeros(n, dtype=buffer.dtype)
        for r in range(p):
            total += rows[r, :n].astype(buffer.dtype) * buffer.dtype.type(scales[r])
        total /= p
        return total

    return FutureWork(_all_gather_rows(bucket.comm, packed), decode)


def topk_compress_hook(state, bucket):
    """Send only the k = ceil(state.ratio * n) largest |gradient + residual| entries of the
    bucket: every rank all-gathers the p lists of (int32 index, value), adds them up in rank
    order and divides by p. The entries not sent stay in the residual (error feedback, Stich
    et al. 2018) unless ``state.error_feedback`` is False.

    state: a :class:`TopKState`. Returns a FutureWork of the averaged flat gradient (the
    bucket's dtype). Raises TypeError for another state."""
    if not isinstance(state, TopKState):
        raise TypeError(f"topk_compress_hook needs a TopKState (e.g. TopKState(ratio=0.01)) as its state, got "
                        f"{type(state).__name__}")
    buffer, p = bucket.buffer(), bucket.world_size
    xp = backend.get_array_module(buffer)
    v = state.corrected(bucket)
    n = v.size
    k = max(1, min(n, math.ceil(state.ratio * n)))
    index = xp.argpartition(xp.abs(v), n - k)[n - k:].astype(xp.int32)
    values = v[index]
    sent = xp.zeros_like(v)
    sent[index] = values
    state.remember(bucket, v, sent)
    width = 4 + v.dtype.itemsize
    packed = xp.empty((p, k * width), dtype=xp.uint8)
    packed[bucket.comm.Get_rank(), :4 * k] = index.view(xp.uint8)
    packed[bucket.comm.Get_rank(), 4 * k:] = xp.ascontiguousarray(values).view(xp.uint8)

    def decode(gathered):
        rows = gathered.reshape(p, k * width)
        total = xp.zeros(n, dtype=buffer.dtype)
        for r in range(p):
            idx = rows[r, :4 * k].view(xp.int32)
            total[idx] += rows[r, 4 * k:].view(v.dtype)  # indices of one rank are distinct
        total /= p
        return total

    return FutureWork(_all_gather_rows(bucket.comm, packed), decode)


HOOKS = {"none": allreduce_hook, "fp16": fp16_compress_hook, "bf16": bf16_compress_hook,
         "int8": int8_compress_hook, "topk": topk_compress_hook}
COMM_HOOKS = tuple(HOOKS)  # the names of ``train --comm-hook``


def comm_hook(name, topk_ratio=DEFAULT_TOPK_RATIO):
    """``(state, hook)`` for a ``train --comm-hook`` name (one of COMM_HOOKS): int8 gets an
    ``ErrorFeedbackState()``, topk a ``TopKState(topk_ratio)``, the others None. Raises
    ValueError for an unknown name (naming the choices) or a bad ratio."""
    if name not in HOOKS:
        raise ValueError(f"unknown comm hook {name!r}; choose one of {COMM_HOOKS}")
    state = {"int8": ErrorFeedbackState, "topk": lambda: TopKState(topk_ratio)}.get(name, lambda: None)()
    return state, HOOKS[name]


# ---------------------------------------------------------------------------------------
# Plumbing
# ---------------------------------------------------------------------------------------


# Ring all-gather of equal rows: rows[rank] is this rank's; every row arrives everywhere
# ((p-1) alpha + (p-1) row bytes beta, collectives' ring). Staged through the host for GPU rows.
def _all_gather_rows(comm, rows):
    host, back = stage_to_host(comm, rows)
    flat = host.reshape(-1)
    bounds = chunk_bounds(flat.size, comm.Get_size())
    work = start(comm, lambda tag: ring_all_gather_steps(comm, flat, bounds, tag), flat)
    return FutureWork(work, back)


def _no_state(state, name):
    if state is not None:
        raise TypeError(f"{name} keeps no state: register it with state=None (minidist's hooks send on DDP's "
                        f"communicator, not a process group), got {type(state).__name__}")


def _require(state, keys, name):
    missing = [key for key in keys if key not in state]
    if missing:
        raise ValueError(f"{name}.load_state_dict: the state lacks {', '.join(missing)}")


def _state(state, kind, name, example):
    if state is not None and not isinstance(state, kind):
        raise TypeError(f"{name} needs {kind.__name__} or None as its state (e.g. {example}), got "
                        f"{type(state).__name__}")
    return state
