"""Attention of this rank's query chunks to one piece of keys and values, chunk pair by chunk pair.

Every variant of context parallelism ends in the same local work: this rank holds queries at
some chunks of positions (:mod:`.layout`), it is handed keys and values at other chunks (a
neighbour's, in a ring; everyone's, after an all-gather), and it must add what those keys
contribute to its queries' output. Under a causal mask each (query chunk, key chunk) pair is
one of three kinds, read off the positions alone:

- **skipped**: every key comes after every query (key start >= query stop): the pair is above
  the diagonal of the causal triangle and contributes nothing; it costs nothing either;
- **whole**: every key comes at or before every query (last key <= first query): no mask;
- **masked**: the pair straddles the diagonal: ``minidist.attention.causal_mask`` of the two
  position ranges.

Without a causal mask every pair is whole. Each pair computed is one call of
``minidist.attention.attention_block`` (forward: the pair's output and log-sum-exp, merged into
the query chunk's running result with ``merge_attention``, FlashAttention-2's online softmax
one block at a time; Dao 2023, Algorithm 1) or of ``attention_block_backward`` (backward, from
the final log-sum-exp and delta = rowsum(dO ∘ O); Algorithm 2). A pair costs about
4 · B · H · Tq · Tk · d flops forward, whatever its kind: that is why the count of computed
pairs per rank measures the load (:class:`BlockCounter`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy

from minidist.attention import attention_block, attention_block_backward, causal_mask, merge_attention
from minidist.backend import get_array_module


@dataclass
class BlockCounter:
    """What one rank computed in its context-parallel attention calls (pass one as ``counter=``
    to ``context_parallel_attention``; it adds to it). forward_pairs, backward_pairs: chunk
    pairs computed (skipped pairs not counted); forward_scores, backward_scores: query-key
    products computed, Σ Tq·Tk over those pairs (the work, in scores); pairs: every computed
    forward pair as ((query start, stop), (key start, stop)) positions, in the order computed."""

    forward_pairs: int = 0
    backward_pairs: int = 0
    forward_scores: int = 0
    backward_scores: int = 0
    pairs: list = field(default_factory=list)


def count(counter: BlockCounter | None, direction: str, queries: int, keys: int, pair=None) -> None:
    """Add one computed pair of ``queries`` x ``keys`` scores to ``counter`` (nothing when None):
    ``direction`` "forward" or "backward"; a forward ``pair`` ((query start, stop), (key start,
    stop)) is also listed in ``counter.pairs``."""
    if counter is None:
        return
    if direction == "forward":
        counter.forward_pairs += 1
        counter.forward_scores += queries * keys
        if pair is not None:
            counter.pairs.append(pair)
    else:
        counter.backward_pairs += 1
        counter.backward_scores += queries * keys


def local_chunks(chunks) -> list[tuple[int, int, int, int]]:
    """``(local start, local stop, position start, position stop)`` of each ``(start, stop)``
    chunk, laid side by side in a rank's array in the order given."""
    out, offset = [], 0
    for start, stop in chunks:
        out.append((offset, offset + stop - start, start, stop))
        offset += stop - start
    return out


def pair_mask(q_chunk, k_chunk, is_causal: bool, xp=numpy):
    """The kind of a (query chunk, key chunk) pair (module docstring): None to skip it, or
    ``(mask,)`` with mask None (whole) or the bool causal mask (Tq, Tk)."""
    _, _, q_start, q_stop = q_chunk
    _, _, k_start, k_stop = k_chunk
    if q_stop == q_start or k_stop == k_start or (is_causal and k_start >= q_stop):
        return None
    if not is_causal or k_stop - 1 <= q_start:
        return (None,)
    return (causal_mask(xp.arange(q_start, q_stop), xp.arange(k_start, k_stop)),)


def attend(q, q_chunks, k, v, k_chunks, scale, is_causal, o, lse, counter=None) -> None:
    """Add the keys and values ``k`` (..., Tk, d), ``v`` (..., Tk, e), held as ``k_chunks``, to
    the running result ``o`` (..., Tq, e), ``lse`` (..., Tq) of the queries ``q`` (..., Tq, d)
    held as ``q_chunks`` (both lists of :func:`local_chunks`), in place, pair by pair."""
    xp = get_array_module(q)
    for q_chunk in q_chunks:
        rows = slice(q_chunk[0], q_chunk[1])
        for k_chunk in k_chunks:
            kind = pair_mask(q_chunk, k_chunk, is_causal, xp)
            if kind is None:
                continue
            cols = slice(k_chunk[0], k_chunk[1])
            o_b, lse_b = attention_block(q[..., rows, :], k[..., cols, :], v[..., cols, :], scale, kind[0])
            o[..., rows, :], lse[..., rows] = merge_attention(o[..., rows, :], lse[..., rows], o_b, lse_b)
            count(counter, "forward", q_chunk[1] - q_chunk[0], k_chunk[1] - k_chunk[0], (q_chunk[2:], k_chunk[2:]))


def attend_backward(q, q_chunks, k, v, k_chunks, do, lse, delta, scale, is_causal, dq, counter=None):
    """The gradients the keys and values ``k``, ``v`` (held as ``k_chunks``) receive from this
    rank's queries, and their part of the queries' gradient, added to ``dq`` in place. do
    (..., Tq, e) the output's gradient, lse and delta (..., Tq) the final row statistics
    (``attention_block_backward``). Returns ``(dk, dv)`` shaped as k and v (zeros where no
    query of this rank sees a key)."""
    xp = get_array_module(q)
    dk, dv = xp.zeros_like(k), xp.zeros_like(v)
    for q_chunk in q_chunks:
        rows = slice(q_chunk[0], q_chunk[1])
        for k_chunk in k_chunks:
            kind = pair_mask(q_chunk, k_chunk, is_causal, xp)
            if kind is None:
                continue
            cols = slice(k_chunk[0], k_chunk[1])
            dq_b, dk_b, dv_b = attention_block_backward(q[..., rows, :], k[..., cols, :], v[..., cols, :],
                                                        do[..., rows, :], lse[..., rows], delta[..., rows], scale,
                                                        kind[0])
            dq[..., rows, :] += dq_b
            dk[..., cols, :] += dk_b
            dv[..., cols, :] += dv_b
            count(counter, "backward", q_chunk[1] - q_chunk[0], k_chunk[1] - k_chunk[0])
    return dk, dv


def empty_result(q, e: int):
    """The running result before any key: o = 0 (..., Tq, e) and lse = -inf (..., Tq)."""
    xp = get_array_module(q)
    return xp.zeros(q.shape[:-1] + (e,), q.dtype), xp.full(q.shape[:-1], -xp.inf, q.dtype)
