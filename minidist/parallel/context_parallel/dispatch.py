"""``context_parallel_attention``: this rank's part of the sequence in, this rank's part of attention out.

The one entry point of the wing's four variants (**contract**). Every rank of the cp group
passes its part of q, k and v, cut by :func:`~.layout.shard_sequence` for the same variant, and
gets its part of the output, exactly what dense attention over the whole sequence gives at
those positions; the result is differentiable (one ``minidist.tensor.Function`` per variant:
:class:`.ring.RingAttention` for "ring" and "zigzag", :class:`.allgather.AllGatherAttention`,
:class:`.ulysses.UlyssesAttention`).

Before any block moves, the ranks agree (``minidist.p2p.agree``, one small pickled round, not
counted among an algorithm's array bytes): each says its shapes, dtype, variant and mask; every
rank then knows every part's length, hence the whole length T and every rank's positions, and
any disagreement, or parts that are not the variant's cut of T, raises the same ValueError on
every rank instead of hanging a ring halfway round.
"""
from __future__ import annotations

import math

from minidist.p2p import agree
from minidist.parallel.context_parallel.allgather import AllGatherAttention
from minidist.parallel.context_parallel.layout import check_length, check_variant, rank_chunks, shard_lengths
from minidist.parallel.context_parallel.ring import RingAttention
from minidist.parallel.context_parallel.ulysses import UlyssesAttention, check_heads
from minidist.tensor import Tensor, as_tensors


def local_problem(q, k, v) -> str | None:
    """What is wrong with this rank's own q, k, v, or None: not 4-D (B, H, t, d), not floats of
    one dtype, or shapes that do not go together."""
    if not q.ndim == k.ndim == v.ndim == 4:
        return f"q, k, v must be (B, H, t, d) arrays, got shapes {q.shape}, {k.shape}, {v.shape}"
    if q.shape != k.shape or q.shape[:3] != v.shape[:3]:
        return f"q {q.shape}, k {k.shape} and v {v.shape} must be (B, H, t, d), (B, H, t, d), (B, H, t, e)"
    if not q.dtype == k.dtype == v.dtype or q.dtype.kind != "f":
        return f"q, k, v must be floats of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    return None


def agreed_lengths(comm, q, k, v, variant, is_causal) -> list[int]:
    """Every rank's number of positions, in rank order, after one agreement round (module
    docstring). Raises ValueError (on every rank alike; ``p2p.CollectiveError``, a ValueError,
    naming the rank, for a bad part on any rank), ranks that
    disagree on anything but their lengths, or lengths that are not ``variant``'s cut."""
    problem = local_problem(q, k, v)
    shape = (q.shape[0], q.shape[1], q.shape[3], v.shape[3]) if problem is None else None
    said = agree(comm, problem and f"context_parallel_attention: {problem}",
                 (shape, str(q.dtype), variant, bool(is_causal), None if problem else q.shape[2]),
                 what="context_parallel_attention")
    if len({entry[:4] for entry in said}) > 1:
        listed = "; ".join(f"rank {r}: (B, H, d, e) {s}, {dt}, {var}, causal {c}" for r, (s, dt, var, c, _) in
                           enumerate(said))
        raise ValueError(f"context_parallel_attention: the ranks disagree ({listed}); every rank must pass the same "
                         "batch, heads, head size, dtype, variant and is_causal")
    lengths = [entry[4] for entry in said]
    t, p = sum(lengths), comm.Get_size()
    check_length(t, p, variant)
    if lengths != shard_lengths(t, p, variant):
        raise ValueError(f"context_parallel_attention: the parts' lengths {lengths} are not the {variant} cut of "
                         f"{t} positions over {p} ranks ({shard_lengths(t, p, variant)}); cut q, k and v with "
                         f"shard_sequence(x, comm, {variant!r})")
    return lengths


def context_parallel_attention(q, k, v, comm, is_causal=True, variant="ring", *, scale=None, counter=None) -> Tensor:
    """Attention over a sequence cut across the ranks of ``comm`` (**contract**; module
    docstring): this rank's output positions of softmax(q kᵀ · scale + causal mask) v.

    Args:
        q, k: this rank's part (B, H, t, d) of the queries and keys, Tensors or arrays (a
            constant), cut by ``shard_sequence(x, comm, variant)``; v: (B, H, t, e).
        comm: the cp group (mpi4py or ``minidist.sim``); every rank calls this.
        is_causal: position i sees positions 0..i of the whole sequence (torch's is_causal).
        variant: "ring" (contiguous parts, K/V passed around a ring: :mod:`.ring`), "zigzag"
            (the same ring on zig-zag parts, every rank the same work), "allgather" (K/V
            all-gathered, Llama 3: :mod:`.allgather`) or "ulysses" (an all-to-all to heads and
            back, DeepSpeed-Ulysses: :mod:`.ulysses`).
        scale: multiplies the scores; default 1/sqrt(d).
        counter: a ``blocks.BlockCounter`` to which the chunk pairs and scores this rank
            computes are added (forward and backward), or None.

    Returns a Tensor (B, H, t, e), q's dtype; its gradient flows to q, k and v (collective in
    backward too).

    Raises ValueError (on every rank) for an unknown variant, parts that are not (B, H, t, d)
    floats or not the variant's cut, ranks that disagree, a sequence too short for the variant,
    or for "ulysses" a number of ranks that does not divide H.
    """
    check_variant(variant)
    q, k, v = as_tensors((q, k, v))
    lengths = agreed_lengths(comm, q.data, k.data, v.data, variant, is_causal)
    p = comm.Get_size()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    options = {"comm": comm, "scale": scale, "is_causal": bool(is_causal), "counter": counter}
    if variant == "ulysses":
        check_heads(q.shape[1], p)
        return UlyssesAttention.apply(q, k, v, lengths=lengths, **options)
    chunks = [rank_chunks(sum(lengths), p, r, variant) for r in range(p)]
    if variant == "allgather":
        return AllGatherAttention.apply(q, k, v, chunks=chunks, **options)
    return RingAttention.apply(q, k, v, chunks=chunks, **options)
