"""Which OpenBLAS kernels `make test-notebooks-blas` forces, and on which notebooks.

OpenBLAS (NumPy's BLAS) carries one set of kernels per processor family and picks one when it
loads: Haswell's on an AVX2 machine, SkylakeX's on an AVX-512 one, NEOVERSEN1's on a Graviton.
Each adds up a matrix product in its own order, so the last bit of a product depends on the
machine; ``OPENBLAS_CORETYPE=<name>`` makes it load another (any older x86 family runs here).
A committed notebook output must not depend on that choice (issue 36), so the notebooks run
again under two kernels other than the native one.

    python tests/blas_kernels.py native          the kernel this machine picks (e.g. Haswell)
    python tests/blas_kernels.py coretypes       two kernels to force, neither of them the native one
    python tests/blas_kernels.py check NAME      exit 0 if OPENBLAS_CORETYPE=NAME took effect in this
                                                 process, else say why and exit 1 (2: cannot tell)
    python tests/blas_kernels.py notebooks       the notebooks to run under them (the rule below, less
                                                 PENDING, which it names on stderr)
    python tests/blas_kernels.py notebooks K N   part K (0 .. N-1) of them, every N-th from the K-th: with
                                                 N kernels, each notebook runs under one forced kernel

``make test`` runs each notebook under one of the two forced kernels (part 0 under the first, part
1 under the second), which halves the time of the check (3.5 of CI's minutes); ``make
test-notebooks-blas BLAS_ALL=1`` runs every notebook under both, as issue 36 first did.

The rule for the notebooks: a notebook runs under the forced kernels when its code trains or
differentiates (a ``.backward(`` call, an ``optim.`` optimizer, a ``train.`` or ``train_`` run
or ``.fit(``). Training is what turns a last-bit difference into a printed digit: 500 steps of
lesson 13's GPT in float32 end 0.05 apart under two kernels, while a single product or a sum
printed to a few digits does not move. The notebooks left out do not train in their own code:
they communicate, schedule or count (collectives on the simulator, cost models, traces: sums in
NumPy's own loops, which OpenBLAS's kernel does not touch), or, among the solutions, call a
check that answers with a sentence. Every notebook was run under SandyBridge and under Nehalem
once (issue 36): none of theirs printed anything else.
"""
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# x86-64 families, newest first; every CPU that runs the Haswell kernel runs the older ones.
CANDIDATES = ("Haswell", "SandyBridge", "Nehalem")
TRAINS = re.compile(r"\.backward\(|\boptim\.|\btrain\.\w+\(|\btrain_\w+\(|\.fit\(")
# Notebooks the rule selects that still print a kernel-dependent output, each with what moves and why. They are
# left out of the forced runs, loudly, until fixed (test_blas_kernels.py fails while this list is not empty).
# None today: lesson 11 left it (issue 36, item 1) once autocast summed in float64 and its DDP runs trained in float64.
PENDING: dict[str, str] = {}


def native() -> str | None:
    """The name of the kernel OpenBLAS picked in this process, or None when NumPy's BLAS is not OpenBLAS."""
    import numpy  # noqa: F401  (loads the BLAS)
    from threadpoolctl import threadpool_info

    for info in threadpool_info():
        if info.get("internal_api") == "openblas":
            return info.get("architecture")
    return None


def coretypes(picked: str | None) -> list[str]:
    """Two kernels to force besides ``picked`` (the native one): the newest candidates that differ from it."""
    return [name for name in CANDIDATES if name.lower() != (picked or "").lower()][:2]


def notebooks() -> list[str]:
    """The lessons and solutions whose code trains or differentiates (module docstring), as paths from the root."""
    chosen = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "solutions").glob("*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]  # nbformat 4; plain JSON loads faster
        if any(cell["cell_type"] == "code" and TRAINS.search("".join(cell["source"])) for cell in cells):
            chosen.append(str(path.relative_to(ROOT)))
    return chosen


def runnable() -> list[str]:
    """:func:`notebooks` less :data:`PENDING`."""
    return [path for path in notebooks() if path not in PENDING]


def main(argv: list[str]) -> int:
    command = argv[1] if len(argv) > 1 else ""
    if command == "native":
        print(native() or "not-openblas")
    elif command == "coretypes":
        import os

        if os.environ.get("OPENBLAS_CORETYPE"):  # the native kernel is the one picked without it
            print("OPENBLAS_CORETYPE is set: unset it to list the kernels to force", file=sys.stderr)
            return 2
        print(" ".join(coretypes(native())))
    elif command == "check" and len(argv) == 3:
        picked = native()
        if picked is None:
            print("NumPy's BLAS is not OpenBLAS here: its kernel cannot be forced", file=sys.stderr)
            return 2
        if picked.lower() != argv[2].lower():
            print(f"OPENBLAS_CORETYPE={argv[2]} did not take effect: OpenBLAS picked {picked} (this CPU "
                  "cannot run that kernel, or OpenBLAS was built without it)", file=sys.stderr)
            return 1
        print(f"OpenBLAS kernel: {picked} (forced)")
    elif command == "notebooks" and len(argv) in (2, 4):
        for path, why in PENDING.items():
            print(f"NOT run under the forced kernels yet: {path}: {why}", file=sys.stderr)
        part, parts = (int(argv[2]), int(argv[3])) if len(argv) == 4 else (0, 1)
        print(" ".join(runnable()[part::parts]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
