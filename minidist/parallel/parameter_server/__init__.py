"""Parameter servers: workers pull parameters, compute gradients, push them back.

Read in this order: ``protocol`` (the layout, the messages and the one wait), ``server``
(:class:`ParameterServer`), ``worker`` (:class:`Worker`), ``train`` (the training loop on every
rank, :func:`train_parameter_server`, and the driver of ``train --strategy ps``).

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
blocking wait is the engine's one deadline-bounded wait (``minidist.p2p.wait_all``), the same
on MPI and on the sim. Servers and workers share one deadline, ``timeout`` (None: p2p's
default, which ``train --timeout`` sets; ``math.inf``: none). When it passes,
:class:`ParameterServerTimeout` names the rank that was missing, not the one that waited: a
server names the workers that neither finished nor wait for it (a dead or stuck worker holds
back every clock), counting from the oldest pull it holds back; a worker names the servers
that did not answer, after ``timeout + protocol.WORKER_MARGIN`` seconds, so that when a
worker is missing the server, which knows which one, speaks first (``protocol``'s docstring).

Use::

    from minidist import sim, nn
    from minidist.parallel.parameter_server import train_parameter_server
    results = sim.run(train_parameter_server, 4, lambda: nn.mlp([64, 32, 10], rng=0),
                      X, y, num_servers=1, mode="async", lr=0.05)
    results[0].staleness_histogram        # a server's ServerStats
    results[1].model                      # the reporter's WorkerStats: the final model

The same call runs under ``mpiexec`` with ``MPI.COMM_WORLD``; ``python -m minidist train
--strategy ps`` calls it through :func:`~minidist.parallel.parameter_server.train.train_ps`.
"""
from minidist.parallel.parameter_server.protocol import (
    MODES,
    FlatLayout,
    ParameterServerTimeout,
    check_world,
)
from minidist.parallel.parameter_server.server import ParameterServer, ServerStats
from minidist.parallel.parameter_server.train import figures, final_parameters, train_parameter_server, train_ps
from minidist.parallel.parameter_server.worker import Worker, WorkerStats

__all__ = ["MODES", "FlatLayout", "ParameterServer", "ParameterServerTimeout", "ServerStats", "Worker", "WorkerStats",
           "check_world", "figures", "final_parameters", "train_parameter_server", "train_ps"]
