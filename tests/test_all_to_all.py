"""collectives.all_to_all and all_to_all_v: on the sim (P = 1..5, strict sends) against the
transpose of the blocks, with messages, bytes and steps counted on the trace against the
closed form; the errors; and under mpiexec (P = 2, 4) against MPI's Alltoall/Alltoallv."""
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpitools import mpi_missing

from minidist import Tensor, collectives, costmodel, launch, sim
from minidist.p2p import CollectiveError

sys.path.insert(0, str(Path(__file__).parent / "mpi"))
import all_to_all_cases as cases

SCRIPT = Path(__file__).parent / "mpi" / "all_to_all_cases.py"
A2A_TAG, A2AV_TAG = collectives.TAGS["all_to_all"], collectives.TAGS["all_to_all_v"]


def pairs_by_step(world):
    """{step: {(source, dest), ...}} of the last run's array messages."""
    found = {}
    for m in world.trace:
        if m.kind == "array":
            found.setdefault(m.step, set()).add((m.source, m.dest))
    return found


def pairwise_schedule(p, first_step=0):
    """The pairwise exchange's messages: in step s (1..p-1) rank r sends to (r + s) mod p."""
    return {first_step + s - 1: {(r, (r + s) % p) for r in range(p)} for s in range(1, p)}


# -- all_to_all: the transpose, and the closed form's traffic ----------------------------

@settings(max_examples=25, deadline=None)
@given(p=st.integers(1, 5), dtype=st.sampled_from(cases.DTYPES), trailing=st.sampled_from(cases.TRAILING),
       rows=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_all_to_all_is_the_transpose_with_the_pairwise_traffic(p, dtype, trailing, rows, seed):
    xs = [cases.values(cases.rng_for(seed, r), (p, rows) + trailing, dtype) for r in range(p)]
    world = sim.World(p, timeout=60, strict=True)  # every send waits for its receive: no buffering relied on
    got = world.run(lambda comm: collectives.all_to_all(comm, xs[comm.Get_rank()]))
    for r in range(p):
        expected = np.stack([xs[i][r] for i in range(p)])  # block i from rank i
        assert cases.differs(got[r], expected) is None, (r, cases.differs(got[r], expected))
    messages, sent, _ = costmodel.terms("all_to_all", "pairwise", xs[0].nbytes, p)
    assert [world.messages_sent(r) for r in range(p)] == [messages] * p
    assert [world.bytes_sent(r) for r in range(p)] == [sent] * p
    assert world.num_steps() == p - 1 and pairs_by_step(world) == pairwise_schedule(p)
    assert {m.tag for m in world.trace if m.kind == "array"} <= {A2A_TAG}


def test_all_to_all_small_case_by_hand():
    """Rank r holds [10r, 10r + 1, 10r + 2]: rank r gets [r, 10 + r, 20 + r]."""
    got = sim.run(lambda comm: collectives.all_to_all(comm, np.arange(3) + 10 * comm.Get_rank()), 3)
    assert [g.tolist() for g in got] == [[0, 10, 20], [1, 11, 21], [2, 12, 22]]


def test_all_to_all_leaves_its_input_alone_and_takes_strided_input():
    def run(comm):
        x = np.arange(4 * 6, dtype=np.float64).reshape(6, 4).T + 100 * comm.Get_rank()  # (4, 6), not contiguous
        before = x.copy()
        return collectives.all_to_all(comm, x), np.array_equal(x, before), before
    got = sim.run(run, 4)
    for r, (y, unchanged, _) in enumerate(got):
        assert unchanged and np.array_equal(y, np.stack([got[i][2][r] for i in range(4)]))


# -- all_to_all_v: variable rows, zeros included -----------------------------------------

@settings(max_examples=25, deadline=None)
@given(p=st.integers(1, 5), dtype=st.sampled_from(cases.DTYPES), trailing=st.sampled_from(cases.TRAILING),
       seed=st.integers(-1, 2**16), validate=st.booleans())
def test_all_to_all_v_is_the_transpose_with_counts_then_blocks(p, dtype, trailing, seed, validate):
    counts = cases.row_counts(p, seed)
    sends = [cases.blocks(r, counts, trailing, dtype, seed) for r in range(p)]
    world = sim.World(p, timeout=60, strict=True)
    got = world.run(lambda comm: collectives.all_to_all_v(comm, sends[comm.Get_rank()], validate=validate))
    for r in range(p):
        assert len(got[r]) == p
        for i in range(p):
            assert cases.differs(got[r][i], sends[i][r]) is None, (r, i, cases.differs(got[r][i], sends[i][r]))
    for r in range(p):  # p-1 counts of 8 bytes, then the blocks to the others, one message each
        block_bytes = sum(sends[r][j].nbytes for j in range(p) if j != r)
        assert world.messages_sent(r) == 2 * (p - 1)
        assert world.bytes_sent(r) == 8 * (p - 1) + block_bytes
    assert world.num_steps() == 2 * (p - 1)
    assert pairs_by_step(world) == {**pairwise_schedule(p), **pairwise_schedule(p, first_step=p - 1)}
    assert {m.tag for m in world.trace if m.kind == "array"} <= {A2AV_TAG}


def test_all_to_all_v_small_case_by_hand():
    """Rank r sends j + 1 copies of 10r + j to rank j (rank 1 nothing to rank 0)."""
    def run(comm):
        r = comm.Get_rank()
        return collectives.all_to_all_v(comm, [np.full(0 if (r, j) == (1, 0) else j + 1, 10 * r + j) for j in range(2)])
    got = sim.run(run, 2)
    assert [b.tolist() for b in got[0]] == [[0], []]
    assert [b.tolist() for b in got[1]] == [[1, 1], [11, 11]]


# -- errors: the same CollectiveError on every rank ---------------------------------------

def raised_everywhere(p, call):
    """The one message every rank raised for ``call(comm, rank)`` (fails if they differ)."""
    def run(comm):
        with pytest.raises(CollectiveError) as info:
            call(comm, comm.Get_rank())
        return str(info.value)
    messages = sim.World(p, timeout=20).run(run)
    assert len(set(messages)) == 1, messages
    return messages[0]


@pytest.mark.parametrize("call, expected", [
    (lambda comm, r: collectives.all_to_all(comm, np.zeros((3 + (r == 1), 2))),
     "all_to_all: x must have shape (p, ...) = (3, ...), block j for rank j; got shape (4, 2) (on rank 1"),
    (lambda comm, r: collectives.all_to_all(comm, np.zeros((3, 1 + r))),
     "all_to_all: the ranks disagree on the shape (every rank must pass the same): rank 0: (3, 1); rank 1: (3, 2)"),
    (lambda comm, r: collectives.all_to_all(comm, np.zeros((3, 2), "i8" if r == 2 else "f8")),
     "all_to_all: the ranks disagree on the dtype (every rank must pass the same): rank 0: float64; rank 1: float64; "
     "rank 2: int64"),
    (lambda comm, r: collectives.all_to_all(comm, np.zeros(3, object)), "x has dtype object"),
    (lambda comm, r: collectives.all_to_all(comm, Tensor(np.zeros(3))), "pass tensor.data"),
    (lambda comm, r: collectives.all_to_all_v(comm, [np.zeros((r, 2 + r))] * 3),
     "all_to_all_v: the ranks disagree on the blocks' shape[1:] (every rank must pass the same): rank 0: (2,); "
     "rank 1: (3,); rank 2: (4,)"),
    (lambda comm, r: collectives.all_to_all_v(comm, [np.zeros(2, "f4" if r else "f8")] * 3),
     "all_to_all_v: the ranks disagree on the dtype"),
    (lambda comm, r: collectives.all_to_all_v(comm, [np.zeros((1, 2)), np.zeros((1, 3)), np.zeros((0, 2))]),
     "blocks[1] has shape[1:] (3,), dtype float64 on cpu but blocks[0] (2,), float64 on cpu: the blocks may differ "
     "only in their first dimension"),
    (lambda comm, r: collectives.all_to_all_v(comm, [np.zeros(1, "i4"), np.zeros(1), np.zeros(1, "i4")]),
     "blocks[1] has shape[1:] (), dtype float64"),
    (lambda comm, r: collectives.all_to_all_v(comm, [np.zeros(1)] * (2 if r == 0 else 3)),
     "blocks must be a list of p = 3 arrays (blocks[j] goes to rank j), got 2 items (on rank 0"),
    (lambda comm, r: collectives.all_to_all_v(comm, np.zeros((3, 2))), "got a ndarray"),
    (lambda comm, r: collectives.all_to_all_v(comm, [np.float64(1)] * 3), "blocks[0] is 0-d; every block needs"),
    (lambda comm, r: collectives.all_to_all_v(comm, [np.zeros(1), np.array(["a"]), np.zeros(1)]),
     "blocks[1]: x has dtype <U1"),
])
def test_bad_arguments_raise_the_same_error_on_every_rank(call, expected):
    assert expected in raised_everywhere(3, call)


def test_one_rank_raises_alone_and_moves_nothing():
    with pytest.raises(CollectiveError, match="shape \\(p, ...\\) = \\(1, ...\\)"):
        sim.run(lambda comm: collectives.all_to_all(comm, np.zeros((2, 2))), 1)
    assert sim.run(lambda comm: collectives.all_to_all_v(comm, [np.arange(3)]), 1)[0][0].tolist() == [0, 1, 2]


# -- under mpiexec: MPI's own Alltoall and Alltoallv are the oracle -------------------------

@pytest.mark.mpi
@pytest.mark.skipif(mpi_missing() is not None, reason=f"no MPI: {mpi_missing()}")
@pytest.mark.parametrize("p", [2, 4])
def test_equal_to_mpi_alltoall_and_alltoallv(p):
    result = launch.launch(SCRIPT, p, timeout=180)
    report = result.stdout + result.stderr[-3000:]
    assert result.ok and f"ALL OK ranks={p}" in result.stdout, report
    on_sim = sim.World(p, timeout=20).run(lambda comm: cases.disagreements(comm, collectives, CollectiveError))
    for name, message in on_sim[0][0].items():  # the very messages the sim gives
        assert f"MESSAGE {name}: {message}\n" in result.stdout, (name, message, report)
    assert all(after is None for _, after in on_sim)
