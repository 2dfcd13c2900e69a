"""The pipeline executor: run a schedule's actions over real stages and a communicator.

A schedule (:mod:`minidist.parallel.pipeline.schedules`) is pure data: for each rank, the
ordered list of actions ``2F0`` (stage 2, forward, micro-batch 0), ``1B3``, and for
zero-bubble ``I`` (input gradient) and ``W`` (weight gradient). This module carries those
actions out, the way ``torch.distributed.pipelining`` does:

- ``F`` on stage s, micro-batch i: take micro-batch i of the input (first stage) or
  receive stage s-1's activation; run the stage's submodule; on the last stage apply the
  loss to micro-batch i of the target; otherwise send the activation to stage s+1. The
  stage keeps its input and output until the backward of i: that is the activation
  memory a schedule decides (GPipe holds all m micro-batches, 1F1B at most p - s).
- ``B``: receive the gradient of the output from stage s+1 (the last stage starts from
  its loss, scaled by 1/m so that the parameters end up holding the gradient of the *mean*
  micro-batch loss, torch's ``scale_grads``), run backward, send the input's gradient to
  stage s-1.
- ``I`` then ``W`` (zero-bubble, Qi et al., ICLR 2024): ``I`` is the part of ``B`` that the
  previous stage waits for (the input gradient, :meth:`Tensor.backward_input`); ``W``
  computes the weight gradients later, in what would otherwise be a bubble.

Messages. Activations go forward and gradients backward through :mod:`minidist.p2p`, the
engine's one message layer: ``Isend`` (a non-blocking send, completed at the end of the
step) and a receive completed by p2p's wait with a deadline, so two neighbours that send to
each other at the same time never deadlock, even when MPI (or the strict simulator) makes a
large ``Send`` wait for its receive. A GPU array goes by the host unless MPI is CUDA-aware
(p2p's staging). The deadline is the stage's ``timeout``, by default p2p's
(``p2p.get_timeout()``, which ``train --timeout`` sets); past it the waiting stage raises
:class:`PipelineTimeout` naming the silent rank. Shapes are agreed once, not per
message: micro-batch sizes are broadcast at the start of each step, and each boundary's
trailing shape and dtype travel in one small header the first time the boundary is used.
Each message has its own tag (stage, micro-batch, direction), so the order in which a
rank receives never has to match the order in which its neighbour sent.

Every action's start and end time is recorded in ``schedule.timeline`` for pictures, and
the bytes each stage holds for backward are counted (``stage.activation_bytes``,
``stage.peak_activation_bytes``, by :func:`minidist.memory.saved_bytes`).

Recomputation (torchgpipe's ``checkpoint`` modes; Kim et al., "torchgpipe", 2020): with
``checkpoint="always"`` every micro-batch's stage forward goes through
:func:`minidist.recompute.checkpoint`, so a stage keeps only the micro-batch's input until
its backward and runs the forward again then; ``"except_last"`` spares the last micro-batch
(under GPipe its backward follows its forward at once, so recomputing it would buy nothing);
``"never"`` (the default) keeps every activation. Under zero-bubble a checkpointed
micro-batch computes its weight gradients in I (a recomputation is not split).

Longer than 400 lines: PipelineStage and the schedules that run it share the executor's state
(buffers, pending sends, the deadline), as torch.distributed.pipelining's do.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy

from minidist import backend, memory, p2p, precision, recompute
from minidist.parallel.pipeline import schedules as S
from minidist.tensor import Tensor

# The one-off header that carries a boundary's shape and dtype goes on tag META_TAG + stage index;
# the data messages of a step use the tags below it (PipeDream's streams are sized to fit under it).
META_TAG = 30_000
_MAX_NDIM = 8
HEADER_BYTES = (2 + _MAX_NDIM) * 8  # the header: ndim, dtype character, the trailing shape padded (int64)


class PipelineError(RuntimeError):
    """A pipeline that cannot run as asked: bad stage placement, a missing input or target,
    a neighbour that went silent past the deadline. The message names the fix or the rank."""


class PipelineTimeout(PipelineError, p2p.CollectiveTimeout):
    """A stage waited past its deadline for a neighbour's message: p2p's CollectiveTimeout
    (``rank``: the waiting rank, ``missing``: the ranks it has not heard from, both named in
    the message) and a PipelineError."""

    def __init__(self, message, rank=None, missing=()):
        p2p.CollectiveTimeout.__init__(self, message, rank, missing)


# ----------------------------------------------------------------------------- one stage


class PipelineStage:
    """One stage of a pipeline: a submodule, its index, and the communicator (**contract**).

    Mirrors ``torch.distributed.pipelining.PipelineStage(submodule, stage_index, num_stages,
    device)``; here the communicator replaces the device. Stage s lives on rank
    ``s % comm.Get_size()``: one stage per rank (GPipe, 1F1B, zero-bubble), or v stages per
    rank placed round-robin (interleaved 1F1B: rank r holds r, r + p, ...).

    Args:
        submodule: the layers of this stage (an ``nn.Module``); its input is an array
            of shape (micro-batch, *features).
        stage_index: this stage's place, 0 <= stage_index < num_stages.
        num_stages: stages in the whole pipeline.
        comm: an mpi4py communicator or a ``minidist.sim`` one (the pipeline group).
        timeout: seconds to wait for a neighbour's message; None (the default): p2p's
            deadline at each wait (``p2p.get_timeout()``, 300 s unless set).

    Raises:
        PipelineError: the stage index is out of range, does not belong to this rank, or
            num_stages is not a multiple of the communicator's size.
    """

    def __init__(self, submodule, stage_index: int, num_stages: int, comm, *, timeout: float | None = None):
        p, rank = comm.Get_size(), comm.Get_rank()
        if not (isinstance(num_stages, int) and num_stages >= 1):
            raise PipelineError(f"PipelineStage: num_stages must be a positive int, got {num_stages!r}")
        if not (isinstance(stage_index, int) and 0 <= stage_index < num_stages):
            raise PipelineError(f"PipelineStage: stage_index must be in [0, {num_stages}), got {stage_index!r}")
        if num_stages % p:
            raise PipelineError(f"PipelineStage: {num_stages} stages cannot be spread evenly over {p} ranks; "
                                f"use a multiple of {p} stages")
        if stage_index % p != rank:
            raise PipelineError(f"PipelineStage: stage {stage_index} lives on rank {stage_index % p} "
                                f"(stage s on rank s % {p}), not on rank {rank}")
        if timeout is not None and not (isinstance(timeout, (int, float)) and 0 < timeout < math.inf):
            raise PipelineError(f"PipelineStage: timeout must be a positive number of seconds, got {timeout!r}")
        self.submodule, self.stage_index, self.num_stages, self.comm = submodule, stage_index, num_stages, comm
        self.timeout = timeout
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.prev_rank = (stage_index - 1) % p  # pp_prev_rank: where activations come from
        self.next_rank = (stage_index + 1) % p  # pp_next_rank: where they go
        self._in_meta = None  # (trailing shape, dtype) of the input, agreed once
        self.waited = 0.0  # seconds spent waiting for messages (reset by the schedule per action)
        self._out_meta_sent = False
        self._reset()
        self.peak_activation_bytes = 0
        self.peak_in_flight = 0  # the most micro-batches held at once (the simulator's peak_in_flight)
        self.messages_sent = 0
        self.bytes_sent = 0

    def _reset(self):
        self._inputs, self._outputs = {}, {}
        self._held = {}  # micro-batch -> its output until its backward; after an I (zero-bubble), its W pass
        self._send_requests = []

    @property
    def activation_bytes(self) -> int:
        """Bytes this stage holds now for the backward passes still to come (each array
        once: :func:`minidist.memory.saved_bytes`)."""
        graphs = [held for held in self._held.values() if isinstance(held, Tensor)]
        deferred = [held for held in self._held.values() if not isinstance(held, Tensor)]
        # after I (zero-bubble) a micro-batch still holds its ops' inputs and output gradients for W
        return memory.saved_bytes(*graphs) + sum(memory.contexts_bytes(d.contexts) +
                                                 sum(g.nbytes for g in d.output_grads) for d in deferred)

    @property
    def in_flight(self) -> int:
        """Micro-batches whose forward ran and whose backward has not completed (B, or W for
        zero-bubble: W still needs the stage's inputs, as the schedule simulator counts)."""
        return len(self._held)

    def __repr__(self):
        return f"PipelineStage({self.stage_index} of {self.num_stages}, rank {self.comm.Get_rank()})"

    # ---------------------------------------------------------------- messages
    def _tag(self, receiving_stage: int, microbatch: int, backward: bool, num_microbatches: int) -> int:
        return 1 + 2 * (receiving_stage * num_microbatches + microbatch) + int(backward)

    def _send(self, array, dest, tag):
        array, _ = p2p.stage_to_host(self.comm, array)  # a GPU array goes by the host unless MPI is CUDA-aware
        array = backend.get_array_module(array).ascontiguousarray(array)
        requests, _, _ = p2p.post_send(self.comm, precision.wire_view(array), dest, tag)  # bfloat16 goes as uint16
        self._send_requests.append((requests[0], dest, array))  # the array lives until the send completes
        self.messages_sent += 1
        self.bytes_sent += array.nbytes

    def _recv(self, shape, dtype, like, source, tag, what):
        buf, back = p2p.receive_buffer(self.comm, shape, dtype, like)
        self._wait(*p2p.post_recv(self.comm, precision.wire_view(buf), source, tag),
                   f"stage {self.stage_index} waiting for {what}")
        return back(buf)

    def _send_meta(self, array):
        header = numpy.zeros(2 + _MAX_NDIM, dtype=numpy.int64)
        trailing = array.shape[1:]
        if len(trailing) > _MAX_NDIM:
            raise PipelineError(f"stage {self.stage_index}: activations of {array.ndim} dimensions; "
                                f"at most {_MAX_NDIM + 1}")
        header[0], header[1] = len(trailing), ord(numpy.dtype(array.dtype).char)
        header[2:2 + len(trailing)] = trailing
        self._send(header, self.next_rank, META_TAG + self.stage_index + 1)

    def _recv_meta(self):
        header = numpy.empty(2 + _MAX_NDIM, dtype=numpy.int64)
        self._wait(*p2p.post_recv(self.comm, header, self.prev_rank, META_TAG + self.stage_index),
                   f"stage {self.stage_index} waiting for the activation shape")
        ndim = int(header[0])
        return tuple(int(d) for d in header[2:2 + ndim]), precision.dtype_from_char(chr(int(header[1])))

    def wait_sends(self):
        """Complete every send this stage started (called at the end of a step)."""
        if self._send_requests:
            self._wait([r for r, _, _ in self._send_requests], [dest for _, dest, _ in self._send_requests], 0,
                       f"stage {self.stage_index} sending activations and gradients")
        self._send_requests = []

    def _wait(self, requests, peers, receives, what):
        """Wait for an exchange with this stage's deadline (:func:`minidist.p2p.wait_all`, the
        engine's one wait: on the sim it joins deadlock detection) and count the seconds in
        ``waited``. Raises PipelineTimeout naming the silent rank."""
        start = time.perf_counter()
        try:
            p2p.wait_all(self.comm, requests, peers, what, receives=receives, timeout=self.timeout)
        except p2p.CollectiveTimeout as error:
            raise PipelineTimeout(f"{error} (did that rank stop, or run a different schedule?)", error.rank,
                                  error.missing) from None
        finally:
            self.waited += time.perf_counter() - start

    # ---------------------------------------------------------------- the actions
    def forward(self, microbatch: int, x, sizes, target, loss_fn, losses, num_microbatches, checkpoint=False):
        """Action F: forward of one micro-batch (see the module docstring); with
        ``checkpoint`` the submodule runs under :func:`minidist.recompute.checkpoint`."""
        like = next(iter(p.data for p in self.submodule.parameters()), numpy.empty(0))
        if self.is_first:
            data = backend.to_device(x, backend.device_of(like))  # the loader's batch is on the host
        else:
            if self._in_meta is None:
                self._in_meta = self._recv_meta()
            trailing, dtype = self._in_meta
            data = self._recv((sizes[microbatch], *trailing), dtype, like, self.prev_rank,
                              self._tag(self.stage_index, microbatch, False, num_microbatches),
                              f"micro-batch {microbatch}'s activation")
        inp = Tensor(data, requires_grad=not self.is_first)
        out = recompute.checkpoint(self.submodule, inp) if checkpoint else self.submodule(inp)
        if self.is_last:
            loss = loss_fn(out, backend.to_device(target, backend.device_of(like)))
            losses.append(float(loss.item()))
            out = loss
        else:
            if not self._out_meta_sent:
                self._send_meta(out.data)
                self._out_meta_sent = True
            self._send(out.data, self.next_rank, self._tag(self.stage_index + 1, microbatch, False, num_microbatches))
        self._inputs[microbatch], self._outputs[microbatch] = inp, out
        self._held[microbatch] = out
        self.peak_activation_bytes = max(self.peak_activation_bytes, self.activation_bytes)
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    def backward(self, microbatch: int, num_microbatches: int, split: bool = False):
        """Action B (or I when ``split``): backward of one micro-batch; I leaves the
        weight gradients for a later W (see the module docstring)."""
        inp, out = self._inputs.pop(microbatch), self._outputs.pop(microbatch)
        if self.is_last:
            xp = backend.get_array_module(out.data)
            grad = xp.asarray(1.0 / num_microbatches, dtype=out.dtype)  # mean over micro-batches
        else:
            grad = self._recv(out.shape, out.dtype, out.data, self.next_rank,
                              self._tag(self.stage_index, microbatch, True, num_microbatches),
                              f"micro-batch {microbatch}'s gradient")
        if split:
            self._held[microbatch] = out.backward_input(grad, [inp])  # the W pass still to run
        else:
            out.backward(grad)
            del self._held[microbatch]
        if not self.is_first:
            self._send(inp.grad, self.prev_rank, self._tag(self.stage_index - 1, microbatch, True, num_microbatches))

    def backward_weight(self, microbatch: int):
        """Action W: the weight gradients deferred by micro-batch ``microbatch``'s I."""
        self._held.pop(microbatch).run()


# ----------------------------------------------------------------------------- schedules


@dataclass
class TimelineEntry:
    """One executed action: ``action`` (torch's form, e.g. ``1F3``), its ``rank``, and its
    ``start``/``end`` in seconds since the step began. ``start`` is when the action's input
    had arrived and computing began; ``waited`` the seconds spent before that waiting for a
    neighbour's message (idle time, part of the bubble)."""

    action: str
    rank: int
    start: float
    end: float
    waited: float = 0.0


class PipelineSchedule:
    """Runs this rank's actions of a schedule for one mini-batch per :meth:`step`.

    The subclasses mirror ``torch.distributed.pipelining``: :class:`ScheduleGPipe`,
    :class:`Schedule1F1B`, :class:`ScheduleInterleaved1F1B`, :class:`ScheduleZeroBubble`.

    Args:
        stages: this rank's stage(s) (a PipelineStage, or a list for interleaved).
        n_microbatches: m, how many pieces each mini-batch is split into (axis 0).
        loss_fn: ``loss_fn(output, target) -> scalar Tensor`` (e.g. ``nn.functional.cross_entropy``);
            used on the last stage.
        checkpoint: ``"never"`` (default), ``"except_last"`` or ``"always"``: which
            micro-batches' stage forwards are recomputed in backward (torchgpipe's modes,
            module docstring): none, all but the last, all m.

    Raises:
        PipelineError: no stages, a bad ``n_microbatches`` or ``checkpoint``, or stages
            that do not fit the schedule.
    """

    stages_per_rank = 1  # interleaved schedules hold several
    CHECKPOINT_MODES = ("always", "except_last", "never")

    def __init__(self, stages, n_microbatches: int, loss_fn, *, checkpoint: str = "never"):
        stages = list(stages) if isinstance(stages, (list, tuple)) else [stages]
        if not stages or not all(isinstance(s, PipelineStage) for s in stages):
            raise PipelineError(f"{type(self).__name__}: pass this rank's PipelineStage(s)")
        if not (isinstance(n_microbatches, int) and n_microbatches >= 1):
            raise PipelineError(f"{type(self).__name__}: n_microbatches must be a positive int, got {n_microbatches!r}")
        if checkpoint not in self.CHECKPOINT_MODES:
            raise PipelineError(f"{type(self).__name__}: checkpoint must be one of {self.CHECKPOINT_MODES}, "
                                f"got {checkpoint!r}")
        # micro-batches 0 .. checkpoint_stop - 1 are recomputed (torchgpipe's checkpoint_stop)
        self.checkpoint_stop = {"always": n_microbatches, "except_last": n_microbatches - 1, "never": 0}[checkpoint]
        self.stages = {s.stage_index: s for s in stages}
        self.comm = stages[0].comm
        self.num_stages = stages[0].num_stages
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self.rank, self.world_size = self.comm.Get_rank(), self.comm.Get_size()
        if self.stages_per_rank == 1 and (len(stages) != 1 or self.num_stages != self.world_size):
            raise PipelineError(f"{type(self).__name__}: one stage per rank; got {len(stages)} stage(s) on this rank "
                                f"and {self.num_stages} stages on {self.world_size} ranks")
        self.actions = self._schedule()[self.rank]
        self.timeline: list[TimelineEntry] = []
        self.step_seconds = 0.0

    def _schedule(self):
        raise NotImplementedError

    def step(self, *args, target=None, losses=None):
        """Run one mini-batch through the pipeline: forward and backward of every
        micro-batch. Afterwards each stage's parameters hold (added to ``.grad``) the
        gradient of the mean micro-batch loss.

        Call it on every rank of the pipeline at the same time: ``step(x)`` on the rank of
        the first stage (x: the whole mini-batch, split along axis 0 into m micro-batches with
        ``numpy.array_split`` sizes), ``step(target=y, losses=[])`` on the last (per-micro-batch
        losses are appended to ``losses``), ``step()`` in between, ``step(x, target=y)`` when
        one rank holds both ends.

        Raises:
            PipelineError: x missing on the first stage or given elsewhere, target missing on
                the last, fewer rows than micro-batches, or a neighbour silent past the timeout.
        """
        m = self.n_microbatches
        x = args[0] if args else None
        has_first, has_last = 0 in self.stages, self.num_stages - 1 in self.stages
        problem = None
        if has_first and x is None:
            problem = "the rank of the first stage must pass the mini-batch: step(x)"
        elif not has_first and x is not None:
            problem = f"only the rank of the first stage passes x (this is rank {self.rank})"
        elif has_last and target is None:
            problem = "the rank of the last stage must pass the target: step(target=y)"
        elif has_first and len(x) < m:
            problem = f"a mini-batch of {len(x)} rows cannot be split into {m} micro-batches"
        sizes = [len(part) for part in numpy.array_split(numpy.empty(len(x)), m)] if has_first and not problem else None
        # one round with a deadline: any rank's problem stops every rank; rank 0 (stage 0) gives the sizes
        name = type(self).__name__

        def stop(their_problem, rank, size):
            raise PipelineError(f"{name}.step: {their_problem} (on rank {rank} of {size})")

        plans = p2p.agree(self.comm, problem, (sizes, m, type(self).__name__), raise_problem=stop)
        if len({(plan[1], plan[2]) for plan in plans}) > 1:
            listing = "; ".join(f"rank {r}: {kind}, {count} micro-batches" for r, (_, count, kind) in enumerate(plans))
            raise PipelineError(f"{name}.step: every rank of a pipeline must run the same schedule with the same "
                                f"number of micro-batches ({listing})")
        sizes = plans[0][0]
        xs = _split(x, sizes) if has_first else None
        ys = _split(target.data if isinstance(target, Tensor) else target, sizes) if has_last else None
        losses = [] if losses is None else losses
        for stage in self.stages.values():
            stage._reset()
        t0 = time.perf_counter()
        self.timeline = []
        for action in self.actions:
            stage = self.stages[action.stage]
            stage.waited = 0.0
            start = time.perf_counter() - t0
            self._run(action, xs, ys, sizes, losses)
            self.timeline.append(TimelineEntry(str(action), self.rank, start + stage.waited,
                                               time.perf_counter() - t0, stage.waited))
        for stage in self.stages.values():
            stage.wait_sends()
        self.step_seconds = time.perf_counter() - t0
        return losses

    def busy_fraction(self) -> float:
        """Share of the last step's time this rank spent computing (1 - its bubble)."""
        busy = sum(e.end - e.start for e in self.timeline)
        return busy / self.step_seconds if self.timeline else 0.0

    def _run(self, action, xs, ys, sizes, losses):
        stage, i, m = self.stages[action.stage], action.microbatch, self.n_microbatches
        if action.kind == "F":
            stage.forward(i, xs[i] if stage.is_first else None, sizes,
                          ys[i] if stage.is_last else None, self.loss_fn, losses, m, i < self.checkpoint_stop)
        elif action.kind == "B":
            stage.backward(i, m)
        elif action.kind == "I":
            stage.backward(i, m, split=True)
        elif action.kind == "W":
            stage.backward_weight(i)
        else:
            raise PipelineError(f"unknown action kind in {action}")


def _split(array, sizes):
    bounds = numpy.cumsum([0, *sizes])
    return [array[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


class ScheduleGPipe(PipelineSchedule):
    """GPipe (Huang et al., NeurIPS 2019): every forward, then every backward. Holds the
    activations of all m micro-batches at the peak."""

    def _schedule(self):
        return S.gpipe(self.num_stages, self.n_microbatches)


class Schedule1F1B(PipelineSchedule):
    """1F1B, PipeDream-Flush (Narayanan et al., ICML 2021): warm-up forwards, then one
    backward per forward, then the remaining backwards. Same bubble as GPipe, at most
    p - s micro-batches held by stage s."""

    def _schedule(self):
        return S.one_f_one_b(self.num_stages, self.n_microbatches)


class ScheduleInterleaved1F1B(PipelineSchedule):
    """Interleaved 1F1B (Narayanan et al., SC 2021): v stages per rank, placed round-robin,
    so the bubble shrinks by v at the cost of v times more messages."""

    stages_per_rank = None  # any number v >= 1, the same on every rank

    def __init__(self, stages, n_microbatches: int, loss_fn, *, checkpoint: str = "never"):
        stages = list(stages) if isinstance(stages, (list, tuple)) else [stages]
        super().__init__(stages, n_microbatches, loss_fn, checkpoint=checkpoint)
        if self.num_stages != len(stages) * self.world_size:
            raise PipelineError(f"ScheduleInterleaved1F1B: each rank passes the same number of stages; this rank "
                                f"has {len(stages)} of {self.num_stages} on {self.world_size} ranks")

    def _schedule(self):
        return S.interleaved_1f1b(self.world_size, self.n_microbatches, self.num_stages // self.world_size)


class ScheduleZeroBubble(PipelineSchedule):
    """Zero-bubble ZB-H1 (Qi et al., ICLR 2024): the backward split into I (input gradient,
    sent on at once) and W (weight gradient, deferred into the bubbles)."""

    def _schedule(self):
        return S.zero_bubble(self.num_stages, self.n_microbatches)
