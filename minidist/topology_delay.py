"""The delay layer: a real ``mpiexec`` run on one machine that behaves like a cluster.

On one machine every message between ranks goes through shared memory, so a hierarchical
all-reduce has nothing to win. :class:`DelayComm` wraps a communicator (``MPI.COMM_WORLD``,
or a ``minidist.sim`` rank) and puts its ranks on *fake nodes* of ``ranks_per_node``
consecutive ranks; a message to a rank on another node first waits (``time.sleep``)
``alpha + bytes / bandwidth`` of the inter-node link, so a 4- or 8-rank run shows the shape a
cluster would: the flat ring pays the slow link at every step, the hierarchical all-reduce
only on 1/l of the vector.

    from mpi4py import MPI
    from minidist import collectives
    from minidist.topology_delay import DelayComm

    comm = DelayComm(MPI.COMM_WORLD, ranks_per_node=2, inter=(200e-6, 1e9))  # 200 us, 1 GB/s
    collectives.all_reduce(comm, x, algorithm="hierarchical")   # nodes from comm.cluster_topology

Approximate, by design (the sim's virtual time, ``minidist.sim.topology``, is the exact
model): the sender sleeps before it hands the message to MPI, so a non-blocking ``Isend``
blocks for the delay; several messages from one rank wait one after the other (one port per
rank: ``nic="per_rank"``, a shared card is not modelled); MPI's own time and the sleep's
granularity (tens of microseconds) come on top; a rank waiting in a sleep does not progress
its other requests. Pickled metadata (``send``, ``allgather``...: the collectives' agreement
round) is not delayed, as in virtual time. ``compute(seconds)`` sleeps, as the sim's
``comm.compute`` advances the clock, so one program can draw its Gantt chart on the sim and
show its shape under mpiexec. Everything else passes through to the wrapped communicator;
``Split`` returns a DelayComm of the new communicator, its ranks still on their nodes.
"""
from __future__ import annotations

import os
import time

from minidist.sim.topology import Topology

ENV = "MINIDIST_RANKS_PER_NODE"  # the default ranks_per_node (minidist.node_layout reads it too)


class DelayComm:
    """``comm`` on fake nodes, its cross-node messages delayed (module docstring).

    ranks_per_node: ranks per fake node (consecutive ranks; None: ``MINIDIST_RANKS_PER_NODE``
    from the environment); inter, intra: ``(alpha_seconds, bytes_per_second)`` of a message
    between nodes and inside one (intra defaults to no delay: ``(0.0, inf)``). ``nodes``
    instead of ranks_per_node gives each rank's node id (what ``Split`` passes on).
    Attributes: ``comm`` (the wrapped one), ``cluster_topology`` (a ``sim.Topology`` of these
    nodes and links, nic "per_rank": ``minidist.node_layout`` and ``all_reduce``'s "auto" read
    it), ``delayed_seconds`` (the sleeps so far), ``delayed_messages``.
    Raises ValueError when neither ranks_per_node nor the environment says the node size,
    when it does not divide the communicator's size, or for a bad link.
    """

    def __init__(self, comm, ranks_per_node=None, inter=(100e-6, 1e9), intra=(0.0, float("inf")), nodes=None):
        p = comm.Get_size()
        if nodes is None:
            if ranks_per_node is None:
                value = os.environ.get(ENV, "").strip()
                if not value:
                    raise ValueError(f"DelayComm needs ranks_per_node (or {ENV} in the environment)")
                ranks_per_node = int(value)
            if isinstance(ranks_per_node, bool) or int(ranks_per_node) != ranks_per_node or ranks_per_node < 1 \
                    or p % ranks_per_node:
                raise ValueError(f"ranks_per_node must be a positive divisor of the {p} ranks, got {ranks_per_node!r}")
            nodes = [r // int(ranks_per_node) for r in range(p)]
        self.comm = comm
        self.cluster_topology = Topology(nodes, intra, inter, "per_rank")
        self._rank = comm.Get_rank()
        self.delayed_seconds, self.delayed_messages = 0.0, 0

    def __repr__(self):
        return f"<DelayComm of {self.comm!r} on {self.cluster_topology!r}>"

    def __getattr__(self, name):
        if name == "comm":  # not set yet (copy, pickle): do not recurse
            raise AttributeError(name)
        return getattr(self.comm, name)

    def _delay(self, buf, dest):
        """Sleep for the link from this rank to ``dest`` (its alpha and the buffer's bytes)."""
        array = buf[0] if isinstance(buf, (list, tuple)) and buf else buf
        link = self.cluster_topology.link(self._rank, dest)
        seconds = link.time(int(getattr(array, "nbytes", 0)))
        if seconds > 0:
            time.sleep(seconds)
            self.delayed_seconds += seconds
            self.delayed_messages += 1

    def Send(self, buf, dest, tag=0):
        """``comm.Send`` after the link's delay."""
        self._delay(buf, dest)
        return self.comm.Send(buf, dest=dest, tag=tag)

    def Ssend(self, buf, dest, tag=0):
        """``comm.Ssend`` after the link's delay."""
        self._delay(buf, dest)
        return self.comm.Ssend(buf, dest=dest, tag=tag)

    def Isend(self, buf, dest, tag=0):
        """``comm.Isend`` after the link's delay (which blocks: module docstring)."""
        self._delay(buf, dest)
        return self.comm.Isend(buf, dest=dest, tag=tag)

    def Issend(self, buf, dest, tag=0):
        """``comm.Issend`` after the link's delay."""
        self._delay(buf, dest)
        return self.comm.Issend(buf, dest=dest, tag=tag)

    def Sendrecv(self, sendbuf, dest, sendtag=0, recvbuf=None, source=-1, recvtag=-1, status=None):
        """``comm.Sendrecv`` after the delay of the link to ``dest``."""
        self._delay(sendbuf, dest)
        return self.comm.Sendrecv(sendbuf, dest=dest, sendtag=sendtag, recvbuf=recvbuf, source=source,
                                  recvtag=recvtag, status=status)

    def compute(self, seconds, label="compute"):
        """Sleep ``seconds`` (local work in a demo; the sim's ``comm.compute`` advances its
        virtual clock instead). Raises ValueError for a negative or non-finite number."""
        if not (isinstance(seconds, (int, float)) and 0 <= seconds < float("inf")):
            raise ValueError(f"compute: seconds must be a finite number >= 0, got {seconds!r}")
        time.sleep(seconds)

    def Split(self, color=0, key=0):
        """``comm.Split``, wrapped: the new communicator's ranks keep their nodes and links. A
        rank that passes a negative colour (UNDEFINED) gets what the wrapped Split gives."""
        entries = self.comm.allgather((color, key, self.cluster_topology.node_of(self._rank)))
        sub = self.comm.Split(color, key)
        if color < 0:
            return sub
        members = sorted((k, r, node) for r, (c, k, node) in enumerate(entries) if c == color)
        topo = self.cluster_topology
        return DelayComm(sub, inter=topo.inter, intra=topo.intra, nodes=[node for _, _, node in members])
