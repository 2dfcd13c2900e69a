"""The main job from the command line, as a user runs it."""
import re
import subprocess
import sys

import numpy as np
import pytest

from test_data import write_idx


def run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "minidist", *args], capture_output=True, text=True, timeout=timeout)


def test_default_training_reaches_95_percent_on_digits():
    result = run("train", "--strategy", "single")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert re.fullmatch(r"final test_accuracy=0\.\d{4}", lines[-1])
    assert float(lines[-1].split("=")[1]) >= 0.95
    assert sum(line.startswith("epoch ") and "loss=" in line and "test_accuracy=" in line for line in lines) == 20


@pytest.mark.parametrize("args,message", [
    (["train", "--bogus"], "unrecognized arguments: --bogus"),
    (["train", "--strategy", "magic"], "invalid choice: 'magic'"),
    (["train", "--epochs", "0"], "must be a positive integer"),
    (["train", "--lr", "abc"], "argument --lr"),
    (["train", "--momentum", "1.5"], "--momentum must be in"),
    (["train", "--dataset", "mnist"], "needs --data-dir"),
    (["frobnicate"], "unknown command 'frobnicate'"),
])
def test_usage_errors_not_tracebacks(args, message):
    result = run(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_mnist_files_is_a_clear_error(tmp_path):
    result = run("train", "--dataset", "mnist", "--data-dir", str(tmp_path))
    assert result.returncode == 1 and "train-images-idx3-ubyte" in result.stderr and "Traceback" not in result.stderr


def test_trains_on_mnist_idx_files(tmp_path):
    rng = np.random.default_rng(0)
    for split, n in (("train", 40), ("t10k", 20)):
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        images = np.zeros((n, 28, 28), np.uint8)
        images[np.arange(n), labels, labels] = 255  # a learnable pixel per class
        write_idx(tmp_path / f"{split}-images-idx3-ubyte.gz", images, 0x08, True)
        write_idx(tmp_path / f"{split}-labels-idx1-ubyte.gz", labels, 0x08, True)
    result = run("train", "--dataset", "mnist", "--data-dir", str(tmp_path), "--epochs", "2", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1].startswith("final test_accuracy=")


def test_help_lists_commands():
    result = run("--help")
    assert result.returncode == 0 and "train" in result.stdout and "doctor" in result.stdout
