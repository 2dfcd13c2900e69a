"""The KV cache: the keys and values of the positions a GPT has already read, kept for the next ones.

A decoder-only transformer generates one token at a time. Position t's query attends to the keys
and values of positions 0..t, and those of 0..t-1 do not change when t arrives (the attention is
causal, and every layer's input at an earlier position depends only on earlier tokens). So a
model that keeps them computes, for each new token, only that token's row through the network:
**prefill** runs the prompt's T0 positions at once and fills the cache; **decode** runs one
position per step and appends its keys and values. Without the cache (``GPT.generate(...,
use_cache=False)``, nanoGPT's ``generate``), step t recomputes all t positions: O(t) times the
work of one, O(T²) over a sequence.

What it costs: 2 (keys and values) x n_layer x B x T x C numbers (:func:`kv_cache_bytes`): for
GPT-3 175B (96 layers, C = 12,288) in 16-bit, 4.5 MiB per token, 9 GiB for one 2,048-token sequence.
Decode reads all of it, and all the weights, for one token per sequence: few FLOPs per byte, so
memory-bound (Pope et al., "Efficiently Scaling Transformer Inference", MLSys 2023, section 2).

The interface a model uses (a *cache protocol*: this module's :class:`KVCache`, and the paged cache
of :mod:`minidist.serving.kv_cache`, which keeps each sequence in fixed-size blocks, implement it):

- ``reserve(t)`` before the blocks run: the positions of the t new tokens, an int array (t,) or
  (B, t); raises ValueError when they do not fit;
- ``attend(layer, q, k, v)`` in each layer: store k, v (B, H, t, d) at those positions, return the
  attention (B, H, t, d) of the queries q to every position held, causally (raw arrays);
- ``advance()`` after the last block: the t positions are now held.

The attention is :func:`minidist.attention.tiled_attention` on the cached positions (``attention_block``
over a tile of keys, ``merge_attention`` to combine tiles): one tile by default, or tiles of
``tile`` positions, FlashAttention's loop over key blocks (Dao 2023; the paged cache's tiles are its
blocks, as in vLLM's PagedAttention kernel, Kwon et al., SOSP 2023).
"""
from __future__ import annotations

import math

import numpy as np

from minidist import backend
from minidist.attention import tiled_attention


def kv_cache_bytes(n_layer: int, n_embd: int, batch: int, length: int, itemsize: int = 4) -> int:
    """Bytes of a KV cache holding ``length`` positions of ``batch`` sequences for a model of
    ``n_layer`` blocks of width ``n_embd``: 2 (keys and values) · n_layer · batch · length ·
    n_embd · itemsize (4 for float32, 2 for float16, 8 for float64). Independent of the number of
    heads (H heads of C / H channels)."""
    return 2 * n_layer * batch * length * n_embd * itemsize


def attend_in_tiles(q, keys, values, q_positions, k_positions, tile=None):
    """Causal attention of queries to cached keys, tile by tile: softmax(q kᵀ / sqrt(d)) v over
    the keys whose position is <= the query's, ``tile`` positions at a time (one tile when
    ``tile`` is None) by :func:`minidist.attention.tiled_attention` (``attention_block`` per
    tile, combined with ``merge_attention``; tiles wholly after a query tile skipped).

    q (B, H, t, d); keys (B, H, S, d), values (B, H, S, e) raw arrays of one float dtype;
    q_positions (t,) and k_positions (S,) integer arrays. Returns (B, H, t, e). Every query must
    see at least one key (its own position). Equal to the fused causal attention to about 1e-15
    relative in float64 (the same sums in another order)."""
    xp = backend.get_array_module(q)
    size = keys.shape[-2] if tile is None else max(tile, 1)
    out, _ = tiled_attention(q, keys, values, 1.0 / math.sqrt(q.shape[-1]), is_causal=True, block_size=size,
                             q_positions=xp.asarray(q_positions), k_positions=xp.asarray(k_positions))
    return out


class KVCache:
    """A KV cache for a batch of sequences that all hold the same number of positions, one
    contiguous buffer per layer (the cache protocol: module docstring). What ``GPT.generate``
    uses; the serving scheduler uses the paged one (:mod:`minidist.serving.kv_cache`).

    Args:
        max_len: the most positions it holds (int >= 1); the model's ``block_size`` at most
            (positions beyond it have no position embedding), which ``GPT.forward_cached`` checks.
        tile: None (attend to all cached keys at once) or an int >= 1 (in tiles of that many keys).

    Each layer's buffers, keys and values (B, H, max_len, d) in the queries' dtype and device,
    are made at the layer's first ``attend`` (the shapes come from the model: a tensor-parallel
    rank's cache holds its own heads only). ``length`` is the number of positions held;
    ``nbytes`` the bytes allocated (the reserved maximum: :func:`kv_cache_bytes` of max_len).
    """

    def __init__(self, max_len: int, *, tile: int | None = None):
        for name, value in (("max_len", max_len), ("tile", tile)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
                raise ValueError(f"KVCache: {name} must be an int >= 1, got {value!r}")
        self.max_len, self.tile = int(max_len), tile
        self.length = 0
        self.keys, self.values = {}, {}  # layer index -> (B, H, max_len, d)
        self.pending = 0  # positions reserved by the running forward, not yet advanced

    def reserve(self, t: int):
        """The positions (t,) of the next t tokens, length..length + t - 1. Raises ValueError when
        they would pass ``max_len`` (naming the fix)."""
        if self.length + t > self.max_len:
            raise ValueError(f"KVCache: {t} more position(s) do not fit: the cache holds {self.length} of at most "
                             f"{self.max_len} (the model's block_size at most); start a new cache, or recompute "
                             "the last block_size tokens without it (generate does past block_size)")
        self.pending = t
        return np.arange(self.length, self.length + t)

    def attend(self, layer: int, q, k, v):
        """Store k, v (B, H, t, d) at the reserved positions of ``layer`` and return the causal
        attention (B, H, t, d) of q to every position held. Raises ValueError when the batch or
        head shape differs from the layer's buffers."""
        start, stop = self.length, self.length + self.pending
        if layer not in self.keys:
            xp = backend.get_array_module(k)
            b, h, _, d = k.shape
            self.keys[layer] = xp.zeros((b, h, self.max_len, d), dtype=k.dtype)
            self.values[layer] = xp.zeros((b, h, self.max_len, v.shape[-1]), dtype=v.dtype)
        keys, values = self.keys[layer], self.values[layer]
        if k.shape[:2] != keys.shape[:2] or k.shape[-1] != keys.shape[-1]:
            raise ValueError(f"KVCache: layer {layer} holds (B, H, d) = {keys.shape[:2] + keys.shape[-1:]}, got "
                             f"keys of {k.shape}; use one cache per batch of sequences")
        keys[:, :, start:stop] = k
        values[:, :, start:stop] = v
        return attend_in_tiles(q, keys[:, :, :stop], values[:, :, :stop], np.arange(start, stop), np.arange(stop),
                               self.tile)

    def advance(self) -> None:
        """The reserved positions are held now (called once after the last layer)."""
        self.length += self.pending
        self.pending = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers allocated so far (keys and values of every layer)."""
        return int(sum(a.nbytes for a in (*self.keys.values(), *self.values.values())))
