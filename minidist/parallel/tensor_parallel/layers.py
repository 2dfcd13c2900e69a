"""Linear layers split across a tensor-parallel group: column-parallel, then row-parallel.

A Linear layer computes Y = X Aᵀ + b with A of shape (out, in) (PyTorch's layout). Megatron-LM
(Shoeybi et al. 2019, section 3) splits it one of two ways over the T ranks of ``comm``:

- **Column-parallel** (:class:`ColumnParallelLinear`): rank r holds a block of A's rows (the
  columns of Aᵀ, hence the name): out_r outputs, computed from the whole input. The input
  goes through ``f`` (its gradient is summed over the ranks); the output stays split, each
  rank holding its own features.
- **Row-parallel** (:class:`RowParallelLinear`): rank r holds a block of A's columns and
  reads only the matching features of the input, which is what a column-parallel layer left
  it. Each rank's product is a partial sum of the output; ``g`` adds them up; the bias is
  added once, after the sum.

A column-parallel layer followed by a row-parallel one (the MLP's c_fc and c_proj, or
attention's c_attn split by heads and its c_proj) needs one all-reduce forward (``g``) and
one backward (``f``), and an elementwise op between them (GELU) needs none, since each rank
applies it to its own features. Shards may be uneven: the features are cut as
``numpy.array_split`` cuts them (:func:`minidist.collectives.chunk_bounds`: the first
``n % T`` ranks get one more), so any T from 1 to n works.

Both layers are made from a dense ``nn.Linear`` (``from_dense``), every rank slicing the same
weights: with the same seed, the split layer computes what the dense one does, to rounding.

With ``sequence_parallel=True`` (Korthikanti et al., MLSys 2023) the activations outside the pair are
cut by positions, axis 1 of (B, t, C): the column-parallel layer all-gathers its input's
positions instead of ``f``, the row-parallel layer reduce-scatters its output instead of ``g``
(each rank keeps the sums at its own positions) and adds its bias there: every rank holds the
whole bias but uses it on its positions only, so the ranks' gradients are parts of the bias's
gradient, and the backward sums them (an all-reduce of out_features numbers, what ``f``'s
backward would do).

Memory. This engine's graph keeps the arrays of every op's inputs until the backward
(:mod:`minidist.memory`), where PyTorch keeps only what an op saves. Written as ``linear``
then ``g``, the row-parallel layer would keep its partial product, an array the size of its
output, which no backward needs; so its product and its sum are one op here
(:class:`LinearReduce`), and the learner's two-op version (chapter 14's exercise) computes the
same numbers. Under sequence parallelism the column-parallel layer is one op too
(:class:`AllGatherLinear`): it keeps this rank's block of positions and all-gathers it again
in backward, instead of keeping the gathered input, as Korthikanti et al. (section 4.2.2) do;
that costs one more all-gather per layer and step and saves T - 1 blocks of its input.
"""
from __future__ import annotations

import numpy as np

from minidist import nn
from minidist.collectives import all_reduce, chunk_bounds
from minidist.functions import linear
from minidist.parallel.tensor_parallel.operators import (
    all_gather_sequence,
    communicate,
    copy_to_tensor_parallel_region,
    reduce_scatter_sequence,
)
from minidist.tensor import Function


class AllGatherLinear(Function):
    """Sequence parallelism's column-parallel product as one op (module docstring): this
    rank's positions x (B, t / T, in) all-gathered along axis 1, times weight (out_r, in)
    transposed, plus bias (out_r,) or None -> (B, t, out_r). Saves only x; backward gathers it
    again, then dx = reduce-scatter of g W (each rank keeps its positions' part of the sum),
    dW = gᵀ X, db = Σ g. Collective: one all-gather forward; an all-gather and a
    reduce-scatter backward. Source: Korthikanti et al., MLSys 2023, section 4.2.2."""

    @staticmethod
    def forward(ctx, x, weight, bias=None, *, comm):
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.has_bias = comm, bias is not None
        whole = communicate(all_gather_sequence, comm, x)
        out = whole.reshape(-1, whole.shape[-1]) @ weight.T
        if bias is not None:
            out += bias
        return out.reshape(*whole.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved
        whole = communicate(all_gather_sequence, ctx.comm, x)  # again: cheaper to send than to keep
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_x = communicate(reduce_scatter_sequence, ctx.comm, (g2 @ weight).reshape(whole.shape))
        grad_w = g2.T @ whole.reshape(-1, whole.shape[-1])
        return grad_x, grad_w, (g2.sum(axis=0) if ctx.has_bias else None)


class LinearReduce(Function):
    """A row-parallel product, its sum over the ranks and the bias as one op (module
    docstring): x (..., in_r) times weight (out, in_r) transposed, all-reduced (``g``), plus
    bias (out,) or None -> (..., out); or with ``sequence_parallel`` reduce-scattered along
    axis 1, plus the bias -> (B, t / T, out). Saves x and the weight, neither the partial
    product nor the sum. Backward: dx = g W, dW = gᵀ x (the gradient all-gathered first under
    sequence parallelism), db = Σ g (under sequence parallelism each rank's sum covers its
    positions only: all-reduced, as ``f`` would). Collective. Source: Shoeybi et al. 2019,
    section 3; Korthikanti et al., MLSys 2023, section 4.2.2."""

    @staticmethod
    def forward(ctx, x, weight, bias=None, *, comm, sequence_parallel):
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.sequence_parallel, ctx.has_bias = comm, sequence_parallel, bias is not None
        partial = (x.reshape(-1, x.shape[-1]) @ weight.T).reshape(*x.shape[:-1], weight.shape[0])
        out = communicate(reduce_scatter_sequence if sequence_parallel else all_reduce, comm, partial)
        if bias is not None:
            out += bias  # out is the collective's fresh array
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved
        grad_b = None
        if ctx.has_bias:
            grad_b = grad.reshape(-1, grad.shape[-1]).sum(axis=0)
            if ctx.sequence_parallel:  # this rank's positions only: the ranks' parts summed
                grad_b = communicate(all_reduce, ctx.comm, grad_b)
        if ctx.sequence_parallel:
            grad = communicate(all_gather_sequence, ctx.comm, grad)
        g2 = grad.reshape(-1, grad.shape[-1])
        return (g2 @ weight).reshape(x.shape), g2.T @ x.reshape(-1, x.shape[-1]), grad_b


def shard_bounds(n: int, comm, what: str = "features") -> tuple[int, int]:
    """(start, stop) of this rank's block when n features (or heads: ``what`` names them in
    the error) are cut over ``comm``'s ranks as ``numpy.array_split`` cuts them. Raises
    ValueError when there are more ranks than features (a rank would hold nothing; use fewer
    ranks)."""
    p, rank = comm.Get_size(), comm.Get_rank()
    if n < p:
        raise ValueError(f"cannot split {n} {what} over {p} tensor-parallel ranks: every rank needs at least "
                         f"one; use at most {n} ranks")
    return chunk_bounds(n, p)[rank]


class ShardedLinear(nn.Module):
    """What both split layers hold: ``weight`` and ``bias`` (Parameters, or bias None), the
    group ``comm``, the dense layer's ``in_features`` and ``out_features``, and ``start:stop``,
    the features of the split axis this rank holds (output features for the column-parallel
    layer, input features for the row-parallel one), and ``sequence_parallel`` (module
    docstring)."""

    def __init__(self, weight, bias, comm, in_features: int, out_features: int, start: int, stop: int,
                 sequence_parallel: bool = False):
        super().__init__()
        self.comm, self.in_features, self.out_features = comm, in_features, out_features
        self.start, self.stop, self.sequence_parallel = start, stop, bool(sequence_parallel)
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)


class ColumnParallelLinear(ShardedLinear):
    """The rows ``start:stop`` of a dense Linear's weight (out, in) and bias (module docstring).

    Shapes: input (..., in_features), the same on every rank -> output (..., stop - start),
    this rank's features. ``weight`` (stop - start, in_features), ``bias`` (stop - start,).
    With ``sequence_parallel``: input (B, t / T, in_features), this rank's positions -> (B, t,
    stop - start), every position. Build with :meth:`from_dense`. Collective in backward (``f``
    all-reduces the input's gradient; with sequence parallelism, :class:`AllGatherLinear`: an
    all-gather forward, an all-gather and a reduce-scatter backward). Source: Shoeybi et al.
    2019, section 3; Korthikanti et al., MLSys 2023.
    """

    @classmethod
    def from_dense(cls, dense: nn.Linear, comm, rows=None, sequence_parallel: bool = False) -> ColumnParallelLinear:
        """This rank's block of ``dense``'s output features (copies, so the dense layer can be
        dropped). ``rows``: the output features this rank takes, when they are not its
        contiguous block (attention's q, k and v rows of its heads: a list or integer array;
        ``start``/``stop`` then give its first and one past its last). Raises ValueError when
        ``comm`` has more ranks than output features."""
        if rows is None:
            start, stop = shard_bounds(dense.out_features, comm)
            rows = slice(start, stop)
        else:
            rows = np.asarray(rows)
            start, stop = int(rows[0]), int(rows[-1]) + 1
        bias = None if dense.bias is None else dense.bias.data[rows].copy()
        return cls(dense.weight.data[rows].copy(), bias, comm, dense.in_features, dense.out_features, start, stop,
                   sequence_parallel)

    def forward(self, x):
        if self.sequence_parallel:
            inputs = (x, self.weight) if self.bias is None else (x, self.weight, self.bias)
            return AllGatherLinear.apply(*inputs, comm=self.comm)
        return linear(copy_to_tensor_parallel_region(x, self.comm), self.weight, self.bias)

    def extra_repr(self):
        rows = self.weight.shape[0]
        mine = f"{self.start}:{self.stop}" if rows == self.stop - self.start else \
            f"{rows} rows between {self.start} and {self.stop - 1}"
        return f"in_features={self.in_features}, out_features={self.out_features} (this rank: {mine}), " \
               f"bias={self.bias is not None}"


class RowParallelLinear(ShardedLinear):
    """The columns ``start:stop`` of a dense Linear's weight (out, in), and its whole bias
    (module docstring).

    Shapes: input (..., stop - start), this rank's features (a column-parallel layer's
    output) -> output (..., out_features), the same on every rank. ``weight`` (out_features,
    stop - start), ``bias`` (out_features,), added after the sum. With ``sequence_parallel``:
    input (B, t, stop - start) -> (B, t / T, out_features), this rank's positions. Collective
    in forward (``g`` all-reduces the partial products, fused with the product:
    :class:`LinearReduce`; with sequence parallelism a reduce-scatter forward, an all-gather
    backward, and the bias's gradient all-reduced).
    Source: Shoeybi et al. 2019, section 3; Korthikanti et al., MLSys 2023.
    """

    @classmethod
    def from_dense(cls, dense: nn.Linear, comm, columns=None, sequence_parallel: bool = False) -> RowParallelLinear:
        """This rank's block of ``dense``'s input features, and a copy of its bias.
        ``columns``: the input features this rank takes when they are not its contiguous
        block (a run of consecutive integers). Raises ValueError when ``comm`` has more
        ranks than input features, or ``columns`` is not such a run."""
        if columns is None:
            start, stop = shard_bounds(dense.in_features, comm)
        else:
            start, stop = int(columns[0]), int(columns[-1]) + 1
            if list(columns) != list(range(start, stop)):
                raise ValueError(f"RowParallelLinear.from_dense: columns must be consecutive integers, got "
                                 f"{list(columns)}")
        bias = None if dense.bias is None else dense.bias.data.copy()
        return cls(dense.weight.data[:, start:stop].copy(), bias, comm, dense.in_features, dense.out_features,
                   start, stop, sequence_parallel)

    def forward(self, x):
        if x.shape[-1] != self.stop - self.start:
            raise ValueError(f"RowParallelLinear: this rank holds input features {self.start}:{self.stop} "
                             f"({self.stop - self.start}), got an input whose last axis is {x.shape[-1]}; feed it "
                             "the output of the matching ColumnParallelLinear")
        inputs = (x, self.weight) if self.bias is None else (x, self.weight, self.bias)
        return LinearReduce.apply(*inputs, comm=self.comm, sequence_parallel=self.sequence_parallel)

    def extra_repr(self):
        return (f"in_features={self.in_features} (this rank: {self.start}:{self.stop}), "
                f"out_features={self.out_features}, bias={self.bias is not None}")
