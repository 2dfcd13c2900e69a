"""The two conjugate operators of tensor parallelism, ``f`` and ``g``, as autograd ops.

Megatron-LM (Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models
Using Model Parallelism", 2019, section 3) splits each layer of a transformer across the T
ranks of a tensor-parallel group so that a pair of layers needs one all-reduce going forward
and one going backward. The messages sit in two places, written as two operators that are
each other's mirror image:

- ``f`` (:func:`copy_to_tensor_parallel_region`): the identity going forward, an all-reduce
  of the gradient going backward. It stands where an activation that every rank holds whole
  enters a column-parallel layer: each rank's slice of the layer uses all of the input, so
  each rank's backward gives only its slice's part of the input's gradient, and the parts
  must be summed.
- ``g`` (:func:`reduce_from_tensor_parallel_region`): an all-reduce going forward, the
  identity going backward. It stands after a row-parallel layer, whose ranks each hold a
  partial sum of the output; the gradient of a sum reaches every addend unchanged.

Megatron's names are ``copy_to_tensor_model_parallel_region`` and
``reduce_from_tensor_model_parallel_region``; picotron's ``Copy`` and ``Reduce``. Both are
collectives: every rank of ``comm`` must call them, in the same order, forward and backward.
The all-reduce is :func:`minidist.collectives.all_reduce` ("auto" algorithm), so they run on
a ``minidist.sim`` world and under ``mpiexec`` alike. When ``comm`` keeps time
(``tracing.CountingComm.timed``, the driver's), each operator's collective adds its seconds.
"""
from __future__ import annotations

from minidist.backend import get_array_module
from minidist.collectives import all_gather, all_reduce, reduce_scatter
from minidist.tensor import Function, Tensor


def communicate(collective, comm, x):
    """``collective(comm, x)``, inside ``comm.timed()`` when the communicator has one (a
    ``tracing.CountingComm``: its ``seconds`` then include this call's)."""
    timed = getattr(comm, "timed", None)
    if timed is None:
        return collective(comm, x)
    with timed():
        return collective(comm, x)


class CopyToTensorParallelRegion(Function):
    """``f``: forward returns x unchanged (the same array); backward all-reduces (sums) the
    gradient over ``comm``. Any shape and float dtype."""

    @staticmethod
    def forward(ctx, x, *, comm):
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, grad):
        return (communicate(all_reduce, ctx.comm, grad),)


class ReduceFromTensorParallelRegion(Function):
    """``g``: forward all-reduces (sums) x over ``comm``; backward passes the gradient on
    unchanged. Any shape and float dtype, the same on every rank."""

    @staticmethod
    def forward(ctx, x, *, comm):
        return communicate(all_reduce, comm, x)

    @staticmethod
    def backward(ctx, grad):
        return (grad,)


def copy_to_tensor_parallel_region(x: Tensor, comm) -> Tensor:
    """``f`` (module docstring): identity forward, gradient all-reduced over ``comm`` backward.
    x: a Tensor of any shape, the same on every rank. Collective (every rank calls it)."""
    return CopyToTensorParallelRegion.apply(x, comm=comm)


def reduce_from_tensor_parallel_region(x: Tensor, comm) -> Tensor:
    """``g`` (module docstring): x summed over ``comm`` forward, gradient passed on backward.
    x: a Tensor of the same shape and dtype on every rank. Collective. Raises
    ``p2p.CollectiveError`` on every rank if the ranks' shapes or dtypes differ."""
    return ReduceFromTensorParallelRegion.apply(x, comm=comm)


# ---------------------------------------------------------------------------------------
# Sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large
# Transformer Models", 2022, section 4.2.2): between the split layers, the LayerNorms and the
# residual additions run on a block of the sequence instead of on all of it. An all-reduce is
# a reduce-scatter followed by an all-gather (chapter 04); sequence parallelism moves the two
# halves apart, so the activations between them are held as T blocks of positions, one per rank:
#
# - ``g`` becomes a reduce-scatter along the sequence (forward), whose backward is an
#   all-gather (:func:`reduce_scatter_to_sequence_parallel_region`);
# - ``f`` becomes an all-gather along the sequence (forward), whose backward is a
#   reduce-scatter (:func:`gather_from_sequence_parallel_region`).
#
# Each moves the same bytes as half an all-reduce, so a block sends what it sent before, and
# each rank keeps 1/T of the activations that used to be whole on every rank.
# ---------------------------------------------------------------------------------------


def sequence_block(t: int, comm) -> tuple[int, int]:
    """(start, stop) of this rank's positions when a sequence of length t is cut into
    ``comm.Get_size()`` equal blocks. Raises ValueError (naming the fix) when the size does not
    divide t: every rank's block must have the same shape for the all-gather."""
    p = comm.Get_size()
    if t % p:
        raise ValueError(f"sequence parallelism cuts the sequence into {p} equal blocks, one per tensor-parallel "
                         f"rank, but its length is {t}; use a sequence length (--block-size) that {p} divides, or "
                         "run without sequence parallelism")
    per = t // p
    return comm.Get_rank() * per, (comm.Get_rank() + 1) * per


def all_gather_sequence(comm, x, axis: int = 1):
    """Every rank's block of positions put back together along ``axis``: x (..., t / T, ...)
    the same shape on every rank -> (..., t, ...), rank r's block at positions r·t/T ... A
    ring all-gather (:func:`minidist.collectives.all_gather`). Collective."""
    xp = get_array_module(x)
    parts = all_gather(comm, xp.ascontiguousarray(x))  # (T, *x.shape)
    return xp.concatenate(list(parts), axis=axis)


def reduce_scatter_sequence(comm, x, axis: int = 1):
    """The sum of every rank's x, of which this rank keeps its block of positions along
    ``axis``: x (..., t, ...) -> (..., t / T, ...). A ring reduce-scatter
    (:func:`minidist.collectives.reduce_scatter`) of x with ``axis`` moved first, so that each
    rank's chunk is its block. Raises ValueError when T does not divide t. Collective."""
    xp = get_array_module(x)
    start, stop = sequence_block(x.shape[axis], comm)
    moved = xp.ascontiguousarray(xp.moveaxis(x, axis, 0))  # (t, ...): rank r's block is one chunk
    mine = reduce_scatter(comm, moved).reshape((stop - start,) + moved.shape[1:])
    return xp.ascontiguousarray(xp.moveaxis(mine, 0, axis))


class GatherFromSequenceParallelRegion(Function):
    """``f`` under sequence parallelism: forward all-gathers the blocks of positions (axis 1,
    the course's (B, T, C) layout); backward reduce-scatters the gradient (each rank's split
    layer gave a part of every position's gradient: summed, and each rank keeps its block)."""

    @staticmethod
    def forward(ctx, x, *, comm):
        ctx.comm = comm
        return communicate(all_gather_sequence, comm, x)

    @staticmethod
    def backward(ctx, grad):
        return (communicate(reduce_scatter_sequence, ctx.comm, grad),)


class ReduceScatterToSequenceParallelRegion(Function):
    """``g`` under sequence parallelism: forward reduce-scatters the partial sums along the
    sequence (axis 1); backward all-gathers the gradient of each rank's block."""

    @staticmethod
    def forward(ctx, x, *, comm):
        ctx.comm = comm
        return communicate(reduce_scatter_sequence, comm, x)

    @staticmethod
    def backward(ctx, grad):
        return (communicate(all_gather_sequence, ctx.comm, grad),)


def gather_from_sequence_parallel_region(x: Tensor, comm) -> Tensor:
    """All-gather forward, reduce-scatter backward, along the sequence (axis 1): x (B, t / T,
    ...) this rank's positions -> (B, t, ...) every position. Stands where ``f`` stands without
    sequence parallelism (before a column-parallel layer). Megatron's name. Collective."""
    return GatherFromSequenceParallelRegion.apply(x, comm=comm)


def reduce_scatter_to_sequence_parallel_region(x: Tensor, comm) -> Tensor:
    """Reduce-scatter forward, all-gather backward, along the sequence (axis 1): x (B, t, ...)
    this rank's partial sums -> (B, t / T, ...) the sums at this rank's positions. Stands where
    ``g`` stands without sequence parallelism (after a row-parallel layer). Megatron's name.
    Raises ValueError when T does not divide t. Collective."""
    return ReduceScatterToSequenceParallelRegion.apply(x, comm=comm)
