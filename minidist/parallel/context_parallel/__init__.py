"""Context parallelism: every sequence cut over the ranks of a ``cp`` group, attention across them.

Long context is a memory problem before it is a compute problem: a layer's activations grow
with T, attention's scores with T². Context parallelism gives each of P ranks T / P positions
of every sequence for the whole model; everything but attention works position by position, and
attention brings the other positions' keys and values (or heads) over the network. The files,
in reading order:

- ``layout``     which positions each rank holds: contiguous, or zig-zag (chunks r and 2P-1-r);
                 ``shard_sequence`` (**contract**) and its inverse ``gather_sequence``
- ``blocks``     attention of a rank's query chunks to one piece of keys, chunk pair by chunk
                 pair, skipping what the causal mask hides; ``BlockCounter``
- ``ring``       Ring Attention: K/V blocks around a ring, overlapped with the compute; a second
                 ring carries dK, dV back
- ``allgather``  Llama 3's all-gathered K/V, reduce-scattered gradients
- ``ulysses``    DeepSpeed-Ulysses: all-to-all from sequence-sharded to head-sharded and back
- ``dispatch``   ``context_parallel_attention`` (**contract**): the four variants behind one call
- ``gpt``        the GPT laid out for cp from outside: each block's attention on this rank's
                 positions, the position embedding at the shard's true positions, the loss
- ``compose``    cp around tensor parallelism: the tp GPT's heads attended over cp
- ``train``      the driver of ``train --model gpt --strategy cp --cp-variant V [--dp D] [--tp T]``
- ``strategy``   ``STRATEGY`` and the ``--cp-variant`` flag

Sources: Liu et al., "Ring Attention with Blockwise Transformers for Near-Infinite Context"
(2023); Dubey et al., "The Llama 3 Herd of Models" (2024), section 3.3.2; Jacobs et al.,
"DeepSpeed Ulysses" (arXiv 2309.14509); Dao, "FlashAttention-2" (2023); picotron's
``context_parallel/``; torch's ``torch/distributed/tensor/experimental/_attention.py``.
"""
from minidist.parallel.context_parallel.blocks import BlockCounter
from minidist.parallel.context_parallel.dispatch import context_parallel_attention
from minidist.parallel.context_parallel.layout import (
    VARIANTS,
    gather_sequence,
    rank_chunks,
    rank_positions,
    shard_lengths,
    shard_sequence,
)

__all__ = ["context_parallel_attention", "shard_sequence", "gather_sequence", "BlockCounter", "VARIANTS",
           "rank_chunks", "rank_positions", "shard_lengths"]
