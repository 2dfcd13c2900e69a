"""minidist.course.checks.context_parallel (exercise 19): the solution's merge, causal ring
(forward and backward) and balanced chunk layouts pass on 1 to 4 simulated ranks; answers wrong
in each usual way fail with their own hint: a merge without the max shift (inf), without the guard
for rows that see no key (NaN), that averages the blocks, or whose lse is the larger one; a ring
whose causal mask is each block's own triangle, or takes rank order for position order; a backward
that sends K and V round but never brings dK, dV home; a ring of blocking Sends (a deadlock under
the check's synchronous sends); a ring that sends the positions too, or sends to every rank; a
layout balanced in count but not in work, or that loses a chunk; the engine's merge as the answer
or called by it; a ring that reads the other ranks' parts through memory the simulated ranks share.
The check's oracle (dense float64 attention with its log-sum-exp and gradients) is checked
against the engine's fused attention and finite differences."""
import numpy as np
import pytest

from minidist import functions as F
from minidist.attention import attention_block, attention_block_backward, merge_attention
from minidist.course.checks import STUB_HINT, LearnerError, numerical_gradient
from minidist.course.checks import context_parallel as cp_checks
from minidist.tensor import Tensor

OWN = "own implementation, not yours"
SHARED = {}  # the cheat's store, shared by the simulated ranks' threads


def merge_with(mistake=None):
    """The exercise's merge, the solution's or with one mistake."""

    def merge(o_a, lse_a, o_b, lse_b):
        if mistake == "no_shift":  # log(exp + exp): overflows for large scores
            lse = np.log(np.exp(lse_a) + np.exp(lse_b))
        elif mistake == "max":
            lse = np.maximum(lse_a, lse_b)
        else:
            lse = np.logaddexp(lse_a, lse_b)
        if mistake == "mean":
            return (o_a + o_b) / 2, lse
        base = lse if mistake == "no_guard" else np.where(np.isfinite(lse), lse, 0.0)
        return np.exp(lse_a - base)[..., None] * o_a + np.exp(lse_b - base)[..., None] * o_b, lse

    return merge


MERGE = merge_with()


def exchange(comm, send, shape, mistake=None):
    rank, p = comm.Get_rank(), comm.Get_size()
    received = np.empty(shape)
    if mistake == "blocking":  # every rank Sends first: a deadlock once sends are synchronous
        comm.Send(np.ascontiguousarray(send), dest=(rank + 1) % p, tag=19)
        comm.Recv(received, source=(rank - 1) % p, tag=19)
        return received
    requests = [comm.Irecv(received, source=(rank - 1) % p, tag=19),
                comm.Isend(np.ascontiguousarray(send), dest=(rank + 1) % p, tag=19)]
    for request in requests:
        request.Wait()
    return received


def mask_for(positions, rank, owner, mistake):
    mine, theirs = positions[rank], positions[owner]
    if mistake == "local_mask":  # the block's own lower triangle
        return np.arange(len(theirs))[None, :] <= np.arange(len(mine))[:, None]
    if mistake == "rank_order":  # earlier ranks whole, later ranks hidden, the diagonal block by positions
        if owner != rank:
            return np.full((len(mine), len(theirs)), owner < rank)
    return theirs[None, :] <= mine[:, None]


def forward_with(mistake=None):
    def ring_attention_forward(comm, q, k, v, positions, scale):
        rank, p = comm.Get_rank(), comm.Get_size()
        d = k.shape[-1]
        o, lse = np.zeros(q.shape), np.full(q.shape[:-1], -np.inf)
        if mistake == "shared":  # the other ranks' parts read from memory the threads share, nothing sent
            SHARED[rank] = (k, v)
            comm.Barrier()
            parts = [SHARED[r] for r in range(p)]
        block, owner = np.concatenate([k, v], axis=-1), rank
        for step in range(p):
            if mistake == "shared":
                block = np.concatenate(parts[owner], axis=-1)
            mask = mask_for(positions, rank, owner, mistake)
            if mask.any():
                o_b, lse_b = attention_block(q, block[..., :d], block[..., d:], scale, mask)
                o, lse = (merge_attention if mistake == "engine_merge" else MERGE)(o, lse, o_b, lse_b)
            if step < p - 1:
                owner = (owner - 1) % p
                shape = block.shape[:-2] + (len(positions[owner]), block.shape[-1])
                if mistake == "shared":
                    exchange(comm, np.zeros(block.shape), shape)  # the look of the traffic
                    continue
                if mistake == "to_everyone":  # a copy to every other rank as well (the same size: equal parts)
                    others = [other for other in range(p) if other not in (rank, (rank + 1) % p, (rank - 1) % p)]
                    requests = [comm.Irecv(np.empty(block.shape), source=other, tag=20) for other in others]
                    requests += [comm.Isend(np.ascontiguousarray(block), dest=other, tag=20) for other in others]
                    for request in requests:
                        request.Wait()
                if mistake == "with_positions":  # the positions travel too, as floats
                    block = np.concatenate([block, np.zeros(block.shape[:-1] + (1,))], axis=-1)
                    block = exchange(comm, block, shape[:-1] + (shape[-1] + 1,))[..., :-1]
                else:
                    block = exchange(comm, block, shape, "blocking" if mistake == "blocking" else None)
        return o, lse

    return ring_attention_forward


def backward_with(mistake=None):
    def ring_attention_backward(comm, q, k, v, o, lse, do, positions, scale):
        rank, p = comm.Get_rank(), comm.Get_size()
        d = k.shape[-1]
        delta = (do * o).sum(axis=-1)
        dq = np.zeros(q.shape)
        block, owner = np.concatenate([k, v], axis=-1), rank
        grads = np.zeros(block.shape)
        own = None
        for step in range(p):
            mask = mask_for(positions, rank, owner, None)
            if mask.any():
                dq_b, dk_b, dv_b = attention_block_backward(q, block[..., :d], block[..., d:], do, lse, delta, scale,
                                                            mask)
                dq += dq_b
                if mistake == "not_home":
                    if owner == rank:
                        own = np.concatenate([dk_b, dv_b], axis=-1)
                else:
                    grads += np.concatenate([dk_b, dv_b], axis=-1)
            owner = (owner - 1) % p
            shape = block.shape[:-2] + (len(positions[owner]), block.shape[-1])
            if mistake == "not_home":  # K/V go round, no gradient comes back
                if step < p - 1:
                    block = exchange(comm, block, shape)
                continue
            if step < p - 1:
                both = exchange(comm, np.concatenate([block, grads], axis=-1), shape[:-1] + (2 * shape[-1],))
                block, grads = both[..., :shape[-1]], both[..., shape[-1]:]
            elif p > 1:
                grads = exchange(comm, grads, shape)
        if mistake == "not_home":
            grads = own if own is not None else np.zeros(block.shape)
        return dq, grads[..., :d], grads[..., d:]

    return ring_attention_backward


FORWARD, BACKWARD = forward_with(), backward_with()


def balanced_with(mistake=None):
    def balanced_chunks(p, n_chunks):
        if mistake == "contiguous":  # two neighbouring chunks each: balanced in count, not in work
            per = n_chunks // p
            return [list(range(r * per, (r + 1) * per)) for r in range(p)]
        if mistake == "lost":
            return [[c for c in range(n_chunks) if c % p == r and c != n_chunks - 1] for r in range(p)]
        layout = [[] for _ in range(p)]
        for start in range(0, n_chunks, 2 * p):
            for r in range(p):
                layout[r] += [start + r, start + 2 * p - 1 - r]
        if mistake == "uneven" and p > 1:  # rank 0 takes one chunk of rank 1's
            layout[0].append(layout[1].pop())
        return layout

    return balanced_chunks


def zigzag(t, p):
    chunks = np.array_split(np.arange(t), 2 * p)
    return [np.concatenate([chunks[r], chunks[2 * p - 1 - r]]) for r in range(p)]


def run(forward=FORWARD, backward=BACKWARD, positions=None, t=16, p=4):
    arrays = [np.random.default_rng(t).standard_normal((1, 2, t, 3)) for _ in range(4)]
    return cp_checks.run_ring(forward, backward, positions or zigzag(t, p), arrays)


# ------------------------------------------------------------------------------ the honest answers


def test_the_solution_passes_every_check():
    assert cp_checks.check_merge(MERGE).startswith("merge: ok")
    assert "equal to dense causal attention to 1e-12" in cp_checks.check_ring_attention(FORWARD, BACKWARD, MERGE)
    verdict = cp_checks.check_balanced_chunks(balanced_with(), FORWARD, BACKWARD)
    assert "4 ranks, 16 chunks: 34 pairs each" in verdict and "3 ranks, 18 chunks: 57 pairs each" in verdict


def test_the_oracle_is_the_engines_attention_and_finite_differences():
    """cp_checks.dense (the check's oracle) against the engine's fused causal attention (itself
    checked against torch) and against central differences of its own forward."""
    rng = np.random.default_rng(3)
    q, k, v, do = (rng.standard_normal((1, 2, 6, 3)) for _ in range(4))
    mask = np.tril(np.ones((6, 6), bool))
    o, lse, dq, dk, dv = cp_checks.dense(q, k, v, do, mask, 0.5)
    qt, kt, vt = (Tensor(a.copy(), requires_grad=True) for a in (q, k, v))
    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=0.5)
    out.backward(do)
    for got, want in ((o, out.data), (dq, qt.grad), (dk, kt.grad), (dv, vt.grad)):
        assert np.abs(got - want).max() < 1e-12
    numeric = numerical_gradient(lambda xs: float((cp_checks.dense(*xs, do, mask, 0.5)[0] * do).sum()),
                                 [q.copy(), k.copy(), v.copy()])
    for got, want in zip((dq, dk, dv), numeric):
        assert np.abs(got - want).max() < 1e-7
    scores = np.where(mask, q @ np.swapaxes(k, -1, -2) * 0.5, -np.inf)
    assert np.allclose(lse, np.log(np.exp(scores).sum(-1)), atol=1e-12)


# ------------------------------------------------------------------------------ wrong answers, their hints


@pytest.mark.parametrize("mistake, fragment", [
    ("no_shift", "exp(lse) is inf"),
    ("no_guard", "-inf - (-inf) is NaN"),
    ("mean", "each block weighs its share"),
    ("max", "np.logaddexp(lse_a, lse_b)"),
])
def test_each_mistake_of_the_merge_gets_its_hint(mistake, fragment):
    with pytest.raises(AssertionError, match="merge on") as caught:
        cp_checks.check_merge(merge_with(mistake))
    assert fragment in str(caught.value), str(caught.value)


@pytest.mark.parametrize("forward, backward, fragment", [
    (forward_with("local_mask"), BACKWARD, "the block's own lower triangle"),
    (forward_with("rank_order"), BACKWARD, "assumes that rank order is position order"),
    (FORWARD, backward_with("not_home"), "the other ranks' queries also attend to your keys"),
    (forward_with("with_positions"), BACKWARD, "K and V only"),
    (forward_with("to_everyone"), BACKWARD, "a ring sends to its neighbour only"),
])
def test_each_mistake_of_the_ring_gets_its_hint(forward, backward, fragment):
    with pytest.raises(AssertionError, match="ring attention on 4 simulated ranks") as caught:
        run(forward, backward)
    assert fragment in str(caught.value), str(caught.value)


def test_a_local_mask_passes_the_contiguous_layout_of_equal_parts_and_fails_the_others():
    """The block's own triangle is right on the diagonal blocks and wrong elsewhere: the check's
    zig-zag and shuffled layouts catch it."""
    with pytest.raises(AssertionError, match="lower triangle"):
        cp_checks.check_ring_attention(forward_with("local_mask"), BACKWARD)


def test_a_ring_of_blocking_sends_is_a_deadlock_with_its_hint():
    with pytest.raises(AssertionError, match="every rank Sends before it Receives"):
        run(forward_with("blocking"), BACKWARD)


def test_a_ring_through_shared_memory_fails_on_what_it_received():
    SHARED.clear()
    with pytest.raises(AssertionError, match="did not depend on what your rank received"):
        run(forward_with("shared"), BACKWARD)


@pytest.mark.parametrize("mistake, fragment", [
    ("contiguous", "equal counts are not equal work"),
    ("uneven", "chunks per rank"),
    ("lost", "exactly one rank"),
])
def test_each_mistake_of_the_layout_gets_its_hint(mistake, fragment):
    with pytest.raises(AssertionError, match="balanced_chunks") as caught:
        cp_checks.check_balanced_chunks(balanced_with(mistake))
    assert fragment in str(caught.value), str(caught.value)


def test_the_engines_merge_is_refused_as_the_answer_and_inside_the_ring():
    with pytest.raises(AssertionError, match=OWN):
        cp_checks.check_merge(merge_attention)
    with pytest.raises(LearnerError, match=OWN):
        run(forward_with("engine_merge"), BACKWARD)


def test_a_stub_says_it_is_a_stub():
    def stub(*args):
        raise NotImplementedError()

    with pytest.raises(LearnerError, match=STUB_HINT[:40]):
        cp_checks.check_merge(stub)
