"""What a collective costs: the alpha-beta-gamma model, busbw, and what-if tables.

A message of n bytes between two ranks takes ``alpha + n * beta`` seconds: alpha is the
latency (start-up cost) of one message, beta the time per byte (1 / bandwidth). Reducing
n bytes locally (adding a received chunk into our own) takes ``n * gamma``. Every
algorithm below is a count of three things along its critical path -- messages, bytes
sent, bytes reduced -- so its time is

    T = messages * alpha + bytes * beta + reduced * gamma

and :meth:`CostModel.terms` returns exactly those three counts. The formulas follow
R. Thakur, R. Rabenseifner and W. Gropp, "Optimization of Collective Communication
Operations in MPICH", Int. J. High Perform. Comput. Appl. 19(1):49-66, 2005,
with p ranks and n bytes, where n is always the size of the *whole* vector: the input of
broadcast, reduce, reduce_scatter and all_reduce, the concatenated result of scatter,
gather and all_gather (each rank owns n/p). ``lg`` is log2 and ``ceil(lg p)`` is the
number of rounds of a binomial tree, which minidist calls "tree" everywhere ("binomial" is
accepted as another name for it). Chunk rounding (n not divisible by p) is ignored: these
are models, not byte counts.

    broadcast   linear              (p-1) alpha + (p-1) n beta          root sends p-1 copies
                tree                ceil(lg p) (alpha + n beta)         binomial tree
    scatter     linear              (p-1) alpha + (p-1)/p n beta
                tree                ceil(lg p) alpha + (p-1)/p n beta
    gather      linear / tree       as scatter, messages reversed
    all_gather  ring                (p-1) alpha + (p-1)/p n beta
                recursive_doubling  ceil(lg p) alpha + (p-1)/p n beta  (Bruck's cost for any p)
    reduce_scatter ring             (p-1) alpha + (p-1)/p n (beta + gamma)
    all_to_all  pairwise            (p-1) alpha + (p-1)/p n beta        n = one rank's input
    reduce      linear              (p-1) (alpha + n beta + n gamma)     root receives p-1 vectors
                tree                ceil(lg p) (alpha + n beta + n gamma)
    all_reduce  naive               linear reduce + linear broadcast:
                                    2(p-1) alpha + 2(p-1) n beta + (p-1) n gamma
                ring                ring reduce-scatter + ring all-gather:
                                    2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma
                tree                tree reduce + tree broadcast:
                                    2 ceil(lg p) alpha + 2 ceil(lg p) n beta + ceil(lg p) n gamma
                recursive_doubling  p a power of two: lg p (alpha + n beta + n gamma).
                                    Otherwise (the paper's and MPICH's way): with q = 2**floor(lg p),
                                    the p - q extra ranks first hand their vector to a partner
                                    (alpha + n beta + n gamma), q ranks do recursive doubling,
                                    then the result goes back (alpha + n beta):
                                    (floor(lg p) + 2) alpha + (floor(lg p) + 2) n beta
                                    + (floor(lg p) + 1) n gamma.

``p == 1`` costs nothing for every algorithm (there is nobody to talk to).

The ring all-reduce is bandwidth-optimal -- each rank sends 2(p-1)/p n bytes, which no
algorithm can beat -- but pays 2(p-1) latencies; recursive doubling pays only lg p
latencies but ships the whole vector lg p times. Which one wins depends on n, p and the
machine's alpha, beta and gamma: :func:`choose_all_reduce` answers that for
``collectives.all_reduce(..., algorithm="auto")`` and :func:`what_if` tabulates it up to
thousands of ranks.

Bandwidth figures use the nccl-tests definitions (NVIDIA nccl-tests, ``doc/PERFORMANCE.md``):
``algbw = S / t`` with S the size of the whole vector, and ``busbw = algbw * factor`` with
factor 2(p-1)/p for all_reduce, (p-1)/p for all_gather, reduce_scatter, scatter and gather,
and 1 for broadcast and reduce, so that busbw is comparable to the link's peak whatever p.

The constants (:data:`FITTED`, one model per world size; :func:`model_for`) were fitted on
the course's build machine; refit yours with
``mpiexec -n P python -m mpi4py benchmarks/fit_costmodel.py`` for P = 2 and 4.

Longer than 400 lines: one cost model in three parts that share the algorithms' names and their
critical-path counts, each part after a comment that derives its formulas: one tier (the terms,
the choice, busbw, fitting the constants on this machine, what-if tables), then two tiers (the
links inside and between nodes, equal to the simulator's virtual time, and the topology what-if).
Apart, the two-tier counts would repeat the one-tier ones they are built from.
"""
from __future__ import annotations

import functools
import math
import operator
import time
from dataclasses import dataclass

import numpy

from minidist import p2p
from minidist.sim.topology import Topology

# The one list of each collective's algorithms (minidist.collectives implements them and
# imports the names from here; their order is the cost model's tie-break order). "tree" is
# the binomial tree everywhere in minidist; "binomial" is accepted as another name for it
# (ALIASES), but never printed or returned.
ALL_REDUCE_ALGORITHMS = ("ring", "recursive_doubling", "tree", "naive")
BROADCAST_ALGORITHMS = ("tree", "linear")
ALIASES = {"binomial": "tree"}

# The algorithms each collective knows, in the order ties are broken (first wins); scatter,
# gather and reduce also have the binomial tree here, which minidist.collectives does not
# implement.
ALGORITHMS = {
    "broadcast": BROADCAST_ALGORITHMS,
    "scatter": ("tree", "linear"),
    "gather": ("tree", "linear"),
    "all_gather": ("ring", "recursive_doubling"),
    "reduce_scatter": ("ring",),
    "all_to_all": ("pairwise",),
    "reduce": ("tree", "linear"),
    "all_reduce": ALL_REDUCE_ALGORITHMS,
}

# nccl-tests' bus-bandwidth factor, as a function of the number of ranks p.
_BUSBW_FACTOR = {
    "all_reduce": lambda p: 2 * (p - 1) / p,
    "all_gather": lambda p: (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "scatter": lambda p: (p - 1) / p,
    "gather": lambda p: (p - 1) / p,
    "broadcast": lambda p: 1.0,
    "reduce": lambda p: 1.0,
}


def _check_size(nbytes, world_size):
    """Validate (nbytes, world_size) and return them as Python ints."""
    try:
        n, p = operator.index(nbytes), operator.index(world_size)
    except TypeError:
        raise ValueError(f"nbytes and world_size must be integers, got {nbytes!r} and {world_size!r}") from None
    if n < 0:
        raise ValueError(f"nbytes must be >= 0, got {n}")
    if p < 1:
        raise ValueError(f"world_size must be >= 1, got {p}")
    return n, p


def _check_algorithm(collective, algorithm=None):
    """Validate the names; return the algorithm with aliases resolved ("binomial" -> "tree")."""
    if collective not in ALGORITHMS:
        raise ValueError(f"unknown collective {collective!r}; valid: {', '.join(ALGORITHMS)}")
    if algorithm is not None and algorithm not in ALGORITHMS[collective]:
        if ALIASES.get(algorithm) in ALGORITHMS[collective]:
            return ALIASES[algorithm]
        raise ValueError(
            f"unknown algorithm {algorithm!r} for {collective}; valid: {', '.join(ALGORITHMS[collective])}"
        )
    return algorithm


def terms(collective: str, algorithm: str, nbytes: int, world_size: int) -> tuple[float, float, float]:
    """Critical-path counts ``(messages, bytes_sent, bytes_reduced)`` of one algorithm.

    ``nbytes`` is the size of the whole vector in bytes (see the module docstring);
    the time is ``messages * alpha + bytes_sent * beta + bytes_reduced * gamma``.
    Raises ValueError for negative sizes, ``world_size < 1``, or an unknown
    collective/algorithm (the message lists the valid names); "binomial" is accepted for
    "tree" (the binomial tree).
    """
    algorithm = _check_algorithm(collective, algorithm)
    n, p = _check_size(nbytes, world_size)
    if p == 1:
        return (0.0, 0.0, 0.0)
    rounds = math.ceil(math.log2(p))  # binomial tree depth, exact for any p
    share = (p - 1) / p * n  # what a rank lacks (or must hand on) of the whole vector
    if collective == "broadcast":
        steps = p - 1 if algorithm == "linear" else rounds
        return (steps, steps * n, 0.0)
    if collective in ("scatter", "gather", "all_gather"):
        steps = p - 1 if algorithm in ("linear", "ring") else rounds
        return (steps, share, 0.0)
    if collective == "reduce_scatter":
        return (p - 1, share, share)
    if collective == "all_to_all":  # every block but one's own leaves, one peer per step
        return (p - 1, share, 0.0)
    if collective == "reduce":
        steps = p - 1 if algorithm == "linear" else rounds
        return (steps, steps * n, steps * n)
    # all_reduce
    if algorithm == "ring":
        return (2 * (p - 1), 2 * share, share)
    if algorithm == "naive":
        return (2 * (p - 1), 2 * (p - 1) * n, (p - 1) * n)
    if algorithm == "tree":
        return (2 * rounds, 2 * rounds * n, rounds * n)
    # recursive doubling: lg q exchanges among q = 2**floor(lg p) ranks, plus a fold-in
    # and a fold-out step when p is not a power of two.
    exchanges = p.bit_length() - 1
    if p & (p - 1) == 0:
        return (exchanges, exchanges * n, exchanges * n)
    return (exchanges + 2, (exchanges + 2) * n, (exchanges + 1) * n)


@dataclass(frozen=True)
class CostModel:
    """Machine constants of the alpha-beta-gamma model.

    alpha: seconds per message (latency), beta: seconds per byte sent (1/bandwidth),
    gamma: seconds per byte reduced (one operand's bytes through the local reduction).
    Immutable and hashable, so it can key a cache.
    """

    alpha: float
    beta: float
    gamma: float = 0.0

    def __post_init__(self):
        for name in ("alpha", "beta", "gamma"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    def time(self, collective: str, algorithm: str, nbytes: int, world_size: int) -> float:
        """Predicted seconds of ``collective`` with ``algorithm`` on ``nbytes`` over ``world_size`` ranks."""
        m, b, r = terms(collective, algorithm, nbytes, world_size)
        return m * self.alpha + b * self.beta + r * self.gamma

    def times(self, collective: str, nbytes: int, world_size: int) -> dict[str, float]:
        """Predicted seconds of every algorithm of ``collective``: ``{algorithm: seconds}``."""
        _check_algorithm(collective)
        return {a: self.time(collective, a, nbytes, world_size) for a in ALGORITHMS[collective]}

    def best(self, collective: str, nbytes: int, world_size: int) -> str:
        """The fastest algorithm by the model (ties go to the earlier name in ``ALGORITHMS``)."""
        times = self.times(collective, nbytes, world_size)
        return min(times, key=times.get)  # min keeps the first of equal keys


# Fitted on the course's build machine on 2026-11-26 (2 cores shared with five other jobs, load
# average 4 to 8; MPICH 5.0.2 ch4 over shared memory, mpi4py 4.1.2, NumPy 2.4.6) by
# benchmarks/fit_costmodel.py: gamma from a float32 numpy.add, alpha and beta from the times of
# the four all-reduce algorithms at the 13 sizes of bench_collectives.py (costmodel.fit_times),
# here the medians pooled over 9 runs on 2 ranks and 7 on 4 (the benchmark's and the fit's).
# alpha is a step as the algorithms pay it, Python included (a bare mpi4py pingpong: ~2 us);
# with 4 ranks on 2 cores a step also waits for a core. Measured against the picks: on 2 ranks
# the model picks the fastest algorithm at 11 of 13 sizes and is within 4 % at the other two
# (1 and 4 MiB, where the ring and recursive doubling tie); on 4 ranks it picks the ring
# exactly where the ring wins (4 MiB and up, by 1.3-2.4x) and recursive doubling below, where
# tree and naive are sometimes faster by up to 1.6x: which of the three wins there changes
# from run to run with the scheduling of 4 ranks on 2 cores, which no alpha-beta-gamma term
# describes.
FITTED = {
    2: CostModel(alpha=1.48e-05, beta=4.68e-10, gamma=6.16e-11),
    4: CostModel(alpha=1.36e-04, beta=1.95e-10, gamma=5.87e-11),
}
DEFAULT_MODEL = FITTED[2]  # the model of two ranks, where every rank has a core


def model_for(world_size: int) -> CostModel:
    """The fitted model for ``world_size`` ranks: :data:`FITTED`'s entry for the largest world
    size fitted that is at most ``world_size`` (the smallest one fitted below that)."""
    below = [p for p in FITTED if p <= world_size]
    return FITTED[max(below) if below else min(FITTED)]


@functools.lru_cache(maxsize=4096)
def _choose_all_reduce(nbytes: int, world_size: int, model: CostModel) -> str:
    m = model
    best, best_time = None, math.inf
    for algorithm in ALL_REDUCE_ALGORITHMS:
        a, b, r = terms("all_reduce", algorithm, nbytes, world_size)
        t = a * m.alpha + b * m.beta + r * m.gamma
        if t < best_time:
            best, best_time = algorithm, t
    return best


def choose_all_reduce(nbytes: int, world_size: int, model: CostModel | None = None) -> str:
    """The all-reduce algorithm the model predicts fastest: "ring", "recursive_doubling",
    "tree" or "naive".

    nbytes: size of the vector in bytes (>= 0); world_size: number of ranks (>= 1);
    model: a :class:`CostModel`, ``model_for(world_size)`` when None. With one rank every
    algorithm costs nothing and the answer is "ring" (each one just copies). Answers are
    cached per (nbytes, world_size, model), so calling this on every all-reduce costs a
    dictionary lookup. Raises ValueError on a negative size or world_size < 1.

    What the model leaves out: the per-call cost of Python and of argument checking
    (the same for every algorithm, so it cannot change the choice), ranks sharing cores
    (oversubscription multiplies the real alpha), and page faults on fresh buffers.
    """
    n, p = _check_size(nbytes, world_size)
    return _choose_all_reduce(n, p, model_for(p) if model is None else model)


# --- bandwidth figures (nccl-tests) -------------------------------------------------------


def algbw(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in bytes/second: ``nbytes / seconds`` (nbytes = whole vector)."""
    if seconds <= 0 or not math.isfinite(seconds):
        raise ValueError(f"seconds must be a finite number > 0, got {seconds!r}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    return nbytes / seconds


def busbw(collective: str, nbytes: int, seconds: float, world_size: int) -> float:
    """Bus bandwidth in bytes/second, nccl-tests' definition: ``algbw * factor(p)`` with
    2(p-1)/p for all_reduce; (p-1)/p for all_gather, reduce_scatter, scatter, gather
    (nbytes = the whole vector S); 1 for broadcast and reduce.
    Raises ValueError for an unknown collective, seconds <= 0 or world_size < 1."""
    if collective not in _BUSBW_FACTOR:
        raise ValueError(f"unknown collective {collective!r}; valid: {', '.join(_BUSBW_FACTOR)}")
    _, p = _check_size(nbytes, world_size)
    return algbw(nbytes, seconds) * _BUSBW_FACTOR[collective](p)


# --- measuring and fitting alpha, beta, gamma ----------------------------------------------


def measure_pingpong(comm, sizes, iters: int = 20, warmup: int = 3) -> list[tuple[int, float]] | None:
    """One-way message times between ranks 0 and 1 of ``comm`` (anything with mpi4py's
    Send/Recv/Barrier: ``MPI.COMM_WORLD`` or a ``minidist.sim`` communicator).

    Rank 0 sends ``nbytes`` to rank 1, which sends them back; the one-way time is half
    the round trip, the median over ``iters`` round trips after ``warmup`` unmeasured
    ones. Every rank must call it (other ranks only join the barriers).
    Returns ``[(nbytes, seconds), ...]`` on ranks 0 and 1, None elsewhere.
    Raises ValueError with fewer than 2 ranks or a negative size.
    """
    if comm.Get_size() < 2:
        raise ValueError("measure_pingpong needs at least 2 ranks")
    sizes = [int(s) for s in sizes]
    if any(s < 0 for s in sizes):
        raise ValueError(f"sizes must be >= 0, got {sizes}")
    rank = comm.Get_rank()
    results = []
    for nbytes in sizes:
        buf = numpy.zeros(nbytes, dtype=numpy.uint8)
        comm.Barrier()
        samples = []
        for i in range(warmup + iters):
            start = time.perf_counter()
            if rank == 0:
                comm.Send(buf, dest=1, tag=7)
                comm.Recv(buf, source=1, tag=7)
            elif rank == 1:
                comm.Recv(buf, source=0, tag=7)
                comm.Send(buf, dest=0, tag=7)
            if i >= warmup:
                samples.append((time.perf_counter() - start) / 2)
        results.append((nbytes, float(numpy.median(samples))))
    comm.Barrier()
    return results if rank < 2 else None


def measure_exchange(comm, sizes, iters: int = 20, warmup: int = 3) -> list[tuple[int, float]]:
    """Seconds of one step of the collectives' algorithms: an exchange through the engine
    (:func:`minidist.p2p.post_exchange`, then :func:`minidist.p2p.wait_all`), so the fitted
    alpha includes the Python that every step pays, not only MPI's latency.

    The ranks pair up (r with r XOR 1; an odd last rank only joins the barriers) and each pair
    swaps ``nbytes`` both ways at once, as a step of the ring or of recursive doubling does. A
    size's figure is the slowest rank's median over ``iters`` exchanges after ``warmup``
    unmeasured ones, so with more ranks than cores it includes the wait for a core, as the
    collectives see it. Every rank must call it (``MPI.COMM_WORLD`` or a ``minidist.sim``
    communicator). Returns ``[(nbytes, seconds), ...]`` on every rank. Raises ValueError with
    fewer than 2 ranks or a negative size.
    """
    p, rank = comm.Get_size(), comm.Get_rank()
    if p < 2:
        raise ValueError("measure_exchange needs at least 2 ranks")
    sizes = [int(s) for s in sizes]
    if any(s < 0 for s in sizes):
        raise ValueError(f"sizes must be >= 0, got {sizes}")
    partner = rank ^ 1 if rank ^ 1 < p else None
    results = []
    for nbytes in sizes:
        send, recv = numpy.zeros(nbytes, numpy.uint8), numpy.empty(nbytes, numpy.uint8)
        samples = []
        for i in range(warmup + iters):
            comm.Barrier()
            start = time.perf_counter()
            if partner is not None:
                requests, peers, receives = p2p.post_exchange(comm, send, partner, recv, partner, 7)
                p2p.wait_all(comm, requests, peers, "measure_exchange", receives=receives)
            if i >= warmup:
                samples.append(time.perf_counter() - start)
        results.append((nbytes, max(comm.allgather(float(numpy.median(samples))))))
    comm.Barrier()
    return results


def measure_reduction(sizes, iters: int = 20, dtype=numpy.float32, xp=numpy) -> list[tuple[int, float]]:
    """Seconds to reduce ``nbytes`` locally: median time of ``xp.add(a, b, out=c)`` on
    arrays of ``dtype`` with ``nbytes`` bytes each (rounded down to whole elements; the
    returned size is the rounded one). For CuPy the device is synchronised per call."""
    itemsize = numpy.dtype(dtype).itemsize
    results = []
    for nbytes in sizes:
        count = int(nbytes) // itemsize
        a, b, c = (xp.ones(count, dtype=dtype) for _ in range(3))
        samples = []
        for i in range(iters + 1):  # the first call warms caches and pages up
            start = time.perf_counter()
            xp.add(a, b, out=c)
            if xp is not numpy:
                xp.cuda.Device().synchronize()
            if i:
                samples.append(time.perf_counter() - start)
        results.append((count * itemsize, float(numpy.median(samples))))
    return results


def fit_line(points, relative: bool = True) -> tuple[float, float]:
    """Least-squares ``(intercept, slope)`` of ``seconds = intercept + slope * nbytes``.

    points: ``[(nbytes, seconds), ...]`` with at least two distinct sizes.
    relative=True minimises the squared *relative* error (each residual divided by its
    measured time), so 4-byte latencies count as much as 64 MiB transfers; plain least
    squares would let the largest sizes decide the intercept alone.
    Raises ValueError with fewer than two distinct sizes or a time <= 0.
    """
    data = numpy.asarray(list(points), dtype=numpy.float64).reshape(-1, 2)
    if len(numpy.unique(data[:, 0])) < 2:
        raise ValueError("fit_line needs measurements at two or more distinct sizes")
    if (data[:, 1] <= 0).any():
        raise ValueError("measured times must be > 0")
    design = numpy.stack([numpy.ones(len(data)), data[:, 0]], axis=1)
    target = data[:, 1]
    if relative:
        design, target = design / target[:, None], numpy.ones_like(target)
    (intercept, slope), *_ = numpy.linalg.lstsq(design, target, rcond=None)
    return float(intercept), float(slope)


def fit(pingpong, reduction=None, relative: bool = True) -> CostModel:
    """A :class:`CostModel` fitted to measurements.

    pingpong: ``[(nbytes, one_way_seconds), ...]`` (e.g. from :func:`measure_pingpong`);
    its line gives alpha (intercept) and beta (slope). reduction: optional
    ``[(nbytes, seconds), ...]`` (e.g. from :func:`measure_reduction`); its slope is gamma
    (its intercept, the call overhead of one reduction, is left out of the model);
    gamma = 0 when omitted. Negative fitted values, which only noise can produce, are
    clipped to 0. Raises ValueError as :func:`fit_line`.
    """
    alpha, beta = fit_line(pingpong, relative)
    gamma = fit_line(reduction, relative)[1] if reduction is not None else 0.0
    return CostModel(alpha=max(alpha, 0.0), beta=max(beta, 0.0), gamma=max(gamma, 0.0))


def fit_times(samples, world_size: int, collective: str = "all_reduce",
              gamma: float | None = None) -> tuple[CostModel, float]:
    """A :class:`CostModel` fitted to the measured times of a collective's own algorithms, and
    the per-call seconds they share (the Python and the agreement round that every algorithm
    pays once, which the model leaves out: it cannot change the choice).

    samples: ``[(algorithm, nbytes, seconds), ...]`` on ``world_size`` ranks, with at least two
    algorithms at each size and at least two sizes. The model is fitted to what tells the
    algorithms apart: at each size, each algorithm's time minus the mean over the algorithms,
    against its counts (:func:`terms`) minus theirs, ``messages * alpha + bytes * beta +
    reduced * gamma``, in least squares with each size's differences divided by its mean
    time (so 4-byte calls count as much as 64 MiB ones). ``gamma``: when given (seconds per
    byte, e.g. the slope of :func:`measure_reduction`), it is kept and only alpha and beta
    are fitted; a reduction costs at least what the local add costs, which the noise of a
    shared machine can otherwise drive to 0. The per-call time, the same for
    every algorithm, cancels out of the differences (on a machine with fewer cores than ranks
    it is milliseconds of noise that would swamp alpha); it is returned as the median of
    what the model leaves unexplained. Fitting to the algorithms rather than to one message
    folds every cost a step really pays (the Python of posting and waiting, a rendezvous,
    the wait for a core) into alpha, beta and gamma. Negative constants (noise) are clipped
    to 0. Raises ValueError for too few samples, a time <= 0, or an unknown name.
    """
    by_size = {}
    for algorithm, nbytes, seconds in samples:
        if not seconds > 0:
            raise ValueError(f"measured times must be > 0, got {seconds!r} for {algorithm} at {nbytes} B")
        by_size.setdefault(nbytes, []).append((terms(collective, algorithm, nbytes, world_size), float(seconds)))
    if len(by_size) < 2 or any(len(items) < 2 for items in by_size.values()):
        raise ValueError("fit_times needs at least two algorithms at each of at least two sizes")
    fitted = 3 if gamma is None else 2  # the constants fitted: alpha, beta (and gamma)
    rows, targets = [], []
    for items in by_size.values():
        counts, times = numpy.array([c for c, _ in items]), numpy.array([t for _, t in items])
        scale = times.mean()
        if gamma is not None:
            times = times - counts[:, 2] * gamma
        rows.append((counts[:, :fitted] - counts[:, :fitted].mean(axis=0)) / scale)
        targets.append((times - times.mean()) / scale)
    found, *_ = numpy.linalg.lstsq(numpy.vstack(rows), numpy.concatenate(targets), rcond=None)
    alpha, beta, gamma = (*found, gamma) if gamma is not None else found
    model = CostModel(alpha=max(float(alpha), 0.0), beta=max(float(beta), 0.0), gamma=max(float(gamma), 0.0))
    left = [t - model.time(collective, a, n, world_size) for a, n, t in samples]
    return model, max(float(numpy.median(left)), 0.0)


# --- what if we had thousands of ranks? ---------------------------------------------------

WHAT_IF_WORLD_SIZES = tuple(2**k for k in range(1, 13))  # 2 .. 4096
WHAT_IF_SIZES = tuple(4 ** k for k in range(1, 16, 2))  # 4 B .. 1 GiB, x16 apart


def what_if(world_sizes=WHAT_IF_WORLD_SIZES, sizes=WHAT_IF_SIZES, model: CostModel | None = None,
            collective: str = "all_reduce") -> list[dict]:
    """Predicted seconds of every algorithm of ``collective`` for each (world_size, nbytes).

    Returns a list of dicts, one per pair (world sizes outer, sizes inner):
    ``{"world_size": p, "nbytes": n, <algorithm>: seconds, ..., "best": algorithm}``.
    ``model`` defaults to :data:`DEFAULT_MODEL`. Raises ValueError as :func:`terms`.
    """
    model = DEFAULT_MODEL if model is None else model
    rows = []
    for p in world_sizes:
        for n in sizes:
            times = model.times(collective, n, p)
            rows.append({"world_size": int(p), "nbytes": int(n), **times, "best": min(times, key=times.get)})
    return rows


def format_bytes(nbytes: float) -> str:
    """``1048576 -> '1 MiB'``, ``1536 -> '1.5 KiB'``, ``4 -> '4 B'``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.4g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_seconds(seconds: float) -> str:
    """``2.5e-6 -> '2.5 us'``, ``0.0123 -> '12.3 ms'``, ``3.2 -> '3.2 s'``."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"


def format_table(rows: list[dict]) -> str:
    """Plain-text table of :func:`what_if` rows (or any list of flat dicts with the
    same keys): sizes as bytes, times as seconds with units, other values as given."""
    if not rows:
        return ""
    columns = list(rows[0])

    def cell(key, value):
        if key == "nbytes":
            return format_bytes(value)
        if isinstance(value, float):
            return format_seconds(value)
        return str(value)

    cells = [[cell(k, row[k]) for k in columns] for row in rows]
    widths = [max(len(k), *(len(r[i]) for r in cells)) for i, k in enumerate(columns)]
    lines = ["  ".join(k.rjust(w) for k, w in zip(columns, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


# --- two tiers: links inside a node and between nodes ----------------------------------------
#
# On a cluster a message's alpha and beta depend on its link: inside a node (NVLink, NVSwitch,
# shared memory) or between nodes (the network). A two-tier cost counts, along the critical
# path, the messages and bytes on each link class c, and the time is
#
#     T = sum over c of  messages_c * alpha_c + bytes_c / bandwidth_c
#
# in the model of minidist.sim's virtual time (minidist.sim.topology): a message occupies its
# sender's port (or, with nic="shared", the node's one network card) from start to arrival,
# and a shared card serves its node's inter-node messages one at a time, so when l ranks of a
# node send across at once, each step counts l messages and l times the bytes. P = N l ranks
# on N nodes of l ranks; n the vector's bytes. Reduction costs (gamma) are left out: the sim's
# local work is free.
#
#   ring          one ring over all P ranks; with N >= 2 every step waits for its slowest link,
#                 an inter-node one:  2(P-1) (alpha_inter + n/P / B_inter)
#   tree          binomial reduce + broadcast; round k pairs ranks 2^k apart, which cross
#                 nodes once 2^k >= l:  2 lg l (alpha_intra + n/B_intra) + 2 lg N (alpha_inter + n/B_inter)
#   recursive_doubling  the same rounds once: lg l (...intra) + lg N (...inter, l-fold on a shared NIC)
#   hierarchical  Horovod's three phases (HOROVOD_HIERARCHICAL_ALLREDUCE, in this form since
#                 uber/horovod pull request #411, 2018; the idea: Goyal et al. 2017, section 4): ring
#                 reduce-scatter inside the node, an all-reduce of this rank's 1/l across the
#                 nodes (by ring or recursive doubling, as choose_cross_all_reduce picks: MPI's
#                 Allreduce, which Horovod calls there, chooses too), ring all-gather inside:
#                 2(l-1) (alpha_intra + n/l / B_intra) + cross(n/l, N) on the inter links,
#                 ring cross: 2(N-1) (alpha_inter + n/(lN) / B_inter); the l cross-node
#                 all-reduces run at once, each on its own NIC (per_rank), or taking turns on
#                 the shared one: 2(N-1) (l alpha_inter + n/N / B_inter) -- the same bytes
#                 through the card as the flat ring, so no bandwidth gain, only alpha's
#                 (cross_terms gives both crosses on a shared card, and why the choice moves)
#   torus         the 2-D torus (H. Mikami et al., "Massively distributed SGD: ImageNet/ResNet-50
#                 training in a flash", 2018; X. Jia et al. 2018 for the hierarchical
#                 variants): rows are the nodes, columns the same local rank on every node;
#                 ring reduce-scatter along the row, ring all-reduce along the column, ring
#                 all-gather along the row -- hierarchical with a ring in every phase.
#   multi_ring    what NCCL runs (collectives' comment on it gives the sources): l rings, each
#                 over all P ranks and each all-reducing its own 1/l of the vector, ring k
#                 leaving every node from local rank k, on that rank's card. Each step a rank
#                 sends one message inside its node (its l-1 staying chunks of c = n/(lP)) and
#                 one across (one chunk) at once, so a step lasts the slower of the two:
#                   2(P-1) max(alpha_intra + (l-1) c / B_intra, alpha_inter + c / B_inter)
#                 with a card per rank; on a shared card the l crossings of a step take turns,
#                 l (alpha_inter + c / B_inter) (the sim measures exactly these maxima, slow
#                 NVLink or slow card: tests/test_topology.py). Through each card:
#                 2(P-1)/P n/l bytes, against hierarchical's 2(N-1)/N n/l: the same l-fold cut
#                 against one flat ring (whose two crossing cards carry 2(P-1)/P n each), with
#                 only the factor ((P-1)/P) / ((N-1)/N) between them (1.875 on 2 nodes of 8,
#                 1.03 on 32); the price is 2(P-1) network latencies against hierarchical's
#                 2(N-1) or lg N; the gain, that NVLink and the network work at once where
#                 hierarchical's phases take turns. two_tier_terms charges every step to the
#                 slower link class.
#
# Exact (to rounding, for n divisible by P; by l P for multi_ring) for the algorithms of minidist.collectives on
# nodes numbered node by node; for tree and recursive doubling also only when l and N are
# powers of two (else each round is charged at its slowest pair: an upper bound), except
# hierarchical's cross-node recursive doubling, exact for any N (cross_terms).

TOPOLOGY_ALL_REDUCE_ALGORITHMS = ("hierarchical", "torus", "multi_ring")  # minidist.collectives; need a node layout
TWO_TIER_ALGORITHMS = ("ring", "recursive_doubling", "tree", "hierarchical", "torus", "multi_ring")  # tie-break order
# "auto" on a communicator that knows its topology chooses among these (multi_ring is left out
# so that auto's choices, which other chapters and DDP runs print, stay what they were)
AUTO_TWO_TIER_ALGORITHMS = ("ring", "recursive_doubling", "tree", "hierarchical", "torus")
LINK_CLASSES = ("intra", "inter")


# The cross-node phase on a shared card (nic="shared"). The l columns (one all-reduce of c =
# n/l bytes per local rank) take turns on their node's one card, which carries a message from
# start to arrival, alpha included (minidist.sim's model), T = alpha + c / B for a whole chunk:
#   ring                every card sends in every one of the 2(N-1) steps, for every column:
#                       l 2(N-1) (alpha + c/N / B), exactly l times a column alone;
#   recursive doubling  N a power of two: every card in every one of the lg N rounds: l lg N T,
#                       again l times. Otherwise the N - q extra nodes (q = 2^floor(lg N)) fold
#                       into their partners first and get the result last, and the columns
#                       pipeline through those rounds: a partner's card is busy without a gap
#                       from the first column's fold on (its lg q exchanges and its unfold for
#                       every column): T + l (lg q + 1) T, less than l (lg q + 2) T.
# So a shared card multiplies both crosses by l -- and leaves the choice between them where it
# was -- except recursive doubling on N not a power of two, which gains (l - 1) T: there the
# shared card can flip the choice to recursive doubling (3 nodes of 2 ranks, 8000 B chunks on
# 10 us, 1 GB/s: ring 101.3 us, recursive doubling 90 us; on cards of their own 50.7 against
# 54). Charging the shared card as 1/l of the bandwidth with alpha unchanged ("each rank gets
# 1/l of it") would be wrong: alpha too waits for the card, and that model flips the choice
# to the ring where the sim measures recursive doubling faster (4 nodes of 4, chunks of 30 to
# 70 KB: 320 against 420 us at 30 KB). Exact for chunks that divide by N.

def cross_terms(algorithm: str, nbytes: int, num_nodes: int, ranks_per_nic: int = 1) -> tuple[float, float]:
    """Critical-path ``(messages, bytes)`` on the inter-node link of hierarchical's cross-node
    phase: ``ranks_per_nic`` all-reduces of ``nbytes`` each (one per local rank), each over
    ``num_nodes`` ranks, taking turns on one network card per node (``ranks_per_nic`` = l for
    ``nic="shared"``, 1 for a card per rank). algorithm: "ring" or "recursive_doubling".
    Time: messages * alpha + bytes / bandwidth of the inter link (the comment above derives
    them). Raises ValueError for another algorithm, a negative size, num_nodes < 1 or
    ranks_per_nic < 1."""
    n, p = _check_size(nbytes, num_nodes)
    if isinstance(ranks_per_nic, bool) or not isinstance(ranks_per_nic, int) or ranks_per_nic < 1:
        raise ValueError(f"ranks_per_nic must be an integer >= 1 (l with a shared card, else 1), got {ranks_per_nic!r}")
    if algorithm not in ("ring", "recursive_doubling"):
        raise ValueError(f"unknown cross-node algorithm {algorithm!r}; valid: ring, recursive_doubling")
    messages, per_byte = _cross_counts(algorithm, p, ranks_per_nic)
    return messages, per_byte * n


def _cross_counts(algorithm, p, k):
    """(messages, bytes per byte of the chunk) of :func:`cross_terms`."""
    if p == 1:
        return 0.0, 0.0
    if algorithm == "ring":
        return 2 * (p - 1) * k, 2 * (p - 1) / p * k
    rounds = p.bit_length() - 1  # lg q
    messages = rounds * k if p & (p - 1) == 0 else 1 + k * (rounds + 1)
    return messages, messages


def choose_cross_all_reduce(nbytes: int, num_nodes: int, link=None, ranks_per_nic: int = 1) -> str:
    """The all-reduce that hierarchical runs across the nodes on its 1/l share: "ring" or
    "recursive_doubling" (MPICH's two for short and long vectors), whichever the alpha-beta
    model of ``link`` (anything with ``alpha`` and ``bandwidth``: the inter-node LinkClass;
    None: ``model_for(num_nodes)``) predicts faster; ties go to the ring. ``ranks_per_nic``:
    how many ranks' cross-node all-reduces take turns on one network card (l on a node with
    ``nic="shared"``, 1 with a card per rank): their times are :func:`cross_terms`'s, which on
    a shared card favour recursive doubling when ``num_nodes`` is not a power of two (the
    comment above). Raises ValueError as :func:`choose_all_reduce` and :func:`cross_terms`."""
    n, p = _check_size(nbytes, num_nodes)
    model = model_for(p) if link is None else CostModel(alpha=link.alpha, beta=1.0 / link.bandwidth)
    ring, doubling = (m * model.alpha + b * model.beta + terms("all_reduce", a, n, p)[2] * model.gamma
                      for a in ("ring", "recursive_doubling") for m, b in [cross_terms(a, n, p, ranks_per_nic)])
    return "recursive_doubling" if doubling < ring else "ring"


def _check_topology(topology):
    needed = ("size", "num_nodes", "ranks_per_node", "nic", "intra", "inter", "node_of")
    missing = [name for name in needed if not hasattr(topology, name)]
    if missing:
        raise ValueError(f"topology must be a minidist.sim.Topology (or have {', '.join(needed)}); "
                         f"{type(topology).__name__} lacks {', '.join(missing)}")
    return topology


def _round(topology, pairs):
    """(link class name, senders through the busiest shared card) of one round of
    ``pairs`` = [(sender, receiver), ...] happening at once: "inter" if any pair crosses nodes."""
    crossing = [s for s, d in pairs if topology.node_of(s) != topology.node_of(d)]
    if not crossing:
        return "intra", 1
    if topology.nic != "shared":
        return "inter", 1
    per_node = {}
    for s in crossing:
        per_node[topology.node_of(s)] = per_node.get(topology.node_of(s), 0) + 1
    return "inter", max(per_node.values())


def _add(counts, link, messages, nbytes):
    m, b = counts[link]
    counts[link] = (m + messages, b + nbytes)


def two_tier_terms(algorithm: str, nbytes: int, topology) -> dict[str, tuple[float, float]]:
    """Critical-path ``{"intra": (messages, bytes), "inter": (messages, bytes)}`` of an
    all-reduce of ``nbytes`` on ``topology`` (a ``minidist.sim.Topology``; the comment above
    gives the formulas and when they are exact). algorithm: one of TWO_TIER_ALGORITHMS.
    Time: :func:`two_tier_time`. Raises ValueError for an unknown algorithm, a negative size,
    or hierarchical/torus/multi_ring on nodes of different sizes (they need the same l on every
    node)."""
    if algorithm not in TWO_TIER_ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r} for a two-tier all_reduce; valid: "
                         f"{', '.join(TWO_TIER_ALGORITHMS)}")
    topology = _check_topology(topology)
    n, p = _check_size(nbytes, topology.size)
    counts = {c: (0.0, 0.0) for c in LINK_CLASSES}
    if p == 1:
        return counts
    if algorithm == "ring":
        link, share = _round(topology, [(r, (r + 1) % p) for r in range(p)])
        _add(counts, link, 2 * (p - 1) * share, 2 * (p - 1) / p * n * share)
    elif algorithm == "tree":
        mask = 1
        while mask < p:  # the reduce's round, then the broadcast's (same pairs, reversed)
            pairs = [(v, v - mask) for v in range(mask, p, 2 * mask)]
            for round_pairs in (pairs, [(d, s) for s, d in pairs]):
                link, share = _round(topology, round_pairs)
                _add(counts, link, share, n * share)
            mask <<= 1
    elif algorithm == "recursive_doubling":
        q = 1 << (p.bit_length() - 1)
        rem = p - q
        folds = [(2 * i, 2 * i + 1) for i in range(rem)]
        survivors = [2 * i + 1 for i in range(rem)] + list(range(2 * rem, p))
        if folds:  # the extra ranks hand their vector in, and get the result back at the end
            for pairs in (folds, [(d, s) for s, d in folds]):
                link, share = _round(topology, pairs)
                _add(counts, link, share, n * share)
        mask = 1
        while mask < q:
            link, share = _round(topology, [(survivors[i], survivors[i ^ mask]) for i in range(q)])
            _add(counts, link, share, n * share)
            mask <<= 1
    elif topology.ranks_per_node is None:
        raise ValueError(f"{algorithm} needs the same number of ranks on every node; {topology!r} has not")
    elif algorithm == "multi_ring":
        link, messages, nbytes = _multi_ring_step(n, topology)
        _add(counts, link, 2 * (p - 1) * messages, 2 * (p - 1) * nbytes)
    else:
        l, nodes = topology.ranks_per_node, topology.num_nodes
        _add(counts, "intra", 2 * (l - 1), 2 * (l - 1) / l * n)
        if nodes > 1:
            chunk = n / l
            share = l if topology.nic == "shared" else 1  # the columns taking turns on one card
            cross = "ring" if algorithm == "torus" else \
                choose_cross_all_reduce(int(chunk), nodes, topology.inter, ranks_per_nic=share)
            messages, per_byte = _cross_counts(cross, nodes, share)
            _add(counts, "inter", messages, per_byte * chunk)
    return counts


def _multi_ring_step(n, topology):
    """(link class, messages, bytes) on the critical path of one of the multi-ring's 2(P-1)
    steps (the comment above two_tier_terms): the slower of its one message inside the node
    (l-1 chunks of c = n/(lP); all l on a single node) and its card's crossings (one chunk, or
    l taking turns on a shared card). Ties go to "inter"."""
    l, nodes, p = topology.ranks_per_node, topology.num_nodes, topology.size
    chunk = n / (l * p)
    if nodes == 1:
        return "intra", 1, l * chunk
    turns = l if topology.nic == "shared" else 1
    inside = (l - 1) * chunk
    across = turns * topology.inter.time(chunk)
    if l > 1 and topology.intra.time(inside) > across:
        return "intra", 1, inside
    return "inter", turns, turns * chunk


def two_tier_time(algorithm: str, nbytes: int, topology) -> float:
    """Predicted seconds of an all-reduce of ``nbytes`` with ``algorithm`` on ``topology``:
    the sum over link classes of messages * alpha + bytes / bandwidth (:func:`two_tier_terms`;
    equal to the sim's virtual-time makespan where the comment above says exact)."""
    counts = two_tier_terms(algorithm, nbytes, topology)
    return sum(m * link.alpha + b / link.bandwidth
               for (m, b), link in ((counts["intra"], topology.intra), (counts["inter"], topology.inter)))


def two_tier_times(nbytes: int, topology) -> dict[str, float]:
    """``{algorithm: seconds}`` for every algorithm of TWO_TIER_ALGORITHMS that runs on
    ``topology`` (hierarchical and torus need the same number of ranks on every node)."""
    algorithms = [a for a in TWO_TIER_ALGORITHMS if _check_topology(topology).ranks_per_node is not None
                  or a not in TOPOLOGY_ALL_REDUCE_ALGORITHMS]
    return {a: two_tier_time(a, nbytes, topology) for a in algorithms}


@functools.lru_cache(maxsize=4096)
def choose_all_reduce_on(nbytes: int, topology) -> str:
    """The all-reduce ``collectives.all_reduce(..., algorithm="auto")`` runs on a communicator
    that knows its topology (a ``minidist.sim`` world with one, or a
    ``minidist.topology_delay.DelayComm``): the fastest of :func:`two_tier_times` among
    AUTO_TWO_TIER_ALGORITHMS (ties to the earlier name; "multi_ring" is not among them, see
    there). One rank: "ring". Cached per (nbytes, topology)."""
    n, _ = _check_size(nbytes, _check_topology(topology).size)
    times = {a: t for a, t in two_tier_times(n, topology).items() if a in AUTO_TWO_TIER_ALGORITHMS}
    return min(times, key=times.get)


# Link figures for the what-if (one direction; bytes per second). Sources: NVIDIA A100 Tensor
# Core GPU datasheet (NVLink 3: 600 GB/s total, i.e. 300 GB/s each way) and H100 datasheet
# (NVLink 4: 900 GB/s total, 450 GB/s each way); 100 and 400 Gb/s network cards (EDR/NDR
# InfiniBand, 100/400 GbE) carry 12.5 and 50 GB/s each way. Latencies per step: NCCL's tuning
# model (src/graph/tuning.h and tuning.cc, hwLat, Ring/Simple protocol): 3.4 us on NVLink, 9.6 us
# on the network (5.7 us is its PCIe figure). A DGX A100 / H100 has one network card per GPU
# (nic="per_rank"); a node with one card for its 8 GPUs is nic="shared".
GPU_LINKS = {"A100 NVLink3": (3.4e-6, 300e9), "H100 NVLink4": (3.4e-6, 450e9)}
NETWORK_LINKS = {"100 Gb/s": (9.6e-6, 12.5e9), "400 Gb/s": (9.6e-6, 50e9)}
WHAT_IF_NODES = (2, 8, 32)
WHAT_IF_TOPOLOGY_SIZES = (1 << 20, 64 << 20, 1 << 30)  # 1 MiB, 64 MiB, 1 GiB of gradients


def what_if_topology(num_nodes=WHAT_IF_NODES, sizes=WHAT_IF_TOPOLOGY_SIZES, ranks_per_node=8, gpus=None,
                     networks=None, nics=("per_rank", "shared")) -> list[dict]:
    """Predicted all-reduce seconds on clusters of ``ranks_per_node``-GPU nodes: one row per
    (gpu link, network, nic, number of nodes, size), with a column per algorithm of
    TWO_TIER_ALGORITHMS and "best". ``gpus``/``networks``: ``{name: (alpha_s, bytes_per_s)}``
    (default :data:`GPU_LINKS`, :data:`NETWORK_LINKS`, sourced above). Print with
    :func:`format_table`. Raises ValueError for bad counts or links."""
    rows = []
    for gpu, intra in (GPU_LINKS if gpus is None else gpus).items():
        for network, inter in (NETWORK_LINKS if networks is None else networks).items():
            for nic in nics:
                for nodes in num_nodes:
                    topology = Topology.nodes(nodes, ranks_per_node, intra=intra, inter=inter, nic=nic)
                    for n in sizes:
                        times = two_tier_times(n, topology)
                        rows.append({"gpu": gpu, "network": network, "nic": nic, "nodes": nodes, "nbytes": int(n),
                                     **times, "best": min(times, key=times.get)})
    return rows
