"""minidist.collectives under real mpiexec, P = 1..5: every case against MPI's own calls.

One launch per P runs every case inside (tests/mpi/check_collectives.py) and reports the
problems it found; the same case list runs on the simulated world in test_collectives_sim.py.
"""
from pathlib import Path

import pytest
from mpitools import mpi_missing

from minidist import launch

WORKER = Path(__file__).parent / "mpi" / "check_collectives.py"


pytestmark = [pytest.mark.mpi, pytest.mark.skipif(mpi_missing() is not None, reason=f"no MPI: {mpi_missing()}")]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_every_collective_matches_mpi(p):
    result = launch.launch(WORKER, p, timeout=240)
    report = result.stdout + result.stderr[-3000:]
    assert result.ok, f"worker exited with {result.returncode}:\n{report}"
    assert "ALL OK" in result.stdout and f"ranks={p}" in result.stdout, report
