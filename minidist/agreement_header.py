"""The collectives' agreement round on MPI's own communicators, as one fixed-size binary header.

Why. Every collective first agrees on its arguments (:mod:`minidist.collectives`, "Agreement"):
one round in which each rank learns every rank's 64-bit fingerprint of (collective, shape,
dtype, settings) and whether it found a problem with its own. Through :func:`minidist.p2p.agree`
that round pickles a record per message (mpi4py's lowercase ``isend``/``irecv``); on 2 ranks
(MPICH 5.0.2, this course's 2-core machine) it cost as much as a 4-byte all-reduce's own
exchange, so our all-reduce took 4.4-5x MPI's at 4 B. Here the round is a 32-byte buffer
message on its own tag (``HEADER_TAG``), sent from and received into buffers made once per
communicator: no pickling, no allocation.

The header: four little-endian uint64 -- the fingerprint (0 when this rank found a problem),
the flags (bit 0: this rank found a problem), the bytes of vector that follow the header in the
same message (0, or the all-reduce's n bytes), and ``HEADER_VERSION``.

The vector riding with the header. At P = 2, recursive doubling is one exchange of the whole
vector: the same pair of messages as the round. So an all-reduce of at most ``CARRY_LIMIT``
bytes sends its vector behind its header, in one message, and the round *is* the algorithm: one
latency instead of two (:func:`minidist.collectives.prepare_all_reduce`). The other rank's bytes
are used only once its header has matched this rank's.

Mismatches. Every rank receives every other rank's header and compares it with its own; the
round agrees only when all are equal and none flags a problem. If two headers differ, every rank
differs from at least one of them, so every rank sees the disagreement, and all of them fall
back together to the pickled round of ``p2p.agree``, which shares the problems and the
arguments and raises the same CollectiveError on every rank, in the sim's very words. At P = 2
a rank always receives into ``CARRY_LIMIT`` + 32 bytes, whatever it sends itself, so a rank that
carries its vector never overflows one that carries none (another shape, another collective, a
problem): MPI never sees a truncated receive. Costs (alpha-beta): one round,
alpha + 32 beta, or alpha + (32 + n) beta carrying the vector.

Measured (``benchmarks/bench_collectives.py --collectives all_reduce --iters 300``, 2 ranks of
this course's 2-core machine shared with other work, MPICH 5.0.2, two runs before and two after,
interleaved; notebooks/measurements/bench_collectives_small_2026-12-06_*.json): "auto" against
MPI's Allreduce at 4 B, 4.03 and 4.92 times with the pickled round, 2.83 and 2.50 with the
header (2.79 and 2.60 with no agreement at all: the round now costs nothing measurable there);
the worst ratio from 64 KiB, 1.35 and 1.30 before, 1.00 and 0.76 after.

Where. Only on mpi4py's own communicators (:func:`takes_header`). ``minidist.sim`` matches a
receive only to a message of exactly its size, and both its trace and ``tracing.CountingComm``
(the drivers' byte counts, the exercise checks) count the agreement as pickled metadata apart
from the data, which lessons 03 and 04 print; those communicators keep ``p2p.agree``'s round.
Source of the idea: the note on issue 18 (what would meet the small all-reduce's target).
"""
from __future__ import annotations

import struct

import numpy

from minidist.p2p import attached, wait_all

HEADER_TAG = 7708  # the header round's messages (collectives.TAGS["agree_header"])
HEADER_BYTES = 32
HEADER_VERSION = 1
CARRY_LIMIT = 1 << 16  # bytes of vector a header may carry (P = 2, recursive doubling)
_HEADER = struct.Struct("<4Q")
_BUFFERS = "agreement_header.buffers"  # the key of a communicator's buffers in p2p.attached(comm)


def takes_header(comm) -> bool:
    """Whether ``comm`` is one of mpi4py's own communicators, whose agreement round is this
    module's header (module docstring, "Where"); False for the sim and for wrappers."""
    return type(comm).__module__ == "mpi4py.MPI"


def can_carry(comm, nbytes) -> bool:
    """Whether an all-reduce of ``nbytes`` bytes on ``comm`` may send its vector with its header:
    an MPI communicator of 2 ranks and 0 < nbytes <= CARRY_LIMIT (the caller checks that the
    algorithm is recursive doubling and the vector a host array)."""
    return 0 < nbytes <= CARRY_LIMIT and takes_header(comm) and comm.Get_size() == 2


def header_round(comm, fingerprint, problem, what, carry=None):
    """One agreement round of 32-byte headers (module docstring): ``(agreed, incoming)``.

    fingerprint: this rank's 64-bit fingerprint of the arguments (None or 0 with a problem).
    problem: whether this rank found a problem with its arguments (anything truthy).
    what: the collective's name, for a timeout's message.
    carry: None, or this rank's flat C-contiguous host vector (at most CARRY_LIMIT bytes, only
        on 2 ranks: :func:`can_carry`) to send behind the header.
    Returns agreed = True when every rank sent the same header and none flagged a problem (the
    same answer on every rank), and incoming = the other rank's carried vector (a read-only
    view of this communicator's receive buffer, valid until its next round, of carry's dtype
    and size) when agreed and carrying, else None. Raises CollectiveTimeout (``p2p.wait_all``)
    when a rank's header does not come within the deadline."""
    buffers = _buffers(comm)
    carried = 0 if carry is None else carry.nbytes
    mine = _HEADER.pack(0 if problem else fingerprint or 0, 1 if problem else 0, carried, HEADER_VERSION)
    buffers.send_header[:] = mine
    others = buffers.others
    if len(others) == 1:  # P = 2: one message each way, the header and what it carries
        message, incoming = buffers.send_header, None
        if carried:
            region, message, incoming = buffers.carrying(carry.dtype, carried)
            region[...] = carry
        wait_all(comm, [comm.Irecv(buffers.receive, source=others[0], tag=HEADER_TAG),
                        comm.Isend(message, dest=others[0], tag=HEADER_TAG)], buffers.peers, what, receives=1)
        agreed = not problem and buffers.receive_headers[0] == mine
        return agreed, incoming if agreed else None
    requests = [comm.Irecv(row, source=r, tag=HEADER_TAG) for row, r in zip(buffers.receive_headers, others)]
    requests += [comm.Isend(buffers.send_header, dest=r, tag=HEADER_TAG) for r in others]
    wait_all(comm, requests, buffers.peers, what, receives=len(others))
    return not problem and all(row == mine for row in buffers.receive_headers), None


class _Buffers:
    """A communicator's header buffers, made once (:func:`_buffers`) and reused by every round
    on it (each round completes its requests, or cancels its receives, before it returns).
    P = 2: ``receive`` holds HEADER_BYTES + CARRY_LIMIT bytes, whatever this rank sends; else
    one 32-byte row per other rank. ``send_header``, ``receive_headers``: memoryviews of the
    headers (cheaper to fill and compare than numpy slices: a 4-byte all-reduce notices)."""

    def __init__(self, rank, p):
        self.others = [r for r in range(p) if r != rank]
        self.peers = self.others + self.others  # the round's requests: receives, then sends
        self.send = numpy.zeros(HEADER_BYTES + (CARRY_LIMIT if p == 2 else 0), numpy.uint8)
        self.send_header = memoryview(self.send)[:HEADER_BYTES]
        if p == 2:
            self.receive = numpy.zeros(HEADER_BYTES + CARRY_LIMIT, numpy.uint8)
            self.receive_headers = [memoryview(self.receive)[:HEADER_BYTES]]
        else:
            self.receive = numpy.zeros((p - 1, HEADER_BYTES), numpy.uint8)
            self.receive_headers = [memoryview(row) for row in self.receive]
        self.views = {}  # (dtype, nbytes) -> carrying(...)'s views

    def carrying(self, dtype, nbytes):
        """(where the carried vector goes in the send buffer, as a dtype array; the message:
        header and vector; where the other rank's vector lands, a read-only dtype array),
        made once per (dtype, nbytes)."""
        key = (dtype, nbytes)
        found = self.views.get(key)
        if found is None:
            if len(self.views) >= 64:
                self.views.clear()
            end = HEADER_BYTES + nbytes
            incoming = self.receive[HEADER_BYTES:end].view(dtype)
            incoming.flags.writeable = False
            found = self.views[key] = (self.send[HEADER_BYTES:end].view(dtype), memoryview(self.send)[:end], incoming)
        return found


def _buffers(comm):
    """The :class:`_Buffers` of ``comm`` (kept in ``p2p.attached(comm)``)."""
    state = attached(comm)
    found = state.get(_BUFFERS)
    if found is None:
        found = state[_BUFFERS] = _Buffers(comm.Get_rank(), comm.Get_size())
    return found
