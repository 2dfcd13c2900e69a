"""Tensor parallelism's checkpoints on another layout: the ranks' shards joined into the dense
tensors and cut again for another number of ranks (an elastic resume), or joined once into the
dense model (``checkpoint consolidate``), as :mod:`.plan` cuts them.

No offsets need saving beside the pieces (unlike ZeRO's and FSDP's flat vectors,
``minidist.resharding``): the cut of a tensor is a function of its name, its shape and (rank, T)
alone, and the ranks' parts come in rank order. The schedule, the generators, the windows'
position and the optimizer's step counts are the same on every rank and carry over as they are.
"""
from __future__ import annotations

import copy

import numpy as np

from minidist.parallel.tensor_parallel.plan import join_shards, shard_of
from minidist.resharding import MOMENT_KEYS, ReshardError


def reshard_tensor_parallel(parts: list, world_size: int, names: list, n_head: int) -> list:
    """The training state of each of ``world_size`` tensor-parallel ranks from the ``parts`` T
    ranks saved (a gathered checkpoint's ``"ranks"``, in rank order; module docstring): every
    entry of the model's state dict and of AdamW's ``exp_avg`` and ``exp_avg_sq`` (one per
    parameter, ``names`` naming them in the optimizer's order: ``[n for n, _ in
    model.named_parameters()]``) joined from the T shards (:func:`join_shards`) and cut for each
    new rank (:func:`shard_of`); every other leaf (step, schedule, generators, position,
    windows, the optimizer's step counts) rank 0's. Rank 0 of the new run calls it
    (``Checkpointer(reshard=...)``); costs one dense copy of the weights and two of the moments.
    Raises ReshardError naming the entry when the parts lack it, hold another number of
    moments than ``names``, or disagree on a parameter every rank holds whole (parts that are
    not one run's)."""
    try:
        model = {name: join_shards(name, [part["model"][name] for part in parts]) for name in parts[0]["model"]}
        moments = {}
        for key in (k for k in MOMENT_KEYS if k in parts[0]["optimizer"]):
            if any(len(part["optimizer"][key]) != len(names) for part in parts):
                raise ReshardError(f"optimizer/{key} holds another number of moments than the {len(names)} "
                                   "parameters of this model")
            moments[key] = [None if parts[0]["optimizer"][key][i] is None else
                            join_shards(name, [part["optimizer"][key][i] for part in parts])
                            for i, name in enumerate(names)]
    except KeyError as error:
        raise ReshardError(f"a rank's part of the checkpoint lacks {error}") from None
    except RuntimeError as error:  # a whole parameter that differs between the ranks' parts
        raise ReshardError(str(error)) from None
    out = []
    for rank in range(world_size):
        part = copy.copy(parts[0])
        part["model"] = {name: shard_of(name, whole, rank, world_size, n_head) for name, whole in model.items()}
        part["optimizer"] = dict(parts[0]["optimizer"])
        for key, whole in moments.items():
            part["optimizer"][key] = [None if m is None else shard_of(name, m, rank, world_size, n_head)
                                      for name, m in zip(names, whole)]
        out.append(part)
    return out


def consolidate_tensor_parallel(state: dict) -> dict:
    """The dense state_dict of a tp checkpoint ``state`` (``checkpoint consolidate``): each
    parameter's shards, one per rank of ``state["ranks"]`` (rank order), joined as the split
    model cut them (``join_shards``; a parameter every rank holds whole is rank 0's, a
    RuntimeError when the copies differ)."""
    parts = state["ranks"]
    return {name: join_shards(name, [np.asarray(part["model"][name]) for part in parts])
            for name in parts[0]["model"]}
