"""minidist.course.checks.elastic (exercise 18): the solution's reshard and ElasticSampler pass
every check on the plans (4 -> 2 -> 3 ranks with G = 12, 4 -> 3 with G = 10 that neither
divides, 4 -> 3 -> 1 -> 5 with G = 16, changes mid-epoch and at an epoch's end); versions wrong
in each way the checks look for fail with their own hint (the saved padding copied, the new
pieces assumed to line up with the old, no padding returned, a lost piece silently zero or a lost
padding-only piece refused; a per-rank position, G // M rows, strided parts, the extra rows on the
last ranks, a rank in the seed, no next epoch, rank and world size overwritten by the loaded
state, an epoch missing from the state); other correct answers pass (the next epoch begun
eagerly, a step count as the state, a vector glued together with its padding zeroed). The
checks' oracles are checked against others: the parts against the engine's GlobalBatchSampler,
one process's weights against optim.SGD, the resharded pieces against resharding.assemble."""
import nbformat
import numpy as np
import pytest
from lesson_outputs import ROOT, cell_with, lesson_prose, printed

from minidist import data, optim, resharding
from minidist.course.checks import STUB_HINT, LearnerError
from minidist.course.checks import elastic as elastic_checks
from minidist.nn import Parameter

OWN = "own implementation, not yours"


def reshard_with(mistake=None):
    """The exercise's reshard, the solution's or with one mistake."""

    def reshard(pieces, numel, world_size, rank):
        size = -(-numel // world_size)
        start = rank * size
        if mistake == "padding":  # the saved pieces glued together: their padding comes along
            return np.concatenate([p["values"] for p in pieces] + [np.zeros(size * world_size)])[start : start + size]
        stop = min(start + size, numel)
        out, covered = np.zeros(size), np.zeros(size, dtype=bool)
        for piece in pieces:
            lo, hi = max(start, piece["offset"]), min(stop, piece["offset"] + piece["length"])
            if lo < hi:
                source = (lo - start, hi - start) if mistake == "aligned" else (lo - piece["offset"],
                                                                                 hi - piece["offset"])
                out[lo - start : hi - start] = piece["values"][source[0] : source[1]]
                covered[lo - start : hi - start] = True
        # overeager: the padding too must be covered, though no piece holds it
        missing = np.flatnonzero(~covered if mistake == "overeager" else ~covered[: max(0, stop - start)])
        if missing.size and mistake != "silent":
            raise ValueError(f"position {start + missing[0]} of {numel} is in no saved piece")
        return out[: max(0, min(size, numel - start))] if mistake == "short" else out

    return reshard


def sampler_with(mistake=None):
    """The exercise's ElasticSampler, the solution's or with one mistake."""

    class ElasticSampler:
        def __init__(self, num_samples, global_batch_size, world_size, rank, seed=0):
            self.num_samples, self.global_batch_size = num_samples, global_batch_size
            self.world_size, self.rank, self.seed = world_size, rank, seed
            self.steps_per_epoch = num_samples // global_batch_size
            self.epoch, self.global_samples, self.rows = 0, 0, 0

        def part(self, batch):
            G, M, r = self.global_batch_size, self.world_size, self.rank
            if mistake == "remainder":
                return batch[r * (G // M) : (r + 1) * (G // M)]
            if mistake == "strided":
                return batch[r::M]
            if mistake == "sizes":  # the extra rows on the last ranks
                return np.array_split(batch[::-1], M)[M - 1 - r][::-1]
            return np.array_split(batch, M)[r]

        def next_indices(self):
            G = self.global_batch_size
            if mistake == "per_rank":  # the position: the rows this rank has read
                mine = len(self.part(np.arange(G)))
                self.global_samples = self.rows // mine * G
            if self.global_samples // G == self.steps_per_epoch and mistake != "epoch":
                self.epoch, self.global_samples, self.rows = self.epoch + 1, 0, 0
            seed = [self.seed + self.rank, self.epoch] if mistake == "seed" else [self.seed, self.epoch]
            perm = np.random.default_rng(seed).permutation(self.num_samples)
            part = self.part(perm[self.global_samples : self.global_samples + G])
            self.global_samples += G
            self.rows += len(part)
            return part

        def state_dict(self):
            if mistake == "state":
                return dict(self.__dict__)
            if mistake == "no_epoch":
                return {"global_samples": self.global_samples}
            return {"epoch": self.epoch, "global_samples": self.global_samples, "rows": self.rows}

        def load_state_dict(self, state):
            if mistake == "state":
                self.__dict__.update(state)
                return
            self.epoch = state.get("epoch", 0)
            self.global_samples, self.rows = state["global_samples"], state["rows" if "rows" in state else
                                                                               "global_samples"]

    return ElasticSampler


# ----------------------------------------------------------------------------- the solution passes


def test_the_solution_passes_every_check():
    verdict = elastic_checks.check_reshard(reshard_with())
    assert verdict.startswith("reshard: ok on every rank (10: 3 -> 2, 11: 4 -> 3, 11: 2 -> 5, 5: 4 -> 4, 1: 2 -> 3, "
                              "7: 3 -> 6)"), verdict
    lines = elastic_checks.check_elastic_sampler(sampler_with()).splitlines()
    assert lines == [
        "ElasticSampler: ok",
        "G = 12 (4 steps an epoch, 2 samples left): 4 ranks (3, 3, 3, 3) x 3 -> 2 ranks (6, 6) x 3 -> 3 ranks "
        "(4, 4, 4) x 2: 8 steps, epochs 0-1: each rank read its contiguous part, every sample once",
        "G = 10 (5 steps an epoch, 0 samples left): 4 ranks (3, 3, 2, 2) x 2 -> 3 ranks (4, 3, 3) x 8: 10 steps, "
        "epochs 0-1: each rank read its contiguous part, every sample once",
        "G = 16 (3 steps an epoch, 2 samples left): 4 ranks (4, 4, 4, 4) x 4 -> 3 ranks (6, 5, 5) x 3 -> 1 rank "
        "(16) x 2 -> 5 ranks (4, 3, 3, 3, 3) x 3: 12 steps, epochs 0-3: each rank read its contiguous part, every "
        "sample once"]
    lines = elastic_checks.check_elastic_training(sampler_with(), reshard_with()).splitlines()
    assert lines[0] == "elastic training: ok" and len(lines) == 4
    assert lines[1] == ("G = 12: 4 -> 2 -> 3 ranks, 8 steps; momentum pieces of 3 -> 6, 6 -> 4 numbers resharded, "
                        "padding 0; the weights equal one process's to 1e-10")
    assert "momentum pieces of 3 -> 4, 4 -> 11, 11 -> 3 numbers" in lines[3]


class EagerSampler:
    """Another correct answer: the next epoch begins right after the last step, the state is a
    step count, the part cut by hand, a list returned."""

    def __init__(self, num_samples, global_batch_size, world_size, rank, seed=0):
        self.n, self.G, self.M, self.r, self.seed = num_samples, global_batch_size, world_size, rank, seed
        self.epoch, self.step = 0, 0

    def next_indices(self):
        perm = np.random.default_rng([self.seed, self.epoch]).permutation(self.n)
        q, rem = divmod(self.G, self.M)
        start = self.step * self.G + self.r * q + min(self.r, rem)
        self.step += 1
        if self.step == self.n // self.G:
            self.epoch, self.step = self.epoch + 1, 0
        return perm[start : start + q + (self.r < rem)].tolist()

    def state_dict(self):
        return {"epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state):
        self.epoch, self.step = state["epoch"], state["step"]


def glued_reshard(pieces, numel, world_size, rank):
    """Another correct answer: every piece put in place in one vector, its padding zeroed."""
    size = -(-numel // world_size)
    whole = np.full(world_size * size + sum(p["length"] for p in pieces), np.nan)
    for p in pieces:
        whole[p["offset"] : p["offset"] + p["length"]] = p["values"]
    whole[numel:] = 0.0
    out = whole[rank * size : (rank + 1) * size].copy()
    if np.isnan(out).any():
        raise ValueError(f"position {rank * size + int(np.flatnonzero(np.isnan(out))[0])} is in no saved piece")
    return out


def test_other_correct_answers_pass():
    assert elastic_checks.check_reshard(glued_reshard).startswith("reshard: ok")
    assert elastic_checks.check_elastic_sampler(EagerSampler).startswith("ElasticSampler: ok")
    assert elastic_checks.check_elastic_training(EagerSampler, glued_reshard).startswith("elastic training: ok")


# ----------------------------------------------------------------------------- the oracles


@pytest.mark.parametrize("G, seed, stretches", elastic_checks.PLANS)
def test_the_parts_are_the_engines_global_batch_sampler(G, seed, stretches):
    """expected_parts cuts the global batch as data.GlobalBatchSampler does, on every world size."""
    n, per_epoch = elastic_checks.NUM_SAMPLES, elastic_checks.NUM_SAMPLES // G
    for M in {M for M, _ in stretches}:
        for rank in range(M):
            sampler = data.GlobalBatchSampler(n, G, M, rank, seed=seed)
            for epoch in (0, 1):
                sampler.set_epoch(epoch)
                engine = np.array(list(sampler)).reshape(per_epoch, -1)
                ours = [elastic_checks.expected_parts(n, G, M, seed, epoch, s)[rank] for s in range(per_epoch)]
                assert np.array_equal(engine, np.array(ours))


def test_one_process_is_sgd_with_momentum():
    """The reference weights are optim.SGD's (torch's momentum rule) on the global batches."""
    G, seed, steps = 16, 0, 7
    w = Parameter(np.zeros(elastic_checks.FEATURES + 1))
    sgd = optim.SGD([w], lr=elastic_checks.LR, momentum=elastic_checks.MOMENTUM)
    for t in range(steps):
        epoch, step = divmod(t, elastic_checks.NUM_SAMPLES // G)
        batch = elastic_checks.expected_parts(elastic_checks.NUM_SAMPLES, G, 1, seed, epoch, step)[0]
        w.grad = elastic_checks.gradient(w.data, batch)
        sgd.step()
    assert np.allclose(w.data, elastic_checks.single_process(G, seed, steps), rtol=0, atol=1e-15)
    assert np.abs(w.data).max() > 0.1  # it moved


@pytest.mark.parametrize("numel, saved_by, world_size", elastic_checks.RESHARD_CASES)
def test_the_solution_reads_what_resharding_assemble_reads(numel, saved_by, world_size):
    vector = np.random.default_rng(numel).standard_normal(numel)
    pieces = elastic_checks.reshard_into(reshard_with(), vector, saved_by, world_size, "by hand")
    size = -(-vector.size // saved_by)
    padded = np.concatenate([vector, np.zeros(saved_by * size - numel)])
    parts = [{"x": padded[q * size : (q + 1) * size], "shards": [{"path": ["x"], "numel": numel, "offset": q * size,
                                                                   "length": size}]} for q in range(saved_by)]
    new = -(-numel // world_size)
    for rank, piece in enumerate(pieces):
        assert np.array_equal(piece, resharding.assemble(parts, ["x"], numel, rank * new, new))


def test_the_weights_check_can_fail(monkeypatch):
    reference = elastic_checks.single_process
    monkeypatch.setattr(elastic_checks, "single_process", lambda *args: reference(*args) + 1e-9)
    with pytest.raises(AssertionError, match="differ from one process's on the global batch by 1e-09"):
        elastic_checks.check_elastic_training(sampler_with(), reshard_with())


# ----------------------------------------------------------------------------- each mistake, its hint


@pytest.mark.parametrize("mistake, hint", [
    ("padding", "never copy it"),
    ("aligned", "copy from each piece the part"),
    ("short", "your piece lacks its padding"),
    ("silent", "must raise ValueError naming it"),
    ("overeager", "a lost piece that was all padding is no error"),
])
def test_each_reshard_mistake_gets_its_hint(mistake, hint):
    with pytest.raises((AssertionError, LearnerError)) as caught:
        elastic_checks.check_reshard(reshard_with(mistake))
    assert hint in str(caught.value), str(caught.value)
    if mistake != "silent":  # the training check says the same (it loses no piece)
        with pytest.raises((AssertionError, LearnerError)) as caught:
            elastic_checks.check_elastic_training(sampler_with(), reshard_with(mistake))
        assert hint in str(caught.value), str(caught.value)


@pytest.mark.parametrize("mistake, hint, where", [
    ("per_rank", "save the epoch and the global samples consumed", "G = 12, 2 ranks (resumed from 4 ranks), step 3 "
                                                                   "of epoch 0, the first step after the change"),
    ("no_epoch", "save the epoch and the global samples consumed", "G = 12, 3 ranks (resumed from 2 ranks), step 2 "
                                                                   "of epoch 1"),
    ("remainder", "the first G mod M ranks read one more row; G // M", "G = 10, 4 ranks, step 0 of epoch 0"),
    ("strided", "not every M-th sample", "G = 12, 4 ranks, step 0 of epoch 0"),
    ("sizes", "G = 10 on 4 ranks is 3, 3, 2, 2", "G = 10, 4 ranks, step 0 of epoch 0"),
    ("seed", "with no rank in it", "G = 12, 4 ranks, step 0 of epoch 0"),
    ("epoch", "the next epoch starts at its step 0", "G = 12, 2 ranks (resumed from 4 ranks), step 0 of epoch 1"),
    ("state", "this sampler's rank and world size are its own", "G = 12, 2 ranks (resumed from 4 ranks), step 3"),
])
def test_each_sampler_mistake_gets_its_hint(mistake, hint, where):
    with pytest.raises(AssertionError) as caught:
        elastic_checks.check_elastic_sampler(sampler_with(mistake))
    message = str(caught.value)
    assert hint in message and message.startswith(where), message


@pytest.mark.parametrize("mover", [-1, 0])
def test_a_position_kept_outside_the_sampler_gets_its_own_hint(mover):
    """A position kept in a global or a class attribute, which every sampler of the process shares,
    is named as such (before issue 36: the hint of a resume, of a per-rank position or, when rank
    0 moved it before the others read, of a rank in the seed)."""
    for check in (elastic_checks.check_elastic_sampler,
                  lambda s: elastic_checks.check_elastic_training(s, reshard_with())):
        with pytest.raises(AssertionError) as caught:
            check(sampler_with_a_shared_position(mover))
        message = str(caught.value)
        assert message.startswith("ElasticSampler(50, 8, 2, rank, seed="), message
        assert "a new sampler must start at epoch 0, step 0" in message
        assert elastic_checks.HINTS["outside"] in message


def test_a_position_mistake_names_the_samples_read_twice_and_never():
    with pytest.raises(AssertionError) as caught:
        elastic_checks.check_elastic_sampler(sampler_with("per_rank"))
    message = str(caught.value)
    # 4 ranks read 3 rows each for 3 steps (9 rows), so 2 ranks of 6 rows think they read 1 step
    assert "is read twice in epoch 0 (12 such samples so far)" in message
    assert "is never read (12 samples of steps 0..3 unread)" in message
    assert "here a rank read its part of step 1 of epoch 0" in message


def test_the_engine_is_refused_and_a_stub_says_so():
    def assemble(pieces, numel, world_size, rank):
        size = -(-numel // world_size)
        parts = [{"x": p["values"], "shards": [{"path": ["x"], "numel": numel, "offset": p["offset"],
                                                "length": p["length"]}]} for p in pieces]
        return resharding.assemble(parts, ["x"], numel, rank * size, size)

    with pytest.raises(LearnerError, match=OWN):
        elastic_checks.check_reshard(assemble)
    with pytest.raises(AssertionError, match=OWN):
        elastic_checks.check_elastic_sampler(data.GlobalBatchSampler)

    class Wrapped(sampler_with()):
        def next_indices(self):
            engine = data.GlobalBatchSampler(self.num_samples, self.global_batch_size, self.world_size, self.rank)
            return np.array(list(engine))[: len(super().next_indices())]

    with pytest.raises(LearnerError, match=OWN):
        elastic_checks.check_elastic_sampler(Wrapped)

    class Split(sampler_with()):
        def part(self, batch):
            offsets = data.split_global_batch(self.global_batch_size, self.world_size)
            return batch[offsets[self.rank] : offsets[self.rank + 1]]

    with pytest.raises(LearnerError, match=OWN):
        elastic_checks.check_elastic_sampler(Split)
    with pytest.raises(LearnerError, match=OWN):
        elastic_checks.check_elastic_training(Split, reshard_with())

    def stub(pieces, numel, world_size, rank):
        raise NotImplementedError()

    with pytest.raises(LearnerError) as caught:
        elastic_checks.check_reshard(stub)
    assert STUB_HINT in str(caught.value)



def sampler_from_the_checks():
    """A sampler whose parts are the checks' own reference, expected_parts."""

    class ElasticSampler(sampler_with()):
        def part(self, batch):
            step = self.global_samples // self.global_batch_size
            return elastic_checks.expected_parts(self.num_samples, self.global_batch_size, self.world_size, self.seed,
                                                 self.epoch, step)[self.rank]

    return ElasticSampler


def sampler_with_a_shared_position(mover: int = -1):
    """A sampler whose position is a class attribute (a global behaves the same), one object for
    every sampler of the process, moved by rank ``mover`` of each step (-1: the last rank, after
    every rank read the step; 0: rank 0, before the others read it): its state_dict carries
    nothing, and a resume goes on from where the last step left it. A new class each call."""

    class ElasticSampler:
        steps = {}  # (G, seed): the steps taken, for every sampler of the process

        def __init__(self, num_samples, global_batch_size, world_size, rank, seed=0):
            self.n, self.G, self.M, self.rank, self.seed = num_samples, global_batch_size, world_size, rank, seed
            ElasticSampler.steps.setdefault((global_batch_size, seed), 0)

        def next_indices(self):
            epoch, step = divmod(ElasticSampler.steps[self.G, self.seed], self.n // self.G)
            batch = np.random.default_rng([self.seed, epoch]).permutation(self.n)[step * self.G : (step + 1) * self.G]
            if self.rank == mover % self.M:
                ElasticSampler.steps[self.G, self.seed] += 1
            return np.array_split(batch, self.M)[self.rank]

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    return ElasticSampler


def test_answers_that_are_not_the_learners_fail():
    """Each passed before: the checks' expected_parts called by the sampler; the position kept
    outside the state (the old ranks' last step is now lost with the failure, as in the lesson);
    a reshard that ignores the pieces and redraws the checks' vector from its seed."""
    with pytest.raises(LearnerError, match="called minidist.course.checks.elastic.expected_parts"):
        elastic_checks.check_elastic_sampler(sampler_from_the_checks())
    with pytest.raises(LearnerError, match="called minidist.course.checks.elastic.expected_parts"):
        elastic_checks.check_elastic_training(sampler_from_the_checks(), reshard_with())
    with pytest.raises(AssertionError) as caught:
        elastic_checks.check_elastic_sampler(sampler_with_a_shared_position())
    assert str(caught.value).startswith("ElasticSampler(50, 8, 2, rank, seed=") and "not in a class attribute or a " \
        "global" in str(caught.value) and "a new sampler must start at epoch 0, step 0" in str(caught.value)

    def redrawn(pieces, numel, world_size, rank):
        size = -(-numel // world_size)
        vector = np.concatenate([np.random.default_rng(numel).standard_normal(numel), np.zeros(size * world_size)])
        offsets = {p["offset"] for p in pieces}
        held = {i for p in pieces for i in range(p["offset"], p["offset"] + p["length"])}
        if offsets and set(range(rank * size, min(numel, rank * size + size))) - held:
            raise ValueError("a position is in no saved piece")
        return vector[rank * size : (rank + 1) * size]

    with pytest.raises(AssertionError, match="expected"):
        elastic_checks.check_reshard(redrawn)

def test_the_exercise_quotes_its_outputs():
    nb = nbformat.read(ROOT / "solutions" / "18_elastic.ipynb", as_version=4)
    text = lesson_prose(nb)
    out = printed(cell_with(nb, "for world_size in (2, 4):"))
    assert "rank 1 of 2: [5. 6. 7. 8. 9.]" in out and "rank 1 takes 5..8 from piece 1 and 8..10 from piece 2" in text
    assert "rank 3 of 4: [9. 0. 0.]" in out and "the last rank holds 9 and two positions of padding" in text
    out = printed(cell_with(nb, "N_SAMPLES, G, SEED = 50, 10, 5"))
    assert "resumed on 3 ranks from {'epoch': 0, 'global_samples': 20}" in out
    assert "every sample of epoch 0 read once, in its step: True" in out
    assert "G = 10 on 50 samples (5 steps an epoch): 2 steps on 4 ranks, then the rest of the epoch on 3" in text
    assert "G = 10 on 4 ranks: 3, 3, 2, 2" in text
    assert "4 ranks (3, 3, 2, 2)" in printed(cell_with(nb, "check_elastic_sampler("))
    for plan in ("4 → 2 → 3 ranks with G = 12", "4 → 3 with G = 10, which neither divides",
                 "4 → 3 → 1 → 5 with G = 16"):
        assert plan in text
    assert [(G, [M for M, _ in stretches]) for G, _, stretches in elastic_checks.PLANS] == [
        (12, [4, 2, 3]), (10, [4, 3]), (16, [4, 3, 1, 5])]
    assert (elastic_checks.NUM_SAMPLES, elastic_checks.FEATURES, elastic_checks.MOMENTUM) == (50, 10, 0.9)
    assert "least squares on 50 seeded float64 samples (10 weights and a bias, 11 numbers" in text
    assert "SGD with momentum 0.9" in text and "to 1e-10 in float64" in text
    verdict = printed(cell_with(nb, "check_elastic_training("))
    assert verdict.startswith("elastic training: ok") and verdict.count("the weights equal one process's to 1e-10") == 3
