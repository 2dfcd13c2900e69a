"""Parameter servers: workers pull parameters, compute gradients, push them back.

The architecture of DistBelief (Dean et al., "Large Scale Distributed Deep Networks",
NeurIPS 2012) and of Li et al. ("Scaling Distributed Machine Learning with the Parameter
Server", OSDI 2014): some ranks *hold* the model, the others *compute* on it.

Layout. In a world of P ranks, ranks 0..K-1 are the servers and ranks K..P-1 the
N = P - K workers (worker w is rank K + w; worker 0 is the *reporter*, which receives
the final parameters and every server's statistics at the end).

Sharding. The model's parameters (``model.parameters()``, in order) are laid end to end
as one flat vector of E elements, and server s owns the contiguous range
``collectives.chunk_bounds(E, K)[s]``: the sizes of ``numpy.array_split`` (the first E mod K
shards one element longer), so the shards differ by at most one element, whatever the layer
sizes, and every rank computes the same ranges. (Li et al. partition keys into ranges
the same way; splitting whole tensors instead would leave a 64x128 weight matrix and a
10-element bias on different servers, one of them idle.) Each server applies SGD (with
momentum and weight decay, :class:`minidist.optim.SGD`) to its own range; SGD works
element by element, so K servers updating K ranges do exactly what one optimizer does
to the whole vector.

One worker step, for worker w at clock c (the number of gradients it has pushed so far)::

    pull:  ask every server for its shard; each answers (version, shard)   -> M bytes in
    compute: forward and backward on the worker's own batch
    push:  send every server its range of the gradient                     -> M bytes out

so each server sends and receives 2 M/K bytes per worker per step, 2 N M / K per step
(2 N M at a single server, M = the parameters' bytes): the server's link is the
bottleneck that sharding divides. Control messages (a 24-byte header per request and
an 8-byte version per answer) are counted separately.

Versions and staleness. A server's *version* is the number of updates it has applied
to its shard. The *staleness* of a gradient is measured when the server applies it::

    staleness = (server version at apply time) - (version of the shard the gradient
                was computed on, i.e. the version in the worker's last pull)

and every applied gradient goes into the server's histogram (``staleness_histogram``).

Modes (what a server does with a push, and when it answers a pull):

- ``sync``: one update per clock, the average of the N gradients of that clock, applied
  once all have arrived; a pull at clock c is answered once version c exists. Staleness
  is always 0 and the result equals one process with batch N x b (tested to 1e-10).
- ``ssp`` with bound S (stale synchronous parallel; Ho et al., "More Effective Distributed
  ML via a Stale Synchronous Parallel Parameter Server", NeurIPS 2013): updates are still
  one per clock, but a pull at clock c is answered as soon as version >= c - S, so a
  worker may run up to S clocks ahead of the slowest one (it blocks in ``pull`` when it
  would be more). The gradient of clock c is applied at version c and was computed on a
  version >= c - S: staleness <= S, guaranteed. ``ssp`` with S = 0 is ``sync``. (Ho et al.
  also let a worker see newer updates early, best effort; here a clock becomes visible
  when it is complete, which keeps the bound exact and the run deterministic.)
- ``async`` (Downpour SGD in Dean et al. 2012, "Hogwild"-style): every gradient is an
  update of its own, applied on arrival with the full learning rate; pulls are answered
  at once. Nothing bounds the staleness; with N equally fast workers it is about N - 1,
  and a worker that pauses (the reporter evaluating at an epoch's end) comes back with
  gradients dozens of versions old.

Units: a version is one *clock* (N gradients averaged) in sync and ssp, one *gradient* in
async, so async's staleness divided by N compares with ssp's. In ssp the lag is sticky:
once a worker falls behind, equally fast peers stay at the bound (they never wait for it
to catch up, and it never does), so most gradients end up exactly S clocks stale. Stale
gradients and heavy-ball momentum do not mix: on a quadratic, gradients one update old
shrink momentum 0.9's largest stable step from 3.8 to 0.1 (without momentum, from 2 to 1;
Mitliagkas et al., "Asynchrony begets momentum", 2016). So at equal learning rates ssp and
async lose accuracy against sync, more as the rate grows (chapter 06 measures it on digits).

A worker that finishes early (fewer batches) sends DONE; from then on the clocks are
complete without it (the average is over the workers that pushed), so nothing waits on
it. Shutdown: each worker sends DONE after its last push; a server returns once all N
workers are done, after sending its final shard and statistics to the reporter.

Deadlock freedom. Servers never block on a send (answers go out with ``Isend``), workers
post their receives before asking, and a server waits only for the next request. Every
blocking wait polls ``Test`` with a deadline, the same on MPI and on the sim, and sleeps
between polls, so an oversubscribed core goes to a worker. When ``timeout`` seconds pass,
:class:`ParameterServerTimeout` names the rank that was missing, not the one that waited:
a server names the workers that neither finished nor wait for it (a dead or stuck worker
holds back every clock), a worker names the servers that did not answer. A worker waits
twice as long as a server, because a server may hold a pull's answer back until the
slowest worker arrives: when a worker is missing, the server, which knows which one,
speaks first. ``timeout=None`` blocks in ``Wait`` instead (on the sim, its deadlock
detection and world timeout then apply).

Use::

    from minidist import sim, nn
    from minidist.parallel.parameter_server import train_parameter_server
    results = sim.run(train_parameter_server, 4, lambda: nn.mlp([64, 32, 10], rng=0),
                      X, y, num_servers=1, mode="async", lr=0.05)
    results[0].staleness_histogram        # a server's ServerStats
    results[1].model                      # the reporter's WorkerStats: the final model

The same call runs under ``mpiexec`` with ``MPI.COMM_WORLD``; ``python -m minidist train
--strategy ps`` calls it through ``minidist.strategies.train_ps``.
"""
from __future__ import annotations

import math
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from minidist import backend, data, optim, sim
from minidist.collectives import chunk_bounds
from minidist.fault import TrainingStopped
from minidist.functions import cross_entropy
from minidist.nn import Parameter, parameters_to_vector, vector_to_parameters
from minidist.tensor import Tensor
from minidist.train import fit

MODES = ("sync", "async", "ssp")
DEFAULT_TIMEOUT = 120.0  # seconds a server waits for a peer before giving up (a worker: twice that)
WORKER_PATIENCE = 2.0  # a worker's deadline is this times timeout (module docstring)
# Point-to-point tags (distinct from minidist.collectives' 77xx tags).
TAG_REQUEST, TAG_VERSION, TAG_PARAMS, TAG_GRAD, TAG_FINAL, TAG_STATS = 7801, 7802, 7803, 7804, 7805, 7806
PULL, PUSH, DONE, CHECKPOINT = 0, 1, 2, 3  # request kinds: header = int64 [kind, clock, worker rank]
HEADER_BYTES, VERSION_BYTES = 24, 8


class ParameterServerTimeout(TimeoutError):
    """A rank waited longer than its deadline for a peer. ``missing``: the ranks it did not
    hear from (the workers or servers to look at), named in the message too."""

    def __init__(self, message, missing=()):
        super().__init__(message)
        self.missing = list(missing)


# ---------------------------------------------------------------------------------------
# Layout: who is a server, which range of the flat parameter vector each server owns
# ---------------------------------------------------------------------------------------


def check_world(world_size, num_servers, mode="sync", staleness=0):
    """Raise ValueError (naming the fix) unless K = ``num_servers`` servers and at least one
    worker fit in ``world_size`` ranks, ``mode`` is one of MODES and ``staleness`` >= 0."""
    if mode not in MODES:
        raise ValueError(f"parameter server: mode must be one of {MODES}, got {mode!r}")
    if int(num_servers) != num_servers or num_servers < 1:
        raise ValueError(f"parameter server: needs at least 1 server, got num_servers={num_servers!r}")
    if world_size < 2:
        raise ValueError("parameter server: a world of 1 rank has no room for a server and a worker; "
                         "run under mpiexec with at least 2 ranks, e.g. "
                         "mpiexec -n 4 python -m mpi4py -m minidist train --strategy ps")
    if num_servers > world_size - 1:
        raise ValueError(f"parameter server: {num_servers} servers in a world of {world_size} ranks leave no "
                         f"worker; use --num-servers <= {world_size - 1} or start >= {num_servers + 1} ranks")
    if int(staleness) != staleness or staleness < 0:
        raise ValueError(f"parameter server: staleness must be an integer >= 0, got {staleness!r}")


class FlatLayout:
    """The flat parameter vector (``nn.parameters_to_vector`` order) and the servers' shares of
    it: ``size`` (E elements), ``dtype``, ``nbytes`` (M) and ``ranges``, server s owning
    ``ranges[s] = collectives.chunk_bounds(E, K)[s]``.

    Raises ValueError when the parameters mix dtypes (the flat vector has one) or when there
    are fewer elements than servers (each server needs at least one)."""

    def __init__(self, params, num_servers):
        dtypes = {np.dtype(p.dtype) for p in params}
        if len(dtypes) != 1:
            raise ValueError("parameter server: all parameters need one dtype to be sharded, "
                             f"got {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop()
        self.size = int(sum(p.size for p in params))
        if self.size < num_servers:
            raise ValueError(f"parameter server: cannot shard {self.size} parameters over {num_servers} servers "
                             "(each needs at least one); use fewer servers")
        self.ranges = chunk_bounds(self.size, num_servers)

    @property
    def nbytes(self):
        """M: the bytes of all parameters."""
        return self.size * self.dtype.itemsize


def _host_vector(arrays):
    """The arrays (parameters or gradients, numpy or cupy) laid end to end in one NumPy
    vector: messages travel from host memory."""
    return backend.to_numpy(parameters_to_vector(arrays))


def _any_source():
    """MPI's "any source" for a receive. When mpi4py is loaded, its own value (MPICH and Open
    MPI differ); the sim takes any negative source as "any", so this works for both."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi.ANY_SOURCE if mpi is not None else sim.ANY_SOURCE


def _ranks(ranks):
    ranks = sorted(ranks)
    return f"rank{'s' * (len(ranks) != 1)} {', '.join(map(str, ranks))}"


def _wait_all(requests, timeout, blame):
    """Complete every request (mpi4py's or the sim's, the same code for both).

    timeout None: block in ``Wait``. Else poll ``Test`` with sleeps of 10 us doubling to 1 ms
    and, once ``timeout`` seconds pass, raise ``ParameterServerTimeout(*blame(pending))``:
    ``blame`` gets the indices of the requests still pending and returns (message, missing
    ranks), so the error names who was not heard from."""
    if timeout is None:
        for r in requests:
            r.Wait()
        return
    deadline, pause = time.monotonic() + timeout, 1e-5
    pending = list(range(len(requests)))
    while True:
        pending = [i for i in pending if not requests[i].Test()]
        if not pending:
            return
        if time.monotonic() > deadline:
            message, missing = blame(pending)
            raise ParameterServerTimeout(f"{message} (waited {timeout:g} s; raise timeout= for slow steps)",
                                         missing)
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)


# ---------------------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------------------


@dataclass
class ServerStats:
    """What server ``server`` (rank ``rank``) measured. ``start:stop`` is its range of the
    flat vector; ``version`` the updates applied; ``gradients`` the pushes received;
    ``staleness_histogram`` {staleness: count} over every applied gradient; payload
    ``bytes_received`` (gradients) and ``bytes_sent`` (parameters answered to pulls);
    ``control_bytes`` (headers and versions); ``shard`` the final values (numpy, 1-D; None
    in the copy sent to the reporter)."""

    rank: int
    server: int
    start: int
    stop: int
    mode: str
    staleness_bound: int | None
    num_workers: int
    version: int = 0
    gradients: int = 0
    staleness_histogram: dict = field(default_factory=dict)
    bytes_received: int = 0
    bytes_sent: int = 0
    control_bytes: int = 0
    shard: np.ndarray | None = None

    @property
    def steps(self):
        """Worker steps served: gradients received / N (one push and one pull per worker)."""
        return self.gradients / self.num_workers

    @property
    def bytes_per_step(self):
        """Payload bytes received + sent per step: 2 N (stop - start) itemsize."""
        return (self.bytes_received + self.bytes_sent) / self.steps if self.gradients else 0.0

    @property
    def max_staleness(self):
        return max(self.staleness_histogram, default=0)


class ParameterServer:
    """Server rank ``comm.Get_rank()`` (< ``num_servers``): owns its range of the flat
    parameters, initialised from ``model`` (build the same model on every rank: pass a
    seed), and runs ``serve()`` until every worker is done.

    Args: ``mode`` in MODES; ``staleness`` S for ``ssp`` (ignored otherwise); ``lr``,
    ``momentum``, ``weight_decay`` for :class:`minidist.optim.SGD`; ``warmup_updates``: ramp the
    lr linearly over this many updates (:class:`minidist.optim.WarmupLR`); ``timeout``:
    seconds to wait for the next request (None: forever). Raises ValueError for a bad layout
    or mode; ParameterServerTimeout naming the workers it did not hear from.
    """

    def __init__(self, comm, model, *, num_servers=1, mode="sync", staleness=0, lr=0.05, momentum=0.0,
                 weight_decay=0.0, warmup_updates=0, timeout=DEFAULT_TIMEOUT):
        size, rank = comm.Get_size(), comm.Get_rank()
        check_world(size, num_servers, mode, staleness)
        if rank >= num_servers:
            raise ValueError(f"rank {rank} is a worker (servers are ranks 0..{num_servers - 1}); use Worker")
        params = model.parameters()
        self.layout = FlatLayout(params, num_servers)
        start, stop = self.layout.ranges[rank]
        self.shard = Parameter(_host_vector(params)[start:stop].copy())
        self.optimizer = optim.SGD([self.shard], lr=lr, momentum=momentum, weight_decay=weight_decay)
        self.warmup = optim.WarmupLR(self.optimizer, warmup_updates) if warmup_updates else None
        self.comm, self.mode, self.timeout = comm, mode, timeout
        self.bound = {"sync": 0, "ssp": int(staleness), "async": None}[mode]  # None: unbounded
        self.workers = list(range(num_servers, size))
        self.stats = ServerStats(rank, rank, start, stop, mode, self.bound, len(self.workers))
        self.staleness = Counter()
        self.pulled = {}    # worker -> version of its last pull (its next gradient's); 0 = model's initial values
        self.waiting = []   # pulls not yet answered: (worker, clock)
        self.clocks = {}    # sync/ssp: clock -> {worker: (gradient, pulled version)}
        self.done = {}      # worker -> its number of pushes, once it sent DONE
        self.sending = []   # (request, buffer, worker) of answers in flight
        self.marks = {}     # clock -> workers that reached a checkpoint after it (sync only)

    def serve(self, on_checkpoint=None, on_update=None):
        """Answer pulls, apply pushes, until every worker sent DONE; then send the final
        shard and these statistics to the reporter (the first worker). Returns ServerStats.

        ``on_checkpoint(clock)`` (sync only): called once every worker has sent CHECKPOINT
        after its push of ``clock - 1`` (:meth:`Worker.mark_checkpoint`); the version is then
        exactly ``clock`` and no gradient of a later clock has arrived, a consistent cut (every
        rank saves its part there; see ``fault.Checkpointer``). ``on_update(version)``: after
        each update is applied."""
        if on_checkpoint is not None and self.mode != "sync":
            raise ValueError(f"parameter server: checkpoints need mode 'sync', not {self.mode!r} (elsewhere the "
                             "versions pulled depend on timing, so no cut is reproducible)")
        self.on_update = on_update
        comm, any_source = self.comm, _any_source()
        header = np.empty(3, np.int64)
        while len(self.done) < len(self.workers):
            _wait_all([comm.Irecv(header, source=any_source, tag=TAG_REQUEST)], self.timeout, self._blame_silent)
            kind, clock, worker = (int(v) for v in header)
            self.stats.control_bytes += HEADER_BYTES
            if kind == PULL:
                self.waiting.append((worker, clock))
            elif kind == PUSH:
                gradient = np.empty(self.shard.size, self.layout.dtype)
                _wait_all([comm.Irecv(gradient, source=worker, tag=TAG_GRAD)], self.timeout,
                          lambda _, w=worker: (f"parameter server rank {comm.Get_rank()}: worker rank {w} sent "
                                               "a push header but not its gradient", [w]))
                self.stats.gradients += 1
                self.stats.bytes_received += gradient.nbytes
                self._push(worker, clock, gradient)
            elif kind == CHECKPOINT:
                self.marks.setdefault(clock, set()).add(worker)
            else:
                self.done[worker] = clock
            self._apply_complete_clocks()
            for mark in [c for c, marked in self.marks.items() if len(marked) == len(self.workers)]:
                del self.marks[mark]
                if self.version != mark:
                    raise RuntimeError(f"parameter server rank {comm.Get_rank()}: checkpoint of clock {mark} at "
                                       f"version {self.version}")
                if on_checkpoint is not None:
                    on_checkpoint(mark)
            self._answer_pulls()
            self.sending = [(r, b, w) for r, b, w in self.sending if not r.Test()]
        self._apply_complete_clocks()
        reporter = self.workers[0]
        final = self.shard.data.copy()
        self.sending.append((comm.Isend(final, dest=reporter, tag=TAG_FINAL), final, reporter))

        def blame_receivers(pending):
            missing = sorted({self.sending[i][2] for i in pending})
            return (f"parameter server rank {comm.Get_rank()}: worker {_ranks(missing)} did not receive "
                    "the answers sent to it", missing)

        _wait_all([r for r, _, _ in self.sending], self.timeout, blame_receivers)
        self.stats.version = int(self.optimizer.steps)
        self.stats.staleness_histogram = dict(sorted(self.staleness.items()))
        comm.send(ServerStats(**{**self.stats.__dict__, "shard": None}), dest=reporter, tag=TAG_STATS)
        self.stats.shard = final
        return self.stats

    @property
    def version(self):
        return self.optimizer.steps

    def _blame_silent(self, _pending):
        """Who holds the server up when no request comes: the workers that neither finished
        nor wait for an answer from it (a live worker is computing, or waiting in a pull)."""
        waiting = {w for w, _ in self.waiting}
        silent = [w for w in self.workers if w not in self.done and w not in waiting]
        unfinished = [w for w in self.workers if w not in self.done]
        missing = silent or unfinished
        return (f"parameter server rank {self.comm.Get_rank()}: no request from worker {_ranks(missing)}, which "
                f"neither finished nor waits for parameters (version {self.version}); is it dead or stuck?",
                missing)

    def _update(self, gradient, stalenesses):
        """One optimizer step with ``gradient``; record the staleness of each gradient in it."""
        for s in stalenesses:
            self.staleness[s] += 1
        if self.warmup is not None:
            self.warmup.step()
        self.shard.grad = gradient
        self.optimizer.step()
        self.shard.grad = None
        if getattr(self, "on_update", None) is not None:
            self.on_update(self.version)

    def state_dict(self) -> dict:
        """The shard's values (the optimizer's state is saved apart) and the counters of
        its statistics, for a checkpoint (``fault.Checkpointer``'s ``extra``)."""
        st = self.stats
        return {"shard": self.shard.data.copy(), "gradients": st.gradients, "bytes_received": st.bytes_received,
                "bytes_sent": st.bytes_sent, "control_bytes": st.control_bytes,
                "staleness": [[int(k), int(v)] for k, v in sorted(self.staleness.items())]}

    def load_state_dict(self, state: dict) -> None:
        """Put back what :meth:`state_dict` saved. Raises ValueError for a shard of another size."""
        shard = np.asarray(state["shard"])
        if shard.shape != self.shard.data.shape:
            raise ValueError(f"server shard of {shard.size} elements saved, {self.shard.data.size} here")
        self.shard.data[...] = shard
        for name in ("gradients", "bytes_received", "bytes_sent", "control_bytes"):
            setattr(self.stats, name, int(state[name]))
        self.staleness = Counter({k: v for k, v in state["staleness"]})

    def _push(self, worker, clock, gradient):
        if self.mode == "async":  # apply on arrival, as its own update
            self._update(gradient, [self.version - self.pulled.get(worker, 0)])
        else:  # hold until every worker's gradient of this clock is here
            self.clocks.setdefault(clock, {})[worker] = (gradient, self.pulled.get(worker, 0))

    def _apply_complete_clocks(self):
        """sync/ssp: apply clock v (= version) once every worker pushed it or finished before it;
        the update is the average of its gradients, summed in worker order (deterministic)."""
        while self.version in self.clocks:
            v, pushed = self.version, self.clocks[self.version]
            if any(w not in pushed and self.done.get(w, math.inf) > v for w in self.workers):
                return
            del self.clocks[v]
            total = None
            for w in sorted(pushed):
                total = pushed[w][0].copy() if total is None else total + pushed[w][0]
            self._update(total / len(pushed), [v - pushed[w][1] for w in sorted(pushed)])

    def _answer_pulls(self):
        """Answer every waiting pull that the mode allows: async at once, sync/ssp when the
        version is at least the worker's clock minus the bound."""
        still = []
        for worker, clock in self.waiting:
            if self.bound is not None and self.version < clock - self.bound:
                still.append((worker, clock))
                continue
            version, values = np.array([self.version], np.int64), self.shard.data.copy()
            self.sending.append((self.comm.Isend(version, dest=worker, tag=TAG_VERSION), version, worker))
            self.sending.append((self.comm.Isend(values, dest=worker, tag=TAG_PARAMS), values, worker))
            self.pulled[worker] = self.version
            self.stats.bytes_sent += values.nbytes
            self.stats.control_bytes += VERSION_BYTES
        self.waiting = still


# ---------------------------------------------------------------------------------------
# The worker
# ---------------------------------------------------------------------------------------


@dataclass
class WorkerStats:
    """What worker ``worker`` (rank ``rank``) did: ``steps`` pushes, the loss of each step,
    payload ``bytes_sent`` (gradients) / ``bytes_received`` (parameters), seconds blocked in
    pulls (``wait_seconds``) and computing (``compute_seconds``). On the reporter, ``model``
    holds the final parameters and ``servers`` every server's ServerStats; else None."""

    rank: int
    worker: int
    steps: int = 0
    losses: list = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    wait_seconds: float = 0.0
    compute_seconds: float = 0.0
    model: object = None
    servers: list | None = None


class Worker:
    """Worker rank ``comm.Get_rank()`` (>= ``num_servers``) around ``model``: ``pull()`` loads
    the servers' current parameters into the model, ``push()`` sends the model's gradients
    (after ``loss.backward()``), ``finish()`` says DONE. ``versions`` holds the version of
    each shard last pulled; ``clock`` the number of pushes. Every wait lasts at most
    ``WORKER_PATIENCE * timeout`` seconds (``timeout=None``: forever), then
    ParameterServerTimeout names the servers that did not answer."""

    def __init__(self, comm, model, *, num_servers=1, timeout=DEFAULT_TIMEOUT):
        size, rank = comm.Get_size(), comm.Get_rank()
        check_world(size, num_servers)
        if rank < num_servers:
            raise ValueError(f"rank {rank} is a server (workers are ranks {num_servers}..{size - 1}); "
                             "use ParameterServer")
        self.comm, self.model, self.num_servers, self.timeout = comm, model, num_servers, timeout
        self.params = model.parameters()
        self.layout = FlatLayout(self.params, num_servers)
        self.flat = np.empty(self.layout.size, self.layout.dtype)  # the receive buffer of the parameters
        self.versions = np.zeros(num_servers, np.int64)
        self.clock = 0
        self.stats = WorkerStats(rank, rank - num_servers)

    def _header(self, kind):
        return np.array([kind, self.clock, self.comm.Get_rank()], np.int64)

    def _wait(self, requests, servers, what):
        """Complete the requests (``requests[i]`` talks to server rank ``servers[i]``) within
        the worker's deadline; on expiry the error names the servers still pending."""
        def blame(pending):
            missing = sorted({servers[i] for i in pending})
            return f"parameter server worker rank {self.comm.Get_rank()}: server {_ranks(missing)} did not {what}", \
                missing

        _wait_all(requests, None if self.timeout is None else WORKER_PATIENCE * self.timeout, blame)

    def state_dict(self) -> dict:
        """The worker's clock and byte counters, for a checkpoint (its sampler position and
        generators are saved by ``fault.Checkpointer``; its parameters are the servers')."""
        st = self.stats
        return {"clock": self.clock, "bytes_sent": st.bytes_sent, "bytes_received": st.bytes_received}

    def load_state_dict(self, state: dict) -> None:
        """Put back what :meth:`state_dict` saved."""
        self.clock = self.stats.steps = int(state["clock"])
        self.stats.bytes_sent, self.stats.bytes_received = int(state["bytes_sent"]), int(state["bytes_received"])

    def mark_checkpoint(self):
        """Tell every server that this worker reached a checkpoint after its push of clock
        ``clock - 1`` (the servers save once all workers did: ``ParameterServer.serve``)."""
        requests = [self.comm.Isend(self._header(CHECKPOINT), dest=s, tag=TAG_REQUEST)
                    for s in range(self.num_servers)]
        self._wait(requests, list(range(self.num_servers)), f"take the checkpoint mark of clock {self.clock}")

    def pull(self):
        """Receive every shard (blocking while a server holds the answer back) and load the
        model. Returns the versions pulled (int64 array, one per server)."""
        comm, header, start = self.comm, self._header(PULL), time.perf_counter()
        answers = [np.empty(1, np.int64) for _ in range(self.num_servers)]
        requests, servers = [], []
        for s, (a, b) in enumerate(self.layout.ranges):  # post the receives before asking
            requests += [comm.Irecv(answers[s], source=s, tag=TAG_VERSION),
                         comm.Irecv(self.flat[a:b], source=s, tag=TAG_PARAMS)]
            servers += [s, s]
        requests += [comm.Isend(header, dest=s, tag=TAG_REQUEST) for s in range(self.num_servers)]
        servers += list(range(self.num_servers))
        self._wait(requests, servers, f"answer the pull of clock {self.clock}")
        self.versions = np.concatenate(answers)
        vector_to_parameters(self.flat, self.params)
        self.stats.bytes_received += self.layout.nbytes
        self.stats.wait_seconds += time.perf_counter() - start
        return self.versions

    def push(self):
        """Send each server its range of the gradient, then advance the clock. Raises
        ValueError when a parameter has no gradient (call ``loss.backward()`` first)."""
        if any(p.grad is None for p in self.params):
            raise ValueError("Worker.push: a parameter has no gradient; call loss.backward() before push()")
        gradient = _host_vector(p.grad for p in self.params)
        comm, header, requests, servers = self.comm, self._header(PUSH), [], []
        for s, (a, b) in enumerate(self.layout.ranges):
            requests += [comm.Isend(header, dest=s, tag=TAG_REQUEST),
                         comm.Isend(gradient[a:b], dest=s, tag=TAG_GRAD)]
            servers += [s, s]
        self._wait(requests, servers, f"take the gradient of clock {self.clock}")
        self.stats.bytes_sent += self.layout.nbytes
        self.clock += 1
        self.stats.steps = self.clock

    def finish(self, receive_final=False):
        """Tell every server this worker is done. With ``receive_final`` (the reporter only:
        the first worker), wait for the final shards, load them into the model and collect
        the servers' statistics. Returns WorkerStats."""
        comm, header = self.comm, self._header(DONE)
        requests = [comm.Isend(header, dest=s, tag=TAG_REQUEST) for s in range(self.num_servers)]
        servers = list(range(self.num_servers))
        if receive_final:
            requests += [comm.Irecv(self.flat[a:b], source=s, tag=TAG_FINAL)
                         for s, (a, b) in enumerate(self.layout.ranges)]
            servers += list(range(self.num_servers))
        self._wait(requests, servers, "take DONE" + (" and send the final parameters" if receive_final else ""))
        if receive_final:
            vector_to_parameters(self.flat, self.params)
            self.stats.model = self.model
            self.stats.servers = [comm.recv(source=s, tag=TAG_STATS) for s in range(self.num_servers)]
        return self.stats


# ---------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------


def train_parameter_server(comm, model_fn, X, y, *, num_servers=1, mode="sync", staleness=0, epochs=1,
                           batch_size=32, lr=0.05, momentum=0.0, weight_decay=0.0, warmup_epochs=0.0, seed=0,
                           step_hook=None, on_epoch_end=None, progress=False, timeout=DEFAULT_TIMEOUT,
                           checkpointer=None):
    """Train ``model_fn()`` on (X, y) with K = ``num_servers`` servers and the other ranks as
    workers; call it on every rank (``sim.run(train_parameter_server, P, ...)`` or with
    ``MPI.COMM_WORLD``). Returns ServerStats on a server, WorkerStats on a worker (the
    reporter, worker 0, also gets the final model and all ServerStats).

    Args:
        model_fn: builds the model; must give the same initial parameters on every rank.
        X, y: training data, (n, features) float and (n,) int; worker w reads the shard
            ``DistributedSampler(n, N, w, shuffle=True, seed=seed)`` in batches of ``batch_size``.
        mode, staleness: see the module docstring. lr, momentum, weight_decay: SGD on the servers.
        warmup_epochs: linear lr warm-up over this many epochs of updates.
        step_hook: ``step_hook(worker, clock)`` on every worker before each gradient (e.g. a
            sleep, to make a worker slow).
        on_epoch_end: ``on_epoch_end(epoch, mean_loss, model)`` on the reporter, with the
            model's parameters as they were at the end of that epoch (the next pull, or the
            final shards after the last epoch). progress: a tqdm bar on the reporter.
        timeout: seconds a server waits for the next request, a worker twice that, on MPI and
            on the sim alike; then ParameterServerTimeout names the missing rank (None: no deadline).
        checkpointer: optional ``checkpointer(server_or_worker) -> fault.Checkpointer`` (a
            gathered one, built around this rank's ParameterServer or Worker; sync only). Every
            rank resumes from it first; a worker at a checkpoint step marks it
            (:meth:`Worker.mark_checkpoint`) and saves its part in ``on_step_end``; a server
            saves its part when every worker marked it (``serve``'s ``on_checkpoint``) and calls
            ``after_step(version, stop=False)`` (the kill hook) after each update, or after the
            save on a checkpoint step. A worker
            stopped by ``TrainingStopped`` says DONE (the reporter takes the final shards)
            before re-raising it, so the servers end too.

    The worker's loop is :func:`minidist.train.fit` with a step that pulls, computes and
    pushes; an epoch's end is reported after the next pull, when the parameters that the
    epoch's last gradient produced have arrived.

    Raises ValueError (naming the fix) for a bad world, mode or staleness;
    ``train.NonFiniteLossError`` on a worker whose loss becomes NaN or infinite.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    check_world(size, num_servers, mode, staleness)
    num_workers = size - num_servers
    model = model_fn()
    if rank < num_servers:
        steps_per_epoch = math.ceil(math.ceil(len(X) / num_workers) / batch_size)
        updates_per_epoch = steps_per_epoch * (num_workers if mode == "async" else 1)
        server = ParameterServer(comm, model, num_servers=num_servers, mode=mode, staleness=staleness, lr=lr,
                                 momentum=momentum, weight_decay=weight_decay,
                                 warmup_updates=round(warmup_epochs * updates_per_epoch), timeout=timeout)
        if checkpointer is None:
            return server.serve()
        ckpt = checkpointer(server)
        ckpt.resume()

        def on_checkpoint(clock):  # the kill hook of a checkpoint step fires after its save, as on a worker
            ckpt.save(clock)
            ckpt.after_step(clock, stop=False)

        def on_update(version):
            if not ckpt.due(version):
                ckpt.after_step(version, stop=False)

        return server.serve(on_checkpoint=on_checkpoint, on_update=on_update)
    worker = Worker(comm, model, num_servers=num_servers, timeout=timeout)
    index, device = rank - num_servers, worker.params[0].device
    is_reporter = index == 0
    sampler = data.DistributedSampler(len(X), num_workers, index, shuffle=True, seed=seed)
    loader = data.DataLoader(X, y, batch_size=batch_size, sampler=sampler)
    finished = []  # the reporter's last (epoch, mean loss), scored once the next pull brings its parameters

    def report_finished():
        if finished and on_epoch_end:
            on_epoch_end(*finished.pop(), model)

    def step_fn(xb, yb):
        worker.pull()
        report_finished()
        if step_hook is not None:
            step_hook(index, worker.clock)
        start = time.perf_counter()
        model.zero_grad()
        loss = cross_entropy(model(Tensor(xb, device=device)), backend.to_device(yb, device))
        loss.backward()
        worker.stats.compute_seconds += time.perf_counter() - start
        worker.push()
        worker.stats.losses.append(float(loss.item()))
        return worker.stats.losses[-1]

    def epoch_end(epoch, loss, seconds):
        finished.append((epoch, loss))

    ckpt = checkpointer(worker) if checkpointer is not None else None

    def on_step_end(position):
        if ckpt.due(position["global_step"]):
            worker.mark_checkpoint()
        ckpt(position)

    try:
        fit(step_fn, loader, epochs, on_epoch_end=epoch_end if is_reporter else None,
            progress=progress and is_reporter, start=ckpt.resume() if ckpt else None,
            on_step_end=on_step_end if ckpt else None)
    except TrainingStopped:  # stopped on purpose: let the servers end too
        worker.finish(receive_final=is_reporter)
        raise
    stats = worker.finish(receive_final=is_reporter)
    report_finished()
    return stats


def final_parameters(results):
    """The trained flat parameter vector (numpy, 1-D), from the servers' results of a run."""
    shards = sorted((r for r in results if isinstance(r, ServerStats)), key=lambda r: r.server)
    return np.concatenate([r.shard for r in shards])


def figures(servers, num_workers, param_bytes):
    """The figures ``train --strategy ps`` prints, from the reporter's list of ServerStats:
    measured payload bytes per server per step vs the formula 2 N M / K, and staleness."""
    k, mode = len(servers), servers[0].mode
    histograms = "; ".join(f"server{s.server} {s.staleness_histogram}" for s in servers)
    return {
        "ps_mode": mode + (f" (staleness bound {servers[0].staleness_bound})" if mode == "ssp" else ""),
        "servers": k,
        "workers": num_workers,
        "parameter_bytes": param_bytes,
        "bytes_per_server_per_step": " ".join(f"{s.bytes_per_step:.0f}" for s in servers),
        "formula_2NM_over_K": f"{2 * num_workers * param_bytes / k:.0f}",
        "max_staleness": max(s.max_staleness for s in servers),
        "staleness_histogram": histograms,
    }

