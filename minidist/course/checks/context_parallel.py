"""The puzzle of exercise 19: the merge of partial attention results, a causal ring over the
simulated ranks, and chunk layouts that balance the causal triangle.

1. :func:`check_merge` takes your ``merge(o_a, lse_a, o_b, lse_b) -> (o, lse)``: two partial
   results of attention over disjoint blocks of keys (o (..., Tq, e), lse (..., Tq), the
   log-sum-exp of each row's scores over its block) merged into the result over both. It is
   compared with dense float64 attention over both blocks, on ordinary scores, on scores up to
   about 2000 (where exp overflows without the max shift), and on rows that see no key of one
   block or of both (lse = -inf: the merge must give the other side unchanged, or o = 0 and
   lse = -inf, never NaN).

2. :func:`check_ring_attention` takes your ``ring_attention_forward(comm, q, k, v, positions,
   scale) -> (o, lse)`` and ``ring_attention_backward(comm, q, k, v, o, lse, do, positions, scale)
   -> (dq, dk, dv)``: causal attention with the sequence cut over the ranks of ``comm``, each rank
   holding the positions ``positions[rank]`` (any order, any layout) of q, k and v, (B, H, t, d)
   float64. On 1 to 4 simulated ranks (every ``Send`` synchronous, as MPI may make any send past its
   eager limit), with contiguous uneven parts, zig-zag parts and a shuffled layout, the output and
   the three gradients must equal dense float64 attention to 1e-12, and the traffic must be a
   ring's: every array message to rank + 1; forward, the K and V of every other rank's part once
   each (2 (P - 1)(T/P) h values per rank for equal parts); backward, at most the forward's again
   plus one dK/dV accumulator per part (P of them). Every rank's answer must come from what it
   received (:func:`~minidist.course.checks.crossing.check_received`).

3. :func:`check_balanced_chunks` takes your ``balanced_chunks(p, n_chunks)``: a causal sequence
   cut into ``n_chunks`` equal chunks (a multiple of 2p), which chunks each of p ranks holds, so
   that every rank does the same work of the causal triangle. Chunk c's queries see chunks
   0 .. c, so rank r's work is the sum of c + 1 over its chunks, in chunk pairs (the pairs the
   engine's ``BlockCounter`` counts). Zig-zag is the answer for 2p chunks; the check asks for
   4p and 6p too, then runs your ring on one of your layouts against dense attention.

The engine's ``merge_attention``, ``causal_mask``, ``context_parallel_attention`` and its ring
may not be the answer nor be called by it; ``attention_block`` and ``attention_block_backward``
(one block's partial result and one block's gradients) may. A failure raises
``AssertionError("what: problem\\nHint: ...")``; your code raising gives a
:class:`minidist.course.checks.LearnerError`. Use::

    from minidist.course.checks import context_parallel as cp_checks
    print(cp_checks.check_merge(merge))
    print(cp_checks.check_ring_attention(ring_attention_forward, ring_attention_backward, merge))
    print(cp_checks.check_balanced_chunks(balanced_chunks, ring_attention_forward, ring_attention_backward))
"""
from __future__ import annotations

import secrets

import numpy as np

from minidist import attention, sim
from minidist.course.checks import (
    DEADLOCK_HINT,
    SynchronousSends,
    call_learner,
    check_own_code,
    fail,
    fail_together,
    forbidding,
)
from minidist.course.checks.crossing import any_right, check_received
from minidist.parallel.context_parallel import dispatch, layout, ring
from minidist.tracing import CountingComm

B, H, D = 1, 2, 3
ATOL = 1e-12
WORLD_SIZES = (1, 2, 3, 4)

HINTS = {
    "merge_overflow": ("your merge overflows: exp(lse) is inf for lse above about 709. Shift by the larger one first: "
                       "lse = np.logaddexp(lse_a, lse_b), then weight o_a by exp(lse_a - lse) and o_b by "
                       "exp(lse_b - lse), numbers between 0 and 1"),
    "merge_empty": ("a row that saw no key of a block has lse = -inf and o = 0 there; merged with the other block it "
                    "must give the other block's result (exp(-inf - lse) = 0), and a row empty in both must stay "
                    "o = 0, lse = -inf. -inf - (-inf) is NaN: where lse is -inf, subtract 0 instead "
                    "(np.where(np.isfinite(lse), lse, 0.0))"),
    "merge_weights": ("the merged output is a weighted sum o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b, with "
                      "lse = logaddexp(lse_a, lse_b): each block weighs its share of the probability mass, and the "
                      "two shares add up to 1 (o_a + o_b, or their mean, weighs them wrong)"),
    "merge_lse": "the merged lse is the log of the sum of both blocks' exponentials: np.logaddexp(lse_a, lse_b)",
    "mask_local": ("your causal mask is the block's own lower triangle: a query sees a key when the key's *position in "
                   "the sequence* is <= the query's, so build it from positions: positions[owner][None, :] <= "
                   "positions[rank][:, None]; a block from an earlier part is whole, a later one hidden"),
    "mask_order": ("your mask assumes that rank order is position order (earlier ranks whole, later ranks skipped): "
                   "with zig-zag or shuffled parts a rank holds early and late positions at once. Build the mask "
                   "from the positions: positions[owner][None, :] <= positions[rank][:, None]"),
    "forward": ("compare with dense causal attention: in step s rank r holds the K/V part of rank r - s, attends its "
                "queries to it under the mask built from the two parts' positions, and merges the partial (o, lse) "
                "into its running one; after P steps every key was seen once"),
    "lse": "return the log-sum-exp of each query's scores over every key it sees: the merged lse after the last step",
    "dkv_home": ("dK and dV of your part hold only your own queries' share: the other ranks' queries also attend to "
                 "your keys. Send an accumulator of dK, dV around the ring beside the K/V block (each rank adds its "
                 "part) and, after the last step, one more hop home"),
    "backward": ("per block: attention_block_backward(q, k_block, v_block, do, lse, delta, scale, mask) with the "
                 "final lse and delta = (do * o).sum(-1); dq adds up over the blocks where it is, dK and dV go to the "
                 "block's owner"),
    "ring_dest": ("a ring sends to its neighbour only: every array message to (rank + 1) % P, every receive from "
                  "(rank - 1) % P"),
    "forward_bytes": ("forward, pass each K/V part on once per step (K and V only: every rank knows every part's "
                      "positions), P - 1 steps: {expected} bytes from this rank"),
    "backward_bytes": ("backward, the K/V parts go round once more (P - 1 steps) and each part's dK/dV accumulator "
                       "P hops: at most {expected} bytes from this rank"),
    "chunks_cover": "every chunk 0 .. n_chunks - 1 must be held by exactly one rank",
    "chunks_count": "every rank holds n_chunks / p chunks, so that every rank holds as many positions",
    "chunks_work": ("equal counts are not equal work: chunk c's queries see c + 1 chunks, so rank r's work is the sum "
                    "of (c + 1) over its chunks. Pair an early chunk with a late one: with 2p chunks rank r holds r "
                    "and 2p - 1 - r (zig-zag); with more, repeat the pairing over each run of 2p chunks"),
}
ENGINE = (attention.merge_attention, attention.causal_mask, dispatch.context_parallel_attention, ring.ring_forward,
          ring.ring_backward, ring.pass_block, layout.rank_chunks, layout.rank_positions)


def _rng(salt, *tag):
    return np.random.default_rng([salt, *tag])


def dense(q, k, v, do, mask, scale):
    """The oracle: one process's float64 attention under the bool ``mask`` (T, T) (True: may
    attend), its output, the log-sum-exp of each row, and dQ, dK, dV for the cotangent ``do``."""
    s = q @ np.swapaxes(k, -1, -2) * scale
    s = np.where(mask, s, -np.inf)
    lse = np.logaddexp.reduce(s, axis=-1)
    p = np.exp(s - lse[..., None])
    o = p @ v
    dp = do @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (do * o).sum(-1, keepdims=True)) * scale
    return o, lse, ds @ k, np.swapaxes(ds, -1, -2) @ q, np.swapaxes(p, -1, -2) @ do


# -- part 1: the merge ------------------------------------------------------------------------


def _merge_case(salt, name, split, big=1.0, hide=None):
    """Keys 0..split-1 in block a, the rest in b; the largest score ``big`` when > 1; ``hide`` a bool
    (Tq, Tk) mask of pairs never seen. Returns the two blocks' results and the whole's."""
    rng = _rng(salt, len(name))
    tq, tk = 5, 7
    q, k, v = rng.standard_normal((2, tq, D)), rng.standard_normal((2, tk, D)), rng.standard_normal((2, tk, D))
    if big > 1:  # the largest score exactly ``big``: exp of it overflows float64 for every salt
        q *= big / (q @ np.swapaxes(k, -1, -2)).max()
    mask = np.ones((tq, tk), bool) if hide is None else ~hide
    with np.errstate(all="ignore"):
        a = attention.attention_block(q, k[:, :split], v[:, :split], 1.0, mask[:, :split])
        b = attention.attention_block(q, k[:, split:], v[:, split:], 1.0, mask[:, split:])
        whole = attention.attention_block(q, k, v, 1.0, mask)
    return a, b, whole


def check_merge(merge) -> str:
    """Check ``merge(o_a, lse_a, o_b, lse_b)`` (module docstring, part 1); returns a verdict."""
    check_own_code(merge, "merge")
    salt = secrets.randbits(32)
    empty_a = np.zeros((5, 7), bool)
    empty_a[1, :3] = True  # row 1 sees nothing of block a
    empty_a[3, :] = True  # row 3 sees nothing at all
    cases = [("ordinary scores", 3, 1.0, None), ("scores up to about 2000", 4, 2000.0, None),
             ("rows that see no key of a block, or none at all", 3, 1.0, empty_a)]
    for name, split, big, hide in cases:
        (o_a, l_a), (o_b, l_b), (o, lse) = _merge_case(salt, name, split, big, hide)
        what = f"merge on {name}"
        with forbidding(*ENGINE), np.errstate(all="ignore"):
            got = call_learner(what, merge, o_a.copy(), l_a.copy(), o_b.copy(), l_b.copy())
        if not isinstance(got, tuple) or len(got) != 2:
            fail(what, f"expected a pair (o, lse), got {type(got).__name__}", "return o, lse")
        got_o, got_lse = (np.asarray(x, dtype=np.float64) for x in got)
        if got_o.shape != o.shape or got_lse.shape != lse.shape:
            fail(what, f"expected shapes {o.shape} and {lse.shape}, got {got_o.shape} and {got_lse.shape}",
                 "o keeps o_a's shape (..., Tq, e), lse lse_a's (..., Tq)")
        if np.isnan(got_o).any() or np.isnan(got_lse).any():
            fail(what, "NaN in the result", HINTS["merge_empty" if hide is not None else "merge_overflow"])
        if not np.allclose(got_lse, lse, rtol=0, atol=1e-12) or (np.isinf(got_lse) != np.isinf(lse)).any():
            fail(what, "lse is not the log-sum-exp over both blocks",
                 HINTS["merge_overflow" if np.isinf(got_lse).any() and big > 1 else "merge_lse"])
        if not np.allclose(got_o, o, rtol=0, atol=1e-12):
            fail(what, f"o differs from attention over both blocks by up to {np.abs(got_o - o).max():.3g}",
                 HINTS["merge_weights"])
    return "merge: ok (ordinary scores, scores up to about 2000, rows empty in one block or in both)"


# -- part 2: the ring --------------------------------------------------------------------------


def layouts(t, p, salt):
    """The layouts the ring is checked on: contiguous (uneven), zig-zag, and a shuffled one
    (each rank a random set of positions, in a random order)."""
    out = {"contiguous": [np.arange(t)[part] for part in np.array_split(np.arange(t), p)]}
    if t >= 2 * p:
        out["zig-zag"] = [np.concatenate([c[r], c[2 * p - 1 - r]]) for c in [np.array_split(np.arange(t), 2 * p)]
                          for r in range(p)]
    shuffled = _rng(salt, t, p).permutation(t)
    out["shuffled"] = [np.asarray(part) for part in np.array_split(shuffled, p)]
    return out


def _wrong_masks(positions, t):
    """The global masks two usual mistakes amount to: the block's local lower triangle, and
    rank order taken for position order."""
    owner, local = np.empty(t, int), np.empty(t, int)
    for r, pos in enumerate(positions):
        owner[pos], local[pos] = r, np.arange(len(pos))
    same = owner[None, :] == owner[:, None]
    return {"mask_local": local[None, :] <= local[:, None],
            "mask_order": (owner[None, :] < owner[:, None]) | (same & (np.arange(t)[None, :] <= np.arange(t)[:, None]))}


def _inputs(salt, t):
    rng = _rng(salt, t, 7)
    return [rng.standard_normal((B, H, t, D)) for _ in range(4)]


def _ring_rank(comm, forward, backward, positions, arrays, scale, counted_comm=True):
    """One rank: its parts, the learner's forward and backward, what it sent each way."""
    rank, p = comm.Get_rank(), comm.Get_size()
    mine = positions[rank]
    q, k, v, do = (a[:, :, mine].copy() for a in arrays)
    counted = CountingComm(comm) if counted_comm else comm
    strict = SynchronousSends(counted)
    what = f"ring_attention_forward on {p} simulated rank{'s' * (p > 1)}"
    with forbidding(*ENGINE):
        result = call_learner(what, forward, strict, q, k, v, [x.copy() for x in positions], scale)
        sent_forward = list(counted.sent) if counted_comm else []
        if not isinstance(result, tuple) or len(result) != 2:
            fail(what, f"expected a pair (o, lse), got {type(result).__name__}", "return o, lse")
        o, lse = (np.asarray(x, dtype=np.float64) for x in result)
        grads = call_learner(what.replace("forward", "backward"), backward, strict, q, k, v, o.copy(), lse.copy(),
                             do, [x.copy() for x in positions], scale)
    sent_backward = list(counted.sent)[len(sent_forward):] if counted_comm else []
    return o, lse, grads, sent_forward, sent_backward


def _bytes_to(sent, dest_ok):
    return sum(m.nbytes for m in sent), all(dest_ok(m.dest) for m in sent)


def _forward_problem(what, o, lse, want, wrong):
    if o.shape != want[0].shape or lse.shape != want[1].shape:
        return what, f"expected o {want[0].shape} and lse {want[1].shape}, got {o.shape} and {lse.shape}", \
            HINTS["forward"]
    if not np.allclose(o, want[0], rtol=0, atol=ATOL):
        for key, other in wrong.items():
            if np.allclose(o, other, rtol=0, atol=1e-9):
                return what, "the output is not causal attention over the whole sequence", HINTS[key]
        return what, f"o differs from dense causal attention by up to {np.nanmax(np.abs(o - want[0])):.3g}", \
            HINTS["forward"]
    if not np.allclose(lse, want[1], rtol=0, atol=ATOL):
        return what, "lse is not each query's log-sum-exp over the keys it sees", HINTS["lse"]
    return None


def _backward_problem(what, grads, want, own):
    if not isinstance(grads, tuple) or len(grads) != 3:
        return what, f"expected (dq, dk, dv), got {type(grads).__name__}", "return dq, dk, dv"
    for name, got, expected, alone in zip(("dq", "dk", "dv"), grads, want, (None, *own)):
        got = np.asarray(got, dtype=np.float64)
        if got.shape != expected.shape:
            return what, f"{name} has shape {got.shape}, expected {expected.shape}", HINTS["backward"]
        if not np.allclose(got, expected, rtol=0, atol=ATOL):
            hint = HINTS["dkv_home"] if alone is not None and np.allclose(got, alone, atol=1e-9) else HINTS["backward"]
            return what, f"{name} differs from dense attention's by up to {np.nanmax(np.abs(got - expected)):.3g}", \
                hint
    return None


def _traffic_problem(what, p, rank, positions, sent_forward, sent_backward):
    if p == 1:
        return None if not sent_forward + sent_backward else (what, "one rank sent messages", HINTS["ring_dest"])
    part = [len(pos) * B * H * 2 * D * 8 for pos in positions]  # K and V of each part, float64
    forward_expected = sum(part[(rank - s) % p] for s in range(p - 1))
    backward_most = forward_expected + sum(part)
    nbytes, to_next = _bytes_to(sent_forward, lambda dest: dest == (rank + 1) % p)
    back_bytes, back_next = _bytes_to(sent_backward, lambda dest: dest == (rank + 1) % p)
    if not (to_next and back_next):
        return what, "sent to a rank other than its neighbour rank + 1", HINTS["ring_dest"]
    if nbytes != forward_expected:
        return what, f"sent {nbytes} bytes forward, expected {forward_expected}", \
            HINTS["forward_bytes"].format(expected=forward_expected)
    if back_bytes > backward_most:
        return what, f"sent {back_bytes} bytes backward, more than {backward_most}", \
            HINTS["backward_bytes"].format(expected=backward_most)
    return None


def _ring_world(comm, forward, backward, positions, arrays, scale, want, wrong):
    """Every rank: the learner's ring, each result against the oracle, the traffic against a ring's."""
    rank, p = comm.Get_rank(), comm.Get_size()
    mine = positions[rank]
    o, lse, grads, sent_forward, sent_backward = _ring_rank(comm, forward, backward, positions, arrays, scale)
    what = f"ring attention on {p} simulated rank{'s' * (p > 1)}"
    fail_together(comm, _forward_problem(what + ", forward", o, lse, [w[:, :, mine] for w in want[:2]],
                                         {key: w[:, :, mine] for key, w in wrong.items()}))
    own = _own_share(arrays, mine, want, scale)
    fail_together(comm, _backward_problem(what + ", backward", grads, [w[:, :, mine] for w in want[2:]], own))
    fail_together(comm, _traffic_problem(what, p, rank, positions, sent_forward, sent_backward))


def _own_share(arrays, mine, want, scale):
    """dK, dV of this rank's keys from its own queries alone: the mistake of gradients never sent home."""
    q, k, v, do = (a[:, :, mine] for a in arrays)
    mask = mine[None, :] <= mine[:, None]
    s = np.where(mask, q @ np.swapaxes(k, -1, -2) * scale, -np.inf)
    lse = want[1][:, :, mine]
    prob = np.exp(s - lse[..., None])
    o = want[0][:, :, mine]
    ds = prob * (do @ np.swapaxes(v, -1, -2) - (do * o).sum(-1, keepdims=True)) * scale
    return np.swapaxes(ds, -1, -2) @ q, np.swapaxes(prob, -1, -2) @ do


def _still_right(comm, forward, backward, positions, arrays, scale, want):
    """Under spoiled messages: whether any value this rank's queries got from other ranks' keys is right."""
    rank = comm.Get_rank()
    mine = positions[rank]
    foreign = np.ones(arrays[0].shape[2], bool)
    foreign[mine] = False
    sees = (np.arange(len(foreign))[None, :] <= mine[:, None]) & foreign[None, :]  # rows that see another's key
    rows = sees.any(axis=1)
    o, *_ = _ring_rank(comm, forward, backward, positions, arrays, scale, counted_comm=False)
    return bool(rows.any()) and any_right(o[:, :, rows], want[0][:, :, mine][:, :, rows], 1e-9)


def run_ring(forward, backward, positions, arrays, salt=0):
    """Run the learner's ring on ``positions`` (one array per rank) against dense attention;
    fails with a hint. Returns the number of ranks."""
    p, t = len(positions), arrays[0].shape[2]
    scale = D ** -0.5
    causal = np.arange(t)[None, :] <= np.arange(t)[:, None]
    want = dense(*arrays[:3], arrays[3], causal, scale)
    wrong = {key: dense(*arrays[:3], arrays[3], mask, scale)[0] for key, mask in _wrong_masks(positions, t).items()}
    try:
        sim.World(p, timeout=60).run(_ring_world, forward, backward, positions, arrays, scale, want, wrong)
    except (sim.DeadlockError, sim.SimTimeoutError) as error:
        fail(f"ring attention on {p} simulated ranks", str(error).splitlines()[0], DEADLOCK_HINT)
    check_received(f"ring attention on {p} simulated ranks", p, _still_right, forward, backward, positions, arrays,
                   scale, want)
    return p


def check_ring_attention(forward, backward, merge=None) -> str:
    """Check the learner's ring (module docstring, part 2) on 1 to 4 simulated ranks; returns a verdict."""
    for fn, name in ((forward, "ring_attention_forward"), (backward, "ring_attention_backward"), (merge, "merge")):
        if fn is not None:
            check_own_code(fn, name)
    salt = secrets.randbits(32)
    done = []
    for p in WORLD_SIZES:
        t = 4 * p + 1 if p > 1 else 5  # no P > 1 divides it
        arrays = _inputs(salt, t)
        for name, positions in layouts(t, p, salt).items():
            run_ring(forward, backward, positions, arrays, salt)
            done.append(f"{name} P = {p}")
    return (f"ring attention: ok, output and dQ, dK, dV equal to dense causal attention to 1e-12 in float64 "
            f"({len(done)} layouts on 1 to 4 ranks, T = 4P + 1), each K/V part passed on once per step, every message "
            "to the next rank")


# -- part 3: the balanced layout ---------------------------------------------------------------

CHUNK_CASES = ((1, 2), (2, 4), (3, 6), (4, 8), (2, 8), (4, 16), (3, 18))


def chunk_work(chunks_of_rank) -> int:
    """The chunk pairs of the causal triangle a rank holding these chunks computes: chunk c's
    queries see chunks 0 .. c, so c + 1 pairs each (the diagonal one masked)."""
    return sum(int(c) + 1 for c in chunks_of_rank)


def check_balanced_chunks(balanced_chunks, forward=None, backward=None) -> str:
    """Check ``balanced_chunks(p, n_chunks)`` (module docstring, part 3), then, given the ring,
    run it on the layout for p = 4, 16 chunks; returns a verdict."""
    check_own_code(balanced_chunks, "balanced_chunks")
    lines = []
    for p, n_chunks in CHUNK_CASES:
        what = f"balanced_chunks({p}, {n_chunks})"
        with forbidding(*ENGINE):
            got = call_learner(what, balanced_chunks, p, n_chunks)
        try:
            ranks = [[int(c) for c in chunks] for chunks in got]
        except (TypeError, ValueError):
            fail(what, f"expected a list of {p} lists of chunk indices, got {got!r}", HINTS["chunks_cover"])
        if len(ranks) != p or sorted(c for chunks in ranks for c in chunks) != list(range(n_chunks)):
            fail(what, f"got {ranks}: not every chunk 0..{n_chunks - 1} exactly once over {p} ranks",
                 HINTS["chunks_cover"])
        if len({len(chunks) for chunks in ranks}) != 1:
            fail(what, f"chunks per rank {[len(c) for c in ranks]} differ", HINTS["chunks_count"])
        work = [chunk_work(chunks) for chunks in ranks]
        if len(set(work)) != 1:
            fail(what, f"the ranks compute {work} chunk pairs of the causal triangle (layout {ranks})",
                 HINTS["chunks_work"])
        lines.append(f"{p} rank{'s' * (p > 1)}, {n_chunks} chunks: {work[0]} pairs each")
    if forward is not None and backward is not None:
        p, n_chunks, size = 4, 16, 2
        ranks = [[int(c) for c in chunks] for chunks in call_learner("balanced_chunks(4, 16)", balanced_chunks,
                                                                      p, n_chunks)]
        positions = [np.concatenate([np.arange(c * size, (c + 1) * size) for c in chunks]) for chunks in ranks]
        run_ring(forward, backward, positions, _inputs(secrets.randbits(32), n_chunks * size))
        lines.append("your ring on your layout for 4 ranks and 16 chunks: equal to dense causal attention")
    return "balanced_chunks: ok\n" + "\n".join(lines)


__all__ = ["HINTS", "check_balanced_chunks", "check_merge", "check_ring_attention", "chunk_work", "dense", "layouts",
           "run_ring"]
