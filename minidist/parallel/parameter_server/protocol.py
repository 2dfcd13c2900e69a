"""The parameter server's messages: who is a server, which range of the flat parameter vector
each one owns, the tags and request headers on the wire, and its waits (``minidist.p2p``'s one
wait, with the error that names the rank at fault).

A request is a header of three int64, ``[kind, clock, worker rank]`` (``HEADER_BYTES``), on
``TAG_REQUEST``; a PUSH header is followed by the gradient range on ``TAG_GRAD``; a pull is
answered with the shard's version (``VERSION_BYTES``) on ``TAG_VERSION`` and its values on
``TAG_PARAMS``; at the end each server sends its final shard (``TAG_FINAL``) and statistics
(``TAG_STATS``, pickled) to the reporter.

One deadline. Servers and workers share ONE ``timeout`` (None: ``p2p.get_timeout()``, the
engine's default, which ``train --timeout`` sets; ``math.inf``: none), and the server speaks
first when a worker is missing. A server counts its deadline from the oldest pull it holds
back (else from its last request): the worker of that pull started waiting when it sent it,
and waits ``timeout + WORKER_MARGIN`` seconds, so the server, which knows which worker holds
the clock back, reaches its deadline first by the margin, less the pull's delivery and the
server's bookkeeping (microseconds to milliseconds on one machine). A worker whose server is
dead names the server after ``timeout + WORKER_MARGIN``. On the sim, a deadlock ends these
waits at once, in the order of their deadlines (``p2p.wait_all``'s blame).
"""
from __future__ import annotations

import sys
import time

import numpy as np

from minidist import backend, p2p, sim
from minidist.collectives import chunk_bounds
from minidist.nn import parameters_to_vector

MODES = ("sync", "async", "ssp")
WORKER_MARGIN = 1.0  # seconds a worker waits past the shared timeout, so the server speaks first (module docstring)
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


def host_vector(arrays):
    """The arrays (parameters or gradients, numpy or cupy) laid end to end in one NumPy
    vector: messages travel from host memory."""
    return backend.to_numpy(parameters_to_vector(arrays))


def any_source():
    """MPI's "any source" for a receive. When mpi4py is loaded, its own value (MPICH and Open
    MPI differ); the sim takes any negative source as "any", so this works for both."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi.ANY_SOURCE if mpi is not None else sim.ANY_SOURCE


def format_ranks(ranks):
    """``"rank 3"`` or ``"ranks 1, 4"``: the ranks named in an error, sorted."""
    ranks = sorted(ranks)
    return f"rank{'s' * (len(ranks) != 1)} {', '.join(map(str, ranks))}"


def seconds(timeout):
    """The deadline in seconds of a ``timeout`` argument: None gives ``p2p.get_timeout()`` (read
    at each wait, so ``p2p.set_timeout`` applies), ``math.inf`` no deadline. Raises ValueError
    for anything but None or a positive number."""
    if timeout is None:
        return p2p.get_timeout()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"parameter server: timeout must be a positive number of seconds, math.inf or None, "
                         f"got {timeout!r}")
    return float(timeout)


def wait_all(comm, requests, peers, timeout, blame, receives=0, since=None):
    """Complete the requests (mpi4py's or the sim's) with :func:`minidist.p2p.wait_all`, the
    engine's one wait, by ``timeout`` seconds (a number: resolve None with :func:`seconds`)
    after ``since`` (a ``time.perf_counter()``; None: now). ``peers[i]``: the rank request i
    talks to (None: any); the first ``receives`` requests are receives (cancelled on expiry).
    On expiry raise ``ParameterServerTimeout``: ``blame`` gets the indices of the requests
    still pending and returns (message, missing ranks), so the error names who was not heard
    from, not who waited."""
    def expired(pending):
        message, missing = blame(pending)
        return ParameterServerTimeout(f"{message} (deadline {timeout:g} s; raise timeout= for slow steps)", missing)

    left = timeout if since is None else max(0.0, since + timeout - time.perf_counter())
    p2p.wait_all(comm, requests, peers, "parameter server", receives=receives, timeout=left, blame=expired)
