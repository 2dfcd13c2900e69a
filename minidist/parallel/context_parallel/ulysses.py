"""DeepSpeed-Ulysses: an all-to-all turns sequence-sharded q, k, v into head-sharded ones, and back.

Jacobs et al., "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme Long
Sequence Transformer Models" (arXiv 2309.14509, 2023). Attention never mixes heads, so instead
of passing keys around, re-cut the work: each rank holds all H heads of its T / P positions
(B, H, T/P, d); one all-to-all sends head group j (H / P heads) of those positions to rank j,
which then holds its H / P heads at *every* position (B, H/P, T, d) and runs plain attention on
them, causal mask and all, with no message; a second all-to-all sends each rank's output
positions back to their owners (B, H, T/P, e). Backward is the same in reverse: the output's
gradient goes to the head owners, the attention's backward runs there, and dQ, dK, dV come
back. P must divide H (each rank takes the same number of heads); T need not divide by P (the
parts' lengths differ by one: ``collectives.all_to_all_v`` instead of ``all_to_all``).

Cost per rank per call, one all-to-all of q, k, v (side by side) and one of the output forward,
the same backward: an all-to-all keeps 1/P of what it holds and sends the rest, so each rank
sends (P - 1)/P of its 4 · B · (T/P) · h values, 4 (P - 1) B T h / P² forward (h = H · d, e = d)
and as much backward. The paper's "4Nh/P per link" counts an all-to-all of an aggregate M
values as M/P per link; DeepSpeed issue #4217 asked how that compares with Megatron-LM's
sequence parallelism (two all-gathers and two reduce-scatters of Nh per layer, each rank
sending (P - 1)/P of Nh per collective: about 4Nh per rank whatever P). Counting the traced
bytes settles it: Ulysses' per-rank volume falls as 1/P, Megatron-SP's does not.
"""
from __future__ import annotations

from minidist.attention import tiled_attention, tiled_attention_backward
from minidist.backend import get_array_module
from minidist.collectives import all_to_all, all_to_all_v
from minidist.parallel.context_parallel.blocks import count
from minidist.tensor import Function


def check_heads(n_heads: int, p: int) -> None:
    """Raise ValueError, naming the fix, when ``p`` ranks cannot take equal groups of heads."""
    if n_heads % p:
        sizes = [n for n in range(1, n_heads + 1) if n_heads % n == 0]
        raise ValueError(f"Ulysses gives each of the {p} cp ranks H / P heads, but H = {n_heads} heads do not divide "
                         f"by {p}; use a number of cp ranks among {sizes} (or another variant: ring, zigzag, "
                         "allgather)")


def sequence_to_heads(comm, x, lengths):
    """(B, H, t, c) this rank's positions, every head -> (B, H/P, T, c) every position of this
    rank's head group (the parts in rank order, which is position order). Collective."""
    xp, p = get_array_module(x), comm.Get_size()
    b, h, t, c = x.shape
    blocks = xp.ascontiguousarray(x.reshape(b, p, h // p, t, c).transpose(1, 3, 0, 2, 4))  # (P, t, B, H/P, c)
    if len(set(lengths)) == 1:
        received = list(all_to_all(comm, blocks))
    else:
        received = all_to_all_v(comm, list(blocks))
    whole = xp.concatenate(received, axis=0)  # (T, B, H/P, c)
    return xp.ascontiguousarray(whole.transpose(1, 2, 0, 3))


def heads_to_sequence(comm, x, lengths):
    """(B, H/P, T, c) this rank's heads, every position -> (B, H, t, c) this rank's positions,
    every head (head group j from rank j). Collective."""
    xp, p, rank = get_array_module(x), comm.Get_size(), comm.Get_rank()
    b, g, _, c = x.shape
    offsets = [sum(lengths[:r]) for r in range(p + 1)]
    pieces = [xp.ascontiguousarray(x[:, :, offsets[r]:offsets[r + 1], :].transpose(2, 0, 1, 3)) for r in range(p)]
    if len(set(lengths)) == 1:
        received = list(all_to_all(comm, xp.stack(pieces)))  # (P, t, B, H/P, c): head group j from rank j
    else:
        received = all_to_all_v(comm, pieces)
    whole = xp.stack(received, axis=0)  # (P, t, B, H/P, c)
    return xp.ascontiguousarray(whole.transpose(2, 0, 3, 1, 4).reshape(b, p * g, lengths[rank], c))


class UlyssesAttention(Function):
    """DeepSpeed-Ulysses attention (module docstring) as one differentiable op: q (B, H, t, d),
    k (B, H, t, d), v (B, H, t, e) this rank's contiguous positions -> this rank's output
    (B, H, t, e). Options: ``comm``, ``lengths`` (every rank's t, rank order), ``scale``,
    ``is_causal``, ``counter`` (one pair per call, of T x T scores on H / P heads). Saves the
    head-sharded q, k, v, output and log-sum-exp (attention by tiles, ``attention.tiled_attention``:
    nothing T x T is held). Collective forward and backward."""

    @staticmethod
    def forward(ctx, q, k, v, *, comm, lengths, scale, is_causal, counter=None):
        xp = get_array_module(q)
        d, t = q.shape[-1], sum(lengths)
        qkv = sequence_to_heads(comm, xp.concatenate([q, k, v], axis=-1), lengths)  # (B, H/P, T, 2d + e)
        # the whole sequence on H/P heads, by tiles: O(T) held, never the (T, T) scores or mask
        o, lse = tiled_attention(qkv[..., :d], qkv[..., d:2 * d], qkv[..., 2 * d:], scale, is_causal)
        count(counter, "forward", t, t)
        ctx.save_for_backward(qkv, o, lse)
        ctx.comm, ctx.lengths, ctx.d, ctx.scale, ctx.counter = comm, lengths, d, scale, counter
        ctx.is_causal = is_causal
        return heads_to_sequence(comm, o, lengths)

    @staticmethod
    def backward(ctx, grad):
        qkv, o, lse = ctx.saved
        xp, d, comm, lengths = get_array_module(grad), ctx.d, ctx.comm, ctx.lengths
        do = sequence_to_heads(comm, xp.ascontiguousarray(grad), lengths)
        grads = tiled_attention_backward(qkv[..., :d], qkv[..., d:2 * d], qkv[..., 2 * d:], o, lse, do, ctx.scale,
                                         ctx.is_causal)
        count(ctx.counter, "backward", sum(lengths), sum(lengths))
        back = heads_to_sequence(comm, xp.concatenate(grads, axis=-1), lengths)
        return back[..., :d], back[..., d:2 * d], back[..., 2 * d:]
