"""The main job: ``python -m minidist train`` (**contract**).

Trains a multilayer perceptron on the bundled digits (default) or on MNIST, prints a
tqdm progress bar, one line per epoch with loss and accuracy, and last the line
``final test_accuracy=0.xxxx``. Strategies are registered in ``STRATEGIES``: each
takes the parsed arguments and the dataset and returns a :class:`TrainResult`.

Unknown flags or values exit with a usage message (status 2), never a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from minidist import backend, data, nn, optim
from minidist.functions import cross_entropy
from minidist.tensor import Tensor, no_grad


@dataclass
class TrainResult:
    """What a strategy reports: the final test accuracy (fraction in [0, 1]), the
    per-epoch history (dicts with epoch, loss, train_accuracy, test_accuracy,
    seconds), and strategy-specific figures (e.g. bytes sent), printed before the last
    line."""

    test_accuracy: float
    history: list = field(default_factory=list)
    figures: dict = field(default_factory=dict)


def count_correct(model, X, y, batch_size: int = 1024, device: str = "cpu") -> int:
    """How many samples of (X, y) the model's argmax prediction gets right.
    X (n, features) float array, y (n,) int array. Runs under ``no_grad``."""
    correct = 0
    with no_grad():
        for start in range(0, len(X), batch_size):
            logits = model(Tensor(X[start : start + batch_size], device=device)).data
            predicted = backend.to_numpy(logits.argmax(axis=1))
            correct += int((predicted == np.asarray(y[start : start + batch_size])).sum())
    return correct


def accuracy(model, X, y, batch_size: int = 1024, device: str = "cpu") -> float:
    """Fraction of samples in (X, y) whose argmax prediction equals the label (NaN for
    an empty set). X (n, features) float array, y (n,) int array."""
    if len(X) == 0:
        return float("nan")
    return count_correct(model, X, y, batch_size, device) / len(X)


def report_epoch(model, dataset, args, epoch, loss, seconds, log=print) -> dict:
    """Score the model after an epoch and log the line every strategy prints; returns the
    history row (epoch, loss, train_accuracy, test_accuracy, seconds)."""
    row = {
        "epoch": epoch,
        "loss": loss,
        "train_accuracy": accuracy(model, dataset.X_train, dataset.y_train, device=args.device),
        "test_accuracy": accuracy(model, dataset.X_test, dataset.y_test, device=args.device),
        "seconds": seconds,
    }
    log(f"epoch {epoch}/{args.epochs}  loss={loss:.4f}  train_accuracy={row['train_accuracy']:.4f}  "
        f"test_accuracy={row['test_accuracy']:.4f}  time={seconds:.2f}s")
    return row


def load_dataset(args) -> data.Dataset:
    """The dataset named by ``args.dataset`` (``digits`` or ``mnist`` with ``args.data_dir``)."""
    if args.dataset == "mnist":
        return data.load_mnist(args.data_dir)
    return data.load_digits(seed=args.seed)


def build_model(args, dataset: data.Dataset) -> nn.Sequential:
    """An MLP features -> hidden... -> classes, initialised from ``args.seed``."""
    sizes = [dataset.num_features, *args.hidden, dataset.num_classes]
    return nn.mlp(sizes, rng=args.seed, device=args.device)


def train_epochs(model, optimizer, loader, dataset, args, *, step_hook=None, show_progress=True, log=print):
    """The training loop shared by strategies: for each epoch, for each batch: forward,
    loss, backward, ``step_hook`` (e.g. gradient averaging; may be None), optimizer step.
    Returns the history (list of per-epoch dicts)."""
    history = []
    for epoch in range(1, args.epochs + 1):
        loader.set_epoch(epoch - 1)
        start, total_loss, batches = time.perf_counter(), 0.0, 0
        bar = tqdm(loader, desc=f"epoch {epoch}/{args.epochs}", leave=False, disable=not show_progress,
                   file=sys.stderr, dynamic_ncols=True)
        for xb, yb in bar:
            optimizer.zero_grad()
            loss = cross_entropy(model(Tensor(xb, device=args.device)), backend.to_device(yb, args.device))
            loss.backward()
            if step_hook is not None:
                step_hook()
            optimizer.step()
            total_loss += float(loss.item())
            batches += 1
        seconds = time.perf_counter() - start
        history.append(report_epoch(model, dataset, args, epoch, total_loss / max(batches, 1), seconds, log))
    return history


def run_single(args, dataset: data.Dataset) -> TrainResult:
    """One process, one model: the reference every parallel strategy must match."""
    model = build_model(args, dataset)
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    loader = data.DataLoader(dataset.X_train, dataset.y_train, batch_size=args.batch_size, shuffle=True, seed=args.seed)
    log = tqdm.write if not args.no_progress else print
    history = train_epochs(model, optimizer, loader, dataset, args, show_progress=not args.no_progress, log=log)
    return TrainResult(history[-1]["test_accuracy"], history, {"ranks": 1, "bytes_communicated": 0})


class UsageError(Exception):
    """A combination of flags a strategy cannot run (e.g. ``--strategy ps`` on one
    rank); ``train_main`` prints it as a usage error and exits with status 2."""


# name -> runner(args, dataset) -> TrainResult on the reporting rank, None elsewhere.
# Parallel strategies live with their algorithm and are imported only when chosen.
STRATEGIES = {
    "single": run_single,
    "ddp": "minidist.parallel.data_parallel:run_ddp",
    "ps": "minidist.parallel.parameter_server:run_ps",
}


def resolve_strategy(name):
    """The runner function for a strategy name (importing its module on demand)."""
    runner = STRATEGIES[name]
    if isinstance(runner, str):
        module_name, function_name = runner.split(":")
        runner = getattr(importlib.import_module(module_name), function_name)
    return runner


def positive_int(text):
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text):
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``train`` command's flags (defaults reach >= 0.95 on digits in seconds)."""
    p = argparse.ArgumentParser(prog="python -m minidist train", description="Train an MLP with minidist.")
    p.add_argument("--strategy", choices=sorted(STRATEGIES), default="single", help="how to train (default: single)")
    p.add_argument("--epochs", type=positive_int, default=20, help="passes over the training set (default: 20)")
    p.add_argument("--batch-size", type=positive_int, default=32, help="samples per step, per rank (default: 32)")
    p.add_argument("--lr", type=_positive_float, default=0.05, help="learning rate (default: 0.05)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum in [0, 1) (default: 0.9)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="L2 penalty (default: 0)")
    p.add_argument("--hidden", type=positive_int, nargs="+", default=[128], help="hidden layer sizes (default: 128)")
    p.add_argument("--ps-mode", choices=["sync", "async", "ssp"], default="sync",
                   help="parameter-server mode: sync, async, or ssp (bounded staleness) (default: sync)")
    p.add_argument("--num-servers", type=positive_int, default=1, help="parameter-server ranks K (default: 1)")
    p.add_argument("--staleness", type=int, default=2,
                   help="for --ps-mode ssp: how many versions a worker may lag behind (default: 2)")
    p.add_argument("--scale-lr", action=argparse.BooleanOptionalAction, default=None,
                   help="linear scaling rule: multiply --lr by the number of data-parallel workers (Goyal et al. "
                        "2017) (default: on for ddp, where the global batch grows with the ranks; off otherwise)")
    p.add_argument("--warmup-epochs", type=float, default=0.0,
                   help="ramp the lr up linearly over this many epochs (Goyal et al. 2017) (default: 0)")
    p.add_argument("--seed", type=int, default=0, help="seed for data split, init and shuffling (default: 0)")
    p.add_argument("--dataset", choices=["digits", "mnist"], default="digits", help="digits (bundled) or mnist")
    p.add_argument("--data-dir", help="folder with the four MNIST IDX files (for --dataset mnist)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where to compute (default: cpu)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def check_args(parser, args) -> None:
    """Reject combinations argparse cannot see, with a usage error (exit 2)."""
    if args.dataset == "mnist" and not args.data_dir:
        parser.error("--dataset mnist needs --data-dir DIR (the folder with the MNIST IDX files)")
    if not 0 <= args.momentum < 1:
        parser.error(f"--momentum must be in [0, 1), got {args.momentum}")
    if args.weight_decay < 0:
        parser.error(f"--weight-decay must be >= 0, got {args.weight_decay}")
    if args.staleness < 0:
        parser.error(f"--staleness must be >= 0, got {args.staleness}")
    if args.warmup_epochs < 0:
        parser.error(f"--warmup-epochs must be >= 0, got {args.warmup_epochs}")
    if args.device == "cuda":
        try:
            backend.check_device("cuda")
        except backend.DeviceError as error:
            parser.error(str(error))


def train_main(argv) -> int:
    """Entry point of ``python -m minidist train``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    try:
        dataset = load_dataset(args)
    except (FileNotFoundError, ValueError) as error:
        print(f"minidist train: error: {error}", file=sys.stderr)
        return 1
    np.random.seed(args.seed)  # nothing should use the global generator; this makes sure
    nn.manual_seed(args.seed)
    try:
        result = resolve_strategy(args.strategy)(args, dataset)
    except UsageError as error:
        parser.error(str(error))
    if result is None:  # a rank that is not the reporter (under mpiexec)
        return 0
    for key, value in result.figures.items():
        print(f"{key}={value}")
    print(f"final test_accuracy={result.test_accuracy:.4f}")
    return 0
