"""ZeRO-1's driver: ``train --strategy ddp --zero`` (``DistributedDataParallel`` for the same
start, its gradient all-reduce skipped with ``no_sync``; ``ZeroRedundancyOptimizer(...,
reduce_gradients=True)`` reduce-scattering the gradients, stepping each rank's shard and
all-gathering the shards), for ``--model mlp`` or ``gpt``. Everything else is ``train
--strategy ddp``'s; the optimizer's state is 1/P per rank, so a checkpoint gathers every rank's
part into one file (``Checkpointer(..., gathered=True)``; it resumes on the same number of
ranks, or, with ``--global-batch-size``, on another: the moments are resharded from their offsets,
``minidist.resharding``). The figures add the bytes each rank sent per training step (a reduce-scatter and an
all-gather, 2Ψ(P-1)/P with ring collectives, Ψ the padded parameters' bytes, DDP's own; plus one
number for the clipping's norm) and this rank's optimizer state in bytes.
"""
from __future__ import annotations

from minidist import memory, precision
from minidist.fault import Checkpointer
from minidist.parallel.data_parallel.ddp import DistributedDataParallel
from minidist.parallel.zero.optimizer import apply_zero
from minidist.resharding import ShardLayout
from minidist.tracing import CountingComm
from minidist.train import (
    StepBytes,
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
    sharded_step,
    workload_for,
)


def check_zero(world_size: int, config: TrainConfig) -> None:
    """Raise ValueError, naming the fix, for what ``--zero`` cannot run: a comm hook (a hook
    compresses DDP's all-reduce, which --zero skips: the optimizer reduce-scatters the
    gradients itself)."""
    if config.comm_hook != "none":
        raise ValueError("--zero reduce-scatters the gradients itself, skipping DDP's all-reduce that a comm hook "
                         "compresses; leave out --comm-hook or --zero")


def train_zero(comm, config: TrainConfig, dataset, *, checkpointer_class=Checkpointer) -> TrainResult | None:
    """``train --strategy ddp --zero``: ``train_ddp``'s run (the same model, data, lr scaling,
    schedule, clipping and reports on rank 0) with the workload's optimizer (SGD for the MLP,
    AdamW for the GPT) wrapped in :class:`ZeroRedundancyOptimizer` over ``comm``, which
    reduce-scatters the gradients itself (``train.sharded_step`` inside ``ddp.no_sync``).

    Returns a TrainResult on rank 0 (figures: ranks, global_batch, lr, zero_stage,
    bytes_per_step (each rank's mean over the training steps, rank order), bytes_communicated
    (rank 0's in training steps), optimizer_state_bytes (rank 0's: 1/P of DDP's)) and None
    elsewhere. Raises ValueError for what :func:`check_zero` refuses, NonFiniteLossError,
    checkpoint_io.CheckpointError (another number of ranks, other flags), TrainingStopped.
    Source: Rajbhandari et al., SC 2020, section 5.1.
    """
    check_zero(comm.Get_size(), config)
    with collective_deadline(config.timeout):
        rank, size = comm.Get_rank(), comm.Get_size()
        config = per_rank_config(config, size, rank)  # --global-batch-size: this rank's part of it
        work = workload_for(config, dataset)
        traffic = CountingComm(comm, allow_collectives=True, keep_messages=False)
        ddp = DistributedDataParallel(work.model(), traffic)
        loader = work.loader(rank, size)
        lr = data_parallel_lr(work, config, size)
        optimizer = apply_zero(ddp.parameters(), work.optimizer(ddp.parameters(), lr), traffic)  # its own, sharded
        schedule = work.lr_schedule(optimizer, len(loader))
        progress = rank == 0 and config.progress
        log = rank_logger(rank == 0, progress)
        log(f"ddp --zero: {size} ranks, {batch_description(config, size)}, "
            f"lr {lr:g}, {type(optimizer.optim).__name__} on {optimizer.flat.shard_size} of "
            f"{optimizer.flat.padded} numbers per rank")

        def report(epoch, loss, seconds):
            return work.report(ddp.module, epoch, loss, seconds, log, world_size=size)

        # the backward inside ddp.no_sync(): the optimizer reduce-scatters the gradients itself (2Ψ, not 3Ψ),
        # and clips over the reduce-scattered shards
        clip = (lambda: optimizer.clip_grad_norm_(work.grad_clip)) if work.grad_clip else None
        scaler = precision.grad_scaler_for(config.precision, config.loss_scale)  # fp32 master shards
        step = StepBytes(sharded_step(lambda x, y: work.loss(work.forward(ddp, x), y), optimizer, schedule, clip,
                                      context=ddp.no_sync, precision=config.precision,
                                      scaler=scaler if scaler.is_enabled() else None, comm=comm,
                                      device=config.device, loss_weight=loss_weight(config, size, rank)), traffic)
        layout = ShardLayout(optimizer=[(optimizer.flat, True)])  # the moments: pieces of one flat vector
        checkpointer = checkpointer_class(config, ddp.module, optimizer, schedule, comm=comm, log=log, gathered=True,
                                          extra=checkpoint_parts(work, loader, scaler), metadata=work.metadata(),
                                          layout=layout)
        history = fit(step, loader, work.epochs, on_epoch_end=report if rank == 0 else None, progress=progress,
                      start=work.begin(checkpointer.resume()), on_step_end=checkpointer, bar_label=work.bar_label)
        ddp.verify_synced()
        checkpointer.save_model()
        everyone = step.per_step(comm)
    if rank != 0:
        return None
    figures = {"ranks": size, "global_batch": global_batch(config, size), "lr": f"{lr:g}", "zero_stage": 1,
               "bytes_per_step": ",".join(map(str, everyone)), "bytes_communicated": step.bytes,
               "optimizer_state_bytes": memory.optimizer_state_bytes(optimizer.optim),
               **precision.figures(config.precision, scaler)}
    return TrainResult(**work.final(ddp.module, history), history=history, figures=figures, model=ddp.module)

