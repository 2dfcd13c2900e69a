"""Fit the alpha-beta-gamma cost model to this machine, for P ranks.

    .venv/bin/mpiexec -n P .venv/bin/python -m mpi4py benchmarks/fit_costmodel.py [--iters N] [--repeats R]
        [--json PATH]

The ranks pair up and swap 4 B .. 16 MiB through the engine (``costmodel.measure_exchange``:
``p2p.post_exchange`` and ``p2p.wait_all``, one step of the collectives' algorithms, so alpha
includes the Python every step pays, and with more ranks than cores the wait for a core);
rank 0 times a local float32 ``numpy.add`` (``costmodel.measure_reduction``). Each size keeps
the fastest of ``--repeats`` whole sweeps (each itself a median of ``--iters`` exchanges),
which tames a machine shared with other jobs. Rank 0 prints the measurements, the fitted
alpha (s/message), beta (s/byte) and gamma (s/byte reduced), what the line predicts next to
what was measured, and the ``FITTED[P] = CostModel(...)`` line to paste into
``minidist/costmodel.py``. Run it for every world size "auto" should know (P = 2 and 4 here).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys

from mpi4py import MPI

from minidist import costmodel

SIZES = [4**k for k in range(1, 13)]  # 4 B .. 16 MiB


def best_of_sweeps(sweeps):
    """[[(n, t), ...], ...] -> [(n, min t), ...] size by size: the least disturbed sweep.

    Two ranks that busy-poll for messages on a 2-core machine shared with other jobs slow
    down several-fold whenever a third process wants a core; the minimum over sweeps
    (each already a median) is the machine's own speed, not its neighbours'."""
    return [(n, min(s[i][1] for s in sweeps)) for i, (n, _) in enumerate(sweeps[0])]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=30, help="round trips per size and sweep (default 30)")
    parser.add_argument("--repeats", type=int, default=5, help="sweeps over all sizes; the fastest is kept (default 5)")
    parser.add_argument("--json", metavar="PATH", help="write measurements and constants as JSON")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    if p < 2:
        print("fit_costmodel: run under `mpiexec -n 2` (needs two ranks)", file=sys.stderr)
        return 2

    sweeps = [costmodel.measure_exchange(comm, SIZES, iters=args.iters) for _ in range(args.repeats)]
    if comm.Get_rank() != 0:
        return 0
    exchange = best_of_sweeps(sweeps)
    reduction = best_of_sweeps([costmodel.measure_reduction(SIZES[2:], iters=args.iters)
                                  for _ in range(args.repeats)])
    model = costmodel.fit(exchange, reduction)

    print(f"one exchange through minidist.p2p on {p} ranks (best of {args.repeats} sweeps, each the slowest rank's "
          f"median of {args.iters}):")
    rows = [{"nbytes": n, "measured": t, "model": model.alpha + n * model.beta,
             "ratio": f"{t / (model.alpha + n * model.beta):.2f}"}
            for n, t in exchange]
    print(costmodel.format_table(rows))
    print("\nlocal float32 add (numpy.add(a, b, out=c)):")
    print(costmodel.format_table([{"nbytes": n, "measured": t, "model": n * model.gamma} for n, t in reduction]))
    print(f"\nalpha = {model.alpha:.3e} s   beta = {model.beta:.3e} s/B ({1 / model.beta / 1e9:.2f} GB/s)"
          f"   gamma = {model.gamma:.3e} s/B ({1 / model.gamma / 1e9:.2f} GB/s)" if model.beta and model.gamma else
          f"\nalpha = {model.alpha:.3e}  beta = {model.beta:.3e}  gamma = {model.gamma:.3e}")
    library = " ".join(MPI.Get_library_version().splitlines()[0].split())
    print(f"FITTED[{p}] = CostModel(alpha={model.alpha:.2e}, beta={model.beta:.2e}, gamma={model.gamma:.2e})"
          f"  # {datetime.date.today()}, {library}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": str(datetime.date.today()), "mpi": library, "world_size": p,
                       "alpha": model.alpha, "beta": model.beta, "gamma": model.gamma,
                       "exchange": exchange, "reduction": reduction}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
