"""The puzzle of exercise 20: a mixture-of-experts layer whose experts live on different ranks,
its tokens sent to them and back by two ``all_to_all_v``.

1. :func:`check_route` takes your ``route(x, router_weight, top_k) -> (choice, gates)``: the
   router's softmax over ``x @ router_weight.T`` (x (N, C), router_weight (E, C) float64), each
   token's ``top_k`` experts best first (int (N, k)) and their gate weights (N, k), renormalised
   to sum to 1 when k > 1 (GShard, Mixtral, DeepSeek-V3; Switch keeps p for k = 1).

2. :func:`check_moe_layer` takes your ``moe_forward(comm, x, router_weight, experts, owners,
   top_k, capacity_factor) -> y``: every rank holds its own tokens x (N_r, C), the router, and
   the experts ``owners[rank]`` (``experts[e] = (w_in (C, F), w_out (F, C))``, the expert
   ``relu(x @ w_in) @ w_out``); it returns ``y = x + Σ_s keep · g · expert(x)`` for its tokens.
   The capacity is GShard's, per expert and over the *global* batch (every rank's tokens, in rank
   order): C = ceil(capacity_factor · k · N / E) assignments per expert, first choices of every
   token before any second choice, within a slot the tokens in order; an assignment past C is
   dropped, and a token whose every slot is dropped leaves the layer as it came (the residual).
   ``capacity_factor=None`` drops nothing. On 1 to 4 simulated ranks (uneven token counts, an
   expert no token picks, E not a multiple of P, tight and no capacity) the output must equal this
   layer computed densely in one process in float64 to 1e-12, and the float64 bytes each rank
   sends must be exactly the token rows it has to: 8 · C bytes per kept assignment of its tokens
   whose expert lives on another rank (dispatch) and per row it computed for another rank's token
   (combine); the counts travel as integers. Run again with every array message spoiled in
   transit (:func:`~minidist.course.checks.crossing.check_received`), no row of a token that used
   another rank's expert may still be right: it must have come through the communicator.

The engine's routing and dispatch (``minidist.models.moe``'s ``keep_mask``, ``kept_counts``,
``RoutingPlan``, ``top_k_experts``, ``MoE``; ``minidist.parallel.expert_parallel``'s dispatcher)
may not be called; ``minidist.collectives`` may. A failure raises ``AssertionError("what:
problem\\nHint: ...")``; the usual mistakes are recognised and named: gates not renormalised,
capacity counted per rank instead of per expert over the global batch, second choices before
first ones, the outputs combined in the wrong order, dropped tokens not passed through. Use::

    from minidist.course.checks import experts as moe_checks
    print(moe_checks.check_route(route))
    print(moe_checks.check_moe_layer(moe_forward))

Sources: Lepikhin et al. 2020, GShard (Algorithm 1); Fedus et al. 2021, Switch Transformers
(section 2.2); Megatron-Core's ``MoEAlltoAllTokenDispatcher`` (``megatron/core/transformer/moe/
token_dispatcher.py``), whose capacity is local to a rank (the mistake named above, a choice there).
"""
from __future__ import annotations

import math
import secrets

import numpy as np

from minidist import sim
from minidist.course.checks import DEADLOCK_HINT, call_learner, check_own_code, fail, forbidding
from minidist.course.checks.crossing import any_right, check_received
from minidist.models import moe
from minidist.parallel.expert_parallel import dispatch

ATOL = 1e-12
C_WIDTH, F_WIDTH = 5, 7

HINTS = {
    "softmax": "the router's probabilities are softmax(x @ router_weight.T) over the experts (axis -1), shifted by "
               "the row's max before exp",
    "choice": "choice[t] holds token t's top_k experts by probability, best first: np.argsort(-probs, axis=1)[:, :k]",
    "renormalise": "after picking the top k > 1 experts, divide their probabilities by their sum so each token's gates "
                   "add up to 1 (GShard, Mixtral); only for k = 1 (Switch) keep p as it is",
    "local_capacity": "the capacity is per expert over the *global* batch: C = ceil(capacity_factor * k * N / E) "
                      "with N every rank's tokens together, and an assignment's place in the queue counts the "
                      "assignments of the ranks before yours (all_gather the (k, E) counts first). "
                      "Yours looks counted per rank, from each rank's own tokens",
    "order": "GShard's queue puts every token's first choice before any second choice: go slot by slot (all ranks' "
             "slot 0, then slot 1), and within a slot the tokens in rank order; yours seems to go token by token",
    "passthrough": "a token whose every assignment was dropped must leave the layer as it came, y = x (the residual): "
                   "start from y = x.copy() and add the kept experts' weighted outputs",
    "combine": "on one rank it works, on several not: the rows come back from all_to_all_v peer by peer, in the order "
               "you sent them; undo the permutation you applied after dispatch (expert-major back to peer-major) "
               "before the reverse all_to_all_v, and scatter each row to the (token, slot) it came from",
    "values": "compare with the dense layer on 1 rank first: y = x + sum over kept slots of gate * "
              "relu(x @ w_in) @ w_out of the chosen expert",
    "bytes": "send each kept assignment's row to its expert's rank once and its output back once; keep rows for your "
             "own experts at home, send no dropped row, and exchange the counts as integers",
}
ENGINE = (moe.keep_mask, moe.kept_counts, moe.assignments_before, moe.top_k_experts, moe.RoutingPlan.__init__,
          moe.MoE.forward, dispatch.AllToAllDispatcher.layout, dispatch.exchange)


# -- the oracle: the layer in one process ------------------------------------------------------


def softmax(logits):
    """Row softmax of (N, E) float64, shifted by the row max."""
    z = np.exp(logits - logits.max(axis=1, keepdims=True))
    return z / z.sum(axis=1, keepdims=True)


def dense_route(x, router_weight, top_k, renormalise=True):
    """The oracle router: (choice (N, k) int64 best first, gates (N, k)); ties to the lower index."""
    probs = softmax(x @ router_weight.T)
    choice = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]
    gates = np.take_along_axis(probs, choice, axis=1)
    if renormalise and top_k > 1:
        gates = gates / gates.sum(axis=1, keepdims=True)
    return choice, gates


def dense_keep(choice_per_rank, n_expert, capacity_factor, local=False, token_major=False):
    """bool (N_r, k) per rank: which assignments the capacity keeps, by looping over GShard's queue
    (slot by slot, tokens in rank order). ``local``: each rank's own capacity over its own tokens;
    ``token_major``: a token's slots before the next token's (the two mistakes diagnosed)."""
    groups = [[c] for c in choice_per_rank] if local else [list(choice_per_rank)]
    keeps = []
    for group in groups:
        n = sum(len(c) for c in group)
        k = group[0].shape[1]
        cap = math.inf if capacity_factor is None else math.ceil(capacity_factor * k * n / n_expert)
        used = np.zeros(n_expert, int)
        keep = [np.zeros(c.shape, bool) for c in group]
        queue = ([(r, t, s) for r, c in enumerate(group) for t in range(len(c)) for s in range(k)] if token_major
                 else [(r, t, s) for s in range(k) for r, c in enumerate(group) for t in range(len(c))])
        for r, t, s in queue:
            e = group[r][t, s]
            if used[e] < cap:
                used[e] += 1
                keep[r][t, s] = True
        keeps += keep
    return keeps


def expert_mlp(x, w_in, w_out):
    """The exercise's expert: relu(x @ w_in) @ w_out, (n, C) -> (n, C)."""
    return np.maximum(x @ w_in, 0.0) @ w_out


def dense_layer(xs, router_weight, w_in, w_out, top_k, capacity_factor, **mistake):
    """The oracle: every rank's y = x + Σ kept g · expert(x), computed in one process (list of (N_r, C))."""
    renormalise = mistake.pop("renormalise", True)
    routed = [dense_route(x, router_weight, top_k, renormalise) for x in xs]
    keeps = dense_keep([c for c, _ in routed], len(w_in), capacity_factor, **mistake)
    ys = []
    for x, (choice, gates), keep in zip(xs, routed, keeps):
        y = x.copy()
        for t, s in zip(*np.nonzero(keep)):
            e = choice[t, s]
            y[t] += gates[t, s] * expert_mlp(x[t:t + 1], w_in[e], w_out[e])[0]
        ys.append(y)
    return ys, routed, keeps


# -- part 1 -------------------------------------------------------------------------------------


def check_route(route) -> str:
    """Check ``route(x, router_weight, top_k)`` (module docstring, part 1); returns a verdict."""
    check_own_code(route, "route")
    rng = np.random.default_rng(secrets.randbits(32))
    for top_k in (1, 2, 3):
        x, w = rng.standard_normal((9, 4)), rng.standard_normal((6, 4))
        what = f"route(x (9, 4), router_weight (6, 4), top_k={top_k})"
        with forbidding(*ENGINE):
            got = call_learner(what, route, x.copy(), w.copy(), top_k)
        choice, gates = (np.asarray(a) for a in got)
        want_choice, want_gates = dense_route(x, w, top_k)
        if choice.shape != (9, top_k) or not np.array_equal(choice, want_choice):
            fail(what, f"choice\n{choice}\nexpected\n{want_choice}", HINTS["choice"])
        if gates.shape == want_gates.shape and np.allclose(gates, dense_route(x, w, top_k, False)[1], atol=ATOL) \
                and top_k > 1:
            fail(what, f"gates sum to {np.round(gates.sum(axis=1)[:3], 4)} ..., not 1", HINTS["renormalise"])
        if gates.shape != want_gates.shape or not np.allclose(gates, want_gates, atol=ATOL, rtol=0):
            fail(what, f"gates\n{np.round(gates, 6)}\nexpected\n{np.round(want_gates, 6)}", HINTS["softmax"])
    return "route: ok, top-1, top-2 and top-3 choices and gates equal the dense router's (renormalised for k > 1)"


# -- part 2 -------------------------------------------------------------------------------------


def moe_case(seed, p, n_expert, top_k, capacity_factor, tokens=None):
    """Inputs of one case: tokens per rank (uneven), router and expert weights; the last expert is
    never chosen (its router row is pushed down on a constant feature)."""
    rng = np.random.default_rng([seed, p, n_expert, top_k])
    tokens = tokens or [3 + (r * 2) % 5 for r in range(p)]
    xs = [rng.standard_normal((n, C_WIDTH)) for n in tokens]
    for x in xs:
        x[:, -1] = 1.0
    router = rng.standard_normal((n_expert, C_WIDTH))
    router[-1, -1] = -30.0
    router[0, -1] = 1.5  # expert 0 popular: the capacity bites
    w_in = rng.standard_normal((n_expert, C_WIDTH, F_WIDTH)) / 2
    w_out = rng.standard_normal((n_expert, F_WIDTH, C_WIDTH)) / 2
    return xs, router, w_in, w_out


def _rank(comm, layer, xs, router, w_in, w_out, owners, top_k, capacity_factor):
    r = comm.Get_rank()
    experts = {e: (w_in[e].copy(), w_out[e].copy()) for e in owners[r]}
    with forbidding(*ENGINE):
        y = call_learner(f"moe_forward on rank {r}", layer, comm, xs[r].copy(), router.copy(), experts,
                         [list(o) for o in owners], top_k, capacity_factor)
    return np.asarray(y, dtype=float)


def _still_right(comm, layer, xs, router, w_in, w_out, owners, top_k, capacity_factor, want, remote_rows):
    """Under spoiled messages: whether any row of this rank's tokens that used another rank's
    expert is still right (it cannot be, if it came through the communicator)."""
    r = comm.Get_rank()
    rows = remote_rows[r]
    y = _rank(comm, layer, xs, router, w_in, w_out, owners, top_k, capacity_factor)
    return bool(rows.any()) and any_right(y[rows], want[r][rows], 1e-9)


def float_bytes_sent(world, rank) -> int:
    """The bytes of float64 array messages ``rank`` sent in ``world``'s trace."""
    return sum(m.nbytes for m in world.trace if m.source == rank and m.kind == "array" and m.dtype == "float64")


def _diagnose(what, got, xs, args, p):
    """Name the mistake whose dense variant the learner's wrong output matches."""
    for mistake, hint in (({"renormalise": False}, "renormalise"), ({"local": True}, "local_capacity"),
                          ({"token_major": True}, "order")):
        wrong, _, _ = dense_layer(xs, *args, **mistake)
        if all(g.shape == w.shape and np.allclose(g, w, atol=1e-9) for g, w in zip(got, wrong)):
            fail(what, "the output differs from the dense layer's", HINTS[hint])
    want, routed, keeps = dense_layer(xs, *args)
    for r, (g, w, keep) in enumerate(zip(got, want, keeps)):
        gone = ~keep.any(axis=1)
        if gone.any() and g.shape == w.shape and not np.allclose(g[gone], w[gone], atol=ATOL):
            fail(what, f"rank {r}: tokens {np.nonzero(gone)[0].tolist()} were dropped from every expert and should "
                       f"come out as they went in", HINTS["passthrough"])
    fail(what, "the output differs from the dense layer's (largest difference "
               f"{max(np.abs(g - w).max() if g.shape == w.shape else np.inf for g, w in zip(got, want)):.3g})",
         HINTS["combine"] if p > 1 else HINTS["values"])


CASES = ((1, 4, 2, 1.0), (2, 4, 1, 1.25), (2, 5, 2, None), (3, 5, 2, 1.0), (4, 6, 2, 1.0), (4, 8, 2, 0.75),
         (4, 4, 1, None))


def run_layer(layer, seed, p, n_expert, top_k, capacity_factor):
    """Run the learner's layer on ``p`` simulated ranks against the dense one; fails with a hint.
    Returns (dropped assignments, float64 bytes per rank)."""
    xs, router, w_in, w_out = moe_case(seed, p, n_expert, top_k, capacity_factor)
    owners = [list(map(int, part)) for part in np.array_split(np.arange(n_expert), p)]
    args = (router, w_in, w_out, top_k, capacity_factor)
    what = f"moe_forward on {p} simulated rank{'s' * (p > 1)} (E = {n_expert}, top_k = {top_k}, " \
           f"capacity_factor = {capacity_factor}, tokens per rank {[len(x) for x in xs]})"
    world = sim.World(p, timeout=60)
    try:
        got = world.run(_rank, layer, xs, router, w_in, w_out, owners, top_k, capacity_factor)
    except (sim.DeadlockError, sim.SimTimeoutError) as error:
        fail(what, str(error).splitlines()[0], DEADLOCK_HINT)
    want, routed, keeps = dense_layer(xs, *args)
    if not all(g.shape == w.shape and np.allclose(g, w, atol=ATOL, rtol=0) for g, w in zip(got, want)):
        _diagnose(what, got, xs, args, p)
    owner_of = np.concatenate([np.full(len(o), j) for j, o in enumerate(owners)])
    home = [owner_of[choice][keep] for (choice, _), keep in zip(routed, keeps)]  # kept assignments' ranks
    for r in range(p):
        out_rows = int((home[r] != r).sum())  # dispatch: my tokens to other ranks' experts
        in_rows = sum(int((home[j] == r).sum()) for j in range(p) if j != r)  # combine: their outputs back
        expected, sent = 8 * C_WIDTH * (out_rows + in_rows), float_bytes_sent(world, r)
        if sent != expected:
            fail(what, f"rank {r} sent {sent:,} bytes of float64, expected 8 x C x ({out_rows} rows out to other "
                       f"ranks' experts + {in_rows} outputs back to their tokens' ranks) = {expected:,}",
                 HINTS["bytes"])
    remote_rows = [(keep & (owner_of[choice] != r)).any(axis=1) for r, ((choice, _), keep) in
                   enumerate(zip(routed, keeps))]
    check_received(what, p, _still_right, layer, xs, router, w_in, w_out, owners, top_k, capacity_factor, want,
                   remote_rows)
    dropped = sum(int((~k).sum()) for k in keeps)
    return dropped, [float_bytes_sent(world, r) for r in range(p)]


def check_moe_layer(layer) -> str:
    """Check ``moe_forward`` (module docstring, part 2) on 1 to 4 simulated ranks; returns a verdict."""
    check_own_code(layer, "moe_forward")
    seed = secrets.randbits(32)
    lines = []
    for p, n_expert, top_k, capacity_factor in CASES:
        run_layer(layer, seed, p, n_expert, top_k, capacity_factor)  # random inputs: their counts not printed
        lines.append(f"P = {p}, E = {n_expert}, top-{top_k}, capacity factor {capacity_factor}: equal, bytes exact")
    return ("moe_forward: ok, equal to the dense layer to 1e-12 in float64, only the kept rows sent, there and back\n"
            + "\n".join(lines))


__all__ = ["CASES", "HINTS", "check_moe_layer", "check_route", "dense_keep", "dense_layer", "dense_route",
           "expert_mlp", "float_bytes_sent", "moe_case", "run_layer"]
