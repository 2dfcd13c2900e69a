"""Mixture of experts: a layer of E MLPs of which each token uses k (the GPT's MLP, made sparse).

A dense GPT runs every token through one MLP; an MoE layer holds E of them ("experts") and a
router that sends each token to k of them, so the parameters grow E-fold while the FLOPs per
token grow k-fold (Shazeer et al. 2017; GShard, Lepikhin et al. 2020; Switch Transformer,
Fedus et al. 2021; Mixtral, Jiang et al. 2024; DeepSeek-V3, 2024). For the N tokens
x (N, C) of a batch:

    logits = x W_r^T               (N, E)     the router, a Linear without bias
    p      = softmax(logits)       (N, E)     each token's probability over the experts
    choice = top-k of p (+ bias)   (N, k)     the experts each token goes to (slot 0 the best)
    g      = p[choice]             (N, k)     the gate weights, renormalised to sum 1 when k > 1
    y_t    = sum_s g[t,s] * MLP_choice[t,s](x_t)    over the slots s the capacity kept

Renormalising after top-k: GShard (Algorithm 1: g1, g2 divided by g1 + g2), Mixtral (softmax
over the top-k logits, the same thing) and DeepSeek-V3 (eq. 13, its sigmoid scores) do; Switch
(k = 1) does not: it keeps p_i, else the gate is 1 and the router gets no gradient from the task
loss. So this layer renormalises exactly when k > 1.

Capacity (GShard, Switch section 2.2): expert i takes at most C = ceil(capacity_factor · k · N / E)
(token, slot) assignments; the rest are dropped: the layer outputs 0 for that slot, and the
token goes on through the block's residual. Which are kept is GShard's order (Algorithm 1,
``position_in_expert``): every token's first choice before any second choice, and within a slot
the tokens in batch order. N is the *global* batch's tokens, so a run whose tokens are split over
ranks drops exactly the set the one-process run drops (:func:`keep_mask` takes the counts of the
ranks before; ``minidist.parallel.expert_parallel``). Megatron-Core instead computes C from each
rank's own tokens (``topk_softmax_with_capacity`` in ``megatron/core/transformer/moe/moe_utils.py``
calls ``get_capacity(num_tokens * topk, ...)`` on the local tokens, and by default keeps the
highest probabilities, ``drop_policy="probs"``): no extra exchange, but the dropped set depends on
how the batch was cut. ``capacity_factor=None`` drops nothing (Megatron's and Mixtral's default).

Balance. Switch's load-balancing loss (eq. 4): α · E · Σ_i f_i · P_i, f_i the fraction of the
k·N assignments routed to i (before capacity; a count, no gradient), P_i the mean router
probability of i; minimal (α) when both are uniform. Megatron's ``switch_load_balancing_loss_func``
uses the same f_i (``tokens_per_expert / (num_tokens · topk)``). Its gradient is added to the
backward without adding its value to the loss (Megatron's ``MoEAuxLossAutoScaler``): the layer's
output carries it (:class:`AuxLossScaler`), so any loop that backpropagates the task loss trains
the router to balance; the value is kept in ``layer.aux_loss`` for reports. DeepSeek-V3's
auxiliary-loss-free alternative (report section 2.1.2): a per-expert bias b added to the scores
for the top-k choice only (the gates still use p), and after each training forward
b_i += γ · sign(mean load - load_i): an overloaded expert becomes less attractive, outside the
gradient. Megatron-Core's name for γ is ``moe_router_bias_update_rate``.

The layer does not know how its tokens reach the experts: a dispatcher does
(:class:`LocalDispatcher`: one process, all experts here; the expert-parallel wing's sends them
over an all-to-all), as Megatron-Core splits router, token dispatcher and experts
(``megatron/core/transformer/moe/router.py``, ``token_dispatcher.py``, ``experts.py``).
"""
from __future__ import annotations

import math

import numpy as np

from minidist import backend, nn
from minidist import functions as F
from minidist.tensor import Function, Tensor, is_grad_enabled

# ---------------------------------------------------------------------------------------
# Routing on raw arrays: the choice, the capacity, which assignments are kept
# ---------------------------------------------------------------------------------------


def check_experts(n_expert, top_k, capacity_factor, aux_loss_coef=0.0, bias_update_rate=0.0) -> None:
    """Raise ValueError, naming the fix, for expert settings that cannot route: n_expert or top_k
    not an int >= 1, top_k > n_expert, capacity_factor not > 0 (None: no capacity), a negative
    aux_loss_coef or bias_update_rate."""
    for name, value in (("n_expert", n_expert), ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"MoE: {name} must be an int >= 1, got {value!r}")
    if top_k > n_expert:
        raise ValueError(f"MoE: top_k = {top_k} experts per token, but only n_expert = {n_expert}; use top_k <= "
                         f"{n_expert} (1: Switch, 2: GShard, Mixtral)")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"MoE: capacity_factor must be > 0 (1.25: Switch's), or None for no capacity; got "
                         f"{capacity_factor!r}")
    for name, value in (("aux_loss_coef", aux_loss_coef), ("bias_update_rate", bias_update_rate)):
        if not value >= 0:
            raise ValueError(f"MoE: {name} must be >= 0 (0: off), got {value!r}")


def expert_capacity(n_tokens: int, n_expert: int, top_k: int, capacity_factor) -> int | None:
    """C = ceil(capacity_factor · top_k · n_tokens / n_expert), the assignments one expert takes
    (GShard; Switch section 2.2); None when ``capacity_factor`` is None (nothing dropped)."""
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * top_k * n_tokens / n_expert)


def top_k_experts(probs, top_k: int, bias=None):
    """The ``top_k`` experts of each row of ``probs`` (N, E) (raw array), best first: int64 (N, k).
    ``bias`` (E,) (DeepSeek-V3's) is added for the choice only. Ties go to the lower index
    (a stable sort), so the choice is deterministic."""
    xp = backend.get_array_module(probs)
    scores = probs if bias is None else probs + xp.asarray(bias, dtype=probs.dtype)
    return xp.argsort(-scores, axis=1, kind="stable")[:, :top_k].astype(np.int64)


def routed_counts(choice, n_expert: int) -> np.ndarray:
    """(k, E) int64: how many rows of ``choice`` (N, k) put expert e in slot s (before capacity)."""
    choice = backend.to_numpy(choice)
    return np.stack([np.bincount(choice[:, s], minlength=n_expert) for s in range(choice.shape[1])]).astype(np.int64)


def assignments_before(all_counts, rank: int) -> np.ndarray:
    """(k, E): for each (slot s, expert e), the assignments that come before ``rank``'s in GShard's
    order over the ranks' tokens in rank order: every rank's slots before s, and slot s of the
    ranks before ``rank``. ``all_counts`` (P, k, E): every rank's :func:`routed_counts`."""
    all_counts = np.asarray(all_counts, dtype=np.int64)
    per_slot = all_counts.sum(axis=0)  # (k, E)
    earlier_slots = np.cumsum(per_slot, axis=0) - per_slot
    return earlier_slots + all_counts[:rank].sum(axis=0)


def keep_mask(choice, all_counts, rank: int, capacity) -> np.ndarray:
    """bool (N, k): which of this rank's assignments ``choice`` (N, k) the capacity keeps.

    An assignment is kept when fewer than ``capacity`` assignments to its expert come before it in
    GShard's order (module docstring); the global order is the ranks' tokens in rank order, so
    with ``all_counts`` (P, k, E) of every rank the ranks together keep the set one process keeps
    on the whole batch (P = 1: ``all_counts = routed_counts(choice, E)[None]``). None: all kept."""
    choice = backend.to_numpy(choice)
    n, k = choice.shape
    if capacity is None:
        return np.ones((n, k), bool)
    n_expert = np.asarray(all_counts).shape[2]
    before = assignments_before(all_counts, rank)
    keep = np.empty((n, k), bool)
    for s in range(k):
        onehot = choice[:, s, None] == np.arange(n_expert)  # (N, E)
        position = np.cumsum(onehot, axis=0)[np.arange(n), choice[:, s]] - 1  # among this rank's slot s
        keep[:, s] = before[s, choice[:, s]] + position < capacity
    return keep


def kept_counts(all_counts, capacity) -> np.ndarray:
    """(P, E) int64: the assignments of each rank that each expert keeps (:func:`keep_mask`'s
    counts, from the counts alone: what a receiving rank expects from each sender)."""
    all_counts = np.asarray(all_counts, dtype=np.int64)
    if capacity is None:
        return all_counts.sum(axis=1)
    kept = [np.clip(capacity - assignments_before(all_counts, r), 0, all_counts[r]) for r in range(len(all_counts))]
    return np.stack(kept).sum(axis=1)


class RoutingPlan:
    """This process's kept assignments, sorted by expert (then GShard's order): ``token`` (A,),
    ``slot`` (A,), ``expert`` (A,) int64 arrays; ``all_counts`` (P, k, E) every rank's routed
    counts; ``capacity`` (int or None); ``n_tokens`` the tokens of every rank together; ``keep``
    (N, k) bool."""

    def __init__(self, choice, all_counts, rank: int, capacity):
        self.all_counts, self.capacity = np.asarray(all_counts, dtype=np.int64), capacity
        self.keep = keep_mask(choice, all_counts, rank, capacity)
        choice = backend.to_numpy(choice)
        k = choice.shape[1]
        self.n_tokens = int(self.all_counts[:, 0].sum())
        token, slot = np.nonzero(self.keep)  # token order, then slot: re-sorted below
        order = np.lexsort((token, slot, choice[token, slot]))  # by expert, then slot, then token
        self.token, self.slot = token[order].astype(np.int64), slot[order].astype(np.int64)
        self.expert = choice[self.token, self.slot].astype(np.int64)
        self.top_k = k


# ---------------------------------------------------------------------------------------
# The ops the layer needs beyond functions.py: rows concatenated, rows added at indices
# ---------------------------------------------------------------------------------------


class ConcatRows(Function):
    """Tensors (n_i, C) stacked along rows into (Σ n_i, C); backward: the gradient cut back."""

    @staticmethod
    def forward(ctx, *arrays):
        xp = backend.get_array_module(arrays[0])
        ctx.sizes = [a.shape[0] for a in arrays]
        return xp.concatenate(arrays, axis=0)

    @staticmethod
    def backward(ctx, grad):
        bounds = np.cumsum(ctx.sizes)[:-1]
        return tuple(backend.get_array_module(grad).split(grad, bounds, axis=0))


class IndexAdd(Function):
    """``out = zeros(n, C); out[index[j]] += values[j]`` (torch's ``index_add``): the combine's
    sum over a token's slots. Backward: ``grad[index]``."""

    @staticmethod
    def forward(ctx, values, index=None, n_rows=0):
        xp = backend.get_array_module(values)
        ctx.index = index
        out = xp.zeros((n_rows,) + values.shape[1:], dtype=values.dtype)
        backend.scatter_add(out, index, values)
        return out

    @staticmethod
    def backward(ctx, grad):
        return (grad[ctx.index],)


class AuxLossScaler(Function):
    """Identity on ``output``, and a gradient of 1 for the scalar ``aux_loss``: its gradient joins
    the backward of whatever loss ``output`` feeds (Megatron-Core's ``MoEAuxLossAutoScaler``)."""

    @staticmethod
    def forward(ctx, output, aux_loss):
        ctx.aux_shape = aux_loss.shape
        return output

    @staticmethod
    def backward(ctx, grad):
        return grad, backend.get_array_module(grad).ones(ctx.aux_shape, dtype=grad.dtype)


def concat_rows(tensors) -> Tensor:
    """Tensors (n_i, C) -> (Σ n_i, C), differentiable (:class:`ConcatRows`)."""
    return ConcatRows.apply(*tensors)


def index_add(values, index, n_rows: int) -> Tensor:
    """(n_rows, C) zeros with ``values`` (A, C) added at rows ``index`` (A,), differentiable."""
    return IndexAdd.apply(values, index=index, n_rows=n_rows)


# ---------------------------------------------------------------------------------------
# The dispatcher of one process, and the layer
# ---------------------------------------------------------------------------------------


class LocalDispatcher:
    """One process holds every expert and every token: the counts are its own, dispatch gathers
    the kept assignments' rows in the plan's order, combine hands them back unchanged.
    ``expert_ids``: the experts computed here (all E)."""

    rank = 0

    def __init__(self, n_expert: int):
        self.expert_ids = list(range(n_expert))

    def all_counts(self, counts):
        """(1, k, E): the routed counts of every rank (this one)."""
        return counts[None]

    def dispatch(self, tokens, plan):
        """(A, C) rows of ``tokens`` (N, C) for the kept assignments, and the rows per expert here."""
        return tokens[plan.token], np.bincount(plan.expert, minlength=len(self.expert_ids))

    def combine(self, outputs, plan):
        """The experts' outputs (A, C) back in the plan's order (already)."""
        return outputs


class MoE(nn.Module):
    """A mixture-of-experts feed-forward layer: (B, T, C) -> (B, T, C) (module docstring).

    Args:
        config: a ``GPTConfig`` with n_expert E >= 1, top_k k in [1, E], capacity_factor (> 0 or
            None), aux_loss_coef α >= 0, bias_update_rate γ >= 0 (0: no bias), n_embd, bias, dropout.
        rng, dtype, device: as the GPT's layers.

    Parameters: ``router.weight`` (E, C); ``experts.{i}`` GPT MLPs (``models.gpt.MLP``).
    After a forward: ``plan`` (its :class:`RoutingPlan`: ``plan.keep`` the kept assignments),
    ``aux_loss`` (float, α·E·Σ f_i P_i of this process's tokens), ``tokens_per_expert``
    (E,) routed counts of every rank, ``dropped`` (assignments dropped, every rank).
    ``expert_bias`` (E,) float64, DeepSeek-V3's bias (not a parameter: no gradient, not saved).
    """

    def __init__(self, config, *, rng, dtype, device, mlp_class):
        super().__init__()
        e, c = config.n_expert, config.n_embd
        self.n_expert, self.top_k, self.capacity_factor = e, config.top_k, config.capacity_factor
        self.aux_loss_coef, self.bias_update_rate = config.aux_loss_coef, config.bias_update_rate
        self.router = nn.Linear(c, e, bias=False, rng=rng, dtype=dtype, device=device)
        self.experts = nn.ModuleList(mlp_class(config, rng=rng, dtype=dtype, device=device) for _ in range(e))
        self.expert_bias = np.zeros(e)
        self.dispatcher = LocalDispatcher(e)
        self.aux_loss, self.tokens_per_expert, self.dropped = 0.0, np.zeros(e, np.int64), 0

    def route(self, tokens):
        """Router probabilities (N, E) Tensor, the choice (N, k) and the renormalised gates (N, k)."""
        probs = F.softmax(self.router(tokens), dim=-1)
        bias = self.expert_bias if self.bias_update_rate else None
        choice = top_k_experts(probs.data, self.top_k, bias)
        xp = backend.get_array_module(probs.data)
        gates = probs[xp.arange(tokens.shape[0])[:, None], choice]
        if self.top_k > 1:
            gates = gates / gates.sum(axis=-1, keepdims=True)
        return probs, choice, gates

    def forward(self, x):
        b, t, c = x.shape
        tokens = x.reshape(b * t, c)
        probs, choice, gates = self.route(tokens)
        all_counts = self.dispatcher.all_counts(routed_counts(choice, self.n_expert))
        n_global = int(all_counts[:, 0].sum())
        capacity = expert_capacity(n_global, self.n_expert, self.top_k, self.capacity_factor)
        self.plan = plan = RoutingPlan(choice, all_counts, self.dispatcher.rank, capacity)
        rows, per_expert = self.dispatcher.dispatch(tokens, plan)
        bounds = np.concatenate([[0], np.cumsum(per_expert)])
        outputs = concat_rows([expert(rows[int(bounds[i]):int(bounds[i + 1])])
                               for i, expert in enumerate(self.experts)])
        back = self.dispatcher.combine(outputs, plan)
        weighted = back * gates[plan.token, plan.slot].reshape(-1, 1)
        out = index_add(weighted, plan.token, b * t).reshape(b, t, c)
        self.note_load(all_counts, plan)
        if self.aux_loss_coef and self.training and is_grad_enabled():
            out = AuxLossScaler.apply(out, self.balance_loss(probs, all_counts))
        return out

    def balance_loss(self, probs, all_counts) -> Tensor:
        """Switch's α · E · Σ_i f_i · P_i (eq. 4): f_i over every rank's assignments (a constant),
        P_i the mean probability over this process's tokens (averaged over data-parallel ranks,
        it is the global P_i)."""
        routed = all_counts.sum(axis=(0, 1))
        f = routed / routed.sum()
        xp = backend.get_array_module(probs.data)
        fraction = Tensor(xp.asarray(f, dtype=probs.dtype))
        loss = (probs.mean(axis=0) * fraction).sum() * (self.aux_loss_coef * self.n_expert)
        self.aux_loss = float(loss.item())
        return loss

    def note_load(self, all_counts, plan):
        """Record the load of every rank's tokens; in training, DeepSeek-V3's bias update
        b_i += γ · sign(mean load - load_i) (the same on every rank: the counts are global)."""
        load = all_counts.sum(axis=(0, 1))
        self.tokens_per_expert = load
        kept = kept_counts(all_counts, plan.capacity).sum()
        self.dropped = int(load.sum() - kept)
        if self.bias_update_rate and self.training and is_grad_enabled():
            self.expert_bias = self.expert_bias + self.bias_update_rate * np.sign(load.mean() - load)
