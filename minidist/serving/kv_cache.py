"""Paged KV cache: keys and values in fixed-size blocks, a block table per sequence, a free list.

A contiguous cache (:class:`minidist.models.kv_cache.KVCache`) reserves, for every sequence, room
for the longest it may become: a serving system that does not know when a request will stop
reserves block_size positions for each and uses a fraction of them (Kwon et al., "Efficient Memory
Management for Large Language Model Serving with PagedAttention", SOSP 2023, section 3, measured
20-38 % of such memory holding tokens in the systems they studied). PagedAttention borrows the
operating system's answer, virtual memory with pages:

- the memory is one pool of ``num_blocks`` **blocks** of ``block_size`` positions each (per layer,
  keys and values: (num_blocks, H, block_size, d));
- each sequence has a **block table**, the list of its blocks in order: position p lives in block
  ``table[p // block_size]`` at offset ``p % block_size``; the blocks need not be adjacent;
- a **free list** holds the blocks nobody uses; a sequence takes one when it starts a new block
  and gives all of them back when it ends, so at most block_size - 1 positions per sequence are
  reserved and unused.

Attention reads a sequence's keys block by block through its table (vLLM's paged attention
kernel): here one ``attention_block`` per block, combined with ``merge_attention``
(:mod:`minidist.attention`); a batch of sequences of different lengths runs as one batch,
each row masked to its own positions. vLLM keeps the free list as a queue of block ids
(``vllm/v1/core/block_pool.py``, ``FreeKVCacheBlockQueue``: freed blocks to the back, taken
from the front); so does :class:`PagedKVCache`.
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np

from minidist import backend
from minidist.attention import attention_block, merge_attention


class PagedKVCache:
    """The block pool, the free list and a block table per sequence (module docstring).

    Args:
        num_blocks: blocks in the pool (int >= 1).
        block_size: positions per block (int >= 1; vLLM's default is 16).

    The pool's arrays, per layer keys and values (num_blocks, H, block_size, d), are made at the
    first ``attend`` (the model gives H, d, dtype and device; a tensor-parallel rank's pool holds
    its own heads). Sequences are named by any hashable id. Not thread-safe.
    """

    def __init__(self, num_blocks: int, block_size: int):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"PagedKVCache: {name} must be an int >= 1, got {value!r}")
        self.num_blocks, self.block_size = int(num_blocks), int(block_size)
        self.free_blocks = deque(range(self.num_blocks))  # taken from the left, given back on the right
        self.block_tables: dict = {}  # sequence id -> [block ids], in position order
        self.lengths: dict = {}  # sequence id -> positions held
        self.keys, self.values = {}, {}  # layer -> (num_blocks, H, block_size, d)

    @property
    def num_free_blocks(self) -> int:
        """Blocks on the free list."""
        return len(self.free_blocks)

    def blocks_for(self, positions: int) -> int:
        """Blocks that hold ``positions`` positions: ceil(positions / block_size)."""
        return math.ceil(positions / self.block_size)

    def blocks_needed(self, seq_id, t: int) -> int:
        """More blocks ``seq_id`` (new or held) needs to append t positions."""
        length = self.lengths.get(seq_id, 0)
        return self.blocks_for(length + t) - len(self.block_tables.get(seq_id, ()))

    def allocate(self, seq_id, t: int) -> None:
        """Take from the free list the blocks ``seq_id`` needs for t more positions (a new
        sequence starts with none). Raises MemoryError naming the shortfall when the free list
        is too short (a scheduler checks ``blocks_needed`` first and waits or preempts)."""
        need = self.blocks_needed(seq_id, t)
        if need > len(self.free_blocks):
            raise MemoryError(f"PagedKVCache: {need} block(s) needed, {len(self.free_blocks)} free of "
                              f"{self.num_blocks}; free a sequence first (or make a larger pool)")
        table = self.block_tables.setdefault(seq_id, [])
        self.lengths.setdefault(seq_id, 0)
        table.extend(self.free_blocks.popleft() for _ in range(max(need, 0)))

    def free(self, seq_id) -> int:
        """Give ``seq_id``'s blocks back to the free list and forget it; returns how many. An
        unknown id frees nothing (0)."""
        table = self.block_tables.pop(seq_id, [])
        self.lengths.pop(seq_id, None)
        self.free_blocks.extend(table)
        return len(table)

    def batch(self, seq_ids) -> PagedBatch:
        """A view of the sequences ``seq_ids`` (in this order, the batch's rows) that a model
        runs on: the cache protocol of :mod:`minidist.models.kv_cache`."""
        return PagedBatch(self, list(seq_ids))

    def store(self, layer: int, slots, k, v) -> None:
        """Write k, v (B, H, t, d) at ``slots`` = (blocks (B, t), offsets (B, t)) of ``layer``,
        making the layer's pool arrays at the first call."""
        if layer not in self.keys:
            xp = backend.get_array_module(k)
            h, d, e = k.shape[1], k.shape[-1], v.shape[-1]
            self.keys[layer] = xp.zeros((self.num_blocks, h, self.block_size, d), dtype=k.dtype)
            self.values[layer] = xp.zeros((self.num_blocks, h, self.block_size, e), dtype=v.dtype)
        blocks, offsets = slots
        # pool[blocks, :, offsets] is (B, t, H, d): the advanced indices first, then the heads' slice
        self.keys[layer][blocks, :, offsets] = k.transpose(0, 2, 1, 3)
        self.values[layer][blocks, :, offsets] = v.transpose(0, 2, 1, 3)

    @property
    def nbytes(self) -> int:
        """Bytes of the pool (allocated at the first attend; 0 before)."""
        return int(sum(a.nbytes for a in (*self.keys.values(), *self.values.values())))

    def bytes_per_block(self) -> int:
        """Bytes of one block over every layer, keys and values (0 before the pool exists)."""
        return self.nbytes // self.num_blocks

    def used_bytes(self) -> int:
        """Bytes of the blocks that sequences hold now."""
        return self.bytes_per_block() * (self.num_blocks - len(self.free_blocks))


class PagedBatch:
    """Some sequences of a :class:`PagedKVCache` run together as a batch of rows: the cache
    protocol (``reserve``, ``attend``, ``advance``) of :mod:`minidist.models.kv_cache`, with
    each row at its own length. Made by :meth:`PagedKVCache.batch`."""

    def __init__(self, cache: PagedKVCache, seq_ids: list):
        self.cache, self.seq_ids = cache, seq_ids
        self.starts = np.array([cache.lengths.get(s, 0) for s in seq_ids], dtype=np.int64)
        self.pending = 0

    def reserve(self, t: int):
        """The positions (B, t) of each row's next t tokens, taking the blocks they need from the
        free list. Raises MemoryError when the free list is too short (nothing taken then)."""
        cache = self.cache
        need = sum(max(cache.blocks_needed(s, t), 0) for s in self.seq_ids)
        if need > cache.num_free_blocks:
            raise MemoryError(f"PagedKVCache: this batch needs {need} more block(s), {cache.num_free_blocks} are "
                              "free; run fewer sequences at once (a scheduler waits or preempts)")
        for s in self.seq_ids:
            cache.allocate(s, t)
        self.pending = t
        return self.starts[:, None] + np.arange(t)

    def slots(self, positions):
        """(blocks, offsets), each (B, t): where each row's ``positions`` live in the pool."""
        bs = self.cache.block_size
        tables = [self.cache.block_tables[s] for s in self.seq_ids]
        blocks = np.array([[table[p // bs] for p in row] for table, row in zip(tables, positions.tolist())],
                          dtype=np.int64).reshape(positions.shape)
        return blocks, positions % bs

    def attend(self, layer: int, q, k, v):
        """Store k, v (B, H, t, d) at the reserved positions of ``layer``, then the causal
        attention (B, H, t, d) of q to each row's positions, block by block through the block
        tables (one ``attention_block`` per table column, merged)."""
        cache, bs = self.cache, self.cache.block_size
        positions = self.starts[:, None] + np.arange(self.pending)  # (B, t)
        cache.store(layer, self.slots(positions), k, v)
        xp = backend.get_array_module(q)
        tables = [cache.block_tables[s] for s in self.seq_ids]
        width = max(len(table) for table in tables)
        padded = np.array([table + [table[0]] * (width - len(table)) for table in tables])  # (B, width)
        q_positions = xp.asarray(positions)[:, None, :, None]  # (B, 1, t, 1)
        scale = 1.0 / math.sqrt(q.shape[-1])
        out, lse = None, None
        for j in range(width):  # one block of every row at a time: blocks past a row's end are masked out
            index = xp.asarray(padded[:, j])
            k_positions = xp.arange(j * bs, (j + 1) * bs)[None, None, None, :]
            o, block_lse = attention_block(q, cache.keys[layer][index], cache.values[layer][index], scale,
                                           k_positions <= q_positions)
            out, lse = (o, block_lse) if out is None else merge_attention(out, lse, o, block_lse)
        return out

    def advance(self) -> None:
        """The reserved positions are held now."""
        for s in self.seq_ids:
            self.cache.lengths[s] += self.pending
        self.starts += self.pending
        self.pending = 0
