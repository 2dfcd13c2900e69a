"""Tensor parallelism (Megatron-LM): each layer split across the ranks of a group.

- ``operators``  ``f`` and ``g``, the conjugate all-reduce operators, as autograd ops, and
                 sequence parallelism's pair (all-gather / reduce-scatter along the sequence)
- ``layers``     ``ColumnParallelLinear`` and ``RowParallelLinear``, made from a dense Linear
- ``vocab``      the vocabulary split: ``VocabParallelEmbedding``, ``vocab_parallel_cross_entropy``
- ``gpt``        the GPT split: attention by heads, the MLP column-then-row, the tied
                 embedding and head by vocabulary, optionally the sequence between them;
                 ``parallelize_gpt`` (**contract**)
- ``plan``       the tensor-parallel plan, written once: which parameter is cut along which axis
                 (``is_sharded``, ``join_shards``, ``shard_of``)
- ``reshard``    a tp checkpoint cut again for another number of ranks, or joined into one model
- ``train``      the driver of ``train --model gpt --strategy tp [--sequence-parallel]``
- ``strategy``   ``STRATEGY``: what ``--strategy tp`` takes and can do; the ``--tp`` and
                 ``--sequence-parallel`` flags other strategies take too

Sources: Shoeybi et al., "Megatron-LM" (2019), section 3; Korthikanti et al., "Reducing
Activation Recomputation in Large Transformer Models" (2022), section 4.2.2.
"""
from minidist.parallel.tensor_parallel.gpt import (
    ParallelMLP,
    ParallelSelfAttention,
    SequenceParallelLayerNorm,
    SequenceParallelPositionEmbedding,
    TensorParallelGPT,
    check_split,
    is_sharded,
    join_shards,
    parallelize_gpt,
)
from minidist.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, shard_bounds
from minidist.parallel.tensor_parallel.operators import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from minidist.parallel.tensor_parallel.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = ["parallelize_gpt", "TensorParallelGPT", "check_split", "is_sharded", "join_shards",
           "ParallelSelfAttention", "ParallelMLP", "SequenceParallelLayerNorm", "SequenceParallelPositionEmbedding",
           "ColumnParallelLinear", "RowParallelLinear", "shard_bounds", "copy_to_tensor_parallel_region",
           "reduce_from_tensor_parallel_region", "gather_from_sequence_parallel_region",
           "reduce_scatter_to_sequence_parallel_region", "VocabParallelEmbedding", "vocab_parallel_cross_entropy"]
