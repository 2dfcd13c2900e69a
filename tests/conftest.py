"""Shared fixtures: ``device`` runs a test on the CPU and, when CuPy and a GPU are
present, again on CUDA."""
import pytest

from minidist import backend

DEVICES = ["cpu"] + (["cuda"] if backend.cuda_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param
