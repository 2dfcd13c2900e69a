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

    python -m minidist evaluate                      # one process (the command is in minidist.cli)
    mpiexec -n 4 python -m mpi4py -m minidist evaluate [--checkpoint model.npz]
"""
from __future__ import annotations

import re

import numpy as np

from minidist.collectives import all_gather, chunk_bounds
from minidist.p2p import CollectiveError
from minidist.train import count_correct


def evaluate(model, X, y, comm, batch_size: int = 1024, device: str = "cpu") -> float:
    """Accuracy of ``model`` on (X, y), computed data-parallel over ``comm``.

    Every rank passes the same full X (n, features) and y (n,) (or at least arrays of the
    same length n whose shard it holds) and the same model; rank r evaluates samples
    ``start:stop = collectives.chunk_bounds(n, p)[r]`` and the ranks then all-gather
    (correct, count, n) as int64, once.
    Returns the fraction in [0, 1] (NaN when n == 0) on every rank; it equals
    ``train.accuracy(model, X, y)`` exactly. Raises ValueError when X and y differ in
    length or batch_size < 1; CollectiveError when the ranks pass different n.
    """
    if len(X) != len(y):
        raise ValueError(f"evaluate: X has {len(X)} samples but y has {len(y)}")
    if batch_size < 1:
        raise ValueError(f"evaluate: batch_size must be >= 1, got {batch_size}")
    start, stop = chunk_bounds(len(X), comm.Get_size())[comm.Get_rank()]
    local = np.array([count_correct(model, X[start:stop], y[start:stop], batch_size, device), stop - start,
                      len(X)], np.int64)
    table = all_gather(comm, local)  # (p, 3): correct, count, n of every rank; the one communication
    if np.any(table[:, 2] != len(X)):
        raise CollectiveError(f"evaluate: every rank must pass the same test set; the ranks passed "
                              f"{table[:, 2].tolist()} samples")
    correct, count = int(table[:, 0].sum()), int(table[:, 1].sum())
    return float("nan") if count == 0 else correct / count


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
