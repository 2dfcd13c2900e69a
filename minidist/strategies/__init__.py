"""The drivers of ``python -m minidist train``, one file per strategy.

Each takes a :class:`minidist.train.TrainConfig` (and, when distributed, a communicator such as
``mpi4py.MPI.COMM_WORLD`` or a ``minidist.sim`` rank's) and returns a
:class:`minidist.train.TrainResult` on the reporting rank, None elsewhere. They all train with
the one loop, :func:`minidist.train.fit`, each with its own step function.
"""
from minidist.strategies.ddp import train_ddp
from minidist.strategies.pipedream import train_pipedream
from minidist.strategies.pipeline import check_pipeline, measured_bubble, pipeline_layout, train_pipeline
from minidist.strategies.ps import train_ps
from minidist.strategies.single import train_single

__all__ = ["check_pipeline", "measured_bubble", "pipeline_layout", "train_ddp", "train_pipedream", "train_pipeline",
           "train_ps", "train_single"]
