"""The engine benchmark still runs and agrees with its hand-written reference (it asserts
that both compute the same loss before timing). Speed itself is not checked here."""
import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_engine.py"


def test_bench_engine_runs_and_writes_json(tmp_path):
    out = tmp_path / "engine.json"
    result = subprocess.run([sys.executable, str(BENCH), "--repeats", "3", "--json", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "ratio minidist/numpy = " in result.stdout
    figures = json.loads(out.read_text())
    assert set(figures["median_seconds"]) >= {"numpy", "minidist"} and figures["ratio_minidist_numpy"] > 0
