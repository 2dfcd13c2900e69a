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
