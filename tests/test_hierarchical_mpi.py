"""Hierarchical and torus all-reduce under real mpiexec (issue 23 item 5): one 8-rank launch
runs P = 2..8 in fake nodes against MPI's own Allreduce, the environment's layout, a layout
error, and the delay layer (tests/mpi/hierarchical_cases.py)."""
import re
from pathlib import Path

import pytest
from mpitools import JOB_ENV, mpi_missing

from minidist import launch

WORKER = Path(__file__).parent / "mpi" / "hierarchical_cases.py"

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(mpi_missing() is not None, reason=f"no MPI: {mpi_missing()}")]


def test_hierarchical_and_torus_match_mpi_allreduce_in_fake_nodes_and_the_delay_layer_slows_only_cross_node():
    result = launch.launch(WORKER, 8, timeout=240, env={**JOB_ENV, "MINIDIST_RANKS_PER_NODE": "2"})
    report = result.stdout + result.stderr[-3000:]
    assert result.ok, f"worker exited with {result.returncode}:\n{report}"
    assert "ALL OK cases=" in result.stdout, report
    delay = re.search(r"DELAY intra=([\d.]+) inter=([\d.]+)", result.stdout)
    assert delay, report
    intra, inter = float(delay[1]), float(delay[2])
    assert intra < inter and 0.05 <= inter < 2.0, (intra, inter)  # 1000 B: 1 us more than alpha
