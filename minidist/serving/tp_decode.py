"""Tensor-parallel decoding: the GPT split over a tensor-parallel group, its KV cache split by heads.

**Tensor-parallel decode** (Megatron-LM's split of chapter 14, Shoeybi et al. 2019, used for
inference as in Pope et al., MLSys 2023, section 3): each rank holds its heads of every attention
layer, its features of every MLP and its rows of the vocabulary (``parallelize_gpt``), and so the
keys and values of its own heads only: the KV cache is split by heads too, 1/T of it per rank. A
decode step costs two all-reduces per block (of B x C numbers: one token per sequence), and the
logits stay split until the sampler needs them: only the last position's, (B, V / T) per rank, are
all-gathered (Megatron's ``gather_output`` at the end of the pipeline's last stage). Every rank runs
the same :class:`~minidist.serving.scheduler.Scheduler` on the same requests: the gathered logits
are the same bytes on every rank, so each draws the same tokens with the request's seed and the
schedulers stay in step without another message.
(Replicas of the whole model behind one front: :mod:`minidist.serving.replicas`.)
"""
from __future__ import annotations

import numpy as np

from minidist import backend
from minidist.collectives import all_gather, chunk_bounds
from minidist.models.gpt import GPT, cached_attention
from minidist.parallel.tensor_parallel import ParallelSelfAttention, parallelize_gpt


class CachedParallelSelfAttention(ParallelSelfAttention):
    """A rank's heads of causal self-attention (``ParallelSelfAttention``) that can also run with a
    KV cache: ``forward(x, kv_cache, layer)`` stores its heads' keys and values there and attends to
    them (``models.gpt.cached_attention``). Without a cache, the parent's forward."""

    def forward(self, x, kv_cache=None, layer=0):
        if kv_cache is None:
            return super().forward(x)
        h = self.last_head - self.first_head
        qkv = self.c_attn(x)
        b, t = qkv.shape[:2]
        qkv = qkv.reshape(b, t, 3, h, self.head_dim).transpose(2, 0, 3, 1, 4)
        y = cached_attention(kv_cache, layer, qkv[0], qkv[1], qkv[2])  # (B, h, t, d)
        return self.c_proj(y.transpose(0, 2, 1, 3).reshape(b, t, h * self.head_dim))


class TensorParallelDecoder:
    """A GPT split over the tensor-parallel group ``comm`` for decoding (module docstring): what a
    :class:`~minidist.serving.scheduler.Scheduler` runs on each rank of the group.

    Args:
        model: the dense GPT, the same on every rank (dropout 0).
        comm: the tensor-parallel group (mpi4py's ``COMM_WORLD``, a sim communicator, a Split).

    ``forward_cached(idx, kv_cache)`` returns the whole logits (B, V) of each row's last position
    (float NumPy, the same bytes on every rank), from this rank's vocabulary columns all-gathered;
    ``config`` is the dense model's. Collective: every rank of ``comm`` makes the same calls.
    Raises ValueError as ``parallelize_gpt`` does (heads or MLP features not divisible by the size).
    """

    def __init__(self, model: GPT, comm):
        self.module = parallelize_gpt(model, comm)
        for block in self.module.transformer.h:
            a = block.attn
            block.attn = CachedParallelSelfAttention(a.c_attn, a.c_proj, (a.first_head, a.last_head), a.head_dim)
        self.config, self.comm = model.config, comm
        self.vocab_bounds = chunk_bounds(model.config.vocab_size, comm.Get_size())  # every rank's columns

    def forward_cached(self, idx, kv_cache) -> np.ndarray:
        """The last position's logits (B, V), gathered: each rank's (B, V / T) columns padded to
        the widest, one all-gather, the padding cut (collective)."""
        local = backend.to_numpy(GPT.forward_cached(self.module, idx, kv_cache).data)
        width = max(stop - start for start, stop in self.vocab_bounds)
        padded = np.zeros((local.shape[0], width), dtype=local.dtype)
        padded[:, :local.shape[1]] = local
        parts = all_gather(self.comm, padded)  # (T, B, width)
        return np.concatenate([parts[r, :, :stop - start] for r, (start, stop) in enumerate(self.vocab_bounds)],
                              axis=1)
