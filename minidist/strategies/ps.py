"""Parameter servers: ``train --strategy ps`` (sync, async, ssp; sharded over ``num_servers``).
"""
from __future__ import annotations

import math
import time

from tqdm import tqdm

from minidist import data
from minidist.fault import Checkpointer, TrainingStopped
from minidist.train import TrainConfig, TrainResult, _quiet, build_model, collective_deadline, report_epoch


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

    Returns a TrainResult on the reporter (figures: ``parameter_server.figures``), None on
    the other ranks. Raises ValueError (naming the fix) for a world without room for the
    servers and a worker, or checkpoints outside sync mode; NonFiniteLossError on a worker
    whose loss diverges; fault.CheckpointError (every rank) for a checkpoint that cannot be
    resumed; TrainingStopped after ``config.stop_after_steps``.
    """
    from minidist.parallel import parameter_server as ps  # noqa: PLC0415

    ps.check_world(comm.Get_size(), config.num_servers, config.ps_mode, config.staleness)
    num_workers = comm.Get_size() - config.num_servers
    lr = config.lr * (num_workers if config.scale_lr and config.ps_mode != "async" else 1)
    history, log, start = [], (tqdm.write if config.progress else print), time.perf_counter()
    checkpointer = None
    if config.checkpoint_dir is not None:
        if config.ps_mode != "sync":
            raise ValueError(f"checkpoints need --ps-mode sync, not {config.ps_mode} (the versions pulled depend on "
                             "timing there, so no exact state to resume exists)")

        def checkpointer(part):  # a server or a worker: rank 0 writes, the reporter logs
            is_worker = isinstance(part, ps.Worker)
            talk = log if comm.Get_rank() == config.num_servers else _quiet
            return Checkpointer(config, part.model if is_worker else None, None if is_worker else part.optimizer,
                                None if is_worker else part.warmup, comm=comm, log=talk, extra={"part": part},
                                gathered=True, weights=False)

    def on_epoch_end(epoch, loss, model):  # time: since the start, scoring included
        history.append(report_epoch(model, dataset, config, epoch, loss, time.perf_counter() - start, log))

    with collective_deadline(config.timeout):
        result = ps.train_parameter_server(
            comm, lambda: build_model(config, dataset), dataset.X_train, dataset.y_train,
            num_servers=config.num_servers, mode=config.ps_mode, staleness=config.staleness, epochs=config.epochs,
            batch_size=config.batch_size, lr=lr, momentum=config.momentum, weight_decay=config.weight_decay,
            warmup_epochs=config.warmup_epochs, seed=config.seed, on_epoch_end=on_epoch_end,
            progress=config.progress, timeout=config.timeout, checkpointer=checkpointer)
    if isinstance(result, ps.ServerStats) and config.stop_after_steps is not None:
        steps = config.epochs * math.ceil(math.ceil(len(dataset.X_train) / num_workers) / config.batch_size)
        if result.version < steps:  # the workers stopped early on purpose
            raise TrainingStopped(result.version)
    if not isinstance(result, ps.WorkerStats) or result.model is None:
        return None
    Checkpointer(config, result.model, None).save_model()  # the reporter (comm=None: it writes)
    param_bytes = ps.FlatLayout(result.model.parameters(), config.num_servers).nbytes
    return TrainResult(history[-1]["test_accuracy"], history, ps.figures(result.servers, num_workers, param_bytes),
                       result.model)
