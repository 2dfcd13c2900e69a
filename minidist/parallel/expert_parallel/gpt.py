"""The MoE GPT laid out for expert parallelism from outside: each MoE layer keeps this rank's
experts and sends its tokens through an all-to-all dispatcher; the gradients reduced by who holds
what; the clipping norm of the whole model.

Who holds what, on a (dp, ep) mesh of P = D x (P / D) ranks, ep fastest: every rank holds the
attention, embeddings, norms and routers (replicated P times, as under DDP) and the experts of its
ep coordinate (replicated D times: once per ep group). After backward:

- a replicated parameter's gradient is its ranks' average over all P ranks (each rank's loss is
  the mean over its own tokens, so the average is the gradient of the global batch's mean);
- an expert's gradient already holds the contributions of every token its ep group sent it (the
  reverse all-to-all brought them home), each from a rank-mean loss: the sum over its D replicas
  (the dp group), divided by P, is the global batch's gradient. Only the D ranks that hold the
  expert take part: an all-reduce over the dp group, not the world.

Megatron-Core reduces expert gradients over its "expert data parallel" group the same way
(``megatron/core/distributed/finalize_model_grads.py`` and the expert-dp groups of
``parallel_state``); torchtitan's FSDP over the experts uses the ``efsdp`` mesh dimension.
"""
from __future__ import annotations

import math

import numpy as np

from minidist import backend, collectives, nn
from minidist.models.moe import MoE
from minidist.parallel.expert_parallel.dispatch import AllToAllDispatcher


def moe_layers(model) -> list:
    """The model's MoE layers (``models.moe.MoE``), in module order."""
    return [module for module in model.modules() if isinstance(module, MoE)]


def apply_ep(model, ep_comm, world_comm):
    """Lay ``model`` (an MoE GPT, the same on every rank) out for expert parallelism in place:
    each MoE layer keeps only this rank's experts (``dispatch.expert_owners``) and dispatches
    through an :class:`~.dispatch.AllToAllDispatcher` over ``ep_comm`` (the capacity's counts over
    ``world_comm``). Returns ``model``. Raises ValueError when the model has no MoE layer or there
    are fewer experts than ep ranks (naming the fix)."""
    layers = moe_layers(model)
    if not layers:
        raise ValueError("expert parallelism spreads the experts of MoE layers; build the GPT with "
                         "GPTConfig(n_expert=E) (train --n-expert E)")
    for layer in layers:
        dispatcher = AllToAllDispatcher(ep_comm, world_comm, layer.n_expert)
        layer.experts = nn.ModuleList(layer.experts[i] for i in dispatcher.expert_ids)
        layer.dispatcher = dispatcher
    return model


def split_parameters(model) -> tuple[list, list]:
    """(replicated parameters, expert parameters) of a laid-out model, each in module order."""
    experts = {id(p) for layer in moe_layers(model) for p in layer.experts.parameters()}
    params = model.parameters()
    return [p for p in params if id(p) not in experts], [p for p in params if id(p) in experts]


def all_reduce_mean(comm, params, divisor: int) -> None:
    """Every ``.grad`` of ``params`` replaced by the sum over ``comm`` divided by ``divisor``: one
    all-reduce of the gradients laid end to end (a missing gradient counts as zeros)."""
    if not params:
        return
    xp = backend.get_array_module(params[0].data)
    grads = [p.grad if p.grad is not None else xp.zeros_like(p.data) for p in params]
    total = collectives.all_reduce(comm, xp.concatenate([g.ravel() for g in grads])) / divisor
    offset = 0
    for p in params:
        p.grad = total[offset:offset + p.size].reshape(p.shape).astype(p.dtype, copy=False)
        offset += p.size


def reduce_gradients(model, world_comm, dp_comm) -> None:
    """After backward: replicated gradients averaged over ``world_comm``, expert gradients summed
    over ``dp_comm`` (the ranks holding the same experts) and divided by the world size."""
    replicated, experts = split_parameters(model)
    world = world_comm.Get_size()
    all_reduce_mean(world_comm, replicated, world)
    all_reduce_mean(dp_comm, experts, world)


def clip_grad_norm_(model, ep_comm, max_norm: float) -> float:
    """``nn.clip_grad_norm_`` (2-norm, torch's factor) of the whole MoE model, each parameter counted
    once: the replicated gradients' squares here, the experts' summed over the ep group (which
    together holds every expert once). Returns the norm before clipping. Collective over ep_comm."""
    replicated, experts = split_parameters(model)
    local = sum(float(np.vdot(backend.to_numpy(p.grad).ravel(), backend.to_numpy(p.grad).ravel()))
                for p in experts if p.grad is not None)
    expert_square = float(collectives.all_reduce(ep_comm, np.array([local]))[0])
    dense_square = sum(float(np.vdot(backend.to_numpy(p.grad).ravel(), backend.to_numpy(p.grad).ravel()))
                       for p in replicated if p.grad is not None)
    total = math.sqrt(dense_square + expert_square)
    coefficient = max_norm / (total + 1e-6)
    if coefficient < 1:
        for p in replicated + experts:
            if p.grad is not None:
                p.grad *= p.grad.dtype.type(coefficient)
    return total


def dense_state_dict(model, ep_comm) -> dict | None:
    """The one-process model's state dict from a laid-out model, on ep rank 0 (None elsewhere;
    collective over ``ep_comm``): every expert gathered from its holder and named as in the dense
    GPT (``...mlp.experts.{i}...``, i the expert's global number)."""
    layer_of = {id(layer.router.weight): layer for layer in moe_layers(model)}
    layers = {name[:-len(".router.weight")]: layer_of[id(p)] for name, p in model.named_parameters()
              if id(p) in layer_of}
    local, replicated = {}, {}
    for key, value in model.state_dict().items():
        prefix, _, rest = key.partition(".experts.")
        if rest and prefix in layers:
            position, _, tail = rest.partition(".")
            expert_id = layers[prefix].dispatcher.expert_ids[int(position)]
            local[f"{prefix}.experts.{expert_id}.{tail}"] = backend.to_numpy(value)
        else:
            replicated[key] = value
    parts = collectives.gather_objects(ep_comm, local)
    if parts is None:
        return None
    for part in parts:
        replicated.update(part)
    return replicated
