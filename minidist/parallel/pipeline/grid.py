"""Data x pipeline parallelism: the ranks as a 2-D grid, D pipelines of S stages each.

With P ranks and D data-parallel replicas, each replica is a pipeline of S = P / D ranks.
A rank has two coordinates, named by dimension as in picotron and Megatron-LM:

    pp_rank = rank % S      its place in its pipeline (which stage(s) it holds)
    dp_rank = rank // S     which pipeline it belongs to (which shard of the data it reads)

so the ranks of one pipeline are contiguous (on a cluster: one pipeline per node keeps its
frequent activation traffic on the fast links inside the node). P = 4, D = 2:

                 pp_rank 0   pp_rank 1
    dp_rank 0     rank 0      rank 1      <- pp_comm: one pipeline
    dp_rank 1     rank 2      rank 3
                    ^
                    dp_comm: the replicas of stage 0

Two communicators come from a 2-D :class:`~minidist.parallel.mesh.DeviceMesh` of shape
(D, S), names ("dp", "pp"), one ``comm.Split`` (MPI_Comm_split) each: ``pp_comm`` joins the
ranks of one pipeline (ranked by pp_rank), over which activations and gradients flow;
``dp_comm`` joins the ranks that hold the same stages in different pipelines (ranked by
dp_rank). With tensor parallelism inside each stage the mesh has a third dimension
(:meth:`ProcessGrid.from_mesh`, the 3-D driver). Each pipeline runs its schedule on its own shard of every global batch;
after the flush each stage's gradients hold the mean over that pipeline's batch, and one
all-reduce over ``dp_comm`` (sum, then / D) turns them into the mean over the global batch,
exactly as data parallelism does for whole models (Narayanan et al., "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", SC 2021, sec. 2.2 and 3).
Cost per step and stage: one all-reduce of that stage's gradients among D ranks; the
pipelines' traffic never crosses.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy

from minidist import backend, nn
from minidist.collectives import all_reduce
from minidist.p2p import CollectiveError, CollectiveTimeout, agree
from minidist.parallel.mesh import DeviceMesh


@dataclass
class ProcessGrid:
    """This rank's place in a D x S grid of P ranks (module docstring).

    Attributes: ``dp_size`` D (pipelines), ``pp_size`` S (ranks per pipeline), ``dp_rank``,
    ``pp_rank``, ``pp_comm`` (this rank's pipeline; its ``Get_rank()`` is ``pp_rank``),
    ``dp_comm`` (the ranks holding the same stages; its ``Get_rank()`` is ``dp_rank``),
    ``mesh`` (the :class:`~minidist.parallel.mesh.DeviceMesh` they come from).
    """

    dp_size: int
    pp_size: int
    dp_rank: int
    pp_rank: int
    pp_comm: object
    dp_comm: object
    mesh: object = None

    @classmethod
    def create(cls, comm, dp: int = 1) -> ProcessGrid:
        """Split ``comm`` (mpi4py or ``minidist.sim``, P ranks) into ``dp`` pipelines of P / dp
        ranks. Collective: every rank of ``comm`` calls it. Raises ValueError (on every rank
        alike, before any message) when ``dp`` is not a positive integer dividing P.

        ``comm.Split`` (MPI_Comm_split) cannot time out: a rank that stopped before it would
        leave the others waiting forever. So the ranks first meet in one
        :func:`minidist.p2p.agree` round with the collectives' deadline (train's ``--timeout``),
        which also checks that they ask for the same ``dp``; raises CollectiveTimeout (a
        TimeoutError) naming the ranks not heard from, CollectiveError (on every rank) when
        the ranks' ``dp`` differ."""
        world_size = comm.Get_size()
        check_grid(world_size, dp)
        pp_size = world_size // dp
        rank = comm.Get_rank()
        pp_rank, dp_rank = rank % pp_size, rank // pp_size
        try:
            asked = agree(comm, payload=dp)
        except CollectiveTimeout as error:
            raise CollectiveTimeout(f"pipeline grid (before comm.Split): {error}", error.rank, error.missing) from None
        if len(set(asked)) > 1:
            raise CollectiveError(f"pipeline grid: the ranks ask for different numbers of pipelines (--dp): {asked} "
                                  "in rank order; give every rank the same --dp")
        grid = cls.from_mesh(DeviceMesh(comm, (dp, pp_size), ("dp", "pp")))
        assert (grid.dp_rank, grid.pp_rank) == (dp_rank, pp_rank), "the mesh numbers the ranks row-major"
        return grid

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh) -> ProcessGrid:
        """The grid of a mesh with dimensions named "dp" and "pp" (and others, e.g. "tp": each
        (dp, pp) grid of one tp_rank is then one set of pipelines). Raises ValueError when the
        mesh lacks either name."""
        return cls(mesh.size("dp"), mesh.size("pp"), mesh.get_local_rank("dp"), mesh.get_local_rank("pp"),
                   mesh.get_group("pp"), mesh.get_group("dp"), mesh)

    def free(self):
        """Release the communicators (``Free()``; a no-op on the sim)."""
        if self.mesh is not None:
            self.mesh.free()
        else:
            self.pp_comm.Free()
            self.dp_comm.Free()


def check_grid(world_size: int, dp: int) -> None:
    """Raise ValueError, naming the fix, unless ``dp`` is a positive integer dividing ``world_size``."""
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"--dp must be a positive integer (pipelines side by side), got {dp!r}")
    if world_size % dp:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(f"--dp {dp} does not divide the {world_size} ranks into pipelines of equal length; "
                         f"use one of {', '.join(map(str, divisors))} (or run on a multiple of {dp} ranks)")


def average_gradients(parameters, dp_comm, extra=None):
    """Average the parameters' gradients over ``dp_comm`` in place: one all-reduce (sum) of
    all of them laid end to end (``nn.parameters_to_vector``), then / D, so each ``.grad``
    becomes the mean of the D replicas' gradients (same shape and dtype).

    parameters: this rank's parameters, every one with a gradient, in the same order on every
        rank of ``dp_comm`` (the same stages). extra: optional float (e.g. the pipeline's
        loss) averaged in the same message, so it costs no message of its own.
    Returns the averaged ``extra`` (a float), or None without one.
    Raises ValueError when a parameter has no gradient; CollectiveError/CollectiveTimeout
    from the all-reduce (ranks that disagree on the sizes, a silent rank).
    """
    params = list(parameters)
    missing = [i for i, p in enumerate(params) if p.grad is None]
    if missing:
        raise ValueError(f"average_gradients: parameters {missing} have no gradient; run the step's backward first")
    arrays = [p.grad for p in params]
    if extra is not None:
        like = arrays[0] if arrays else numpy.empty(0)
        arrays.append(backend.get_array_module(like).asarray([extra], dtype=like.dtype))
    flat = nn.parameters_to_vector(arrays)
    total = all_reduce(dp_comm, flat, op="sum")
    total /= dp_comm.Get_size()
    offset = 0
    for p in params:
        p.grad = total[offset:offset + p.grad.size].reshape(p.grad.shape)
        offset += p.grad.size
    return float(total[-1]) if extra is not None else None
