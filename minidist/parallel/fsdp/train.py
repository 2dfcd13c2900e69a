"""FSDP's driver: ``train --strategy fsdp [--sharding-strategy FULL_SHARD|SHARD_GRAD_OP|NO_SHARD]``
for ``--model mlp`` (one unit) or ``gpt`` (a unit per block and the root).

The run is ``train --strategy ddp``'s (each rank reads its share of the global batch, the same
lr scaling, schedule and clipping) with the model wrapped in ``FullyShardedDataParallel`` and
the workload's optimizer built on this rank's shards. What changes: the gradient norm is clipped
over the shards (``FullyShardedDataParallel.clip_grad_norm_``: one number all-reduced);
evaluation runs the sharded model, so every rank evaluates (rank 0 prints); a checkpoint
gathers every rank's shards and optimizer state into one file (``Checkpointer(...,
gathered=True)``; resuming needs the same sharding strategy, and the same number of ranks unless
``--global-batch-size`` is given: then the shards are cut again, ``minidist.resharding``); the sample,
``--save-model`` and the returned model are a dense copy loaded from ``full_state_dict``. The
figures add the bytes each rank sent per training step (ring: 3Ψ(P-1)/P for FULL_SHARD,
2Ψ(P-1)/P for the others, plus the clipping's number) and what rank 0 holds of the parameters
and of the optimizer state.
"""
from __future__ import annotations

from minidist import memory, precision
from minidist.fault import Checkpointer
from minidist.parallel.fsdp.fsdp import FullyShardedDataParallel
from minidist.parallel.fsdp.unit import SHARDING_STRATEGIES
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


def check_fsdp(world_size: int, config: TrainConfig) -> None:
    """Raise ValueError, naming the fix, for what ``--strategy fsdp`` cannot run: an unknown
    sharding strategy."""
    if config.sharding_strategy not in SHARDING_STRATEGIES:
        raise ValueError(f"--sharding-strategy {config.sharding_strategy} is not one of "
                         f"{', '.join(SHARDING_STRATEGIES)}")


def train_fsdp(comm, config: TrainConfig, dataset, *, checkpointer_class=Checkpointer) -> TrainResult | None:
    """Fully sharded data-parallel training of ``config``'s workload over ``comm`` with
    ``config.sharding_strategy`` (module docstring). Every wait gives up after
    ``config.timeout`` seconds.

    Returns a TrainResult on rank 0 (figures: ranks, global_batch, lr, sharding_strategy, units,
    bytes_per_step (each rank's mean over the training steps, rank order), bytes_communicated
    (rank 0's in training steps), parameter_bytes and optimizer_state_bytes (rank 0's shards and
    state); ``model``: a dense model with the trained weights) and None elsewhere. Raises
    ValueError for what :func:`check_fsdp` refuses, NonFiniteLossError on a diverging run,
    checkpoint_io.CheckpointError for a checkpoint of another layout, TrainingStopped after
    ``config.stop_after_steps``. Sources: Rajbhandari et al., SC 2020; Zhao et al., VLDB 2023.
    """
    check_fsdp(comm.Get_size(), config)
    with collective_deadline(config.timeout):
        rank, size = comm.Get_rank(), comm.Get_size()
        config = per_rank_config(config, size, rank)  # --global-batch-size: this rank's part of it
        work = workload_for(config, dataset)
        traffic = CountingComm(comm, allow_collectives=True, keep_messages=False)
        model = FullyShardedDataParallel(work.model(), traffic, config.sharding_strategy)
        loader = work.loader(rank, size)
        lr = data_parallel_lr(work, config, size)
        optimizer = work.optimizer(model.parameters(), lr)
        schedule = work.lr_schedule(optimizer, len(loader))
        progress = rank == 0 and config.progress
        log = rank_logger(rank == 0, progress)
        log(f"fsdp {config.sharding_strategy}: {size} ranks, {batch_description(config, size)}, lr {lr:g}, "
            f"{len(model.units)} units, "
            f"{sum(u.shard.size for u in model.units)} of {sum(u.flat.numel for u in model.units)} numbers per rank")

        def report(epoch, loss, seconds):  # every rank: the sharded forward is collective
            return work.report(model, epoch, loss, seconds, log, world_size=size)

        clip = (lambda: model.clip_grad_norm_(work.grad_clip)) if work.grad_clip else None
        scaler = precision.grad_scaler_for(config.precision, config.loss_scale)  # fp32 master shards
        step = StepBytes(sharded_step(lambda x, y: work.loss(work.forward(model, x), y), optimizer, schedule, clip,
                                      precision=config.precision, scaler=scaler if scaler.is_enabled() else None,
                                      comm=comm, device=config.device,
                                      loss_weight=loss_weight(config, size, rank)), traffic)
        pieces = [(unit.flat, unit.sharded) for unit in model.units]  # each unit's shard and its moments
        layout = ShardLayout(model={name: piece for (name, _), piece in zip(model.named_parameters(), pieces)},
                             optimizer=pieces, names=model.names)
        checkpointer = checkpointer_class(config, model, optimizer, schedule, comm=comm, log=log, gathered=True,
                                          extra=checkpoint_parts(work, loader, scaler), metadata=work.metadata(),
                                          layout=layout)
        history = fit(step, loader, work.epochs, on_epoch_end=report, progress=progress,
                      start=work.begin(checkpointer.resume()), on_step_end=checkpointer, bar_label=work.bar_label)
        checkpointer.close()
        dense = work.model()
        dense.load_state_dict(model.full_state_dict())  # every rank takes part; rank 0 samples and saves
        if rank == 0 and config.save_model:
            Checkpointer(config, dense, None, metadata=work.metadata()).save_model()
        everyone = step.per_step(comm)
    if rank != 0:
        return None
    figures = {"ranks": size, "global_batch": global_batch(config, size), "lr": f"{lr:g}",
               "sharding_strategy": config.sharding_strategy, "units": len(model.units),
               "bytes_per_step": ",".join(map(str, everyone)), "bytes_communicated": step.bytes,
               "parameter_bytes": memory.parameter_bytes(model.parameters()),
               "optimizer_state_bytes": memory.optimizer_state_bytes(optimizer),
               **precision.figures(config.precision, scaler)}
    return TrainResult(**work.final(dense, history), history=history, figures=figures, model=dense)
