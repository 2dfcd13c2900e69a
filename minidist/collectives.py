"""Collective operations built from point-to-point messages.

Every function here takes a communicator with mpi4py's point-to-point methods (``Isend``/
``Irecv`` + ``Test``, and ``isend``/``irecv`` for the agreement round) and nothing more, so
the same code runs on a ``minidist.sim`` world (threads, with a message trace) and on
``mpi4py.MPI.COMM_WORLD`` under ``mpiexec``. All of them are *functional*: they never modify
their input and return a new array (numpy or cupy, like the input, of the input's numeric
dtype), or fill the ``out`` buffer you pass to ``all_reduce``.

Costs are given in the alpha-beta-gamma model: a message of n bytes costs alpha + n*beta,
reducing n bytes locally costs n*gamma; p is the number of ranks and n the size of the
vector. The algorithms and their costs follow R. Thakur, R. Rabenseifner and W. Gropp,
"Optimization of Collective Communication Operations in MPICH" (IJHPCA 19(1), 2005); the
ring all-reduce and its bandwidth optimality, P. Patarasuk and X. Yuan, "Bandwidth optimal
all-reduce algorithms for clusters of workstations" (JPDC 69(2), 2009).
:mod:`minidist.costmodel` evaluates the same formulas, owns the algorithms' names
(``ALL_REDUCE_ALGORITHMS``, ``BROADCAST_ALGORITHMS``, ``ALIASES``) and picks ``"auto"``'s.

The step protocol. The tree, ring, recursive-doubling and naive algorithms are written as
*step generators*, the engine's protocol for a collective in progress: each ``yield`` posts
the messages of one round (:func:`minidist.p2p.post_exchange` and friends) and hands the
exchange ``(requests, peers, receives)`` to whoever drives the algorithm; the code after the
yield runs once those requests are complete. The blocking collectives drive them at once
(:func:`run_steps`); :mod:`minidist.async_collectives` drives the same generators a little at
a time while the caller computes, and the comm hooks of data parallelism start their own
(:func:`all_reduce_steps`, :func:`ring_all_gather_steps`). One copy of each algorithm, so the
blocking and the non-blocking all-reduce give the same bytes.

Agreement. Before any data moves, the ranks check that they called the same collective
with the same arguments (shape, dtype, op, algorithm, root) and that none found a problem
with its own (an unknown op, an input that cannot be sent), in one round of
:func:`minidist.p2p.agree`. If the ranks disagree, or any rank's arguments are bad, every
rank raises the same :class:`~minidist.p2p.CollectiveError` instead of hanging or returning
garbage. To keep that round cheap, it carries a 64-bit fingerprint of the arguments, not
the arguments: a small message to each other rank, one round of latency. On mpi4py's own
communicators that message is a 32-byte binary header on its own tag, and at P = 2 a small
recursive-doubling all-reduce sends its vector behind it, so the round is the algorithm's one
exchange (:mod:`minidist.agreement_header`); on the sim and on wrapping communicators it is
pickled (:func:`minidist.p2p.agree`), as the traces count it. When the headers or the
fingerprints differ, a pickled round shares the arguments, to say which differ. The
local checks, "auto"'s choice and the fingerprint are computed once per set of arguments
and remembered (as ``DistributedDataParallel`` checks its buckets once), so a repeated call
pays the round and little else. ``validate=False`` skips the round when you know the
arguments agree (then bad arguments raise only on the ranks that see them, and the others
wait until the deadline).

Input. x is a numpy or cupy array (or anything ``asarray`` takes) of bool, integer, float or
complex numbers in native byte order: what MPI can send and numpy can reduce. A minidist
``Tensor``, an object or string array, or a byte-swapped one (``'>f8'`` on a little-endian
machine) is a CollectiveError on every rank, the same under ``mpiexec`` as on the sim.

Deadlines and errors are :mod:`minidist.p2p`'s: every wait has one (``p2p.get_timeout()``
seconds, default 300; ``p2p.set_timeout``, ``MINIDIST_TIMEOUT``), and on expiry every waiting
rank raises ``p2p.CollectiveTimeout`` naming the ranks it has not heard from.

GPU arrays. A ``minidist.sim`` communicator takes cupy arrays directly (``comm.cuda_aware``
is True). For an MPI communicator, cupy inputs are staged through host memory (copied to
numpy, communicated and reduced there, copied back: ``p2p.stage_to_host``) unless the
environment says the MPI library is CUDA-aware: ``MINIDIST_CUDA_AWARE_MPI=1`` (mpi4py
offers no portable query).

Longer than 400 lines: the collectives share one step protocol, one agreement round and one
chunking rule, and every all-reduce algorithm (ring, recursive doubling, tree, naive, the
topology-aware hierarchical, torus and multi-ring) is a short generator beside the comment that
gives its cost. Split by algorithm, a reader would jump between files to follow one all-reduce
from its arguments to its messages; the sections (public collectives, objects, steps, plumbing)
are marked instead.
"""
from __future__ import annotations

import functools
import hashlib
import operator
import pickle
from typing import NamedTuple

import numpy

from minidist.agreement_header import HEADER_TAG, can_carry, header_round, takes_header
from minidist.backend import device_of, get_array_module
from minidist.costmodel import (
    ALIASES,
    ALL_REDUCE_ALGORITHMS,
    BROADCAST_ALGORITHMS,
    TOPOLOGY_ALL_REDUCE_ALGORITHMS,
    choose_all_reduce,
    choose_all_reduce_on,
    choose_cross_all_reduce,
)
from minidist.node_layout import node_layout, rank_grid
from minidist.p2p import (
    AGREE_TAG,
    CollectiveError,
    agree,
    post_exchange,
    post_recv,
    post_send,
    stage_to_host,
    wait_all,
)
from minidist.tensor import Tensor

OPS = {"sum": "add", "prod": "multiply", "max": "maximum", "min": "minimum"}  # op -> ufunc name
# One tag per collective, so a collective never takes a user's message (or another
# collective's); messages with the same tag between two ranks stay in order (MPI's rule).
TAGS = {"agree": AGREE_TAG, "agree_header": HEADER_TAG, "broadcast": 7701, "scatter": 7702, "gather": 7703,
        "all_gather": 7704, "reduce": 7705, "reduce_scatter": 7706, "all_reduce": 7707, "all_to_all": 7709,
        "all_to_all_v": 7710}
_TAG_NAMES = {tag: name for name, tag in TAGS.items()}
VALIDATE = (True, False)  # the values of every collective's validate argument

# ---------------------------------------------------------------------------------------
# Public collectives
# ---------------------------------------------------------------------------------------


def broadcast(comm, x, root=0, algorithm="tree", validate=True):
    """Root's array on every rank.

    x: an array of the same shape and dtype on every rank (only root's values are used).
    algorithm: "tree" (the binomial tree, ceil(lg p) rounds; "binomial" is accepted for it)
    or "linear" (root sends p-1 copies). Returns a new array of x's shape and dtype on every
    rank. Raises CollectiveError (on every rank) for mismatched shapes/dtypes, an input the
    collectives cannot send (module docstring), a root out of range, roots that differ or
    an unknown algorithm; CollectiveTimeout past the deadline. Source: Thakur et al. 2005.
    """
    x, problem = _input(x)
    algorithm = ALIASES.get(algorithm, algorithm) if isinstance(algorithm, str) else algorithm
    problem = problem or _check_root(root, comm) or _check_name(algorithm, BROADCAST_ALGORITHMS, "algorithm")
    _agree(comm, "broadcast", x.shape, x.dtype, problem, validate, (("algorithm", algorithm), ("root", root)))
    x, back = stage_to_host(comm, x)
    xp = get_array_module(x)
    out = xp.array(x, order="C", copy=True) if comm.Get_rank() == root else xp.empty(x.shape, x.dtype)
    if algorithm == "linear":
        _broadcast_linear(comm, out, root, TAGS["broadcast"])
    else:
        run_steps(comm, broadcast_tree_steps(comm, out, root, TAGS["broadcast"]), "broadcast")
    return back(out)


def scatter(comm, x, root=0, validate=True):
    """Block ``rank`` of root's array: root passes x of shape (p, *block), the others an
    array shaped and typed like one block (its values are ignored); returns a new array of
    shape ``block`` on every rank. Linear: (p-1) alpha + (p-1)/p N beta, N = root's bytes.
    Raises CollectiveError if root's first axis is not p, blocks or dtypes differ, the input
    cannot be sent, or the root is out of range. Source: Thakur et al. 2005."""
    x, problem = _input(x)
    p, rank = comm.Get_size(), comm.Get_rank()
    problem = problem or _check_root(root, comm)
    block_shape = x.shape
    if not problem and rank == root:
        if x.ndim == 0 or x.shape[0] != p:
            problem = f"root's x must have shape (p, ...) = ({p}, ...), got {x.shape}"
        block_shape = x.shape[1:]
    _agree(comm, "scatter", block_shape, x.dtype, problem, validate, (("root", root),))
    x, back = stage_to_host(comm, x)
    return back(_scatter_linear(comm, x, root, TAGS["scatter"]))


def gather(comm, x, root=0, validate=True):
    """Every rank's x stacked on root: root returns shape (p, *x.shape), the others None.
    Linear (root posts p-1 receives): (p-1) alpha + (p-1)/p N beta, N = the result's bytes.
    Raises CollectiveError for mismatched shapes/dtypes, an input that cannot be sent or a
    bad root. Source: Thakur et al. 2005."""
    x, problem = _input(x)
    _agree(comm, "gather", x.shape, x.dtype, problem or _check_root(root, comm), validate, (("root", root),))
    x, back = stage_to_host(comm, x)
    return back(_gather_linear(comm, x, root, TAGS["gather"]))


def all_gather(comm, x, validate=True):
    """Every rank's x stacked on every rank: returns shape (p, *x.shape). Ring:
    (p-1) alpha + (p-1)/p N beta, N = the result's bytes (Thakur et al. 2005).
    Raises CollectiveError for mismatched shapes/dtypes or an input that cannot be sent."""
    x, problem = _input(x)
    _agree(comm, "all_gather", x.shape, x.dtype, problem, validate, ())
    x, back = stage_to_host(comm, x)
    xp, p = get_array_module(x), comm.Get_size()
    out = xp.empty((p,) + x.shape, x.dtype)
    out[comm.Get_rank()] = x
    tag = TAGS["all_gather"]
    run_steps(comm, ring_all_gather_steps(comm, out.reshape(-1), _bounds(p * x.size, p), tag), "all_gather")
    return back(out)


def reduce(comm, x, op="sum", root=0, validate=True):
    """The elementwise reduction of every rank's x, on root (others get None).

    op: "sum", "prod", "max" or "min" (numpy's add/multiply/maximum/minimum in x's dtype,
    so integers wrap as in C). Binomial tree: ceil(lg p) (alpha + n beta + n gamma).
    Raises CollectiveError for mismatched shapes/dtypes, an input that cannot be sent, a bad
    root or an unknown op. Source: Thakur et al. 2005."""
    x, problem = _input(x)
    problem = problem or _check_root(root, comm) or _check_name(op, OPS, "op")
    _agree(comm, "reduce", x.shape, x.dtype, problem, validate, (("op", op), ("root", root)))
    x, back = stage_to_host(comm, x)
    acc = get_array_module(x).array(x, order="C", copy=True).reshape(-1)
    run_steps(comm, reduce_tree_steps(comm, acc, root, _ufunc(op, acc), TAGS["reduce"]), "reduce")
    return back(acc.reshape(x.shape)) if comm.Get_rank() == root else None


def reduce_scatter(comm, x, op="sum", validate=True):
    """Chunk ``rank`` of the reduction of every rank's flattened x.

    The flattened vector of n elements is split into p chunks with ``numpy.array_split``
    sizes (the first n % p chunks one element longer); returns a new 1-D array. Ring:
    (p-1) alpha + (p-1)/p n (beta + gamma) (Patarasuk & Yuan 2009). Raises CollectiveError
    for mismatched shapes/dtypes, an input that cannot be sent or an unknown op."""
    x, problem = _input(x)
    problem = problem or _check_name(op, OPS, "op")
    _agree(comm, "reduce_scatter", x.shape, x.dtype, problem, validate, (("op", op),))
    x, back = stage_to_host(comm, x)
    mine = _contiguous(x).reshape(-1)
    out = get_array_module(mine).empty_like(mine)
    bounds = _bounds(x.size, comm.Get_size())
    steps = ring_reduce_scatter_steps(comm, mine, out, bounds, _ufunc(op, mine), TAGS["reduce_scatter"])
    run_steps(comm, steps, "reduce_scatter")
    start, stop = bounds[comm.Get_rank()]
    return back(out[start:stop].copy())


def all_to_all(comm, x, validate=True):
    """Block j of x to rank j; block i of the result from rank i (MPI's Alltoall): across the
    ranks, the transpose of the p x p grid of blocks.

    x: an array of shape (p, *block), the same shape and dtype on every rank. Returns a new
    array of x's shape and dtype whose block i is rank i's ``x[rank]``. Pairwise exchange
    (:func:`all_to_all_steps`): (p-1) alpha + (p-1)/p n beta, n = x's bytes. Raises
    CollectiveError (on every rank) when x's first axis is not p, the ranks' shapes or dtypes
    differ, or x cannot be sent; CollectiveTimeout past the deadline. Sources: Thakur et al.
    2005; MPICH's src/mpi/coll/alltoall/alltoall_intra_pairwise.c."""
    x, problem = _input(x)
    p = comm.Get_size()
    if not problem and (x.ndim == 0 or x.shape[0] != p):
        problem = f"x must have shape (p, ...) = ({p}, ...), block j for rank j; got shape {x.shape}"
    _agree(comm, "all_to_all", x.shape, x.dtype, problem, validate, ())
    x, back = stage_to_host(comm, x)
    send = _contiguous(x)
    out = get_array_module(send).empty_like(send)
    blocks = [send[j:j + 1] for j in range(p)], [out[i:i + 1] for i in range(p)]  # slices: 0-d blocks too
    run_steps(comm, all_to_all_steps(comm, *blocks, TAGS["all_to_all"]), "all_to_all")
    return back(out)


def all_to_all_v(comm, blocks, validate=True):
    """``blocks[j]`` to rank j, with any number of rows each (MPI's Alltoallv): returns the list
    of the p arrays received, item i from rank i (a new array, ``blocks[rank]``'s copy at i).

    blocks: a list of p arrays of any first dimension (0 included); the rest of their shape
    (shape[1:]) and their dtype the same in every block on every rank. The receivers do not
    know how many rows come, so the counts travel first, as MoE token dispatchers do before
    their all-to-all (Megatron-LM's MoEAlltoAllTokenDispatcher all-gathers every rank's token
    count per expert: megatron/core/transformer/moe/token_dispatcher.py, ``preprocess``): here
    a pairwise all-to-all of one int64 per peer, then the blocks by the same schedule. Cost
    (after the agreement round): 2(p-1) alpha + (8(p-1) + m) beta, m = the bytes this rank
    sends to others: the counts double the latency term, which a small all-to-all notices and
    a large one does not. Raises CollectiveError (on every rank)
    when blocks is not a list of p arrays, a block is 0-d or cannot be sent, or the blocks'
    trailing shapes or dtypes differ (on one rank or between ranks); CollectiveTimeout past
    the deadline. Sources: Thakur et al. 2005; MPICH's pairwise exchange."""
    p = comm.Get_size()
    arrays, problem = _blocks(blocks, p)
    first = arrays[0] if arrays else numpy.empty((0,))
    _agree(comm, "all_to_all_v", first.shape[1:], first.dtype, problem, validate, ())
    staged = [stage_to_host(comm, b) for b in arrays]
    send = [_contiguous(b) for b, _ in staged]
    counts = numpy.array([b.shape[0] for b in send], numpy.int64)
    received = numpy.empty_like(counts)
    tag = TAGS["all_to_all_v"]
    run_steps(comm, all_to_all_steps(comm, [counts[j:j + 1] for j in range(p)],
                                     [received[i:i + 1] for i in range(p)], tag), "all_to_all_v")
    xp = get_array_module(send[0])
    out = [xp.empty((int(n),) + first.shape[1:], first.dtype) for n in received]
    run_steps(comm, all_to_all_steps(comm, send, out, tag), "all_to_all_v")  # after the counts: same tag, in order
    back = staged[0][1]
    return [back(o) for o in out]


def _blocks(blocks, p):
    """(all_to_all_v's blocks as arrays, why they cannot be exchanged or None)."""
    if not isinstance(blocks, (list, tuple)) or len(blocks) != p:
        got = f"{len(blocks)} items" if isinstance(blocks, (list, tuple)) else f"a {type(blocks).__name__}"
        return [], f"blocks must be a list of p = {p} arrays (blocks[j] goes to rank j), got {got}"
    arrays, problems = [], []
    for j, block in enumerate(blocks):
        array, problem = _input(block)
        arrays.append(array)
        if problem:
            problems.append(f"blocks[{j}]: {problem}")
        elif array.ndim == 0:
            problems.append(f"blocks[{j}] is 0-d; every block needs a first dimension (its rows): pass a.reshape(1)")
    first = arrays[0]
    for j, array in enumerate(arrays):
        if array.shape[1:] != first.shape[1:] or array.dtype != first.dtype or device_of(array) != device_of(first):
            problems.append(f"blocks[{j}] has shape[1:] {array.shape[1:]}, dtype {array.dtype} on "
                            f"{device_of(array)} but blocks[0] {first.shape[1:]}, {first.dtype} on {device_of(first)}: "
                            "the blocks may differ only in their first dimension (reshape, cast or move them alike)")
    return arrays, (problems[0] if problems else None)


def all_reduce(comm, x, op="sum", algorithm="auto", validate=True, out=None):
    """The elementwise reduction of every rank's x, on every rank (same shape and dtype).

    op: "sum", "prod", "max" or "min". algorithm:
      "naive"               linear reduce to rank 0, then linear broadcast (the parameter
                            server pattern): 2(p-1) alpha + 2(p-1) n beta + (p-1) n gamma
      "ring"                ring reduce-scatter, then ring all-gather; bandwidth-optimal:
                            2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma
      "tree"                binomial-tree reduce to 0, then binomial-tree broadcast
                            ("binomial" is accepted for it):
                            2 ceil(lg p) (alpha + n beta) + ceil(lg p) n gamma
      "recursive_doubling"  lg p exchanges of the whole vector: lg p (alpha + n beta + n gamma)
                            when p is a power of two; otherwise the p - q extra ranks (q the
                            largest power of two below p) fold in first and get the result
                            last: 2 (alpha + n beta) + n gamma more, with lg q exchanges
      "hierarchical"        Horovod's three phases over the ranks' nodes (``minidist.node_layout``:
                            the sim's topology, MPI's shared-memory groups, or fake nodes):
                            ring reduce-scatter inside each node (l ranks), an all-reduce of
                            this rank's 1/l across the N nodes (ring or recursive doubling, as
                            ``costmodel.choose_cross_all_reduce`` picks), ring all-gather inside:
                            2(l-1) (a_intra + n/l b_intra) + 2(N-1) (a_inter + n/(lN) b_inter)
                            with a cross-node ring; only 1/l of the vector leaves each rank
      "torus"               the 2-D torus: the same three phases with a ring in each (rows =
                            nodes, columns = the same local rank on every node)
      "multi_ring"          NCCL's way on nodes with a network card per GPU: l rings over all
                            P ranks at once, each all-reducing 1/l of the vector, ring k
                            crossing between nodes only from local rank k (its own card):
                            2(P-1) max(a_intra + (l-1) n/(lP) b_intra, a_inter + n/(lP) b_inter)
      "auto"                the one ``minidist.costmodel.choose_all_reduce`` predicts fastest;
                            on a communicator that knows its topology (``cluster_topology``: a
                            sim world with one, ``topology_delay.DelayComm``) the fastest of
                            ``costmodel.two_tier_times``, hierarchical and torus included
    Every rank returns identical bytes. The reduction is numpy's ufunc in x's dtype
    (integers wrap; for bool, "sum" is logical or). validate=False skips the agreement
    round (module docstring).

    out: optional C-contiguous array of x's shape, dtype and device, not overlapping x,
    that receives the result and is returned (like MPI's receive buffer); it must be
    writable. Reusing one ``out`` across calls saves allocating, and on machines where
    fresh memory is slow to touch, much of the time of a large all-reduce.

    Raises CollectiveError for mismatched shapes/dtypes, an input that cannot be sent, an
    unknown op or algorithm, or an unusable ``out`` on any rank; CollectiveTimeout past the
    deadline (module docstring); hierarchical, torus and multi_ring raise CollectiveError on
    every rank when the nodes hold different numbers of ranks. Sources: Thakur et al. 2005; Patarasuk &
    Yuan 2009; Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE (uber/horovod#411) and Goyal et al. 2017
    (section 4); Mikami et al. 2018 (2-D torus); NCCL's
    rings (the comment above ``_all_reduce_multi_ring_steps``).
    """
    plan = prepare_all_reduce(comm, x, op, algorithm, validate, out, carry=True)
    if plan.algorithm is not None:  # None: the agreement round carried the vectors and reduced them (P = 2)
        run_steps(comm, all_reduce_steps(comm, plan.algorithm, plan.mine, plan.result, plan.ufunc, _ALL_REDUCE_TAG),
                  "all_reduce")
    return plan.finish(plan.result)


_ALL_REDUCE_TAG = TAGS["all_reduce"]


class AllReducePlan(NamedTuple):
    """What an all-reduce needs before its first message (:func:`prepare_all_reduce`):
    ``algorithm`` (one of ALL_REDUCE_ALGORITHMS, "auto" resolved; None when the agreement round
    carried the vectors and ``result`` already holds the reduction); ``mine``, this rank's input,
    flat and C-contiguous (only read); ``result``, the flat buffer the steps fill (``out``'s
    memory when given); ``ufunc(a, b, out=)``, the reduction; ``finish(result)``, the value
    all_reduce returns (x's shape and device, or ``out``)."""

    algorithm: str
    mine: object
    result: object
    ufunc: object
    finish: object


def prepare_all_reduce(comm, x, op="sum", algorithm="auto", validate=True, out=None,
                       carry=False) -> AllReducePlan:
    """Everything an all-reduce does before its first message, blocking or not (arguments as
    :func:`all_reduce`): check the arguments and agree on them, resolve "auto", stage a GPU
    array through the host when the MPI library cannot take GPU memory, and lay out the
    buffers. The local checks and "auto"'s choice are remembered per shape, dtype, op,
    algorithm and world size, so a repeated call pays only the agreement round. Drive the
    plan with ``all_reduce_steps(comm, plan.algorithm, plan.mine, plan.result, plan.ufunc,
    tag)``. carry=True (the blocking all-reduce) lets the agreement round do the whole
    all-reduce when it can: recursive doubling of a host array of at most 64 KiB on 2 ranks
    of an MPI communicator sends its vector behind its agreement header
    (:mod:`minidist.agreement_header`) and reduces it here, op(rank 0's, rank 1's) as the
    steps would; then ``plan.algorithm`` is None and there are no steps to drive. Raises
    CollectiveError as :func:`all_reduce`."""
    if type(x) is numpy.ndarray:  # the hot path: no conversion; _settle checks the dtype once
        problem = None
    else:
        x, problem = _input(x)
    topology = getattr(comm, "cluster_topology", None) if algorithm == "auto" else None
    key = (x.shape, x.dtype, op, algorithm, comm.Get_size(), topology)
    settled = _SETTLED.get(key) if problem is None and type(op) is str and type(algorithm) is str else None
    if settled is None:
        settled, problem = _settle(x, op, algorithm, comm.Get_size(), problem, key, topology)
    chosen, settings, fingerprint = settled
    problem = problem or _check_out(out, x)
    carried = (_flat(x) if carry and problem is None and chosen == "recursive_doubling"
               and type(x) is numpy.ndarray and can_carry(comm, x.nbytes) else None)
    incoming = _agree(comm, "all_reduce", x.shape, x.dtype, problem, validate, settings, fingerprint, carried)
    if chosen in TOPOLOGY_ALL_REDUCE_ALGORITHMS:
        node_layout(comm)  # collective the first time: before any message of the steps
    if type(x) is numpy.ndarray:
        staged, back = x, None
    else:
        staged, back = stage_to_host(comm, x)
    mine = _flat(staged)
    ufunc = getattr(numpy if back is None else get_array_module(mine), OPS[op])
    steps = chosen if incoming is None else None  # None: no steps left to run
    if out is not None and (back is None or device_of(out) == device_of(staged)):
        plan = AllReducePlan(steps, mine, _flat(out), ufunc, lambda _: out)  # the steps write into out
    else:
        plan = AllReducePlan(steps, mine, get_array_module(mine).empty_like(mine), ufunc,
                             _finisher(x.shape, back, out))
    if incoming is not None:
        # The round carried the other rank's vector: recursive doubling's one exchange at P = 2
        # is done; combine op(lower rank's, higher rank's) as its steps do: the same bytes.
        if comm.Get_rank() == 0:
            ufunc(mine, incoming, out=plan.result)
        else:
            ufunc(incoming, mine, out=plan.result)
    return plan


_SETTLED = {}  # (shape, dtype, op, algorithm, p, topology) -> (algorithm chosen, settings agreed on, fingerprint)
_ALL_REDUCE_NAMES = ALL_REDUCE_ALGORITHMS + TOPOLOGY_ALL_REDUCE_ALGORITHMS


def _settle(x, op, algorithm, p, problem, key, topology=None):
    """The local checks of an all-reduce's arguments and "auto"'s choice: ((algorithm, settings
    to agree on, their fingerprint), problem or None); remembered for ``key`` when fine."""
    if problem is None and type(x) is numpy.ndarray:
        problem = _input(x)[1]
    name = ALIASES.get(algorithm, algorithm) if isinstance(algorithm, str) else algorithm
    problem = (problem or _check_name(op, OPS, "op")
               or _check_name(name, _ALL_REDUCE_NAMES + ("auto",), "algorithm"))
    settings = (("algorithm", name), ("op", op))
    if problem:
        return (None, settings, None), problem
    if name != "auto":
        chosen = name
    else:
        chosen = choose_all_reduce(x.nbytes, p) if topology is None else choose_all_reduce_on(x.nbytes, topology)
    if chosen not in _ALL_REDUCE_NAMES:
        raise CollectiveError(f"costmodel.choose_all_reduce returned unknown algorithm {chosen!r}")
    settled = (chosen, settings, _fingerprint("all_reduce", x.shape, x.dtype, settings))
    if len(_SETTLED) >= _REMEMBERED:
        _SETTLED.clear()
    _SETTLED[key] = settled
    return settled, None


def _finisher(shape, back, out):
    """finish(flat result) for an all-reduce into a new array, or through the host copy of a
    GPU array: x's shape, on x's device, copied into ``out`` when given."""
    back = back or _same

    def finish(flat):
        y = back(flat.reshape(shape))
        if out is None:
            return y
        out[...] = y
        return out
    return finish


def _same(y):
    return y


# ---------------------------------------------------------------------------------------
# Python objects: pickled, their sizes agreed, then moved as uint8 arrays
# ---------------------------------------------------------------------------------------


def gather_objects(comm, obj, root=0) -> list | None:
    """Every rank's picklable ``obj`` on ``root``: a list of p objects in rank order there,
    None on the other ranks (as ``torch.distributed.gather_object`` and mpi4py's ``gather``).

    Two rounds with the collectives' deadline: :func:`minidist.p2p.agree` shares the pickles'
    sizes, then :func:`gather` moves them as uint8 arrays padded to the longest (so the
    cost is that of p blocks of the largest pickle). Raises CollectiveError (on every rank)
    for a bad root, CollectiveTimeout naming a rank that does not take part within the
    deadline. Only unpickle what your own ranks sent (pickle runs code)."""
    problem = _check_root(root, comm)
    blob = _pickled(obj) if problem is None else numpy.zeros(0, numpy.uint8)
    sizes = agree(comm, f"gather_objects: {problem}" if problem else None, blob.size)
    padded = numpy.zeros(max(sizes), numpy.uint8)
    padded[:blob.size] = blob
    stacked = gather(comm, padded, root=root)
    if comm.Get_rank() != root:
        return None
    return [pickle.loads(stacked[r, :n].tobytes()) for r, n in enumerate(sizes)]  # our own ranks


def scatter_objects(comm, objs, root=0, problem=None, info=None, error=CollectiveError):
    """``objs[rank]`` on each rank, with ``root``'s ``info`` on every rank: returns ``(obj, info)``
    (as ``torch.distributed.scatter_object_list`` and mpi4py's ``scatter``).

    objs: on root, a list of p picklable values (ignored elsewhere); None on root gives every
    rank ``(None, info)``. info: any small picklable value from root. problem: a string on
    root (e.g. "the checkpoint holds 3 parts") raised on every rank as ``error(problem)``
    (default CollectiveError) instead of scattering. Two rounds, as :func:`gather_objects`.
    Raises ``error`` on every rank when root's list does not have p items, CollectiveError
    for a bad root, CollectiveTimeout past the deadline."""
    rank, size = comm.Get_rank(), comm.Get_size()
    bad_root = _check_root(root, comm)
    if bad_root:
        agree(comm, f"scatter_objects: {bad_root}")
    blobs = None
    if rank == root and objs is not None and problem is None:
        if len(objs) != size:
            problem = f"scatter_objects: {len(objs)} objects for {size} ranks; pass one per rank"
        else:
            blobs = [_pickled(o) for o in objs]

    def raise_problem(found, _rank, _size):
        raise error(found)

    mine = (problem, (None if blobs is None else [b.size for b in blobs], info)) if rank == root else (None, None)
    sizes, info = agree(comm, *mine, raise_problem=raise_problem)[root]
    if sizes is None:
        return None, info
    stacked = numpy.zeros((size, max(sizes)), numpy.uint8)
    for r, b in enumerate(blobs or ()):
        stacked[r, :b.size] = b
    block = scatter(comm, stacked if rank == root else stacked[0], root=root)
    return pickle.loads(block[:sizes[rank]].tobytes()), info  # our own ranks


def _pickled(obj):
    return numpy.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=numpy.uint8)


# ---------------------------------------------------------------------------------------
# The algorithms (the step protocol: module docstring). They work in place on the
# C-contiguous arrays they are given, which the caller owns; inputs named ``mine`` are
# only read.
# ---------------------------------------------------------------------------------------


def run_steps(comm, steps, what):
    """Drive a step generator to the end: wait (:func:`minidist.p2p.wait_all`, with the
    deadline) for each exchange it yields, then resume it. ``what`` names the collective in a
    timeout's message. Raises what the wait raises (CollectiveTimeout past the deadline)."""
    for requests, peers, receives in steps:
        wait_all(comm, requests, peers, what, receives=receives)


# Linear broadcast: root sends the whole vector to each other rank in turn.
# Cost (p-1)(alpha + n beta): root's link carries everything, p-1 times.
def _broadcast_linear(comm, buf, root, tag):
    rank, p = comm.Get_rank(), comm.Get_size()
    if rank != root:
        _recv(comm, buf, root, tag)
        return
    for k in range(1, p):
        _send(comm, buf, (root + k) % p, tag)


def broadcast_tree_steps(comm, buf, root, tag):
    """Binomial-tree broadcast of ``buf`` (C-contiguous; root's values end on every rank), as
    steps. Ranks are numbered relative to root (vr = rank - root mod p). In round k the
    ranks that already hold the data (vr < 2^k) each send it to vr + 2^k, so the holders
    double every round: ceil(lg p) (alpha + n beta). A rank first receives from vr - (its
    lowest set bit), then forwards to vr + 2^j for each smaller power 2^j, largest first
    (MPICH's order: the farthest subtree starts earliest). Thakur et al. 2005."""
    rank, p = comm.Get_rank(), comm.Get_size()
    vr = (rank - root) % p
    mask = 1
    while mask < p:
        if vr & mask:
            yield post_recv(comm, buf, (rank - mask) % p, tag)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if vr + mask < p:
            yield post_send(comm, buf, (rank + mask) % p, tag)
        mask >>= 1


# Linear scatter: root sends block r to rank r. (p-1) alpha + (p-1)/p N beta.
def _scatter_linear(comm, x, root, tag):
    rank, p = comm.Get_rank(), comm.Get_size()
    xp = get_array_module(x)
    if rank != root:
        block = xp.empty(x.shape, x.dtype)
        _recv(comm, block, root, tag)
        return block
    blocks = _contiguous(x)
    for k in range(1, p):
        r = (root + k) % p
        _send(comm, blocks[r:r + 1], r, tag)  # a slice, never a scalar, even for 0-d blocks
    return blocks[root:root + 1].reshape(x.shape[1:]).copy()


# Linear gather: every rank sends its block to root, which posts all p-1 receives at
# once (Irecv) so the blocks can arrive in any order. (p-1) alpha + (p-1)/p N beta.
def _gather_linear(comm, x, root, tag):
    rank, p = comm.Get_rank(), comm.Get_size()
    if rank != root:
        _send(comm, _contiguous(x), root, tag)
        return None
    out = get_array_module(x).empty((p,) + x.shape, x.dtype)
    out[root] = x
    sources = [r for r in range(p) if r != root]
    wait_all(comm, [comm.Irecv(out[r:r + 1], source=r, tag=tag) for r in sources], sources, _TAG_NAMES[tag],
             receives=len(sources))
    return out


def ring_all_gather_steps(comm, flat, bounds, tag):
    """Ring all-gather on a flat vector cut into p chunks, as steps: ``bounds[i]`` = (start,
    stop) of chunk i (:func:`chunk_bounds`); rank r starts with chunk r of ``flat`` filled in
    and ends with all of it. The ranks form a ring r -> r+1. In step s (s = 0 .. p-2) rank r
    passes on the chunk it received in the step before -- at first its own chunk r, then
    chunk r-1, ... -- and receives chunk r-s-1 from its left neighbour. Each rank sends every
    chunk but one: (p-1) alpha + (p-1)/p n beta, and every link is busy in every step.
    Thakur et al. 2005; Patarasuk & Yuan 2009."""
    rank, p = comm.Get_rank(), comm.Get_size()
    right, left = (rank + 1) % p, (rank - 1) % p
    for s in range(p - 1):
        send_start, send_stop = bounds[(rank - s) % p]
        recv_start, recv_stop = bounds[(rank - s - 1) % p]
        yield post_exchange(comm, flat[send_start:send_stop], right, flat[recv_start:recv_stop], left, tag)


# Pairwise exchange, the all-to-all for long messages in MPICH (Thakur et al. 2005, Sec. 3;
# src/mpi/coll/alltoall/alltoall_intra_pairwise.c). Rank r keeps its own block; in step
# s = 1 .. p-1 it sends block r+s to rank r+s and receives block r-s from rank r-s (mod p),
# one Irecv and one Isend posted together. Every rank's partner to send to in step s is
# receiving from it in that same step, so every send meets its receive within the step, even
# when each send waits for its receive (the sim's strict mode); each link carries one block
# per step. p-1 messages of n/p per rank: (p-1) alpha + (p-1)/p n beta, n = one rank's input.
# No algorithm sends less (every byte but one's own block must leave), but the p-1
# latencies grow with p: MPICH uses Bruck's lg p rounds for short messages. For p a power of
# two MPICH pairs ranks by r XOR s (each step a swap); the shift works for every p.
def all_to_all_steps(comm, send, receive, tag):
    """The pairwise-exchange all-to-all, as steps: ``send[j]`` (C-contiguous) goes to rank j
    and ``receive[i]`` (C-contiguous, of the size rank i sends) is filled from rank i;
    ``receive[rank]`` gets a copy of ``send[rank]``. (p-1) alpha + (p-1)/p n beta for equal
    blocks. Thakur et al. 2005; MPICH's pairwise exchange (comment above)."""
    rank, p = comm.Get_rank(), comm.Get_size()
    receive[rank][...] = send[rank]
    for s in range(1, p):
        dest, source = (rank + s) % p, (rank - s) % p
        yield post_exchange(comm, send[dest], dest, receive[source], source, tag)


# Ring all-reduce (Patarasuk & Yuan 2009): a ring reduce-scatter leaves chunk r of the
# result on rank r, then a ring all-gather hands every chunk to every rank. Each rank sends
# 2(p-1) messages of n/p: 2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma. Patarasuk &
# Yuan prove that no all-reduce can have every rank send less than 2(p-1)/p n, whatever p:
# the bandwidth term is optimal, and it does not grow with p. The price is 2(p-1)
# latencies, against lg p for recursive doubling, so short vectors prefer the latter.
def _all_reduce_ring_steps(comm, mine, out, ufunc, tag):
    bounds = _bounds(mine.size, comm.Get_size())
    yield from ring_reduce_scatter_steps(comm, mine, out, bounds, ufunc, tag)
    yield from ring_all_gather_steps(comm, out, bounds, tag)


def ring_reduce_scatter_steps(comm, mine, out, bounds, ufunc, tag):
    """Ring reduce-scatter, as steps: chunk r (``bounds[r]``) of ``out`` ends holding the
    reduction of every rank's chunk r of ``mine`` (only read). The mirror image of the ring
    all-gather, adding as it goes: chunk c starts at rank c+1 (its own, unreduced values),
    travels right one rank per step, and each rank it visits combines it with its own part,
    the partial from the left first, so chunk c is reduced in the order
    (((x[c+1] + x[c+2]) + x[c+3]) + ...) + x[c] (rank indices mod p), and ends complete at
    rank c after p-1 steps. In step s rank r sends chunk r-s-1 and receives chunk r-s-2.
    Every rank sends and reduces (p-1)/p of the vector: (p-1) alpha + (p-1)/p n (beta +
    gamma). Uneven chunks need no padding: each message has its chunk's length (as
    baidu-allreduce does). The incoming partial is received into ``out`` and combined there,
    so no copy of the input and no scratch buffer is needed; chunk r-1 of ``out`` is left
    unwritten (it was sent straight from ``mine``). Patarasuk & Yuan 2009."""
    rank, p = comm.Get_rank(), comm.Get_size()
    if p == 1:
        out[...] = mine
        return
    right, left = (rank + 1) % p, (rank - 1) % p
    for s in range(p - 1):
        send_start, send_stop = bounds[(rank - s - 1) % p]
        recv_start, recv_stop = bounds[(rank - s - 2) % p]
        outgoing = (mine if s == 0 else out)[send_start:send_stop]
        incoming = out[recv_start:recv_stop]
        yield post_exchange(comm, outgoing, right, incoming, left, tag)
        ufunc(incoming, mine[recv_start:recv_stop], out=incoming)


def reduce_tree_steps(comm, acc, root, ufunc, tag):
    """Binomial-tree reduce of ``acc`` (flat, C-contiguous, this rank's values; overwritten
    with partial sums) to ``root``, as steps: the broadcast tree run backwards. With vr =
    rank - root mod p, in round k (mask = 2^k) a rank whose bit k is set sends its partial
    result -- which covers relative ranks [vr, vr + 2^k) -- to vr - 2^k and is done; a rank
    with bit k clear adds what vr + 2^k sends (lower ranks' partial first). ceil(lg p)
    (alpha + n beta + n gamma). Only root's ``acc`` ends holding the reduction.
    Thakur et al. 2005."""
    rank, p = comm.Get_rank(), comm.Get_size()
    vr = (rank - root) % p
    scratch = None
    mask = 1
    while mask < p:
        if vr & mask:
            yield post_send(comm, acc, (rank - mask) % p, tag)
            return
        if vr + mask < p:
            if scratch is None:
                scratch = get_array_module(acc).empty_like(acc)
            yield post_recv(comm, scratch, (rank + mask) % p, tag)
            ufunc(acc, scratch, out=acc)
        mask <<= 1


# Recursive doubling. With p a power of two: in step k every rank swaps its whole vector
# with the partner whose rank differs in bit k, and both combine; after lg p steps every
# rank holds the full reduction: lg p (alpha + n beta + n gamma) -- few latencies, so good
# for short vectors, but the whole vector crosses every link lg p times.
# Any p (MPICH's fold, Thakur et al. 2005 Sec. 4): let q be the largest power of two <= p
# and rem = p - q. Among the first 2*rem ranks, each even rank hands its vector to the odd
# rank above it and sits out; the q remaining ranks (new ranks 0..q-1) do recursive
# doubling; then each odd rank hands the result back: 2 (alpha + n beta) + n gamma more.
# Both partners compute op(lower rank's vector, higher rank's), so their bytes agree.
# The first message a rank receives lands in ``out`` and is combined there with ``mine``:
# no copy of the input, and a scratch buffer only from the second exchange on.
def _all_reduce_recursive_doubling_steps(comm, mine, out, ufunc, tag):
    rank, p = comm.Get_rank(), comm.Get_size()
    if p == 1:
        out[...] = mine
        return
    q = 1 << (p.bit_length() - 1)
    rem = p - q
    acc, new_rank = mine, rank - rem  # acc: what this rank holds so far (its input until the first combine)
    if rank < 2 * rem:
        new_rank = -1 if rank % 2 == 0 else rank // 2
        if rank % 2 == 0:
            yield post_send(comm, mine, rank + 1, tag)
        else:
            yield post_recv(comm, out, rank - 1, tag)
            acc = ufunc(out, mine, out=out)
    scratch, mask = None, 1
    while new_rank >= 0 and mask < q:
        new_partner = new_rank ^ mask
        partner = 2 * new_partner + 1 if new_partner < rem else new_partner + rem
        if acc is mine:
            incoming = out
        else:
            if scratch is None:
                scratch = get_array_module(out).empty_like(out)
            incoming = scratch
        yield post_exchange(comm, acc, partner, incoming, partner, tag)
        acc = ufunc(incoming, acc, out=out) if partner < rank else ufunc(acc, incoming, out=out)
        mask <<= 1
    if rank < 2 * rem:
        yield post_send(comm, out, rank - 1, tag) if rank % 2 == 1 else post_recv(comm, out, rank + 1, tag)


# Naive all-reduce, the parameter-server pattern: every rank sends its whole vector to
# rank 0, which reduces them in rank order ((x0 + x1) + x2) + ... and sends the result to
# every rank. Rank 0's link carries 2(p-1) n bytes:
# 2(p-1) alpha + 2(p-1) n beta + (p-1) n gamma -- the bottleneck the ring removes.
def _all_reduce_naive_steps(comm, mine, out, ufunc, tag):
    rank, p = comm.Get_rank(), comm.Get_size()
    if rank != 0:
        yield post_send(comm, mine, 0, tag)
        yield post_recv(comm, out, 0, tag)
        return
    out[...] = mine
    scratch = get_array_module(out).empty_like(out) if p > 1 else None
    for r in range(1, p):
        yield post_recv(comm, scratch, r, tag)
        ufunc(out, scratch, out=out)
    for r in range(1, p):
        yield post_send(comm, out, r, tag)


def all_reduce_steps(comm, algorithm, mine, result, ufunc, tag):
    """The steps of one all-reduce (a generator of exchanges: the step protocol, module
    docstring). ``algorithm``: one of ALL_REDUCE_ALGORITHMS; ``mine``: this rank's flat input
    (only read, and it must not change until the steps end); ``result``: the flat output
    buffer of the same size and dtype, not overlapping ``mine`` (its values are ignored);
    ``ufunc(a, b, out=)``: the reduction; ``tag``: the messages' tag. Drive it with
    :func:`run_steps` (the blocking :func:`all_reduce` does) or
    ``minidist.async_collectives.start``. Raises CollectiveError for an unknown algorithm.
    Sources as :func:`all_reduce`."""
    steps = _ALL_REDUCE_STEPS.get(algorithm)
    if steps is None:
        raise CollectiveError(f"all_reduce_steps: unknown algorithm {algorithm!r}; choose one of "
                              f"{', '.join(_ALL_REDUCE_NAMES)}")
    return steps(comm, mine, result, ufunc, tag)


# Binomial-tree reduce to rank 0, then binomial-tree broadcast from it.
def _all_reduce_tree_steps(comm, mine, out, ufunc, tag):
    out[...] = mine
    yield from reduce_tree_steps(comm, out, 0, ufunc, tag)
    yield from broadcast_tree_steps(comm, out, 0, tag)


# Hierarchical all-reduce (Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE, in this form since
# uber/horovod pull request #411, 2018: NCCL reduce-scatter, MPI all-reduces across the nodes,
# NCCL all-gather; the idea in P. Goyal et al., arXiv:1706.02677, 2017, section 4), on N nodes of
# l ranks (minidist.node_layout):
#   1. ring reduce-scatter inside the node: this rank ends with chunk "local rank" (1/l of the
#      vector) summed over its node:               (l-1) (a_intra + n/l b_intra)
#   2. all-reduce of that chunk with the ranks holding the same chunk on the other nodes (the
#      column): ring, or recursive doubling for short chunks (MPI's Allreduce, which Horovod
#      calls here, also switches): ring    2(N-1) (a_inter + n/(lN) b_inter)
#   3. ring all-gather inside the node:            (l-1) (a_intra + n/l b_intra)
# Each rank sends only 2(N-1)/(lN) n across the network, l times less than a flat ring, and
# the l columns run at once (on l network cards, or taking turns on a shared one: then the
# bytes through the card are the flat ring's, and only the alphas drop). The 2-D torus
# (H. Mikami et al., arXiv:1811.05233, 2018) is the same with a ring in every phase (rows =
# nodes, columns = local ranks). Chunks are numpy.array_split's of the flat vector, so any n
# works (0 too); every node must hold l ranks. The order of additions is the ring's inside a
# node, then the column's: another order than a flat algorithm's, so floats agree to rounding.
def _all_reduce_two_level_steps(comm, mine, out, ufunc, tag, torus):
    layout = node_layout(comm)
    node, cross = layout.node_comm, layout.cross_comm
    bounds = _bounds(mine.size, layout.ranks_per_node)
    yield from _as_parent(ring_reduce_scatter_steps(node, mine, out, bounds, ufunc, tag), layout.node_ranks)
    start, stop = bounds[node.Get_rank()]
    if layout.num_nodes > 1:
        chunk = out[start:stop]
        partial = chunk.copy()  # the cross-node steps read their input while they fill chunk
        shared = layout.inter is not None and getattr(getattr(comm, "cluster_topology", None), "nic", None) == "shared"
        algorithm = "ring" if torus else choose_cross_all_reduce(partial.nbytes, layout.num_nodes, layout.inter,
                                                                 layout.ranks_per_node if shared else 1)
        yield from _as_parent(all_reduce_steps(cross, algorithm, partial, chunk, ufunc, tag), layout.cross_ranks)
    yield from _as_parent(ring_all_gather_steps(node, out, bounds, tag), layout.node_ranks)


def _as_parent(steps, ranks):
    """A sub-communicator's steps, with their peers named by rank in the parent communicator
    (``ranks[sub_rank]``), so a timeout names the ranks the caller knows."""
    for requests, peers, receives in steps:
        yield requests, [ranks[p] for p in peers], receives


def _all_reduce_hierarchical_steps(comm, mine, out, ufunc, tag):
    return _all_reduce_two_level_steps(comm, mine, out, ufunc, tag, torus=False)


def _all_reduce_torus_steps(comm, mine, out, ufunc, tag):
    return _all_reduce_two_level_steps(comm, mine, out, ufunc, tag, torus=True)


# The multi-ring all-reduce: what NCCL runs on nodes with a network card per GPU. NCCL's
# rings are flat, over every rank (NVIDIA/nccl issue #530), and it runs several at once
# ("channels", each on its share of the data: issue #299; enough of them to use every card,
# nccl-tests issue #277); each ring enters and leaves a node through the same card, so that
# traffic stays on one network rail unless NCCL_CROSS_NIC allows otherwise
# (src/graph/search.cc: "NET n -> GPU a -> ... -> GPU x -> NET n"; issue #1933). Here, on N
# nodes of l ranks (P = N l): l rings, each a ring all-reduce ("ring" above) of its own 1/l
# of the vector over all P ranks. Ring k visits the nodes in order and, inside each, the local
# ranks k+1, k+2, ..., k (mod l), then leaves from local rank k for local rank k+1 of the next
# node: ring k crosses the network only from local rank k, on that rank's card, and every
# card carries one ring. In every ring the next rank after local rank i is local rank i+1,
# on the same node except in ring i, so in each of the 2(P-1) steps a rank sends its l-1
# staying chunks as one message inside the node and ring i's chunk as one message across,
# both at once (with c = n/(lP)):
#     2(P-1) max(a_intra + (l-1) c b_intra, a_inter + c b_inter)       (a card per rank)
# Each card carries 2(P-1)/P n/l; hierarchical's carry 2(N-1)/N n/l: the same l-fold cut
# against one flat ring, and only the factor ((P-1)/P) / ((N-1)/N) between them. What the
# rings pay is 2(P-1) network latencies (hierarchical: 2(N-1) or lg N); what they gain is
# that NVLink and the network work at once, where hierarchical's phases take turns. On a
# shared card (nic="shared") the l rings' crossings take turns: costmodel.two_tier_terms.
# One node: one ring, every chunk in one message; one rank per node: the flat ring.
def _all_reduce_multi_ring_steps(comm, mine, out, ufunc, tag):
    layout = node_layout(comm)
    grid, l, nodes, p = rank_grid(layout), layout.ranks_per_node, layout.num_nodes, comm.Get_size()
    if p == 1:
        out[...] = mine
        return
    node = layout.nodes[comm.Get_rank()]
    local = grid[node].index(comm.Get_rank())
    pieces = _bounds(mine.size, l)  # ring k all-reduces piece k, cut into p chunks
    chunks = [[(a + start, a + stop) for start, stop in _bounds(b - a, p)] for a, b in pieces]
    place = [node * l + (local - k - 1) % l for k in range(l)]  # this rank's place in ring k
    sends, receives = {}, {}  # peer -> the rings whose chunk goes to (comes from) it
    for k in range(l):
        right = grid[(node + 1) % nodes][(local + 1) % l] if k == local else grid[node][(local + 1) % l]
        left = grid[(node - 1) % nodes][(local - 1) % l] if k == (local - 1) % l else grid[node][(local - 1) % l]
        sends.setdefault(right, []).append(k)
        receives.setdefault(left, []).append(k)
    xp = get_array_module(out)
    for reducing in (True, False):
        for s in range(p - 1):
            shift = s + 1 if reducing else s  # the ring's chunk index this rank sends: place - shift
            source = mine if reducing and s == 0 else out
            outgoing = {peer: xp.concatenate([source[slice(*chunks[k][(place[k] - shift) % p])] for k in rings])
                        for peer, rings in sends.items()}
            incoming = {peer: xp.empty(sum(b - a for a, b in (chunks[k][(place[k] - shift - 1) % p] for k in rings)),
                                       out.dtype) for peer, rings in receives.items()}
            posted = [post_recv(comm, buf, peer, tag) for peer, buf in incoming.items()]
            posted += [post_send(comm, buf, peer, tag) for peer, buf in outgoing.items()]
            yield [r for e in posted for r in e[0]], [q for e in posted for q in e[1]], len(incoming)
            for peer, rings in receives.items():
                offset = 0
                for k in rings:
                    a, b = chunks[k][(place[k] - shift - 1) % p]
                    part = incoming[peer][offset:offset + b - a]
                    offset += b - a
                    if reducing:
                        ufunc(part, mine[a:b], out=out[a:b])
                    else:
                        out[a:b] = part


_ALL_REDUCE_STEPS = {"ring": _all_reduce_ring_steps, "recursive_doubling": _all_reduce_recursive_doubling_steps,
                     "tree": _all_reduce_tree_steps, "naive": _all_reduce_naive_steps,
                     "hierarchical": _all_reduce_hierarchical_steps, "torus": _all_reduce_torus_steps,
                     "multi_ring": _all_reduce_multi_ring_steps}


# ---------------------------------------------------------------------------------------
# Plumbing: single messages, agreement, input checks, chunking
# ---------------------------------------------------------------------------------------


def _send(comm, buf, dest, tag):
    requests, peers, _ = post_send(comm, buf, dest, tag)
    wait_all(comm, requests, peers, _TAG_NAMES[tag])


def _recv(comm, buf, source, tag):
    requests, peers, _ = post_recv(comm, buf, source, tag)
    wait_all(comm, requests, peers, _TAG_NAMES[tag], receives=1)


def _agree(comm, name, shape, dtype, problem, validate, settings, fingerprint=None, carry=None):
    """Check that every rank called ``name`` with the same shape, dtype and settings (a tuple
    of (name, value) pairs) and that no rank found a problem with its arguments; raise the
    same CollectiveError on every rank otherwise. Skipped when p == 1 or validate=False
    (then only the local problem is raised). The round's payload is a 64-bit fingerprint of
    the arguments (``fingerprint``, computed when None). On an MPI communicator it is first a
    32-byte header (:func:`minidist.agreement_header.header_round`; ``carry``: the vector the
    header may carry); otherwise, or when the headers differ, one :func:`minidist.p2p.agree`
    round, and only when the fingerprints differ does a second round share the arguments
    themselves, to say which differ. Returns the other rank's carried vector when the header
    round agreed with one, else None."""
    if validate not in VALIDATE:
        problem = problem or f"validate must be True or False, got {validate!r}"
    if not validate or comm.Get_size() == 1:
        if problem:
            raise CollectiveError(f"{name}: {problem}")
        return None
    if problem is None and fingerprint is None:
        fingerprint = _fingerprint(name, shape, dtype, settings)
    if takes_header(comm):
        agreed, incoming = header_round(comm, fingerprint, problem, name, carry)
        if agreed:
            return incoming
        # every rank saw a header differ from its own: all of them say why, in the pickled round
    prints = agree(comm, f"{name}: {problem}" if problem else None, fingerprint, what=name)
    if any(their != fingerprint for their in prints):  # every rank sees the same prints: all go on
        # dtype.str ("<f8") is cheap to make and to pickle; it is spelled out only in an error
        _check_headers(name, agree(comm, None, (name, tuple(shape), dtype.str, settings), what=name))
    return None  # the arguments agree (headers that differed only in what they carried): the steps run


def _fingerprint(name, shape, dtype, settings):
    """A 64-bit digest of a collective's arguments, the same in every process (BLAKE2b of
    their repr; Python's hash() of a string differs from process to process), remembered."""
    key = (name, shape, dtype, settings)
    found = _FINGERPRINTS.get(key)
    if found is None:
        text = repr((name, tuple(shape), numpy.dtype(dtype).str, settings)).encode()
        found = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")
        if len(_FINGERPRINTS) >= _REMEMBERED:
            _FINGERPRINTS.clear()
        _FINGERPRINTS[key] = found
    return found


_FINGERPRINTS = {}  # (name, shape, dtype, settings) -> fingerprint
_REMEMBERED = 4096  # entries each cache keeps at most (then it starts again)


def _check_headers(name, headers):
    """Raise CollectiveError listing every rank's value of the first field the ranks disagree on."""
    shape = _SHAPE_NAMES.get(name, "shape")
    for field, what in ((0, "collective"), (1, shape), (2, "dtype"), (3, "arguments")):
        values = [h[field] for h in headers]
        if any(v != values[0] for v in values):
            listing = "; ".join(f"rank {r}: {_show(v, what)}" for r, v in enumerate(values))
            raise CollectiveError(f"{name}: the ranks disagree on the {what} "
                                  f"(every rank must pass the same): {listing}")


_SHAPE_NAMES = {"all_to_all_v": "blocks' shape[1:]"}  # collective -> what its "shape" is, in errors


def _show(value, what):
    if what == "dtype":
        return numpy.dtype(value).name  # metadata, not data: numpy is fine here
    if what == "arguments":
        return ", ".join(f"{k}={v!r}" for k, v in value)
    return str(value)


def _check_root(root, comm):
    p = comm.Get_size()
    if isinstance(root, (bool, numpy.bool_)):
        return f"root must be a rank in 0..{p - 1}, got {root!r} (a bool is not a rank)"
    try:
        if 0 <= operator.index(root) < p:
            return None
    except TypeError:
        pass
    return f"root must be a rank in 0..{p - 1}, got {root!r}"


def _check_out(out, x):
    """Why ``out`` cannot receive the all-reduce of ``x`` (None when it can)."""
    if out is None:
        return None
    if (type(out) is numpy.ndarray and type(x) is numpy.ndarray and out.shape == x.shape and out.dtype == x.dtype
            and out.flags.c_contiguous and out.flags.writeable and out.base is None and x.base is None
            and out is not x):
        return None  # the usual case, quickly: two arrays that own their memory cannot overlap
    if not hasattr(out, "shape") or out.shape != x.shape or out.dtype != x.dtype:
        return (f"out must be an array of x's shape {x.shape} and dtype {x.dtype}, got "
                f"{getattr(out, 'shape', type(out).__name__)} {getattr(out, 'dtype', '')}".rstrip())
    if device_of(out) != device_of(x) or not out.flags.c_contiguous:
        return "out must be C-contiguous and on x's device"
    if not out.flags.writeable:
        return "out must be writable (it is read-only: out.flags.writeable is False); pass a writable array"
    if get_array_module(x).may_share_memory(out, x):
        return "out must not overlap x (an in-place all-reduce is not supported; pass a separate buffer)"
    return None


def _check_name(value, choices, what):
    if isinstance(value, str) and value in choices:
        return None
    return f"unknown {what} {value!r}; choose one of {', '.join(repr(c) for c in choices)}"


def _input(x):
    """(x as an array, None) or (an array standing in for x, why x cannot be communicated):
    a Tensor, or a dtype MPI cannot send or numpy cannot reduce (module docstring). The
    problem goes through the agreement round, so every rank raises the same error."""
    if isinstance(x, Tensor):
        return _as_array(x.data), ("x is a minidist Tensor; the collectives take raw arrays: pass tensor.data "
                                   "(and wrap the result in a Tensor if you need one)")
    x = _as_array(x)
    dtype = x.dtype
    if dtype.kind not in "biufc":
        return x, (f"x has dtype {dtype} ({dtype.str!r}), which the collectives cannot send: they move bool, "
                   "integer, float or complex numbers (for Python objects use comm.allgather)")
    if not dtype.isnative:
        return x, (f"x has non-native byte order (dtype {dtype.str!r}), which MPI cannot send: pass "
                   "x.astype(x.dtype.newbyteorder('='))")
    return x, None


def _as_array(x):
    return get_array_module(x).asarray(x)


def _flat(x):
    """x as a flat C-contiguous array: itself when it already is one (reshape costs half a
    microsecond, which a 4-byte all-reduce notices), else a view or a copy."""
    if x.ndim == 1 and x.flags.c_contiguous:
        return x
    return _contiguous(x).reshape(-1)


def _contiguous(x):
    return x if x.flags.c_contiguous else get_array_module(x).array(x, order="C")


def _ufunc(op, like):
    return getattr(get_array_module(like), OPS[op])


def chunk_bounds(n, p):
    """(start, stop) of the p contiguous chunks of ``numpy.array_split(range(n), p)``: the
    first n % p chunks have one element more. Returns a new list of p tuples. The ring
    collectives cut vectors this way; data-parallel evaluation and the parameter servers'
    shards use it too. Raises ValueError for n < 0 or p < 1."""
    return list(_bounds(n, p))


@functools.lru_cache(maxsize=1024)
def _bounds(n, p):
    """chunk_bounds as a tuple, remembered (the collectives ask at every call)."""
    if n < 0 or p < 1:
        raise ValueError(f"chunk_bounds needs n >= 0 and p >= 1, got n={n}, p={p}")
    base, extra = divmod(n, p)
    bounds, start = [], 0
    for i in range(p):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return tuple(bounds)
