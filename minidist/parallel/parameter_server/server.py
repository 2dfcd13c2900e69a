"""A parameter server: one rank that owns a range of the flat parameters, answers pulls and
applies pushes (sync, async or bounded staleness; see the package's docstring).
"""
from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from minidist import optim
from minidist.nn import Parameter
from minidist.parallel.parameter_server.protocol import (
    CHECKPOINT,
    HEADER_BYTES,
    PULL,
    PUSH,
    TAG_FINAL,
    TAG_GRAD,
    TAG_PARAMS,
    TAG_REQUEST,
    TAG_STATS,
    TAG_VERSION,
    VERSION_BYTES,
    FlatLayout,
    any_source,
    check_world,
    format_ranks,
    host_vector,
    seconds,
    wait_all,
)


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
    lr linearly over this many updates (:class:`minidist.optim.WarmupLR`); ``timeout``: the
    deadline in seconds shared with the workers (None: ``p2p.get_timeout()``; ``math.inf``:
    none), counted from the oldest pull held back, else from the last request
    (``protocol``'s docstring: the server speaks first). Raises ValueError for a bad layout,
    mode or timeout; ParameterServerTimeout naming the workers it did not hear from.
    """

    def __init__(self, comm, model, *, num_servers=1, mode="sync", staleness=0, lr=0.05, momentum=0.0,
                 weight_decay=0.0, warmup_updates=0, timeout=None):
        size, rank = comm.Get_size(), comm.Get_rank()
        check_world(size, num_servers, mode, staleness)
        seconds(timeout)  # a bad timeout is an error now, not at the first wait
        if rank >= num_servers:
            raise ValueError(f"rank {rank} is a worker (servers are ranks 0..{num_servers - 1}); use Worker")
        params = model.parameters()
        self.layout = FlatLayout(params, num_servers)
        start, stop = self.layout.ranges[rank]
        self.shard = Parameter(host_vector(params)[start:stop].copy())
        self.optimizer = optim.SGD([self.shard], lr=lr, momentum=momentum, weight_decay=weight_decay)
        self.warmup = optim.WarmupLR(self.optimizer, warmup_updates) if warmup_updates else None
        self.comm, self.mode, self.timeout = comm, mode, timeout
        self.bound = {"sync": 0, "ssp": int(staleness), "async": None}[mode]  # None: unbounded
        self.workers = list(range(num_servers, size))
        self.stats = ServerStats(rank, rank, start, stop, mode, self.bound, len(self.workers))
        self.staleness = Counter()
        self.pulled = {}    # worker -> version of its last pull (its next gradient's); 0 = model's initial values
        self.waiting = []   # pulls not yet answered: (worker, clock)
        self.asked = {}     # worker -> perf_counter time its unanswered pull arrived (the deadline counts from it)
        self.heard = 0.0    # perf_counter time of the last request
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
        header = np.empty(3, np.int64)
        self.heard = time.perf_counter()
        while len(self.done) < len(self.workers):
            kind, clock, worker = self._next_request(header)
            if kind == PULL:
                self.waiting.append((worker, clock))
                self.asked[worker] = self.heard
            elif kind == PUSH:
                self._receive_gradient(worker, clock)
            elif kind == CHECKPOINT:
                self.marks.setdefault(clock, set()).add(worker)
            else:
                self.done[worker] = clock
            self._apply_complete_clocks()
            self._checkpoints(on_checkpoint)
            self._answer_pulls()
            self.sending = [(r, b, w) for r, b, w in self.sending if not r.Test()]
        self._apply_complete_clocks()
        return self._finish()

    def _next_request(self, header):
        """Wait for the next request into ``header``: (kind, clock, worker). The deadline
        counts from the oldest pull held back, else from the last request (module docstring
        of ``protocol``); past it, the error names the silent workers."""
        since = min(self.asked.values(), default=self.heard)
        request = self.comm.Irecv(header, source=any_source(), tag=TAG_REQUEST)
        wait_all(self.comm, [request], [None], seconds(self.timeout), self._blame_silent, receives=1, since=since)
        self.heard = time.perf_counter()
        self.stats.control_bytes += HEADER_BYTES
        return tuple(int(v) for v in header)

    def _receive_gradient(self, worker, clock):
        """The gradient range that follows worker ``worker``'s push header of ``clock``."""
        gradient = np.empty(self.shard.size, self.layout.dtype)
        rank = self.comm.Get_rank()
        wait_all(self.comm, [self.comm.Irecv(gradient, source=worker, tag=TAG_GRAD)], [worker], seconds(self.timeout),
                 lambda _: (f"parameter server rank {rank}: worker rank {worker} sent a push header but not its "
                            "gradient", [worker]), receives=1)
        self.stats.gradients += 1
        self.stats.bytes_received += gradient.nbytes
        self._push(worker, clock, gradient)

    def _checkpoints(self, on_checkpoint):
        """Call ``on_checkpoint(clock)`` for each clock every worker has marked (``serve``)."""
        for mark in [c for c, marked in self.marks.items() if len(marked) == len(self.workers)]:
            del self.marks[mark]
            if self.version != mark:
                raise RuntimeError(f"parameter server rank {self.comm.Get_rank()}: checkpoint of clock {mark} at "
                                   f"version {self.version}")
            if on_checkpoint is not None:
                on_checkpoint(mark)

    def _finish(self):
        """Send the final shard and the statistics to the reporter (the first worker), once every
        answer in flight has gone out. Returns this server's ServerStats."""
        comm, reporter = self.comm, self.workers[0]
        final = self.shard.data.copy()
        self.sending.append((comm.Isend(final, dest=reporter, tag=TAG_FINAL), final, reporter))

        def blame_receivers(pending):
            missing = sorted({self.sending[i][2] for i in pending})
            return (f"parameter server rank {comm.Get_rank()}: worker {format_ranks(missing)} did not receive "
                    "the answers sent to it", missing)

        wait_all(comm, [r for r, _, _ in self.sending], [w for _, _, w in self.sending], seconds(self.timeout),
                 blame_receivers)
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
        return (f"parameter server rank {self.comm.Get_rank()}: no request from worker {format_ranks(missing)}, which "
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
            self.asked.pop(worker, None)
            self.stats.bytes_sent += values.nbytes
            self.stats.control_bytes += VERSION_BYTES
        self.waiting = still
