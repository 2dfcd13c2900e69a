"""Determinism: the same seed and flags give bit-identical weights, run after run; async ps does not.

Each strategy trains twice from scratch (two epochs of digits, a small MLP) and the final
weights, written by ``--save-model`` (``TrainConfig.save_model``), must be equal to the bit.
The oracle is the other run: nothing in a run may depend on thread timing, arrival order or a
generator shared with anything else. What breaks this, on purpose, is asynchronous parameter
serving: a server applies each push as it arrives, and the order of arrivals is timing.
"""
import dataclasses

import numpy as np
import pytest

from minidist import nn, optim, sim, train
from minidist.cli.train import run_driver

CONFIG = train.TrainConfig(epochs=2, hidden=(16,), progress=False, timeout=60.0)


def weights(path) -> dict:
    with np.load(path) as npz:
        return {k: npz[k] for k in npz.files}


def trained(tmp_path, name: str, config, ranks: int) -> dict:
    """Train ``config`` from scratch (as the command line does: the module generator seeded
    first) on ``ranks`` simulated ranks (1: no communicator) and return the saved weights."""
    config = dataclasses.replace(config, save_model=str(tmp_path / f"{name}.npz"))
    dataset = train.load_dataset(config)
    nn.manual_seed(config.seed)
    if ranks == 1:
        train.train_single(config, dataset)
    else:
        sim.run(lambda comm: run_driver(config, dataset, comm), ranks)
    return weights(tmp_path / f"{name}.npz")


@pytest.mark.parametrize("changes, ranks", [
    ({}, 1),
    ({"strategy": "ddp"}, 2),
    ({"strategy": "ps", "ps_mode": "sync"}, 3),  # 1 server, 2 workers
    ({"strategy": "pipeline", "schedule": "1f1b", "microbatches": 4}, 2),
], ids=["single", "ddp-2", "ps-sync-1+2", "pipeline-1f1b-2"])
def test_the_same_seed_gives_bit_identical_weights(tmp_path, changes, ranks):
    config = dataclasses.replace(CONFIG, **changes)
    first, second = trained(tmp_path, "first", config, ranks), trained(tmp_path, "second", config, ranks)
    assert len(first) == 4 and sorted(first) == sorted(second)
    for key in first:
        assert first[key].tobytes() == second[key].tobytes(), key
    other = trained(tmp_path, "other-seed", dataclasses.replace(config, seed=1), ranks)
    assert any(first[k].tobytes() != other[k].tobytes() for k in first)  # the comparison can tell runs apart


def test_async_ps_applies_pushes_in_arrival_order_so_the_order_changes_the_weights():
    """Why ``--ps-mode async`` promises no bit-identical rerun: its server applies each gradient
    on arrival (``ParameterServer._push``), and which worker's push arrives first is timing.
    The same two gradients applied in the two orders, by the server's own optimizer (SGD with
    momentum, as ``train`` configures it), give different weights: with momentum the first
    gradient is counted again in the second update; even without momentum, float32 rounding
    of (w - a) - b and (w - b) - a differs in some elements. Sync (and ssp) servers wait for
    every worker's gradient of a clock and sum them in worker order, so they are repeatable."""
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal(1000).astype(np.float32)
    g = [rng.standard_normal(1000).astype(np.float32) for _ in range(2)]

    def server(order, momentum):
        shard = nn.Parameter(w0.copy())
        sgd = optim.SGD([shard], lr=0.05, momentum=momentum)
        for worker in order:
            shard.grad = g[worker].copy()
            sgd.step()
        return shard.data

    for momentum in (0.9, 0.0):
        a, b = server((0, 1), momentum), server((1, 0), momentum)
        # By hand: order (0, 1) moves w by lr (g0 + (momentum g0 + g1)), order (1, 0) by lr (g1 + (momentum g1 + g0)).
        expected = -0.05 * momentum * (g[0].astype(np.float64) - g[1])
        np.testing.assert_allclose(a.astype(np.float64) - b, expected, rtol=0, atol=1e-6)
        assert a.tobytes() != b.tobytes()  # not the same bits, even where the two orders agree in exact arithmetic
