"""Synchronous data parallelism's driver: ``train --strategy ddp`` (``DistributedDataParallel`` over MPI),
for either workload (``--model mlp`` or ``gpt``: :mod:`minidist.workloads`).
"""
from __future__ import annotations

from minidist import precision
from minidist.fault import Checkpointer
from minidist.parallel.data_parallel.comm_hooks import comm_hook
from minidist.parallel.data_parallel.ddp import DistributedDataParallel
from minidist.train import (
    ParallelRun,
    TrainConfig,
    TrainResult,
    batch_description,
    data_parallel_lr,
    global_batch,
    loss_weight,
    per_rank_config,
    train_parallel,
    workload_for,
    workload_step,
)


def train_ddp(comm, config: TrainConfig, dataset, *, checkpointer_class=Checkpointer) -> TrainResult | None:
    """Synchronous data-parallel training over ``comm`` (e.g. ``mpi4py.MPI.COMM_WORLD``) of
    ``config.model``'s workload (``train.workload_for``: the MLP with SGD, the GPT with AdamW):
    :func:`~minidist.train.train_parallel` with :class:`DataParallelRun`.

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
    return train_parallel(DataParallelRun, comm, config, dataset, checkpointer_class=checkpointer_class)


class DataParallelRun(ParallelRun):
    """ddp's parallelize step and hooks (:func:`train_ddp`): the workload's model wrapped in
    ``DistributedDataParallel`` over every rank (``config.all_reduce``; ``config.comm_hook``
    registered), each rank one replica, the workload's optimizer at the scaled lr."""

    def __init__(self, comm, config: TrainConfig, dataset):
        rank, size = comm.Get_rank(), comm.Get_size()
        config = per_rank_config(config, size, rank)  # --global-batch-size: this rank's part of it
        work = workload_for(config, dataset)
        self.ddp = DistributedDataParallel(work.model(), comm, algorithm=config.all_reduce)
        self.hook_state = None
        if config.comm_hook != "none":
            self.hook_state, hook = comm_hook(config.comm_hook, config.topk_ratio)
            self.ddp.register_comm_hook(self.hook_state, hook)
        lr = data_parallel_lr(work, config, size)
        super().__init__(comm, config, work, self.ddp.module, work.optimizer(self.ddp.parameters(), lr), lr,
                         rank, size)

    def step(self):
        # Mixed precision: the averaged gradients are the same on every rank, so all skip together.
        return workload_step(self.work, self.ddp, self.optimizer, self.schedule, self.scaler,
                             loss_weight(self.config, self.dp, self.dp_rank))

    def describe(self) -> str:
        config, warmup = self.config, getattr(self.schedule, "warmup_steps", 0)
        return (f"ddp: {self.dp} ranks, {batch_description(config, self.dp)}, "
                f"lr {self.lr:g}{f', warm-up {warmup} steps' if warmup else ''}, {len(self.ddp.buckets)} buckets, "
                f"all-reduce {config.all_reduce}"
                f"{'' if config.comm_hook == 'none' else f', comm hook {config.comm_hook}'}")

    def checkpoint_options(self) -> dict:
        # The int8/top-k error-feedback residuals differ per rank: each rank's goes in the checkpoint.
        return {"per_rank": None if self.hook_state is None else {"comm_hook": self.hook_state}}

    def finish(self, checkpointer):
        self.ddp.verify_synced()
        return super().finish(checkpointer)

    def figures(self, step) -> dict | None:
        config, stats = self.config, self.ddp.stats
        return {
            "ranks": self.dp,
            "global_batch": global_batch(config, self.dp),
            "lr": f"{self.lr:g}",
            "buckets": len(self.ddp.buckets),
            "all_reduce": config.all_reduce,
            "all_reduce_calls": stats.all_reduce_calls,
            "bytes_communicated": stats.bytes_sent,
            "comm_seconds": f"{stats.comm_seconds:.3f}",
            "compute_seconds": f"{stats.compute_seconds:.3f}",
            **({} if config.comm_hook == "none" else {"comm_hook": config.comm_hook}),
            **precision.figures(config.precision, self.scaler),
        }
