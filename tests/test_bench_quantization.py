"""Smoke test: the quantization benchmark runs in quick mode, prints its table and writes sane
JSON (int8 bytes about 4x fewer; both models scored). Speed is not judged here: the machine may
be shared."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_quantization.py"


def test_bench_quantization_quick(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, str(BENCH), "--quick", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "int8/fp32" in done.stdout and "accuracy drop" in done.stdout and "int32 product" in done.stdout
    result = json.loads(out.read_text())
    fp32_bytes, int8_bytes = result["digits"]["bytes"]
    assert fp32_bytes == 4 * (64 * 128 + 128 + 128 * 10 + 10)  # float32 parameters
    assert int8_bytes == 64 * 128 + 128 * 10 + 4 * 2 * (128 + 10)  # int8 weights, float32 scales and biases
    assert all(0 < a <= 1 for a in result["digits"]["accuracy"])
    assert all(s > 0 for s in result["digits"]["seconds"] + result["wide"]["seconds"])
    assert set(result["wide"]["int8_parts_first_layer"]) == {"quantize", "int32 product", "same sums in float64 BLAS",
                                                             "rescale"}


def test_bench_quantization_refuses_a_zero_width():
    done = subprocess.run([sys.executable, str(BENCH), "--width", "0"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0 and "--width must be >= 1" in done.stderr
