"""The GPT benchmark runs (``--quick``: a tiny GPT, a few steps) and prints its three figures:
the time to the loss target with ddp following the single process, one step against PyTorch
(skipped without torch) beside the engine with tiled attention, and the activations of a
block term by term, which must add up to what memory.track measures. Speed itself is not checked here."""
import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gpt.py"


def test_bench_gpt_quick_prints_the_three_figures(tmp_path):
    out = tmp_path / "gpt.json"
    result = subprocess.run([sys.executable, str(BENCH), "--quick", "--follow-steps", "4", "--json", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "(a) val loss <= 2.0: not reached in 20 steps" in result.stdout
    assert "(b) one step, 1024 tokens, float32, 1 BLAS thread" in result.stdout
    assert "    md-flash " in result.stdout and "    flash/dns " in result.stdout  # the engine with tiled attention
    assert "(c) one block, s=32 b=32 h=32 a=2" in result.stdout and "equal to the measurement" in result.stdout
    figures = json.loads(out.read_text())
    follow = figures["ddp_follows_single"]
    assert follow["within_1e-4"] and follow["ddp_batch_per_rank"] * 2 == follow["single_batch"]
    memory = figures["activations"]
    assert memory["engine_model_bytes"] == memory["measured_bytes"] == sum(memory["by_op"].values())
    s, b, h, a = memory["s"], memory["b"], memory["h"], memory["a"]
    assert memory["korthikanti_fp32_no_dropout_bytes"] == 64 * s * b * h + 4 * a * s * s * b
    step = figures["step_against_torch"]
    assert all(step["median_seconds"][name]["step"] > 0 for name in ("minidist", "md-dense", "md-flash"))
    assert set(step["ratio_flash_dense"]) == {"forward", "backward", "update", "step"}
