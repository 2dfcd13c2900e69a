"""The attention benchmark runs (``--quick``: small T, two repeats) and prints its two figures:
time over T, dense against tiled (and torch when installed), and memory over T. Speed itself
is not checked; the memory figures are: flash's bytes held for backward double when T doubles
(T·d), dense's nearly quadruple (T²), and flash allocates less at the largest T."""
import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_attention.py"


def test_bench_attention_quick_prints_time_and_memory_over_T(tmp_path):
    out, picture = tmp_path / "attention.json", tmp_path / "attention.png"
    result = subprocess.run([sys.executable, str(BENCH), "--quick", "--json", str(out), "--plot", str(picture)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "(a) causal attention forward + backward, float32, 1 BLAS thread" in result.stdout
    assert "(b) memory, B=1 H=4 d=16 float32, causal" in result.stdout
    assert picture.stat().st_size > 0
    figures = json.loads(out.read_text())
    assert [row["T"] for row in figures["time"]] == [32, 64, 128]
    assert all(row["median_seconds"]["dense"] > 0 and set(row["flash_over_dense"]) == {"flash32", "flash64"}
               for row in figures["time"])
    rows = figures["memory"]
    for before, after in zip(rows, rows[1:]):
        assert after["flash"]["held_for_backward"] == 2 * before["flash"]["held_for_backward"]
        assert after["dense"]["held_for_backward"] > 3 * before["dense"]["held_for_backward"]
    assert rows[-1]["flash"]["allocated_peak"] < rows[-1]["dense"]["allocated_peak"]
