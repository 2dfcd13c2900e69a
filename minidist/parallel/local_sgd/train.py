"""DiLoCo's driver: ``train --strategy diloco --sync-every H [--outer-lr 0.7 --outer-momentum 0.9
--nesterov] [--fragments F] [--comm-hook fp16|int8|...] [--dp D]`` under ``mpiexec -n P``.

The P ranks form a :class:`~minidist.parallel.mesh.DeviceMesh` of shape (D, P / D), names
("dp", "ddp"), the ranks of a replica group neighbours (they all-reduce gradients at every
step, so they share a node's fast links; the replica groups talk once every H steps, over the
slow ones: the two data centres)::

    P = 4, --dp 2:   replica group 0  [0 1]    ddp groups [0 1] [2 3]  (DDP inside: every step)
                     replica group 1  [2 3]    dp groups  [0 2] [1 3]  (DiLoCo across: every H steps)

``--dp`` left at 1 makes every rank a replica of its own (D = P, no DDP). Each rank reads its own
shard of the data (``work.loader(rank, P)``); inside a group DDP averages the gradients of its
P / D ranks, and each rank of a group runs the same DiLoCo over its ``dp`` group (the ranks at
the same place in every replica group), whose members hold identical weights: every rank of a
group sends the whole pseudo-gradient once every H steps (an HSDP-like layout would send 1/(P/D)
each; not written). The inner optimizer is the workload's (the GPT's AdamW with its warm-up and
cosine, the MLP's SGD with momentum); the outer one ``optim.SGD(lr=outer_lr,
momentum=outer_momentum, nesterov=...)`` on the pseudo-gradients (:mod:`.diloco`).

Reports: rank 0 scores its own replica's weights; with ``--eval-every`` a multiple of H (GPT)
they are the global weights, just synced. The dense model of the result (and ``--save-model``)
is the global weights, the same on every replica (a figure says whether every rank's hash
agrees): the local steps after the last sync are not in it. Checkpoints are refused (the outer
state, global weights and momentum, is not in the checkpointer's parts; a replica that restarts
joins from a peer instead, :mod:`.replicas`). fp32 only.
"""
from __future__ import annotations

import hashlib

from minidist.collectives import gather_objects
from minidist.fault import Checkpointer
from minidist.parallel.data_parallel.ddp import DistributedDataParallel
from minidist.parallel.local_sgd.diloco import DiLoCo, unflatten
from minidist.parallel.local_sgd.fragments import check_schedule
from minidist.parallel.local_sgd.replicas import ReplicaSet
from minidist.parallel.mesh import DeviceMesh
from minidist.tracing import CountingComm
from minidist.train import (
    ParallelRun,
    StepBytes,
    TrainConfig,
    TrainResult,
    data_parallel_lr,
    run_fields,
    train_parallel,
    workload_for,
    workload_step,
)

MESH_NAMES = ("dp", "ddp")


def replica_groups(world_size: int, config: TrainConfig) -> int:
    """D, the number of replica groups: ``config.dp``, or every rank when it is 1."""
    return world_size if config.dp == 1 else config.dp


def check_diloco(world_size: int, config: TrainConfig) -> None:
    """Raise ValueError, naming the fix, when ``config`` cannot train with ``--strategy diloco``
    on ``world_size`` ranks: ``--dp`` not dividing the ranks, more fragments than inner steps
    (or than parameter tensors: found when the model is built), an outer momentum of 1 or more,
    mixed precision."""
    groups = replica_groups(world_size, config)
    if world_size % groups:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(f"--dp {groups} does not divide the {world_size} ranks (each of the --dp replica groups holds "
                         f"ranks / dp ranks); use --dp among {divisors}")
    check_schedule(config.fragments, config.sync_every)
    if not 0 <= config.outer_momentum < 1:
        raise ValueError(f"--outer-momentum must be in [0, 1), got {config.outer_momentum:g}")
    if config.precision != "fp32":
        raise ValueError(f"--strategy diloco trains in float32 (the pseudo-gradients are float32 differences of the "
                         f"weights); leave out --precision {config.precision}")


def train_diloco(comm, config: TrainConfig, dataset, *, checkpointer_class=Checkpointer) -> TrainResult | None:
    """DiLoCo training of ``config`` over ``comm`` (module docstring): :func:`~minidist.train.train_parallel`
    with :class:`DiLoCoRun`, every wait giving up after ``config.timeout`` seconds (a replica not
    heard from by then is dropped from the quorum, :mod:`.replicas`).

    Returns a TrainResult on rank 0 (figures: ranks, replicas, ranks_per_replica, sync_every,
    fragments, outer (lr, momentum, Nesterov), syncs, sync_bytes_per_step (each rank's bytes sent
    to the other replica groups per step, rank order), bytes_communicated (rank 0's),
    replicas_identical (every rank's global weights hash the same), comm_hook when given) and None
    elsewhere. Raises ValueError for a layout :func:`check_diloco` refuses, NonFiniteLossError."""
    check_diloco(comm.Get_size(), config)
    return train_parallel(DiLoCoRun, comm, config, dataset, checkpointer_class=checkpointer_class)


class DiLoCoRun(ParallelRun):
    """diloco's parallelize step and hooks (:func:`train_diloco`): the (dp, ddp) mesh, the workload's
    model (in DDP over its replica group when the group has several ranks), its optimizer as the
    inner one, and :class:`.DiLoCo` over the ``dp`` group (counted: ``tracing.CountingComm``)."""

    def __init__(self, comm, config: TrainConfig, dataset):
        rank, size = comm.Get_rank(), comm.Get_size()
        groups = replica_groups(size, config)
        self.mesh = DeviceMesh(comm, (groups, size // groups), MESH_NAMES)
        work = workload_for(config, dataset)
        model, inner = work.model(), self.mesh.size("ddp")
        self.ddp = DistributedDataParallel(model, self.mesh.get_group("ddp")) if inner > 1 else None
        self.traffic = CountingComm(self.mesh.get_group("dp"), allow_collectives=True, keep_messages=False)
        fingerprint = {name: value for name, value in run_fields(config).items() if name not in ("dp",)}
        self.diloco = DiLoCo(model.parameters(), ReplicaSet(self.traffic, timeout=config.timeout), config.sync_every,
                             outer_lr=config.outer_lr, outer_momentum=config.outer_momentum,
                             nesterov=config.nesterov, fragments=config.fragments, comm_hook=config.comm_hook,
                             fingerprint=fingerprint)
        lr = data_parallel_lr(work, config, inner)  # the batch of a replica group grows with its ranks
        super().__init__(comm, config, work, model, work.optimizer(model.parameters(), lr), lr, rank, size)

    def step(self):
        inner = workload_step(self.work, self.ddp or self.model, self.optimizer, self.schedule, self.scaler)

        def step(x, y):
            loss = inner(x, y)
            self.diloco.step()
            return loss

        return StepBytes(step, self.traffic)

    def describe(self) -> str:
        config, groups = self.config, self.mesh.size("dp")
        inner = self.mesh.size("ddp")
        layout = f"{groups} replica groups of {inner} ranks (DDP inside)" if inner > 1 else f"{groups} replicas"
        fragments = f", {config.fragments} fragments (streaming)" if config.fragments > 1 else ""
        nesterov = " Nesterov" if self.diloco.outer[0].nesterov else ""
        return (f"diloco: {layout}, sync every {config.sync_every} inner steps{fragments}, outer SGD lr "
                f"{config.outer_lr:g} momentum {config.outer_momentum:g}{nesterov}"
                f", inner lr {self.lr:g}, batch {config.batch_size} per rank"
                f"{'' if config.comm_hook == 'none' else f', comm hook {config.comm_hook}'}")

    def finish(self, checkpointer):
        for theta, fragment in zip(self.diloco.global_params, self.diloco.fragments):
            unflatten(theta.data, fragment)  # the replicas' consensus: the global weights
        checkpointer.save_model()
        return self.model

    def figures(self, step) -> dict | None:
        config, diloco = self.config, self.diloco
        digest = hashlib.sha256(b"".join(theta.data.tobytes() for theta in diloco.global_params)).hexdigest()
        hashes = gather_objects(self.comm, digest)
        per_step = step.per_step(self.comm)
        if self.comm.Get_rank() != 0:
            return None
        return {
            "ranks": self.comm.Get_size(),
            "replicas": self.mesh.size("dp"),
            "ranks_per_replica": self.mesh.size("ddp"),
            "sync_every": config.sync_every,
            "fragments": config.fragments,
            "outer": f"lr {config.outer_lr:g} momentum {config.outer_momentum:g} nesterov {diloco.outer[0].nesterov}",
            "syncs": diloco.syncs,
            "sync_bytes_per_step": per_step,
            "bytes_communicated": self.traffic.nbytes,
            "replicas_identical": len(set(hashes)) == 1,
            **({} if config.comm_hook == "none" else {"comm_hook": config.comm_hook}),
        }
