"""Serving a GPT: a paged KV cache, a continuous-batching scheduler, tensor-parallel and replicated
decoding, and the HTTP endpoint of ``minidist serve``.

- ``kv_cache``    ``PagedKVCache``: fixed-size KV blocks, a block table per sequence, a free list
                  (PagedAttention, Kwon et al., SOSP 2023)
- ``scheduler``   ``Request``, ``Event``, ``Scheduler``: iteration-level scheduling (Orca, Yu et al.,
                  OSDI 2022), per-request sampling, static batching for comparison
- ``tp_decode``   ``TensorParallelDecoder``: decoding with the GPT split over a tensor-parallel group
                  (chapter 14's split), the KV cache split by heads, the logits gathered only to sample
- ``replicas``    ``ReplicaFront``, ``serve_replica``: replicas of the whole model behind one front
                  (data-parallel serving)
- ``server``      the HTTP endpoint (``minidist serve``)

The dense cache a single ``GPT.generate`` uses is in :mod:`minidist.models.kv_cache` (below this
package: the model does not import serving).
"""
from minidist.serving.kv_cache import PagedBatch, PagedKVCache
from minidist.serving.replicas import ReplicaFront, serve_replica
from minidist.serving.scheduler import Event, Request, Scheduler
from minidist.serving.tp_decode import CachedParallelSelfAttention, TensorParallelDecoder

__all__ = ["CachedParallelSelfAttention", "Event", "PagedBatch", "PagedKVCache", "ReplicaFront", "Request",
           "Scheduler", "TensorParallelDecoder", "serve_replica"]
