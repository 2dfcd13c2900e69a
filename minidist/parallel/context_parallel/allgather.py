"""All-gathered keys and values (Llama 3's context parallelism): gather K and V, attend, reduce-scatter back.

Llama 3 (Dubey et al., "The Llama 3 Herd of Models", 2024, section 3.3.2) trained its long
context this way rather than with a ring: each rank all-gathers the keys and values of the
whole sequence, attends with its own queries against all of them under the true causal mask,
and in backward reduce-scatters the keys' and values' gradients so each rank gets the sum of
every rank's part for its own positions. The paper's reasons: it is simple, works with any
mask (document masks too), and with grouped-query attention K and V are much smaller than Q,
so gathering them costs little; the all-gather is not overlapped with the compute (it is
exposed) but small next to attention at long context. Llama 3 pairs it with the 2 x CP-chunk
(zig-zag) layout for balance; here "allgather" uses the contiguous layout the contract gives it,
and the causal mask is built from positions, so this rank skips the keys after its last query.

Cost per rank per call, with b = B · (T / P) · h values of one rank's K or V (h = H · d): the
ring all-gather of K and V side by side (``minidist.collectives.all_gather``) sends
2 (P - 1) b values forward, the reduce-scatter of dK and dV 2 (P - 1) b backward: the ring's
bytes forward, fewer backward (no K/V second pass), in 2 (P - 1) latencies per direction.
Memory: the whole sequence's K and V on every rank, T · h values each, kept for backward.

Uneven parts (T not a multiple of P) are padded to the longest before the collectives (their
sizes must agree) and the padding dropped after; it is sent, so the bytes are those of P equal
parts of the longest length.
"""
from __future__ import annotations

from minidist.attention import tiled_attention, tiled_attention_backward
from minidist.backend import get_array_module
from minidist.collectives import all_gather, reduce_scatter
from minidist.parallel.context_parallel.blocks import count
from minidist.tensor import Function


def visible_ranks(chunks, rank, is_causal) -> list[int]:
    """The ranks whose keys this rank's queries may see: all of them, or under a causal mask
    those holding a position at or before this rank's last query."""
    last = max(stop for _, stop in chunks[rank]) - 1
    return [r for r, mine in enumerate(chunks) if not is_causal or min(start for start, _ in mine) <= last]


def positions_of(chunks, xp):
    """The positions of ``chunks`` ((start, stop) ranges), in the order held."""
    return xp.concatenate([xp.arange(start, stop) for start, stop in chunks])


def gather_kv(comm, k, v, lengths):
    """Every rank's K and V side by side on the last axis, padded to the longest part and
    all-gathered: (P, B, H, longest, d + e). Collective."""
    xp = get_array_module(k)
    block = xp.zeros(k.shape[:-2] + (max(lengths), k.shape[-1] + v.shape[-1]), k.dtype)
    block[..., :k.shape[-2], :k.shape[-1]] = k
    block[..., :k.shape[-2], k.shape[-1]:] = v
    return all_gather(comm, block)


def keys_and_positions(gathered, chunks, lengths, seen, rank, xp):
    """The keys and values of the ranks ``seen`` joined along the positions, with the
    positions of this rank's queries and of those keys (the causal mask is built from them
    tile by tile, never whole)."""
    kv = xp.concatenate([gathered[r][..., :lengths[r], :] for r in seen], axis=-2)
    keys = xp.concatenate([positions_of(chunks[r], xp) for r in seen])
    return kv, positions_of(chunks[rank], xp), keys


class AllGatherAttention(Function):
    """Attention with all-gathered keys and values (module docstring) as one differentiable op:
    q (B, H, t, d), k (B, H, t, d), v (B, H, t, e) this rank's positions -> this rank's output
    (B, H, t, e). Options as :class:`.ring.RingAttention`'s (``counter`` counts one pair per
    call, of t x the keys seen). Saves q, the gathered K and V it used, the output and its
    log-sum-exp. Collective forward and backward."""

    @staticmethod
    def forward(ctx, q, k, v, *, comm, chunks, scale, is_causal, counter=None):
        xp, rank = get_array_module(q), comm.Get_rank()
        lengths = [sum(stop - start for start, stop in mine) for mine in chunks]
        gathered = gather_kv(comm, k, v, lengths)
        seen = visible_ranks(chunks, rank, is_causal)
        kv, q_positions, k_positions = keys_and_positions(gathered, chunks, lengths, seen, rank, xp)
        d = k.shape[-1]
        o, lse = tiled_attention(q, kv[..., :d], kv[..., d:], scale, is_causal, q_positions=q_positions,
                                 k_positions=k_positions)  # by tiles: no (t, T) scores or mask held
        count(counter, "forward", q.shape[-2], kv.shape[-2])
        ctx.save_for_backward(q, kv, o, lse, q_positions, k_positions)
        ctx.comm, ctx.lengths, ctx.seen, ctx.d, ctx.scale, ctx.counter = comm, lengths, seen, d, scale, counter
        ctx.is_causal = is_causal
        return o

    @staticmethod
    def backward(ctx, grad):
        q, kv, o, lse, q_positions, k_positions = ctx.saved
        xp, d, lengths, p = get_array_module(grad), ctx.d, ctx.lengths, ctx.comm.Get_size()
        dq, dk, dv = tiled_attention_backward(q, kv[..., :d], kv[..., d:], o, lse, grad, ctx.scale, ctx.is_causal,
                                              q_positions=q_positions, k_positions=k_positions)
        count(ctx.counter, "backward", q.shape[-2], kv.shape[-2])
        longest = max(lengths)
        parts = xp.zeros((p,) + q.shape[:-2] + (longest, kv.shape[-1]), q.dtype)  # rank r's keys' gradient in row r
        offset = 0
        for r in ctx.seen:
            parts[r, ..., :lengths[r], :d] = dk[..., offset:offset + lengths[r], :]
            parts[r, ..., :lengths[r], d:] = dv[..., offset:offset + lengths[r], :]
            offset += lengths[r]
        mine = reduce_scatter(ctx.comm, parts).reshape(parts.shape[1:])[..., :lengths[ctx.comm.Get_rank()], :]
        return dq, mine[..., :d], mine[..., d:]
