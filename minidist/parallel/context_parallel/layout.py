"""Which positions of a sequence each rank of a context-parallel group holds: contiguous or zig-zag.

Context parallelism cuts every sequence of T positions over the P ranks of a ``cp`` group, so
that each rank holds about T / P of the activations of every layer. Everything but attention
works position by position and needs nothing from the other ranks; attention needs every key
and value of the sequence (:mod:`.ring`, :mod:`.allgather`, :mod:`.ulysses`).

Two layouts (the ``variant`` names of :func:`shard_sequence`):

- **contiguous** ("ring", "allgather", "ulysses"): rank r holds block r of P blocks, in order,
  ``numpy.array_split``'s sizes (the first T mod P blocks one position longer). Under a causal
  mask rank r's queries see r + 1 of the P key blocks: the last rank does P block pairs of
  the causal triangle while the first does one (Ring Attention, Liu et al. 2023, leaves the
  imbalance as it is).
- **zig-zag** ("zigzag"): the sequence is cut into 2P chunks and rank r holds chunks r and
  2P - 1 - r, concatenated (one near the start, one near the end, whose rows of the causal
  triangle are short and long). Every rank then does 2P + 1 chunk pairs of the triangle, half
  the size of the contiguous blocks: r + 1 for its early chunk and 2P - r for its late one.
  Llama 3 (Dubey et al. 2024, section 3.3.2, "context parallelism") cuts its sequences so, into
  2 x CP chunks; torch's ``_HeadTailLoadBalancer``
  (``torch/distributed/tensor/experimental/_context_parallel/_load_balancer.py``) and
  torchtitan, which uses it, call it head-tail; the striped layout (Brandon et al. 2023) deals
  the positions round-robin instead.

A layout is a list of *chunks* per rank: ``(start, stop)`` ranges of positions in the whole
sequence, held side by side in the rank's array. The causal mask between two chunks is a
function of their positions alone (``minidist.attention.causal_mask``), so the attention code
never needs to know which layout made them.
"""
from __future__ import annotations

import numpy

from minidist import functions as F
from minidist.backend import get_array_module
from minidist.collectives import all_gather
from minidist.tensor import Tensor

VARIANTS = ("ring", "zigzag", "allgather", "ulysses")  # context_parallel_attention's; zigzag is the zig-zag layout


def check_variant(variant) -> None:
    """Raise ValueError naming the choices for a variant that is not one of :data:`VARIANTS`."""
    if variant not in VARIANTS:
        raise ValueError(f"context parallelism has no variant {variant!r}; choose one of {', '.join(VARIANTS)}")


def pieces(variant: str, p: int) -> int:
    """How many equal pieces a sequence is cut into: 2P for zig-zag, P otherwise."""
    return 2 * p if variant == "zigzag" else p


def check_length(t: int, p: int, variant: str) -> None:
    """Raise ValueError, naming the fix, when a sequence of ``t`` positions cannot be cut for
    ``variant`` over ``p`` ranks: fewer positions than pieces (:func:`pieces`), so some rank or
    chunk would hold none. Any longer length works (uneven pieces, one position apart)."""
    check_variant(variant)
    n = pieces(variant, p)
    if t < n:
        what = f"2 x {p} = {n} chunks (zig-zag)" if variant == "zigzag" else f"{p} parts, one per rank"
        raise ValueError(f"context parallelism ({variant}) cuts a sequence into {what}, but it has only {t} "
                         f"positions; use a sequence of at least {n} positions, or fewer cp ranks")


def rank_chunks(t: int, p: int, rank: int, variant: str) -> list[tuple[int, int]]:
    """The ``(start, stop)`` position ranges rank ``rank`` of ``p`` holds of a sequence of ``t``
    positions, in the order it holds them (module docstring): one block for the contiguous
    variants, chunks r and 2P - 1 - r for zig-zag. Raises ValueError as :func:`check_length`."""
    check_length(t, p, variant)
    bounds = numpy.cumsum([0] + [len(c) for c in numpy.array_split(numpy.arange(t), pieces(variant, p))])
    mine = (rank, 2 * p - 1 - rank) if variant == "zigzag" else (rank,)
    return [(int(bounds[c]), int(bounds[c + 1])) for c in mine]


def rank_positions(t: int, p: int, rank: int, variant: str) -> numpy.ndarray:
    """The positions (int64, in the order held) of rank ``rank``'s part (:func:`rank_chunks`)."""
    return numpy.concatenate([numpy.arange(start, stop) for start, stop in rank_chunks(t, p, rank, variant)])


def shard_lengths(t: int, p: int, variant: str) -> list[int]:
    """Every rank's number of positions, in rank order."""
    return [sum(stop - start for start, stop in rank_chunks(t, p, r, variant)) for r in range(p)]


def shard_sequence(x, comm, variant: str, axis: int = 2):
    """This rank's part of the sequence along ``axis`` (**contract**): ``x`` the whole sequence,
    the same on every rank (a NumPy or CuPy array, or a Tensor: then a Tensor whose gradient
    flows back into x); returns the positions :func:`rank_positions` gives for ``comm``'s rank
    and size, in that order (zig-zag: chunks r and 2P - 1 - r concatenated; a contiguous block
    otherwise). Local: no message. Default axis 2: (B, H, T, d) for attention's q, k, v; the
    GPT's token ids (B, T) use axis 1.

    Raises ValueError for an unknown variant, an axis x does not have, or a length the variant
    cannot cut (:func:`check_length`, naming the fix)."""
    check_variant(variant)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"shard_sequence: axis {axis} is not an axis of an array of shape {tuple(x.shape)}")
    axis %= x.ndim
    positions = rank_positions(x.shape[axis], comm.Get_size(), comm.Get_rank(), variant)
    if isinstance(x, Tensor):
        index = (slice(None),) * axis + (get_array_module(x.data).asarray(positions),)
        return F.getitem(x, index)
    return get_array_module(x).take(x, get_array_module(x).asarray(positions), axis=axis)


def gather_sequence(x, comm, variant: str, axis: int = 2):
    """The whole sequence from every rank's part (:func:`shard_sequence`'s inverse), on every
    rank: x this rank's part (an array; the other axes the same on every rank) -> the array of
    all T positions in order along ``axis``. For tests and reports, not for training (no
    gradient). Collective: two all-gathers (the parts' lengths, then the parts padded to the
    longest). Raises ValueError when the parts are not the cut of one sequence for ``variant``."""
    xp, p = get_array_module(x), comm.Get_size()
    axis %= x.ndim
    lengths = [int(n) for n in all_gather(comm, numpy.array([x.shape[axis]], numpy.int64))[:, 0]]
    t = sum(lengths)
    if lengths != shard_lengths(t, p, variant):
        raise ValueError(f"gather_sequence: the parts' lengths {lengths} are not the {variant} cut of {t} positions "
                         f"({shard_lengths(t, p, variant)}); pass the parts shard_sequence made")
    longest = max(lengths)
    padded = xp.zeros(x.shape[:axis] + (longest,) + x.shape[axis + 1:], x.dtype)
    padded[(slice(None),) * axis + (slice(0, x.shape[axis]),)] = x
    parts = all_gather(comm, padded)
    out = xp.empty(x.shape[:axis] + (t,) + x.shape[axis + 1:], x.dtype)
    for r in range(p):
        positions = xp.asarray(rank_positions(t, p, r, variant))
        out[(slice(None),) * axis + (positions,)] = parts[r][(slice(None),) * axis + (slice(0, lengths[r]),)]
    return out
