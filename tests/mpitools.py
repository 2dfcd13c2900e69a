"""The one way tests find MPI, or skip with the reason and the fix (minidist.launch's
own lookup: mpiexec next to the interpreter, then on PATH; mpi4py importable)."""
import pytest

from minidist import launch


def mpi_missing():
    """None when mpiexec and mpi4py are both there, else why not (naming the fix)."""
    try:
        launch.require_mpi4py()
        launch.find_mpiexec()
    except launch.LaunchError as exc:
        return str(exc)
    return None


def mpiexec_or_skip() -> str:
    """The mpiexec path; skips the calling test when MPI is missing."""
    reason = mpi_missing()
    if reason:
        pytest.skip(f"no MPI: {reason}")
    return launch.find_mpiexec()


requires_mpi = pytest.mark.skipif(mpi_missing() is not None, reason=f"no MPI: {mpi_missing()}")


# The environment of the tests' training jobs: one BLAS thread per rank (the ranks share the
# cores; bit-identical comparisons also want a fixed summation order) and unbuffered output.
JOB_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def mpirun_minidist(n, *args, timeout=120, cwd=None):
    """``mpiexec -n N python -m mpi4py -m minidist ARGS`` in ``cwd`` (default: the repository)
    with :data:`JOB_ENV`; skips the calling test without MPI. The CompletedProcess, output
    captured as text."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    cwd = cwd or Path(__file__).resolve().parents[1]

    command = [mpiexec_or_skip(), "-n", str(n), sys.executable, "-m", "mpi4py", "-m", "minidist", *map(str, args)]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **JOB_ENV})


def saved_weights(path):
    """The arrays of a ``--save-model`` file, by name."""
    import numpy as np

    with np.load(path) as npz:
        return {k: npz[k] for k in npz.files}


def assert_bit_identical(a, b):
    """Two ``saved_weights`` dicts hold the same float32 arrays, bit for bit."""
    import numpy as np

    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype == np.float32
        assert np.array_equal(a[k], b[k]), f"{k} differs by up to {np.abs(a[k] - b[k]).max()}"
