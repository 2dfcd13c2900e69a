"""Data-parallel inference: shard the test set across ranks, communicate once at the end.

Evaluating a trained model needs no communication while it runs: the model is the same on
every rank and each sample's prediction depends on that sample alone. So rank r of p takes
a contiguous shard of the n samples (``numpy.array_split`` sizes: the first n % p shards one
sample longer), counts how many it predicts correctly, and the ranks exchange nothing until
one final all-gather of three integers per rank, (correct, count, n). Integer counts add exactly, so the
accuracy equals the single-process one exactly; the work per rank is n/p samples, and the
only communication is one tiny message round, whatever n is. This is how a model is served
at scale ("embarrassingly parallel" inference, as in the data-parallel serving of
TensorFlow's distribution strategies and PyTorch's DDP evaluation loops).

    python -m minidist evaluate                      # one process
    mpiexec -n 4 python -m mpi4py -m minidist evaluate [--checkpoint model.npz]
"""
from __future__ import annotations

import argparse
import re
import sys

import numpy as np

from minidist.collectives import CollectiveError, all_gather, broadcast, chunk_bounds
from minidist.train import count_correct, positive_int


def shard_bounds(n: int, rank: int, size: int) -> tuple[int, int]:
    """(start, stop) of rank ``rank``'s contiguous shard of n samples over ``size`` ranks
    (``numpy.array_split`` sizes). Raises ValueError for a rank outside [0, size)."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"shard_bounds: rank must be in [0, {size}) with size >= 1, got rank {rank}, size {size}")
    return chunk_bounds(int(n), size)[rank]


def evaluate(model, X, y, comm, batch_size: int = 1024, device: str = "cpu") -> float:
    """Accuracy of ``model`` on (X, y), computed data-parallel over ``comm``.

    Every rank passes the same full X (n, features) and y (n,) (or at least arrays of the
    same length n whose shard it holds) and the same model; rank r evaluates samples
    ``shard_bounds(n, r, p)`` and the ranks then all-gather (correct, count, n) as int64, once.
    Returns the fraction in [0, 1] (NaN when n == 0) on every rank; it equals
    ``train.accuracy(model, X, y)`` exactly. Raises ValueError when X and y differ in
    length or batch_size < 1; CollectiveError when the ranks pass different n.
    """
    if len(X) != len(y):
        raise ValueError(f"evaluate: X has {len(X)} samples but y has {len(y)}")
    if batch_size < 1:
        raise ValueError(f"evaluate: batch_size must be >= 1, got {batch_size}")
    start, stop = shard_bounds(len(X), comm.Get_rank(), comm.Get_size())
    local = np.array([count_correct(model, X[start:stop], y[start:stop], batch_size, device), stop - start,
                      len(X)], np.int64)
    table = all_gather(comm, local)  # (p, 3): correct, count, n of every rank; the one communication
    if np.any(table[:, 2] != len(X)):
        raise CollectiveError(f"evaluate: every rank must pass the same test set; the ranks passed "
                              f"{table[:, 2].tolist()} samples")
    correct, count = int(table[:, 0].sum()), int(table[:, 1].sum())
    return float("nan") if count == 0 else correct / count


# ---------------------------------------------------------------------------------------
# python -m minidist evaluate
# ---------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """The ``evaluate`` command's flags."""
    p = argparse.ArgumentParser(
        prog="python -m minidist evaluate",
        description="Data-parallel evaluation on the test set: each rank scores its shard, one final gather. "
                    "Run under `mpiexec -n N python -m mpi4py -m minidist evaluate`.")
    p.add_argument("--checkpoint", metavar="PATH",
                   help="an .npz of a model's state_dict (np.savez(PATH, **model.state_dict())); the layer sizes "
                        "are read from it. Without it, rank 0 first trains the default MLP single-process")
    p.add_argument("--save", metavar="PATH", help="rank 0 saves the evaluated model's state_dict to PATH (.npz)")
    p.add_argument("--epochs", type=positive_int, default=10, help="epochs of the single-process training (default: 10)")
    p.add_argument("--hidden", type=positive_int, nargs="+", default=[128], help="hidden layer sizes (default: 128)")
    p.add_argument("--batch-size", type=positive_int, default=1024, help="evaluation batch per rank (default: 1024)")
    p.add_argument("--seed", type=int, default=0, help="seed for the data split, init and shuffling (default: 0)")
    p.add_argument("--dataset", choices=["digits", "mnist"], default="digits", help="digits (bundled) or mnist")
    p.add_argument("--data-dir", help="folder with the four MNIST IDX files (for --dataset mnist)")
    return p


def mlp_sizes_from_state(state) -> list[int]:
    """Layer sizes [in, hidden..., out] of an ``nn.mlp`` state_dict (keys "0.weight",
    "2.weight", ...). Raises ValueError when the state is not an MLP's."""
    layers = sorted((int(m.group(1)), key) for key in state if (m := re.fullmatch(r"(\d+)\.weight", key)))
    if not layers or any(state[key].ndim != 2 for _, key in layers):
        raise ValueError(f"not an nn.mlp state_dict (expected keys 0.weight, 2.weight, ...; got {sorted(state)})")
    sizes = [int(state[layers[0][1]].shape[1])]
    for _, key in layers:
        if state[key].shape[1] != sizes[-1]:
            raise ValueError(f"{key} has shape {state[key].shape}: its input size does not follow {sizes[-1]}")
        sizes.append(int(state[key].shape[0]))
    return sizes


def _train_single(args, dataset):
    """The default model trained single-process with ``train``'s defaults (quietly)."""
    from minidist import data, optim, train  # noqa: PLC0415

    targs = train.build_parser().parse_args(["--epochs", str(args.epochs), "--seed", str(args.seed),
                                             "--hidden", *map(str, args.hidden), "--no-progress"])
    model = train.build_model(targs, dataset)
    optimizer = optim.SGD(model.parameters(), lr=targs.lr, momentum=targs.momentum)
    loader = data.DataLoader(dataset.X_train, dataset.y_train, batch_size=targs.batch_size, shuffle=True,
                             seed=targs.seed)
    train.train_epochs(model, optimizer, loader, dataset, targs, show_progress=False, log=lambda line: None)
    return model


def evaluate_main(argv) -> int:
    """Entry point of ``python -m minidist evaluate``; returns the exit status.

    Every rank loads the dataset (and ``--checkpoint`` if given); otherwise rank 0 trains
    the default MLP. Rank 0's weights are broadcast, each rank scores its shard, one
    all-gather combines the counts. Rank 0 prints ranks, shard sizes, the single-process
    accuracy it measures itself, whether the two agree, and last ``test_accuracy=0.xxxx``.
    Exit status: 0; 1 when a file is missing or unreadable or the results disagree; 2 for
    usage errors (bad flags, a checkpoint that does not fit the dataset).
    """
    from minidist import nn, train  # noqa: PLC0415

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.dataset == "mnist" and not args.data_dir:
        parser.error("--dataset mnist needs --data-dir DIR (the folder with the MNIST IDX files)")
    try:
        from mpi4py import MPI  # noqa: PLC0415
    except ImportError as error:
        print(f"minidist evaluate: error: needs mpi4py ({error}); install it with `pip install mpi4py mpich`",
              file=sys.stderr)
        return 1
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    try:
        dataset = train.load_dataset(args)
        state = dict(np.load(args.checkpoint)) if args.checkpoint else None
    except (OSError, ValueError) as error:  # every rank reads the same files: all fail alike
        print(f"minidist evaluate: error: {error}", file=sys.stderr)
        return 1
    if state is not None:
        try:
            sizes = mlp_sizes_from_state(state)
        except ValueError as error:
            parser.error(f"--checkpoint {args.checkpoint}: {error}")
        if sizes[0] != dataset.num_features or sizes[-1] < dataset.num_classes:
            parser.error(f"--checkpoint {args.checkpoint} is a model for {sizes[0]} features and {sizes[-1]} "
                         f"classes; --dataset {args.dataset} has {dataset.num_features} and {dataset.num_classes}")
        model = nn.mlp(sizes)
        model.load_state_dict(state)
    elif rank == 0:
        model = _train_single(args, dataset)
    else:
        model = train.build_model(argparse.Namespace(hidden=args.hidden, seed=args.seed, device="cpu"), dataset)
    for p in model.parameters():  # rank 0's weights everywhere
        p.data[...] = broadcast(comm, p.data, root=0)
    accuracy = evaluate(model, dataset.X_test, dataset.y_test, comm, batch_size=args.batch_size)
    if rank != 0:
        return 0
    if args.save:
        np.savez(args.save, **model.state_dict())
    single = train.accuracy(model, dataset.X_test, dataset.y_test)
    shards = [stop - start for start, stop in (shard_bounds(len(dataset.X_test), r, size) for r in range(size))]
    print(f"ranks={size}")
    print(f"shard_sizes={','.join(map(str, shards))}")
    print(f"single_process_accuracy={single:.4f}")
    print(f"matches_single_process={accuracy == single}")
    print(f"test_accuracy={accuracy:.4f}")
    return 0 if accuracy == single else 1
