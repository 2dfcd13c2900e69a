"""Data-parallel test cases, shared by the sim tests and the mpiexec worker.

Each ``case_*`` function takes a communicator (a ``minidist.sim`` comm or
``mpi4py.MPI.COMM_WORLD``), runs on every rank, and returns a small dict of what it found
(or raises AssertionError). The oracle is a single-process run on the global batch.

Run under MPI (one launch does every case and reports failures as one JSON line on rank 0):

    mpiexec -n P python -m mpi4py tests/mpi/ddp_cases.py
"""
from __future__ import annotations

import json
import sys
import traceback

import numpy as np

from minidist import nn, optim
from minidist.functions import cross_entropy
from minidist.parallel.data_parallel import DistributedDataParallel
from minidist.parallel.data_parallel.inference import evaluate
from minidist.tensor import Tensor

SIZES = [12, 16, 10, 4]  # a small float64 MLP: 4 parameter tensors, 382 scalars
INIT_SEED = 3
LR, MOMENTUM, WEIGHT_DECAY = 0.1, 0.9, 1e-3
TOLERANCE = 1e-10
SMALL_BUCKET_MB = 700 / 2**20  # 700 bytes: several buckets for this model


def make_data(world_size, batch, steps, seed=0):
    """Fixed data for ``steps`` global batches of world_size * batch samples."""
    rng = np.random.default_rng(seed)
    n = steps * world_size * batch
    return rng.standard_normal((n, SIZES[0])), rng.integers(0, SIZES[-1], n)


def make_model(seed=INIT_SEED):
    return nn.mlp(SIZES, rng=seed, dtype="float64")


def make_optimizer(params):
    return optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)


def loss_of(model, x, y, scale=1.0):
    loss = cross_entropy(model(Tensor(x)), y)
    return loss * scale if scale != 1.0 else loss


def reference_parameters(world_size, batch, steps):
    """The oracle: one process, global batch world_size * batch, same init and data."""
    X, y = make_data(world_size, batch, steps)
    model = make_model()
    opt = make_optimizer(model.parameters())
    g = world_size * batch
    for t in range(steps):
        opt.zero_grad()
        loss_of(model, X[t * g:(t + 1) * g], y[t * g:(t + 1) * g]).backward()
        opt.step()
    return [p.data.copy() for p in model.parameters()]


def ddp_parameters(comm, batch, steps, bucket_cap_mb=25, algorithm="auto", micro_batches=1, overlap=True):
    """Train with DistributedDataParallel: rank r reads its slice of each global batch.
    Every rank starts from a *different* init (seed INIT_SEED + 1000 r; rank 0's equals the
    oracle's), so only the broadcast can make them agree. With micro_batches=2 the rank's
    slice is split in two halves, the first backward inside no_sync, each loss halved."""
    rank, p = comm.Get_rank(), comm.Get_size()
    X, y = make_data(p, batch, steps)
    model = make_model(INIT_SEED + 1000 * rank)
    before = [q.data.copy() for q in model.parameters()]
    ddp = DistributedDataParallel(model, comm, bucket_cap_mb=bucket_cap_mb, algorithm=algorithm, overlap=overlap)
    initial = [q.data.copy() for q in model.parameters()]
    opt = make_optimizer(ddp.parameters())
    for t in range(steps):
        start = t * p * batch + rank * batch
        xs, ys = X[start:start + batch], y[start:start + batch]
        opt.zero_grad()
        if micro_batches == 1:
            loss_of(ddp, xs, ys).backward()
        else:
            half = batch // 2
            with ddp.no_sync():
                loss_of(ddp, xs[:half], ys[:half], 0.5).backward()
            loss_of(ddp, xs[half:], ys[half:], 0.5).backward()
        opt.step()
    ddp.verify_synced()
    return {"before": before, "initial": initial, "final": [q.data.copy() for q in model.parameters()],
            "stats": ddp.stats, "buckets": [b.numel for b in ddp.buckets], "itemsize": 8}


def max_difference(a, b):
    return max(float(np.max(np.abs(x - y))) if x.size else 0.0 for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------
# The cases
# ---------------------------------------------------------------------------------------

def case_equivalence(comm, batch=6, steps=4):
    """P ranks with batch b == one process with batch P*b, bucketed, unbucketed, default."""
    p = comm.Get_size()
    reference = reference_parameters(p, batch, steps)
    found = {}
    for label, cap in (("default", 25), ("small_buckets", SMALL_BUCKET_MB), ("unbucketed", None)):
        run = ddp_parameters(comm, batch, steps, bucket_cap_mb=cap)
        error = max_difference(run["final"], reference)
        assert error <= TOLERANCE, f"{label}: parameters differ from the single-process run by {error:g}"
        found[label] = {"error": error, "buckets": len(run["buckets"]), "final": run["final"]}
    assert found["default"]["buckets"] == 1 and found["unbucketed"]["buckets"] == len(SIZES) * 2 - 2
    assert found["small_buckets"]["buckets"] >= 3, found["small_buckets"]["buckets"]
    between = max_difference(found["small_buckets"]["final"], found["unbucketed"]["final"])
    assert between <= TOLERANCE, f"bucketed and unbucketed differ by {between:g}"
    return {label: {k: v for k, v in f.items() if k != "final"} for label, f in found.items()} | {
        "bucketed_vs_unbucketed": between}


def case_no_sync(comm, batch=6, steps=3):
    """Two micro-batches (first under no_sync) == one step on the concatenated batch."""
    reference = reference_parameters(comm.Get_size(), batch, steps)
    run = ddp_parameters(comm, batch, steps, bucket_cap_mb=SMALL_BUCKET_MB, micro_batches=2)
    error = max_difference(run["final"], reference)
    assert error <= TOLERANCE, f"no_sync accumulation differs from the single-process run by {error:g}"
    assert run["stats"].synced_steps == steps, run["stats"]
    calls = steps * len(run["buckets"]) if comm.Get_size() > 1 else 0  # one rank: nothing to exchange
    assert run["stats"].all_reduce_calls == calls, run["stats"]
    return {"error": error}


def case_broadcast(comm):
    """Construction overwrites every rank's own init with rank 0's, bit for bit."""
    run = ddp_parameters(comm, batch=2, steps=0)
    reference = [q.data for q in make_model().parameters()]
    assert max_difference(run["initial"], reference) == 0.0, "parameters after construction are not rank 0's"
    if comm.Get_rank() != 0:
        assert max_difference(run["before"], reference) > 0.1, "the ranks' own inits should differ before"
    return {"broadcast_bytes": run["stats"].broadcast_bytes}


def case_ring_bytes(comm, batch=4, steps=2):
    """Bytes each rank sends per step with the ring: 2(P-1)/P * N * itemsize, per bucket
    within chunk rounding (each of the 2(P-1) chunks is n/P rounded up or down)."""
    p = comm.Get_size()
    run = ddp_parameters(comm, batch, steps, bucket_cap_mb=SMALL_BUCKET_MB, algorithm="ring")
    per_step = run["stats"].bytes_sent / steps
    n, itemsize, buckets = sum(run["buckets"]), run["itemsize"], len(run["buckets"])
    formula = 2 * (p - 1) / p * n * itemsize
    assert abs(per_step - formula) <= 2 * itemsize * buckets, (per_step, formula)
    assert run["stats"].messages_sent == steps * buckets * 2 * (p - 1), run["stats"]
    return {"bytes_per_step": per_step, "formula": formula, "buckets": buckets}


def case_evaluate(comm, n=103):
    """Data-parallel accuracy equals the single-process accuracy exactly (uneven shards)."""
    from minidist.train import accuracy

    rng = np.random.default_rng(5)
    X, y = rng.standard_normal((n, SIZES[0])), rng.integers(0, SIZES[-1], n)
    model = make_model()
    result, single = evaluate(model, X, y, comm, batch_size=16), accuracy(model, X, y)
    assert result == single, (result, single)
    return {"accuracy": result}


def case_structure_mismatch(comm):
    """Ranks that build different models: a ValueError on every rank at construction."""
    if comm.Get_size() == 1:
        return {"skipped": "needs 2 ranks"}
    sizes = SIZES if comm.Get_rank() == 0 else [SIZES[0], SIZES[1] + 1, *SIZES[2:]]
    try:
        DistributedDataParallel(nn.mlp(sizes, rng=0, dtype="float64"), comm)
    except ValueError as error:
        assert "differs across ranks" in str(error), str(error)
        return {"message": str(error)}
    raise AssertionError("no error for models that differ across ranks")


class TwoHeads(nn.Module):
    """An MLP with a second head that forward never uses (an unused parameter)."""

    def __init__(self):
        super().__init__()
        self.body = make_model()
        self.unused = nn.Linear(SIZES[-1], 2, rng=0, dtype="float64")

    def forward(self, x):
        return self.body(x)


def case_unused_parameter(comm):
    """A parameter no rank uses: the next forward raises RuntimeError naming it, everywhere."""
    ddp = DistributedDataParallel(TwoHeads(), comm, bucket_cap_mb=None)
    X, y = make_data(1, 4, 1)
    loss_of(ddp, X, y).backward()
    try:
        ddp(Tensor(X))
    except RuntimeError as error:
        assert "unused.weight" in str(error) and "unused.bias" in str(error), str(error)
        return {"message": str(error)}
    raise AssertionError("no error for a parameter that received no gradient")


def case_overlap_equivalence(comm, batch=6, steps=3):
    """With and without overlap, every algorithm: the single-process parameters (float64,
    <= TOLERANCE), and overlap or not changes no bit."""
    reference = reference_parameters(comm.Get_size(), batch, steps)
    found = {}
    for algorithm in ("ring", "recursive_doubling", "tree", "naive"):
        runs = [ddp_parameters(comm, batch, steps, bucket_cap_mb=SMALL_BUCKET_MB, algorithm=algorithm, overlap=o)
                for o in (True, False)]
        for run, overlap in zip(runs, (True, False)):
            error = max_difference(run["final"], reference)
            assert error <= TOLERANCE, f"{algorithm}, overlap={overlap}: differs from one process by {error:g}"
        assert max_difference(runs[0]["final"], runs[1]["final"]) == 0.0, f"{algorithm}: overlap changed bits"
        found[algorithm] = len(runs[0]["buckets"])
    return found


class RecordingComm:
    """A communicator wrapper that logs, for each Isend, which bucket buffer it reads
    (the ring's first step sends straight from the bucket's flat buffer)."""

    def __init__(self, comm, events):
        self.comm, self.events, self.buffers = comm, events, []

    def __getattr__(self, name):
        return getattr(self.comm, name)

    def Isend(self, buf, dest, tag=0):
        for k, flat in enumerate(self.buffers):
            if flat is not None and np.shares_memory(buf, flat):
                self.events.append(("send", k))
        return self.comm.Isend(buf, dest=dest, tag=tag)


class RegisteredBackwards(nn.Module):
    """Registration order (late, early) opposite to use order (early, then late): bucket 0
    (last registered: early) gets its gradients last, so bucket 1 is ready first."""

    def __init__(self):
        super().__init__()
        self.late = nn.Linear(SIZES[1], SIZES[-1], rng=1, dtype="float64")
        self.early = nn.Linear(SIZES[0], SIZES[1], rng=2, dtype="float64")

    def forward(self, x):
        return self.late(self.early(x).relu())


def _recorded_step(comm, model, bucket_cap_mb):
    events = []
    recorder = RecordingComm(comm, events)
    ddp = DistributedDataParallel(model, recorder, bucket_cap_mb=bucket_cap_mb, algorithm="ring")
    X, y = make_data(comm.Get_size(), 4, 1)
    x = Tensor(X[:4], requires_grad=True)  # its gradient is the last thing the first layer's backward makes
    x.register_post_accumulate_grad_hook(lambda _: events.append(("first layer backward ends",)))
    for b in ddp.buckets:  # DDP allocates a bucket's buffer at its first use; hand it one to watch
        b.buffer = np.empty(b.numel, b.dtype)
    recorder.buffers = [b.buffer for b in ddp.buckets]
    cross_entropy(ddp(x), y[:4]).backward()
    events.append(("backward returned",))
    return events, len(ddp.buckets)


def case_start_order(comm):
    """Bucket all-reduces start in bucket order on every rank, even when a later bucket's
    gradients are ready first, and (overlap) bucket 0 starts before the first layer's
    backward ends."""
    if comm.Get_size() == 1:
        return {"skipped": "needs 2 ranks"}
    events, buckets = _recorded_step(comm, RegisteredBackwards(), None)
    starts = [e[1] for e in events if e[0] == "send"]
    firsts = [k for i, k in enumerate(starts) if k not in starts[:i]]
    assert firsts == list(range(buckets)), f"buckets started in order {firsts}, not 0..{buckets - 1}"
    events, buckets = _recorded_step(comm, make_model(), SMALL_BUCKET_MB)
    end = events.index(("first layer backward ends",))
    assert buckets >= 3 and ("send", 0) in events[:end], f"bucket 0 not started before the first layer ended: {events}"
    return {"buckets": buckets, "events": [e[0] + (f" {e[1]}" if len(e) > 1 else "") for e in events]}


CASES = [case_equivalence, case_no_sync, case_broadcast, case_ring_bytes, case_evaluate,
         case_structure_mismatch, case_unused_parameter, case_overlap_equivalence, case_start_order]


def main():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    failures, results = [], {}
    for case in CASES:
        try:
            results[case.__name__] = case(comm)
        except Exception:
            failures.append(f"rank {comm.Get_rank()} {case.__name__}: {traceback.format_exc()}")
    everyone = comm.gather(failures, root=0)
    if comm.Get_rank() == 0:
        report = {"world_size": comm.Get_size(), "failures": [f for fs in everyone for f in fs],
                  "results": {name: {k: v for k, v in r.items() if isinstance(v, (int, float, str))}
                              for name, r in results.items()}}
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
