"""Tensor parallelism (Megatron-LM): each layer split across the ranks of a group.

- ``operators``  ``f`` and ``g``, the conjugate all-reduce operators, as autograd ops
- ``layers``     ``ColumnParallelLinear`` and ``RowParallelLinear``, made from a dense Linear
- ``gpt``        the GPT's blocks split: attention by heads, the MLP column-then-row;
                 ``parallelize_gpt``

The first part of the wing (issue 20): the vocabulary-parallel embedding and loss,
sequence parallelism and the ``--strategy tp`` driver come next.
Source: Shoeybi et al., "Megatron-LM" (2019), section 3.
"""
from minidist.parallel.tensor_parallel.gpt import (
    ParallelMLP,
    ParallelSelfAttention,
    TensorParallelGPT,
    join_shards,
    parallelize_gpt,
)
from minidist.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, shard_bounds
from minidist.parallel.tensor_parallel.operators import (
    copy_to_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
)

__all__ = ["parallelize_gpt", "TensorParallelGPT", "join_shards", "ParallelSelfAttention", "ParallelMLP",
           "ColumnParallelLinear", "RowParallelLinear", "shard_bounds", "copy_to_tensor_parallel_region",
           "reduce_from_tensor_parallel_region"]
