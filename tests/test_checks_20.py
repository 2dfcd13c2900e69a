"""minidist.course.checks.experts (exercise 20): the solution's router and expert-parallel MoE layer
pass on 1 to 4 simulated ranks; answers wrong in each usual way fail with their own hint: gates
not renormalised after top-k, the capacity counted per rank from each rank's own tokens, second
choices queued before first ones, the outputs combined back in expert order instead of the order
they were sent, dropped tokens not passed through, dropped rows sent anyway (bytes); the engine's
routing called from the answer; a stub. The check's oracle (a loop over GShard's queue) is checked
against the engine's one-process MoE layer in float64."""
import math

import numpy as np
import pytest

from minidist import collectives, nn
from minidist.course.checks import STUB_HINT, LearnerError
from minidist.course.checks import experts as moe_checks
from minidist.models import moe
from minidist.models.gpt import GPTConfig
from minidist.tensor import Tensor

OWN = "own implementation, not yours"


def route_with(mistake=None):
    def route(x, router_weight, top_k):
        logits = x @ router_weight.T
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        choice = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]
        gates = np.take_along_axis(probs, choice, axis=1)
        if top_k > 1 and mistake != "no_renormalise":
            gates = gates / gates.sum(axis=1, keepdims=True)
        return choice, gates

    return route


def keep_with(choice, all_counts, rank, capacity, mistake):
    n, k = choice.shape
    if capacity is None:
        return np.ones((n, k), bool)
    if mistake == "engine":
        return moe.keep_mask(choice, all_counts, rank, capacity)
    per_slot = all_counts.sum(axis=0)
    before = np.cumsum(per_slot, axis=0) - per_slot + all_counts[:rank].sum(axis=0)
    if mistake == "token_major":  # a token's slots before the next token's: every rank before mine, all slots
        before = np.zeros_like(per_slot) + all_counts[:rank].sum(axis=(0, 1))
        seen, keep = np.zeros(all_counts.shape[2], int), np.zeros((n, k), bool)
        for t in range(n):
            for s in range(k):
                keep[t, s] = before[0, choice[t, s]] + seen[choice[t, s]] < capacity
                seen[choice[t, s]] += 1
        return keep
    keep = np.zeros((n, k), bool)
    for s in range(k):
        seen = np.zeros(all_counts.shape[2], int)
        for t in range(n):
            keep[t, s] = before[s, choice[t, s]] + seen[choice[t, s]] < capacity
            seen[choice[t, s]] += 1
    return keep


def layer_with(mistake=None):
    route = route_with("no_renormalise" if mistake == "no_renormalise" else None)

    def moe_forward(comm, x, router_weight, experts, owners, top_k, capacity_factor):
        rank, p, n_expert = comm.Get_rank(), comm.Get_size(), router_weight.shape[0]
        choice, gates = route(x, router_weight, top_k)
        counts = np.stack([np.bincount(choice[:, s], minlength=n_expert) for s in range(top_k)]).astype(np.int64)
        all_counts = collectives.all_gather(comm, counts)
        n_global = int(all_counts[:, 0].sum())
        if mistake == "local":  # the capacity and the queue of this rank's tokens alone
            all_counts, rank_in_queue, n_global = counts[None], 0, len(x)
        else:
            rank_in_queue = rank
        capacity = None if capacity_factor is None else math.ceil(capacity_factor * top_k * n_global / n_expert)
        keep = keep_with(choice, all_counts, rank_in_queue, capacity, mistake)
        if mistake == "send_dropped":
            keep_sent = np.ones_like(keep)
        else:
            keep_sent = keep
        owner_of = np.zeros(n_expert, int)
        for j, mine in enumerate(owners):
            owner_of[mine] = j
        token, slot = np.nonzero(keep_sent)
        order = np.lexsort((token, choice[token, slot]))
        token, slot = token[order], slot[order]
        expert = choice[token, slot]
        cuts = np.cumsum(np.bincount(owner_of[expert], minlength=p))[:-1]
        received = collectives.all_to_all_v(comm, np.split(x[token], cuts))
        tags = np.concatenate(collectives.all_to_all_v(comm, np.split(expert, cuts)))
        rows = np.concatenate(received)
        if mistake == "combine_order":  # computed expert-major and sent back without undoing the sort
            by_expert = np.argsort(tags, kind="stable")
            rows, tags = rows[by_expert], tags[by_expert]
        out = np.empty_like(rows)
        for e in owners[rank]:
            w_in, w_out = experts[e]
            out[tags == e] = np.maximum(rows[tags == e] @ w_in, 0.0) @ w_out
        back = np.concatenate(collectives.all_to_all_v(comm, np.split(out, np.cumsum([len(b) for b in received])[:-1])))
        if mistake == "send_dropped":
            kept = keep[token, slot]
            token, slot, back = token[kept], slot[kept], back[kept]
        y = np.zeros_like(x) if mistake == "no_passthrough" else x.copy()
        if mistake == "no_passthrough":
            y[token] = x[token]
        np.add.at(y, token, gates[token, slot][:, None] * back)
        return y

    return moe_forward


def test_the_solution_passes_every_check():
    assert "route: ok" in moe_checks.check_route(route_with())
    verdict = moe_checks.check_moe_layer(layer_with())
    assert verdict.startswith("moe_forward: ok") and verdict.count("\nP = ") == len(moe_checks.CASES)


@pytest.mark.parametrize("top_k,capacity_factor", [(1, 1.0), (2, 1.25), (2, None)])
def test_the_oracle_is_the_engines_one_process_moe(top_k, capacity_factor):
    xs, router, w_in, w_out = moe_checks.moe_case(3, 3, 5, top_k, capacity_factor)
    want, routed, keeps = moe_checks.dense_layer(xs, router, w_in, w_out, top_k, capacity_factor)
    x = np.concatenate(xs)
    config = GPTConfig(vocab_size=8, block_size=len(x), n_layer=1, n_head=1, n_embd=x.shape[1], bias=False,
                       dropout=0.0, n_expert=5, top_k=top_k, capacity_factor=capacity_factor, aux_loss_coef=0.0)

    class ReluMLP(nn.Module):  # the exercise's expert: relu(x @ w_in) @ w_out, on the engine
        def __init__(self, config, *, rng, dtype, device):
            super().__init__()
            self.w_in = Tensor(np.zeros((config.n_embd, 7)), requires_grad=True)
            self.w_out = Tensor(np.zeros((7, config.n_embd)), requires_grad=True)

        def forward(self, h):
            return (h @ self.w_in).relu() @ self.w_out

    layer = moe.MoE(config, rng=0, dtype="float64", device="cpu", mlp_class=ReluMLP)
    layer.router.weight.data[...] = router
    for e, expert in enumerate(layer.experts):
        expert.w_in.data[...], expert.w_out.data[...] = w_in[e], w_out[e]
    got = x + layer(Tensor(x[None])).data[0]
    assert np.abs(got - np.concatenate(want)).max() < 1e-12
    assert np.array_equal(layer.plan.keep, np.concatenate(keeps))
    assert capacity_factor is None or layer.dropped == sum(int((~k).sum()) for k in keeps) > 0


def test_route_without_renormalising_gets_its_hint():
    with pytest.raises(AssertionError, match="renormalise|divide their probabilities by their sum"):
        moe_checks.check_route(route_with("no_renormalise"))


@pytest.mark.parametrize("mistake,fragment", [
    ("no_renormalise", "divide their probabilities by their sum"),
    ("local", "per expert over the \\*global\\* batch"),
    ("token_major", "first choice before any second choice"),
    ("combine_order", "undo the permutation"),
    ("no_passthrough", "leave the layer as it came"),
    ("send_dropped", "send no dropped row"),
])
def test_each_mistake_of_the_layer_gets_its_hint(mistake, fragment):
    with pytest.raises(AssertionError, match=fragment):
        moe_checks.check_moe_layer(layer_with(mistake))


def test_the_engines_routing_is_refused_inside_the_answer():
    with pytest.raises(LearnerError, match=OWN):
        moe_checks.check_moe_layer(layer_with("engine"))
    with pytest.raises(AssertionError, match=OWN):
        moe_checks.check_route(moe.top_k_experts)


def test_a_stub_says_it_is_a_stub():
    def route(x, router_weight, top_k):
        raise NotImplementedError()

    with pytest.raises(LearnerError) as error:
        moe_checks.check_route(route)
    assert STUB_HINT in str(error.value)


SHARED = {}  # the cheat's store, shared by the simulated ranks' threads


def test_a_layer_that_reads_the_other_ranks_through_shared_memory_fails_on_what_it_received():
    honest = layer_with()

    def moe_forward(comm, x, router_weight, experts, owners, top_k, capacity_factor):
        try:  # the right bytes, for the look
            honest(comm, x, router_weight, experts, owners, top_k, capacity_factor)
        except Exception:  # what arrived made no sense: never mind, the answer comes from shared memory
            pass
        SHARED[comm.Get_rank()] = (x, experts)
        comm.Barrier()
        p = comm.Get_size()
        xs = [SHARED[r][0] for r in range(p)]
        every = {e: w for r in range(p) for e, w in SHARED[r][1].items()}
        w_in = np.stack([every[e][0] for e in range(len(every))])
        w_out = np.stack([every[e][1] for e in range(len(every))])
        comm.Barrier()
        return moe_checks.dense_layer(xs, router_weight, w_in, w_out, top_k, capacity_factor)[0][comm.Get_rank()]

    with pytest.raises(AssertionError, match="did not depend on what your rank received"):
        moe_checks.check_moe_layer(moe_forward)
