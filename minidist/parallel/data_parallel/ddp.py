"""Data parallelism: one replica of the model per rank, gradients averaged after backward.

Synchronous data-parallel SGD. Every rank holds the same parameters and reads a different
slice of the global batch (``data.DistributedSampler``). After the backward pass each rank
holds the gradient of the mean loss over *its* b samples; the gradient of the mean loss over
all P·b samples is the average of those P gradients, so one all-reduce (sum) followed by a
division by P gives every rank the gradient a single process would have computed on the
whole global batch. Every rank then applies the same optimizer step to the same parameters
and the replicas stay identical, step after step. That is why the tests can demand that P
ranks with batch b end with the same parameters as one process with batch P·b.

What :class:`DistributedDataParallel` adds on top of "all-reduce every gradient", following
PyTorch's ``DistributedDataParallel`` (S. Li et al., "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", VLDB 2020):

- **The same start.** Construction broadcasts rank 0's parameters, so replicas that were
  initialised differently (another seed, another process) begin identical.
- **Buckets.** One all-reduce per parameter pays the per-message latency (alpha) once per
  tensor; one all-reduce of everything must wait for the whole backward pass. Buckets sit in
  between: parameters are grouped, in *reverse* registration order (backward produces the
  last layer's gradients first), into buckets of at most ``bucket_cap_mb`` MiB (25), the
  first one at most 1 MiB (PyTorch's ``_DEFAULT_FIRST_BUCKET_BYTES``: a small first bucket
  starts communicating early). When the last gradient of a bucket arrives (a
  post-accumulate-grad hook), the bucket is flattened into one buffer and its all-reduce is
  *started* (``async_collectives.all_reduce(..., async_op=True)``). With a ring all-reduce a
  bucket of n elements costs 2(p-1) alpha + 2(p-1)/p n beta, so k buckets cost 2k(p-1) alpha + 2(p-1)/p N beta in all:
  the bandwidth term does not depend on k, the latency term grows with it.
- **In order.** Buckets are started in index order on every rank (a bucket that completes
  early waits for the ones before it), so all ranks start the same collectives in the same
  order and a message of one bucket can never be matched with another's.
- **Overlap.** The all-reduce of a bucket runs while backward computes the gradients of
  earlier layers: each later hook advances it (``async_collectives``' state machine), and
  once backward ends (``tensor.queue_callback``, PyTorch's moment too) DDP waits for every
  bucket and hands each parameter its averaged gradient. Only the last bucket's exchange,
  and whatever of the others outlasted the backward pass, is exposed. ``overlap=False``
  waits for each bucket inside its hook instead (the lesson's comparison): the same
  messages and bytes, every one of them on the critical path.
- **Nodes.** ``algorithm="hierarchical"`` or ``"torus"`` sums each bucket inside the node,
  across the nodes on 1/l of it, and back inside (``collectives.all_reduce``'s two-level
  algorithms, on ``minidist.node_layout``'s nodes: the sim's topology, the machines, or fake
  nodes), so each rank sends l times fewer bytes across the network. Their steps run on the
  node and cross communicators, Split once at construction from DDP's counter
  (:class:`SplitCountingComm`, which counts their messages too); a bucket's messages carry its
  own tag there as on the world's (``async_collectives``), so buckets in flight never mix.
- **One rank.** With nobody to talk to the gradients are already the average: no bucket is
  copied and no message is sent; the hooks only count.
- **Accumulation.** Inside ``with ddp.no_sync():`` the hooks do nothing; gradients just add
  up locally, and the next backward outside the block averages the accumulated sum.
- **Communication hooks.** What a bucket sends is a hook's choice
  (``register_comm_hook(state, hook)``, PyTorch's name; ``minidist.parallel.data_parallel.comm_hooks``):
  the default all-reduces the fp32 sum; fp16/bf16 halve the bytes, int8 and top-k compress
  further with error feedback. Every hook is started from the gradient hook and waited for
  at the end of backward, like the default, so the overlap stays.

Timeline. ``ddp.timeline`` holds the last synced step's events (:class:`StepTimeline`):
when forward started, when backward ended, and for each bucket when its gradients were
ready and when its all-reduce finished (as seen by this rank's progress calls);
``StepTimeline.hidden_fraction()`` is the share of the exchange that ran while the training
thread computed. The progress is made by the hooks (``async_collectives``), so an exchange
hides only behind compute that has hooks after it: a bucket started just before one long
layer with no parameter hook inside it moves little until that layer ends.

Large batches. With P ranks the global batch is P times the per-rank batch; Goyal et al.,
"Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour" (2017) scale the learning rate
by the same factor (linear scaling rule) and ramp it up over the first epochs (gradual
warm-up): ``optim.scale_lr`` and ``optim.WarmupLR``, used by ``minidist.parallel.data_parallel.train.train_ddp``.

Longer than 400 lines: DistributedDataParallel is one class whose buckets, hooks, overlap,
``no_sync`` and all-reduce choice act on one shared state; the learner reads it top to bottom as
chapter 5 builds it.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass

from minidist import backend
from minidist.collectives import broadcast
from minidist.costmodel import ALL_REDUCE_ALGORITHMS, TOPOLOGY_ALL_REDUCE_ALGORITHMS
from minidist.nn import parameters_to_vector, vector_to_parameters
from minidist.node_layout import node_layout, set_ranks_per_node
from minidist.p2p import agree
from minidist.parallel.data_parallel.comm_hooks import GradBucket, allreduce_hook
from minidist.tensor import is_grad_enabled, queue_callback
from minidist.tracing import CountingComm

MIB = 1024 * 1024
FIRST_BUCKET_CAP_MB = 1  # PyTorch's dist._DEFAULT_FIRST_BUCKET_BYTES, in MiB
DDP_ALGORITHMS = ALL_REDUCE_ALGORITHMS + TOPOLOGY_ALL_REDUCE_ALGORITHMS + ("auto",)  # DDP's algorithm=


@dataclass
class DDPStats:
    """What a :class:`DistributedDataParallel` measured since construction (assign a fresh
    ``DDPStats()`` to ``ddp.stats`` to start counting again, e.g. after warm-up steps).

    synced_steps: backward passes whose gradients were averaged.
    all_reduce_calls: gradient all-reduces (one per bucket per synced step; none on one rank).
    bytes_sent / messages_sent / bytes_received: array bytes and messages this rank sent,
        and bytes it received, in those all-reduces, counted at the communicator
        (measured, not computed from a formula).
    comm_seconds: wall time the training thread spent in the gradient all-reduces (starting
        and advancing them in the hooks, waiting for them at the end of backward): the
        *exposed* communication; with ``overlap=True`` the hidden part is not in it.
    compute_seconds: wall time of forward and backward passes (all micro-batches of a step,
        from the first forward after the previous sync to the end of the last bucket),
        minus ``comm_seconds`` spent in between.
    broadcast_bytes: bytes this rank sent in the initial broadcast of the parameters.
    """

    synced_steps: int = 0
    all_reduce_calls: int = 0
    bytes_sent: int = 0
    messages_sent: int = 0
    bytes_received: int = 0
    comm_seconds: float = 0.0
    compute_seconds: float = 0.0
    broadcast_bytes: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class StepTimeline:
    """One synced step of one rank, in ``time.perf_counter()`` seconds.

    forward_start: the first forward of the step; backward_end: the end of the backward
    pass (the end-of-backward callback, before waiting); synced: every gradient averaged.
    buckets: ``(index, nbytes, ready, done)`` per bucket, in start order: ``ready`` when its
    last gradient arrived and its all-reduce started, ``done`` when this rank saw it finish.
    blocked: ``(start, end)`` intervals the training thread spent in DDP's communication calls
    (starting and advancing all-reduces in the hooks, waiting for them): the compute lane is
    [forward_start, backward_end] less these.
    """

    forward_start: float
    backward_end: float
    synced: float
    buckets: list
    blocked: list = None

    def compute_intervals(self):
        """[forward_start, backward_end] less the blocked intervals, as sorted pairs."""
        out, at = [], self.forward_start
        for start, stop in sorted(self.blocked or []):
            if start > at:
                out.append((at, min(start, self.backward_end)))
            at = max(at, stop)
        if at < self.backward_end:
            out.append((at, self.backward_end))
        return [(a, b) for a, b in out if b > a]

    def comm_intervals(self):
        """The union of the buckets' [ready, done] intervals, as sorted disjoint pairs."""
        merged = []
        for _, _, start, stop in sorted(self.buckets, key=lambda b: b[2]):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], stop)
            else:
                merged.append([start, stop])
        return [tuple(m) for m in merged]

    def hidden_fraction(self):
        """Share of the communication time (the union of the buckets' intervals) during which
        the training thread was computing (``compute_intervals``), in [0, 1]: 0 without
        overlap (backward stands still while a bucket is exchanged), 1.0 when there was no
        communication."""
        intervals = self.comm_intervals()
        total = sum(stop - start for start, stop in intervals)
        if total <= 0:
            return 1.0
        compute = self.compute_intervals()
        hidden = sum(max(0.0, min(b, d) - max(a, c)) for a, b in intervals for c, d in compute)
        return hidden / total


class Bucket:
    """A group of parameters all-reduced together as one flat buffer.

    params / names: the parameters in the bucket, in the order gradients are expected
    (reverse registration order); offsets[i]:offsets[i+1] is parameter i's slice of the
    flat buffer. numel (int), dtype (numpy dtype of every parameter in it), nbytes (int).
    """

    def __init__(self, index, params, names):
        self.index, self.params, self.names = index, params, names
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.size)
        self.numel = self.offsets[-1]
        self.dtype = params[0].dtype
        self.nbytes = self.numel * self.dtype.itemsize
        self.pending = len(params)  # gradients still to arrive in this backward pass
        self.buffer = None  # the flat gradient buffer, allocated at the first reduction and reused

    def __repr__(self):
        return f"Bucket({self.index}, {self.names}, {self.nbytes} bytes)"


def compute_bucket_assignment(params, bucket_cap_mb=25, first_bucket_cap_mb=None):
    """Group parameters into buckets, last parameter first (PyTorch's rule, Li et al. 2020).

    params: a list of Tensors in registration order. bucket_cap_mb: the largest bucket in
    MiB (a float; a parameter bigger than that gets a bucket of its own); 0 or None puts
    every parameter in its own bucket (the unbucketed baseline). first_bucket_cap_mb: the
    cap of bucket 0 only (PyTorch's DDP uses 1 MiB, ``FIRST_BUCKET_CAP_MB``); None: the same
    as the others. A new bucket also starts where the dtype or device changes, since one
    flat buffer holds one dtype.
    Returns a list of lists of indices into ``params``; bucket 0 holds the last parameters.
    Raises ValueError for a negative cap.
    """
    for name, value in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_cap_mb", first_bucket_cap_mb)):
        if value is not None and not value >= 0:
            raise ValueError(f"{name} must be >= 0 or None (one bucket per parameter), got {value!r}")
    cap = 0 if not bucket_cap_mb else bucket_cap_mb * MIB
    first_cap = cap if first_bucket_cap_mb is None or not bucket_cap_mb else first_bucket_cap_mb * MIB
    buckets, current, current_bytes, kind = [], [], 0, None
    for i in reversed(range(len(params))):
        p = params[i]
        nbytes = p.size * p.dtype.itemsize
        p_kind = (str(p.dtype), backend.device_of(p.data))
        limit = cap if buckets else first_cap
        if current and (p_kind != kind or current_bytes + nbytes > limit):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += nbytes
        kind = p_kind
    if current:
        buckets.append(current)
    return buckets


class DistributedDataParallel:
    """Wrap a module so that backward leaves every gradient averaged over the ranks
    (**contract**, used as ``torch.nn.parallel.DistributedDataParallel``).

    Args:
        module: an ``nn.Module``; the same architecture (parameter names, shapes, dtypes)
            on every rank. Its parameters are overwritten by rank 0's at construction.
        comm: a communicator with mpi4py's methods (``mpi4py.MPI.COMM_WORLD`` or a
            ``minidist.sim`` rank's comm).
        bucket_cap_mb: largest bucket in MiB (default 25, PyTorch's; the first bucket is
            at most ``FIRST_BUCKET_CAP_MB`` = 1 MiB, as PyTorch's, or ``bucket_cap_mb``
            when that is smaller, where PyTorch keeps 1 MiB); 0 or None: one
            all-reduce per parameter (for comparisons).
        algorithm: the all-reduce algorithm of ``collectives.all_reduce``, one of
            ``DDP_ALGORITHMS`` ("auto" picks by size from the cost model; "ring" is
            bandwidth-optimal; "hierarchical" and "torus" run over the ranks' nodes,
            ``minidist.node_layout``, worked out once at construction, so a layout error is
            raised there).
        overlap: True (default): start each bucket's all-reduce from its hook and wait for
            all of them when backward ends; False: wait inside each hook (no overlap).

    Use: ``out = ddp(x)`` runs the module; after ``loss.backward()`` each parameter's
    ``.grad`` (same shape and dtype as the parameter) holds the mean of the ranks'
    gradients. ``with ddp.no_sync():`` skips the averaging (gradient accumulation).
    ``ddp.register_comm_hook(state, hook)`` (before the first backward) changes what each
    bucket sends (``minidist.parallel.data_parallel.comm_hooks``: fp16, bf16, int8, top-k compression).
    ``ddp.stats`` (:class:`DDPStats`) holds bytes, calls and seconds; ``ddp.buckets`` the
    buckets; ``ddp.timeline`` the last synced step's :class:`StepTimeline` (None before).
    ``module``, ``parameters()``, ``named_parameters()``, ``state_dict()``, ``load_state_dict()``,
    ``zero_grad()``, ``train()``, ``eval()`` pass through to the module (state_dict names carry
    no ``module.`` prefix, unlike PyTorch's).

    Raises:
        TypeError: ``comm`` lacks ``Get_rank``/``Get_size``.
        ValueError (on every rank): the module has no parameters, a negative
            ``bucket_cap_mb``, an unknown ``algorithm``, or the ranks disagree on the parameters (names, shapes,
            dtypes) or on ``bucket_cap_mb``/``algorithm`` -- the message lists the ranks.
        CollectiveError (on every rank, from ``node_layout``): hierarchical or torus on nodes that
            hold different numbers of ranks.
        RuntimeError (at the next forward, as PyTorch): a synced backward left some
            parameters without a gradient (not used to compute the loss), so their buckets
            were never averaged. Use every parameter, or freeze it (``requires_grad=False``)
            before wrapping. If the ranks differ in which parameters they used, the ranks
            that did use them wait in the all-reduce until the others fail (``python -m
            mpi4py`` then aborts them all; the sim stops them).
        p2p.CollectiveTimeout: a rank stopped taking part (an exception, a
            ``sys.exit``, a crash, a hang) and another waited for it past the collectives'
            deadline (``p2p.set_timeout``, default ``p2p.DEFAULT_TIMEOUT``). DDP waits only inside the
            collectives (the agreement and broadcast at construction, the bucket all-reduces
            in backward), so every one of its waits has that deadline, and the error names
            the ranks not heard from.
    """

    def __init__(self, module, comm, bucket_cap_mb=25, algorithm="auto", overlap=True):
        if not (hasattr(comm, "Get_rank") and hasattr(comm, "Get_size")):
            raise TypeError(f"DistributedDataParallel needs a communicator (mpi4py.MPI.COMM_WORLD or a "
                            f"minidist.sim comm), got {type(comm).__name__}")
        self.module, self.comm, self.algorithm = module, comm, algorithm
        self.bucket_cap_mb, self.overlap = bucket_cap_mb, bool(overlap)
        self.rank, self.world_size = comm.Get_rank(), comm.Get_size()
        # every message of the broadcast and the gradient all-reduces goes through this
        # counter (totals only, MPI's own collectives passed through uncounted)
        self._traffic = SplitCountingComm(comm, allow_collectives=True, keep_messages=False)
        named = list(module.named_parameters())
        problem = None if named else "the module has no parameters"
        if problem is None and bucket_cap_mb is not None and not bucket_cap_mb >= 0:
            problem = f"bucket_cap_mb must be >= 0 or None, got {bucket_cap_mb!r}"
        if problem is None and algorithm not in DDP_ALGORITHMS:
            problem = f"unknown algorithm {algorithm!r}; choose one of {DDP_ALGORITHMS}"
        self._agree(named, problem)
        self._find_nodes()
        self.stats = DDPStats()
        self._broadcast_parameters([p for _, p in named])

        trained = [(name, p) for name, p in named if p.requires_grad]
        first_cap = min(FIRST_BUCKET_CAP_MB, bucket_cap_mb) if bucket_cap_mb else None
        assignment = compute_bucket_assignment([p for _, p in trained], bucket_cap_mb, first_cap)
        self.buckets = [Bucket(k, [trained[i][1] for i in idx], [trained[i][0] for i in idx])
                        for k, idx in enumerate(assignment)]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._grad_ready) for _, p in trained]
        self._sync_enabled = True
        self._ready = set()  # ids of the parameters whose gradient arrived in this backward
        self._next_bucket = 0  # the next bucket to all-reduce, in index order
        self._works = []  # (bucket, Work) started in this backward and not yet waited for
        self._ready_times = []  # (bucket index, nbytes, ready, done) of this step
        self._blocked = []  # (start, end) of this step's communication calls
        self._callback_queued = False
        self.timeline = None
        self._window_start, self._window_comm = None, 0.0
        self._comm_hook, self._comm_hook_state, self._hook_registered = allreduce_hook, None, False
        self._backward_seen = False  # register_comm_hook is refused after the first backward

    def register_comm_hook(self, state, hook):
        """Send each bucket with ``hook(state, bucket)`` instead of the default all-reduce
        (``torch.nn.parallel.DistributedDataParallel.register_comm_hook``).

        hook: a callable ``hook(state, GradBucket) -> Work``, e.g. from
        ``minidist.parallel.data_parallel.comm_hooks`` (``fp16_compress_hook``, ``bf16_compress_hook``,
        ``int8_compress_hook``, ``topk_compress_hook``); its ``wait()`` must return the averaged
        flat gradient (the bucket's dtype and size). state: what the hook keeps between calls
        (None, an ``ErrorFeedbackState``, a ``TopKState``). A collective: every rank must
        register the same hook with the same kind of state (one ``p2p.agree`` round).
        On one rank the hook is never called (the local gradient is the average).

        Raises (every rank): RuntimeError if called after the first backward or a second time
        (PyTorch's rules); TypeError if ``hook`` is not callable; ValueError if the ranks
        register different hooks or states.
        """
        problem = None
        if self._hook_registered:
            problem = "register_comm_hook can only be called once (build a new DistributedDataParallel to change it)"
        elif self._backward_seen:
            problem = ("register_comm_hook must be called before the first backward pass (the buckets of that "
                       "pass were already sent with the previous hook)")
        elif not callable(hook):
            problem = f"hook must be a callable hook(state, bucket), got {type(hook).__name__}"
        signature = (getattr(hook, "__qualname__", repr(hook)), type(state).__name__,
                     getattr(state, "ratio", None), getattr(state, "error_feedback", None))

        def raise_error(their_problem, rank, size):
            kind = TypeError if "callable" in their_problem else RuntimeError
            raise kind(f"DistributedDataParallel: {their_problem} (on rank {rank} of {size})")

        signatures = agree(self.comm, problem, signature, raise_problem=raise_error)
        for rank, theirs in enumerate(signatures):
            if theirs != signatures[0]:
                raise ValueError(f"DistributedDataParallel.register_comm_hook: the ranks register different hooks "
                                 f"(hook, state type, ratio, error_feedback): rank 0 {signatures[0]}, rank {rank} "
                                 f"{theirs}; every rank must register the same")
        self._comm_hook, self._comm_hook_state, self._hook_registered = hook, state, True

    # -------------------------------------------------------------- construction
    def _agree(self, named, problem):
        """Every rank raises the same ValueError unless all ranks have the same parameters
        and settings (one ``p2p.agree`` round: a small pickled allgather, skipped
        for a world of one)."""

        def raise_value_error(their_problem, rank, size):
            raise ValueError(f"DistributedDataParallel: {their_problem} (on rank {rank} of {size})")

        signature = [(name, tuple(p.shape), str(p.dtype), p.requires_grad) for name, p in named]
        headers = agree(self.comm, problem, (signature, self.bucket_cap_mb, self.algorithm),
                        raise_problem=raise_value_error)
        reference = headers[0]
        for rank, (their_signature, cap, algorithm) in enumerate(headers):
            if (cap, algorithm) != reference[1:]:
                raise ValueError("DistributedDataParallel: the ranks disagree on the settings (every rank must "
                                 f"pass the same): rank 0 has bucket_cap_mb={reference[1]!r}, algorithm="
                                 f"{reference[2]!r}; rank {rank} has bucket_cap_mb={cap!r}, algorithm={algorithm!r}")
            if their_signature != reference[0]:
                raise ValueError("DistributedDataParallel: the model differs across ranks (every rank must build "
                                 f"the same architecture): {_first_difference(reference[0], their_signature, rank)}")

    # The nodes of hierarchical and torus (and of "auto" on a communicator that knows its
    # topology, which may pick them): worked out now, a collective, rather than inside the first
    # bucket's hook. The counter's own layout: the algorithms run on ITS node and cross
    # communicators, Split from it, so that their messages are counted too. Fake nodes set on
    # the caller's communicator (node_layout.set_ranks_per_node) are carried over.
    def _find_nodes(self):
        topology = getattr(self.comm, "cluster_topology", None)
        if self.world_size == 1 or not (self.algorithm in TOPOLOGY_ALL_REDUCE_ALGORITHMS or (
                self.algorithm == "auto" and getattr(topology, "ranks_per_node", None) is not None)):
            return
        theirs = node_layout(self.comm)
        if theirs.source == "setting":
            set_ranks_per_node(self._traffic, theirs.ranks_per_node)
        node_layout(self._traffic)

    # Broadcast rank 0's parameters: one binomial-tree broadcast per group of parameters
    # of one dtype (flattened together, as the gradient buckets), ceil(lg p)(alpha + n beta).
    def _broadcast_parameters(self, params):
        if self.world_size == 1:
            return
        before = self._traffic.totals()[0]
        for group in compute_bucket_assignment(params, bucket_cap_mb=float("inf")):
            group_params = [params[i] for i in group]
            flat = broadcast(self._traffic, parameters_to_vector(group_params), root=0, validate=False)
            vector_to_parameters(flat, group_params)
        self.stats.broadcast_bytes += self._traffic.totals()[0] - before

    # -------------------------------------------------------------- forward
    def __call__(self, *inputs, **kwargs):
        return self.forward(*inputs, **kwargs)

    def forward(self, *inputs, **kwargs):
        """Run the wrapped module (after checking that the previous backward synced)."""
        self.verify_synced()
        if is_grad_enabled() and self._window_start is None:
            self._window_start, self._window_comm = time.perf_counter(), self.stats.comm_seconds
        return self.module(*inputs, **kwargs)

    def verify_synced(self):
        """Raise RuntimeError if the last synced backward left buckets unreduced (some
        parameters received no gradient); the message names them. Called by every forward;
        call it after the last step to check the end of a run too."""
        if not self._ready:
            return
        missing = [name for b in self.buckets[self._next_bucket:] for name, p in zip(b.names, b.params)
                   if id(p) not in self._ready]
        self._reset_iteration()
        raise RuntimeError(
            "DistributedDataParallel: the previous backward pass did not produce gradients for "
            f"{missing} on rank {self.rank}, so their buckets were never averaged (the optimizer "
            "used unsynchronised gradients). Use every parameter in the loss, or set "
            "requires_grad=False on the unused ones before wrapping the module.")

    # -------------------------------------------------------------- backward: the hooks
    def _grad_ready(self, param):
        """Post-accumulate-grad hook: ``param.grad`` is complete for this backward pass."""
        self._backward_seen = True
        if not self._sync_enabled:
            return
        bucket = self._bucket_of[id(param)]
        if id(param) in self._ready:
            raise RuntimeError("DistributedDataParallel: a parameter received two gradients in one synced "
                               "backward (backward called twice before the buckets were reduced?)")
        self._ready.add(id(param))
        bucket.pending -= 1
        if not self._callback_queued:  # once per backward: wait for the buckets when it ends
            queue_callback(self._backward_done)
            self._callback_queued = True
        if self.world_size == 1:  # the local gradient is the average: nothing to copy or send
            while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:
                now = time.perf_counter()
                self._ready_times.append((self._next_bucket, self.buckets[self._next_bucket].nbytes, now, now))
                self._next_bucket += 1
            return
        t0 = time.perf_counter()
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:
            self._start(self.buckets[self._next_bucket])
            self._next_bucket += 1
        if self._works:
            if self.overlap:
                self._works[-1][1].is_completed()  # advance every bucket in flight (no waiting)
            else:
                self._wait_all()
        t1 = time.perf_counter()
        self.stats.comm_seconds += t1 - t0
        self._blocked.append((t0, t1))

    # Flatten the bucket's gradients into its buffer (kept for the whole run) and start the
    # comm hook on it (the default: summing it over the ranks). Not nn.parameters_to_vector:
    # the gradients come back as views of the averaged buffer, no copy per parameter each step.
    def _start(self, bucket):
        xp = backend.get_array_module(bucket.params[0].data)
        if bucket.buffer is None:
            bucket.buffer = xp.empty(bucket.numel, dtype=bucket.dtype)
        flat = bucket.buffer
        for p, start, stop in zip(bucket.params, bucket.offsets, bucket.offsets[1:]):
            flat[start:stop] = p.grad.reshape(-1)
        traffic = self._traffic
        before = traffic.totals()
        grad_bucket = GradBucket(bucket.index, flat, bucket.params, bucket.offsets,
                                 bucket.index == len(self.buckets) - 1, traffic, self.algorithm)
        work = self._comm_hook(self._comm_hook_state, grad_bucket)
        work.traffic_before = before
        self._works.append((bucket, work))
        self.stats.all_reduce_calls += 1

    # Wait for every bucket started, in order; hand each parameter its slice of the average.
    def _wait_all(self):
        traffic = self._traffic
        for bucket, work in self._works:
            total = work.wait()
            if getattr(total, "shape", None) != (bucket.numel,) or total.dtype != bucket.dtype:
                self._works = []
                raise RuntimeError(f"DistributedDataParallel: the comm hook {self._comm_hook!r} returned "
                                   f"{getattr(total, 'dtype', type(total).__name__)} "
                                   f"{getattr(total, 'shape', '')} for bucket {bucket.index}; it must return the "
                                   f"averaged flat gradient, {bucket.dtype} ({bucket.numel},)")
            for p, start, stop in zip(bucket.params, bucket.offsets, bucket.offsets[1:]):
                p.grad = total[start:stop].reshape(p.shape)
            self._ready_times.append((bucket.index, bucket.nbytes, work.start_time, work.end_time))
        if self._works:  # the counter's totals at the end cover every message of these buckets
            first, now = self._works[0][1].traffic_before, traffic.totals()
            self.stats.bytes_sent += now[0] - first[0]
            self.stats.messages_sent += now[1] - first[1]
            self.stats.bytes_received += now[2] - first[2]
        self._works = []

    # End of backward (tensor.queue_callback): wait for the buckets still in flight. If a
    # bucket never started (a parameter got no gradient) the step is not finished; the next
    # forward's verify_synced raises.
    def _backward_done(self):
        self._callback_queued = False
        backward_end = t0 = time.perf_counter()
        self._wait_all()
        now = time.perf_counter()
        self.stats.comm_seconds += now - t0
        self._blocked.append((t0, now))
        if self._next_bucket == len(self.buckets):
            self.timeline = StepTimeline(self._window_start if self._window_start is not None else backward_end,
                                         backward_end, now, self._ready_times, self._blocked)
            self._finish_step()

    def _finish_step(self):
        now = time.perf_counter()
        if self._window_start is not None:
            comm = self.stats.comm_seconds - self._window_comm
            self.stats.compute_seconds += max(0.0, now - self._window_start - comm)
        self._window_start = None
        self.stats.synced_steps += 1
        self._reset_iteration()

    def _reset_iteration(self):
        for b in self.buckets:
            b.pending = len(b.params)
        self._ready.clear()
        self._next_bucket = 0
        self._ready_times, self._blocked = [], []
        self._callback_queued = False  # a backward that raised dropped its callback

    # -------------------------------------------------------------- accumulation
    @contextlib.contextmanager
    def no_sync(self):
        """Context manager: backward passes inside it only accumulate local gradients; the
        first backward after it averages the accumulated sums (gradient accumulation over
        micro-batches without communicating for each one)."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    # -------------------------------------------------------------- passthroughs
    def parameters(self):
        return self.module.parameters()

    def named_parameters(self, prefix: str = ""):
        return self.module.named_parameters(prefix)

    def state_dict(self):
        return self.module.state_dict()

    def load_state_dict(self, state):
        return self.module.load_state_dict(state)

    def zero_grad(self):
        return self.module.zero_grad()

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def __repr__(self):
        return (f"DistributedDataParallel(rank {self.rank} of {self.world_size}, {len(self.buckets)} buckets, "
                f"algorithm={self.algorithm!r})\n  (module): " + repr(self.module).replace("\n", "\n  "))


class SplitCountingComm(CountingComm):
    """``tracing.CountingComm`` whose ``Split`` returns counting sub-communicators, so that
    what the topology-aware all-reduces send on ``node_layout``'s node and cross
    communicators (Split from this one) is counted too. ``parts``: the counters Split from
    it; :meth:`totals` adds theirs to its own. Arguments and errors as CountingComm's."""

    def __init__(self, comm, **options):
        super().__init__(comm, **options)
        self.options, self.parts = options, []

    def Split(self, color=0, key=0):
        """``comm.Split`` (MPI_Comm_split), the new communicator counted as a part of this
        one (None where ``comm.Split`` gives None, for an undefined colour)."""
        sub = self.comm.Split(color, key)
        if sub is None:
            return None
        part = SplitCountingComm(sub, **self.options)
        self.parts.append(part)
        return part

    def totals(self) -> tuple[int, int, int]:
        """(bytes sent, array messages sent, bytes received) here and in every part, ints."""
        sent, messages, received = self.nbytes, self.messages, self.bytes_received
        for part in self.parts:
            more = part.totals()
            sent, messages, received = sent + more[0], messages + more[1], received + more[2]
        return sent, messages, received


def _first_difference(reference, signature, rank):
    """Describe where rank ``rank``'s parameter list first differs from rank 0's."""
    if len(reference) != len(signature):
        return f"rank 0 has {len(reference)} parameters, rank {rank} has {len(signature)}"
    for (name0, shape0, dtype0, grad0), (name, shape, dtype, grad) in zip(reference, signature):
        if (name0, shape0, dtype0, grad0) != (name, shape, dtype, grad):
            return (f"rank 0 has {name0} {shape0} {dtype0} (requires_grad={grad0}), rank {rank} has "
                    f"{name} {shape} {dtype} (requires_grad={grad})")
    return "unknown difference"

