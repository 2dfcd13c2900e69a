"""The checks of exercises 05 and 06: a piece of data-parallel training you wrote, run on
every rank, checked against an oracle that does not share your code.

- :func:`check_average_gradients` (exercise 05): after your ``average_gradients(comm,
  params)`` every ``p.grad`` must hold the mean of the ranks' gradients, and the traffic
  must be *one* all-reduce of all gradients flattened together (one bucket), not one per
  parameter.
- :func:`check_train_step` (exercise 05): a few steps of your ``train_step(comm, model,
  optimizer, xb, yb)`` on P ranks must reach the parameters of one process trained on the
  global batch (float64, 1e-10) and those of :class:`~minidist.parallel.DistributedDataParallel`.
- :func:`check_worker_loop` (exercise 06): your worker loop (pull, compute, push) runs
  against the engine's :class:`~minidist.parallel.parameter_server.ParameterServer`; in
  ``sync`` mode it must give what ``train_parameter_server(mode="sync")`` and one process
  with the global batch give, and it must also finish in ``async`` mode.
- :func:`check_sync_server` (exercise 06): your synchronous server, written from
  ``Send``/``Recv`` in a small protocol, against the same oracles; its traffic must be
  2·N·M bytes per step (N workers, M the model's bytes), counted message by message.

Like :mod:`minidist.course.checks.collectives`, each ``check_*`` is collective: call it on every rank
of a communicator (a ``minidist.sim`` world or ``mpi4py.MPI.COMM_WORLD``). The ranks share
what they found before deciding, so every rank raises the same ``AssertionError("what:
problem\\nHint: ...")`` and none is left waiting; on success each returns a one-line verdict.
:func:`on_sim` runs a check on simulated worlds and turns a deadlock into an AssertionError
with a hint::

    from minidist.course.checks import parallel as parallel_checks
    print(parallel_checks.on_sim(parallel_checks.check_average_gradients, average_gradients))

Longer than 400 lines: exercises 05 and 06's checks, each with the hints for the usual wrong turns,
as the runner calls them in order.
"""
from __future__ import annotations

import numpy as np

from minidist import collectives, costmodel, data, nn, optim, p2p, sim
from minidist.course.checks import check_own_code, fail, fail_together
from minidist.functions import cross_entropy
from minidist.parallel import parameter_server as ps
from minidist.parallel.data_parallel import DistributedDataParallel
from minidist.tensor import Tensor
from minidist.tracing import CountingComm

SEED = 2024
TOLERANCE = 1e-10
SIZES = (12, 16, 10, 4)  # a small MLP: 6 parameter tensors, 422 numbers
INIT_SEED = 3
LR, MOMENTUM, WEIGHT_DECAY = 0.1, 0.9, 1e-3
PARAMS_TAG, GRAD_TAG = 51, 52  # the small protocol of exercise 06's server
DEADLOCK_HINT = ("every rank blocked: does each Send have its Recv on the other side, with the same tag, and "
                 "does every rank run the same number of steps?")


# ----------------------------------------------------------------------------- shared pieces


def make_model(dtype: str = "float64", seed: int = INIT_SEED) -> nn.Sequential:
    """The checks' model: an MLP of ``SIZES``, the same on every rank for the same seed."""
    return nn.mlp(list(SIZES), rng=seed, dtype=dtype)


def make_data(num_samples: int, seed: int = SEED):
    """Seeded features (n, SIZES[0]) float64 and labels (n,) int64."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((num_samples, SIZES[0])), rng.integers(0, SIZES[-1], num_samples)


def _try(what, hint, fn, *args):
    """``(fn(*args), None)``, or ``(None, problem)`` when ``fn`` raises something other than
    NotImplementedError (a stub) or a sim teardown; the error becomes the problem."""
    try:
        return fn(*args), None
    except (NotImplementedError, sim.SimError):
        raise
    except Exception as error:  # reported with the hint, on every rank
        return None, (what, f"raised {type(error).__name__}: {error}", hint)


def _difference(got, expected):
    return float(np.max(np.abs(np.asarray(got, np.float64) - expected))) if np.size(expected) else 0.0


def on_sim(check, fn, world_sizes=(1, 2, 3, 4), **kwargs) -> str:
    """Run ``check(comm, fn, **kwargs)`` on a simulated world of each size in ``world_sizes``;
    return the verdicts, one line per size. A deadlock or a world that runs past its timeout
    becomes an AssertionError with a hint; the check's own AssertionError passes through."""
    lines = []
    for p in world_sizes:
        try:
            verdicts = sim.World(p, timeout=60).run(check, fn, **kwargs)
        except (sim.DeadlockError, sim.SimTimeoutError) as error:
            fail(f"{check.__name__} on {p} simulated ranks", str(error), DEADLOCK_HINT)
        lines.append(f"p={p}: {verdicts[0]}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- exercise 05


def _all_reduce_counts(comm, n, dtype):
    """{algorithm: (messages, bytes)} this rank sends in one ``collectives.all_reduce`` of n
    elements, for every algorithm (what one flat all-reduce may cost)."""
    counts = {}
    for algorithm in costmodel.ALL_REDUCE_ALGORITHMS:
        counted = CountingComm(comm)
        collectives.all_reduce(counted, np.zeros(n, dtype), algorithm=algorithm, validate=False)
        counts[algorithm] = (counted.messages, counted.nbytes)
    return counts


def _traffic_problem(comm, what, counted, numel, dtype, calls=1):
    """Every rank's (messages, bytes) must be ``calls`` all-reduces of ``numel`` elements
    with one algorithm. Returns (what, problem, hint) on every rank, or None."""
    allowed = _all_reduce_counts(comm, numel, dtype)
    mine = (counted.messages, counted.nbytes)
    table = p2p.agree(comm, payload=(mine, allowed))
    if comm.Get_size() == 1:
        return None  # nothing to send on one rank
    for algorithm in costmodel.ALL_REDUCE_ALGORITHMS:
        if all(sent == tuple(calls * c for c in refs[algorithm]) for sent, refs in table):
            return None
    ring = table[0][1]["ring"]
    reduces = "one all-reduce" if calls == 1 else f"{calls} all-reduces (one per step)"
    return (what, f"rank 0 sent {table[0][0][0]} messages ({table[0][0][1]} bytes); {reduces} of "
                  f"the {numel} gradient numbers flattened together would send {calls * ring[0]} messages "
                  f"({calls * ring[1]} bytes) with the ring",
            "concatenate every p.grad into one flat array (np.concatenate([p.grad.reshape(-1) ...])) and "
            "call collectives.all_reduce(comm, flat) once per step: one bucket, not one all-reduce per parameter")


def check_average_gradients(comm, average_gradients) -> str:
    """Check ``average_gradients(comm, params)``: afterwards every ``p.grad`` (same shape and
    dtype as before) holds the mean over the ranks, the parameters' values are untouched,
    and this rank sent exactly what one all-reduce of all gradients flattened together
    sends (any algorithm of ``collectives.all_reduce``). Float64 and float32 models; seeded
    gradients that differ per rank. Collective; raises AssertionError on every rank."""
    check_own_code(average_gradients, "average_gradients")
    rank, p = comm.Get_rank(), comm.Get_size()
    for dtype, tolerance in (("float64", 1e-12), ("float32", 1e-5)):
        what = f"average_gradients on {p} rank{'s' * (p > 1)}, {dtype} model"
        params = make_model(dtype).parameters()

        def grads_of(r, params=params, dtype=dtype):
            rng = np.random.default_rng([SEED, r])
            return [rng.standard_normal(q.shape).astype(dtype) for q in params]

        for q, g in zip(params, grads_of(rank)):
            q.grad = g.copy()
        before = [q.data.copy() for q in params]
        everyone = [grads_of(r) for r in range(p)]
        mean = [sum(gs[i].astype(np.float64) for gs in everyone) / p for i in range(len(params))]
        counted = CountingComm(comm, allow_collectives=True)  # collectives' argument check pickles
        _, problem = _try(what, "run it on sim.run(..., 2) and print what each rank holds",
                          average_gradients, counted, params)
        for i, q in enumerate(params):
            if problem:
                break
            name = f"{what}: the gradient of parameter {i} (shape {q.shape})"
            if q.grad is None or np.shape(q.grad) != q.shape or np.asarray(q.grad).dtype != np.dtype(dtype):
                got = "None" if q.grad is None else f"shape {np.shape(q.grad)}, {np.asarray(q.grad).dtype}"
                problem = (name, f"expected shape {q.shape} and {dtype}, got {got}",
                           "write each parameter's slice of the averaged flat array back, reshaped: "
                           "q.grad = flat[start:start + q.size].reshape(q.shape)")
            elif not np.array_equal(q.data, before[i]):
                problem = (name, "the parameter's values changed", "average the gradients only; "
                           "the optimizer updates the parameters")
            elif not np.allclose(q.grad, mean[i], rtol=tolerance, atol=tolerance):
                summed = p * mean[i]
                if p > 1 and np.allclose(q.grad, summed, rtol=tolerance, atol=tolerance):
                    hint = "the all-reduce sums the gradients: divide by the world size, comm.Get_size()"
                elif p > 1 and np.array_equal(q.grad, everyone[rank][i]):
                    hint = "the gradient is still this rank's own: copy the averaged values back into p.grad"
                else:
                    hint = "flatten in parameter order, all-reduce, divide by comm.Get_size(), split in the same order"
                problem = (name, f"not the mean over the ranks (largest difference "
                                 f"{_difference(q.grad, mean[i]):.3g})", hint)
        fail_together(comm, problem)
        numel = sum(q.size for q in params)
        fail_together(comm, _traffic_problem(comm, what, counted, numel, np.dtype(dtype)))
    return (f"average_gradients: the mean of the gradients of {p} rank{'s' * (p > 1)}, in one all-reduce of "
            f"{numel} numbers (float64 and float32)")


def _ddp_reference(comm, X, y, batch, steps):
    """DistributedDataParallel on the same data: the parameters after ``steps`` steps and this
    rank's loss of each step."""

    rank, p = comm.Get_rank(), comm.Get_size()
    model = make_model()
    ddp = DistributedDataParallel(model, comm)
    opt = optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    losses = []
    for t in range(steps):
        start = (t * p + rank) * batch
        opt.zero_grad()
        loss = cross_entropy(ddp(Tensor(X[start:start + batch])), y[start:start + batch])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return nn.parameters_to_vector(model.parameters()), losses


def _single_process(X, y, global_batch, steps):
    """The oracle: one process, one model, batches of the global size, in order."""

    model = make_model()
    opt = optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    for t in range(steps):
        opt.zero_grad()
        cross_entropy(model(Tensor(X[t * global_batch:(t + 1) * global_batch])),
                      y[t * global_batch:(t + 1) * global_batch]).backward()
        opt.step()
    return nn.parameters_to_vector(model.parameters())


def check_train_step(comm, train_step, batch: int = 4, steps: int = 3) -> str:
    """Check ``train_step(comm, model, optimizer, xb, yb) -> loss`` (one synchronous
    data-parallel step: zero the gradients, forward, cross-entropy loss, backward, average
    the gradients over the ranks, optimizer step; returns this rank's loss as a float).

    Every rank starts from the same float64 model with SGD (lr 0.1, momentum 0.9, weight
    decay 1e-3); in step t rank r trains on its slice of global batch t (``batch`` samples
    each). After ``steps`` steps every rank's parameters must equal (1e-10) those of one
    process trained on the global batches and those of ``DistributedDataParallel``; the
    losses must be this rank's; the traffic must be one flat all-reduce per step.
    Collective; raises AssertionError on every rank."""
    check_own_code(train_step, "train_step")

    rank, p = comm.Get_rank(), comm.Get_size()
    X, y = make_data(steps * p * batch)
    what = f"train_step on {p} rank{'s' * (p > 1)}, per-rank batch {batch}"
    model = make_model()
    opt = optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    counted = CountingComm(comm, allow_collectives=True)
    losses, problem = [], None
    for t in range(steps):
        start = (t * p + rank) * batch
        loss, problem = _try(f"{what}, step {t + 1}", "run it on sim.run(..., 2) and print what each rank holds",
                             train_step, counted, model, opt, X[start:start + batch], y[start:start + batch])
        if problem:
            break
        losses.append(loss)
    fail_together(comm, problem)
    numel = sum(q.size for q in model.parameters())
    fail_together(comm, _traffic_problem(comm, f"{what}: the traffic of {steps} steps", counted, numel,
                                  np.dtype("float64"), calls=steps))
    mine = nn.parameters_to_vector(model.parameters())
    ddp_params, ddp_losses = _ddp_reference(comm, X, y, batch, steps)
    single = _single_process(X, y, p * batch, steps)
    problem = None
    if not all(isinstance(v, (int, float, np.number)) for v in losses):
        problem = (what, f"train_step returned {losses!r}", "return the loss as a float: loss.item()")
    elif _difference(mine, single) > TOLERANCE:
        problem = (what, f"the parameters differ from one process trained on the global batch of {p * batch} "
                         f"(largest difference {_difference(mine, single):.3g} after {steps} steps)",
                   "zero the gradients, forward and backward on this rank's batch, average the gradients over "
                   "the ranks (sum / comm.Get_size()), and only then call optimizer.step()")
    elif _difference(mine, ddp_params) > TOLERANCE:
        problem = (what, f"the parameters differ from DistributedDataParallel's "
                         f"(largest difference {_difference(mine, ddp_params):.3g})",
                   "one optimizer step per train_step, on the averaged gradients")
    elif not np.allclose([float(v) for v in losses], ddp_losses, rtol=1e-12, atol=1e-12):
        problem = (what, f"the losses {np.round(np.asarray(losses, float), 6).tolist()} are not this rank's "
                         f"{np.round(ddp_losses, 6).tolist()}",
                   "return the loss of this rank's batch, computed before the optimizer step")
    fail_together(comm, problem)
    return (f"train_step: {steps} steps on {p} rank{'s' * (p > 1)} equal one process with the global batch "
            f"and DistributedDataParallel (to {TOLERANCE:g}), one all-reduce per step")


# ----------------------------------------------------------------------------- exercise 06


def _ps_loader(X, y, num_workers, worker, batch, seed):
    """Worker ``worker``'s batches, as ``train_parameter_server`` reads them."""
    sampler = data.DistributedSampler(len(X), num_workers, worker, shuffle=True, seed=seed)
    return data.DataLoader(X, y, batch_size=batch, sampler=sampler)


def _ps_single_process(X, y, global_batch, epochs, lr, momentum, seed):
    """One process reading the same samples per step as the N workers together."""

    model = make_model()
    opt = optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    loader = _ps_loader(X, y, 1, 0, global_batch, seed)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            cross_entropy(model(Tensor(xb)), yb).backward()
            opt.step()
    return nn.parameters_to_vector(model.parameters())


def check_worker_loop(comm, train_worker, num_servers: int = 1, batch: int = 4, steps: int = 3,
                      epochs: int = 2) -> str:
    """Check ``train_worker(worker, model, loader, epochs) -> losses``: for each epoch and each
    batch ``(xb, yb)`` of ``loader``, ``worker.pull()``, forward and backward on the batch,
    ``worker.push()``; return the list of losses (floats).

    Run on every rank of a world of ``num_servers`` + N ranks (N >= 1): the servers run the
    engine's ``ParameterServer``; each worker runs your loop, then the check calls
    ``worker.finish``. In ``sync`` mode (lr 0.1, momentum 0.9) the final parameters must equal
    (1e-10) ``train_parameter_server(mode="sync")``'s and one process's with the global batch,
    every gradient must be fresh (staleness 0), and each worker must have pushed ``steps *
    epochs`` times; in ``async`` mode the run must finish with every gradient applied.
    Collective; raises AssertionError on every rank."""
    check_own_code(train_worker, "train_worker")

    rank, size = comm.Get_rank(), comm.Get_size()
    num_workers = size - num_servers
    X, y = make_data(num_workers * batch * steps)
    what = f"train_worker with {num_servers} server{'s' * (num_servers > 1)} and {num_workers} worker" \
           f"{'s' * (num_workers > 1)}"
    finals = {}
    for mode in ("sync", "async"):
        model = make_model()
        problem = None
        if rank < num_servers:
            stats = ps.ParameterServer(comm, model, num_servers=num_servers, mode=mode, lr=LR,
                                       momentum=MOMENTUM).serve()
        else:
            worker = ps.Worker(comm, model, num_servers=num_servers)
            loader = _ps_loader(X, y, num_workers, rank - num_servers, batch, SEED)
            losses, problem = _try(f"{what}, {mode} mode", "call worker.pull() before computing and "
                                   "worker.push() after loss.backward(), once per batch", train_worker,
                                   worker, model, loader, epochs)
            if problem is None and worker.clock != steps * epochs:
                problem = (f"{what}, {mode} mode", f"the worker pushed {worker.clock} gradients, expected "
                           f"{steps * epochs} ({epochs} epochs of {steps} batches)",
                           "push once per batch, for every batch of every epoch")
            elif problem is None and (not isinstance(losses, list) or len(losses) != steps * epochs):
                problem = (f"{what}, {mode} mode", f"train_worker returned {type(losses).__name__} "
                           f"{losses if isinstance(losses, list) and len(losses) < 8 else ''}",
                           f"return the list of the {steps * epochs} losses (loss.item() of each batch)")
            stats = worker.finish(receive_final=rank == num_servers)  # DONE: the servers stop
        fail_together(comm, problem)
        finals[mode] = stats
    # sync: the servers' shards against the engine's own run and one process
    reference = ps.train_parameter_server(comm, make_model, X, y, num_servers=num_servers, mode="sync",
                                          epochs=epochs, batch_size=batch, lr=LR, momentum=MOMENTUM, seed=SEED)
    single = _ps_single_process(X, y, num_workers * batch, epochs, LR, MOMENTUM, SEED)
    problem = None
    if rank < num_servers:
        mine, theirs = finals["sync"], reference
        shard = single[mine.start:mine.stop]
        if mine.staleness_histogram != {0: num_workers * steps * epochs}:
            problem = (f"{what}, sync mode", f"staleness histogram {mine.staleness_histogram}",
                       "pull before every step, so each gradient is computed on the newest parameters")
        elif _difference(mine.shard, shard) > TOLERANCE:
            problem = (f"{what}, sync mode", f"server {rank}'s parameters differ from one process with the "
                       f"global batch by {_difference(mine.shard, shard):.3g}",
                       "pull, zero the gradients, forward and backward on the batch, push: in that order")
        elif _difference(mine.shard, theirs.shard) > TOLERANCE:
            problem = (f"{what}, sync mode", "the parameters differ from train_parameter_server's",
                       "one pull and one push per batch, in the loader's order")
        elif finals["async"].gradients != num_workers * steps * epochs:
            problem = (f"{what}, async mode", f"the server applied {finals['async'].gradients} gradients",
                       "push once per batch")
    fail_together(comm, problem)
    return (f"train_worker: sync equals train_parameter_server and one process (to {TOLERANCE:g}) with "
            f"{num_servers} server{'s' * (num_servers > 1)} and {num_workers} worker{'s' * (num_workers > 1)}; "
            "async runs to the end")


def tiny_worker(comm, model, loader, epochs):
    """The worker side of exercise 06's small protocol (rank >= 1; the server is rank 0):
    for every batch, receive the flat parameters (tag 51), load them, compute the gradient
    of the batch's loss, send it flat (tag 52). Returns the number of steps."""

    params = model.parameters()
    flat = np.empty(sum(q.size for q in params))
    steps = 0
    for _ in range(epochs):
        for xb, yb in loader:
            comm.Recv(flat, source=0, tag=PARAMS_TAG)
            nn.vector_to_parameters(flat, params)
            model.zero_grad()
            cross_entropy(model(Tensor(xb)), yb).backward()
            comm.Send(nn.parameters_to_vector(q.grad for q in params), dest=0, tag=GRAD_TAG)
            steps += 1
    return steps


def check_sync_server(comm, serve_sync, batch: int = 4, steps: int = 3, epochs: int = 2, lr: float = LR) -> str:
    """Check ``serve_sync(comm, params, num_steps, lr) -> params``, the server (rank 0) of a
    synchronous parameter server in exercise 06's protocol: each step, send the flat float64
    ``params`` to every worker (tag 51), receive one flat gradient from each (tag 52), and
    apply plain SGD with their average; return the final flat parameters.

    The other ranks run :func:`tiny_worker`. The result must equal (1e-10) one process with
    the global batch and ``train_parameter_server(mode="sync", momentum=0)``; the server must
    send N messages of M bytes per step and receive as many (2·N·M bytes per step, counted).
    Collective; raises AssertionError on every rank."""
    check_own_code(serve_sync, "serve_sync")

    rank, size = comm.Get_rank(), comm.Get_size()
    num_workers = size - 1
    what = f"serve_sync with {num_workers} worker{'s' * (num_workers > 1)}"
    X, y = make_data(num_workers * batch * steps)
    model = make_model()
    initial = nn.parameters_to_vector(model.parameters())
    counted = CountingComm(comm)
    problem = None
    if rank == 0:
        result, problem = _try(what, "send the parameters to every worker, then receive one gradient from "
                               "each", serve_sync, counted, initial.copy(), steps * epochs, lr)
    else:
        tiny_worker(counted, model, _ps_loader(X, y, num_workers, rank - 1, batch, SEED), epochs)
    fail_together(comm, problem)
    M = initial.nbytes
    sent = p2p.agree(comm, payload=(counted.messages, counted.nbytes))
    reference = ps.train_parameter_server(comm, make_model, X, y, num_servers=1, mode="sync", epochs=epochs,
                                          batch_size=batch, lr=lr, momentum=0.0, seed=SEED)
    if rank == 0:
        single = _ps_single_process(X, y, num_workers * batch, epochs, lr, 0.0, SEED)
        total = steps * epochs
        received = sum(b for _, b in sent[1:])
        if result is None or np.shape(result) != initial.shape:
            problem = (what, f"returned {type(result).__name__} of shape {np.shape(result)}",
                       f"return the final flat parameters, shape {initial.shape}")
        elif sent[0] != (num_workers * total, num_workers * total * M):
            problem = (what, f"the server sent {sent[0][0]} messages ({sent[0][1]} bytes) in {total} steps; "
                             f"expected {num_workers * total} messages of {M} bytes",
                       "one Send of the whole flat parameter vector to each worker per step")
        elif _difference(result, single) > TOLERANCE:
            hint = "average the N gradients (sum / N) and update once per step: params = params - lr * mean"
            problem = (what, f"the parameters differ from one process with the global batch by "
                             f"{_difference(result, single):.3g}", hint)
        elif _difference(result, reference.shard) > TOLERANCE:
            problem = (what, "the parameters differ from train_parameter_server(mode='sync')", "one update per step")
        elif received != num_workers * total * M:
            problem = (what, f"the server received {received} bytes", "receive one gradient per worker per step")
    fail_together(comm, problem)
    return (f"serve_sync: equals one process with the global batch and train_parameter_server (to "
            f"{TOLERANCE:g}); the server moved 2·N·M = {2 * num_workers * M} bytes per step "
            f"(N={num_workers}, M={M})")
