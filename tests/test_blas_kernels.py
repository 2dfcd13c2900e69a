"""make test-notebooks-blas (issue 36, item 1): the notebooks that train run again under two
OpenBLAS kernels other than the native one, and that run means something: the forced kernels do
round a float32 product differently, and the notebooks where a kernel changed a committed output
(lessons 11, 13, 18 and solution 13, found by running every notebook under SandyBridge and
Nehalem) are among those it runs."""
import os
import subprocess
import sys
from pathlib import Path

import blas_kernels
import pytest

ROOT = Path(__file__).resolve().parents[1]
# The kernel OpenBLAS picked, then the bits of a seeded float32 product.
PRODUCT = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import blas_kernels, numpy as np; "
           "rng = np.random.default_rng(0); a = rng.standard_normal((64, 256), dtype=np.float32); "
           "b = rng.standard_normal((256, 64), dtype=np.float32); "
           "print(blas_kernels.native()); print((a @ b).tobytes().hex())")


def product_under(core: str | None) -> tuple[str, str]:
    """(the kernel picked, the product's bits) in a fresh interpreter with OPENBLAS_CORETYPE=core (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    if core:
        env["OPENBLAS_CORETYPE"] = core
    out = subprocess.run([sys.executable, "-c", PRODUCT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    picked, bits = out.stdout.split()
    return picked, bits


def test_the_kernels_forced_are_two_and_never_the_native_one():
    assert blas_kernels.coretypes("Haswell") == ["SandyBridge", "Nehalem"]
    assert blas_kernels.coretypes("SkylakeX") == ["Haswell", "SandyBridge"]  # an AVX-512 machine
    assert blas_kernels.coretypes("Sandybridge") == ["Haswell", "Nehalem"]  # threadpoolctl's spelling
    assert blas_kernels.coretypes(None) == ["Haswell", "SandyBridge"]


def test_the_notebooks_that_train_are_run_and_those_that_only_communicate_are_not():
    chosen = set(blas_kernels.notebooks())
    for path in ("notebooks/11_precision_and_quantization.ipynb", "notebooks/13_transformers.ipynb",
                 "notebooks/18_elastic.ipynb", "solutions/13_transformers.ipynb"):
        assert path in chosen, path  # a forced kernel changed one of their committed outputs
    for path in ("notebooks/03_collectives.ipynb", "notebooks/04_ring_allreduce.ipynb",
                 "solutions/04_ring_allreduce.ipynb"):
        assert path not in chosen, path
    assert set(blas_kernels.PENDING) <= chosen
    assert set(blas_kernels.runnable()) == chosen - set(blas_kernels.PENDING)


def test_the_two_parts_run_every_notebook_once_each_under_a_forced_kernel():
    """make test runs part 0 under the first forced kernel and part 1 under the second (half the
    time); together they are every notebook the rule picks, none twice."""
    parts = [subprocess.run([sys.executable, str(ROOT / "tests" / "blas_kernels.py"), "notebooks", str(k), "2"],
                            capture_output=True, text=True, check=True).stdout.split() for k in (0, 1)]
    assert sorted(parts[0] + parts[1]) == sorted(blas_kernels.runnable()) and not set(parts[0]) & set(parts[1])
    assert abs(len(parts[0]) - len(parts[1])) <= 1


def test_no_notebook_is_left_out_of_the_forced_kernels():
    assert not blas_kernels.PENDING


def test_make_test_runs_them_and_ci_does_not_let_them_skip():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    test_line = next(line for line in makefile.splitlines() if line.startswith("test:"))
    assert "test-notebooks-blas" in test_line.split()
    assert "OPENBLAS_CORETYPE=$$core" in makefile and "BLAS_STRICT" in makefile
    assert "make test BLAS_STRICT=1" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_a_forced_kernel_rounds_a_float32_product_differently_so_the_rerun_tests_something():
    native, bits = product_under(None)
    if native == "None":
        pytest.skip("NumPy's BLAS is not OpenBLAS here")
    results = {native: bits}
    for core in blas_kernels.coretypes(native):
        picked, bits = product_under(core)
        if picked.lower() != core.lower():
            pytest.skip(f"OpenBLAS's {core} kernel cannot be forced on this CPU (it picked {picked})")
        results[picked] = bits
    assert len(set(results.values())) > 1, f"{sorted(results)} gave the same bits: the forced runs would prove nothing"
