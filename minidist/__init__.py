"""minidist: a small, readable engine for learning distributed training.

Read it in this order, one concept per file (each reads top to bottom):

The engine on one device
- ``backend``          NumPy or CuPy, chosen in one place
- ``tensor``           Tensor, Function/Context, no_grad, reverse-mode backward
- ``functions``        the differentiable ops, each forward beside its derivative
- ``attention``        the transformer's fused ops: softmax, attention, LayerNorm, GELU, embedding
- ``nn``, ``optim``    layers, losses and SGD with PyTorch's names
- ``data``             digits/MNIST, DataLoader, DistributedSampler, prefetching
- ``train``            ``fit``: the one training loop every strategy uses; ``train_single``
- ``strategy``         what a way of training declares (``Strategy``, ``Flag``) and the table the wings register in
- ``workloads``        what a driver trains (model, batches, optimizer, loss, report): the GPT's; the MLP's in ``train``
- ``memory``           bytes per category (parameters, gradients, optimizer, activations), peaks
- ``recompute``        activation checkpointing (``checkpoint``, ``checkpoint_sequential``)
- ``precision``        mixed precision: ``autocast``, ``GradScaler``, float formats
- ``quantization``     int8 post-training quantization for inference
- ``anomaly``          ``detect_anomaly``: the first op that made a NaN or an infinity

Messages between ranks
- ``sim``              N ranks as threads with mpi4py's method names, a trace, deadlock detection,
                       virtual time on a topology of nodes and links
- ``p2p``              the one message layer: posting, the deadline-bounded wait, agreement
- ``costmodel``        alpha-beta costs, the algorithms' names and the choice among them
- ``planner``          choosing a (dp, pp, tp, micro-batch, ZeRO, recomputation) layout for a model on a cluster
- ``planner_moe``      the planner's mixtures of experts: total and active parameters, all-to-alls, ep
- ``collectives``      broadcast ... all_reduce, built from point-to-point messages
- ``agreement_header`` the collectives' agreement on MPI as a 32-byte header (at P = 2 carrying a small vector)
- ``async_collectives`` ``all_reduce(..., async_op=True)``: progress while backward runs
- ``node_layout``      which node each rank is on; the node and column sub-communicators
- ``topology_delay``   DelayComm: fake nodes under mpiexec, cross-node messages delayed
- ``blink``            idle links: broadcast and all-reduce over packed spanning trees (DGX-1 NVLink + PCIe)
- ``tracing``          the one counting communicator; timelines

Ways of splitting the work (``parallel``: one wing, one folder each, its driver and its ``STRATEGY``
record inside; ``parallel.registry`` registers each, one line per wing)
- ``parallel.data_parallel``     DistributedDataParallel, comm hooks, inference
- ``parallel.parameter_server``  servers and workers: sync, async, bounded staleness
- ``parallel.pipeline``          schedules, stages, the executor, PipeDream
- ``parallel.tensor_parallel``   each layer split across ranks (Megatron-LM): f and g, column/row-parallel Linear
- ``parallel.zero``              ZeRO-1: the optimizer's state sharded (ZeroRedundancyOptimizer), the flat padded vector
- ``parallel.fsdp``              ZeRO-2/3, PyTorch's FSDP: gradients and parameters sharded too, units gathered to run
- ``parallel.three_d``           data x pipeline x tensor parallelism of the GPT on one (dp, pp, tp) ``parallel.mesh``
- ``parallel.context_parallel``  each sequence cut over a cp group: ring, zig-zag, all-gathered K/V, Ulysses attention
- ``parallel.expert_parallel``   mixture of experts over an ep group: tokens dispatched and combined by all_to_all_v
- ``parallel.local_sgd``         DiLoCo and Streaming DiLoCo across replicas that sync every H steps, and come and go

Serving a trained model (``serving``: above the wings, below the command line)
- ``serving``          the KV cache in blocks, continuous batching, tensor-parallel and replicated decode,
                       the HTTP endpoint (``minidist serve``)

Surviving failures and running jobs
- ``checkpoint_io``    checkpoint files: atomic, checksummed, the newest valid one
- ``fault``            the Checkpointer: the whole training state, resumed bit for bit
- ``resharding``       a checkpoint's pieces (ZeRO, FSDP) cut again for another number of ranks
- ``replay``           rerun one step from a checkpoint, under detect_anomaly
- ``launch``           mpiexec from Python, the restart supervisor, ``doctor``

``import minidist as md`` gives ``md.nn``, ``md.optim``, ``md.data``, ``md.collectives``,
``md.sim`` and ``md.parallel``, as ``import torch`` gives ``torch.nn``. The course machinery
(quizzes, exercise checks) lives apart, in ``minidist.course``; the command line in
``minidist.cli`` (``--strategy`` and its flags are read off the registered records).
"""
from minidist import collectives, data, functions, nn, optim, parallel, sim  # functions installs Tensor's operators
from minidist.anomaly import detect_anomaly, is_anomaly_enabled, set_detect_anomaly
from minidist.tensor import Tensor, is_grad_enabled, no_grad

__version__ = "0.1.0"
__all__ = ["Tensor", "no_grad", "is_grad_enabled", "detect_anomaly", "set_detect_anomaly", "is_anomaly_enabled",
           "functions", "nn", "optim", "data", "sim", "collectives",
           "parallel", "__version__"]
