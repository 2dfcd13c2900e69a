"""Shared fixtures: ``device`` runs a test on the CPU and, when CuPy and a GPU are
present, again on CUDA; every test starts and ends with the deadline of the process as it
was (``p2p.set_timeout`` is process-wide, and a test whose rank threads set and restore it in
turn could leave a short one behind for the tests after it, which then time out)."""
import pytest

from minidist import backend, p2p

DEVICES = ["cpu"] + (["cuda"] if backend.cuda_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(autouse=True)
def deadline_restored():
    setting = p2p.set_timeout(None)  # read the setting (None: the default) ...
    p2p.set_timeout(setting)  # ... and put it back
    yield
    p2p.set_timeout(setting)
