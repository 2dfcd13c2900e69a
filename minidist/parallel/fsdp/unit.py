"""One FSDP unit: a group of parameters kept as this rank's shard of one flat vector.

A unit (a GPT ``Block``; the rest of the model, the root) owns a
:class:`~minidist.parallel.zero.FlatParameter` layout and a Parameter holding this rank's shard
of the padded vector (``padded / P`` numbers; under NO_SHARD the whole vector). Its three
moves, each one collective over the ranks, with ring costs per rank (Ψ_u the unit's padded
bytes, P ranks):

- ``gather``: all-gather the shards into the full vector and point the module's parameters
  at views of it (``p.data``), so the module runs as it was written: (P-1)/P Ψ_u;
- ``free``: point the parameters at empty arrays again, dropping the full vector (ZeRO-3's
  saving: between its forward and its backward a unit holds 1/P of its parameters);
- ``reduce``: lay the parameters' gradients end to end, reduce-scatter them (sum over ranks)
  and keep this rank's shard, divided by P, in ``shard.grad`` (DDP's average): (P-1)/P Ψ_u.
  NO_SHARD all-reduces the whole vector instead (ring: 2(P-1)/P Ψ_u), as DDP.

FULL_SHARD gathers before the forward and again before the backward: 3(P-1)/P Ψ per step;
SHARD_GRAD_OP keeps the gathered vector from the forward to the end of the backward:
2(P-1)/P Ψ; NO_SHARD never gathers: 2(P-1)/P Ψ (Rajbhandari et al., SC 2020, section 7;
Zhao et al., VLDB 2023, section 3).
"""
from __future__ import annotations

import numpy

from minidist import backend
from minidist.async_collectives import start
from minidist.collectives import all_gather, all_reduce, reduce_scatter, ring_all_gather_steps
from minidist.nn import Parameter
from minidist.parallel.fsdp.release import GraphRelease
from minidist.parallel.zero.flat import FlatParameter

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")


class FlatUnit:
    """The parameters ``params`` (of ``module``) as one sharded flat vector over ``comm``.

    Args:
        name: the unit's name (its module's dotted prefix, ``transformer.h.0``; ``root``).
        module: the nn.Module whose forward is the unit's.
        params: its Parameters (each once; the tied embedding is one), one dtype.
        comm: the (counting) communicator the vector is cut over; strategy: one of
            SHARDING_STRATEGIES (HYBRID_SHARD: cut as FULL_SHARD over ``comm``, one node's ranks).
        replicate_comm: HYBRID_SHARD's other communicator, the ranks holding the same shard on
            the other nodes; each reduce-scattered shard of the gradient is all-reduced over it.

    Attributes: ``flat`` (the layout), ``shard`` (a Parameter: ``shard_size`` numbers, or the
    whole padded vector under NO_SHARD), ``full`` (the gathered vector, or None when freed),
    ``work`` (a prefetch in flight, or None), ``release`` (a ``release.GraphRelease``),
    ``pending`` (gradients still to arrive in this backward). The parameters' values at
    construction become the shard (the caller makes them equal on every rank first); under
    FULL_SHARD and SHARD_GRAD_OP they are freed at once.
    """

    def __init__(self, name, module, params, comm, strategy, replicate_comm=None):
        self.name, self.module, self.comm, self.strategy = name, module, comm, strategy
        self.replicate_comm = replicate_comm
        self.rank, self.world_size = comm.Get_rank(), comm.Get_size()
        self.flat = FlatParameter(params, 1 if strategy == "NO_SHARD" else self.world_size)
        whole = self.flat.flatten([p.data for p in self.flat.params])
        start_, stop = self.flat.shard_bounds(0 if strategy == "NO_SHARD" else self.rank)
        self.shard = Parameter(whole[start_:stop].copy())
        self.full = self.work = None
        self.pending = len(self.flat.params)
        self.release = GraphRelease()  # FULL_SHARD: the holes in its graph between forward and backward
        if strategy == "NO_SHARD":  # the parameters live in the shard, which is the whole vector
            self._point_at(self.shard.data)
        else:
            self.free()

    @property
    def sharded(self) -> bool:
        """Whether the vector is cut over the ranks (FULL_SHARD, SHARD_GRAD_OP), not whole (NO_SHARD)."""
        return self.strategy != "NO_SHARD"

    def _point_at(self, full):
        self.full = full
        for p, view in zip(self.flat.params, self.flat.views(full)):
            p.data = view

    def gather(self) -> bool:
        """Make the parameters whole (waiting for a prefetch when one is in flight); returns
        whether an all-gather was needed (False: they were whole already)."""
        if self.full is not None:
            return False
        if self.work is not None:
            full, self.work = self.work.wait(), None
        else:
            full = all_gather(self.comm, self.shard.data, validate=False).reshape(-1)
        self._point_at(full)
        return True

    def prefetch(self) -> bool:
        """Start the all-gather without waiting (``async_collectives.start`` of the ring's
        steps); :meth:`gather` waits for it. Returns False when there is nothing to start
        (whole already, or in flight)."""
        if self.full is not None or self.work is not None or not self.sharded:
            return False
        xp = backend.get_array_module(self.shard.data)
        out = xp.empty(self.flat.padded, dtype=self.flat.dtype)
        first, last = self.flat.shard_bounds(self.rank)
        out[first:last] = self.shard.data
        bounds = [self.flat.shard_bounds(r) for r in range(self.world_size)]
        self.work = start(self.comm, lambda tag: ring_all_gather_steps(self.comm, out, bounds, tag), out)
        return True

    def shard_mask(self, selected) -> numpy.ndarray:
        """A boolean NumPy array over this rank's shard (``shard.size``): True where the number
        belongs to a parameter whose entry of ``selected`` (one bool per ``flat.params``) is
        true; False in the padding."""
        whole = numpy.zeros(self.flat.padded, dtype=bool)
        for chosen, lo, hi in zip(selected, self.flat.offsets, self.flat.offsets[1:]):
            whole[lo:hi] = bool(chosen)
        first, last = self.flat.shard_bounds(self.rank if self.sharded else 0)
        return whole[first:last].copy()

    def free(self) -> None:
        """Drop the gathered vector: each parameter's ``data`` becomes an empty array."""
        if not self.sharded:
            return
        xp = backend.get_array_module(self.shard.data)
        for p in self.flat.params:
            p.data = xp.empty((0,), dtype=self.flat.dtype)
        self.full = None

    def reduce(self) -> None:
        """Average the parameters' gradients over the ranks into ``shard.grad`` (added to a
        gradient already there) and clear theirs; free the parameters (sharded strategies).
        HYBRID_SHARD: reduce-scatter over the node, then the shard all-reduced over the replicas
        (the ranks holding it on the other nodes): 2 (N - 1) / N of Ψ / l crosses the network per
        rank, instead of FULL_SHARD's share of 3 (P - 1) / P Ψ."""
        grads = self.flat.flatten([p.grad for p in self.flat.params], like=self.shard.data)
        for p in self.flat.params:
            p.grad = None
        replicas = 1 if self.replicate_comm is None else self.replicate_comm.Get_size()
        if self.sharded:
            mine = reduce_scatter(self.comm, grads, validate=False)
            if replicas > 1:  # HYBRID_SHARD: the same shard's sums on the other nodes
                mine = all_reduce(self.replicate_comm, mine, algorithm="ring", validate=False)
        else:
            mine = all_reduce(self.comm, grads, algorithm="ring", validate=False)
        mine /= self.world_size * replicas
        self.shard.grad = mine if self.shard.grad is None else self.shard.grad + mine
        self.pending = len(self.flat.params)
        self.free()

    def __repr__(self):
        return f"FlatUnit({self.name!r}, {self.strategy}, {self.flat})"
