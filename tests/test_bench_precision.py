"""Smoke test: the mixed-precision benchmark runs in quick mode and prints a ratio per precision
and per product. Speed is not judged here: the machine may be shared."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_precision_quick():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_precision.py"), "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    names = "fp32|fp16|bf16|fp32 BLAS|fp16 emulated|bf16 emulated|fp16 NumPy"
    ratios = dict(re.findall(rf"^\s+({names})\s*:.*ratio to fp32 ([0-9.]+)$", done.stdout, re.M))
    assert set(ratios) == {"fp32", "fp16", "bf16", "fp32 BLAS", "fp16 emulated", "bf16 emulated", "fp16 NumPy"}
    assert float(ratios["fp32"]) == 1.0 and float(ratios["fp32 BLAS"]) == 1.0
    assert done.stdout.count("epoch on digits") == 2
