"""What do DDP's communication hooks save, and what do they cost in accuracy?

For each hook of ``minidist.parallel.data_parallel.comm_hooks`` (none = the fp32 all-reduce, fp16, bf16,
int8 and top-k, the last two with error feedback) this trains the default MLP on digits with
``train --strategy ddp`` (``parallel.data_parallel.train.train_ddp``: 20 epochs, per-rank batch 32) on P ranks
and prints, per hook:

- the bytes rank 0 sent per step (measured at DDP's counting communicator, every message of
  every bucket) and their ratio to ``none`` measured in the same run;
- the final test accuracy, next to ``none``'s.

The runs are on ``minidist.sim`` (P in-process ranks, the default: deterministic, seconds) or,
with ``--mpi``, under ``mpiexec -n P`` (the same figures from the command line's output). The
bytes do not depend on the machine; no times are printed (the sim's links are free).

What to expect: fp16 and bf16 send exactly half (the same all-reduce algorithm on half the
bytes); int8 all-gathers one byte per element plus a 4-byte scale, (P-1)(n+4) bytes against
the fp32 all-reduce's 2(P-1)/P 4n for the ring (or 2 * 4n for recursive doubling, which "auto"
picks for this 38 kB bucket on 4 ranks); top-k sends (P-1) k 8 bytes, k = ratio * n.

    .venv/bin/python benchmarks/bench_comm_hooks.py [--ranks 4] [--epochs 20] [--topk-ratio 0.01] [--mpi] [--json PATH]
    .venv/bin/python benchmarks/bench_comm_hooks.py --quick      # 2 ranks, 2 epochs: a smoke run
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from minidist import data, sim, train  # noqa: E402
from minidist.parallel.data_parallel.comm_hooks import COMM_HOOKS, DEFAULT_TOPK_RATIO  # noqa: E402
from minidist.parallel.data_parallel.train import train_ddp  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4, help="data-parallel ranks P (default: 4)")
    p.add_argument("--epochs", type=int, default=20, help="epochs per run (default: 20)")
    p.add_argument("--topk-ratio", type=float, default=DEFAULT_TOPK_RATIO, help="top-k's fraction (default: 0.01)")
    p.add_argument("--hooks", nargs="+", choices=COMM_HOOKS, default=list(COMM_HOOKS), help="hooks to run")
    p.add_argument("--mpi", action="store_true", help="run each under mpiexec -n P instead of minidist.sim")
    p.add_argument("--quick", action="store_true", help="2 ranks, 2 epochs (a smoke run)")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    if args.quick:
        args.ranks, args.epochs = 2, 2
    if args.ranks < 2 or args.epochs < 1 or not 0 < args.topk_ratio <= 1:
        p.error("--ranks must be >= 2 (a hook sends nothing on one rank), --epochs >= 1, --topk-ratio in (0, 1]")
    return args


def run_sim(hook, args, digits):
    """(test accuracy, bytes rank 0 sent, synced steps) of one train_ddp run on the sim."""
    config = train.TrainConfig(strategy="ddp", epochs=args.epochs, comm_hook=hook, topk_ratio=args.topk_ratio,
                               progress=False)
    with contextlib.redirect_stdout(io.StringIO()):  # train_ddp's per-epoch lines
        result = sim.run(lambda comm: train_ddp(comm, config, digits), args.ranks)[0]
    figures = result.figures
    return result.test_accuracy, figures["bytes_communicated"], figures["all_reduce_calls"] // figures["buckets"]


def run_mpi(hook, args):
    """The same under ``mpiexec -n P``, read from the command line's figures."""
    from minidist import launch

    command = [launch.find_mpiexec(), "-n", str(args.ranks), sys.executable, "-m", "mpi4py", "-m", "minidist",
               "train", "--strategy", "ddp", "--epochs", str(args.epochs), "--comm-hook", hook, "--no-progress"]
    if hook == "topk":
        command += ["--topk-ratio", str(args.topk_ratio)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
    lines = done.stdout.strip().splitlines()
    figures = dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("epoch"))
    steps = int(figures["all_reduce_calls"]) // int(figures["buckets"])
    return float(figures["final test_accuracy"]), int(figures["bytes_communicated"]), steps


def main(argv=None):
    args = parse_args(argv)
    digits = None if args.mpi else data.load_digits(seed=0)
    hooks = list(dict.fromkeys(["none", *args.hooks]))  # the reference first
    rows = []
    for hook in hooks:
        accuracy, nbytes, steps = run_mpi(hook, args) if args.mpi else run_sim(hook, args, digits)
        rows.append({"hook": hook, "test_accuracy": accuracy, "bytes_sent": nbytes, "steps": steps,
                     "bytes_per_step": nbytes / steps})
    reference = rows[0]
    where = f"mpiexec -n {args.ranks}" if args.mpi else f"minidist.sim, {args.ranks} ranks"
    print(f"digits, default MLP, {args.epochs} epochs, {where}; top-k ratio {args.topk_ratio:g}")
    print(f"{'hook':<6} {'bytes/step':>11} {'vs none':>8} {'test acc':>9} {'vs none':>8}")
    for row in rows:
        row["bytes_ratio"] = row["bytes_per_step"] / reference["bytes_per_step"]
        row["accuracy_change"] = row["test_accuracy"] - reference["test_accuracy"]
        print(f"{row['hook']:<6} {row['bytes_per_step']:>11.0f} {row['bytes_ratio']:>8.3f} "
              f"{row['test_accuracy']:>9.4f} {row['accuracy_change']:>+8.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"ranks": args.ranks, "epochs": args.epochs, "mpi": args.mpi,
                                               "topk_ratio": args.topk_ratio, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
