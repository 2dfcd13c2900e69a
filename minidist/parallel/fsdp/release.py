"""Letting a unit's gathered parameters go between its forward and its backward (FULL_SHARD).

ZeRO-3 holds 1/P of a unit's parameters except while the unit computes. Pointing the module's
parameters at empty arrays after the forward is not enough in this engine: every op keeps the
arrays it needs for its backward (``ctx.saved``: a Linear its weight, a LayerNorm its scale) and
its input Tensors (``ctx.parents``), so the graph would keep the gathered vector alive until the
backward. PyTorch frees the storage under the graph's feet (``storage.resize_(0)``) and gathers
into it again before the backward, so the saved tensors see the parameters once more. The same
here, on NumPy arrays: while the unit runs forward, a memory observer
(``tensor.add_memory_observer``) notes each op it records; after the forward, every saved array
(and input Tensor's array) that views the gathered vector is swapped for a :class:`Hole`, which
remembers where in the vector it looked (byte offset, shape, strides); just before the unit's
backward, after the vector was gathered again, each hole becomes a view of the new vector. Then
the vector of the forward has no reference left and is freed: between its forward and its
backward a unit holds only its shard (tests/test_fsdp.py checks it with a weak reference). The
values are the same (an all-gather of the same shards), so nothing a backward computes changes.
CuPy arrays are left alone (their views are not rebuilt from a buffer here).
"""
from __future__ import annotations

import weakref

import numpy as np

from minidist.tensor import add_memory_observer, remove_memory_observer


class Hole:
    """Where a saved array looked into the gathered vector: ``offset`` (bytes from its start),
    ``shape``, ``strides`` (bytes), ``dtype``. :meth:`view` rebuilds it on a new vector."""

    __slots__ = ("offset", "shape", "strides", "dtype")

    def __init__(self, array, full):
        self.offset = array.__array_interface__["data"][0] - full.__array_interface__["data"][0]
        self.shape, self.strides, self.dtype = array.shape, array.strides, array.dtype

    def view(self, full):
        return np.ndarray(self.shape, self.dtype, buffer=full, offset=self.offset, strides=self.strides)


def owner(array):
    """The array that owns ``array``'s memory (``.base`` followed to the end)."""
    while isinstance(getattr(array, "base", None), np.ndarray):
        array = array.base
    return array


def views_into(array, full) -> bool:
    """Whether ``array`` views the memory of ``full`` (the same owner)."""
    return isinstance(array, np.ndarray) and owner(array) is owner(full)


class GraphRelease:
    """The ops one unit records in one forward, and the holes punched in them.

    ``start()`` before the forward, ``stop()`` after it (observing this thread's recorded ops);
    ``punch(full)`` swaps every view of ``full`` they hold for a :class:`Hole`; ``fill(full)``
    (before the backward) turns the holes into views of the new ``full``. Ops whose backward
    already ran, or whose graph was dropped, are skipped (weak references)."""

    def __init__(self):
        self.contexts, self.holes = [], []

    # tensor.py's memory-observer protocol
    def saved(self, ctx):
        self.contexts.append(weakref.ref(ctx))

    def released(self, ctx):
        pass

    def start(self):
        self.contexts, self.holes = [], []
        add_memory_observer(self)

    def stop(self):
        remove_memory_observer(self)

    def punch(self, full) -> int:
        """Swap the views of ``full`` held by the observed ops for holes; returns how many."""
        if not isinstance(full, np.ndarray):
            self.contexts = []
            return 0
        for ref in self.contexts:
            ctx = ref()
            if ctx is None:
                continue
            saved = getattr(ctx, "saved", None)
            if saved and any(views_into(a, full) for a in saved):
                ctx.saved = tuple(Hole(a, full) if views_into(a, full) else a for a in saved)
                self.holes.append(("saved", ctx))
            for tensor in getattr(ctx, "parents", ()):
                if views_into(tensor.data, full):
                    self.holes.append(("parent", tensor, Hole(tensor.data, full)))
                    tensor.data = np.empty((0,), dtype=full.dtype)
        self.contexts = []
        return len(self.holes)

    def fill(self, full) -> None:
        """Make every hole a view of ``full`` again (the re-gathered vector)."""
        for hole in self.holes:
            if hole[0] == "saved":
                ctx = hole[1]
                if getattr(ctx, "saved", None):
                    ctx.saved = tuple(a.view(full) if isinstance(a, Hole) else a for a in ctx.saved)
            elif hole[1].data.size == 0:
                hole[1].data = hole[2].view(full)
        self.holes = []
