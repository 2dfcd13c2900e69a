"""The test cases for minidist.collectives, shared by the sim tests and the mpiexec worker.

Plain numpy, no MPI: inputs every rank can regenerate from a seed, the numpy oracle, a
replay of each all-reduce algorithm's own order of operations (so float results can be
compared bit for bit), and the tolerance for comparing against a different order.

Tolerance (stated): two reductions of the same p values in different orders differ by at
most  p * eps * scale  elementwise, with eps the dtype's machine epsilon and scale = sum of
|x_i| for "sum", the product of |x_i| for "prod" (each order is within (p-1) eps/2 * scale
of the exact value, to first order). "max" and "min" pick an input, so they are exact.
"""
from __future__ import annotations

import zlib

import numpy as np

from minidist.p2p import CollectiveError

OPS = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}
DTYPES = ("int32", "int64", "float32", "float64")
ALL_REDUCE_ALGORITHMS = ("naive", "ring", "tree", "recursive_doubling", "auto")


def sizes(p):
    """The element counts every collective is tested on."""
    return sorted({0, 1, max(p - 1, 0), p + 1, 1001, 100003})


def inputs(p, n, dtype, op, seed=0):
    """Every rank's input (a list of p 1-D arrays), the same on every process.
    Values keep each op away from overflow: sums of small ints, products near 1."""
    key = zlib.crc32(f"{p}/{n}/{dtype}/{op}/{seed}".encode())
    rng = np.random.default_rng(key)
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        bound = {"sum": 1000, "prod": 3}.get(op, 2**30)
        return [rng.integers(-bound, bound, n, endpoint=True).astype(dtype) for _ in range(p)]
    if op == "prod":
        return [(rng.uniform(0.5, 1.5, n) * rng.choice([-1.0, 1.0], n)).astype(dtype) for _ in range(p)]
    return [rng.standard_normal(n).astype(dtype) for _ in range(p)]


def oracle(xs, op):
    """numpy's reduction of the stacked inputs."""
    stack = np.stack(xs)
    return {"sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min}[op](stack, axis=0).astype(xs[0].dtype)


def within_tolerance(result, xs, op):
    """True if ``result`` is a valid reduction of xs in some order (see module docstring);
    integers and max/min must match numpy exactly."""
    reference = oracle(xs, op)
    if result.shape != reference.shape or result.dtype != reference.dtype:
        return False
    if result.dtype.kind in "iu" or op in ("max", "min"):
        return result.tobytes() == reference.tobytes()
    stack = np.abs(np.stack(xs).astype(np.float64))
    scale = stack.sum(axis=0) if op == "sum" else stack.prod(axis=0)
    eps = np.finfo(result.dtype).eps
    return bool(np.all(np.abs(result.astype(np.float64) - reference) <= len(xs) * eps * scale))


def chunk_bounds(n, p):
    edges = np.cumsum([0] + [len(c) for c in np.array_split(np.arange(n), p)])
    return [(int(edges[i]), int(edges[i + 1])) for i in range(p)]


# -- replays: each algorithm's own order of operations, in plain numpy ------------------

def replay_ring(xs, op):
    """Ring reduce-scatter order: chunk c is ((x[c+1] op x[c+2]) op ...) op x[c]."""
    p, f = len(xs), OPS[op]
    out = np.empty_like(xs[0])
    for c, (a, b) in enumerate(chunk_bounds(xs[0].size, p)):
        acc = xs[(c + 1) % p][a:b].copy()
        for k in range(2, p + 1):
            acc = f(acc, xs[(c + k) % p][a:b])
        out[a:b] = acc
    return out


def replay_tree(xs, op, root=0):
    """Binomial reduce to root: at distance 2^k, relative rank v absorbs v + 2^k."""
    p, f = len(xs), OPS[op]
    partial = [xs[(v + root) % p].copy() for v in range(p)]
    mask = 1
    while mask < p:
        for v in range(0, p, 2 * mask):
            if v + mask < p:
                partial[v] = f(partial[v], partial[v + mask])
        mask <<= 1
    return partial[0]


def replay_recursive_doubling(xs, op):
    """Fold the extra ranks in pairs, then pairwise exchanges, lower rank's operand first."""
    p, f = len(xs), OPS[op]
    q = 1 << (p.bit_length() - 1)
    rem = p - q
    values = [f(xs[2 * i], xs[2 * i + 1]) for i in range(rem)] + [x.copy() for x in xs[2 * rem:]]
    mask = 1
    while mask < q:
        values = [f(values[min(v, v ^ mask)], values[max(v, v ^ mask)]) for v in range(q)]
        mask <<= 1
    return values[0]


def replay_naive(xs, op):
    acc = xs[0].copy()
    for x in xs[1:]:
        acc = OPS[op](acc, x)
    return acc


def replay_all_reduce(xs, op, algorithm):
    if algorithm == "auto":
        from minidist.costmodel import choose_all_reduce

        algorithm = choose_all_reduce(xs[0].nbytes, len(xs))
    return {"ring": replay_ring, "tree": replay_tree, "naive": replay_naive,
            "recursive_doubling": replay_recursive_doubling}[algorithm](xs, op)


# -- the case list -----------------------------------------------------------------------

def cases(p):
    """Every case for p ranks, as dicts: collective, n, dtype, and op/root/algorithm.

    Not the full cross product (that is ~1300 cases at p=5, too slow for oversubscribed
    mpiexec) but a covering design: every collective on every size x dtype; the op (and
    the root) rotate so that every (algorithm, size, op), (algorithm, dtype, op), (root,
    op), (size, root) and (dtype, root) combination occurs (the last ones once 24 >= p)."""
    ops, out = list(OPS), []
    for i, n in enumerate(sizes(p)):
        for j, dtype in enumerate(DTYPES):
            base = {"n": n, "dtype": dtype}
            root = (i + j) % p
            out.append(dict(base, collective="all_gather"))
            out.append(dict(base, collective="reduce_scatter", op=ops[(i + j) % 4]))
            for k, algorithm in enumerate(ALL_REDUCE_ALGORITHMS):
                out.append(dict(base, collective="all_reduce", op=ops[(i + j + k) % 4], algorithm=algorithm))
            out.append(dict(base, collective="broadcast", root=root, algorithm="tree"))
            out.append(dict(base, collective="broadcast", root=(root + 1) % p, algorithm="linear"))
            out.append(dict(base, collective="scatter", root=root))
            out.append(dict(base, collective="gather", root=(root + 1) % p))
            for r in range(p):  # reduce: every root with every op
                out.append(dict(base, collective="reduce", root=r, op=ops[(i + j + r) % 4]))
    return out


def case_name(case):
    extras = ",".join(f"{k}={case[k]}" for k in ("algorithm", "op", "root") if k in case)
    return f"{case['collective']}[n={case['n']},{case['dtype']}{',' + extras if extras else ''}]"


def case_inputs(case, p):
    """(xs, what rank r passes) for a case: scatter's root passes the stacked blocks."""
    xs = inputs(p, case["n"], case["dtype"], case.get("op", "sum"))
    if case["collective"] == "scatter":
        stacked = np.stack(xs)
        return xs, lambda r: stacked if r == case["root"] else np.zeros_like(xs[r])
    return xs, lambda r: xs[r]


def call(collectives, comm, case, x):
    """Run the case's collective from ``minidist.collectives`` on comm."""
    name, kw = case["collective"], {k: case[k] for k in ("op", "root", "algorithm") if k in case}
    return getattr(collectives, name)(comm, x, **kw)


def expected(case, xs):
    """What each rank must return for this case, exactly: a list of p arrays (None off
    root), and the problems found when holding those expectations against numpy (for
    reductions the replayed order must lie within the stated tolerance of numpy's; a result
    equal bit for bit to the replay then does too)."""
    name, p = case["collective"], len(xs)
    root, op = case.get("root", 0), case.get("op")
    problems = []

    def reduction(value, inputs, what):
        if not within_tolerance(value, inputs, op):
            problems.append(f"{what} is outside the tolerance of numpy")
        return value

    if name == "broadcast":
        want = [xs[root]] * p
    elif name == "scatter":
        want = list(xs)
    elif name in ("gather", "all_gather"):
        stacked = np.stack(xs)
        want = [stacked if name == "all_gather" or r == root else None for r in range(p)]
    elif name == "reduce":
        value = reduction(replay_tree(xs, op, root), xs, "binomial replay")
        want = [value if r == root else None for r in range(p)]
    elif name == "reduce_scatter":
        full = replay_ring(xs, op)
        want = [reduction(full[a:b], [x[a:b] for x in xs], "ring replay")
                for a, b in chunk_bounds(xs[0].size, p)]
    else:
        want = [reduction(replay_all_reduce(xs, op, case["algorithm"]), xs, "replay")] * p
    return want, problems


def differs(result, want):
    """A description of how ``result`` differs from ``want`` (bytes, shape, dtype), or ''."""
    if want is None or result is None:
        return "" if result is want else f"expected {want!r:.40}, got {result!r:.40}"
    if not hasattr(result, "dtype") or result.shape != want.shape or result.dtype != want.dtype:
        got = f"{getattr(result, 'shape', type(result))} {getattr(result, 'dtype', '')}"
        return f"expected {want.shape} {want.dtype}, got {got}"
    if result.tobytes() != want.tobytes():
        bad = np.flatnonzero(result.reshape(-1) != want.reshape(-1))
        return f"bytes differ ({bad.size} elements differ in value, first {bad[:3].tolist()})"
    return ""


def prepare(case, p):
    """Everything a rank needs for one case: (inputs, what each rank passes, expected
    results, problems with the expectations)."""
    xs, arg = case_inputs(case, p)
    want, problems = expected(case, xs)
    return xs, arg, want, problems


def run_cases(comm, collectives, case_list, prepared, native=None, barrier=False):
    """Run every case on ``comm``; return (this rank's problems, digests of its results).

    prepared(i, case) -> prepare(case, p) (the sim tests share one copy between threads,
    and need ``barrier=True`` so no rank runs ahead of that copy); native(comm, case, xs,
    result) -> problems comparing with MPI's own call, if given. The digests (crc32 of the
    result bytes of broadcast, all_gather and all_reduce) must be the same on every rank."""
    rank, problems, digests = comm.Get_rank(), [], []
    for i, case in enumerate(case_list):
        xs, arg, want, expectation_problems = prepared(i, case)
        x = arg(rank)
        before = x.copy()
        result = call(collectives, comm, case, x)
        name = case_name(case)
        if rank == 0:
            problems += [f"{name}: {m}" for m in expectation_problems]
        how = differs(result, want[rank])
        if how:
            problems.append(f"{name}: rank {rank}: {how}")
        if x.tobytes() != before.tobytes():
            problems.append(f"{name}: rank {rank}: the input was modified")
        if native is not None:
            problems += [f"{name}: rank {rank}: {m}" for m in native(comm, case, xs, result)]
        if case["collective"] in ("broadcast", "all_gather", "all_reduce"):
            digests.append((name, zlib.crc32(result.tobytes()) if result is not None else None))
        if barrier:
            comm.Barrier()
    return problems, digests


def digest_problems(digests_per_rank):
    """Problems where ranks ended with different bytes (input: each rank's digests)."""
    first, problems = digests_per_rank[0], []
    for rank, digests in enumerate(digests_per_rank[1:], start=1):
        for (name, mine), (_, theirs) in zip(digests, first):
            if mine != theirs:
                problems.append(f"{name}: rank {rank} ended with different bytes from rank 0")
    return problems


# -- inputs the collectives must refuse, with the same CollectiveError on sim and MPI ----

def refused_calls(collectives, comm, tensor_type):
    """{name: call} of collectives given input they must refuse on every rank. Each bad
    argument is on one rank only (the others' are fine), so the error must travel."""
    rank, p = comm.Get_rank(), comm.Get_size()
    last = p - 1
    good = np.arange(3.0)

    def read_only_out():
        out = np.empty(3)
        out.flags.writeable = rank != 1 % p
        return collectives.all_reduce(comm, good, out=out)

    objects = np.array([1, "a", None], dtype=object)
    return {
        "object dtype": lambda: collectives.all_reduce(comm, objects if rank == last else good),
        "non-native byte order": lambda: collectives.broadcast(comm, good.astype(">f8") if rank == 0 else good),
        "Tensor": lambda: collectives.all_gather(comm, tensor_type(good) if rank == last else good),
        "Tensor everywhere": lambda: collectives.reduce(comm, tensor_type(good)),
        "string dtype": lambda: collectives.reduce_scatter(comm, np.array(["a", "b", "c"]) if rank == 0 else good),
        "read-only out": read_only_out,
        "root=True": lambda: collectives.broadcast(comm, good, root=True),
        "root=False on one rank": lambda: collectives.gather(comm, good, root=False if rank == last else 0),
    }


def mismatched_calls(collectives, comm):
    """{name: call} of all-reduces whose ranks disagree (the last rank differs), each a
    CollectiveError on every rank when p > 1. Under MPI the agreement is a binary header, and
    at P = 2 a small vector rides with it (minidist.agreement_header): these are the cases
    where a rank's message is not the one the others expect, same bytes with another meaning
    included, which must neither hang nor give a silent wrong answer."""
    last = comm.Get_rank() == comm.Get_size() - 1
    small, large = np.arange(3.0), np.ones(1 << 17)  # 24 B rides with its header at P = 2; 1 MiB takes the ring

    def broadcast_or_all_reduce():
        return collectives.broadcast(comm, small) if last else collectives.all_reduce(comm, small)

    return {
        "shape": lambda: collectives.all_reduce(comm, np.arange(4.0) if last else small),
        "dtype, same bytes": lambda: collectives.all_reduce(comm, np.zeros(4, np.int32 if last else np.float32)),
        "op": lambda: collectives.all_reduce(comm, small, op="max" if last else "sum"),
        "algorithm": lambda: collectives.all_reduce(comm, small, algorithm="tree" if last else "recursive_doubling"),
        "small against large": lambda: collectives.all_reduce(comm, large if last else small),
        "large against small": lambda: collectives.all_reduce(comm, small if last else large),
        "another collective": broadcast_or_all_reduce,
    }


def refusals(collectives, comm, tensor_type, calls=None):
    """{name: this rank's CollectiveError message, or what went wrong instead} for each of
    ``calls`` (default: refused_calls; mismatched_calls gives the others)."""
    messages = {}
    for name, call in (calls or refused_calls(collectives, comm, tensor_type)).items():
        try:
            call()
            messages[name] = "no error"
        except CollectiveError as exc:
            messages[name] = str(exc)
        except Exception as exc:
            messages[name] = f"{type(exc).__name__} instead of CollectiveError: {exc}"
    return messages
