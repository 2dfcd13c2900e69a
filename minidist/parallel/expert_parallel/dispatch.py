"""Dispatch and combine over an ``ep`` group: a token's row goes to the rank holding its expert
and its output comes back, two ``all_to_all_v`` (Lepikhin et al. 2020, GShard, section 2.2).

The E experts are cut over the P ranks of the ep group in contiguous runs (``numpy.array_split``:
the first E mod P ranks hold one more; every rank at least one, so E >= P). A layer's forward:

    counts    every rank's routed counts (k, E), all-gathered over *every* rank (the dp replicas
              too): the capacity and the dropped set are those of the whole global batch
              (``models.moe.keep_mask``), and each rank learns how many rows each peer sends
    dispatch  the kept assignments' rows, sorted by expert, so the rows for ep rank j are one
              contiguous block: all_to_all_v(blocks); a rank receives, from each peer, rows for
              its experts in expert order, and reorders them expert-major (expert 0's rows from
              every peer, then expert 1's ...) for its MLPs
    combine   the experts' outputs the same way back (the reverse permutation, all_to_all_v with
              the roles of sender and receiver swapped); the gates multiply them on the token's
              own rank (``models.moe.MoE.forward``)

The backward of an all-to-all is the reverse all-to-all: the gradient of dispatch's output
travels back as combine's forward does, and combine's as dispatch's. Per layer and direction a
rank sends k · N_r · C values less those for its own experts: (P - 1) / P of them when the router
is uniform, plus the counts (one int64 per peer, ``all_to_all_v``'s agreement) and the (P, k, E)
all-gather. Megatron-Core's ``MoEAlltoAllTokenDispatcher`` (``megatron/core/transformer/moe/
token_dispatcher.py``) does the same steps: ``preprocess`` (the split sizes from the tokens per
expert), ``dispatch_preprocess`` (sort by expert), ``token_dispatch`` (the all-to-all),
``dispatch_postprocess`` (sort by local expert), then ``combine_preprocess``, ``token_combine``,
``combine_postprocess`` the reverse (older releases: ``token_permutation``/``token_unpermutation``).
torchtitan's ``ExpertParallel`` (``torchtitan/distributed/expert_parallel.py``,
``_token_dispatch``) exchanges the counts with an ``all_to_all_single`` first, then the tokens; it
views the counts as (ep, E / ep), so there E must be a multiple of the ep degree, and it drops no
token. Here the runs may differ by one expert (E = 5 over 2 ranks: 3 and 2), and the capacity
needs every rank's counts, so they are all-gathered instead (the same bytes order: k · E ints).
"""
from __future__ import annotations

import numpy as np

from minidist import backend, collectives
from minidist.models.moe import kept_counts
from minidist.tensor import Function


def expert_owners(n_expert: int, ep: int) -> list[list[int]]:
    """The experts each of the ``ep`` ranks holds: contiguous runs, ``numpy.array_split``'s sizes.
    Raises ValueError naming the fix when n_expert < ep (a rank would hold none)."""
    if n_expert < ep:
        raise ValueError(f"{n_expert} experts cannot be spread over {ep} ep ranks (each holds at least one); use "
                         f"--n-expert {ep} or more, or fewer ep ranks (--dp D puts ranks / D in each ep group)")
    return [list(map(int, part)) for part in np.array_split(np.arange(n_expert), ep)]


class AllToAllDispatcher:
    """The token dispatcher of one MoE layer on one rank (module docstring).

    Args:
        ep_comm: this rank's ep group (its Get_rank() the ep coordinate).
        world_comm: every rank whose tokens share the capacity (the ep group times its dp replicas),
            world rank = dp_rank · ep + ep_rank (the mesh's order: ep fastest).
        n_expert: E.

    ``expert_ids``: the experts this rank holds. ``rank``: the world rank (its tokens' place in the
    global order). After each forward: ``sent_rows`` and ``received_rows``, the rows dispatch sent to
    and received from the other ranks (combine sends back what dispatch received)."""

    def __init__(self, ep_comm, world_comm, n_expert: int):
        self.ep_comm, self.world_comm = ep_comm, world_comm
        self.ep, self.ep_rank, self.rank = ep_comm.Get_size(), ep_comm.Get_rank(), world_comm.Get_rank()
        self.owners = expert_owners(n_expert, self.ep)
        self.expert_ids = self.owners[self.ep_rank]
        self.owner_of = np.concatenate([np.full(len(ids), j) for j, ids in enumerate(self.owners)]).astype(np.int64)
        self.sent_rows = self.received_rows = 0

    def all_counts(self, counts):
        """(P, k, E): every world rank's routed counts (an all-gather of (k, E) int64)."""
        return collectives.all_gather(self.world_comm, np.ascontiguousarray(counts, dtype=np.int64))

    def layout(self, plan):
        """The rows this rank sends to each ep rank (its plan's kept assignments by owner) and the
        permutation from received (peer-major) to expert-major order, with rows per local expert."""
        send_sizes = np.bincount(self.owner_of[plan.expert], minlength=self.ep)
        dp_rank = self.rank // self.ep
        kept = kept_counts(plan.all_counts, plan.capacity)[dp_rank * self.ep:(dp_rank + 1) * self.ep]  # (ep, E)
        mine = kept[:, self.expert_ids]  # (ep peers, local experts): rows each peer sends per expert
        offsets = np.concatenate([[0], np.cumsum(mine.sum(axis=1))])[:-1]
        within = np.cumsum(mine, axis=1) - mine  # start of expert e's rows inside peer i's block
        order = [np.arange(mine[i, e]) + offsets[i] + within[i, e]
                 for e in range(mine.shape[1]) for i in range(self.ep)]
        permutation = np.concatenate(order).astype(np.int64) if order else np.zeros(0, np.int64)
        return send_sizes, mine.sum(axis=1), permutation, mine.sum(axis=0)

    def dispatch(self, tokens, plan):
        """(M, C) rows for this rank's experts, expert-major, and the rows per local expert."""
        send_sizes, recv_sizes, permutation, per_expert = self.layout(plan)
        self.sent_rows = int(send_sizes.sum() - send_sizes[self.ep_rank])
        self.received_rows = int(recv_sizes.sum() - recv_sizes[self.ep_rank])
        rows = tokens[plan.token]  # (A, C): a getitem, whose backward adds a token's slots
        return Dispatch.apply(rows, comm=self.ep_comm, send_sizes=send_sizes, recv_sizes=recv_sizes,
                              permutation=permutation), per_expert

    def combine(self, outputs, plan):
        """The experts' outputs (M, C) back to the tokens' ranks: (A, C) in the plan's order."""
        send_sizes, recv_sizes, permutation, _ = self.layout(plan)
        return Combine.apply(outputs, comm=self.ep_comm, send_sizes=send_sizes, recv_sizes=recv_sizes,
                             permutation=permutation)


def exchange(comm, rows, sizes):
    """all_to_all_v of ``rows`` cut into consecutive blocks of ``sizes`` (block j to rank j):
    the received blocks concatenated (peer-major)."""
    xp = backend.get_array_module(rows)
    blocks = xp.split(rows, np.cumsum(sizes)[:-1], axis=0)
    return xp.concatenate(collectives.all_to_all_v(comm, list(blocks)), axis=0)


def to_expert_major(received, permutation):
    """Peer-major rows (M, C) to expert-major: row m of the result is ``received[permutation[m]]``."""
    return received[permutation]


def to_peer_major(rows, permutation):
    """The inverse of :func:`to_expert_major`."""
    xp = backend.get_array_module(rows)
    out = xp.empty_like(rows)
    out[permutation] = rows
    return out


class Dispatch(Function):
    """(A, C) kept rows sorted by expert -> (M, C) rows of this rank's experts, expert-major.
    Forward: all_to_all_v then the permutation; backward: the inverse, the reverse all_to_all_v."""

    @staticmethod
    def forward(ctx, rows, comm=None, send_sizes=None, recv_sizes=None, permutation=None):
        ctx.comm, ctx.send_sizes, ctx.recv_sizes, ctx.permutation = comm, send_sizes, recv_sizes, permutation
        return to_expert_major(exchange(comm, rows, send_sizes), permutation)

    @staticmethod
    def backward(ctx, grad):
        return (exchange(ctx.comm, to_peer_major(grad, ctx.permutation), ctx.recv_sizes),)


class Combine(Function):
    """(M, C) expert-major outputs -> (A, C) on the tokens' ranks, in the plan's order: the
    inverse of :class:`Dispatch`'s forward (and its backward is Dispatch's forward)."""

    @staticmethod
    def forward(ctx, outputs, comm=None, send_sizes=None, recv_sizes=None, permutation=None):
        ctx.comm, ctx.send_sizes, ctx.permutation = comm, send_sizes, permutation
        return exchange(comm, to_peer_major(outputs, permutation), recv_sizes)

    @staticmethod
    def backward(ctx, grad):
        return (to_expert_major(exchange(ctx.comm, grad, ctx.send_sizes), ctx.permutation),)
