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
a ``minidist.sim`` world and under ``mpiexec`` alike.
"""
from __future__ import annotations

from minidist.collectives import all_reduce
from minidist.tensor import Function, Tensor


class CopyToTensorParallelRegion(Function):
    """``f``: forward returns x unchanged (the same array); backward all-reduces (sums) the
    gradient over ``comm``. Any shape and float dtype."""

    @staticmethod
    def forward(ctx, x, *, comm):
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, grad):
        return (all_reduce(ctx.comm, grad),)


class ReduceFromTensorParallelRegion(Function):
    """``g``: forward all-reduces (sums) x over ``comm``; backward passes the gradient on
    unchanged. Any shape and float dtype, the same on every rank."""

    @staticmethod
    def forward(ctx, x, *, comm):
        return all_reduce(comm, x)

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
