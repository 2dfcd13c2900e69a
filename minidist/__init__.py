"""minidist: a small, readable engine for learning distributed training.

Read it top to bottom, one concept per file:

- ``backend``      NumPy or CuPy, chosen in one place
- ``tensor``       Tensor, Function/Context, no_grad, reverse-mode backward
- ``functions``    the differentiable ops, each forward beside its derivative
- ``nn``, ``optim`` layers, losses and SGD with PyTorch's names
- ``data``         digits/MNIST, DataLoader, DistributedSampler, prefetching
- ``train``        ``fit``: the one training loop every strategy uses
- ``strategies``   the drivers of ``train --strategy``, one file each
- ``sim``          N ranks as threads with mpi4py's method names
- ``p2p``          point-to-point with deadlines, the agreement round
- ``collectives``  broadcast ... all_reduce, built from Send/Recv
- ``parallel``     data parallelism, parameter servers, pipelines

``import minidist as md`` gives ``md.nn``, ``md.optim``, ``md.data``, ``md.collectives``,
``md.sim`` and ``md.parallel``, as ``import torch`` gives ``torch.nn``. The course machinery
(quizzes, exercise checks) lives apart, in ``minidist.course``; the command line in
``minidist.cli``.
"""
from minidist import collectives, data, functions, nn, optim, parallel, sim  # functions installs Tensor's operators
from minidist.anomaly import detect_anomaly, is_anomaly_enabled, set_detect_anomaly
from minidist.tensor import Tensor, is_grad_enabled, no_grad

__version__ = "0.1.0"
__all__ = ["Tensor", "no_grad", "is_grad_enabled", "detect_anomaly", "set_detect_anomaly", "is_anomaly_enabled",
           "functions", "nn", "optim", "data", "sim", "collectives",
           "parallel", "__version__"]
