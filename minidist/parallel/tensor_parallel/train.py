"""The tensor-parallel driver: ``train --model gpt --strategy tp [--sequence-parallel]``.

Every rank of the job is one tensor-parallel rank: each holds its shards of every layer of
the GPT (:func:`~minidist.parallel.tensor_parallel.parallelize_gpt`), reads the *same* batch
(tensor parallelism splits the model, not the data) and computes the same loss, so the run
follows the single-process run of the same flags step for step, to rounding. What it adds to
the GPT's training (``minidist.workloads.LanguageModelWorkload``): the gradient's norm is
clipped over the whole model (the shards' squares summed once across the ranks:
``TensorParallelGPT.clip_grad_norm_``); evaluation is collective, so every rank evaluates; the
sample at the end and ``--save-model`` use a dense GPT loaded from ``full_state_dict``; a
checkpoint gathers every rank's shards and optimizer state to rank 0, which writes one file
(:class:`~minidist.fault.Checkpointer` with ``gathered=True``). Each evaluation line adds what
every rank sent in the interval's steps and the share of the step time spent inside the
collectives.

With ``--global-batch-size G`` every rank reads the same G windows a step (G is the batch, as
one process's; the lr is ``--lr``), and a checkpoint resumes on another number of ranks T'
(``fault.is_elastic``), with sequence parallelism on or off: :func:`reshard_tensor_parallel`
joins each parameter's T saved shards, and AdamW's two moments of it, into the dense tensor
(``join_shards``: the shards in rank order are concatenated along their cut axis, so their
sizes, uneven ones included, say where each lies) and cuts it again for T' as the layers cut
a dense model (:func:`shard_of`). No offsets need saving beside the pieces (unlike ZeRO's and
FSDP's flat vectors, ``minidist.resharding``): the cut of a tensor is a function of its name,
its shape and (rank, T) alone, and the ranks' parts come in rank order. The schedule, the
generators, the windows' position (``workloads.GlobalWindowsState``: G windows a step on any T)
and the optimizer's step counts are the same on every rank and carry over as they are.
"""
from __future__ import annotations

import functools

from minidist.collectives import gather_objects
from minidist.fault import Checkpointer
from minidist.models.gpt import GPT
from minidist.parallel.tensor_parallel.gpt import (
    even_split_sizes,
    parallelize_gpt,
    uneven_split,
)
from minidist.parallel.tensor_parallel.plan import shard_of  # noqa: F401  (tests and lesson 18 name it here)
from minidist.parallel.tensor_parallel.reshard import reshard_tensor_parallel
from minidist.tracing import CountingComm
from minidist.train import (
    ParallelRun,
    TrainConfig,
    TrainResult,
    per_rank_config,
    sharded_step,
    train_parallel,
    workload_for,
)


def check_tensor_parallel(world_size: int, config: TrainConfig) -> None:
    """Raise ValueError, naming the fix, when ``config`` cannot train with ``--strategy tp`` on
    ``world_size`` ranks: not the GPT, n_head or 4 · n_embd not divisible by the number of
    ranks (each rank holds the same number of heads and MLP features), dropout (each rank would
    draw its own masks), or, with sequence parallelism, a context (``--block-size``) the number
    of ranks does not divide (every rank holds an equal block of the positions)."""
    if getattr(config, "model", "mlp") != "gpt":
        raise ValueError("--strategy tp splits the layers of the GPT (attention by heads, the MLP by features); use "
                         "--model gpt")
    problem = uneven_split(config.n_head, config.n_embd, world_size)
    if problem is not None:
        flag, n = ("--n-head", "4 x --n-embd")[problem[0]], problem[1]
        raise ValueError(f"--strategy tp on {world_size} ranks: {flag} = {n} is not divisible by {world_size} "
                         f"(each rank holds the same number of heads and MLP features); run on one of "
                         f"{even_split_sizes(config.n_head, config.n_embd)} ranks, or change --n-head")
    if config.dropout:
        raise ValueError(f"--strategy tp needs --dropout 0 (got {config.dropout:g}): each rank would draw its own "
                         "dropout masks, and the split model would no longer compute the one-process model")
    if config.sequence_parallel and config.block_size % world_size:
        raise ValueError(f"--sequence-parallel cuts each window's {config.block_size} positions into {world_size} "
                         f"equal blocks; use a --block-size that {world_size} divides, or leave out "
                         "--sequence-parallel")


def train_tensor_parallel(comm, config: TrainConfig, dataset, *, checkpointer_class=Checkpointer
                          ) -> TrainResult | None:
    """Tensor-parallel training of ``config``'s GPT over ``comm`` (every rank one
    tensor-parallel rank), with sequence parallelism when ``config.sequence_parallel``
    (module docstring): :func:`~minidist.train.train_parallel` with :class:`TensorParallelRun`.
    Every rank builds the dense GPT from ``config.seed`` and keeps its
    shards; every rank reads the whole batch of ``config.batch_size`` windows, or of
    ``config.global_batch_size`` when given (the global batch: one process's), with AdamW at
    ``config.lr`` and the workload's schedule. Every wait gives up after ``config.timeout``
    seconds. With ``config.global_batch_size`` a checkpoint written on another number of ranks
    (or with sequence parallelism the other way) is resumed, its shards cut again
    (:func:`reshard_tensor_parallel`).

    Returns a TrainResult on rank 0 (figures: ranks, sequence_parallel, lr, bytes_per_step
    (sent by each rank, in rank order, averaged over the run's steps), bytes_communicated (by
    rank 0), comm_seconds and comm_share (rank 0's time inside the collectives, and its share
    of the training time); ``model``: a dense GPT with the trained weights) and None on the
    other ranks. Raises ValueError (naming the fix) for a layout :func:`check_tensor_parallel`
    refuses, NonFiniteLossError on every rank when the loss diverges,
    checkpoint_io.CheckpointError for a checkpoint that cannot be resumed (other flags; another
    number of ranks without ``config.global_batch_size``), fault.TrainingStopped after
    ``config.stop_after_steps``.
    Source: Shoeybi et al. 2019; Korthikanti et al., MLSys 2023.
    """
    check_tensor_parallel(comm.Get_size(), config)
    return train_parallel(TensorParallelRun, comm, config, dataset, checkpointer_class=checkpointer_class)


class TensorParallelRun(ParallelRun):
    """tp's parallelize step and hooks (:func:`train_tensor_parallel`): the GPT split over every
    rank (``parallelize_gpt``, over a ``tracing.CountingComm`` that counts and times its
    operators), one replica: every rank reads the same windows. Evaluation is collective, so
    every rank reports; each report adds the interval's bytes per step and comm share."""

    reports_everywhere = True

    def __init__(self, comm, config: TrainConfig, dataset):
        config = per_rank_config(config, 1)  # with G, every rank reads the G windows one process reads
        work = workload_for(config, dataset)
        self.traffic = CountingComm(comm, allow_collectives=True, keep_messages=False)  # counts and times
        model = parallelize_gpt(work.model(), self.traffic, sequence_parallel=config.sequence_parallel)
        super().__init__(comm, config, work, model, work.optimizer(model.parameters(), config.lr), config.lr)
        # the counter's totals at the last report; the run's steps, seconds in collectives and training
        # seconds; each rank's bytes sent in training steps (rank 0 learns them at each report)
        self.meter = {"bytes": 0, "seconds": 0.0, "steps": 0, "comm": 0.0, "total_seconds": 0.0,
                      "sent": [0.0] * comm.Get_size()}

    def step(self):
        model, work = self.model, self.work
        clip = (lambda: model.clip_grad_norm_(work.grad_clip)) if work.grad_clip else None
        return sharded_step(lambda x, y: model(x, y)[1], self.optimizer, self.schedule, clip)  # vocab-parallel loss

    def describe(self) -> str:
        """Each rank's heads, MLP features, rank 0's vocabulary rows, the positions under
        sequence parallelism, the batch and the lr."""
        config, size = self.config, self.comm.Get_size()
        heads, features = config.n_head // size, 4 * config.n_embd // size
        positions = f", sequence parallel ({config.block_size // size} positions each)" \
            if config.sequence_parallel else ""
        return (f"tp: {size} ranks, {heads} head{'s' * (heads != 1)} and {features} MLP features each, vocabulary "
                f"rows {self.model.lm_head.start}:{self.model.lm_head.stop} on rank 0{positions}, batch "
                f"{config.batch_size}, lr {config.lr:g}")

    def report(self, epoch, loss, seconds):
        config, meter, traffic = self.config, self.meter, self.traffic
        ran = max(1, min(epoch * config.eval_every, config.steps) - self.work.last_step)
        sent, spent = traffic.nbytes - meter["bytes"], traffic.seconds - meter["seconds"]
        everyone = gather_objects(self.comm, sent / ran)
        meter["steps"] += ran
        meter["comm"] += spent
        meter["total_seconds"] += seconds
        extra = "" if everyone is None else (f"  sent/step={','.join(f'{b / 1e6:.2f}' for b in everyone)}MB  "
                                             f"comm={spent / max(seconds, 1e-9):.0%}")
        row = self.work.report(self.model, epoch, loss, seconds, self.log, extra=extra)  # collective evaluation
        meter["bytes"], meter["seconds"] = traffic.nbytes, traffic.seconds  # the evaluation's messages left out
        if everyone is not None:
            meter["sent"] = [total + b * ran for total, b in zip(meter["sent"], everyone)]
        return row

    def checkpoint_options(self) -> dict:
        names = [name for name, _ in self.model.named_parameters()]  # the optimizer's order
        return {"gathered": True,  # (parts, ranks) -> this layout's parts
                "reshard": functools.partial(reshard_tensor_parallel, names=names, n_head=self.config.n_head)}

    def finish(self, checkpointer):
        checkpointer.close()
        model = self.model
        dense = GPT(model.config, dtype=str(model.transformer.wte.weight.dtype), device=self.config.device)
        dense.load_state_dict(model.full_state_dict())  # every rank takes part; rank 0 samples and saves
        if self.comm.Get_rank() == 0 and self.config.save_model:
            Checkpointer(self.config, dense, None, metadata=self.work.metadata()).save_model()
        return dense

    def figures(self, step) -> dict | None:
        meter, steps = self.meter, max(self.meter["steps"], 1)
        return {
            "ranks": self.comm.Get_size(),
            "sequence_parallel": "on" if self.config.sequence_parallel else "off",
            "lr": f"{self.config.lr:g}",
            "bytes_per_step": ",".join(str(round(total / steps)) for total in meter["sent"]),
            "bytes_communicated": round(meter["sent"][0]),
            "comm_seconds": f"{meter['comm']:.3f}",
            "comm_share": f"{meter['comm'] / max(meter['total_seconds'], 1e-9):.3f}",
        }
