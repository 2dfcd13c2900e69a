"""Synchronous data parallelism's driver: ``train --strategy ddp`` (``DistributedDataParallel`` over MPI).
"""
from __future__ import annotations

from minidist import data, optim, precision
from minidist.fault import Checkpointer
from minidist.parallel.data_parallel.comm_hooks import comm_hook
from minidist.parallel.data_parallel.ddp import DistributedDataParallel
from minidist.parallel.data_parallel.inference import evaluate
from minidist.train import (
    TrainConfig,
    TrainResult,
    build_model,
    collective_deadline,
    fit,
    rank_logger,
    report_epoch,
    supervised_step,
    warmup_schedule,
)


def train_ddp(comm, config: TrainConfig, dataset: data.Dataset, *,
              checkpointer_class=Checkpointer) -> TrainResult | None:
    """Synchronous data-parallel SGD over ``comm`` (e.g. ``mpi4py.MPI.COMM_WORLD``).

    Every rank builds the model from ``config.seed`` (rank 0's copy is broadcast anyway),
    reads its shard of the training set (``DistributedSampler``, reshuffled each epoch) in
    batches of ``config.batch_size`` (per rank; the global batch is that times the number
    of ranks) and averages gradients with ``DistributedDataParallel``. The learning rate is
    ``config.lr`` times the number of ranks (Goyal et al.'s linear scaling rule: the global
    batch is that many times larger, so there are that many times fewer steps per epoch)
    unless ``config.scale_lr`` is False, and ``config.warmup_epochs`` ramps it up linearly
    (``optim.WarmupLR``, stepped per batch). Every collective waits at most
    ``config.timeout`` seconds. Progress and per-epoch lines come from rank 0 only; the
    final test accuracy is computed data-parallel (``inference.evaluate``).

    Returns a TrainResult on rank 0 (figures: ranks, global_batch, lr, buckets,
    all_reduce_calls, bytes_communicated (sent by rank 0), comm_seconds, compute_seconds)
    and None on the other ranks. Checkpoints (rank 0 writes, every rank loads the same file):
    :class:`Checkpointer` (or ``checkpointer_class``, a subclass: ``minidist.replay`` passes its own), so
    ``config.checkpoint_dir`` must be one folder every rank sees.
    ``config.comm_hook`` (not "none") registers that hook of ``minidist.parallel.data_parallel.comm_hooks``
    (``comm_hook(name, config.topk_ratio)``; the figures then include comm_hook): fp16/bf16
    halve the bytes, int8/topk compress with error feedback, whose residuals (one per rank)
    every checkpoint holds, so a resumed or replayed run is bit-identical to the uninterrupted one.
    Raises NonFiniteLossError on a rank whose loss diverges, checkpoint_io.CheckpointError (every rank)
    for a checkpoint that cannot be resumed, TrainingStopped after ``config.stop_after_steps``.
    """
    with collective_deadline(config.timeout):
        rank, size = comm.Get_rank(), comm.Get_size()
        ddp = DistributedDataParallel(build_model(config, dataset), comm)
        hook_state = None
        if config.comm_hook != "none":
            hook_state, hook = comm_hook(config.comm_hook, config.topk_ratio)
            ddp.register_comm_hook(hook_state, hook)
        sampler = data.DistributedSampler(len(dataset.X_train), size, rank, shuffle=True, seed=config.seed)
        loader = data.DataLoader(dataset.X_train, dataset.y_train, batch_size=config.batch_size, sampler=sampler)
        scale = True if config.scale_lr is None else config.scale_lr
        lr = optim.scale_lr(config.lr, config.batch_size * size, config.batch_size) if scale else config.lr
        optimizer = optim.SGD(ddp.parameters(), lr=lr, momentum=config.momentum, weight_decay=config.weight_decay)
        warmup = warmup_schedule(optimizer, config, len(loader))
        progress = rank == 0 and config.progress
        log = rank_logger(rank == 0, progress)
        log(f"ddp: {size} ranks, per-rank batch {config.batch_size}, global batch {config.batch_size * size}, "
            f"lr {lr:g}{f', warm-up {warmup.warmup_steps} steps' if warmup else ''}, {len(ddp.buckets)} buckets"
            f"{'' if config.comm_hook == 'none' else f', comm hook {config.comm_hook}'}")

        def report(epoch, loss, seconds):
            return report_epoch(ddp.module, dataset, config, epoch, loss, seconds, log, extra=scaler.describe())

        # Mixed precision: the averaged gradients are the same on every rank, so all skip together.
        scaler = precision.grad_scaler_for(config.precision, config.loss_scale)
        step_fn = supervised_step(ddp, optimizer, device=config.device, lr_schedule=warmup,
                                  precision=config.precision, scaler=scaler if scaler.is_enabled() else None)
        # The int8/top-k error-feedback residuals differ per rank: each rank's goes in the checkpoint.
        checkpointer = checkpointer_class(config, ddp.module, optimizer, warmup, comm=comm, log=log,
                                          extra={"scaler": scaler} if scaler.is_enabled() else None,
                                          per_rank=None if hook_state is None else {"comm_hook": hook_state})
        history = fit(step_fn, loader, config.epochs, on_epoch_end=report if rank == 0 else None, progress=progress,
                      start=checkpointer.resume(), on_step_end=checkpointer)
        ddp.verify_synced()
        checkpointer.save_model()
        test_accuracy = evaluate(ddp.module, dataset.X_test, dataset.y_test, comm, device=config.device)
    if rank != 0:
        return None
    stats = ddp.stats
    figures = {
        "ranks": size,
        "global_batch": config.batch_size * size,
        "lr": f"{lr:g}",
        "buckets": len(ddp.buckets),
        "all_reduce_calls": stats.all_reduce_calls,
        "bytes_communicated": stats.bytes_sent,
        "comm_seconds": f"{stats.comm_seconds:.3f}",
        "compute_seconds": f"{stats.compute_seconds:.3f}",
        **({} if config.comm_hook == "none" else {"comm_hook": config.comm_hook}),
        **precision.figures(config.precision, scaler),
    }
    return TrainResult(test_accuracy, history, figures, ddp.module)
