"""Ring attention: the keys and values travel around the ring of cp ranks, one block per step.

Ring Attention (Liu, Zaharia & Abbeel, "Ring Attention with Blockwise Transformers for
Near-Infinite Context", 2023) keeps each rank's queries where they are and passes the keys and
values instead. The P ranks form a ring r -> r + 1. In step s (s = 0 .. P-1) rank r holds the
K/V block of rank r - s: it posts the send of that block to r + 1 and the receive of the next
one (rank r - s - 1's) from r - 1 *before* it computes, so the message travels while it
attends to the block it holds (``minidist.p2p.post_exchange``: an Isend and an Irecv, waited
for after the compute). Each block's partial result (o, lse) is merged into the running one
with the log-sum-exp rule lse' = logaddexp(lse, lse_b) (``minidist.attention.merge_attention``),
so after P steps every query has seen every key, and the output equals dense attention's.

Backward is a second ring. The K/V blocks go around again (recomputing each block's
probabilities from the saved final lse, FlashAttention-2's backward), and beside them travels
an accumulator of the block's dK and dV: in step s rank r adds its queries' part to the
accumulator of rank r - s's block and passes it on to r + 1, so after P steps each accumulator
has every rank's part, and one last pass hands it to its owner. The accumulator of step s is
sent while step s + 1 computes (it is waited for just before it is needed).

Cost per rank per attention call, with b = B · (T / P) · h values of one K or V block
(h = H · d): forward (P - 1) messages of K and V, 2 (P - 1) b values (the ring's closed form
2 (P - 1)(T / P) h per sequence); backward P - 1 messages of K and V and P of dK and dV,
(4P - 2) b values. Under a causal mask with contiguous shards rank r computes r + 1 of the P
block pairs (the rest lie above the diagonal and are skipped): the last rank sets the pace.
With zig-zag shards (:mod:`.layout`) the same ring gives every rank 2P + 1 half-size pairs.

The same ring carries both layouts: each block comes with its owner's chunks of positions, and
:mod:`.blocks` decides pair by pair what to compute. picotron's
``picotron/context_parallel/context_parallel.py`` (``RingAttentionFunc``) runs the same two
rings with torch's batched send/recv; torch's ``_templated_ring_attention``
(``torch/distributed/tensor/experimental/_attention.py``) too.
"""
from __future__ import annotations

from minidist.backend import get_array_module
from minidist.p2p import post_exchange, receive_buffer, stage_to_host, wait_all
from minidist.parallel.context_parallel.blocks import attend, attend_backward, empty_result, local_chunks
from minidist.tensor import Function

# One tag per ring, so that no message of one is taken by the other (or by a collective).
KV_TAG, KV_BACKWARD_TAG, DKV_TAG = 7790, 7791, 7792


def pass_block(comm, block, shape, tag):
    """Post one ring step: send ``block`` (a C-contiguous array) to rank + 1 and receive an
    array of ``shape`` (block's dtype) from rank - 1, both at once, so no rank waits for
    another's send to be received before it receives (a ring of blocking Sends hangs once a
    block passes MPI's eager limit: the sim reports it as a deadlock). Returns ``(exchange,
    buffer, back)``: wait for the exchange with :func:`finish_pass`; ``back(buffer)`` is the
    received block on ``block``'s device."""
    rank, p = comm.Get_rank(), comm.Get_size()
    send, _ = stage_to_host(comm, block)
    buffer, back = receive_buffer(comm, shape, block.dtype, block)
    return post_exchange(comm, send, (rank + 1) % p, buffer, (rank - 1) % p, tag), buffer, back


def finish_pass(comm, posted, what):
    """Wait (with the engine's deadline) for a :func:`pass_block` and return the received block."""
    (requests, peers, receives), buffer, back = posted
    wait_all(comm, requests, peers, what, receives=receives)
    return back(buffer)


def kv_shape(k, v, t):
    """The shape of a K/V block of ``t`` positions: k and v side by side on the last axis."""
    return k.shape[:-2] + (t, k.shape[-1] + v.shape[-1])


def ring_forward(comm, q, k, v, chunks, scale, is_causal, counter=None):
    """The forward ring (module docstring). chunks: every rank's ``(start, stop)`` position
    chunks (``layout.rank_chunks``), in rank order. Returns ``(o, lse)`` of this rank's queries."""
    xp, rank, p = get_array_module(q), comm.Get_rank(), comm.Get_size()
    d, e = k.shape[-1], v.shape[-1]
    mine = local_chunks(chunks[rank])
    o, lse = empty_result(q, e)
    block, owner = xp.ascontiguousarray(xp.concatenate([k, v], axis=-1)), rank
    for step in range(p):
        if step < p - 1:  # the next block travels while this one is computed
            nxt = (owner - 1) % p
            posted = pass_block(comm, block, kv_shape(k, v, length(chunks[nxt])), KV_TAG)
        attend(q, mine, block[..., :d], block[..., d:], local_chunks(chunks[owner]), scale, is_causal, o, lse, counter)
        if step < p - 1:
            block, owner = finish_pass(comm, posted, f"ring attention step {step}"), nxt
    return o, lse


def ring_backward(comm, q, k, v, o, lse, do, chunks, scale, is_causal, counter=None):
    """The backward ring (module docstring): ``(dq, dk, dv)`` of this rank's q, k, v."""
    xp, rank, p = get_array_module(q), comm.Get_rank(), comm.Get_size()
    d = k.shape[-1]
    mine = local_chunks(chunks[rank])
    delta = (do * o).sum(axis=-1)
    dq = xp.zeros_like(q)
    block, owner, carried = xp.ascontiguousarray(xp.concatenate([k, v], axis=-1)), rank, None
    for step in range(p):
        if step < p - 1:
            nxt = (owner - 1) % p
            posted = pass_block(comm, block, kv_shape(k, v, length(chunks[nxt])), KV_BACKWARD_TAG)
        dk, dv = attend_backward(q, mine, block[..., :d], block[..., d:], local_chunks(chunks[owner]), do, lse, delta,
                                 scale, is_causal, dq, counter)
        grads = xp.concatenate([dk, dv], axis=-1)
        if carried is not None:  # the accumulator of this block, from rank - 1
            grads += finish_pass(comm, carried, f"ring attention backward step {step} (dK, dV)")
        after = (owner - 1) % p  # whose accumulator rank - 1 passes next (this rank's own after the last step)
        carried = pass_block(comm, xp.ascontiguousarray(grads), kv_shape(k, v, length(chunks[after])), DKV_TAG)
        if step < p - 1:
            block, owner = finish_pass(comm, posted, f"ring attention backward step {step}"), nxt
    grads = finish_pass(comm, carried, "ring attention backward (this rank's dK, dV)")
    return dq, grads[..., :d], grads[..., d:]


def length(chunks) -> int:
    """The positions a rank holds, given its chunks."""
    return sum(stop - start for start, stop in chunks)


class RingAttention(Function):
    """Ring attention as one differentiable op (module docstring): q (B, H, t, d), k (B, H, t, d),
    v (B, H, t, e) this rank's positions -> this rank's output (B, H, t, e). Options: ``comm``
    (the cp group), ``chunks`` (every rank's position chunks, rank order), ``scale``,
    ``is_causal``, ``counter`` (a ``blocks.BlockCounter`` or None). Saves q, k, v, the output
    and its log-sum-exp. Collective forward and backward."""

    @staticmethod
    def forward(ctx, q, k, v, *, comm, chunks, scale, is_causal, counter=None):
        o, lse = ring_forward(comm, q, k, v, chunks, scale, is_causal, counter)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.comm, ctx.chunks, ctx.scale, ctx.is_causal, ctx.counter = comm, chunks, scale, is_causal, counter
        return o

    @staticmethod
    def backward(ctx, grad):
        q, k, v, o, lse = ctx.saved
        xp = get_array_module(grad)
        return ring_backward(ctx.comm, q, k, v, o, lse, xp.ascontiguousarray(grad), ctx.chunks, ctx.scale,
                             ctx.is_causal, ctx.counter)
