"""Training with parameter servers: :func:`train_parameter_server`, the loop every rank runs
(a server serves, a worker pulls, computes and pushes), and :func:`train_ps`, the driver of
``python -m minidist train --strategy ps``.
"""
from __future__ import annotations

import math
import time

import numpy as np

from minidist import backend, data
from minidist.fault import Checkpointer, TrainingStopped
from minidist.functions import cross_entropy
from minidist.parallel.parameter_server.protocol import FlatLayout, check_world
from minidist.parallel.parameter_server.server import ParameterServer, ServerStats
from minidist.parallel.parameter_server.worker import Worker, WorkerStats
from minidist.tensor import Tensor
from minidist.train import (
    TrainConfig,
    TrainResult,
    build_model,
    collective_deadline,
    fit,
    rank_logger,
    report_epoch,
    silent,
)


def train_parameter_server(comm, model_fn, X, y, *, num_servers=1, mode="sync", staleness=0, epochs=1,
                           batch_size=32, lr=0.05, momentum=0.0, weight_decay=0.0, warmup_epochs=0.0, seed=0,
                           step_hook=None, on_epoch_end=None, progress=False, timeout=None,
                           checkpointer=None):
    """Train ``model_fn()`` on (X, y) with K = ``num_servers`` servers and the other ranks as
    workers; call it on every rank (``sim.run(train_parameter_server, P, ...)`` or with
    ``MPI.COMM_WORLD``). Returns ServerStats on a server, WorkerStats on a worker (the
    reporter, worker 0, also gets the final model and all ServerStats).

    Args:
        model_fn: builds the model; must give the same initial parameters on every rank.
        X, y: training data, (n, features) float and (n,) int; worker w reads the shard
            ``DistributedSampler(n, N, w, shuffle=True, seed=seed)`` in batches of ``batch_size``.
        mode, staleness: see the module docstring. lr, momentum, weight_decay: SGD on the servers.
        warmup_epochs: linear lr warm-up over this many epochs of updates.
        step_hook: ``step_hook(worker, clock)`` on every worker before each gradient (e.g. a
            sleep, to make a worker slow).
        on_epoch_end: ``on_epoch_end(epoch, mean_loss, model)`` on the reporter, with the
            model's parameters as they were at the end of that epoch (the next pull, or the
            final shards after the last epoch). progress: a tqdm bar on the reporter.
        timeout: the one deadline in seconds the servers and workers share (None: p2p's,
            ``p2p.get_timeout()``; ``math.inf``: none; ``protocol``'s docstring), on MPI and on
            the sim alike; then ParameterServerTimeout names the missing rank.
        checkpointer: optional ``checkpointer(server_or_worker) -> fault.Checkpointer`` (a
            gathered one, built around this rank's ParameterServer or Worker; sync only). Every
            rank resumes from it first; a worker at a checkpoint step marks it
            (:meth:`Worker.mark_checkpoint`) and saves its part in ``on_step_end``; a server
            saves its part when every worker marked it (``serve``'s ``on_checkpoint``) and calls
            ``after_step(version, stop=False)`` (the kill hook) after each update, or after the
            save on a checkpoint step. A worker
            stopped by ``TrainingStopped`` says DONE (the reporter takes the final shards)
            before re-raising it, so the servers end too.

    The worker's loop is :func:`minidist.train.fit` with a step that pulls, computes and
    pushes; an epoch's end is reported after the next pull, when the parameters that the
    epoch's last gradient produced have arrived.

    Raises ValueError (naming the fix) for a bad world, mode or staleness;
    ``train.NonFiniteLossError`` on a worker whose loss becomes NaN or infinite.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    check_world(size, num_servers, mode, staleness)
    num_workers = size - num_servers
    if rank < num_servers:
        steps_per_epoch = math.ceil(math.ceil(len(X) / num_workers) / batch_size)
        updates_per_epoch = steps_per_epoch * (num_workers if mode == "async" else 1)
        server = ParameterServer(comm, model_fn(), num_servers=num_servers, mode=mode, staleness=staleness, lr=lr,
                                 momentum=momentum, weight_decay=weight_decay,
                                 warmup_updates=round(warmup_epochs * updates_per_epoch), timeout=timeout)
        return _serve(server, checkpointer)
    worker = Worker(comm, model_fn(), num_servers=num_servers, timeout=timeout)
    return _work(worker, X, y, epochs=epochs, batch_size=batch_size, seed=seed, step_hook=step_hook,
                 on_epoch_end=on_epoch_end, progress=progress, checkpointer=checkpointer)


def _serve(server: ParameterServer, checkpointer) -> ServerStats:
    """A server's part of :func:`train_parameter_server`: resume, then serve, saving its part
    at each checkpoint the workers marked and calling the kill hook after each update."""
    if checkpointer is None:
        return server.serve()
    ckpt = checkpointer(server)
    ckpt.resume()

    def on_checkpoint(clock):  # the kill hook of a checkpoint step fires after its save, as on a worker
        ckpt.save(clock)
        ckpt.after_step(clock, stop=False)

    def on_update(version):
        if not ckpt.due(version):
            ckpt.after_step(version, stop=False)

    return server.serve(on_checkpoint=on_checkpoint, on_update=on_update)


def _work(worker: Worker, X, y, *, epochs, batch_size, seed, step_hook, on_epoch_end, progress,
          checkpointer) -> WorkerStats:
    """A worker's part of :func:`train_parameter_server`: :func:`minidist.train.fit` over its
    shard with a step that pulls, computes and pushes; DONE at the end (or when stopped)."""
    comm, model, num_servers = worker.comm, worker.model, worker.num_servers
    num_workers = comm.Get_size() - num_servers
    index, device = comm.Get_rank() - num_servers, worker.params[0].device
    is_reporter = index == 0
    sampler = data.DistributedSampler(len(X), num_workers, index, shuffle=True, seed=seed)
    loader = data.DataLoader(X, y, batch_size=batch_size, sampler=sampler)
    finished = []  # the reporter's last (epoch, mean loss), scored once the next pull brings its parameters

    def report_finished():
        if finished and on_epoch_end:
            on_epoch_end(*finished.pop(), model)

    def step_fn(xb, yb):
        worker.pull()
        report_finished()
        if step_hook is not None:
            step_hook(index, worker.clock)
        start = time.perf_counter()
        model.zero_grad()
        loss = cross_entropy(model(Tensor(xb, device=device)), backend.to_device(yb, device))
        loss.backward()
        worker.stats.compute_seconds += time.perf_counter() - start
        worker.push()
        worker.stats.losses.append(float(loss.item()))
        return worker.stats.losses[-1]

    def epoch_end(epoch, loss, seconds):
        finished.append((epoch, loss))

    ckpt = checkpointer(worker) if checkpointer is not None else None

    def on_step_end(position):
        if ckpt.due(position["global_step"]):
            worker.mark_checkpoint()
        ckpt(position)

    try:
        fit(step_fn, loader, epochs, on_epoch_end=epoch_end if is_reporter else None,
            progress=progress and is_reporter, start=ckpt.resume() if ckpt else None,
            on_step_end=on_step_end if ckpt else None)
    except TrainingStopped:  # stopped on purpose: let the servers end too
        worker.finish(receive_final=is_reporter)
        raise
    stats = worker.finish(receive_final=is_reporter)
    report_finished()
    return stats


def final_parameters(results):
    """The trained flat parameter vector (numpy, 1-D), from the servers' results of a run."""
    shards = sorted((r for r in results if isinstance(r, ServerStats)), key=lambda r: r.server)
    return np.concatenate([r.shard for r in shards])


def figures(servers, num_workers, param_bytes):
    """The figures ``train --strategy ps`` prints, from the reporter's list of ServerStats:
    measured payload bytes per server per step vs the formula 2 N M / K, and staleness."""
    k, mode = len(servers), servers[0].mode
    histograms = "; ".join(f"server{s.server} {s.staleness_histogram}" for s in servers)
    return {
        "ps_mode": mode + (f" (staleness bound {servers[0].staleness_bound})" if mode == "ssp" else ""),
        "servers": k,
        "workers": num_workers,
        "parameter_bytes": param_bytes,
        "bytes_per_server_per_step": " ".join(f"{s.bytes_per_step:.0f}" for s in servers),
        "formula_2NM_over_K": f"{2 * num_workers * param_bytes / k:.0f}",
        "max_staleness": max(s.max_staleness for s in servers),
        "staleness_histogram": histograms,
    }



def train_ps(comm, config: TrainConfig, dataset: data.Dataset) -> TrainResult | None:
    """Parameter-server training over ``comm``: K = ``config.num_servers`` server ranks and
    the other N ranks as workers with ``config.batch_size`` each, in ``config.ps_mode``
    (``config.staleness`` bounds ssp). Every blocking wait gives up after ``config.timeout``
    seconds. The reporter (worker 0, rank K) prints the per-epoch lines.

    Learning rate: sync and ssp apply one update per clock with the average over N workers
    (global batch N x b), so ``config.scale_lr`` multiplies ``config.lr`` by N (Goyal et al.
    2017); async applies every worker's gradient as it comes (the batch of an update is b),
    so there is nothing to scale.

    Checkpoints (``config.checkpoint_dir``, sync only): a gathered
    :class:`~minidist.fault.Checkpointer` on every rank. When every worker has pushed the
    gradient of a checkpoint step and said so, each server's shard, optimizer state (momentum,
    step count = version) and warm-up, and each worker's clock, sampler position and
    generators go to rank 0 (server 0), which writes one file; ``config.resume`` sends each rank
    its part back. ``config.save_model``: the reporter writes the final weights.

    Returns a TrainResult on the reporter (figures: :func:`figures`), None on
    the other ranks. Raises ValueError (naming the fix) for a world without room for the
    servers and a worker, or checkpoints outside sync mode; NonFiniteLossError on a worker
    whose loss diverges; checkpoint_io.CheckpointError (every rank) for a checkpoint that cannot be
    resumed; TrainingStopped after ``config.stop_after_steps``.
    """
    check_world(comm.Get_size(), config.num_servers, config.ps_mode, config.staleness)
    num_workers = comm.Get_size() - config.num_servers
    lr = config.lr * (num_workers if config.scale_lr and config.ps_mode != "async" else 1)
    history, log, start = [], rank_logger(True, config.progress), time.perf_counter()
    checkpointer = None
    if config.checkpoint_dir is not None:
        if config.ps_mode != "sync":
            raise ValueError(f"checkpoints need --ps-mode sync, not {config.ps_mode} (the versions pulled depend on "
                             "timing there, so no exact state to resume exists)")

        def checkpointer(part):  # a server or a worker: rank 0 writes, the reporter logs
            is_worker = isinstance(part, Worker)
            talk = log if comm.Get_rank() == config.num_servers else silent
            return Checkpointer(config, part.model if is_worker else None, None if is_worker else part.optimizer,
                                None if is_worker else part.warmup, comm=comm, log=talk, extra={"part": part},
                                gathered=True, weights=False)

    def on_epoch_end(epoch, loss, model):  # time: since the start, scoring included
        history.append(report_epoch(model, dataset, config, epoch, loss, time.perf_counter() - start, log))

    with collective_deadline(config.timeout):
        result = train_parameter_server(
            comm, lambda: build_model(config, dataset), dataset.X_train, dataset.y_train,
            num_servers=config.num_servers, mode=config.ps_mode, staleness=config.staleness, epochs=config.epochs,
            batch_size=config.batch_size, lr=lr, momentum=config.momentum, weight_decay=config.weight_decay,
            warmup_epochs=config.warmup_epochs, seed=config.seed, on_epoch_end=on_epoch_end,
            progress=config.progress, timeout=config.timeout, checkpointer=checkpointer)
    if isinstance(result, ServerStats) and config.stop_after_steps is not None:
        steps = config.epochs * math.ceil(math.ceil(len(dataset.X_train) / num_workers) / config.batch_size)
        if result.version < steps:  # the workers stopped early on purpose
            raise TrainingStopped(result.version)
    if not isinstance(result, WorkerStats) or result.model is None:
        return None
    Checkpointer(config, result.model, None).save_model()  # the reporter (comm=None: it writes)
    param_bytes = FlatLayout(result.model.parameters(), config.num_servers).nbytes
    return TrainResult(history[-1]["test_accuracy"], history, figures(result.servers, num_workers, param_bytes),
                       result.model)
