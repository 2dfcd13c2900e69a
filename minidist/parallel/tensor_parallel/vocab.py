"""The vocabulary split across a tensor-parallel group: the embedding and the loss.

A GPT's largest matrices are often the token embedding (V, C) and the output layer that
shares it: V = 50,257 for GPT-2. Megatron-LM (Shoeybi et al. 2019, section 3) cuts both by
vocabulary rows, so each rank holds V / T of them, and never gathers the (B, T, V) logits:

- :class:`VocabParallelEmbedding`: rank r holds rows ``start:stop``. A token it owns is looked
  up; any other gives zeros; ``g`` (an all-reduce) then gives every rank every token's row.
  The gradient reaches only the rows a rank owns.
- the output layer is column-parallel over the same rows (the tied weight): each rank gets
  the logits of its own part of the vocabulary, (B, T, stop - start);
- :func:`vocab_parallel_cross_entropy` computes the softmax loss from those parts with three
  all-reduces of one number per position (the maximum, the sum of exponentials, the target's
  logit) instead of the V numbers per position that gathering the logits would move; its
  backward needs no message: each rank's gradient is softmax minus one-hot on its own columns.

Megatron pads V to a multiple of T and masks the padded logits; here the rows are cut as
``numpy.array_split`` cuts them (:func:`minidist.collectives.chunk_bounds`), so there is no
padding to mask and any T up to V works.
"""
from __future__ import annotations

from functools import partial

from minidist import backend, nn
from minidist.collectives import all_reduce
from minidist.functions import embedding
from minidist.parallel.tensor_parallel.layers import shard_bounds
from minidist.parallel.tensor_parallel.operators import (
    communicate,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from minidist.tensor import Function, Tensor


class VocabParallelEmbedding(nn.Module):
    """This rank's rows ``start:stop`` of a dense ``nn.Embedding`` (V, C) (module docstring).

    Shapes: integer ids of any shape, the same on every rank, each in [0, V) -> (*ids.shape,
    C), the same on every rank. ``weight`` (stop - start, C). With ``sequence_parallel``: ids
    (B, t) -> (B, t / T, C), this rank's positions (a reduce-scatter along axis 1 in place of
    ``g``). Collective in forward. Build with :meth:`from_dense`. Source: Shoeybi et al. 2019,
    section 3; Korthikanti et al., MLSys 2023.
    """

    def __init__(self, weight, comm, num_embeddings: int, start: int, stop: int, sequence_parallel: bool = False):
        super().__init__()
        self.comm, self.num_embeddings, self.start, self.stop = comm, num_embeddings, start, stop
        self.sequence_parallel = bool(sequence_parallel)
        self.weight = nn.Parameter(weight)

    @classmethod
    def from_dense(cls, dense: nn.Embedding, comm, sequence_parallel: bool = False) -> VocabParallelEmbedding:
        """This rank's rows of ``dense.weight`` (a copy). Raises ValueError when ``comm`` has
        more ranks than the vocabulary has tokens."""
        rows = dense.weight.shape[0]
        start, stop = shard_bounds(rows, comm, "tokens")
        return cls(dense.weight.data[start:stop].copy(), comm, rows, start, stop, sequence_parallel)

    def forward(self, ids):
        xp = backend.get_array_module(self.weight.data)
        ids = ids.data if isinstance(ids, Tensor) else xp.asarray(ids)
        mine = (ids >= self.start) & (ids < self.stop)
        rows = embedding(xp.where(mine, ids - self.start, 0), self.weight)
        partial = rows * Tensor(mine[..., None].astype(rows.dtype))  # zeros for the tokens other ranks hold
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial, self.comm)
        return reduce_from_tensor_parallel_region(partial, self.comm)

    def extra_repr(self):
        return f"{self.num_embeddings}, {self.weight.shape[1]} (this rank: {self.start}:{self.stop})"


class VocabParallelCrossEntropy(Function):
    """Mean cross-entropy from this rank's columns ``start:start + n`` of the logits (N, V)
    (module docstring). logits (N, n) float; ``targets`` (N,) integers in [0, V) or
    ``ignore_index`` (left out of the loss and of the mean's count). Forward: three
    all-reduces of N numbers (the second carries one more, the rank's width, so that V is
    known everywhere); backward: none. Raises ValueError on every rank for an id outside
    [0, V)."""

    @staticmethod
    def forward(ctx, logits, *, targets, start, comm, ignore_index=-1):
        xp = backend.get_array_module(logits)
        n, width = logits.shape
        largest = communicate(partial(all_reduce, op="max"), comm, logits.max(axis=1))
        shifted = logits - largest[:, None]
        exp = xp.exp(shifted)
        # the sums of exponentials, and one number more: this rank's width, so that every rank
        # learns V (the widths added up) and can refuse an id no rank holds (float32 at least:
        # V exact up to 2**24)
        sums = xp.concatenate([exp.sum(axis=1), xp.asarray([width])]).astype(xp.result_type(exp.dtype, xp.float32))
        sums = communicate(all_reduce, comm, sums)
        total, vocab = sums[:-1].astype(exp.dtype), int(round(float(sums[-1])))
        kept = targets != ignore_index
        bad = kept & ((targets < 0) | (targets >= vocab))
        if bad.any():  # the same targets and V on every rank: every rank raises here
            raise ValueError(f"vocab_parallel_cross_entropy: target ids must be in [0, V = {vocab}) or "
                             f"ignore_index = {ignore_index}; got {int(targets[bad][0])}")
        mine = kept & (targets >= start) & (targets < start + width)
        local = xp.where(mine, targets - start, 0)
        picked = communicate(all_reduce, comm, xp.where(mine, shifted[xp.arange(n), local], 0.0))  # target's, shifted
        count = int(kept.sum())
        exp /= total[:, None]
        ctx.save_for_backward(exp, local, mine, kept)
        ctx.count = count
        if count == 0:
            return xp.asarray(xp.nan, dtype=logits.dtype)
        return ((xp.log(total) - picked) * kept).sum() / count

    @staticmethod
    def backward(ctx, grad):
        probs, local, mine, kept = ctx.saved
        xp = backend.get_array_module(probs)
        out = probs * kept[:, None]
        out[xp.arange(out.shape[0]), local] -= mine.astype(out.dtype)
        out *= grad / max(ctx.count, 1)
        return (out,)


def vocab_parallel_cross_entropy(logits: Tensor, targets, comm, start: int, ignore_index: int = -1) -> Tensor:
    """The mean cross-entropy of ``targets`` under the softmax of logits split by vocabulary
    columns: ``logits`` (N, n) is this rank's columns ``start:start + n`` of the whole (N, V);
    ``targets`` (N,) integer ids in [0, V), or ``ignore_index`` for positions left out. Returns
    the same scalar Tensor on every rank, equal to ``nn.functional.cross_entropy`` of the
    whole logits. Collective (three all-reduces of N numbers, the second with one number more:
    each rank's width, summed to V). Raises ValueError on every rank, naming it, for a target
    outside [0, V) that is not ``ignore_index`` (no rank holds its logit: without the check its
    loss would be computed from a logit of 0). Source: Shoeybi et al. 2019, section 3
    (Megatron's ``vocab_parallel_cross_entropy``)."""
    xp = backend.get_array_module(logits.data)
    ids = targets.data if isinstance(targets, Tensor) else xp.asarray(targets)
    return VocabParallelCrossEntropy.apply(logits, targets=ids, start=start, comm=comm, ignore_index=ignore_index)
