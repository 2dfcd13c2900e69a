"""The array module: NumPy on the CPU, CuPy on an NVIDIA GPU, chosen in one place.

Every op in the engine asks ``xp = get_array_module(x)`` for the module that owns its
input and calls ``xp.matmul``, ``xp.exp``, ... on it. Nothing else in minidist imports
CuPy, so the same code runs on both (the idea of NumPy's ``__array_function__`` protocol
and CuPy's ``cupy.get_array_module``; needle's ``backend_selection.py`` keeps the same
single switch).

The device is ``"cpu"`` unless the environment variable ``MINIDIST_DEVICE=cuda`` says
otherwise or a tensor is moved with ``Tensor.to("cuda")``. Asking for CUDA where CuPy or
a GPU is missing raises :class:`DeviceError` with the fix, instead of silently running
on the CPU.
"""
from __future__ import annotations

import os

import numpy

DEVICES = ("cpu", "cuda")


class DeviceError(RuntimeError):
    """A device was asked for that this machine cannot provide (for example ``cuda``
    without CuPy or without a GPU), or a device name is unknown."""


def _import_cupy():
    """Return the ``cupy`` module, or None when it is not installed or sees no GPU."""
    try:
        import cupy  # noqa: PLC0415 (optional dependency, imported on demand)
    except Exception:  # ImportError, or a CUDA library error while importing
        return None
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
    except Exception:
        return None
    return cupy


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one GPU."""
    return _import_cupy() is not None


def check_device(device: str) -> str:
    """Validate a device name and return it normalised (``"cpu"`` or ``"cuda"``).

    ``"cuda:0"`` is accepted as ``"cuda"``. Raises :class:`DeviceError` for an unknown
    name, or for ``cuda`` on a machine without CuPy or a GPU.
    """
    if not isinstance(device, str):
        raise DeviceError(f"device must be a string 'cpu' or 'cuda', got {device!r}")
    name = device.lower().split(":")[0]
    if name not in DEVICES:
        raise DeviceError(f"unknown device {device!r}; use one of {DEVICES}")
    if name == "cuda" and not cuda_available():
        raise DeviceError(
            "device 'cuda' was asked for, but CuPy is not installed or no GPU is visible. "
            "Install the GPU extra (pip install -e '.[gpu]', the CuPy wheel matching your "
            "CUDA driver) on a machine with an NVIDIA GPU, or use MINIDIST_DEVICE=cpu."
        )
    return name


def default_device() -> str:
    """The device new tensors are created on: ``$MINIDIST_DEVICE`` or ``"cpu"``."""
    return check_device(os.environ.get("MINIDIST_DEVICE", "cpu") or "cpu")


def module_for(device: str):
    """The array module (``numpy`` or ``cupy``) for a device name."""
    return numpy if check_device(device) == "cpu" else _import_cupy()


def get_array_module(*arrays):
    """The array module that owns ``arrays``: ``cupy`` if any of them is a CuPy array,
    else ``numpy``. Python scalars and None are ignored. Never imports CuPy when it is
    not already loaded, so on a CPU-only machine this costs a dictionary lookup."""
    for a in arrays:
        mod = type(a).__module__
        if mod.startswith("cupy"):
            import cupy  # noqa: PLC0415 (already imported: a cupy array exists)

            return cupy
    return numpy


def device_of(array) -> str:
    """``"cuda"`` for a CuPy array, ``"cpu"`` for anything else."""
    return "cuda" if get_array_module(array) is not numpy else "cpu"


def to_device(array, device: str):
    """Copy ``array`` to ``device`` (no copy when it is already there)."""
    device = check_device(device)
    if device == device_of(array):
        return array
    if device == "cpu":
        return array.get()
    return module_for("cuda").asarray(array)


def to_numpy(array):
    """A NumPy array with the contents of ``array`` (copied from the GPU if needed)."""
    if get_array_module(array) is numpy:
        return numpy.asarray(array)
    return array.get()


def scatter_add(target, index, values):
    """``target[index] += values`` in place, where an entry selected several times by
    an integer-array ``index`` receives every value (``numpy.add.at``; CuPy's
    ``cupyx.scatter_add`` on older CuPy). Basic indices (ints, slices) take the fast
    path of a plain assignment-add."""
    if _is_basic_index(index):
        target[index] += values
        return
    xp = get_array_module(target)
    if xp is numpy or hasattr(xp.add, "at"):
        xp.add.at(target, index, values)
    else:  # pragma: no cover (old CuPy)
        import cupyx  # noqa: PLC0415 (optional dependency, with cupy)

        cupyx.scatter_add(target, index, values)


def _is_basic_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return all(p is None or p is Ellipsis or isinstance(p, (int, slice)) for p in parts)
