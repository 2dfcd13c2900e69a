"""The mixture-of-experts layer (models.moe) and its expert-parallel dispatch (parallel.expert_parallel),
in float64: against a dense loop over tokens and experts written here in NumPy (the oracle), finite
differences (gradcheck), and on the sim (P = 1..4, with dp) against the one-process layer: outputs,
the dropped set and every gradient to 1e-12; bytes per dispatch on the trace; errors."""
import math

import numpy as np
import pytest
from gradcheck import check_gradients

from minidist import collectives, sim
from minidist.models.gpt import MLP, GPTConfig
from minidist.models.moe import MoE, check_experts, expert_capacity
from minidist.parallel.expert_parallel import apply_ep, expert_owners
from minidist.parallel.mesh import DeviceMesh
from minidist.tensor import Tensor

C = 6
A2AV_TAG = collectives.TAGS["all_to_all_v"]


def moe_config(n_expert=5, top_k=2, capacity_factor=1.0, aux_loss_coef=0.0, bias_update_rate=0.0):
    return GPTConfig(vocab_size=7, block_size=8, n_layer=1, n_head=1, n_embd=C, n_expert=n_expert, top_k=top_k,
                     capacity_factor=capacity_factor, aux_loss_coef=aux_loss_coef, bias_update_rate=bias_update_rate)


def make_layer(config, silent_expert=False, sharpness=6.0):
    """The same layer on every call (seed 0); a sharper router gives uneven loads; with
    ``silent_expert`` the last expert's routing bias keeps every token away from it."""
    layer = MoE(config, rng=np.random.default_rng(0), dtype="float64", device=None, mlp_class=MLP)
    layer.router.weight.data *= sharpness / 0.02 / math.sqrt(C)
    if silent_expert:
        layer.bias_update_rate = 1e-300  # the bias is used for the choice; its updates vanish
        layer.expert_bias[-1] = -10.0
    return layer


def tokens(n, seed=1):
    return np.random.default_rng(seed).standard_normal((n, C))


# ------------------------------------------------------------------------ the dense oracle


def gelu_tanh(z):
    return 0.5 * z * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3)))


def dense_reference(layer, x):
    """(out (N, C), keep (N, k)) by loops: softmax, top-k, renormalised gates, GShard's order
    (every first choice before any second, tokens in order), each kept slot through its MLP."""
    logits = x @ layer.router.weight.data.T
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    n, e, k = x.shape[0], layer.n_expert, layer.top_k
    scores = p + (layer.expert_bias if layer.bias_update_rate else 0.0)
    choice = [sorted(range(e), key=lambda i, t=t: (-scores[t, i], i))[:k] for t in range(n)]
    capacity = math.inf if layer.capacity_factor is None else math.ceil(layer.capacity_factor * k * n / e)
    used, keep, out = [0] * e, np.zeros((n, k), bool), np.zeros((n, C))
    for s in range(k):
        for t in range(n):
            expert = choice[t][s]
            if used[expert] < capacity:
                used[expert] += 1
                keep[t, s] = True
    for t in range(n):
        gates = [p[t, i] for i in choice[t]]
        total = sum(gates) if k > 1 else 1.0
        for s in range(k):
            if keep[t, s]:
                mlp = layer.experts[choice[t][s]]
                hidden = gelu_tanh(x[t] @ mlp.c_fc.weight.data.T + mlp.c_fc.bias.data)
                out[t] += gates[s] / total * (hidden @ mlp.c_proj.weight.data.T + mlp.c_proj.bias.data)
    return out, keep


@pytest.mark.parametrize("n_expert,top_k,capacity_factor,silent", [
    (5, 2, 1.0, False), (4, 1, 1.25, False), (5, 2, 0.5, True), (3, 3, None, False), (6, 2, 2.0, True)])
def test_layer_equals_the_dense_loop(n_expert, top_k, capacity_factor, silent):
    layer = make_layer(moe_config(n_expert, top_k, capacity_factor), silent_expert=silent)
    x = tokens(24)
    out = layer(Tensor(x[None])).data[0]
    expected, keep = dense_reference(layer, x)
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-12)
    assert (layer.plan.keep == keep).all()
    assert layer.dropped == keep.size - keep.sum()
    if capacity_factor is not None and capacity_factor < 1:
        assert layer.dropped > 0  # the capacity binds
    if silent:
        assert layer.tokens_per_expert[-1] == 0
    assert top_k == n_expert or len(set(layer.tokens_per_expert.tolist())) > 1  # uneven loads


def test_capacity_formula_and_bad_settings():
    assert expert_capacity(24, 5, 2, 1.0) == 10 and expert_capacity(24, 4, 1, 1.25) == 8
    assert expert_capacity(24, 4, 2, None) is None
    for args, message in [((4, 5, 1.0), "top_k = 5 experts per token, but only n_expert = 4"),
                          ((4, 2, 0.0), "capacity_factor must be > 0"), ((0, 1, 1.0), "n_expert must be an int")]:
        with pytest.raises(ValueError, match=message):
            check_experts(*args)
    with pytest.raises(ValueError, match="top_k = 3 experts per token"):
        moe_config(n_expert=2, top_k=3)


# ------------------------------------------------------------------------ gradients


def test_gradcheck_input_and_parameters():
    layer = make_layer(moe_config(4, 2, 0.75), sharpness=2.0)
    x = tokens(10, seed=3)
    check_gradients(lambda t: layer(t.reshape(1, 10, C)).reshape(10, C), x)
    v = np.random.default_rng(4).standard_normal((10, C))
    layer.zero_grad()  # check_gradients' backward reached the parameters too
    layer(Tensor(x[None])).reshape(10, C).__mul__(Tensor(v)).sum().backward()

    def value():
        return float((layer(Tensor(x[None])).data[0] * v).sum())

    pick = np.random.default_rng(5)
    for name, p in layer.named_parameters():
        for flat in pick.choice(p.size, size=min(4, p.size), replace=False):
            index = np.unravel_index(flat, p.shape)
            keep = p.data[index]
            p.data[index] = keep + 1e-6
            up = value()
            p.data[index] = keep - 1e-6
            down = value()
            p.data[index] = keep
            assert abs(p.grad[index] - (up - down) / 2e-6) < 1e-6 * (1 + abs(p.grad[index])), name


def test_balance_loss_gradient_is_switchs():
    """The gradient the aux-loss scaler adds to the router is that of alpha * E * sum f_i P_i (f fixed)."""
    x, alpha = tokens(12, seed=6), 0.1
    grads = []
    for coef in (0.0, alpha):
        layer = make_layer(moe_config(4, 2, 1.0, aux_loss_coef=coef))
        layer(Tensor(x[None])).sum().backward()
        grads.append(layer.router.weight.grad.copy())
    f = layer.tokens_per_expert / layer.tokens_per_expert.sum()
    w = layer.router.weight.data.copy()

    def aux(weights):
        logits = x @ weights.T
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        return alpha * 4 * float((f * (p / p.sum(axis=1, keepdims=True)).mean(axis=0)).sum())

    numeric = np.zeros_like(w)
    for index in np.ndindex(*w.shape):
        step = np.zeros_like(w)
        step[index] = 1e-6
        numeric[index] = (aux(w + step) - aux(w - step)) / 2e-6
    np.testing.assert_allclose(grads[1] - grads[0], numeric, atol=1e-8)
    assert layer.aux_loss == pytest.approx(aux(w), rel=1e-12)


def test_bias_update_moves_load_away_from_the_busiest_expert():
    layer = make_layer(moe_config(4, 1, None, bias_update_rate=0.01))
    layer(Tensor(tokens(32)[None]))
    load = layer.tokens_per_expert
    assert np.array_equal(layer.expert_bias, 0.01 * np.sign(load.mean() - load))


# ------------------------------------------------------------------------ expert parallel on the sim


def ep_layer_run(comm, config, x_global, v_global, dp, silent):
    """On each rank: the layer laid out over its ep group, its part of the tokens, <v, out> backward.
    Returns (out, keep, x.grad, router grad, {expert: its grads})."""
    p, rank = comm.Get_size(), comm.Get_rank()
    mesh = DeviceMesh(comm, (dp, p // dp), ("dp", "ep"))
    layer = apply_ep(make_layer(config, silent), mesh.get_group("ep"), comm)
    n = x_global.shape[0] // p
    x = Tensor(x_global[rank * n:(rank + 1) * n][None], requires_grad=True)
    out = layer(x)
    (out * Tensor(v_global[rank * n:(rank + 1) * n][None])).sum().backward()
    experts = {e: [q.grad for q in mlp.parameters()] for e, mlp in zip(layer.dispatcher.expert_ids, layer.experts)}
    result = out.data[0], layer.plan.keep, x.grad[0], layer.router.weight.grad, experts
    mesh.free()
    return result


@pytest.mark.parametrize("p,dp,n_expert,top_k,capacity_factor,silent", [
    (1, 1, 5, 2, 1.0, False), (2, 1, 5, 2, 0.75, True), (3, 1, 4, 1, 1.0, False), (4, 1, 6, 2, 1.0, True),
    (4, 2, 5, 2, 0.75, False), (4, 4, 3, 2, 1.0, False)])
def test_expert_parallel_equals_one_process(p, dp, n_expert, top_k, capacity_factor, silent):
    config = moe_config(n_expert, top_k, capacity_factor)
    x, v = tokens(24), np.random.default_rng(7).standard_normal((24, C))
    one = make_layer(config, silent)
    xt = Tensor(x[None], requires_grad=True)
    (one(xt) * Tensor(v[None])).sum().backward()
    got = sim.run(ep_layer_run, p, config, x, v, dp, silent)
    np.testing.assert_allclose(np.concatenate([g[0] for g in got]), one(Tensor(x[None])).data[0], rtol=0, atol=1e-12)
    assert (np.concatenate([g[1] for g in got]) == one.plan.keep).all()  # the same dropped set
    np.testing.assert_allclose(np.concatenate([g[2] for g in got]), xt.grad[0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(sum(g[3] for g in got), one.router.weight.grad, rtol=0, atol=1e-12)
    for e in range(n_expert):  # an expert's gradient: summed over its dp replicas
        holders = [g[4][e] for g in got if e in g[4]]
        assert len(holders) == dp
        for i, q in enumerate(one.experts[e].parameters()):
            np.testing.assert_allclose(sum(h[i] for h in holders), q.grad, rtol=0, atol=1e-12)


def test_fewer_experts_than_ep_ranks_is_refused():
    assert expert_owners(5, 2) == [[0, 1, 2], [3, 4]]
    with pytest.raises(ValueError, match="3 experts cannot be spread over 4 ep ranks .*--dp D"):
        sim.run(lambda comm: apply_ep(make_layer(moe_config(3, 2)), comm, comm), 4)


def a2av_bytes(world, rank):
    return sum(m.nbytes for m in world.trace if m.source == rank and m.tag == A2AV_TAG and m.kind == "array")


@pytest.mark.parametrize("p", [2, 4])
def test_bytes_per_dispatch_uniform_router(p):
    """Token t prefers experts t mod E and t + 1 mod E: every expert gets k N / E assignments, so a rank
    sends k n (P - 1) / P rows of C values in dispatch, the same back in combine, plus one count per peer each."""
    e, k, n = 4, 2, 8
    layer_config = moe_config(e, k, 1.0)
    x = np.zeros((n * p, C))
    x[np.arange(n * p), np.arange(n * p) % e] = 1.0
    weight = 2 * np.eye(e, C) + np.roll(np.eye(e, C), 1, axis=0)  # row e: 2 at column e, 1 at column e - 1

    def run(comm):
        layer = make_layer(layer_config)
        layer.router.weight.data = weight.copy()
        layer = apply_ep(layer, comm, comm)
        r = comm.Get_rank()
        layer(Tensor(x[r * n:(r + 1) * n][None]))
        return layer.dispatcher.sent_rows, layer.dispatcher.received_rows, layer.dropped

    world = sim.World(p)
    got = world.run(run)
    rows = k * n * (p - 1) // p
    for r in range(p):
        assert got[r] == (rows, rows, 0)
        assert a2av_bytes(world, r) == 2 * (rows * C * 8 + 8 * (p - 1))


def test_bytes_on_the_trace_with_uneven_loads():
    config, x = moe_config(5, 2, 1.0), tokens(24)

    def run(comm):
        layer = apply_ep(make_layer(config, silent_expert=True), comm, comm)
        n = 24 // comm.Get_size()
        layer(Tensor(x[comm.Get_rank() * n:(comm.Get_rank() + 1) * n][None]))
        return layer.dispatcher.sent_rows, layer.dispatcher.received_rows

    world = sim.World(3)
    got = world.run(run)
    assert len({s for s, _ in got}) > 1  # the ranks send different amounts
    for r, (sent, received) in enumerate(got):
        assert a2av_bytes(world, r) == (sent + received) * C * 8 + 2 * 8 * 2


def test_a_rank_that_raises_mid_dispatch_ends_every_rank():
    """Rank 1's expert fails between dispatch and combine: every rank ends, with its error."""
    config, x = moe_config(4, 2, 1.0), tokens(12)

    def run(comm):
        layer = apply_ep(make_layer(config), comm, comm)
        if comm.Get_rank() == 1:
            def broken(h):
                raise RuntimeError("expert 2 failed on rank 1")
            layer.experts[0].forward = broken
        layer(Tensor(x[comm.Get_rank() * 4:(comm.Get_rank() + 1) * 4][None]))

    world = sim.World(3, timeout=30)
    with pytest.raises(RuntimeError, match="expert 2 failed on rank 1"):
        world.run(run)
    assert len(world.errors) == 3
