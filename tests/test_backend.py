"""The one switch between NumPy and CuPy."""
import numpy as np
import pytest

from minidist import Tensor, backend


def test_cpu_is_the_default(monkeypatch):
    monkeypatch.delenv("MINIDIST_DEVICE", raising=False)
    assert backend.default_device() == "cpu"
    assert backend.get_array_module(np.ones(2), 3.0, None) is np
    assert Tensor([1.0]).device == "cpu"
    assert backend.check_device("CPU") == "cpu"


def test_to_numpy_and_to_device_on_cpu():
    a = np.arange(3)
    assert backend.to_numpy(a) is a
    assert backend.to_device(a, "cpu") is a
    assert Tensor(a).to("cpu").data is a


@pytest.mark.skipif(not backend.cuda_available(), reason="needs CuPy and a GPU")
def test_cuda_roundtrip():
    t = Tensor(np.arange(3.0), requires_grad=True).to("cuda")
    assert t.device == "cuda" and backend.get_array_module(t.data).__name__ == "cupy"
    (t * t).sum().backward()
    np.testing.assert_array_equal(backend.to_numpy(t.grad), [0.0, 2.0, 4.0])
