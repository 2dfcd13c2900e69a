"""Tensor parallelism (Megatron-LM): each layer split across the ranks of a group.

- ``operators``  ``f`` and ``g``, the conjugate all-reduce operators, as autograd ops
- ``layers``     ``ColumnParallelLinear`` and ``RowParallelLinear``, made from a dense Linear
- ``vocab``      the vocabulary split: ``VocabParallelEmbedding``, ``vocab_parallel_cross_entropy``
- ``gpt``        the GPT split: attention by heads, the MLP column-then-row, the tied
                 embedding and head by vocabulary; ``parallelize_gpt``

The first part of the wing (issue 20): sequence parallelism and the ``--strategy tp``
driver come next.
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
from minidist.parallel.tensor_parallel.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = ["parallelize_gpt", "TensorParallelGPT", "join_shards", "ParallelSelfAttention", "ParallelMLP",
           "ColumnParallelLinear", "RowParallelLinear", "shard_bounds", "copy_to_tensor_parallel_region",
           "reduce_from_tensor_parallel_region", "VocabParallelEmbedding", "vocab_parallel_cross_entropy"]
