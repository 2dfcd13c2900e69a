"""minidist: a small, readable engine for learning distributed training.

Read it top to bottom, one concept per file:

- ``backend``      NumPy or CuPy, chosen in one place
- ``tensor``       Tensor, no_grad, reverse-mode backward
- ``functions``    the differentiable ops, each forward beside its derivative
- ``nn``, ``optim`` layers, losses and SGD with PyTorch's names
- ``data``         digits/MNIST, DataLoader, DistributedSampler, prefetching
- ``sim``          N ranks as threads with mpi4py's method names
- ``collectives``  broadcast ... all_reduce, built from Send/Recv
- ``parallel``     data parallelism, parameter servers, pipelines
"""
from minidist.tensor import Tensor, no_grad, is_grad_enabled

__version__ = "0.1.0"
__all__ = ["Tensor", "no_grad", "is_grad_enabled", "__version__"]
