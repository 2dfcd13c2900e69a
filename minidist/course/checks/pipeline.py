"""The checks of exercise 07: one GPipe stage's send/recv loop, run on every rank of a pipeline.

:func:`check_gpipe_stage_step` calls your ``gpipe_stage_step(comm, stage, x, y, m,
batch_size)`` on every rank of a communicator (a ``minidist.sim`` world or
``mpi4py.MPI.COMM_WORLD``), rank r holding stage r of a small float64 model, and checks it
against two things that do not share your code:

- **one process**: the whole model on the whole mini-batch, cut into the same m micro-batches
  (``numpy.array_split``: with 10 rows and m = 4 they hold 3, 3, 2 and 2), the step's loss the
  mean of the m micro-batch losses, one backward. After your step every stage's gradients must
  equal the single process's gradients of the same layers (to 1e-10), and the last rank's losses
  must be the micro-batches' losses. The mini-batch of :data:`BATCH` = 10 rows is one that
  m = 3 and m = 4 do not divide, so a receive buffer sized ``batch_size // m`` fails;
- **the messages**, counted by a :class:`minidist.tracing.CountingComm`: GPipe sends each
  micro-batch across each boundary exactly once forward (the activation, to rank r + 1) and
  once back (the gradient of that activation, to rank r - 1), all forwards before any
  backward; nothing through the pickling lowercase ``send``.

Your function gets a communicator whose ``Send`` is ``Ssend`` (and ``Isend`` is ``Issend``):
a send that completes only when its receive is posted, as MPI may make any ``Send`` past its
eager limit. :func:`on_sim` runs the check on simulated worlds of 1 to 4 ranks in strict mode
(``sim.World(p, strict=True)``, every send synchronous) and turns a deadlock into an
AssertionError with a hint. The ranks share what they found (one ``p2p.agree`` round)
before deciding, so every rank raises the same ``AssertionError("what: problem\\nHint: ...")``;
when your code raises on one rank, that rank raises :class:`~minidist.course.checks.LearnerError`
at once (hint and your line), except a stub's NotImplementedError, which passes through. On
success every rank returns the same one-line verdict::

    from minidist.course.checks import pipeline as pipeline_checks
    print(pipeline_checks.on_sim(pipeline_checks.check_gpipe_stage_step, gpipe_stage_step))
"""
from __future__ import annotations

import numpy as np

from minidist import nn, sim
from minidist.course.checks import LearnerError, SynchronousSends, check_own_code, fail, fail_together, learner_error
from minidist.functions import cross_entropy
from minidist.tensor import Tensor
from minidist.tracing import CountingComm

SEED = 2024
INIT_SEED = 7
TOLERANCE = 1e-10
BATCH = 10  # rows of the mini-batch: m = 3 and m = 4 do not divide it, so micro-batches differ in size
MICROBATCHES = (1, 2, 3, 4)
IN_FEATURES, CLASSES = 5, 4
DEADLOCK_HINT = ("every rank waits: either for a message no rank sends (in the forward pass rank r receives "
                 "from rank r - 1 and sends to rank r + 1; in the backward pass it receives from rank r + 1 and "
                 "sends to rank r - 1; the first rank receives nothing forward, the last nothing backward), or "
                 "two neighbours both Send to each other at once, and here every Send waits for its Recv: GPipe "
                 "avoids that by running every forward before any backward")
ORDER_HINT = ("GPipe runs the forward of every micro-batch first (send each activation to rank + 1 right after "
              "computing it), then the backward of every micro-batch in the same order 0, 1, ..., m - 1 "
              "(send each input gradient to rank - 1); one message per micro-batch and direction")


# ----------------------------------------------------------------------------- the model


def widths(num_stages: int) -> list[int]:
    """Features entering each stage and leaving the last: ``num_stages + 1`` numbers, neighbours
    different (so a buffer sized with the wrong width fails)."""
    return [IN_FEATURES] + [6 + (3 * s) % 5 for s in range(1, num_stages)] + [CLASSES]


def make_stages(num_stages: int, dtype: str = "float64", seed: int = INIT_SEED) -> list[nn.Sequential]:
    """The checks' model cut into ``num_stages`` stages, the same on every rank for the same seed.

    Stage s is ``Linear(w[s], h) -> Tanh -> Linear(h, w[s + 1])`` followed by a Tanh except on
    the last stage, whose output is the logits (``w = widths(num_stages)``, h = 3 + s). Every
    stage starts with a Linear, so ``stage[0].in_features`` is the width of what it receives."""
    w = widths(num_stages)
    rng = np.random.default_rng(seed)
    stages = []
    for s in range(num_stages):
        hidden = 3 + s
        layers = [nn.Linear(w[s], hidden, rng=rng, dtype=dtype), nn.Tanh(), nn.Linear(hidden, w[s + 1], rng=rng,
                                                                                      dtype=dtype)]
        if s < num_stages - 1:
            layers.append(nn.Tanh())
        stages.append(nn.Sequential(*layers))
    return stages


def make_data(batch: int = BATCH, seed: int = SEED):
    """Seeded features (batch, IN_FEATURES) float64 and labels (batch,) int64."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((batch, IN_FEATURES)), rng.integers(0, CLASSES, batch)


def single_process(num_stages: int, X, y, m: int):
    """The oracle: the whole model in one process on the whole mini-batch ``X`` (rows) with labels
    ``y``, cut into m micro-batches by ``numpy.array_split`` (the first ``len(X) % m`` one row
    longer), the loss the mean of the m micro-batch losses (each a mean cross-entropy over its
    rows; with equal micro-batches this is the mini-batch's mean loss), one backward.
    Returns (gradients per stage, as float64 arrays of each stage's parameters, in order; the
    m micro-batch losses, floats)."""
    stages = make_stages(num_stages)
    whole = nn.Sequential(*[layer for stage in stages for layer in stage])
    parts = [cross_entropy(whole(Tensor(xi)), yi) for xi, yi in zip(np.array_split(X, m), np.array_split(y, m))]
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    (total * (1.0 / m)).backward()
    grads = [[p.grad.copy() for p in stage.parameters()] for stage in stages]
    return grads, [part.item() for part in parts]


# ----------------------------------------------------------------------------- the check


def _call(what, fn, *args):
    """The learner's ``fn(*args)``. NotImplementedError (a stub) and the simulator's own
    teardown pass through; any other exception becomes a LearnerError on this rank (the other
    ranks may be waiting for it, so it cannot wait for an agreement round)."""
    try:
        return fn(*args)
    except (NotImplementedError, AssertionError, sim.SimError):
        raise
    except Exception as error:  # reported with a hint and the learner's line
        text = str(error)
        if "NoneType" in text:
            hint = ("an input gradient is None: make each received activation Tensor(buf, requires_grad=True), so "
                    "that backward fills its .grad, and send inp.grad back")
        elif "pickled" in text or "lowercase" in text:
            hint = ("send arrays with the uppercase comm.Send(array, dest=...) and receive them with "
                    "comm.Recv(buf, source=...); the lowercase send pickles Python objects")
        elif any(word in text for word in ("fit", "shape", "truncat")):
            hint = ("size every receive buffer from what travels: forward, (rows of micro-batch i, "
                    "stage[0].in_features) in the stage's dtype; backward, numpy.empty_like(out.data) of that "
                    "micro-batch's output")
        else:
            hint = ""
        raise learner_error(what, error, "your gpipe_stage_step", hint) from None


def _expected_traffic(rank, p, m, w, batch):
    """(destinations in order, bytes sent, receives posted) of GPipe's stage ``rank``."""
    first, last = rank == 0, rank == p - 1
    destinations = ([] if last else [rank + 1] * m) + ([] if first else [rank - 1] * m)
    nbytes = 8 * batch * ((0 if last else w[rank + 1]) + (0 if first else w[rank]))
    receives = (0 if first else m) + (0 if last else m)
    return destinations, nbytes, receives


def _problem(what, rank, p, m, w, batch, counted, returned, stage, grads, losses):
    """(what, problem, hint) for this rank after one step, or None."""
    expected_dest, expected_bytes, expected_receives = _expected_traffic(rank, p, m, w, batch)
    if counted.object_messages:
        return (what, f"{counted.object_messages} message(s) went through the lowercase send (pickled)",
                "send arrays with comm.Send(array, dest=...) and receive them into a buffer with "
                "comm.Recv(buf, source=...)")
    if counted.destinations != expected_dest:
        return (what, f"rank {rank} sent to ranks {counted.destinations}; GPipe sends to {expected_dest}",
                ORDER_HINT)
    if counted.nbytes != expected_bytes:
        return (what, f"rank {rank} sent {counted.nbytes} bytes; the activations and gradients of the "
                      f"{batch} rows are {expected_bytes} bytes",
                "send each micro-batch's whole output forward (out.data) and its whole input gradient back "
                "(inp.grad), nothing else")
    if counted.messages_received != expected_receives:
        return (what, f"rank {rank} posted {counted.messages_received} receives; expected {expected_receives} "
                      f"(m = {m} from each neighbour)", ORDER_HINT)
    for i, (q, expected) in enumerate(zip(stage.parameters(), grads)):
        name = f"{what}: the gradient of stage {rank}'s parameter {i} (shape {q.shape})"
        if q.grad is None:
            return (name, "is None: no backward reached it",
                    "on the last stage call backward on each micro-batch's loss; on the others on each "
                    "micro-batch's output, with the gradient received from rank + 1: out.backward(grad)")
        difference = float(np.max(np.abs(np.asarray(q.grad, np.float64) - expected)))
        if difference > TOLERANCE:
            if np.allclose(q.grad, m * expected, rtol=1e-9, atol=1e-12) and m > 1:
                hint = (f"the gradients are m = {m} times too large: the step's loss is the mean of the m "
                        f"micro-batch losses, so the last stage starts each backward from 1/m, "
                        f"loss.backward(numpy.asarray(1.0 / m)), not from 1")
            else:
                hint = ("pair each received gradient with its own micro-batch's output (same order on both "
                        "sides), and call backward once per micro-batch; the caller zeroes the gradients")
            return (name, f"differs from one process by {difference:.3g}", hint)
    if rank == p - 1:
        if not isinstance(returned, (list, tuple)) or len(returned) != m:
            return (what, f"the last rank returned {returned!r}",
                    f"return the list of the m = {m} micro-batch losses (loss.item()) on the last rank")
        got = np.asarray([float(v) for v in returned])
        if not np.allclose(got, losses, rtol=0, atol=TOLERANCE):
            return (what, f"the losses {np.round(got, 6).tolist()} are not the micro-batches' "
                          f"{np.round(losses, 6).tolist()}",
                    "append each micro-batch's unscaled loss, loss.item(), in micro-batch order")
    return None


def check_gpipe_stage_step(comm, gpipe_stage_step, microbatches=MICROBATCHES, batch: int = BATCH) -> str:
    """Check ``gpipe_stage_step(comm, stage, x, y, m, batch_size) -> losses`` on every rank.

    Rank r of p holds stage r of :func:`make_stages(p) <make_stages>` (float64, zero
    gradients); rank 0 passes the mini-batch x (``batch`` rows), the last rank the labels y,
    the others None. For each m in ``microbatches`` (any m from 1 to ``batch``) one step must
    leave every stage's gradients equal (1e-10) to :func:`single_process`'s, return the m
    micro-batch losses on the last rank, leave the parameters' values alone, and send what
    GPipe sends (module docstring). Collective; raises AssertionError on every rank (or
    :class:`LearnerError` on a rank whose code raised; NotImplementedError for a stub)."""
    check_own_code(gpipe_stage_step, "gpipe_stage_step")
    rank, p = comm.Get_rank(), comm.Get_size()
    w = widths(p)
    X, y = make_data(batch)
    for m in microbatches:
        if not 1 <= m <= batch:
            raise ValueError(f"check_gpipe_stage_step: m = {m} micro-batches of a batch of {batch} rows; "
                             f"use 1 <= m <= {batch}")
        what = f"gpipe_stage_step on {p} rank{'s' * (p > 1)}, m = {m}, a mini-batch of {batch}"
        stage = make_stages(p)[rank]
        before = [q.data.copy() for q in stage.parameters()]
        counted = CountingComm(comm)
        x_in = X.copy() if rank == 0 else None
        y_in = y.copy() if rank == p - 1 else None
        returned = _call(what, gpipe_stage_step, SynchronousSends(counted), stage, x_in, y_in, m, batch)
        grads, losses = single_process(p, X, y, m)
        problem = None
        if any(not np.array_equal(q.data, b) for q, b in zip(stage.parameters(), before)):
            problem = (what, f"stage {rank}'s parameter values changed",
                       "compute the gradients only; the optimizer's step() changes the parameters, after")
        else:
            problem = _problem(what, rank, p, m, w, batch, counted, returned, stage, grads[rank], losses)
        fail_together(comm, problem)
    counts = ", ".join(str(m) for m in microbatches)
    last = microbatches[-1]
    if p == 1:
        traffic = "no boundary, no message"
    else:
        where = "the boundary" if p == 2 else f"each of the {p - 1} boundaries"
        traffic = (f"each micro-batch crossed {where} once forward and once back "
                   f"({2 * (p - 1) * last} messages at m = {last})")
    return (f"gpipe_stage_step on {p} rank{'s' * (p > 1)}, m = {counts}: gradients equal one process (to "
            f"{TOLERANCE:g}); {traffic}")


def on_sim(check, fn, world_sizes=(1, 2, 3, 4), **kwargs) -> str:
    """Run ``check(comm, fn, **kwargs)`` on a strict simulated world (every send synchronous)
    of each size in ``world_sizes``; return the verdicts, one line per size. A deadlock or a
    world past its timeout becomes an AssertionError with :data:`DEADLOCK_HINT`; the check's
    own AssertionError (and a LearnerError) passes through."""
    lines = []
    for p in world_sizes:
        try:
            verdicts = sim.World(p, timeout=60, strict=True).run(check, fn, **kwargs)
        except (sim.DeadlockError, sim.SimTimeoutError) as error:
            fail(f"{check.__name__} on {p} simulated ranks", str(error), DEADLOCK_HINT)
        lines.append(f"p={p}: {verdicts[0]}")
    return "\n".join(lines)


__all__ = ["DEADLOCK_HINT", "LearnerError", "check_gpipe_stage_step", "make_data", "make_stages", "on_sim",
           "single_process", "widths"]
