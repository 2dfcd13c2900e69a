"""Parallel training: one wing (a folder) per way of splitting the work, its driver inside.

- ``data_parallel``     DistributedDataParallel (replicas, bucketed gradient all-reduce
                        overlapped with backward), comm hooks, data-parallel inference; ``train``
- ``parameter_server``  workers push gradients to sharded servers (sync, async, bounded
                        staleness); ``train``
- ``pipeline``          the model cut into stages: GPipe, 1F1B, interleaved, zero-bubble
                        schedules and PipeDream; ``train`` and ``train_pipedream``
- ``tensor_parallel``   each layer split across the ranks of a group (Megatron-LM): the f and g
                        operators, column- and row-parallel Linear layers, the vocabulary, the
                        GPT split (``parallelize_gpt``), sequence parallelism; ``train``
- ``zero``              ZeRO-1: each rank keeps the optimizer state of its shard of one flat
                        padded vector (``ZeroRedundancyOptimizer``); ``train`` (``ddp --zero``)
- ``fsdp``              ZeRO-2/3 (``FullyShardedDataParallel``): units of flat parameters,
                        all-gathered to run, gradients reduce-scattered; ``train``
- ``three_d``           data x pipeline x tensor parallelism of the GPT on one mesh (Megatron-LM's
                        PTD-P); ``train`` (``--strategy 3d``) and ``predict`` (its exact bytes)
- ``context_parallel``  each sequence cut over a cp group: ring and zig-zag attention (K/V
                        blocks passed around), all-gathered K/V (Llama 3), Ulysses (all-to-all to
                        head shards); with tp inside and dp around; ``train`` (``--strategy cp``)
- ``expert_parallel``   a mixture of experts' experts spread over an ep group, tokens dispatched
                        and combined by ``all_to_all_v``; ``train`` (``--strategy ep``)
- ``local_sgd``         DiLoCo and Streaming DiLoCo: replicas that train alone for H steps, then
                        an outer step on the averaged change; replicas that leave and join;
                        ``train`` (``--strategy diloco``)

``mesh.py`` (not a wing: what the wings share) numbers the ranks as an n-dimensional
``DeviceMesh`` with one sub-communicator per dimension; the pipeline's 2-D grid and the 3-D
driver are built on it.

Each wing reads top to bottom: the mechanism first, its messages, then ``train.py``, the
driver that ``python -m minidist train --strategy ...`` runs, and ``strategy.py``, the wing's
``STRATEGY`` record (``minidist.strategy.Strategy``: its flags, its rules, what its runs can
do). ``registry`` registers every record, one line per wing: the command line, the
checkpointer and the launcher read what a strategy can do from there, and name none.
"""
# registry last in the names, but it imports every wing itself and registers each one's STRATEGY
from minidist.parallel import (
    context_parallel,
    data_parallel,
    expert_parallel,
    fsdp,
    local_sgd,
    parameter_server,
    pipeline,
    registry,
    tensor_parallel,
    three_d,
    zero,
)
from minidist.parallel.data_parallel import DistributedDataParallel, evaluate
from minidist.parallel.parameter_server import ParameterServer, Worker, train_parameter_server

__all__ = ["DistributedDataParallel", "evaluate", "ParameterServer", "Worker", "train_parameter_server",
           "data_parallel", "parameter_server", "pipeline", "tensor_parallel", "zero", "fsdp", "three_d",
           "context_parallel", "expert_parallel", "local_sgd", "registry"]
