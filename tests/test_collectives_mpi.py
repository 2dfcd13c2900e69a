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


def test_faults_under_mpi_match_the_sim():
    """Refused input gives the very messages the sim gives; a rank that never calls the
    collective is named by every waiting rank after the 2 s deadline (n = 3)."""
    import json

    from minidist import Tensor, collectives, sim

    result = launch.launch(FAULTS, 3, timeout=120)
    report = result.stdout + result.stderr[-3000:]
    assert result.ok, f"worker exited with {result.returncode}:\n{report}"
    line = next((x for x in result.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, report
    found = json.loads(line[len("RESULT "):])
    on_sim = sim.World(3, timeout=20).run(lambda comm: cc.refusals(collectives, comm, Tensor))
    assert found["refusals"] == on_sim, (found["refusals"], on_sim)
    assert "MPICH" not in result.stderr, report  # no request left pending at MPI_Finalize
    for rank, seen in enumerate(found["timeout"][:2]):
        assert seen["error"] == "CollectiveTimeout" and seen["is_timeout"] and seen["is_collective_error"], seen
        assert seen["missing"] == [2] and 2.0 <= seen["seconds"] < 3.5, seen
        assert seen["message"].startswith(f"all_reduce: rank {rank} has not heard from rank 2 within 2 s"), seen
    assert found["timeout"][2] is None
