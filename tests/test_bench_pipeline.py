"""Smoke test: the pipeline benchmark launches its 2-rank job, prints its table and writes
sane JSON (a row per schedule and m; bubble formula exact). Speed is not judged here: the
machine may be shared."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from mpitools import mpiexec_or_skip

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_pipeline.py"


@pytest.mark.mpi
def test_bench_pipeline_quick(tmp_path):
    mpiexec_or_skip()
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "samples/s" in done.stdout and "bubble" in done.stdout and "formula" in done.stdout
    rows = {row["config"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"single", "single 4", "gpipe 1", "gpipe 4", "1f1b 1", "1f1b 4"}
    assert rows["gpipe 4"]["bubble_formula"] == pytest.approx(1 / 5)
    assert rows["1f1b 1"]["ideal"] == pytest.approx(1.0)
    for row in rows.values():
        assert row["samples_per_s"] > 0
