"""The checks of exercise 18: resume on another world size, with the two things an elastic
resume needs (chapter 18): the optimizer state resharded (PyTorch's distributed checkpoint, DCP:
each saved piece carries its offset and length, a new rank copies the overlaps) and the data
position stored as global samples consumed (a per-rank count repeats and skips samples on
another number of ranks: the bug allenai/OLMo #176 fixed, chapter 18).

Your ``reshard(pieces, numel, world_size, rank)``: ``pieces`` are the N pieces a ZeRO-1 run saved
of a flat float64 vector of ``numel`` numbers, one dict ``{"offset", "length", "values"}`` per
saving rank in rank order; piece q covers ``[q s, q s + s)``, ``s = ceil(numel / N)``, so the
last piece is padded (a piece may be padding only) and the padding's values (NaN here) must never
be read. It returns rank ``rank`` of ``world_size``'s piece, float64 ``(ceil(numel /
world_size),)``: the saved numbers where it overlaps them, 0.0 as its padding; a position below
``numel`` that no piece covers raises ValueError. :func:`check_reshard`: :data:`RESHARD_CASES`
on every rank of M against the vector itself, and :data:`LOST` (ValueError expected where a lost
piece held numbers, none where it held padding only).

Your ``ElasticSampler(num_samples, global_batch_size, world_size, rank, seed)``: an epoch is one
permutation from ``np.random.default_rng([seed, epoch])`` (every rank the same), ``num_samples //
G`` steps, step s the global batch ``perm[s G : (s + 1) G]`` (the last ``num_samples mod G`` are
not read), rank r of M reading its *contiguous* part as ``numpy.array_split`` cuts it (the first
``G mod M`` ranks one row more; :func:`expected_parts`, as ``data.GlobalBatchSampler``).
``next_indices()`` returns this rank's part of the next step (into the next epoch after the last
step); ``state_dict()`` is the position (the epoch, the global samples consumed in it), which
``load_state_dict`` restores on a sampler of another world size. :func:`check_elastic_sampler`
runs :data:`PLANS`, the ranks emulated in one process; at each change the old ranks save rank 0's
``state_dict()`` (one copy, as a checkpoint does) and run one more step, lost with the failure,
and every new rank loads a copy of the saved state (a position kept outside it, in a class
attribute, is a step ahead). Before the plans, :func:`check_own_position` makes two sets of
samplers alike, one after the other, and fails with its own hint when the second does not read
what the first read first (a position kept in a class attribute or a global, which every sampler
of the process shares; under mpiexec every rank is a process of its own). Every rank's part of
every step must be :func:`expected_parts`'s (contiguous: strided parts would give the same
weights); the first step that differs names a sample read twice, never, or ahead of its step,
with a hint.

:func:`check_elastic_training` trains with both: least squares on :data:`NUM_SAMPLES` seeded
float64 samples (:data:`FEATURES` weights and a bias: 11 numbers, which no world size of the
plans but 1 divides), SGD with momentum (torch's ``v = mu v + g``, ``w -= lr v``), the momentum
sharded ZeRO-1-style; each rank's mean gradient weighted by ``rows / G`` in the sum. At each
change of world size the old pieces are saved with NaN padding and the new ones built by your
``reshard`` (checked as above); at the end the weights must equal one process's on the global
batch to :data:`WEIGHTS_TOL`.

A failure raises ``AssertionError("what: problem\\nHint: ...")``; your code raising gives a
:class:`minidist.course.checks.LearnerError` with your line. The engine's ``resharding.assemble``
and ``reshard_parts``, ``data.GlobalBatchSampler`` and ``data.split_global_batch``, and this
module's :func:`expected_parts` raise while your code runs; the vectors ``check_reshard`` saves
are drawn afresh at every call. On success each check returns its verdict::

    from minidist.course.checks import elastic as elastic_checks
    print(elastic_checks.check_reshard(reshard))
    print(elastic_checks.check_elastic_sampler(ElasticSampler))
    print(elastic_checks.check_elastic_training(ElasticSampler, reshard))

Longer than 400 lines: exercise 18's checks, each with the hints for the usual wrong turns, as the
runner calls them in order.
"""
from __future__ import annotations

import copy
import functools
import secrets
import sys

import numpy as np

from minidist import data, resharding
from minidist.course.checks import armed, call_learner, check_own_code, fail, forbidding, learner_error, learner_line
from minidist.course.checks.integrity import unchanged

NUM_SAMPLES, FEATURES = 50, 10  # the model: FEATURES weights and a bias, 11 numbers
LR, MOMENTUM = 0.05, 0.9
WEIGHTS_TOL = 1e-10  # float64: the ranks' weighted sum of means against one mean, rounding only
# (global batch G, seed, [(world size, steps), ...]): each starts afresh, then resumes on each next world size
PLANS = (
    (12, 18, ((4, 3), (2, 3), (3, 2))),  # 4 steps an epoch (2 samples left); 2 ranks cross into epoch 1
    (10, 5, ((4, 2), (3, 8))),  # neither 4 nor 3 divides 10: parts 3, 3, 2, 2 then 4, 3, 3
    (16, 0, ((4, 4), (3, 3), (1, 2), (5, 3))),  # 6, 5, 5 on 3; the change to 5 falls on an epoch's end
)
# (numel, saved by N ranks, read by M ranks), each read by every rank of M
RESHARD_CASES = ((10, 3, 2), (11, 4, 3), (11, 2, 5), (5, 4, 4), (1, 2, 3), (7, 3, 6))
LOST = ((11, 4, 3, 1), (5, 4, 2, 3))  # (numel, N, M, the piece lost): 1 holds 3..5; 3 is padding only
SAMPLER_METHODS = ("__init__", "next_indices", "state_dict", "load_state_dict")

HINTS = {
    "padding": ("positions >= numel are padding: the saved padding holds garbage (NaN here), so never copy it; your "
                "piece's own padding is 0.0 (np.zeros, then copy only the overlaps with positions below numel)"),
    "overlap": ("rank r of M holds positions [r s, r s + s), s = ceil(numel / M), which on another number of ranks "
                "is not any saved piece: copy from each piece the part of [piece['offset'], piece['offset'] + "
                "piece['length']) that overlaps your range, at the right place in yours"),
    "shape": "return ceil(numel / world_size) numbers, float64, the padding included",
    "lost": ("a position below numel that no saved piece covers must raise ValueError naming it: a silent 0 would "
             "restart that momentum from nothing and nobody would notice"),
    "covered": ("only positions below numel need a saved piece; the padding (positions >= numel) needs none, so a "
                "lost piece that was all padding is no error"),
    "type": "next_indices() returns this rank's sample indices of the step: a 1-D array of ints",
    "remainder": ("when M does not divide G, cut the global batch as numpy.array_split does: the first G mod M ranks "
                  "read one more row; G // M rows per rank leaves G mod M samples of every step unread"),
    "strided": ("rank r reads one contiguous slice of the global batch, np.array_split(batch, M)[r], not every M-th "
                "sample (batch[r::M]): the same samples overall, but not the parts this exercise (and the engine) "
                "asks for"),
    "sizes": "the first G mod M ranks read one more row (numpy.array_split's cut: G = 10 on 4 ranks is 3, 3, 2, 2)",
    "contiguous": "rank r's part is np.array_split(batch, M)[r]: a contiguous slice, in the permutation's order",
    "seed": ("every rank must draw the same permutation, np.random.default_rng([seed, epoch]), with no rank in it: "
             "ranks with their own orders read some samples twice and others never"),
    "order": ("step s of an epoch is perm[s * G : (s + 1) * G], perm = np.random.default_rng([seed, epoch])"
              ".permutation(num_samples), the same on every rank; a new sampler starts at epoch 0, step 0"),
    "epoch": ("an epoch is num_samples // G steps; after its last step the next epoch starts at its step 0, with the "
              "permutation of [seed, epoch + 1] (the num_samples mod G samples left at the end are not read)"),
    "position": ("the position must mean the same on any number of ranks: save the epoch and the global samples "
                 "consumed in it (steps x G), not what this rank read (its part's size changes with the world size)"),
    "state": ("load_state_dict must restore only the position (epoch, global samples): this sampler's rank and world "
              "size are its own, not those of the sampler that saved the state"),
    "resume": ("go on from the state loaded: the old ranks ran one step after their state_dict(), lost with the "
               "failure, and you read on from there. Keep the position in self, not in a class attribute or a global"),
    "outside": ("keep the position in self (self.epoch, self.consumed...) and in state_dict(), not in a class "
                "attribute or a global: those are shared by every sampler of the process (the ranks this check "
                "emulates, and every sampler made before), so a new sampler does not start at epoch 0, step 0 and a "
                "resumed one does not read on from the state it loaded. Under mpiexec every rank is a process of its "
                "own, and a checkpoint holds only state_dict(). Draw only from np.random.default_rng([seed, epoch])"),
}
PROBE = (8, 2, 2)  # check_own_position: G (no plan's), the ranks of a world, the steps the first world reads


def expected_parts(num_samples: int, global_batch_size: int, world_size: int, seed: int, epoch: int,
                   step: int) -> list[np.ndarray]:
    """The parts of step ``step`` of epoch ``epoch``, one int64 array per rank: the global batch
    ``perm[step G : (step + 1) G]`` of ``np.random.default_rng([seed, epoch]).permutation(num_samples)``
    cut as ``numpy.array_split`` cuts it (the first ``G mod M`` ranks one row more)."""
    perm = np.random.default_rng([seed, epoch]).permutation(num_samples)
    return np.array_split(perm[step * global_batch_size : (step + 1) * global_batch_size], world_size)


@functools.cache
def dataset() -> tuple[np.ndarray, np.ndarray]:
    """The training set: ``X`` float64 (NUM_SAMPLES, FEATURES + 1), its last column ones (the
    bias), and ``y`` float64 (NUM_SAMPLES,) = X w* + noise (seeded)."""
    rng = np.random.default_rng(18)
    X = np.hstack([rng.standard_normal((NUM_SAMPLES, FEATURES)), np.ones((NUM_SAMPLES, 1))])
    return X, X @ rng.standard_normal(FEATURES + 1) + 0.1 * rng.standard_normal(NUM_SAMPLES)


def gradient(w: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The gradient of the mean over ``rows`` of ``(x . w - y)^2 / 2`` (float64, like ``w``)."""
    X, y = dataset()
    residual = X[rows] @ w - y[rows]
    return X[rows].T @ residual / len(rows)


def single_process(global_batch_size: int, seed: int, steps: int) -> np.ndarray:
    """The weights after ``steps`` steps of one process on the global batches (the reference)."""
    w, velocity = np.zeros(FEATURES + 1), np.zeros(FEATURES + 1)
    per_epoch = NUM_SAMPLES // global_batch_size
    for t in range(steps):
        batch = np.concatenate(expected_parts(NUM_SAMPLES, global_batch_size, 1, seed, *divmod(t, per_epoch)))
        velocity = MOMENTUM * velocity + gradient(w, batch)
        w = w - LR * velocity
    return w


# ----------------------------------------------------------------------------- reshard


def _saved(vector: np.ndarray, world_size: int) -> list[dict]:
    """``vector``'s ZeRO-1 pieces on ``world_size`` ranks, NaN in the padding."""
    size = -(-vector.size // world_size)
    padded = np.concatenate([vector, np.full(world_size * size - vector.size, np.nan)])
    return [{"offset": q * size, "length": size, "values": padded[q * size : (q + 1) * size].copy()}
            for q in range(world_size)]


def _piece_problem(got, vector: np.ndarray, world_size: int, rank: int):
    """(problem, hint) for rank ``rank``'s resharded piece of ``vector``, or None."""
    numel, size = vector.size, -(-vector.size // world_size)
    start, real = rank * size, max(0, min(size, vector.size - rank * size))
    if got is None:
        return "returned None", "return the piece (did you forget the return?)"
    got = np.asarray(got)
    if got.shape != (size,):
        return (f"expected {size} numbers (positions {start}..{start + size}), got shape {got.shape}",
                HINTS["shape"] + (" (your piece lacks its padding)" if got.shape == (real,) else ""))
    if got.dtype != np.float64:
        return f"expected float64 numbers, got dtype {got.dtype}", HINTS["shape"]
    nan = np.flatnonzero(np.isnan(got))
    if nan.size:
        return f"position {start + nan[0]} holds NaN, the saved padding's value", HINTS["padding"]
    wrong = np.flatnonzero(got[:real] != vector[start : start + real])
    if wrong.size:
        k = wrong[0]
        return f"position {start + k} holds {got[k]!r}, expected {vector[start + k]!r}", HINTS["overlap"]
    if np.any(got[real:] != 0):
        k = real + int(np.flatnonzero(got[real:] != 0)[0])
        return f"position {start + k} (>= numel = {numel}: padding) holds {got[k]!r}, expected 0.0", HINTS["padding"]
    return None


def call_reshard(what: str, reshard, pieces: list[dict], numel: int, world_size: int, rank: int):
    """Your ``reshard`` on a copy of ``pieces``; when it raises, a LearnerError whose hint is about
    coverage for a ValueError of your own ``raise`` (padding needs no piece), else about the overlaps."""
    try:
        with armed():
            return reshard(copy.deepcopy(pieces), numel, world_size, rank)
    except AssertionError:
        raise
    except Exception as error:  # every learner error becomes a check failure
        own_raise = isinstance(error, ValueError) and learner_line(error).split(": ", 1)[-1].startswith("raise")
        raise learner_error(what, error, "your reshard", HINTS["covered" if own_raise else "overlap"]) from None


def reshard_into(reshard, vector: np.ndarray, saved_by: int, world_size: int, what: str) -> list[np.ndarray]:
    """Every rank of ``world_size``'s piece of ``vector`` from its pieces saved by ``saved_by``
    ranks, read by your ``reshard``; each checked (AssertionError with a hint when wrong)."""
    pieces, out = _saved(vector, saved_by), []
    for rank in range(world_size):
        label = (f"{what}: reshard(pieces of {saved_by} ranks, numel={vector.size}, world_size={world_size}, "
                 f"rank={rank})")
        got = call_reshard(label, reshard, pieces, vector.size, world_size, rank)
        problem = _piece_problem(got, vector, world_size, rank)
        if problem:
            fail(label, *problem)
        out.append(np.array(got, dtype=np.float64))
    return out


def _vector(numel: int, salt: int) -> np.ndarray:
    """The vector of ``numel`` float64 numbers ``check_reshard`` saves (``salt``: drawn at every call)."""
    return np.random.default_rng([salt, numel]).standard_normal(numel)


def _check_lost(reshard, numel: int, saved_by: int, world_size: int, lost: int, salt: int) -> None:
    pieces = _saved(_vector(numel, salt), saved_by)
    gone = pieces.pop(lost)
    holes = set(range(gone["offset"], min(numel, gone["offset"] + gone["length"])))
    size = -(-numel // world_size)
    for rank in range(world_size):
        label = (f"reshard with piece {lost} of {saved_by} lost (numel={numel}, world_size={world_size}, "
                 f"rank={rank})")
        if not holes & set(range(rank * size, rank * size + size)):
            got = call_reshard(label, reshard, pieces, numel, world_size, rank)
            problem = _piece_problem(got, _vector(numel, salt), world_size, rank)
            if problem:
                fail(label, *problem)
            continue
        try:
            with armed():
                reshard(copy.deepcopy(pieces), numel, world_size, rank)
        except ValueError:
            continue
        except AssertionError:
            raise
        except Exception as error:  # the learner's code raised something else
            raise learner_error(label, error, "your reshard", HINTS["lost"]) from None
        fail(label, f"positions {min(holes)}..{max(holes)} are in no saved piece, and no ValueError was raised",
             HINTS["lost"])


@forbidding(resharding.assemble, resharding.reshard_parts)
@unchanged(sys.modules[__name__], np)
def check_reshard(reshard) -> str:
    """Check your ``reshard(pieces, numel, world_size, rank)`` (module docstring) on
    :data:`RESHARD_CASES` and :data:`LOST`. Returns the verdict; raises AssertionError with a
    hint, or LearnerError."""
    check_own_code(reshard, "reshard")
    salt = secrets.randbits(64)  # values nobody can compute ahead of the call
    for numel, saved_by, world_size in RESHARD_CASES:
        reshard_into(reshard, _vector(numel, salt), saved_by, world_size, f"{numel} numbers saved by {saved_by} ranks")
    for case in LOST:
        _check_lost(reshard, *case, salt)
    cases = ", ".join(f"{n}: {a} -> {b}" for n, a, b in RESHARD_CASES)
    return (f"reshard: ok on every rank ({cases}), the padding never read; a lost piece raises ValueError, "
            f"a lost piece of padding only does not")


# ----------------------------------------------------------------------------- the sampler


def _indices(value, what: str) -> np.ndarray:
    array = np.asarray(value) if value is not None else None
    if array is None or array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        fail(what, f"returned {value!r}", HINTS["type"])
    return array.astype(np.int64)


def _same(parts, want) -> bool:
    return len(parts) == len(want) and all(np.array_equal(p, w) for p, w in zip(parts, want))


def _hint_for_reads(parts, G, seed, epoch, step, resumed_from):
    """The hint for a step whose parts are not the global batch read once (``resumed_from``: the
    previous world size when this is the first step after a change, else None)."""
    M, per_epoch = len(parts), NUM_SAMPLES // G
    if G % M and [len(p) for p in parts] == [G // M] * M:
        return HINTS["remainder"]
    nearby = [(e, s) for e in range(max(0, epoch - 1), epoch + 2) for s in range(per_epoch)]
    if resumed_from:
        before = [part for e, s in nearby for part in expected_parts(NUM_SAMPLES, G, resumed_from, seed, e, s)]
        if all(any(np.array_equal(p, part) for part in before) for p in parts):
            return HINTS["state"]
        mine = {(e, s): expected_parts(NUM_SAMPLES, G, M, seed, e, s) for e, s in nearby}
        found = [next(((e, s) for (e, s), want in mine.items() if np.array_equal(p, want[r])), None)
                 for r, p in enumerate(parts)]
        if all(found):
            e, s = next(f for f in found if f != (epoch, step))
            following = (epoch, step + 1) if step + 1 < per_epoch else (epoch + 1, 0)
            if set(found) == {following}:
                return HINTS["resume"]
            return HINTS["position"] + f" (here a rank read its part of step {s} of epoch {e})"
    if step == 0 and epoch > 0:
        return HINTS["epoch"]
    want = expected_parts(NUM_SAMPLES, G, M, seed, epoch, step)
    got = np.concatenate(parts)
    if any(np.array_equal(p, w) for p, w in zip(parts, want)) or np.unique(got).size < got.size:
        return HINTS["seed"]
    return HINTS["order"]


def _reads_problem(parts, G, seed, epoch, step, read_before, resumed_from=None):
    """(problem, hint) for step ``step`` of epoch ``epoch`` (``read_before``: the indices read
    in the epoch's earlier steps), or None when every rank read exactly its part."""
    M = len(parts)
    want = expected_parts(NUM_SAMPLES, G, M, seed, epoch, step)
    if _same(parts, want):
        return None
    batch, got = np.concatenate(want), np.concatenate(parts)
    if np.array_equal(np.sort(got), np.sort(batch)):  # the right samples, cut otherwise
        r = next(r for r, (p, w) in enumerate(zip(parts, want)) if not np.array_equal(p, w))
        if all(np.array_equal(p, batch[k::M]) for k, p in enumerate(parts)):
            hint = HINTS["strided"]
        else:
            hint = HINTS["sizes"] if [len(p) for p in parts] != [len(w) for w in want] else HINTS["contiguous"]
        return (f"each sample of the global batch was read once, but rank {r} read {parts[r].tolist()}, expected "
                f"{want[r].tolist()}", hint)
    perm = np.random.default_rng([seed, epoch]).permutation(NUM_SAMPLES)
    prefix = perm[: (step + 1) * G]
    read = np.concatenate([np.asarray(read_before, dtype=np.int64), got])
    counts = np.bincount(read[(read >= 0) & (read < NUM_SAMPLES)], minlength=NUM_SAMPLES)
    twice = [int(i) for i in prefix if counts[i] >= 2]
    never = [int(i) for i in prefix if counts[i] == 0]
    ahead = [int(i) for i in got if i not in set(prefix.tolist())]
    found = []
    if twice:
        found.append(f"sample {twice[0]} is read twice in epoch {epoch} ({len(twice)} such samples so far)")
    if never:
        steps = f"steps 0..{step}" if step else "step 0"
        found.append(f"sample {never[0]} is never read ({len(never)} samples of {steps} unread)")
    if ahead:
        place = np.flatnonzero(perm == ahead[0])
        where = (f"step {place[0] // G} of epoch {epoch}" if place.size and place[0] < (NUM_SAMPLES // G) * G
                 else f"no step of epoch {epoch}")
        found.append(f"sample {ahead[0]} is read here though it belongs to {where}")
    sizes = ", ".join(str(len(p)) for p in parts)
    problem = "; ".join(found) + f" (ranks read {sizes} samples, expected {', '.join(str(len(w)) for w in want)})"
    return problem, _hint_for_reads(parts, G, seed, epoch, step, resumed_from)


def run_sampler(Sampler, G: int, seed: int, stretches, on_step=None, on_change=None) -> None:
    """Run ``Sampler`` along one plan (module docstring): a fresh sampler per rank of each world
    size of ``stretches``, every step checked (AssertionError with a hint). ``on_step(t, parts)``
    and ``on_change(old, new)`` let the training follow."""
    per_epoch, t, samplers, previous, read, state = NUM_SAMPLES // G, 0, None, None, [], None
    for k, (M, steps) in enumerate(stretches):
        label = f"G = {G}, {M} ranks" + (f" (resumed from {previous} ranks)" if previous else "")
        new = [call_learner(f"{label}: ElasticSampler({NUM_SAMPLES}, {G}, {M}, {r}, seed={seed})", Sampler,
                            NUM_SAMPLES, G, M, r, seed, name="your ElasticSampler") for r in range(M)]
        if samplers is not None:
            for r, sampler in enumerate(new):
                call_learner(f"{label}: rank {r}'s load_state_dict(rank 0's state of {previous} ranks)",
                             sampler.load_state_dict, copy.deepcopy(state), name="your load_state_dict")
            if on_change:
                on_change(previous, M)
        samplers, first = new, True
        for _ in range(steps):
            epoch, step = divmod(t, per_epoch)
            what = f"{label}, step {step} of epoch {epoch}"
            parts = [_indices(call_learner(f"{what}: rank {r}'s next_indices()", s.next_indices,
                                           name="your next_indices"), f"{what}: rank {r}'s next_indices()")
                     for r, s in enumerate(samplers)]
            problem = _reads_problem(parts, G, seed, epoch, step, read if step else [], first and previous)
            if problem:
                fail(what + (", the first step after the change" if first and previous else ""), *problem)
            read = (read if step else []) + np.concatenate(parts).tolist()
            if on_step:
                on_step(t, parts)
            t, first = t + 1, False
        if k + 1 < len(stretches):  # the checkpoint, then one more step whose update the failure loses
            state = copy.deepcopy(call_learner(f"{label}: rank 0's state_dict()", samplers[0].state_dict,
                                               name="your state_dict"))
            for r, sampler in enumerate(samplers):
                call_learner(f"{label}, the step after the checkpoint (lost with the failure): rank {r}'s "
                             "next_indices()", sampler.next_indices, name="your next_indices")
        previous = M


def check_own_position(Sampler) -> None:
    """Two worlds of samplers made alike (rank r of :data:`PROBE`'s M, G, a seed drawn now, so
    no plan's), the second made after the first read :data:`PROBE`'s steps: its first step must
    read what the first world's first step read. AssertionError with ``HINTS["outside"]`` when it
    does not (the position lives outside the samplers, or they draw at random)."""
    G, M, steps = PROBE
    seed = secrets.randbits(32)
    label = f"ElasticSampler({NUM_SAMPLES}, {G}, {M}, rank, seed={seed})"

    def world(which):
        return [call_learner(f"{label}, the {which} samplers made alike: rank {r}", Sampler, NUM_SAMPLES, G, M, r,
                             seed, name="your ElasticSampler") for r in range(M)]

    def step(samplers, what):
        return [_indices(call_learner(f"{what}: rank {r}'s next_indices()", s.next_indices, name="your next_indices"),
                         f"{what}: rank {r}'s next_indices()") for r, s in enumerate(samplers)]

    first = world("first")
    reads = [step(first, f"{label}, the first samplers, step {k}") for k in range(steps)]
    again = step(world("second"), f"{label}, the second samplers made alike, their first step")
    if _same(again, reads[0]):
        return
    per_epoch = NUM_SAMPLES // G
    where = next((f" (step {s} of epoch {e}'s parts)" for e in range(2) for s in range(per_epoch)
                  if _same(again, expected_parts(NUM_SAMPLES, G, M, seed, e, s))), "")
    fail(f"{label}: a second set of {M} samplers made after the first set read {steps} steps",
         f"their first step read {[p.tolist() for p in again]}{where}, the first set's first step "
         f"{[p.tolist() for p in reads[0]]}: a new sampler must start at epoch 0, step 0, whatever other samplers "
         "of the process did", HINTS["outside"])


def _describe(G: int, stretches) -> str:
    parts = [f"{M} rank{'s' if M > 1 else ''} ({', '.join(str(len(p)) for p in np.array_split(np.arange(G), M))}) "
             f"x {steps}" for M, steps in stretches]
    steps, per_epoch = sum(s for _, s in stretches), NUM_SAMPLES // G
    left = NUM_SAMPLES - per_epoch * G
    return (f"G = {G} ({per_epoch} steps an epoch, {left} samples left): {' -> '.join(parts)}: "
            f"{steps} steps, epochs 0-{(steps - 1) // per_epoch}")


# The engine's sampler, which the learner's may not call
ENGINE_SAMPLER = (data.GlobalBatchSampler.__init__, data.GlobalBatchSampler.__iter__,
                  data.GlobalBatchSampler.permutation, data.split_global_batch)


@forbidding(*ENGINE_SAMPLER, expected_parts)
@unchanged(sys.modules[__name__], data, np)
def check_elastic_sampler(ElasticSampler) -> str:
    """Check your ``ElasticSampler`` (module docstring) along :data:`PLANS`: every rank's part of
    every step. Returns the verdict (a line per plan); raises AssertionError with a hint, or
    LearnerError."""
    check_own_code(ElasticSampler, "ElasticSampler", methods=SAMPLER_METHODS)
    check_own_position(ElasticSampler)
    lines = []
    for G, seed, stretches in PLANS:
        run_sampler(ElasticSampler, G, seed, stretches)
        lines.append(_describe(G, stretches) + ": each rank read its contiguous part, every sample once")
    return "ElasticSampler: ok\n" + "\n".join(lines)


# ----------------------------------------------------------------------------- training


@forbidding(resharding.assemble, resharding.reshard_parts, *ENGINE_SAMPLER, expected_parts)
@unchanged(sys.modules[__name__], data, resharding, np)
def check_elastic_training(ElasticSampler, reshard) -> str:
    """Train with your sampler and your ``reshard`` along :data:`PLANS` (module docstring):
    ZeRO-1's momentum resharded at each change, the weights against :func:`single_process`.
    Returns the verdict (a line per plan); raises AssertionError with a hint, or LearnerError."""
    check_own_code(ElasticSampler, "ElasticSampler", methods=SAMPLER_METHODS)
    check_own_code(reshard, "reshard")
    check_own_position(ElasticSampler)
    n, lines = FEATURES + 1, []
    for G, seed, stretches in PLANS:
        M0 = stretches[0][0]
        run = {"w": np.zeros(n), "velocity": [np.zeros(-(-n // M0)) for _ in range(M0)], "pieces": []}

        def on_change(old, new, run=run, G=G):
            size = -(-n // old)
            momentum = np.concatenate(run["velocity"])[:n]
            run["velocity"] = reshard_into(reshard, momentum, old, new, f"G = {G}, momentum of {old} ranks")
            run["pieces"].append(f"{size} -> {-(-n // new)}")

        def on_step(t, parts, run=run, G=G):
            M = len(parts)
            size = -(-n // M)
            g = sum(len(p) / G * gradient(run["w"], p) for p in parts)  # each rank's mean, weighted by rows / G
            g, w = np.concatenate([g, np.zeros(M * size - n)]), np.concatenate([run["w"], np.zeros(M * size - n)])
            for r in range(M):  # ZeRO-1: rank r steps its own piece with its own momentum
                run["velocity"][r] = MOMENTUM * run["velocity"][r] + g[r * size : (r + 1) * size]
                w[r * size : (r + 1) * size] -= LR * run["velocity"][r]
            run["w"] = w[:n]  # the all-gather

        run_sampler(ElasticSampler, G, seed, stretches, on_step=on_step, on_change=on_change)
        steps = sum(s for _, s in stretches)
        reference = single_process(G, seed, steps)
        difference = float(np.max(np.abs(run["w"] - reference)))
        if not difference <= WEIGHTS_TOL:
            fail(f"G = {G}: the weights after {steps} steps on {' -> '.join(str(M) for M, _ in stretches)} ranks",
                 f"differ from one process's on the global batch by {difference:.3g} (allowed {WEIGHTS_TOL:g})",
                 "the check computes the gradients and the steps; what differs is what your sampler and reshard "
                 "gave it: run check_reshard and check_elastic_sampler first")
        lines.append(f"G = {G}: {' -> '.join(str(M) for M, _ in stretches)} ranks, {steps} steps; momentum pieces "
                     f"of {', '.join(run['pieces'])} numbers resharded, padding 0; the weights equal one "
                     f"process's to {WEIGHTS_TOL:g}")
    return "elastic training: ok\n" + "\n".join(lines)


__all__ = ["FEATURES", "HINTS", "LOST", "NUM_SAMPLES", "PLANS", "RESHARD_CASES", "WEIGHTS_TOL",
           "check_elastic_sampler", "check_elastic_training", "check_own_position", "check_reshard", "dataset",
           "expected_parts",
           "gradient", "reshard_into", "run_sampler", "single_process"]
