"""The tensor-parallel benchmark runs (``--quick``: a tiny GPT, 20 steps of (c)) and prints its
three figures: every strategy's bytes per step equal to its closed form, the activations per
rank falling with tensor and then sequence parallelism, and the step times. Speed itself is not
checked here."""
import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_tensor_parallel.py"


def test_bench_tensor_parallel_quick_prints_the_three_figures(tmp_path):
    out = tmp_path / "tp.json"
    result = subprocess.run([sys.executable, str(BENCH), "--quick", "--json", str(out)], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "(a) bytes each rank sends per training step" in result.stdout and " NO" not in result.stdout
    figures = json.loads(out.read_text())
    rows = figures["bytes_per_step"]
    assert {(r["ranks"], r["strategy"]) for r in rows} == {(p, s) for p in (2, 4) for s in ("tp", "tp+sp", "ddp")}
    assert all(r["equal"] for r in rows)
    memory = {(r["ranks"], r["layout"]): r["peak_bytes_per_rank"] for r in figures["activation_memory"]["rows"]}
    assert memory[4, "tp+sp"] < memory[2, "tp+sp"] < memory[2, "tp"] < memory[1, "dense"]
    assert memory[4, "tp+sp"] < memory[4, "tp"] < memory[2, "tp"]
    step = figures["step_time"]
    assert step["single"]["median_ms_per_step"] > 0
    if "tp_2_ranks" in step:  # mpiexec present
        assert step["tp_2_ranks"]["final"] == step["single"]["final"]  # the same final val_loss
