"""Digits, MNIST IDX files written by the test, DataLoader, DistributedSampler, prefetch."""
import gzip
import struct
import threading
import time

import numpy as np
import pytest

from minidist import data


def test_load_digits_is_fixed_and_scaled():
    a, b = data.load_digits(seed=0), data.load_digits(seed=0)
    assert a.X_train.dtype == np.float32 and a.y_train.dtype == np.int64
    assert a.X_train.shape == (1347, 64) and a.X_test.shape == (450, 64)
    assert 0.0 <= a.X_train.min() and a.X_train.max() <= 1.0 and a.X_train.max() == 1.0
    assert np.array_equal(a.X_train, b.X_train) and np.array_equal(a.y_test, b.y_test)
    assert not np.array_equal(a.y_train, data.load_digits(seed=1).y_train)
    assert a.num_classes == 10 and a.num_features == 64
    with pytest.raises(ValueError, match="test_fraction"):
        data.load_digits(test_fraction=1.5)


def write_idx(path, array, code, compress):
    header = struct.pack(">BBBB", 0, 0, code, array.ndim) + struct.pack(f">{array.ndim}i", *array.shape)
    payload = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    with (gzip.open if compress else open)(path, "wb") as f:
        f.write(payload)


@pytest.mark.parametrize("compress", [False, True])
def test_load_mnist_from_small_idx_files(tmp_path, compress):
    rng = np.random.default_rng(0)
    ext = ".gz" if compress else ""
    images = {"train": rng.integers(0, 256, (6, 28, 28), dtype=np.uint8),
              "t10k": rng.integers(0, 256, (3, 28, 28), dtype=np.uint8)}
    labels = {"train": rng.integers(0, 10, 6, dtype=np.uint8), "t10k": rng.integers(0, 10, 3, dtype=np.uint8)}
    for split in ("train", "t10k"):
        write_idx(tmp_path / f"{split}-images-idx3-ubyte{ext}", images[split], 0x08, compress)
        write_idx(tmp_path / f"{split}-labels-idx1-ubyte{ext}", labels[split], 0x08, compress)
    ds = data.load_mnist(tmp_path)
    assert ds.X_train.shape == (6, 784) and ds.X_test.shape == (3, 784) and ds.X_train.dtype == np.float32
    np.testing.assert_allclose(ds.X_train[1], images["train"][1].reshape(-1) / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(ds.y_test, labels["t10k"])


def test_read_idx_other_dtypes_and_errors(tmp_path):
    arr = np.arange(12, dtype=np.int32).reshape(3, 4) - 5
    write_idx(tmp_path / "a", arr, 0x0C, False)
    np.testing.assert_array_equal(data.read_idx(tmp_path / "a"), arr)
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(ValueError, match="not an IDX file"):
        data.read_idx(tmp_path / "bad")
    (tmp_path / "short").write_bytes(struct.pack(">BBBBi", 0, 0, 8, 1, 10) + b"\x00" * 3)
    with pytest.raises(ValueError, match="header says shape"):
        data.read_idx(tmp_path / "short")
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
        data.load_mnist(tmp_path)


def test_dataloader_batches_cover_the_data_once_per_epoch():
    X, y = np.arange(10.0).reshape(10, 1), np.arange(10)
    loader = data.DataLoader(X, y, batch_size=4, seed=3)
    epoch0 = [b for _, b in loader]
    epoch1 = [b for _, b in loader]
    assert [len(b) for b in epoch0] == [4, 4, 2] and len(loader) == 3
    assert sorted(np.concatenate(epoch0)) == list(range(10))
    assert not np.array_equal(np.concatenate(epoch0), np.concatenate(epoch1))  # reshuffled
    again = data.DataLoader(X, y, batch_size=4, seed=3)
    assert np.array_equal(np.concatenate([b for _, b in again]), np.concatenate(epoch0))
    assert len(data.DataLoader(X, y, batch_size=4, drop_last=True)) == 2
    plain = data.DataLoader(X, y, batch_size=3, shuffle=False)
    assert list(next(iter(plain))[1]) == [0, 1, 2]


def test_dataloader_errors():
    with pytest.raises(ValueError, match="batch_size"):
        data.DataLoader(np.ones((3, 1)), np.ones(3), batch_size=0)
    with pytest.raises(ValueError, match="X has 3 samples but y has 2"):
        data.DataLoader(np.ones((3, 1)), np.ones(2))


@pytest.mark.parametrize("n,p", [(10, 3), (12, 4), (5, 8), (7, 1)])
def test_distributed_sampler_shards_like_pytorch(n, p):
    shards = [list(data.DistributedSampler(n, p, r, shuffle=True, seed=1)) for r in range(p)]
    assert len({len(s) for s in shards}) == 1 and len(shards[0]) == -(-n // p)
    together = sorted(i for s in shards for i in s)
    assert set(together) == set(range(n)) and len(together) == -(-n // p) * p
    sampler = data.DistributedSampler(n, p, 0, shuffle=True, seed=1)
    sampler.set_epoch(1)
    assert n < 3 or list(sampler) != shards[0] or p == n
    # drop_last: equal shards without padding
    dropped = [list(data.DistributedSampler(n, p, r, shuffle=False, drop_last=True)) for r in range(p)]
    assert all(len(s) == n // p for s in dropped)


def test_distributed_sampler_matches_torch_when_available():
    torch = pytest.importorskip("torch")
    from torch.utils.data import DistributedSampler as TorchSampler

    ours = [list(data.DistributedSampler(10, 3, r, shuffle=False)) for r in range(3)]
    theirs = [list(TorchSampler(range(10), num_replicas=3, rank=r, shuffle=False)) for r in range(3)]
    assert ours == theirs
    del torch


def test_distributed_sampler_errors():
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        data.DistributedSampler(10, 2, 2)
    with pytest.raises(ValueError, match="num_replicas"):
        data.DistributedSampler(10, 0, 0)


class SlowLoader:
    def __init__(self, n, delay):
        self.n, self.delay = n, delay

    def __len__(self):
        return self.n

    def __iter__(self):
        for i in range(self.n):
            time.sleep(self.delay)
            yield i


def test_prefetch_keeps_order_runs_ahead_and_is_bounded():
    assert list(data.PrefetchLoader(SlowLoader(5, 0.0), depth=2)) == [0, 1, 2, 3, 4]
    produced = []

    def recording():
        for i in range(10):
            produced.append(i)
            yield i

    it = iter(data.PrefetchLoader(recording(), depth=2))
    assert next(it) == 0
    deadline = time.monotonic() + 5
    while len(produced) < 4 and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.05)
    # While we "compute" on batch 0, batches 1 and 2 wait in the queue and batch 3 is
    # loaded and waiting for room: loading ran ahead, but never more than depth + 1.
    assert produced == [0, 1, 2, 3]
    assert list(it) == list(range(1, 10))


def test_prefetch_reraises_and_stops_early():
    def broken():
        yield 1
        raise OSError("disk gone")

    it = iter(data.PrefetchLoader(broken()))
    assert next(it) == 1
    with pytest.raises(OSError, match="disk gone"):
        next(it)
    before = threading.active_count()
    for i in data.PrefetchLoader(SlowLoader(100, 0.001), depth=1):
        if i == 2:
            break
    time.sleep(0.2)
    assert threading.active_count() <= before


# -- MNIST files that cannot be used: a DatasetError (a ValueError) naming the file --------

def write_mnist(directory, compress=False, n_train=6, n_test=3, size=28, labels=None):
    """Four small valid MNIST files; returns {name: path}."""
    rng = np.random.default_rng(0)
    ext = ".gz" if compress else ""
    paths = {}
    for split, n in (("train", n_train), ("t10k", n_test)):
        paths[f"{split}-images"] = directory / f"{split}-images-idx3-ubyte{ext}"
        paths[f"{split}-labels"] = directory / f"{split}-labels-idx1-ubyte{ext}"
        write_idx(paths[f"{split}-images"], rng.integers(0, 256, (n, size, size), dtype=np.uint8), 0x08, compress)
        y = rng.integers(0, 10, n, dtype=np.uint8) if labels is None else np.asarray(labels, np.uint8)
        write_idx(paths[f"{split}-labels"], y, 0x08, compress)
    return paths


def load_error(directory):
    with pytest.raises(data.DatasetError) as error:
        data.load_mnist(directory)
    message = str(error.value)
    assert isinstance(error.value, ValueError)
    return message


def test_truncated_gzip_is_named(tmp_path):
    paths = write_mnist(tmp_path, compress=True)
    raw = paths["train-images"].read_bytes()
    paths["train-images"].write_bytes(raw[: len(raw) // 2])
    message = load_error(tmp_path)
    assert str(paths["train-images"]) in message and "corrupt or truncated gzip data" in message


def test_corrupt_gzip_is_named(tmp_path):
    paths = write_mnist(tmp_path, compress=True)
    raw = bytearray(paths["t10k-labels"].read_bytes())
    raw[-8] ^= 0xFF  # the CRC-32 of the data no longer matches
    paths["t10k-labels"].write_bytes(bytes(raw))
    message = load_error(tmp_path)
    assert str(paths["t10k-labels"]) in message and "corrupt or truncated gzip data" in message


def test_truncated_idx_data_and_header_are_named(tmp_path):
    paths = write_mnist(tmp_path)
    raw = paths["train-images"].read_bytes()
    paths["train-images"].write_bytes(raw[:-5])
    message = load_error(tmp_path)
    assert str(paths["train-images"]) in message and "truncated" in message
    paths["train-images"].write_bytes(raw[:9])  # 3 dimensions announced, the second cut short
    message = load_error(tmp_path)
    assert str(paths["train-images"]) in message and "announces 3 dimensions" in message
    paths["train-images"].write_bytes(b"")
    assert "the file is empty" in load_error(tmp_path)


def test_a_directory_in_place_of_a_file_is_named(tmp_path):
    paths = write_mnist(tmp_path)
    paths["t10k-images"].unlink()
    paths["t10k-images"].mkdir()
    message = load_error(tmp_path)
    assert str(paths["t10k-images"]) in message and "is a directory" in message


def test_labels_out_of_range_are_named(tmp_path):
    paths = write_mnist(tmp_path, labels=[3, 1, 200, 4, 5, 9], n_test=6)
    message = load_error(tmp_path)
    assert str(paths["train-labels"]) in message and "the label at index 2 is 200" in message and "0-9" in message


def test_image_and_label_counts_that_differ_are_named(tmp_path):
    paths = write_mnist(tmp_path)
    write_idx(paths["train-labels"], np.zeros(5, np.uint8), 0x08, False)
    message = load_error(tmp_path)
    assert str(paths["train-images"]) in message and str(paths["train-labels"]) in message
    assert "6 images but" in message and "5 labels" in message


def test_train_and_test_images_of_different_sizes_are_named(tmp_path):
    paths = write_mnist(tmp_path)
    write_idx(paths["t10k-images"], np.zeros((3, 20, 20), np.uint8), 0x08, False)
    message = load_error(tmp_path)
    assert "28x28" in message and "20x20" in message and str(paths["t10k-images"]) in message


def test_files_swapped_or_of_the_wrong_type_are_named(tmp_path):
    paths = write_mnist(tmp_path)
    write_idx(paths["train-images"], np.zeros(6, np.uint8), 0x08, False)  # a labels file
    message = load_error(tmp_path)
    assert str(paths["train-images"]) in message and "expected images" in message
    write_mnist(tmp_path)
    write_idx(paths["t10k-labels"], np.zeros(3, np.float32), 0x0D, False)
    message = load_error(tmp_path)
    assert str(paths["t10k-labels"]) in message and "expected labels" in message
