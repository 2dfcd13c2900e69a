"""Data: the bundled digits, MNIST's IDX files, batching, sharding and prefetching.

- :func:`load_digits` — scikit-learn's 1,797 bundled 8×8 handwritten digits (no
  download), split into train and test with a fixed seed.
- :func:`load_mnist` / :func:`read_idx` — the 70,000 28×28 MNIST digits from the IDX
  files of LeCun, Cortes & Burges (http://yann.lecun.com/exdb/mnist/), gzipped or not.
- :class:`DataLoader` — mini-batches, reshuffled every epoch from a seed.
- :class:`DistributedSampler` — which sample indices each rank reads (PyTorch's
  ``torch.utils.data.DistributedSampler``): every rank the same number, together
  covering the dataset once per epoch.
- :class:`PrefetchLoader` — a background thread that prepares the next batches while
  the model trains on the current one (the idea of ``tf.data``'s ``prefetch``).

All arrays are NumPy on the host: features float32 in [0, 1], labels int64. Moving a
batch to the GPU is the training loop's job (``Tensor(x, device="cuda")``).
"""
from __future__ import annotations

import gzip
import math
import os
import queue
import struct
import threading
import zlib
from typing import NamedTuple

import numpy as np


class DatasetError(ValueError):
    """A data file that cannot be used as it is: the message names the file and what is
    wrong with it (truncated, corrupt, a directory, labels out of range, ...)."""


class Dataset(NamedTuple):
    """A train/test split. X_*: float32 (n, features) in [0, 1]; y_*: int64 (n,)."""

    X_train: np.ndarray
    y_train: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray

    @property
    def num_features(self) -> int:
        return self.X_train.shape[1]

    @property
    def num_classes(self) -> int:
        return int(max(self.y_train.max(), self.y_test.max())) + 1


def load_digits(seed: int = 0, test_fraction: float = 0.25) -> Dataset:
    """scikit-learn's bundled digits (1,797 images of 8×8 pixels, 10 classes), with a
    stratified train/test split fixed by ``seed``.

    Returns a :class:`Dataset`: X (n, 64) float32 scaled from 0..16 to [0, 1]; y int64.
    With the defaults: 1,347 training and 450 test samples.
    Raises ValueError for ``test_fraction`` outside (0, 1).
    """
    # scikit-learn only for the bundled digits, imported here: it takes seconds to import, and every rank and
    # test that never loads digits would pay for it
    from sklearn.datasets import load_digits as _sk_load_digits  # noqa: PLC0415
    from sklearn.model_selection import train_test_split  # noqa: PLC0415

    if not 0 < test_fraction < 1:
        raise ValueError(f"load_digits: test_fraction must be in (0, 1), got {test_fraction}")
    bunch = _sk_load_digits()
    X = (bunch.data / 16.0).astype(np.float32)
    y = bunch.target.astype(np.int64)
    X_train, X_test, y_train, y_test = train_test_split(
        X, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    return Dataset(X_train, y_train, X_test, y_test)


# IDX format: 2 zero bytes, a type code, the number of dimensions, then each dimension
# as a big-endian 32-bit integer, then the data in row-major order, big-endian.
_IDX_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_REFETCH = "download it again (http://yann.lecun.com/exdb/mnist/ or a mirror)"


def read_idx(path) -> np.ndarray:
    """Read one IDX file (optionally gzipped, detected by its magic bytes).

    Returns an array of the file's shape and native-endian dtype.
    Raises FileNotFoundError for a missing file; :class:`DatasetError` (a ValueError) naming
    the file for a directory, an unreadable file, corrupt or truncated gzip data, a bad magic
    number, a header cut short, or data shorter or longer than the header says.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise DatasetError(f"{path}: is a directory, not an IDX file")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise
    except OSError as error:
        raise DatasetError(f"{path}: cannot be read ({error.strerror or error})") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as error:
            raise DatasetError(f"{path}: corrupt or truncated gzip data ({error}); {_REFETCH}") from None
    if not raw:
        raise DatasetError(f"{path}: the file is empty; {_REFETCH}")
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES:
        raise DatasetError(f"{path}: not an IDX file (bad magic number {raw[:4].hex()})")
    dtype, ndim = np.dtype(_IDX_TYPES[raw[2]]), raw[3]
    if len(raw) < 4 + 4 * ndim:
        raise DatasetError(f"{path}: the header announces {ndim} dimensions but the file ends after "
                           f"{len(raw)} bytes; {_REFETCH}")
    shape = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    expected = 4 + 4 * ndim + dtype.itemsize * math.prod(shape)
    if len(raw) != expected:
        raise DatasetError(f"{path}: header says shape {shape} ({expected} bytes) but the file has {len(raw)} bytes "
                           f"({'truncated' if len(raw) < expected else 'extra data'}); {_REFETCH}")
    data = np.frombuffer(raw, dtype=dtype, offset=4 + 4 * ndim).reshape(shape)
    return data.astype(dtype.newbyteorder("="))


_MNIST_FILES = {
    "X_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "X_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}
MNIST_CLASSES = 10  # the digits 0-9


def _check_mnist_array(key, array, path):
    """Images: (n, rows, cols) unsigned bytes, n >= 1; labels: (n,) integers in 0..9."""
    if key.startswith("X"):
        if array.ndim != 3 or array.dtype != np.uint8 or len(array) == 0:
            raise DatasetError(f"{path}: expected images, a non-empty (n, rows, cols) array of unsigned bytes (IDX "
                               f"type 0x08), got shape {array.shape} of {array.dtype}; is it the right file?")
        return
    if array.ndim != 1 or array.dtype.kind not in "iu" or len(array) == 0:
        raise DatasetError(f"{path}: expected labels, a non-empty (n,) array of integers, got shape {array.shape} "
                           f"of {array.dtype}; is it the right file?")
    bad = np.flatnonzero((array < 0) | (array >= MNIST_CLASSES))
    if bad.size:
        raise DatasetError(f"{path}: MNIST labels are the digits 0-{MNIST_CLASSES - 1}, but the label at index "
                           f"{bad[0]} is {array[bad[0]]} ({bad.size} of {array.size} out of range); "
                           "is the file corrupt?")


def load_mnist(data_dir) -> Dataset:
    """MNIST from the four IDX files in ``data_dir`` (names as distributed, with or
    without ``.gz``). Returns a :class:`Dataset`: X (n, rows * cols) float32 in [0, 1] (the
    bytes / 255), y int64 in 0..9.

    Raises:
        FileNotFoundError: a file is missing (the message lists the names looked for).
        DatasetError (a ValueError), naming the file and the problem: a file that
            :func:`read_idx` cannot read, images that are not a 3-D array of bytes, labels
            that are not 1-D or not all in 0..9, images and labels that differ in number,
            train and test images of different sizes.
    """
    arrays, paths = {}, {}
    for key, name in _MNIST_FILES.items():
        candidates = [os.path.join(data_dir, name + ext) for ext in ("", ".gz")]
        path = next((c for c in candidates if os.path.exists(c)), None)
        if path is None:
            raise FileNotFoundError(
                f"load_mnist: no {name}[.gz] in {os.fspath(data_dir)!r}. Put the four MNIST IDX files there "
                f"({', '.join(_MNIST_FILES.values())}, gzipped or not), or use --dataset digits."
            )
        arrays[key], paths[key] = read_idx(path), path
        _check_mnist_array(key, arrays[key], path)
    for split in ("train", "test"):
        X, y = arrays["X_" + split], arrays["y_" + split]
        if len(X) != len(y):
            raise DatasetError(f"load_mnist: {paths['X_' + split]} holds {len(X)} images but "
                               f"{paths['y_' + split]} holds {len(y)} labels; they must match one to one")
    if arrays["X_train"].shape[1:] != arrays["X_test"].shape[1:]:
        train, test = (arrays[k].shape[1:] for k in ("X_train", "X_test"))
        raise DatasetError(f"load_mnist: the training images are {train[0]}x{train[1]} pixels "
                           f"({paths['X_train']}) but the test images are {test[0]}x{test[1]} ({paths['X_test']}); "
                           "one model cannot read both")
    for split in ("train", "test"):
        X, y = arrays["X_" + split], arrays["y_" + split]
        arrays["X_" + split] = (X.reshape(len(X), -1) / 255.0).astype(np.float32)
        arrays["y_" + split] = y.astype(np.int64)
    return Dataset(**arrays)


class DistributedSampler:
    """The indices rank ``rank`` of ``num_replicas`` reads in an epoch (PyTorch's
    semantics).

    The index list (shuffled with ``seed + epoch`` when ``shuffle``) is padded by
    repeating its start until its length divides evenly, then rank r takes every
    ``num_replicas``-th index starting at r. With ``drop_last`` the tail is dropped
    instead of padded. Every rank gets ``len(sampler)`` indices; call
    :meth:`set_epoch` at the start of each epoch so the shuffle changes.

    Raises ValueError for ``rank`` outside [0, num_replicas) or num_replicas < 1.
    """

    def __init__(self, num_samples, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
        if num_replicas < 1:
            raise ValueError(f"DistributedSampler: num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"DistributedSampler: rank must be in [0, {num_replicas}), got {rank}")
        self.num_samples_total, self.num_replicas, self.rank = int(num_samples), num_replicas, rank
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0
        if drop_last:
            self.num_samples = self.num_samples_total // num_replicas
        else:
            self.num_samples = math.ceil(self.num_samples_total / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        n = self.num_samples_total
        if self.shuffle:
            indices = np.random.default_rng(self.seed + self.epoch).permutation(n)
        else:
            indices = np.arange(n)
        if self.total_size > n:  # pad by repeating the start
            indices = np.resize(indices, self.total_size) if n else indices
        return iter(indices[: self.total_size][self.rank :: self.num_replicas].tolist())

    def __len__(self):
        return self.num_samples


class DataLoader:
    """Mini-batches ``(x, y)`` of NumPy arrays.

    Args:
        X: array (n, ...); y: array (n,) or None (then batches are ``x`` alone).
        batch_size: samples per batch (>= 1); the last batch may be smaller unless
            ``drop_last``.
        shuffle: a new permutation each epoch, from ``seed`` and the epoch number.
        seed: int; the same seed gives the same batches.
        sampler: optional iterable of indices (e.g. a DistributedSampler); then
            ``shuffle`` is left to the sampler.

    Each ``for`` loop over the loader is one epoch; the epoch counter advances by one
    after each complete pass (or set it with :meth:`set_epoch`).

    Raises ValueError for batch_size < 1 or X and y of different lengths.
    """

    def __init__(self, X, y=None, batch_size=32, shuffle=True, seed=0, drop_last=False, sampler=None):
        if batch_size < 1:
            raise ValueError(f"DataLoader: batch_size must be >= 1, got {batch_size}")
        if y is not None and len(X) != len(y):
            raise ValueError(f"DataLoader: X has {len(X)} samples but y has {len(y)}")
        self.X, self.y, self.batch_size = X, y, int(batch_size)
        self.shuffle, self.seed, self.drop_last, self.sampler = shuffle, seed, drop_last, sampler
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def _indices(self):
        if self.sampler is not None:
            return np.fromiter(self.sampler, dtype=np.int64)
        if self.shuffle:
            return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.X))
        return np.arange(len(self.X))

    def __len__(self):
        n = len(self.sampler) if self.sampler is not None else len(self.X)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self):
        indices = self._indices()
        for b in range(len(self)):
            idx = indices[b * self.batch_size : (b + 1) * self.batch_size]
            yield self.X[idx] if self.y is None else (self.X[idx], self.y[idx])
        self.set_epoch(self.epoch + 1)


class PrefetchLoader:
    """Wrap any iterable of batches so a background thread loads up to ``depth``
    batches ahead while the caller computes on the current one.

    When loading a batch takes L seconds and a training step C seconds, a plain loop
    takes about L + C per batch; with prefetching, about max(L, C), because NumPy and
    most I/O release Python's GIL while they work. ``depth`` bounds the memory used
    by batches waiting in the queue.

    An exception raised while loading is re-raised in the caller at the batch where it
    happened. Leaving the loop early stops the thread.
    """

    _END = object()

    def __init__(self, loader, depth: int = 2):
        if depth < 1:
            raise ValueError(f"PrefetchLoader: depth must be >= 1, got {depth}")
        self.loader, self.depth = loader, depth

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        buffer = queue.Queue(maxsize=self.depth)
        stop = threading.Event()

        def put(item) -> bool:
            # Wait for room, but give up as soon as the consumer has left.
            while not stop.is_set():
                try:
                    buffer.put(item, timeout=0.05)
                    return True
                except queue.Full:
                    continue
            return False

        def produce():
            try:
                for batch in self.loader:
                    if not put(batch):
                        return
                put(self._END)
            except BaseException as error:  # handed to the consumer
                put(error)

        worker = threading.Thread(target=produce, name="minidist-prefetch", daemon=True)
        worker.start()
        try:
            while True:
                item = buffer.get()
                if item is self._END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            worker.join(timeout=5)
