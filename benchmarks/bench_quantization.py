"""Int8 post-training quantization: model bytes, test accuracy and forward latency, fp32 against int8.

Two models:

- ``digits``: the MLP of ``python -m minidist train`` (64-128-10), trained in float32 for
  ``--epochs`` epochs (seed 0), then ``quantization.quantize_dynamic``; accuracy on the 450
  test images, latency of one forward over that whole test batch.
- ``wide``: an untrained MLP ``--width`` wide with three Linear layers (float32 weights drawn
  by ``nn.mlp``), on a random batch of ``--batch`` rows: latency only, to see how the cost
  of the integer product grows with the layer size.

Latency is the median over ``--repeats`` interleaved rounds (fp32 then int8 in each round, so
a busy machine slows both alike) of the mean over ``--steps`` forwards, under ``no_grad``;
the ratio is int8 time / fp32 time measured in the same process. For the wide model the int8
forward is also split into its three parts (quantize the input, the int32 product, rescale).
One BLAS thread is used (set before NumPy loads).

Why int8 is not faster here: NumPy has no integer BLAS. A float32 product runs in OpenBLAS's
vectorised kernels; an int32 one (int8 codes widened so the sum cannot wrap) runs in NumPy's
generic loop, and quantizing the input adds passes over it. The int8 speed-up is a property of
hardware int8 units (x86 VNNI, ARM dot-product, GPU tensor cores) driven by kernels written for
them (FBGEMM, cuBLASLt): Jacob et al. 2018 measure it on ARM phones. What int8 gives everywhere
is 4x fewer bytes per weight (plus a float32 scale per output row and the float32 bias).

    .venv/bin/python benchmarks/bench_quantization.py [--epochs 10] [--width 1024] [--batch 256] [--json PATH]
    .venv/bin/python benchmarks/bench_quantization.py --quick      # a smoke run, seconds

Target (issue 12): int8 model bytes ~4x smaller; accuracy drop on digits <= 1 point.
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from minidist import data, nn, quantization, train  # noqa: E402
from minidist.tensor import Tensor, no_grad  # noqa: E402
from minidist.train import train_single  # noqa: E402


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=10, help="training epochs of the digits model (default: 10)")
    p.add_argument("--width", type=int, default=1024, help="width of the wide MLP (default: 1024)")
    p.add_argument("--batch", type=int, default=256, help="rows per forward of the wide MLP (default: 256)")
    p.add_argument("--steps", type=int, default=10, help="forwards per timing (default: 10)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds (default: 5)")
    p.add_argument("--quick", action="store_true", help="1 epoch, width 128, 2 rounds of 2 (smoke test)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p


def time_forwards(models, x, steps, repeats):
    """Median over ``repeats`` rounds of the mean seconds per forward of each model (rounds
    interleave the models)."""
    times = [[] for _ in models]
    with no_grad():
        for _ in range(repeats):
            for i, model in enumerate(models):
                began = time.perf_counter()
                for _ in range(steps):
                    model(x)
                times[i].append((time.perf_counter() - began) / steps)
    return [statistics.median(t) for t in times]


def int8_parts(layer, x, steps, repeats):
    """Median seconds of one QuantizedLinear forward's parts (quantize x, int32 product, rescale),
    and of the same integer product done in float64 BLAS."""
    parts = {}
    qx, sx = quantization.quantize_per_tensor(x)
    acc = qx.astype(np.int32) @ layer.qweight.T.astype(np.int32)
    assert np.array_equal(acc, qx.astype(np.float64) @ layer.qweight.T.astype(np.float64))
    jobs = {"quantize": lambda: quantization.quantize_per_tensor(x),
            "int32 product": lambda: qx.astype(np.int32) @ layer.qweight.T.astype(np.int32),
            # the same integer sums through float64 BLAS: exact (every partial sum is an integer
            # far below 2**53), so this isolates what the missing integer BLAS costs
            "same sums in float64 BLAS": lambda: qx.astype(np.float64) @ layer.qweight.T.astype(np.float64),
            "rescale": lambda: acc.astype(np.float32) * (sx * layer.weight_scale) + layer.bias}
    for _ in range(repeats):
        for name, job in jobs.items():
            began = time.perf_counter()
            for _ in range(steps):
                job()
            parts.setdefault(name, []).append((time.perf_counter() - began) / steps)
    return {name: statistics.median(t) for name, t in parts.items()}


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.quick:
        args.epochs, args.width, args.steps, args.repeats = 1, 128, 2, 2
    for name in ("epochs", "width", "batch", "steps", "repeats"):
        if getattr(args, name) < 1:
            build_parser().error(f"--{name} must be >= 1, got {getattr(args, name)}")

    dataset = data.load_digits(seed=0)
    fp32 = train_single(train.TrainConfig(epochs=args.epochs, progress=False), dataset, report=False).model
    int8 = quantization.quantize_dynamic(fp32)
    x_test = Tensor(dataset.X_test)
    digits = {
        "bytes": [quantization.model_bytes(fp32), quantization.model_bytes(int8)],
        "accuracy": [train.accuracy(m, dataset.X_test, dataset.y_test) for m in (fp32, int8)],
        "seconds": time_forwards([fp32, int8], x_test, args.steps, args.repeats),
    }

    wide32 = nn.mlp([args.width] * 4, rng=0)
    wide8 = quantization.quantize_dynamic(wide32)
    x = np.random.default_rng(1).standard_normal((args.batch, args.width)).astype(np.float32)
    wide = {
        "bytes": [quantization.model_bytes(wide32), quantization.model_bytes(wide8)],
        "seconds": time_forwards([wide32, wide8], Tensor(x), args.steps, args.repeats),
        "int8_parts_first_layer": int8_parts(wide8[0], x, args.steps, args.repeats),
    }
    with no_grad():
        began = time.perf_counter()
        for _ in range(args.steps):
            x @ wide32[0].weight.data.T
        wide["fp32_product_first_layer"] = (time.perf_counter() - began) / args.steps

    print(f"numpy {np.__version__}, python {platform.python_version()}, {platform.machine()}; "
          f"one BLAS thread; median of {args.repeats} rounds x {args.steps} forwards")
    print(f"{'model':<28}{'fp32':>12}{'int8':>12}{'int8/fp32':>11}")
    rows = [("digits bytes", *digits["bytes"]), ("digits test accuracy", *digits["accuracy"]),
            ("digits forward ms (450 rows)", *(1e3 * s for s in digits["seconds"])),
            (f"wide {args.width} bytes", *wide["bytes"]),
            (f"wide forward ms ({args.batch} rows)", *(1e3 * s for s in wide["seconds"]))]
    for name, a, b in rows:
        fmt = "{:>12.4f}" if "accuracy" in name else "{:>12.3f}" if "ms" in name else "{:>12,d}"
        print(f"{name:<28}" + fmt.format(a) + fmt.format(b) + f"{b / a:>11.3f}")
    drop = 100 * (digits["accuracy"][0] - digits["accuracy"][1])
    print(f"digits: bytes {digits['bytes'][0] / digits['bytes'][1]:.2f}x smaller, accuracy drop {drop:.2f} points")
    parts = wide["int8_parts_first_layer"]
    print(f"wide first layer, ms: fp32 product {1e3 * wide['fp32_product_first_layer']:.3f}; int8: "
          + ", ".join(f"{name} {1e3 * s:.3f}" for name, s in parts.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "digits": digits, "wide": wide}, indent=1))


if __name__ == "__main__":
    main()
