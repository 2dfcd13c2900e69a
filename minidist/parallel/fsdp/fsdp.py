"""Fully sharded data parallelism (ZeRO-2/3, PyTorch's FSDP): parameters, gradients and
optimizer state each held 1/P per rank, the parameters gathered only while a unit runs.

Data parallelism keeps on every rank what ZeRO (Rajbhandari et al., SC 2020) counts as 16
bytes per parameter in mixed-precision AdamW. ZeRO shards it in stages: the optimizer state
(stage 1, :mod:`minidist.parallel.zero`), the gradients (2) and the parameters (3). FSDP (Zhao
et al., "PyTorch FSDP", VLDB 2023) is stage 3 built on units: the model is cut into units (here
each GPT ``Block``, and the rest of the model, the root; a small MLP is one unit), each unit's
parameters one padded flat vector (:class:`~minidist.parallel.fsdp.unit.FlatUnit`) of which a
rank holds one shard. A step, per unit, with ``sharding_strategy``:

- FULL_SHARD (ZeRO-3): all-gather before the unit's forward, free after it; all-gather again
  before its backward (an identity op on the unit's output, whose backward runs just before
  the unit's), reduce-scatter of its gradients once the last one has arrived
  (post-accumulate-grad hooks, as DDP's buckets), free. 3(P-1)/P Ψ bytes per rank and step.
- SHARD_GRAD_OP (ZeRO-2): all-gather before the forward, keep the parameters until the unit's
  gradients are reduce-scattered: 2(P-1)/P Ψ, DDP's bytes, and gradients and optimizer state
  1/P per rank (the parameters are whole only from a unit's forward to its backward).
- NO_SHARD: the whole vector on every rank, gradients all-reduced: DDP.
- HYBRID_SHARD (torch's name; Zhao et al. 2023 call it hybrid sharding): FULL_SHARD
  inside each node, the nodes replicas of each other. The nodes are ``minidist.node_layout``'s
  (the sim's topology, the machines, or fake nodes of ``MINIDIST_RANKS_PER_NODE``): a unit's
  vector is cut over the l ranks of a node (the all-gathers never leave it), and each
  reduce-scattered gradient shard is all-reduced over the N ranks holding it on the other
  nodes. Per rank and step 3(l-1)/l Ψ stays in the node and 2(N-1)/N Ψ/l crosses the network,
  where FULL_SHARD over all P ranks sends most of its 3(P-1)/P Ψ across; the price is memory, a
  shard of 1/l instead of 1/P. (torch builds the same two groups, intra- and inter-node, in
  ``torch/distributed/fsdp/_init_utils.py``, ``_init_intra_and_inter_node_groups``.)

Forward prefetch: the units run in the same order at every step, so the order of the last
forward is recorded and, as unit i starts, the all-gather of the unit after it is started
without waiting (``async_collectives.start`` of the ring's steps), to be waited for when that
unit starts: its messages move while unit i computes (on the sim, whose sends are buffered, and
under MPI as far as the progress calls allow: ``minidist.async_collectives``). Each prefetch
is noted in ``prefetch_order``; each all-gather in ``gathers`` ((phase, unit): phase
"forward", "backward" or "prefetch"). PyTorch also prefetches in backward; this engine does
not (its backward all-gathers are blocking).

Where PyTorch differs: its root unit is not freed after forward (it is needed first in
backward); here every unit is, so FULL_SHARD costs 3(P-1)/P Ψ exactly. Memory: a freed unit's
parameters point at empty arrays, and the arrays its ops saved for backward that view the
gathered vector are swapped for holes until the unit's backward gathers it again
(:mod:`~minidist.parallel.fsdp.release`; PyTorch resizes the storage to 0), so the vector is
really freed between a unit's forward and its backward.
"""
from __future__ import annotations

import math
from collections import OrderedDict

from minidist import backend
from minidist.collectives import all_reduce, broadcast
from minidist.models.gpt import Block
from minidist.node_layout import node_layout
from minidist.p2p import agree
from minidist.parallel.fsdp.unit import SHARDING_STRATEGIES, FlatUnit
from minidist.parallel.zero.flat import FlatParameter
from minidist.tensor import Function, Tensor, is_grad_enabled, no_grad, queue_callback
from minidist.tracing import CountingComm


class PreBackward(Function):
    """Identity in forward; in backward, before passing the gradient on, tell ``unit``'s
    owner that the unit's backward is next (FULL_SHARD all-gathers its parameters there).
    Torch registers a hook on the unit's output tensors for the same moment."""

    @staticmethod
    def forward(ctx, x, owner=None, unit=None):
        ctx.owner, ctx.unit = owner, unit
        return x

    @staticmethod
    def backward(ctx, grad):
        ctx.owner.pre_backward(ctx.unit)
        return grad


def common_prefix(names) -> str:
    """The dotted prefix all ``names`` share (``transformer.h.0`` of its parameters' names)."""
    parts = [n.split(".")[:-1] for n in names]
    prefix = []
    for column in zip(*parts):
        if len(set(column)) > 1:
            break
        prefix.append(column[0])
    return ".".join(prefix)


class FullyShardedDataParallel:
    """Shard ``module`` over the ranks of ``comm`` (**contract**, as
    ``torch.distributed.fsdp.FullyShardedDataParallel``; module docstring).

    Args:
        module: an nn.Module of one dtype, the same architecture on every rank; rank 0's
            parameters are broadcast (torch's ``sync_module_states=True``).
        comm: a communicator with mpi4py's methods.
        sharding_strategy: "FULL_SHARD" (ZeRO-3), "SHARD_GRAD_OP" (ZeRO-2), "NO_SHARD" (DDP) or
            "HYBRID_SHARD" (FULL_SHARD in each node of ``comm``, replicas across the nodes:
            ``shard_comm`` and ``replicate_comm`` are the two groups, counted apart).
        auto_wrap_policy: a tuple of module classes each instance of which is a unit (torch's
            ``ModuleWrapPolicy``); default: the GPT's ``Block``. The rest of the model is the root.
        forward_prefetch: start the next unit's all-gather as a unit starts (default True).

    Use: ``out = fsdp(x)`` (collective), ``loss.backward()`` leaves each unit's averaged
    gradient shard in ``.grad`` of ``fsdp.parameters()`` (this rank's shards, one Parameter per
    unit, root first: hand them to any optimizer); :meth:`clip_grad_norm_` clips over the whole
    model; :meth:`full_state_dict` (collective) gives the module's own names and shapes;
    ``state_dict``/``load_state_dict`` this rank's shards (a checkpoint gathers every rank's).
    ``traffic`` (a CountingComm) counts every byte sent; ``units``; ``gathers``;
    ``prefetch_order``.

    Raises (on every rank, one agreement round): ValueError for an unknown strategy (naming
    them), a module without parameters, several dtypes, or ranks that disagree on the
    parameters or the strategy; RuntimeError at the next forward when a backward left a unit
    without gradients (a parameter not used in the loss).
    """

    def __init__(self, module, comm, sharding_strategy="FULL_SHARD", auto_wrap_policy=None, forward_prefetch=True):
        named = list(module.named_parameters()) if hasattr(module, "named_parameters") else []
        problem = None
        if sharding_strategy not in SHARDING_STRATEGIES:
            problem = (f"unknown sharding_strategy {sharding_strategy!r}; use one of "
                       f"{', '.join(SHARDING_STRATEGIES)}")
        elif not named:
            problem = f"the module ({type(module).__name__}) has no parameters to shard"
        elif len({str(p.dtype) for _, p in named}) > 1:
            problem = "the parameters have several dtypes; one flat vector per unit holds one dtype"
        signature = (sharding_strategy, [(n, tuple(p.shape), str(p.dtype)) for n, p in named])

        def raise_error(their_problem, rank, size):
            raise ValueError(f"FullyShardedDataParallel: {their_problem} (on rank {rank} of {size})")

        for rank, theirs in enumerate(agree(comm, problem, signature, raise_problem=raise_error)):
            if theirs != signature:
                raise ValueError("FullyShardedDataParallel: the ranks disagree on the model or the sharding "
                                 f"strategy (rank {comm.Get_rank()} and rank {rank} differ); every rank must wrap "
                                 "the same architecture with the same sharding_strategy")
        self.module, self.sharding_strategy, self.forward_prefetch = module, sharding_strategy, forward_prefetch
        self.traffic = comm if isinstance(comm, CountingComm) else CountingComm(comm, keep_messages=False)
        self.rank, self.world_size = comm.Get_rank(), comm.Get_size()
        self.shard_comm, self.replicate_comm = self.traffic, None  # what a unit is cut over; HYBRID's replicas
        if sharding_strategy == "HYBRID_SHARD":  # the caller's communicator: its nodes (fake ones set on it too)
            nodes = node_layout(comm)
            self.shard_comm, self.replicate_comm = (CountingComm(group, allow_collectives=True, keep_messages=False)
                                                    for group in (nodes.node_comm, nodes.cross_comm))
        self.reshard_after_forward = sharding_strategy in ("FULL_SHARD", "HYBRID_SHARD")
        self.units = self._make_units(module, named, tuple(auto_wrap_policy or (Block,)))
        self._by_name = {u.name: u for u in self.units}
        self.gathers, self.prefetch_order = [], []
        self._order, self._last_order, self._depth = [], [], 0
        self._callback_queued, self._unreduced = False, []
        self._cut_masks = {}  # unit name -> which numbers of its shard are cut over tp (clip_grad_norm_)
        for unit in self.units:
            for p in unit.flat.params:
                p.register_post_accumulate_grad_hook(lambda p, unit=unit: self._grad_ready(unit))
        self._install(module)

    def _make_units(self, module, named, classes):
        names = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        self.names = names
        wrapped = [m for m in module.modules() if m is not module and isinstance(m, classes)]
        taken, groups = set(), []
        for m in wrapped:
            params = [p for p in m.parameters() if id(p) not in taken]
            if params:
                taken.update(id(p) for p in params)
                groups.append((common_prefix([names[id(p)][0] for p in params]), m, params))
        rest = [p for _, p in named if id(p) not in taken]
        if rest:
            groups.insert(0, ("root", module, rest))
        units = []
        for name, m, params in groups:
            with no_grad():  # the same start on every rank: rank 0's values
                flat = FlatParameter(params, 1)
                whole = broadcast(self.traffic, flat.flatten([p.data for p in params]), root=0, validate=False)
                for p, view in zip(params, flat.views(whole)):
                    p.data = view.copy()
            units.append(FlatUnit(name, m, params, self.shard_comm, self.sharding_strategy, self.replicate_comm))
        self.broadcast_bytes = self.traffic.nbytes
        return units

    def _install(self, module):
        for unit in self.units:
            forward = unit.module.forward

            def run(*inputs, unit=unit, forward=forward, **kwargs):
                self._pre_forward(unit)
                out = forward(*inputs, **kwargs)
                return self._post_forward(unit, out)

            object.__setattr__(unit.module, "forward", run)

    # -------------------------------------------------------------- forward
    def __call__(self, *inputs, **kwargs):
        """``forward``: collective (every rank must call it, with its own batch)."""
        return self.forward(*inputs, **kwargs)

    def forward(self, *inputs, **kwargs):
        """Run the wrapped module (each unit gathering its parameters as it starts)."""
        if self._unreduced:
            missing, self._unreduced = self._unreduced, []
            raise RuntimeError(f"FullyShardedDataParallel: the previous backward left units {missing} without all "
                               "their gradients (a parameter not used in the loss), so they were never "
                               "reduce-scattered; use every parameter, or leave it out of the module")
        return self.module(*inputs, **kwargs)

    def _pre_forward(self, unit):
        self._depth += 1
        position = len(self._order)
        self._order.append(unit.name)
        if unit.gather():
            self.gathers.append(("forward", unit.name))
        if self.reshard_after_forward and is_grad_enabled():
            unit.release.start()  # note the ops it records, to let its gathered vector go after (release.py)
        if self.forward_prefetch and self._last_order[position:position + 1] == [unit.name]:
            for name in self._last_order[position + 1:position + 2]:
                if self._by_name[name].prefetch():
                    self.gathers.append(("prefetch", name))
                    self.prefetch_order.append(name)

    def _post_forward(self, unit, out):
        self._depth -= 1
        if self._depth == 0:  # the outermost unit ended: this forward's order is the next one's guide
            self._last_order, self._order = self._order, []
        training = is_grad_enabled()
        if self.reshard_after_forward and training:
            unit.release.stop()
            unit.release.punch(unit.full)
        if self.reshard_after_forward or not training:
            unit.free()
        if not training:
            return out
        if isinstance(out, tuple):
            return tuple(self._mark(o, unit) for o in out)
        return self._mark(out, unit)

    def _mark(self, out, unit):
        if isinstance(out, Tensor) and out.requires_grad:
            return PreBackward.apply(out, owner=self, unit=unit)
        return out

    # -------------------------------------------------------------- backward
    def pre_backward(self, unit):
        """Called just before ``unit``'s backward (:class:`PreBackward`): gather its parameters
        again if they were freed (FULL_SHARD)."""
        if unit.gather():
            self.gathers.append(("backward", unit.name))
            unit.release.fill(unit.full)
        self._queue_check()

    def _queue_check(self):
        if not self._callback_queued:
            queue_callback(self._backward_done)
            self._callback_queued = True

    def _grad_ready(self, unit):
        self._queue_check()
        unit.pending -= 1
        if unit.pending == 0:
            unit.reduce()

    def _backward_done(self):
        self._callback_queued = False
        self._unreduced = [u.name for u in self.units if u.pending != len(u.flat.params)]
        for unit in self.units:
            unit.pending = len(unit.flat.params)

    # -------------------------------------------------------------- this rank's shards
    def parameters(self) -> list:
        """This rank's shards, one flat Parameter per unit (root first): what an optimizer steps."""
        return [unit.shard for unit in self.units]

    def named_parameters(self, prefix: str = ""):
        """``(f"{unit}.flat_param", shard)`` per unit (the keys of :meth:`state_dict`)."""
        return [(f"{prefix}{unit.name}.flat_param", unit.shard) for unit in self.units]

    def zero_grad(self):
        """Clear the shards' gradients (and any left on the module's parameters)."""
        for unit in self.units:
            unit.shard.grad = None
            for p in unit.flat.params:
                p.grad = None

    @no_grad()
    def clip_grad_norm_(self, max_norm: float, tp_comm=None, is_cut=None) -> float:
        """Clip the whole model's gradient norm to ``max_norm`` (``nn.utils.clip_grad_norm_``'s
        rule and factor, max_norm / (total + 1e-6)), the shards' squares summed over the ranks
        (one all-reduce of one number; none under NO_SHARD, whose shards are whole). Returns the
        total norm before clipping. Collective. Raises ValueError for max_norm <= 0.

        With ``tp_comm`` (the wrapped module is one tensor-parallel rank's part of a model, as
        ``parallel.fsdp.compose`` builds it): the numbers of the parameters ``is_cut(name)`` says
        are cut over ``tp_comm`` (``tensor_parallel.is_sharded``) and the others (whole on every
        tp rank) are summed apart, both over this group (one all-reduce of two numbers), then
        the cut ones over ``tp_comm`` and the whole ones taken from tp rank 0 (one all-reduce of
        two numbers): each parameter counted once, and every rank of the job gets the same norm
        to the last bit (a whole parameter must get the same update on every tp rank)."""
        if not max_norm > 0:
            raise ValueError(f"clip_grad_norm_: max_norm must be > 0, got {max_norm}")
        grads = [u.shard.grad for u in self.units if u.shard.grad is not None]
        xp = backend.get_array_module(self.units[0].shard.data)
        if tp_comm is None:
            local = xp.asarray([sum(float((g.astype("float64") ** 2).sum()) for g in grads)], dtype="float64")
        else:
            local = xp.asarray(self._squares_by_kind(is_cut), dtype="float64")  # [cut over tp, whole]
        if self.sharding_strategy != "NO_SHARD":  # HYBRID_SHARD: one node's shards are the whole model
            local = all_reduce(self.shard_comm, local, algorithm="ring", validate=False)
        if tp_comm is not None:
            if tp_comm.Get_rank() != 0:
                local[1] = 0.0  # the whole parameters' squares: tp rank 0's, added once
            local = all_reduce(tp_comm, local, algorithm="ring", validate=False)
        total = math.sqrt(float(local.sum()))
        factor = max_norm / (total + 1e-6)
        if factor < 1:
            for g in grads:
                g *= factor
        return total

    def _squares_by_kind(self, is_cut) -> list[float]:
        """[sum over this rank's shards of the squared gradients (float64) of the numbers that
        belong to parameters ``is_cut(name)`` selects, the same of the others] (padding adds 0)."""
        totals = [0.0, 0.0]
        for unit in self.units:
            if unit.shard.grad is None:
                continue
            if unit.name not in self._cut_masks:
                self._cut_masks[unit.name] = backend.to_device(unit.shard_mask(
                    [is_cut(self.names[id(p)][0]) for p in unit.flat.params]), unit.shard.device)
            mask, squares = self._cut_masks[unit.name], unit.shard.grad.astype("float64") ** 2
            totals[0] += float(squares[mask].sum())
            totals[1] += float(squares[~mask].sum())
        return totals

    def state_dict(self) -> OrderedDict:
        """This rank's shards by :meth:`named_parameters`' names (copies): a checkpoint's part."""
        return OrderedDict((name, shard.data.copy()) for name, shard in self.named_parameters())

    def load_state_dict(self, state) -> None:
        """Restore what :meth:`state_dict` saved on this rank (in place). Raises KeyError for
        missing or unexpected names, ValueError for a shard of another size (another number of
        ranks)."""
        own = dict(self.named_parameters())
        if set(own) != set(state):
            raise KeyError(f"load_state_dict: missing keys {sorted(set(own) - set(state))}, unexpected keys "
                           f"{sorted(set(state) - set(own))}")
        for name, shard in own.items():
            if tuple(state[name].shape) != shard.shape:
                raise ValueError(f"load_state_dict: {name} has shape {tuple(state[name].shape)} in the state, "
                                 f"{shard.shape} on this rank (saved on another number of ranks?)")
            shard.data[...] = backend.to_device(state[name], shard.device)

    @no_grad()
    def full_state_dict(self) -> OrderedDict:
        """The wrapped module's ``state_dict`` (its own names and shapes, a tied parameter under
        each of its names: loadable into the dense module), gathered unit by unit. Collective."""
        out = {}
        for unit in self.units:
            was_whole = unit.full is not None
            unit.gather()
            for p in unit.flat.params:
                for name in self.names[id(p)]:
                    out[name] = p.data.copy()
            if not was_whole:
                unit.free()
        return OrderedDict((name, out[name]) for name, _ in self.module.named_parameters(remove_duplicate=False))

    # -------------------------------------------------------------- passthroughs
    @property
    def training(self) -> bool:
        """The wrapped module's training flag."""
        return self.module.training

    def train(self, mode: bool = True):
        """Set the wrapped module's training mode (dropout); returns self."""
        self.module.train(mode)
        return self

    def eval(self):
        """``train(False)``: the forward without dropout (still collective)."""
        return self.train(False)

    def modules(self):
        """The wrapped module's modules (a checkpoint saves their random generators)."""
        return self.module.modules()

    def __repr__(self):
        units = ", ".join(f"{u.name} ({u.flat.numel} -> {u.shard.size})" for u in self.units)
        return (f"FullyShardedDataParallel(rank {self.rank} of {self.world_size}, {self.sharding_strategy}, "
                f"units: {units})")
