"""One flat buffer for many parameters, padded so that P ranks hold equal shards.

ZeRO (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020) and PyTorch's FSDP (Zhao et al., VLDB 2023: the ``FlatParameter``) lay a
group of parameters end to end in one vector and cut it into P equal shards, rank r holding
shard r. Equal shards make the collectives plain: an all-gather of P shards of size s is the
whole vector (``collectives.all_gather`` needs the same shape on every rank), and a
reduce-scatter of the whole vector hands rank r exactly its shard (``collectives.reduce_scatter``
cuts with ``numpy.array_split``, whose chunks are equal when P divides the length). So the
vector of n numbers is padded with zeros to ``padded = ceil(n / P) * P``; the padding costs at
most P - 1 numbers, its gradient is zero and no optimizer moves it (AdamW: m = v = 0, the step
0 / (0 + eps); the decay shrinks 0). The bytes of a collective are those of the padded vector:
Ψ in the closed forms is ``padded * itemsize``.

:class:`FlatParameter` is the layout only (offsets, padding, shard bounds) and the two moves
between a list of arrays and the flat vector; who owns the vector is its user's business
(:class:`~minidist.parallel.zero.ZeroRedundancyOptimizer` keeps only its shard,
``minidist.parallel.fsdp`` one per unit).
"""
from __future__ import annotations

from minidist import backend


class FlatParameter:
    """The layout of ``params`` laid end to end and padded for ``world_size`` equal shards.

    Args:
        params: a non-empty list of Tensors (any shapes) of one dtype, in the order they are laid out.
        world_size: P >= 1.

    Attributes: ``params``; ``shapes`` (tuples); ``offsets`` (parameter i is
    ``offsets[i]:offsets[i + 1]`` of the vector); ``numel`` (n, the numbers of the
    parameters); ``padded`` (ceil(n / P) * P); ``shard_size`` (padded / P); ``dtype``;
    ``nbytes`` (padded * itemsize: Ψ of the closed forms).

    Raises ValueError for an empty list, parameters of several dtypes, or world_size < 1.
    """

    def __init__(self, params, world_size: int):
        self.params = list(params)
        if not self.params:
            raise ValueError("FlatParameter: no parameters to lay out (a module without parameters?)")
        if world_size < 1:
            raise ValueError(f"FlatParameter: world_size must be >= 1, got {world_size}")
        dtypes = sorted({str(p.dtype) for p in self.params})
        if len(dtypes) > 1:
            raise ValueError(f"FlatParameter: one flat buffer holds one dtype, the parameters have {dtypes}; cast "
                             "the model to one dtype first")
        self.dtype = self.params[0].dtype
        self.shapes = [tuple(p.shape) for p in self.params]
        self.offsets = [0]
        for p in self.params:
            self.offsets.append(self.offsets[-1] + int(p.size))
        self.numel = self.offsets[-1]
        self.world_size = int(world_size)
        self.shard_size = -(-self.numel // self.world_size)
        self.padded = self.shard_size * self.world_size
        self.nbytes = self.padded * self.dtype.itemsize

    def shard_bounds(self, rank: int) -> tuple[int, int]:
        """(start, stop) of rank ``rank``'s shard in the padded vector."""
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def flatten(self, arrays, like=None):
        """A new padded vector (padded,) of this layout's dtype holding ``arrays`` (one per
        parameter, each of its parameter's size, any shape; None stands for zeros) end to end,
        zeros in the padding. ``like``: an array whose module (numpy/cupy) to use (default: the
        first parameter's)."""
        xp = backend.get_array_module(like if like is not None else self.params[0].data)
        flat = xp.zeros(self.padded, dtype=self.dtype)
        for array, start, stop in zip(arrays, self.offsets, self.offsets[1:]):
            if array is not None:
                flat[start:stop] = array.reshape(-1)
        return flat

    def views(self, flat) -> list:
        """The parameters' arrays as views of ``flat`` (a vector of at least ``numel``
        numbers), each reshaped to its parameter's shape: writing a view writes ``flat``."""
        return [flat[start:stop].reshape(shape) for start, stop, shape in zip(self.offsets, self.offsets[1:],
                                                                             self.shapes)]

    def __repr__(self):
        return (f"FlatParameter({len(self.params)} parameters, {self.numel} numbers padded to {self.padded}, "
                f"{self.world_size} shards of {self.shard_size})")
