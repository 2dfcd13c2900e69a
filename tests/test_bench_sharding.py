"""The sharding benchmark runs (``--quick``: a tiny GPT, 3 timed rounds) and prints its three
figures: each rank's parameters, gradients and optimizer state equal to the ZeRO paper's
fractions for DDP and ZeRO-1/2/3 on 1, 2 and 4 ranks, every strategy's bytes per step equal to
its closed form (ZeRO-3 1.5 times DDP's), and the step times. Speed itself is not checked."""
import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_sharding.py"


def test_bench_sharding_quick_prints_the_three_figures(tmp_path):
    out = tmp_path / "sharding.json"
    result = subprocess.run([sys.executable, str(BENCH), "--quick", "--json", str(out)], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "(b) bytes each rank sends per training step" in result.stdout and " NO " not in result.stdout
    figures = json.loads(out.read_text())
    rows = {(r["ranks"], r["strategy"]): r for r in figures["memory_and_bytes"]}
    assert set(rows) == {(p, s) for p in (1, 2, 4) for s in ("ddp", "zero1", "zero2", "zero3")}
    for (p, strategy), r in rows.items():
        assert r["sent_equal"], (p, strategy)
        assert r["gradients"] == r["formula"]["gradients"] and r["optimizer_state"] == r["formula"]["optimizer_state"]
        assert r["activations"] == rows[1, "ddp"]["activations"] or strategy in ("zero2", "zero3")
        assert r["loss"] == rows[1, "ddp"]["loss"] or p > 1  # the same start
    assert rows[4, "zero3"]["parameters"] == rows[4, "zero3"]["formula"]["parameters"]
    assert rows[2, "zero3"]["sent_closed_form"] == 1.5 * rows[2, "ddp"]["sent_closed_form"]
    assert rows[4, "zero2"]["gathered_peak"] == rows[4, "ddp"]["parameters"]  # ZeRO-2: whole during the step
    times = figures["step_time"]["median_ms_per_step"]
    assert set(times) == {"ddp", "zero1", "zero2", "zero3", "zero2 no prefetch", "zero3 no prefetch"}
    assert all(t > 0 for t in times.values())
