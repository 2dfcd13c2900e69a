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
    ParallelRun,
    StepBytes,
    TrainConfig,
    TrainResult,
    batch_description,
    data_parallel_lr,
    global_batch,
    loss_weight,
    per_rank_config,
    sharded_step,
    train_parallel,
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
    reduce-scatters the gradients itself (``train.sharded_step`` inside ``ddp.no_sync``):
    :func:`~minidist.train.train_parallel` with :class:`ZeroRun`.

    Returns a TrainResult on rank 0 (figures: ranks, global_batch, lr, zero_stage,
    bytes_per_step (each rank's mean over the training steps, rank order), bytes_communicated
    (rank 0's in training steps), optimizer_state_bytes (rank 0's: 1/P of DDP's)) and None
    elsewhere. Raises ValueError for what :func:`check_zero` refuses, NonFiniteLossError,
    checkpoint_io.CheckpointError (another number of ranks, other flags), TrainingStopped.
    Source: Rajbhandari et al., SC 2020, section 5.1.
    """
    check_zero(comm.Get_size(), config)
    return train_parallel(ZeroRun, comm, config, dataset, checkpointer_class=checkpointer_class)


class ZeroRun(ParallelRun):
    """ZeRO-1's parallelize step and hooks (:func:`train_zero`): ``DistributedDataParallel`` for
    the same start (its all-reduce skipped), the workload's optimizer sharded over every rank
    (``zero.optimizer.apply_zero``), every message counted (``tracing.CountingComm``)."""

    def __init__(self, comm, config: TrainConfig, dataset):
        rank, size = comm.Get_rank(), comm.Get_size()
        config = per_rank_config(config, size, rank)  # --global-batch-size: this rank's part of it
        work = workload_for(config, dataset)
        self.traffic = CountingComm(comm, allow_collectives=True, keep_messages=False)
        self.ddp = DistributedDataParallel(work.model(), self.traffic)
        lr = data_parallel_lr(work, config, size)
        optimizer = apply_zero(self.ddp.parameters(), work.optimizer(self.ddp.parameters(), lr), self.traffic)
        super().__init__(comm, config, work, self.ddp.module, optimizer, lr, rank, size)

    def step(self):
        # the backward inside ddp.no_sync(): the optimizer reduce-scatters the gradients itself (2Ψ, not 3Ψ),
        # and clips over the reduce-scattered shards
        work, optimizer, scaler = self.work, self.optimizer, self.scaler
        clip = (lambda: optimizer.clip_grad_norm_(work.grad_clip)) if work.grad_clip else None
        return StepBytes(sharded_step(lambda x, y: work.loss(work.forward(self.ddp, x), y), optimizer, self.schedule,
                                      clip, context=self.ddp.no_sync, precision=self.config.precision,
                                      scaler=scaler if scaler.is_enabled() else None, comm=self.comm,
                                      device=self.config.device,
                                      loss_weight=loss_weight(self.config, self.dp, self.dp_rank)), self.traffic)

    def describe(self) -> str:
        optimizer = self.optimizer
        return (f"ddp --zero: {self.dp} ranks, {batch_description(self.config, self.dp)}, "
                f"lr {self.lr:g}, {type(optimizer.optim).__name__} on {optimizer.flat.shard_size} of "
                f"{optimizer.flat.padded} numbers per rank")

    def report(self, epoch, loss, seconds):
        return self.work.report(self.model, epoch, loss, seconds, self.log, world_size=self.dp)

    def checkpoint_options(self) -> dict:
        layout = ShardLayout(optimizer=[(self.optimizer.flat, True)])  # the moments: pieces of one flat vector
        return {"gathered": True, "layout": layout}

    def finish(self, checkpointer):
        self.ddp.verify_synced()
        return super().finish(checkpointer)

    def figures(self, step) -> dict | None:
        everyone = step.per_step(self.comm)
        if everyone is None:
            return None
        return {"ranks": self.dp, "global_batch": global_batch(self.config, self.dp), "lr": f"{self.lr:g}",
                "zero_stage": 1, "bytes_per_step": ",".join(map(str, everyone)), "bytes_communicated": step.bytes,
                "optimizer_state_bytes": memory.optimizer_state_bytes(self.optimizer.optim),
                **precision.figures(self.config.precision, self.scaler)}
