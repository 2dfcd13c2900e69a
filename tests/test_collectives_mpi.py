"""minidist.collectives under real mpiexec, P = 1..5: every case against MPI's own calls;
faults (refused input, a missing rank) against the sim, n = 3.

One launch per P runs every case inside (tests/mpi/check_collectives.py) and reports the
problems it found; the same case list runs on the simulated world in test_collectives_sim.py.
"""
import sys
from pathlib import Path

import pytest
from mpitools import mpi_missing

from minidist import launch

sys.path.insert(0, str(Path(__file__).parent / "mpi"))
import collective_cases as cc

WORKER = Path(__file__).parent / "mpi" / "check_collectives.py"


pytestmark = [pytest.mark.mpi, pytest.mark.skipif(mpi_missing() is not None, reason=f"no MPI: {mpi_missing()}")]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_every_collective_matches_mpi(p):
    result = launch.launch(WORKER, p, timeout=240)
    report = result.stdout + result.stderr[-3000:]
    assert result.ok, f"worker exited with {result.returncode}:\n{report}"
    assert "ALL OK" in result.stdout and f"ranks={p}" in result.stdout, report


FAULTS = Path(__file__).parent / "mpi" / "collective_faults.py"


def faults_under_mpi(p):
    """collective_faults.py's RESULT under mpiexec -n p, after checking that refused input and
    ranks that disagree (collective_cases) give the very messages the sim gives, and that a
    good all-reduce after them still sums."""
    import json

    from minidist import Tensor, collectives, sim

    result = launch.launch(FAULTS, p, timeout=120)
    report = result.stdout + result.stderr[-3000:]
    assert result.ok, f"worker exited with {result.returncode}:\n{report}"
    line = next((x for x in result.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, report
    found = json.loads(line[len("RESULT "):])
    on_sim = sim.World(p, timeout=20).run(lambda comm: cc.refusals(collectives, comm, Tensor))
    assert found["refusals"] == on_sim, (found["refusals"], on_sim)
    on_sim = sim.World(p, timeout=20).run(
        lambda comm: cc.refusals(collectives, comm, Tensor, cc.mismatched_calls(collectives, comm)))
    assert found["mismatches"] == on_sim, (found["mismatches"], on_sim)
    assert all(m.startswith("all_reduce: the ranks disagree on the") or m.startswith("broadcast: the ranks disagree")
               for per_rank in on_sim for m in per_rank.values()), on_sim
    assert found["after"] == [[0.0, p * (p + 1) / 2, p * (p + 1)]] * p, found["after"]
    assert "MPICH" not in result.stderr, report  # no request left pending at MPI_Finalize
    return found


def test_ranks_that_disagree_at_p2_raise_everywhere_as_on_the_sim():
    """At P = 2 MPI's agreement header carries a small vector (minidist.agreement_header): a
    rank whose message is not the one the other expects (another shape, the same bytes in
    another dtype, another op, algorithm or collective, a 1 MiB vector against 24 B) still
    raises the sim's CollectiveError on both ranks, and the next good call sums."""
    faults_under_mpi(2)


def test_faults_under_mpi_match_the_sim():
    """Refused input and ranks that disagree give the very messages the sim gives; a rank
    that never calls the collective is named by every waiting rank after the 2 s deadline
    (n = 3)."""
    found = faults_under_mpi(3)
    for rank, seen in enumerate(found["timeout"][:2]):
        assert seen["error"] == "CollectiveTimeout" and seen["is_timeout"] and seen["is_collective_error"], seen
        assert seen["missing"] == [2] and 2.0 <= seen["seconds"] < 3.5, seen
        assert seen["message"].startswith(f"all_reduce: rank {rank} has not heard from rank 2 within 2 s"), seen
    assert found["timeout"][2] is None
