"""The tensor-parallel plan of the GPT, written once: which parameter is cut across the ranks of a
tp group, along which axis, in what unit. Everything that cuts or joins a tp shard reads it: the
checks of a split (:func:`is_sharded`: the clipping norm counts a cut parameter's squares over
the group), the joins (:func:`join_shards`: ``full_state_dict``, consolidating a checkpoint,
evaluating 3-D's pipeline 0) and the cuts (:func:`shard_of`: an elastic resume on another T, a
pipeline's stages cut again). The layers themselves (``gpt.TensorParallelGPT``) cut the same way:
tests check ``shard_of`` against them, parameter by parameter.

As torchtitan writes its TP plan as a dict from module names to styles (``apply_tp`` in
``torchtitan/models/llama3/infra/parallelize.py`` hands ``parallelize_module`` one:
``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel`` by module), this file maps a
parameter's name to how it is cut (Shoeybi et al. 2019, section 3):

- ``"qkv_heads"``: attention's ``c_attn`` (column-parallel): the q, k and v rows of the rank's
  heads, each of the three blocks cut apart (``chunk_bounds(n_head, T)``);
- ``"head_columns"``: attention's ``c_proj.weight`` (row-parallel): the columns of those heads;
- ``"rows"``: the MLP's ``c_fc`` (column-parallel), the tied token embedding and head (by
  vocabulary rows), as ``numpy.array_split`` cuts rows, uneven when T does not divide them;
- ``"columns"``: the MLP's ``c_proj.weight`` (row-parallel), by input features.

Every other parameter (the LayerNorms, the position embedding, the row-parallel biases) is whole
on every rank.
"""
from __future__ import annotations

import numpy as np

from minidist.collectives import chunk_bounds

# (a part of the parameter's name, how it is cut); the first that matches wins.
TP_PLAN = (
    (".attn.c_attn.", "qkv_heads"),
    (".attn.c_proj.weight", "head_columns"),
    (".mlp.c_fc.", "rows"),
    (".mlp.c_proj.weight", "columns"),
    ("transformer.wte.weight", "rows"),
    ("lm_head.weight", "rows"),
)


def placement(name: str) -> str | None:
    """How the parameter ``name`` (the dense GPT's name) is cut (:data:`TP_PLAN`), or None when it
    is whole on every rank."""
    return next((style for part, style in TP_PLAN if part in name), None)


def is_sharded(name: str) -> bool:
    """Whether the parameter ``name`` of a tensor-parallel GPT is cut across the ranks
    (attention's c_attn, the MLP's c_fc, both c_proj weights, the tied embedding and head) or
    whole on every rank (LayerNorms, the position embedding, the c_proj biases)."""
    return placement(name) is not None


def join_shards(name: str, shards: list):
    """One dense parameter from the ranks' pieces (NumPy arrays), in rank order, as
    :data:`TP_PLAN` cut it: c_attn keeps q, k and v apart (each rank holds its heads' rows of
    each), rows are stacked, columns put side by side; a parameter whole on every rank is rank
    0's copy (RuntimeError, naming it, when another rank's copy differs: the ranks drifted apart)."""
    style = placement(name)
    if style is None:
        for rank, shard in enumerate(shards[1:], 1):
            if not np.array_equal(shard, shards[0]):
                raise RuntimeError(f"full_state_dict: {name} is whole on every rank, but rank {rank}'s copy differs "
                                   f"from rank 0's by up to {float(np.abs(shard - shards[0]).max()):.3g}: the ranks "
                                   "did not compute the same update (were they given different batches?)")
        return shards[0]
    if style == "qkv_heads":
        parts = [s.reshape(3, -1, *s.shape[1:]) for s in shards]
        joined = np.concatenate(parts, axis=1)
        return joined.reshape(-1, *joined.shape[2:])
    if style in ("head_columns", "columns"):
        return np.concatenate(shards, axis=1)
    return np.concatenate(shards)  # rows


def shard_of(name: str, whole, rank: int, size: int, n_head: int):
    """Rank ``rank``'s shard, of ``size`` tensor-parallel ranks, of the dense parameter (or an
    optimizer moment of it: the same shape) ``name`` of a GPT with ``n_head`` heads: what the
    split model gives that rank (:data:`TP_PLAN`), the inverse of :func:`join_shards`
    (``whole`` a NumPy array; returns a new one; a parameter whole on every rank is returned as
    it is). Heads by ``chunk_bounds(n_head, size)``, rows and columns as ``numpy.array_split``
    cuts them (:func:`minidist.collectives.chunk_bounds`). Source: Shoeybi et al. 2019, section 3."""
    style = placement(name)
    if style is None:
        return whole
    if style in ("qkv_heads", "head_columns"):
        first, last = chunk_bounds(n_head, size)[rank]
        if style == "qkv_heads":
            per_head = whole.reshape(3, n_head, -1, *whole.shape[1:])
            return per_head[:, first:last].reshape(-1, *whole.shape[1:]).copy()
        d = whole.shape[1] // n_head
        return whole[:, first * d : last * d].copy()
    if style == "columns":
        start, stop = chunk_bounds(whole.shape[1], size)[rank]
        return whole[:, start:stop].copy()
    start, stop = chunk_bounds(whole.shape[0], size)[rank]
    return whole[start:stop].copy()
