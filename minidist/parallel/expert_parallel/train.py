"""The expert-parallel driver: ``train --model gpt --n-expert E --top-k K --strategy ep [--dp D]``
under ``mpiexec -n P``, and the one-process MoE GPT (``--strategy single --n-expert E``).

The P ranks form a :class:`~minidist.parallel.mesh.DeviceMesh` of shape (D, P / D), names
("dp", "ep"), ep fastest: an ep group's ranks exchange tokens twice per MoE layer and direction,
so they are neighbours; the D replicas of an expert meet once per step::

    P = 4, D = 2:   ep groups [0 1] [2 3]   (experts 0..E/2-1 on ranks 0 and 2, the rest on 1 and 3)
                    dp groups [0 2] [1 3]   (the replicas of the same experts)

Every rank reads its own part of the global batch (``--global-batch-size G``: G / P windows;
``--batch-size B``: B windows each), so its tokens are data-parallel for the dense layers and
expert-parallel inside the MoE layers; the capacity and the dropped set are those of the whole
global batch (``models.moe``), so P ranks train the one-process MoE GPT on G, step for step.

The parallelize step (:func:`parallelize`): the MoE GPT laid out over its ep group
(:func:`.gpt.apply_ep`), gradients reduced by who holds them (:func:`.gpt.reduce_gradients`:
replicated ones over all P, experts over their D replicas). Megatron-Core's order is
``tp-cp-ep-dp-pp``: ep sits inside data parallelism, as here. Composition: only with data
parallelism (``--dp``); tensor parallelism inside the experts, FSDP of the experts and pipelines
are not written yet (their flags are refused: they belong to tp, fsdp and 3d).

Evaluation and the final model: each report gathers the experts to ep rank 0 and world rank 0
evaluates the dense MoE GPT (every rank evaluating the same windows over the all-to-all would
share one capacity among P copies of the batch: another dropped set than one process's).
"""
from __future__ import annotations

import contextlib
import dataclasses

from minidist import sim
from minidist.fault import Checkpointer
from minidist.models.moe import check_experts
from minidist.parallel.expert_parallel.dispatch import expert_owners
from minidist.parallel.expert_parallel.gpt import (
    apply_ep,
    clip_grad_norm_,
    dense_state_dict,
    moe_layers,
    reduce_gradients,
)
from minidist.parallel.mesh import DeviceMesh
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

MESH_NAMES = ("dp", "ep")
MOE_FIELDS = ("n_expert", "top_k", "capacity_factor", "aux_loss_coef", "bias_update_rate")


def moe_gpt_config(gpt_config, config: TrainConfig):
    """``gpt_config`` (the workload's GPTConfig) with ``config``'s expert fields."""
    return dataclasses.replace(gpt_config, **{name: getattr(config, name) for name in MOE_FIELDS})


def check_expert_parallel(world_size: int, config: TrainConfig) -> None:
    """Raise ValueError, naming the fix, when ``config`` cannot train with ``--strategy ep`` on
    ``world_size`` ranks: not the GPT, no experts, ``--dp`` not dividing the ranks, fewer experts
    than ep ranks, expert settings that cannot route (top_k > n_expert), a global batch the ranks
    cannot split evenly, dropout, mixed precision."""
    if getattr(config, "model", "mlp") != "gpt":
        raise ValueError("--strategy ep spreads the experts of the GPT's MoE layers; use --model gpt --n-expert E")
    if not config.n_expert:
        raise ValueError("--strategy ep needs experts to spread: add --n-expert E (E >= the ep ranks)")
    try:
        check_experts(config.n_expert, config.top_k, config.capacity_factor, config.aux_loss_coef,
                      config.bias_update_rate)
    except ValueError as error:
        raise ValueError(f"{error} (--n-expert, --top-k, --capacity-factor)") from None
    if world_size % config.dp:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(f"--dp {config.dp} does not divide the {world_size} ranks (each of the --dp groups holds "
                         f"ranks / dp ep ranks); use --dp among {divisors}")
    try:
        expert_owners(config.n_expert, world_size // config.dp)
    except ValueError as error:
        raise ValueError(f"--strategy ep: {error}") from None
    g = config.global_batch_size
    if g is not None and g % world_size:
        raise ValueError(f"--global-batch-size {g} does not split evenly over {world_size} ranks (each rank's tokens "
                         f"weigh the same in the balance loss); use a multiple of {world_size}")
    if config.dropout and world_size > 1:  # one rank: the one-process MoE, whose dropout is its own
        raise ValueError(f"--strategy ep needs --dropout 0 (got {config.dropout:g}): an expert would draw its dropout "
                         "masks on another rank than in one process")
    if config.precision != "fp32":
        raise ValueError(f"--strategy ep trains in float32; leave out --precision {config.precision}")


def parallelize(model, mesh, ep_comm=None):
    """``model`` (the MoE GPT, the same on every rank) laid out over the mesh's ep group
    (``ep_comm``: that group, perhaps counted) with the capacity counted over the whole mesh;
    returns ``(model, reduce)``: ``reduce()`` after backward reduces the gradients (module
    docstring). Collective over the mesh."""
    # EP inside data parallelism (Megatron-Core's tp-cp-ep-dp-pp): the ep group's ranks trade tokens
    # at every MoE layer, the dp replicas only their gradients once per step.
    apply_ep(model, ep_comm or mesh.get_group("ep"), mesh.comm)
    return model, lambda: reduce_gradients(model, mesh.comm, mesh.get_group("dp"))


def train_expert_parallel(comm, config: TrainConfig, dataset, *, checkpointer_class=Checkpointer
                          ) -> TrainResult | None:
    """Expert-parallel training of ``config``'s MoE GPT over ``comm`` (module docstring):
    :func:`~minidist.train.train_parallel` with :class:`ExpertParallelRun`.

    Returns a TrainResult on rank 0 (figures: ranks, dp, ep, n_expert, top_k, capacity_factor,
    global_batch, lr, ep_bytes_per_step (each rank's all-to-all bytes per step, rank order),
    tokens_per_expert and dropped (the last step's, first MoE layer); ``model``: the dense MoE GPT)
    and None elsewhere. Raises ValueError for a layout :func:`check_expert_parallel` refuses,
    NonFiniteLossError. Sources: Lepikhin et al. 2020 (GShard); Fedus et al. 2021 (Switch)."""
    check_expert_parallel(comm.Get_size(), config)
    return train_parallel(ExpertParallelRun, comm, config, dataset, checkpointer_class=checkpointer_class)


def train_moe_single(comm, config: TrainConfig, dataset, **kwargs) -> TrainResult:
    """``train --strategy single --n-expert E``: the MoE GPT in one process, as the ep run on one
    rank of the simulator (no message leaves it: dispatch and combine are all_to_all_v with
    oneself; one BLAS thread). The reference every ``--strategy ep`` run equals. ``comm`` is ignored
    (None)."""
    check_expert_parallel(1, config)
    # The simulator's deadline bounds its whole run; one rank never waits for another, so the run
    # may take as long as it takes (1e9 s). The world runs in one BLAS thread, as its ranks do.
    world = sim.World(1, timeout=1e9)
    return world.run(lambda one: train_parallel(ExpertParallelRun, one, config, dataset, **kwargs))[0]


class ExpertParallelRun(ParallelRun):
    """ep's parallelize step and hooks (:func:`train_expert_parallel`)."""

    reports_everywhere = True  # the report gathers the experts (collective)

    def __init__(self, comm, config: TrainConfig, dataset):
        world_size, rank = comm.Get_size(), comm.Get_rank()
        self.mesh = DeviceMesh(comm, (config.dp, world_size // config.dp), MESH_NAMES)
        config = per_rank_config(config, world_size, rank)  # every rank its part of the global batch
        work = workload_for(config, dataset)
        work.gpt_config = moe_gpt_config(work.gpt_config, config)  # the workload builds the MoE GPT
        self.traffic = CountingComm(self.mesh.get_group("ep"), allow_collectives=True, keep_messages=False)
        model, self.reduce = parallelize(work.model(), self.mesh, self.traffic)
        lr = data_parallel_lr(work, config, world_size)
        super().__init__(comm, config, work, model, work.optimizer(model.parameters(), lr), lr, rank, world_size)

    def step(self):
        model, work, config = self.model, self.work, self.config

        @contextlib.contextmanager
        def then_reduce():
            yield
            self.reduce()

        clip = (lambda: clip_grad_norm_(model, self.traffic, work.grad_clip)) if work.grad_clip else None
        step = sharded_step(lambda x, y: model(x, y)[1], self.optimizer, self.schedule, clip, then_reduce,
                            device=config.device, loss_weight=loss_weight(config, self.dp, self.dp_rank))
        return StepBytes(step, self.traffic)

    def describe(self) -> str:
        config, ep = self.config, self.mesh.size("ep")
        held = moe_layers(self.model)[0].dispatcher.expert_ids
        if self.mesh.size() == 1:  # --strategy single --n-expert E
            return (f"single: 1 process, {config.n_expert} experts, top-{config.top_k}, capacity factor "
                    f"{config.capacity_factor}, batch {config.batch_size}, lr {self.lr:g}")
        return (f"ep: {self.mesh.size()} ranks = dp {self.mesh.size('dp')} x ep {ep} (ep fastest), {config.n_expert} "
                f"experts, top-{config.top_k}, capacity factor {config.capacity_factor}, rank 0 holds experts "
                f"{held[0]}..{held[-1]}, {batch_description(config, self.dp)}, lr {self.lr:g}")

    def dense_model(self):
        """The one-process MoE GPT with the trained weights on world rank 0, None elsewhere (collective)."""
        state = dense_state_dict(self.model, self.traffic)
        if self.comm.Get_rank() != 0:
            return None
        dense = self.work.model()
        dense.load_state_dict(state)
        for mine, theirs in zip(moe_layers(self.model), moe_layers(dense)):
            theirs.expert_bias = mine.expert_bias.copy()  # DeepSeek-V3's bias: not a parameter, the same everywhere
        return dense

    def report(self, epoch, loss, seconds):
        dense = self.dense_model()
        if dense is None:
            return None
        return self.work.report(dense, epoch, loss, seconds, self.log, world_size=self.dp)

    def finish(self, checkpointer):
        dense = self.dense_model()
        if dense is not None:  # world rank 0 writes --save-model: the dense MoE GPT, as one process would
            checkpointer.model = dense
        checkpointer.save_model()
        return dense

    def figures(self, step) -> dict | None:
        sent = step.per_step(self.comm)
        if self.comm.Get_rank() != 0:
            return None
        config, layer = self.config, moe_layers(self.model)[0]
        return {"ranks": self.mesh.size(), "dp": self.mesh.size("dp"), "ep": self.mesh.size("ep"),
                "n_expert": config.n_expert, "top_k": config.top_k, "capacity_factor": config.capacity_factor,
                "global_batch": global_batch(config, self.dp), "lr": f"{self.lr:g}",
                "ep_bytes_per_step": ",".join(map(str, sent)),
                "tokens_per_expert": ",".join(map(str, layer.tokens_per_expert)), "dropped": layer.dropped}

    def free(self) -> None:
        self.mesh.free()

