"""The ranks as an n-dimensional mesh, one sub-communicator per dimension (torch's ``DeviceMesh``).

3-D parallelism (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", SC 2021) puts each of P = D x S x T ranks at a coordinate
(dp, pp, tp) and gives it three groups: the T ranks that split the same layers (tensor
parallel), the S ranks of its pipeline, and the D replicas that hold the same shards of the
same stage (data parallel). The rank numbers follow the coordinates in row-major (C) order,
the last dimension fastest:

    rank = (dp_rank * S + pp_rank) * T + tp_rank

so with the names ``("dp", "pp", "tp")`` the T ranks of a tensor-parallel group are
neighbours. That is the point of the order: the launcher fills a node with consecutive ranks,
and tensor parallelism, which talks at every layer (two all-reduces forward, two backward),
must stay on the node's fast links (NVLink); the pipeline sends one activation per micro-batch
and stage, and data parallelism one all-reduce per step, so they can cross the slower network.
P = 8, shape (2, 2, 2):

               pp_rank 0    pp_rank 1
    dp_rank 0   [0  1]       [2  3]        [a b]: one tensor-parallel group (tp_rank 0, 1)
    dp_rank 1   [4  5]       [6  7]

    tp groups: [0 1] [2 3] [4 5] [6 7]     (the other coordinates fixed, tp varying)
    pp groups: [0 2] [1 3] [4 6] [5 7]     (one pipeline per (dp, tp))
    dp groups: [0 4] [1 5] [2 6] [3 7]     (the replicas of one shard of one stage)

A dimension's groups are the lines of the grid along it: fix every other coordinate, sweep
this one. Each group is one ``comm.Split`` (MPI_Comm_split): the colour numbers the line (the
other coordinates, row-major), the key orders the ranks by their coordinate along it, so a
rank's ``Get_rank()`` in its group is its coordinate there. picotron's
``ProcessGroupManager`` and torchtitan's ``ParallelDims`` enumerate the same groups from
``torch.arange(P).view(dp, pp, tp)``; :func:`mesh_groups` is that enumeration, for tests and
drawings.
"""
from __future__ import annotations

import math

import numpy

from minidist.p2p import CollectiveError, CollectiveTimeout, agree


def check_mesh(world_size: int, shape, names) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Validate a mesh's ``shape`` (positive ints) and ``names`` (distinct strings, one per
    dimension) against ``world_size`` ranks; return them as tuples. Raises ValueError naming
    the fix: a product of the sizes other than the world size, a size that is not a positive
    integer, repeated or missing names."""
    shape, names = tuple(shape), tuple(names)
    if not shape or any(isinstance(s, bool) or not isinstance(s, (int, numpy.integer)) or s < 1 for s in shape):
        raise ValueError(f"a mesh's shape is one or more positive integers (ranks along each dimension), got {shape}")
    shape = tuple(int(s) for s in shape)
    if len(names) != len(shape) or not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
        raise ValueError(f"a mesh needs one distinct name per dimension, e.g. ('dp', 'pp', 'tp') for a shape of "
                         f"three; got names {names} for shape {shape}")
    if math.prod(shape) != world_size:
        given = " x ".join(f"{n}={s}" for n, s in zip(names, shape))
        raise ValueError(f"a mesh of {given} holds {math.prod(shape)} ranks, but the communicator has {world_size}; "
                         f"choose sizes whose product is {world_size} (or run on {math.prod(shape)} ranks)")
    return shape, names


def mesh_groups(shape, dim: int) -> list[list[int]]:
    """Every group along dimension ``dim`` of a mesh of ``shape``, as lists of ranks: the lines
    of ``numpy.arange(P).reshape(shape)`` along ``dim`` (the other coordinates fixed, in
    row-major order), each line in coordinate order. Pure (no communicator): for tests and
    pictures. Shape (2, 2, 2), dim 2 -> [[0, 1], [2, 3], [4, 5], [6, 7]]."""
    grid = numpy.arange(math.prod(shape)).reshape(shape)
    return numpy.moveaxis(grid, dim, -1).reshape(-1, shape[dim]).tolist()


class DeviceMesh:
    """This rank's place in a mesh of ranks and its group along each dimension (**contract**;
    module docstring). ``DeviceMesh(comm, (2, 2, 2), ("dp", "pp", "tp"))`` on 8 ranks.

    Args:
        comm: mpi4py or ``minidist.sim`` communicator of P ranks; every rank calls this
            (collective: one agreement round, then one ``comm.Split`` per dimension).
        shape: ranks along each dimension, product P; the last dimension varies fastest
            (put tensor parallelism last, so its groups are neighbours).
        names: one distinct name per dimension.

    Attributes: ``shape``, ``names``, ``coordinate`` (this rank's index along each dimension,
    a tuple; torch's ``get_coordinate()``), ``comm``.

    Raises ValueError (every rank alike, before any message) for a shape whose product is not
    P or bad names (:func:`check_mesh`); CollectiveTimeout (a TimeoutError) naming the ranks not
    heard from when some rank does not arrive within the deadline (``comm.Split`` itself
    cannot time out, so the ranks meet in one :func:`minidist.p2p.agree` round first);
    CollectiveError on every rank when the ranks ask for different meshes.
    """

    def __init__(self, comm, shape, names):
        self.shape, self.names = check_mesh(comm.Get_size(), shape, names)
        self.comm = comm
        rank = comm.Get_rank()
        self.coordinate = tuple(int(c) for c in numpy.unravel_index(rank, self.shape))
        try:
            asked = agree(comm, payload=(self.shape, self.names), what="device mesh")
        except CollectiveTimeout as error:
            raise CollectiveTimeout(f"device mesh (before comm.Split): {error}", error.rank, error.missing) from None
        if len(set(asked)) > 1:
            listed = ", ".join(f"rank {r}: {dict(zip(n, s))}" for r, (s, n) in enumerate(asked))
            raise CollectiveError(f"device mesh: the ranks ask for different meshes ({listed}); give every rank the "
                                  "same sizes")
        self._groups = {}
        for dim, name in enumerate(self.names):
            others = [c for d, c in enumerate(self.coordinate) if d != dim]
            other_shape = [s for d, s in enumerate(self.shape) if d != dim]
            color = int(numpy.ravel_multi_index(others, other_shape)) if others else 0
            self._groups[name] = comm.Split(color=color, key=self.coordinate[dim])

    def _dim(self, name: str) -> int:
        if name not in self.names:
            raise ValueError(f"this mesh has no dimension {name!r}; its dimensions are {', '.join(self.names)}")
        return self.names.index(name)

    def get_group(self, name: str):
        """The sub-communicator along dimension ``name``: the ranks that differ from this one in
        that coordinate only; its ``Get_rank()`` is this rank's coordinate there and its
        ``Get_size()`` the dimension's size. Raises ValueError for an unknown name."""
        return self._groups[self.names[self._dim(name)]]

    def get_local_rank(self, name: str) -> int:
        """This rank's coordinate along ``name`` (torch's ``DeviceMesh.get_local_rank``)."""
        return self.coordinate[self._dim(name)]

    def size(self, name: str | None = None) -> int:
        """The number of ranks along ``name``, or in the whole mesh when ``name`` is None."""
        return math.prod(self.shape) if name is None else self.shape[self._dim(name)]

    def groups(self, name: str) -> list[list[int]]:
        """Every group along ``name`` as lists of ranks of ``comm`` (:func:`mesh_groups`)."""
        return mesh_groups(self.shape, self._dim(name))

    def rank_names(self, name: str) -> list[str]:
        """How the job names the ranks of this rank's group along ``name``: entry i is
        "<rank in comm> (<name> rank i)", e.g. "5 (pp rank 1)". A communicator that carries
        them as ``rank_names`` (a ``tracing.CountingComm`` wrapping the group, say) has its
        timeouts name the silent rank so (``p2p.wait_all``), not by its number in the group."""
        dim = self._dim(name)
        line = next(group for group in mesh_groups(self.shape, dim) if self.comm.Get_rank() in group)
        return [f"{rank} ({name} rank {i})" for i, rank in enumerate(line)]

    def free(self):
        """Release the sub-communicators (``Free()``; a no-op on the sim). Collective."""
        for group in self._groups.values():
            group.Free()
        self._groups = {}

    def __repr__(self):
        sizes = ", ".join(f"{n}={s}" for n, s in zip(self.names, self.shape))
        where = ", ".join(f"{n}={c}" for n, c in zip(self.names, self.coordinate))
        return f"DeviceMesh({sizes}; this rank {self.comm.Get_rank()} at {where})"
