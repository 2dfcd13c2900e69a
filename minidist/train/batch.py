"""The batch of a run on M ranks: the lr's scaling, the global batch G (checked, cut into
parts off by one when M does not divide it, their loss weights), and the workload of a config."""
from __future__ import annotations

import dataclasses

from minidist import data, optim, workloads
from minidist.data import global_batch
from minidist.train.classifier import ClassifierWorkload
from minidist.train.config import MODELS, TrainConfig


def data_parallel_lr(work, config: TrainConfig, replicas: int) -> float:
    """The learning rate of ``replicas`` data-parallel copies that each read ``config.batch_size``
    samples (the global batch ``replicas`` times larger): ``config.lr`` multiplied by
    ``replicas`` (Goyal et al. 2017's linear scaling rule, ``optim.scale_lr``) when
    ``config.scale_lr`` says so, or, when it is None, when the workload scales by default (the
    MLP's SGD does, the GPT's AdamW does not: ``work.scale_lr_by_default``); ``config.lr`` for
    one replica. The one rule of ddp, ddp --zero, fsdp, and the pipelines' --dp (2-D and 3-D).
    With ``config.global_batch_size`` the global batch does not grow with the replicas, so the
    lr is ``config.lr`` (the lr of that batch) on any number of them."""
    if config.global_batch_size is not None:
        return config.lr
    scale = replicas > 1 and (work.scale_lr_by_default if config.scale_lr is None else config.scale_lr)
    return optim.scale_lr(config.lr, config.batch_size * replicas, config.batch_size) if scale else config.lr


def check_global_batch(config: TrainConfig, world_size: int, dataset=None) -> None:
    """Raise ValueError, naming the fix, when ``config.global_batch_size`` cannot be split over
    ``world_size`` ranks (fewer samples than ranks: ``data.split_global_batch``) or, given the
    MLP's ``dataset`` (a ``data.Dataset``), exceeds its training samples; nothing without a
    global batch. A world size that does not divide G is fine: the parts differ by one row."""
    g = config.global_batch_size
    samples = len(getattr(dataset, "X_train", ()))
    if g is not None and dataset is not None and hasattr(dataset, "X_train") and g > samples:
        raise ValueError(f"--global-batch-size {g} is larger than the {samples} training samples of --dataset "
                         f"{config.dataset}; use at most {samples}")
    if g is not None and world_size > g:
        raise ValueError(f"--global-batch-size {g} cannot be split over {world_size} ranks (a rank would read no "
                         f"sample); use --global-batch-size {world_size} or more, or at most {g} ranks")


def per_rank_config(config: TrainConfig, world_size: int, rank: int = 0) -> TrainConfig:
    """``config`` as rank ``rank`` of ``world_size`` runs it: with ``config.global_batch_size``
    G, ``batch_size`` becomes this rank's part of G (``data.split_global_batch``: G / world_size,
    or one row more or less when world_size does not divide G), what the loaders read;
    ``config`` itself without G. Raises ValueError (:func:`check_global_batch`) for more ranks
    than G."""
    if config.global_batch_size is None:
        return config
    check_global_batch(config, world_size)
    offsets = data.split_global_batch(config.global_batch_size, world_size)
    return dataclasses.replace(config, batch_size=int(offsets[rank + 1] - offsets[rank]))


def batch_description(config: TrainConfig, world_size: int) -> str:
    """The run's batch as its first log line says it: "per-rank batch 8, global batch 32", or,
    when ``world_size`` does not divide ``config.global_batch_size``, "per-rank batch 6 or 5,
    global batch 16" (the parts of ``data.split_global_batch``)."""
    g = global_batch(config, world_size)
    if g % world_size:
        return f"per-rank batch {-(-g // world_size)} or {g // world_size}, global batch {g}"
    return f"per-rank batch {g // world_size}, global batch {g}"


def loss_weight(config: TrainConfig, world_size: int, rank: int) -> float:
    """The factor on rank ``rank``'s mean loss that makes the ranks' averaged gradient the mean
    over the global batch: ``rows * world_size / G`` for a part of ``rows`` rows of
    ``config.global_batch_size`` G (``data.split_global_batch``), since the average of the ranks'
    means weights each rank alike, and a rank with 6 rows of 16 must count 6/16 of it, not 1/3.
    1.0 (exactly) when the parts are equal or there is no G. The rows are
    :func:`per_rank_config`'s (the one place G is cut), so ``config`` may be the job's or the
    rank's own. The drivers pass it to :func:`supervised_step` / :func:`sharded_step`
    (``loss_weight=``)."""
    g = config.global_batch_size
    if g is None or g % world_size == 0:
        return 1.0
    return per_rank_config(config, world_size, rank).batch_size * world_size / g


def workload_for(config: TrainConfig, dataset):
    """The workload of ``config.model``: :class:`ClassifierWorkload` ("mlp") or
    ``workloads.LanguageModelWorkload`` ("gpt") over ``dataset`` (what :func:`load_dataset`
    returns for the config). Raises ValueError for another model."""
    if config.model == "gpt":
        return workloads.LanguageModelWorkload(config, dataset)
    if config.model == "mlp":
        return ClassifierWorkload(config, dataset)
    raise ValueError(f"model must be one of {', '.join(MODELS)}, got {config.model!r}")
