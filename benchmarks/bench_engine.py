"""How much does the engine's bookkeeping cost? One SGD step of an MLP 784-512-512-10
(batch 128, float32, random data), timed three ways in the same process:

- ``numpy``:    a hand-written forward, backward and update in plain NumPy (the
                reference: the least work the step can be);
- ``minidist``: the same step through Tensor, the autograd graph, nn and optim;
- ``torch``:    the same step in PyTorch, when it is installed (for scale).

Prints the median of ``--repeats`` timings of each (after warm-up), and the ratio
minidist / numpy. The target is a ratio <= 1.15: the graph bookkeeping should be small
next to the matrix products. All contenders run in the same process with the same BLAS
limited to ``--blas-threads`` threads (default 1: on a small shared machine a
multi-threaded BLAS makes single timings swing by 2x, which would drown the ratio).

    .venv/bin/python benchmarks/bench_engine.py [--repeats 50] [--blas-threads 1] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np
from threadpoolctl import threadpool_limits

SIZES = (784, 512, 512, 10)
BATCH = 128
LR = 0.01


def make_data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, SIZES[0])).astype(np.float32)
    y = rng.integers(0, SIZES[-1], size=BATCH)
    weights = []
    for n_in, n_out in zip(SIZES[:-1], SIZES[1:]):
        bound = 1 / np.sqrt(n_in)
        weights.append((rng.uniform(-bound, bound, (n_out, n_in)).astype(np.float32),
                        rng.uniform(-bound, bound, n_out).astype(np.float32)))
    return x, y, weights


def numpy_step_fn(x, y, weights):
    """A hand-written step: forward, softmax cross-entropy, backward, SGD update."""
    params = [(w.copy(), b.copy()) for w, b in weights]
    n = len(x)
    rows = np.arange(n)

    def step():
        activations = [x]
        h = x
        for i, (w, b) in enumerate(params):
            h = h @ w.T
            h += b  # in place: no temporary (the engine's Linear does the same)
            if i < len(params) - 1:
                h = np.maximum(h, 0)
            activations.append(h)
        shifted = h - h.max(axis=1, keepdims=True)
        exp = np.exp(shifted)
        total = exp.sum(axis=1, keepdims=True)
        loss = -(shifted[rows, y] - np.log(total[:, 0])).mean()
        g = exp / total
        g[rows, y] -= 1
        g /= n
        for i in reversed(range(len(params))):
            w, b = params[i]
            a = activations[i]
            grad_w = g.T @ a
            grad_b = g.sum(axis=0)
            if i > 0:
                g = (g @ w) * (activations[i] > 0)
            w -= LR * grad_w
            b -= LR * grad_b
        return float(loss)

    return step


def minidist_step_fn(x, y, weights):
    from minidist import nn, optim
    from minidist.functions import cross_entropy
    from minidist.tensor import Tensor

    layers = []
    for i, (w, b) in enumerate(weights):
        linear = nn.Linear(w.shape[1], w.shape[0])
        linear.weight.data, linear.bias.data = w.copy(), b.copy()
        layers.append(linear)
        if i < len(weights) - 1:
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers)
    optimizer = optim.SGD(model.parameters(), lr=LR)
    xt = Tensor(x)

    def step():
        optimizer.zero_grad()
        loss = cross_entropy(model(xt), y)
        loss.backward()
        optimizer.step()
        return float(loss.item())

    return step


def torch_step_fn(x, y, weights):
    try:
        import torch
    except ImportError:
        return None
    layers = []
    for i, (w, b) in enumerate(weights):
        linear = torch.nn.Linear(w.shape[1], w.shape[0])
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(w))
            linear.bias.copy_(torch.from_numpy(b))
        layers.append(linear)
        if i < len(weights) - 1:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)

    def step():
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xt), yt)
        loss.backward()
        optimizer.step()
        return float(loss.item())

    return step


def time_interleaved(steps: dict, repeats: int, warmup: int = 5) -> dict:
    """Median seconds per step of each function, measured round-robin so that any
    slowdown of the machine during the run hits every contender alike."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    samples = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) for name, s in samples.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=50, help="timed steps per contender (default 50)")
    parser.add_argument("--blas-threads", type=int, default=1, help="BLAS threads for every contender (default 1)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    with threadpool_limits(limits=args.blas_threads):
        return run(args)


def run(args) -> int:

    x, y, weights = make_data()
    # Same starting weights and data: the first losses must agree, or we'd time different work.
    loss_np, loss_md = numpy_step_fn(x, y, weights)(), minidist_step_fn(x, y, weights)()
    assert abs(loss_np - loss_md) < 1e-4, f"numpy and minidist disagree on the loss: {loss_np} vs {loss_md}"

    steps = {"numpy": numpy_step_fn(x, y, weights), "minidist": minidist_step_fn(x, y, weights)}
    torch_step = torch_step_fn(x, y, weights)
    if torch_step is not None:
        steps["torch"] = torch_step
    medians = time_interleaved(steps, args.repeats)
    ratio = medians["minidist"] / medians["numpy"]

    print(f"one SGD step, MLP {'-'.join(map(str, SIZES))}, batch {BATCH}, float32, median of {args.repeats}, "
          f"{args.blas_threads} BLAS thread(s) ({platform.machine()}, numpy {np.__version__})")
    for name, seconds in medians.items():
        print(f"  {name:<9} {seconds * 1e3:8.3f} ms   {seconds / medians['numpy']:.3f}x numpy")
    print(f"ratio minidist/numpy = {ratio:.3f} (target <= 1.15: {'met' if ratio <= 1.15 else 'MISSED'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"median_seconds": medians, "ratio_minidist_numpy": ratio, "repeats": args.repeats,
                       "sizes": SIZES, "batch": BATCH, "blas_threads": args.blas_threads}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
