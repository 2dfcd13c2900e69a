"""Local SGD and DiLoCo: replicas that train alone for H steps, then average what they learned.

Data parallelism (chapter 05) all-reduces the gradients at every step: 2 (M-1)/M n bytes per
replica and step on M replicas of n bytes of parameters, over whatever links join them. Across
two data centres that link is a WAN, a hundred times slower than the network inside one. Local
SGD (Stich, "Local SGD Converges Fast and Communicates Little", 2019; Lin et al. 2020; FedAvg,
McMahan et al. 2017) lets each replica take H optimizer steps on its own data and only then
averages the *weights*. DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training
of Language Models", 2023, Algorithm 1) adds an optimizer on the outside:

    theta  (the global weights, the same on every replica), one outer optimizer state
    repeat:
        every replica i:  theta_i = theta; H steps of the inner optimizer (AdamW) on its own data
        pseudo-gradient:  Delta = theta - mean_i(theta_i)          (one all-reduce of n values)
        outer step:       theta = OuterOpt(theta, Delta)           (SGD, Nesterov momentum 0.9, lr 0.7)

Delta points where a gradient would (the replicas moved theta downhill, so theta minus where
they got is uphill), so the outer optimizer treats it as a gradient. With outer SGD at lr 1
and no momentum the step is theta - (theta - mean theta_i) = mean theta_i: plain local SGD,
parameter averaging; and with H = 1 and an inner SGD without momentum, mean theta_i = theta -
lr mean g_i, which is DDP's step (tests/test_local_sgd.py checks both to 1e-12). The paper's 8
replicas match synchronous training with 500 times fewer bytes (H = 500); OpenDiLoCo (Jaghouar
et al., "OpenDiLoCo", 2024) ran it on two continents at 90-95 % compute utilisation.

Cost per replica: one all-reduce of n values every H steps, 2 (M-1)/M n / H bytes a step (DDP's
divided by H), plus the memory of two more copies of the weights (theta and the outer momentum).
Streaming DiLoCo (``fragments``): the same bytes, spread over the H steps (``fragments.py``);
not written here: its overlap of a fragment's all-reduce with the next inner steps (tau > 0, the
outer step applied late and mixed into the local weights with alpha).
The pseudo-gradients may be compressed by DDP's communication hooks (fp16, bf16, int8 with
error feedback, top-k: ``data_parallel.comm_hooks``) or in 4-bit floats (``fp4.py``), as the
Streaming DiLoCo paper does.

The all-reduce runs over the replicas that are there (``replicas.py``): a quorum at every sync
point, a replica that died dropped within the deadline, a joiner healed from a peer. The ring
all-reduce hands every member the same bytes and every member applies the same outer step, so
the replicas' theta and outer momentum stay bit-identical. torchft's ``DiLoCo`` and
``_StreamingDiLoCoFragment`` (``torchft/local_sgd.py``) keep the same three copies (the global
weights as a backup, the local ones, the outer optimizer on the pseudo-gradient).
"""
from __future__ import annotations

import numpy

from minidist import collectives, optim
from minidist.parallel.data_parallel import comm_hooks
from minidist.parallel.local_sgd.fp4 import fp4_hook
from minidist.parallel.local_sgd.fragments import check_schedule, due_fragments, split_parameters
from minidist.parallel.local_sgd.replicas import ReplicaSet
from minidist.tensor import Tensor


def flatten(params) -> numpy.ndarray:
    """The parameters' values as one new 1-D array (their dtype), in order."""
    return numpy.concatenate([numpy.ravel(p.data) for p in params])


def unflatten(flat, params) -> None:
    """Copy ``flat`` (as :func:`flatten` made it) into the parameters' ``.data``, in place."""
    at = 0
    for p in params:
        p.data[...] = flat[at:at + p.data.size].reshape(p.data.shape)
        at += p.data.size


class DiLoCo:
    """DiLoCo (and Streaming DiLoCo with ``fragments`` > 1) around a model's inner optimizer.

    Call :meth:`step` after every inner ``optimizer.step()``: after inner step t it syncs the
    fragments due at t (every fragment at t % H == 0 when ``fragments`` is 1; module docstring).

    params: the model's parameters (Tensors; the model on this rank, or the module a DDP inside
    a replica group wraps: its ranks hold the same values). replicas: a :class:`ReplicaSet` or a
    communicator (one rank per replica: the world, or a mesh's ``dp`` group). sync_every: H >= 1.
    outer_lr (> 0), outer_momentum (in [0, 1)), nesterov (needs momentum > 0; ignored without):
    the outer ``optim.SGD``. fragments: F in 1..H (``fragments.py``). comm_hook: a
    ``data_parallel.comm_hooks`` name for the pseudo-gradients ("none": float all-reduce), or
    "fp4" (``fp4.py``: 4-bit floats with error feedback).
    fingerprint: what a joiner must match besides the parameters' shapes and the hyperparameters
    (e.g. the run's config fields). join: this rank is a spare or restarted replica: instead of
    agreeing on the initial weights (a broadcast from the lowest member), it asks to join and
    takes the state of a healthy peer at the next sync point.

    State, bit-identical on every replica after a sync: ``global_params`` (one flat Tensor per
    fragment), the outer optimizers' momentum, ``syncs`` (sync points so far) and
    ``inner_steps``. ``synced``: (inner step, fragment, members) of every sync, for traces.
    Raises ValueError for bad hyperparameters or fragments; ReplicaRefused on a joiner whose
    fingerprint differs."""

    def __init__(self, params, replicas, sync_every: int, *, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True, fragments: int = 1, comm_hook: str = "none", fingerprint=None,
                 join: bool = False):
        self.params = list(params)
        check_schedule(fragments, sync_every)
        self.replicas = replicas if isinstance(replicas, ReplicaSet) else ReplicaSet(replicas)
        self.rank, self.sync_every = self.replicas.rank, sync_every
        self.fragments = split_parameters(self.params, fragments)
        self.global_params = [Tensor(flatten(f), requires_grad=True) for f in self.fragments]
        nesterov = bool(nesterov and outer_momentum > 0)
        self.outer = [optim.SGD([g], lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)
                      for g in self.global_params]
        self.hook_state, self.hook = fp4_hook() if comm_hook == "fp4" else comm_hooks.comm_hook(comm_hook)
        self.inner_steps = self.syncs = 0
        self.synced = []
        self.fingerprint = {
            "parameters": repr([(tuple(p.data.shape), str(p.data.dtype)) for p in self.params]),
            "sync_every": sync_every, "outer_lr": outer_lr, "outer_momentum": outer_momentum,
            "nesterov": nesterov, "fragments": fragments, "comm_hook": comm_hook, **(fingerprint or {})}
        if join:
            self.join()
        else:
            self._agree_on_initial_weights()

    def _agree_on_initial_weights(self):
        group = self.replicas.group(self.replicas.members)
        for flat, fragment in zip(self.global_params, self.fragments):
            flat.data = collectives.broadcast(group, flat.data, root=0)
            unflatten(flat.data, fragment)

    # -- the outer loop ----------------------------------------------------------------------

    def step(self) -> list[int]:
        """Count one inner step; sync the fragments due after it. Returns their indices."""
        self.inner_steps += 1
        due = due_fragments(self.inner_steps, len(self.fragments), self.sync_every)
        for f in due:
            self.sync(f)
        return due

    def sync(self, f: int):
        """One sync point of fragment ``f`` (collective over the live replicas): the quorum, the
        all-reduce of the pseudo-gradient over its members, the outer step, the fragment's
        local weights set to the new global ones, and the state sent to the quorum's receivers
        (by its donor). Returns the ``replicas.Quorum``."""
        quorum = self.replicas.quorum(self.syncs, self.fingerprint)
        if self.rank in quorum.members:
            theta = self.global_params[f]
            delta = theta.data - flatten(self.fragments[f])  # Delta = theta - theta_i; averaged below
            theta.grad = self._average(delta, f, quorum.members)
            self.outer[f].step()
            theta.grad = None
            unflatten(theta.data, self.fragments[f])
            self.syncs = quorum.step + 1
            self.synced.append((self.inner_steps, f, quorum.members))
        if self.rank == quorum.donor and quorum.receivers:
            self.replicas.send_state(self.state_arrays(), quorum.receivers)
        if self.rank in quorum.receivers:
            self.load_state_arrays(self.replicas.receive_state(self.state_arrays(), quorum.donor))
        return quorum

    def _average(self, delta, f, members):
        """mean over ``members`` of their Delta, through the comm hook (a ring all-reduce by
        default, so every member gets the same bytes). One member: its own Delta."""
        if len(members) == 1:
            return delta
        bucket = comm_hooks.GradBucket(f, delta, [], [0], True, self.replicas.group(members), algorithm="ring")
        return self.hook(self.hook_state, bucket).wait()

    def join(self):
        """Ask to join (``ReplicaSet.join``) and take the state a healthy peer sends."""
        quorum = self.replicas.join(self.fingerprint)
        self.load_state_arrays(self.replicas.receive_state(self.state_arrays(), quorum.donor))
        return quorum

    # -- the state a joiner receives -------------------------------------------------------

    def state_arrays(self) -> list:
        """The replicas' shared state as arrays, in a fixed order: each fragment's global weights,
        each fragment's outer momentum (zeros before the first outer step), and int64
        [inner_steps, syncs, outer steps of each fragment]."""
        momentum = [o.velocity[0] if o.velocity[0] is not None else numpy.zeros_like(g.data)
                    for o, g in zip(self.outer, self.global_params)]
        counts = numpy.array([self.inner_steps, self.syncs, *(o.steps for o in self.outer)], numpy.int64)
        return [g.data for g in self.global_params] + momentum + [counts]

    def load_state_arrays(self, arrays) -> None:
        """Install a :meth:`state_arrays` (a peer's): the global weights and the local ones set to
        them, the outer momentum, the counters. The inner optimizer's state is the caller's (a
        joiner starts it fresh, as the paper's replicas keep theirs private)."""
        n = len(self.global_params)
        counts = [int(c) for c in arrays[2 * n]]
        self.inner_steps, self.syncs = counts[0], counts[1]
        for f, (theta, outer) in enumerate(zip(self.global_params, self.outer)):
            theta.data[...] = arrays[f]
            unflatten(theta.data, self.fragments[f])
            outer.steps = counts[2 + f]
            outer.velocity = [arrays[n + f].copy() if outer.momentum and outer.steps else None]

