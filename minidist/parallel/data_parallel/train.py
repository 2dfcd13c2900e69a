"""Synchronous data parallelism's driver: ``train --strategy ddp`` (``DistributedDataParallel`` over MPI),
for either workload (``--model mlp`` or ``gpt``: :mod:`minidist.workloads`).
"""
from __future__ import annotations

from minidist import precision
from minidist.fault import Checkpointer
from minidist.parallel.data_parallel.comm_hooks import comm_hook
from minidist.parallel.data_parallel.ddp import DistributedDataParallel
from minidist.train import (
    TrainConfig,
    TrainResult,
    batch_description,
    checkpoint_parts,
    collective_deadline,
    data_parallel_lr,
    fit,
    global_batch,
    loss_weight,
    per_rank_config,
    rank_logger,
    workload_for,
    workload_step,
)


def train_ddp(comm, config: TrainConfig, dataset, *, checkpointer_class=Checkpointer) -> TrainResult | None:
    """Synchronous data-parallel training over ``comm`` (e.g. ``mpi4py.MPI.COMM_WORLD``) of
    ``config.model``'s workload (``train.workload_for``: the MLP with SGD, the GPT with AdamW).

    Every rank builds the model from ``config.seed`` (rank 0's copy is broadcast anyway),
    reads its share of each global batch (``workload.loader(rank, size)``: the MLP's shard of
    the training set, ``DistributedSampler``, reshuffled each epoch; the GPT's rows of each
    step's windows, ``data.TokenWindows(rank=, world_size=)``) in batches of
    ``config.batch_size`` (per rank; the global batch is that times the number of ranks) and
    averages gradients with ``DistributedDataParallel``. For the MLP the learning rate is
    ``config.lr`` times the number of ranks (Goyal et al.'s linear scaling rule: the global
    batch is that many times larger) unless ``config.scale_lr`` is False; for the GPT (AdamW,
    whose step size does not grow with the batch as SGD's does) only when ``config.scale_lr``
    is True. The workload's schedule (warm-up; the GPT's cosine) and gradient clipping (the
    GPT's, on the averaged gradients, the same on every rank) follow. Every collective waits at
    most ``config.timeout`` seconds. Progress and the report lines come from rank 0 only, which
    scores the model (the MLP's accuracies, the GPT's fixed evaluation windows).

    Returns a TrainResult on rank 0 (figures: ranks, global_batch, lr, buckets, all_reduce
    (``config.all_reduce``, DDP's algorithm), all_reduce_calls, bytes_communicated (sent by
    rank 0, the node and cross communicators' messages of hierarchical and torus included),
    comm_seconds, compute_seconds)
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
        config = per_rank_config(config, size, rank)  # --global-batch-size: this rank's part of it
        work = workload_for(config, dataset)
        ddp = DistributedDataParallel(work.model(), comm, algorithm=config.all_reduce)
        hook_state = None
        if config.comm_hook != "none":
            hook_state, hook = comm_hook(config.comm_hook, config.topk_ratio)
            ddp.register_comm_hook(hook_state, hook)
        loader = work.loader(rank, size)
        lr = data_parallel_lr(work, config, size)
        optimizer = work.optimizer(ddp.parameters(), lr)
        schedule = work.lr_schedule(optimizer, len(loader))
        progress = rank == 0 and config.progress
        log = rank_logger(rank == 0, progress)
        warmup = getattr(schedule, "warmup_steps", 0)
        log(f"ddp: {size} ranks, {batch_description(config, size)}, "
            f"lr {lr:g}{f', warm-up {warmup} steps' if warmup else ''}, {len(ddp.buckets)} buckets, "
            f"all-reduce {config.all_reduce}"
            f"{'' if config.comm_hook == 'none' else f', comm hook {config.comm_hook}'}")

        def report(epoch, loss, seconds):
            return work.report(ddp.module, epoch, loss, seconds, log, extra=scaler.describe(), world_size=size)

        # Mixed precision: the averaged gradients are the same on every rank, so all skip together.
        scaler = precision.grad_scaler_for(config.precision, config.loss_scale)
        step_fn = workload_step(work, ddp, optimizer, schedule, scaler, loss_weight(config, size, rank))
        # The int8/top-k error-feedback residuals differ per rank: each rank's goes in the checkpoint.
        checkpointer = checkpointer_class(config, ddp.module, optimizer, schedule, comm=comm, log=log,
                                          extra=checkpoint_parts(work, loader, scaler), metadata=work.metadata(),
                                          per_rank=None if hook_state is None else {"comm_hook": hook_state})
        history = fit(step_fn, loader, work.epochs, on_epoch_end=report if rank == 0 else None, progress=progress,
                      start=work.begin(checkpointer.resume()), on_step_end=checkpointer, bar_label=work.bar_label)
        ddp.verify_synced()
        checkpointer.save_model()
    if rank != 0:
        return None
    stats = ddp.stats
    figures = {
        "ranks": size,
        "global_batch": global_batch(config, size),
        "lr": f"{lr:g}",
        "buckets": len(ddp.buckets),
        "all_reduce": config.all_reduce,
        "all_reduce_calls": stats.all_reduce_calls,
        "bytes_communicated": stats.bytes_sent,
        "comm_seconds": f"{stats.comm_seconds:.3f}",
        "compute_seconds": f"{stats.compute_seconds:.3f}",
        **({} if config.comm_hook == "none" else {"comm_hook": config.comm_hook}),
        **precision.figures(config.precision, scaler),
    }
    return TrainResult(**work.final(ddp.module, history), history=history, figures=figures, model=ddp.module)
