"""Smoke test: the recomputation benchmark runs in quick mode, prints its table and writes
sane JSON (forward calls and peak held bytes equal their formulas; ratios against k = 1).
Speed is not judged here: the machine may be shared."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_memory.py"


def test_bench_memory_quick(tmp_path):
    out, picture = tmp_path / "bench.json", tmp_path / "bench.png"
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--json", str(out), "--plot", str(picture)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "peak held MiB" in done.stdout and "x time" in done.stdout and "smallest peak held at k" in done.stdout
    rows = {row["k"]: row for row in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == [1, 2, 4, 8]
    for k, row in rows.items():
        assert row["forwards"] == row["forwards_formula"] == 8 + (k - 1) * (8 // k)
        assert row["peak_held_bytes"] == row["formula_bytes"] > 0
        assert row["time_s"] > 0 and row["alloc_peak_bytes"] > 0
    assert rows[1]["memory_ratio"] == rows[1]["time_ratio"] == 1.0
    assert rows[4]["memory_ratio"] > 1.5  # 17 activations held at k = 1, 8 at k = 4
    assert picture.stat().st_size > 0


def test_bench_memory_refuses_segments_beyond_the_blocks():
    done = subprocess.run([sys.executable, str(BENCH), "--blocks", "4", "--segments", "8"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "between 1 and --blocks (4)" in done.stderr
