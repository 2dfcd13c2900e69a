"""PipeDream: a pipeline with no flush, each stage updating its weights after every backward.

GPipe and 1F1B flush the pipeline at the end of every mini-batch: all micro-batches finish
their backward, then the optimizer steps once, and the next mini-batch starts on an empty
pipeline (the bubble). PipeDream (Narayanan et al., "PipeDream: Generalized Pipeline
Parallelism for DNN Training", SOSP 2019) never flushes: micro-batches stream through the
1F1B order, and every stage steps its optimizer as soon as it finishes a backward, so in
steady state no stage is ever idle. The price: while micro-batch i travels up and down the
pipeline, the stages it visits keep updating. On stage s, p - s micro-batches are in flight
(forward done, backward not yet), and between the forward and the backward of one of them
the stage applies p - s - 1 updates.

- **No stashing.** The backward reads the weights as they are then: the forward ran on
  version v, the backward on v + p - s - 1. The gradient belongs to no single set of
  weights (measured in ``tests/test_pipedream.py`` and chapter 09).
- **Weight stashing** (sec. 3.3): stage s keeps the version each in-flight micro-batch's
  forward used, at most p - s versions (the latest included), and swaps it in for that
  micro-batch's backward (:class:`~minidist.parallel.pipeline.stage.WeightStash`). Within a
  stage the gradient is then exact; across stages micro-batch i still meets different
  versions (stage 0 is p - 1 updates behind the last stage).
- **Vertical sync** (option, sec. 3.3): the version the input stage used for micro-batch i
  travels with its activation, and every stage runs micro-batch i on that version, so the
  whole micro-batch sees one model: W(t+1) = W(t) - lr grad f(W(t - p + 1)). Every stage
  then keeps p versions (the input stage's versions lag a later stage's own by s updates).
  A stage knows from the schedule which version each micro-batch will bring, so it keeps no
  more than that, and checks the number that arrives.
- **PipeDream-2BW** (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training",
  ICML 2021): gradients are accumulated over m >= p micro-batches (a batch) and each stage
  updates once per batch; batch t runs, on every stage, on version t - 1 (the one before the
  latest): W(t+1) = W(t) - lr grad f(W(t - 1)). Two versions per stage suffice: version t + 1
  appears when batch t's backwards are done, and from then on only batch t + 1 (on version t)
  is in flight, so version t - 1 is gone.

One :meth:`SchedulePipeDream.step` runs a stream of n micro-batches (an epoch's worth, say)
with the executor's messaging (``PipelineStage``: ``Isend`` and deadline-bounded receives,
one tag per stage, micro-batch and direction) and ends with a flush, so that the model can be
evaluated between streams. Each micro-batch is one optimizer step (2BW: one m-th of one):
the last stage starts its backward from the gradient of that micro-batch's mean loss.

With one micro-batch in flight (``in_flight=1``: F0 B0 F1 B1 ... on every stage, naive model
parallelism) PipeDream, with or without stashing or vertical sync, is sequential SGD exactly
(2BW is not: its gradients are one version old by design).
"""
from __future__ import annotations

import numpy

from minidist import backend
from minidist.parallel.pipeline import executor as E
from minidist.parallel.pipeline.schedules import Action, check_count, one_f_one_b_order
from minidist.parallel.pipeline.stage import WeightStash


def pipedream_1f1b(num_stages: int, num_microbatches: int, in_flight: int | None = None) -> list[list[Action]]:
    """PipeDream's order: 1F1B over a stream of micro-batches (Narayanan et al., SOSP 2019,
    sec. 3.2). Rank r runs min(n, max(1, k - r)) forwards, then alternates one backward and one
    forward, then the backwards left; k = ``in_flight`` (default p, PipeDream's "NOAM", the
    number of micro-batches that keeps every stage busy). With k = p this is
    :func:`~minidist.parallel.pipeline.schedules.one_f_one_b`'s list (the difference is what
    happens between the actions: an update after every backward, no flush); k = 1 is naive
    model parallelism, one micro-batch in flight. Returns ``num_stages`` lists of Actions.
    Raises ValueError for a count < 1 or k outside [1, p]."""
    p = check_count("pipedream_1f1b", "num_stages", num_stages)
    n = check_count("pipedream_1f1b", "num_microbatches", num_microbatches)
    k = p if in_flight is None else check_count("pipedream_1f1b", "in_flight", in_flight)
    if k > p:
        raise ValueError(f"pipedream_1f1b: in_flight must be at most num_stages={p} (p micro-batches keep every "
                         f"stage busy), got {k}")
    return [one_f_one_b_order(r, n, min(n, max(1, k - r))) for r in range(p)]


class PipeDreamStage(E.PipelineStage):
    """A pipeline stage that keeps weight versions (PipeDream): the executor's stage plus a
    :class:`~minidist.parallel.pipeline.stage.WeightStash` over its parameters and a log of
    the version each pass ran on. Arguments as :class:`~minidist.parallel.pipeline.executor.PipelineStage`.

    ``version_log``: one ``(kind, microbatch, version)`` per pass, kind ``"F"`` or ``"B"``,
    version counted in this stage's updates (for the tests and pictures; cleared by
    :meth:`SchedulePipeDream.step`). Raises PipelineError as PipelineStage does, and for a
    stage without parameters (it would have nothing to version).
    """

    def __init__(self, submodule, stage_index: int, num_stages: int, comm, *, timeout: float | None = None):
        super().__init__(submodule, stage_index, num_stages, comm, timeout=timeout)
        params = list(submodule.parameters())
        if not params:
            raise E.PipelineError(f"PipeDreamStage: stage {stage_index} has no parameters; give every stage a layer "
                                  "with weights")
        self.stash = WeightStash(params)
        self.version_log: list[tuple[str, int, int]] = []
        self._version_of: dict[int, int] = {}  # in-flight micro-batch -> the version its forward ran on

    def forward_at(self, version: int, microbatch: int, *args):
        """Action F on weight ``version`` (the latest costs nothing); ``args`` as
        ``PipelineStage.forward``."""
        with self.stash.use(version):
            self.forward(microbatch, *args)
        self._version_of[microbatch] = version
        self.version_log.append(("F", microbatch, version))

    def backward_at(self, version: int | None, microbatch: int, num_microbatches: int, scale: float):
        """Action B on weight ``version`` (None: the live weights, whatever they are now: no
        stashing). The last stage starts from ``scale`` (d loss / d loss, times 1 for one
        micro-batch per update, 1/m for 2BW's m). Adds to the parameters' ``.grad``."""
        self._version_of.pop(microbatch)
        used = self.stash.version if version is None else version
        with self.stash.use(used):
            self._backward(microbatch, num_microbatches, scale)
        self.version_log.append(("B", microbatch, used))

    def _backward(self, microbatch: int, num_microbatches: int, scale: float):
        # PipelineStage.backward with the last stage's seed given (it uses 1/m, a flush's mean)
        inp, out = self._inputs.pop(microbatch), self._outputs.pop(microbatch)
        if self.is_last:
            grad = backend.get_array_module(out.data).asarray(scale, dtype=out.dtype)
        else:
            grad = self._recv(out.shape, out.dtype, out.data, self.next_rank,
                              self._tag(self.stage_index, microbatch, True, num_microbatches),
                              f"micro-batch {microbatch}'s gradient")
        out.backward(grad)
        del self._held[microbatch]
        if not self.is_first:
            self._send(inp.grad, self.prev_rank, self._tag(self.stage_index - 1, microbatch, True, num_microbatches))

    # the version number that travels with an activation (vertical sync)
    def _version_tag(self, receiving_stage: int, microbatch: int, num_microbatches: int) -> int:
        return 1 + 2 * self.num_stages * num_microbatches + receiving_stage * num_microbatches + microbatch

    def send_version(self, microbatch: int, version: int, num_microbatches: int):
        """Send micro-batch ``microbatch``'s version to the next stage (with its activation)."""
        self._send(numpy.array([version], dtype=numpy.int64), self.next_rank,
                   self._version_tag(self.stage_index + 1, microbatch, num_microbatches))

    def recv_version(self, microbatch: int, num_microbatches: int) -> int:
        """The version the previous stage (hence the input stage) ran ``microbatch`` on."""
        buf = self._recv((1,), numpy.int64, numpy.empty(0), self.prev_rank,
                         self._version_tag(self.stage_index, microbatch, num_microbatches),
                         f"micro-batch {microbatch}'s weight version")
        return int(buf[0])


class SchedulePipeDream(E.PipelineSchedule):
    """PipeDream (module docstring): 1F1B with no flush over a stream of micro-batches, an
    optimizer step after every backward, with or without weight stashing, optionally with
    vertical sync.

    Args:
        stage: this rank's :class:`PipeDreamStage` (one stage per rank).
        n_microbatches: n, micro-batches per :meth:`step` (a stream: each is one update).
        loss_fn: ``loss_fn(output, target) -> scalar Tensor``, on the last stage.
        optimizer: over this stage's parameters (e.g. ``optim.SGD``); stepped in place.
        weight_stashing: run each backward on its forward's version (default True).
        vertical_sync: run every stage on the input stage's version (needs stashing).
        in_flight: micro-batches in flight, 1..p (default p); 1 is sequential SGD.
        lr_schedule: optional, stepped before each optimizer step (e.g. ``optim.WarmupLR``).

    :meth:`step` is the executor's (``step(x)`` on the first stage, ``step(target=y,
    losses=[])`` on the last, ``step()`` in between; x split into n micro-batches) and ends
    with a flush. Raises PipelineError for a bad argument (the message names it), a stage that
    is not a PipeDreamStage, or more micro-batches than message tags allow.
    """

    accumulation = 1  # backwards per update (2BW: m)

    def __init__(self, stage, n_microbatches: int, loss_fn, optimizer, *, weight_stashing: bool = True,
                 vertical_sync: bool = False, in_flight: int | None = None, lr_schedule=None):
        if vertical_sync and not weight_stashing:
            raise E.PipelineError("SchedulePipeDream: vertical_sync needs weight_stashing (a stage must keep the "
                                  "input stage's version to run on it); drop vertical_sync or keep stashing")
        self.weight_stashing, self.vertical_sync = bool(weight_stashing), bool(vertical_sync)
        self.in_flight_limit = in_flight
        super().__init__(stage, n_microbatches, loss_fn)
        stage = self.stages[self.rank]
        if not isinstance(stage, PipeDreamStage):
            raise E.PipelineError(f"{type(self).__name__}: pass a PipeDreamStage (it keeps the weight versions), "
                                  f"got {type(stage).__name__}")
        if 3 * self.num_stages * n_microbatches + 1 >= E.META_TAG:
            raise E.PipelineError(f"{type(self).__name__}: {n_microbatches} micro-batches per step need more message "
                                  f"tags than there are below {E.META_TAG}; run the stream in steps of at most "
                                  f"{(E.META_TAG - 2) // (3 * self.num_stages)} micro-batches")
        self.stage, self.optimizer, self.lr_schedule = stage, optimizer, lr_schedule
        self.backwards = 0  # since construction
        # the input stage's version for each micro-batch, counted from the step's start: the
        # backwards its list runs before that forward (what vertical sync will receive)
        self._input_versions, backwards = [], 0
        for action in self._schedule()[0]:
            if action.kind == "B":
                backwards += 1
            else:
                self._input_versions.append(backwards // self.accumulation)

    def _schedule(self):
        try:
            return pipedream_1f1b(self.num_stages, self.n_microbatches, self.in_flight_limit)
        except ValueError as error:
            raise E.PipelineError(str(error)) from None

    # ----------------------------------------------------------- the versions
    def _forward_version(self, i: int) -> int:
        """The version micro-batch i's forward runs on: the latest, or the input stage's."""
        stage = self.stage
        if self.vertical_sync and not stage.is_first:
            version = stage.recv_version(i, self.n_microbatches)
            if version != self._step_base + self._input_versions[i]:
                raise E.PipelineError(f"stage {stage.stage_index}: micro-batch {i} arrived with weight version "
                                      f"{version}, expected {self._step_base + self._input_versions[i]} (do all "
                                      "ranks run the same schedule with the same number of micro-batches?)")
            return version
        return stage.stash.version

    def _future_floor(self) -> int | None:
        """The oldest version a forward still to come can ask for (None: only the latest,
        whichever that will be)."""
        if self.vertical_sync and not self.stage.is_first and self._next_forward < self.n_microbatches:
            return self._step_base + self._input_versions[self._next_forward]
        return None

    def step(self, *args, target=None, losses=None):
        """Run the stream (module docstring), then flush; returns the losses list."""
        stage = self.stage
        stage.version_log = []
        self._step_base = stage.stash.version
        self._next_forward = 0
        self.optimizer.zero_grad()
        losses = super().step(*args, target=target, losses=losses)
        stage.stash.drop_older_than(stage.stash.version)  # flushed: only the latest is left
        return losses

    def _run(self, action, xs, ys, sizes, losses):
        stage, i, m = self.stage, action.microbatch, self.n_microbatches
        if action.kind == "F":
            version = self._forward_version(i)
            self._next_forward = i + 1
            if self.vertical_sync and not stage.is_last:
                stage.send_version(i, version, m)
            stage.forward_at(version, i, xs[i] if stage.is_first else None, sizes,
                             ys[i] if stage.is_last else None, self.loss_fn, losses, m)
        elif action.kind == "B":
            version = stage._version_of[i] if self.weight_stashing else None
            stage.backward_at(version, i, m, 1.0 / self.accumulation)
            self.backwards += 1
            if self.backwards % self.accumulation == 0:
                self._update()
        else:
            raise E.PipelineError(f"{type(self).__name__}: unexpected action {action}")

    def _update(self):
        # Which versions must survive this update: those of the micro-batches in flight, and
        # every version from the oldest a forward still to come may ask for. Drop the rest
        # first, then push the version being overwritten if it is among them.
        stage = self.stage
        future = self._future_floor()
        floor = min([*stage._version_of.values(), *([future] if future is not None else [])],
                    default=stage.stash.version + 1)
        stage.stash.drop_older_than(floor)
        if self.lr_schedule is not None:
            self.lr_schedule.step()
        stage.stash.update(self.optimizer.step, keep=self.weight_stashing and floor <= stage.stash.version)
        self.optimizer.zero_grad()


class SchedulePipeDream2BW(SchedulePipeDream):
    """PipeDream-2BW (Narayanan et al., ICML 2021; module docstring): 1F1B over the stream,
    gradients accumulated over ``accumulation`` = m >= p micro-batches, one update per m
    backwards, batch t (micro-batches tm .. tm + m - 1 of the step) run on every stage on
    version t - 1 (t = 0 on version 0): two versions per stage.

    Args: as :class:`SchedulePipeDream` (always stashing, no vertical sync needed: every stage
    picks the same version by itself), plus ``accumulation`` (m, >= p; n_microbatches must be
    a multiple of it). Raises PipelineError naming the fix otherwise.
    """

    def __init__(self, stage, n_microbatches: int, loss_fn, optimizer, *, accumulation: int,
                 lr_schedule=None):
        if not (isinstance(accumulation, int) and not isinstance(accumulation, bool) and accumulation >= 1):
            raise E.PipelineError(f"SchedulePipeDream2BW: accumulation must be a positive int, got {accumulation!r}")
        self.accumulation = accumulation
        super().__init__(stage, n_microbatches, loss_fn, optimizer, lr_schedule=lr_schedule)
        if accumulation < self.num_stages:
            raise E.PipelineError(f"SchedulePipeDream2BW: accumulation={accumulation} must be at least the "
                                  f"{self.num_stages} stages (with fewer, three versions would be in flight)")
        if n_microbatches % accumulation:
            raise E.PipelineError(f"SchedulePipeDream2BW: {n_microbatches} micro-batches per step do not make whole "
                                  f"batches of {accumulation}; use a multiple of {accumulation}")

    def _forward_version(self, i: int) -> int:
        return self._step_base + max(i // self.accumulation - 1, 0)

    def _future_floor(self) -> int | None:
        if self._next_forward >= self.n_microbatches:
            return None  # every forward of the stream ran
        return self._forward_version(self._next_forward)


def stage_figures(stage: PipeDreamStage) -> dict:
    """A stage's weight-version figures: ``versions`` (peak held, the latest included),
    ``stashed_bytes`` (peak bytes of the stashed copies), ``parameter_bytes`` (one version)."""
    return {"versions": stage.stash.peak_versions, "stashed_bytes": stage.stash.peak_stashed_bytes,
            "parameter_bytes": sum(p.data.nbytes for p in stage.stash.params)}

