"""A parameter-server worker: pulls the parameters, computes a gradient on its batch, pushes it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from minidist.nn import vector_to_parameters
from minidist.parallel.parameter_server.protocol import (
    CHECKPOINT,
    DONE,
    PULL,
    PUSH,
    TAG_FINAL,
    TAG_GRAD,
    TAG_PARAMS,
    TAG_REQUEST,
    TAG_STATS,
    TAG_VERSION,
    WORKER_MARGIN,
    FlatLayout,
    check_world,
    format_ranks,
    host_vector,
    seconds,
    wait_all,
)


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
    each shard last pulled; ``clock`` the number of pushes. ``timeout``: the deadline shared
    with the servers (None: ``p2p.get_timeout()``; ``math.inf``: none); every wait lasts at
    most ``timeout + WORKER_MARGIN`` seconds, so that a server, whose deadline counts from the
    pull it holds back, names a missing worker first (``protocol``'s docstring); past it,
    ParameterServerTimeout names the servers that did not answer. Raises ValueError for a bad
    layout, role or timeout."""

    def __init__(self, comm, model, *, num_servers=1, timeout=None):
        size, rank = comm.Get_size(), comm.Get_rank()
        check_world(size, num_servers)
        seconds(timeout)  # a bad timeout is an error now, not at the first wait
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

    def _wait(self, requests, servers, what, receives=0):
        """Complete the requests (``requests[i]`` talks to server rank ``servers[i]``; the first
        ``receives`` are receives) within the worker's deadline, ``timeout + WORKER_MARGIN``;
        on expiry the error names the servers still pending."""
        def blame(pending):
            missing = sorted({servers[i] for i in pending})
            rank = self.comm.Get_rank()
            return f"parameter server worker rank {rank}: server {format_ranks(missing)} did not {what}", missing

        wait_all(self.comm, requests, servers, seconds(self.timeout) + WORKER_MARGIN, blame, receives)

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
        self._wait(requests, servers, f"answer the pull of clock {self.clock}", receives=2 * self.num_servers)
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
        gradient = host_vector(p.grad for p in self.params)
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
        comm, header, servers = self.comm, self._header(DONE), list(range(self.num_servers))
        receives = [comm.Irecv(self.flat[a:b], source=s, tag=TAG_FINAL)
                    for s, (a, b) in enumerate(self.layout.ranges)] if receive_final else []
        requests = receives + [comm.Isend(header, dest=s, tag=TAG_REQUEST) for s in servers]
        self._wait(requests, servers * (2 if receive_final else 1),
                   "take DONE" + (" and send the final parameters" if receive_final else ""), len(receives))
        if receive_final:
            vector_to_parameters(self.flat, self.params)
            self.stats.model = self.model
            self.stats.servers = [comm.recv(source=s, tag=TAG_STATS) for s in range(self.num_servers)]
        return self.stats
