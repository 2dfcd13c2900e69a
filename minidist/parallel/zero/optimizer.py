"""ZeRO stage 1: each rank keeps the optimizer state of one shard of the parameters.

With data parallelism every rank holds the same parameters, the same averaged gradients and
so would compute the same optimizer step: P copies of the optimizer's state (SGD's momentum,
AdamW's two moments: 8 bytes per fp32 parameter, 12 with fp32 master weights) for one result.
ZeRO's first stage (Rajbhandari et al., SC 2020, section 5.1; PyTorch's
``torch.distributed.optim.ZeroRedundancyOptimizer``) splits that work: rank r updates only
shard r of the parameters and keeps the state of that shard alone, then every rank gets the
updated shards of the others::

    flat gradient g (padded, already averaged by DDP's all-reduce), rank r's shard g_r
    the wrapped optimizer steps shard r:  w_r <- step(w_r, g_r, state_r)      (state: 1/P of it)
    all-gather the shards:                 w = [w_0, ..., w_{P-1}] on every rank

The shards are equal (:class:`~minidist.parallel.zero.flat.FlatParameter` pads the vector to a
multiple of P), so any world size works. Bytes per step and rank with ring collectives, Ψ the
padded vector's bytes: after DDP's all-reduce (2Ψ(P-1)/P, torch's way) the all-gather adds
Ψ(P-1)/P, 3Ψ(P-1)/P in all. But a rank needs only its shard's average, so the paper's ZeRO-1
costs 2Ψ: with ``reduce_gradients=True`` the optimizer reduce-scatters the local gradients
itself (run the backward inside ``ddp.no_sync()``, or without DDP) and the step sends a
reduce-scatter and an all-gather, Ψ(P-1)/P each -- one all-reduce's bytes, cut in two by the
update (chapter 04: a ring all-reduce *is* a reduce-scatter then an all-gather).

An elementwise optimizer (SGD, Adam, AdamW) computes on the shard exactly what it computes on
the whole, number by number, so P ranks follow one process to rounding (bitwise, in fact).
"""
from __future__ import annotations

import inspect
import math

from minidist import backend
from minidist.collectives import all_gather, all_reduce, reduce_scatter
from minidist.nn import Parameter, clip_grad_norm_
from minidist.p2p import agree
from minidist.parallel.zero.flat import FlatParameter
from minidist.tensor import Tensor, no_grad


def optimizer_defaults(optimizer) -> dict:
    """The hyperparameters an optimizer was built with, by its constructor's argument names
    (``SGD``: lr, momentum, weight_decay, nesterov; ``Adam``/``AdamW``: lr, betas, eps,
    weight_decay), read from its attributes: ``ZeroRedundancyOptimizer(params,
    type(optimizer), comm, **optimizer_defaults(optimizer))`` builds the sharded twin of an
    optimizer a workload made."""
    names = [n for n in inspect.signature(type(optimizer).__init__).parameters if n not in ("self", "params")]
    return {n: getattr(optimizer, n) for n in names if hasattr(optimizer, n)}


class ZeroRedundancyOptimizer:
    """Wrap ``optimizer_class`` so that this rank keeps the state of its shard only (ZeRO-1,
    **contract**, as ``torch.distributed.optim.ZeroRedundancyOptimizer``).

    Args:
        params: the model's parameters (``ddp.parameters()``), Tensors with requires_grad, one
            dtype, the same names and shapes on every rank (DDP makes them equal).
        optimizer_class: an elementwise optimizer class (``minidist.optim.SGD``, ``Adam``,
            ``AdamW``), built here on this rank's shard, a flat Parameter of ``padded / P``
            numbers.
        comm: a communicator with mpi4py's methods (``MPI.COMM_WORLD``, a sim rank's comm, a
            ``tracing.CountingComm``).
        reduce_gradients: False (torch's): the gradients are averaged already (DDP); True: they
            are this rank's own, and :meth:`step` (or :meth:`clip_grad_norm_` first)
            reduce-scatters them, keeping this rank's shard of their average (2Ψ per step).
        **defaults: the wrapped optimizer's hyperparameters (``lr=``, ``weight_decay=``, ...).

    ``step()`` reads the parameters' gradients (averaged by DDP: call it after backward),
    steps the shard, all-gathers the shards into every parameter in place (collective: every
    rank calls it). A parameter whose ``.grad`` is None counts as a zero gradient (torch's
    optimizers skip it). ``lr`` reads and sets the wrapped optimizer's (schedules),
    ``params`` is the full list (for ``nn.utils.clip_grad_norm_`` on DDP's averaged gradients),
    ``optim`` the wrapped optimizer, ``flat`` the layout, ``shard`` this rank's Parameter,
    ``zero_grad()`` clears the parameters' gradients. ``state_dict()`` is *this rank's* state
    (the wrapped optimizer's, of the shard; torch consolidates to one rank instead), so a
    checkpoint gathers every rank's (``fault.Checkpointer(..., gathered=True)``) and resumes
    on the same number of ranks, or on another one with ``train --global-batch-size``, where
    ``minidist.resharding`` cuts the saved moments again; ``load_state_dict`` restores it. The shard is read from
    the parameters at each step, so loading the model's weights is seen.

    Raises (every rank, one agreement round): ValueError for no parameters, several dtypes,
    or ranks that disagree on the parameters' shapes and dtypes or on ``optimizer_class``;
    TypeError for a parameter that is not a Tensor with requires_grad; what
    ``optimizer_class`` raises for bad hyperparameters (on the rank that has them).
    """

    def __init__(self, params, optimizer_class, comm, *, reduce_gradients=False, **defaults):
        self.params, self.reduce_gradients = list(params), reduce_gradients
        problem = None
        if not self.params:
            problem = "got no parameters; pass model.parameters()"
        elif not all(isinstance(p, Tensor) and p.requires_grad for p in self.params):
            problem = "every parameter must be a Tensor with requires_grad=True"
        signature = ([(tuple(p.shape), str(p.dtype)) for p in self.params if isinstance(p, Tensor)],
                     getattr(optimizer_class, "__qualname__", repr(optimizer_class)), bool(reduce_gradients))

        def raise_error(their_problem, rank, size):
            kind = TypeError if "Tensor" in their_problem else ValueError
            raise kind(f"ZeroRedundancyOptimizer: {their_problem} (on rank {rank} of {size})")

        signatures = agree(comm, problem, signature, raise_problem=raise_error)
        for rank, theirs in enumerate(signatures):
            if theirs != signatures[0]:
                raise ValueError("ZeroRedundancyOptimizer: the ranks disagree on the parameters' shapes and dtypes "
                                 f"or the optimizer class (rank 0 and rank {rank} differ); every rank must wrap the "
                                 "same model with the same optimizer_class")
        self.comm, self.rank, self.world_size = comm, comm.Get_rank(), comm.Get_size()
        self.flat = FlatParameter(self.params, self.world_size)
        self.start, self.stop = self.flat.shard_bounds(self.rank)
        whole = self.flat.flatten([p.data for p in self.params])
        self.shard = Parameter(whole[self.start:self.stop].copy())
        self.optim = optimizer_class([self.shard], **defaults)
        self.reduced = False  # reduce_gradients: this step's gradients already reduce-scattered into shard.grad

    @property
    def lr(self) -> float:
        """The wrapped optimizer's learning rate (schedules read and set it)."""
        return self.optim.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.optim.lr = value

    def shard_gradient(self):
        """This rank's shard of the averaged gradient into ``shard.grad`` (once per step; later
        calls in the same step do nothing): with ``reduce_gradients`` a reduce-scatter of every
        rank's gradients, divided by the number of ranks (collective); without it this rank's
        slice of the (already averaged) gradients. :meth:`step` and :meth:`clip_grad_norm_` call
        it; a caller that clips its own way (the 3-D driver, over tp and pp too) calls it first."""
        if self.reduced:
            return
        grads = self.flat.flatten([p.grad for p in self.params])
        if self.reduce_gradients:  # sum over the ranks, this rank's shard only: Ψ(P-1)/P bytes
            grads = reduce_scatter(self.comm, grads, validate=False)
            grads /= self.world_size
            self.shard.grad = grads
        else:
            self.shard.grad = grads[self.start:self.stop].copy()
        self.reduced = True

    @no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the averaged gradient's global norm to ``max_norm`` (``nn.utils.clip_grad_norm_``'s
        rule) and return the norm before clipping. Without ``reduce_gradients`` it is
        ``nn.utils.clip_grad_norm_(self.params, max_norm)``; with it the shards' squares are
        summed over the ranks (one all-reduce of one number) and the shard's gradient scaled.
        Collective with ``reduce_gradients``. Raises ValueError for max_norm <= 0."""
        if not self.reduce_gradients:
            return clip_grad_norm_(self.params, max_norm)
        if not max_norm > 0:
            raise ValueError(f"clip_grad_norm_: max_norm must be > 0, got {max_norm}")
        self.shard_gradient()
        xp = backend.get_array_module(self.shard.grad)
        squares = xp.asarray([float((self.shard.grad.astype("float64") ** 2).sum())], dtype="float64")
        total = math.sqrt(float(all_reduce(self.comm, squares, algorithm="ring", validate=False)[0]))
        factor = max_norm / (total + 1e-6)
        if factor < 1:
            self.shard.grad *= factor
        return total

    @no_grad()
    def step(self):
        """Step this rank's shard with its slice of the (averaged) gradients, then all-gather
        every rank's updated shard into the parameters (in place). Collective."""
        self.shard_gradient()
        self.shard.data[...] = self.flat.flatten([p.data for p in self.params])[self.start:self.stop]
        self.optim.step()
        self.shard.grad, self.reduced = None, False
        whole = all_gather(self.comm, self.shard.data, validate=False).reshape(-1)
        for p, view in zip(self.params, self.flat.views(whole)):
            p.data[...] = view

    def zero_grad(self):
        """Clear the parameters' gradients (set to None)."""
        for p in self.params:
            p.grad = None
        self.shard.grad, self.reduced = None, False

    def state_dict(self) -> dict:
        """This rank's optimizer state: the wrapped optimizer's ``state_dict`` of its shard
        (copies; lr, step counts, moments of ``shard_size`` numbers)."""
        return self.optim.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved on this rank (the same world size). Raises
        ValueError when the moments do not have this rank's shard size."""
        for key in ("exp_avg", "exp_avg_sq", "velocity"):
            for buffer in state.get(key, None) or []:
                if buffer is not None and tuple(buffer.shape) != (self.flat.shard_size,):
                    raise ValueError(f"ZeroRedundancyOptimizer.load_state_dict: {key} holds {tuple(buffer.shape)}, "
                                     f"this rank's shard is ({self.flat.shard_size},) (another number of ranks?)")
        self.optim.load_state_dict(state)

    def __repr__(self):
        return (f"ZeroRedundancyOptimizer(rank {self.rank} of {self.world_size}, {type(self.optim).__name__}, "
                f"shard {self.start}:{self.stop} of {self.flat.padded})")


def apply_zero(params, optimizer, dp_comm, reduce_gradients: bool = True) -> ZeroRedundancyOptimizer:
    """The ZeRO-1 step of a composition: ``optimizer`` (built by a workload over ``params``)
    replaced by its sharded twin over ``dp_comm``, each rank keeping the state of 1/D of the
    padded flat vector (``reduce_gradients``: it reduce-scatters the gradients itself, DDP's
    all-reduce skipped). The optimizer given is only read for its class and hyperparameters
    (:func:`optimizer_defaults`). Source: Rajbhandari et al., SC 2020, section 5.1."""
    return ZeroRedundancyOptimizer(params, type(optimizer), dp_comm, reduce_gradients=reduce_gradients,
                                   **optimizer_defaults(optimizer))
