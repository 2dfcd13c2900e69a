"""The GPT's blocks split across a tensor-parallel group (Megatron-LM's layout).

Shoeybi et al. 2019 (section 3, figure 3) split both halves of a transformer block so that
each needs one all-reduce forward and one backward:

- **the MLP**: ``c_fc`` (C -> 4C) column-parallel, the GELU on each rank's own features,
  ``c_proj`` (4C -> C) row-parallel;
- **attention, by heads**: each rank takes a block of the heads (uneven when T does not divide
  n_head: ``numpy.array_split``'s cut). ``c_attn`` is column-parallel with the q, k and v rows
  of those heads (three separate blocks of its 3C rows), the heads attend on their own rank
  (attention never mixes heads), and ``c_proj`` is row-parallel over the same heads' channels.

- **the vocabulary** (:mod:`minidist.parallel.tensor_parallel.vocab`): the token embedding
  and the output layer that shares its weight are cut by vocabulary rows, and the loss is
  computed from each rank's part of the logits, which are never gathered.

The position embedding and the LayerNorms stay whole on every rank: each rank computes them
on the same input and gets the same gradient, since ``f`` has summed the split layers'
contributions. Sequence parallelism and the training driver are the next parts of issue 20.
"""
from __future__ import annotations

import copy
from collections import OrderedDict

import numpy as np

from minidist import functions as F
from minidist import nn
from minidist.models.gpt import GPT
from minidist.p2p import agree
from minidist.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, shard_bounds
from minidist.parallel.tensor_parallel.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy


class ParallelSelfAttention(nn.Module):
    """Causal self-attention over this rank's heads ``first_head:last_head`` (module
    docstring): (B, T, C) whole on every rank -> (B, T, C) whole on every rank. Parameter
    names as the dense ``CausalSelfAttention``'s (``c_attn``, ``c_proj``), shapes sharded:
    c_attn.weight (3 · h · d, C), c_proj.weight (C, h · d) for h heads of d channels here."""

    def __init__(self, c_attn: ColumnParallelLinear, c_proj: RowParallelLinear, heads: tuple[int, int], head_dim: int):
        super().__init__()
        self.c_attn, self.c_proj = c_attn, c_proj
        self.first_head, self.last_head = heads
        self.head_dim = head_dim

    @classmethod
    def from_dense(cls, attn, comm) -> ParallelSelfAttention:
        """This rank's heads of a dense ``models.gpt.CausalSelfAttention``. Raises ValueError
        when ``comm`` has more ranks than heads, or the model has dropout (each rank would draw
        its own masks, and the split would no longer compute the dense model)."""
        if attn.attn_dropout.p or attn.resid_dropout.p:
            raise ValueError("tensor parallelism here needs dropout = 0: the split model's dropout masks would not "
                             "be the dense model's; build the GPT with GPTConfig(dropout=0.0)")
        c, d = attn.n_embd, attn.n_embd // attn.n_head
        first, last = shard_bounds(attn.n_head, comm, "heads")
        mine = np.arange(first * d, last * d)
        c_attn = ColumnParallelLinear.from_dense(attn.c_attn, comm, rows=np.concatenate([mine, c + mine, 2 * c + mine]))
        c_proj = RowParallelLinear.from_dense(attn.c_proj, comm, columns=mine)
        return cls(c_attn, c_proj, (first, last), d)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.last_head - self.first_head
        qkv = self.c_attn(x).reshape(b, t, 3, h, self.head_dim).transpose(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)  # (B, h, T, d)
        return self.c_proj(y.transpose(0, 2, 1, 3).reshape(b, t, h * self.head_dim))


class ParallelMLP(nn.Module):
    """The block's MLP with ``c_fc`` column-parallel and ``c_proj`` row-parallel (module
    docstring): (B, T, C) -> (B, T, C), whole on every rank; names as the dense ``MLP``'s."""

    def __init__(self, c_fc: ColumnParallelLinear, c_proj: RowParallelLinear):
        super().__init__()
        self.c_fc, self.gelu, self.c_proj = c_fc, nn.GELU(approximate="tanh"), c_proj

    @classmethod
    def from_dense(cls, mlp, comm) -> ParallelMLP:
        """This rank's 4C / T features of a dense ``models.gpt.MLP`` (dropout must be 0)."""
        if mlp.dropout.p:
            raise ValueError("tensor parallelism here needs dropout = 0 (see ParallelSelfAttention.from_dense)")
        return cls(ColumnParallelLinear.from_dense(mlp.c_fc, comm), RowParallelLinear.from_dense(mlp.c_proj, comm))

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class TensorParallelGPT(GPT):
    """What :func:`parallelize_gpt` returns: a GPT whose blocks hold this rank's shards
    (``ParallelSelfAttention``, ``ParallelMLP``), whose tied token embedding and output layer
    hold this rank's vocabulary rows (``VocabParallelEmbedding``, a ``ColumnParallelLinear``
    sharing its weight), and whose position embedding and LayerNorms are whole. Called as the
    dense GPT is, ``model(idx, targets) -> (logits, loss)`` (the loss the same on every rank,
    the logits this rank's columns); ``comm`` is its tensor-parallel group. Build it with
    :func:`parallelize_gpt`."""

    def __init__(self, dense: GPT, comm):
        nn.Module.__init__(self)  # not GPT.__init__: the weights are the dense model's, not new ones
        whole = copy.deepcopy(dense)  # one deepcopy: the tied embedding and head stay one Parameter
        self.config, self.comm = whole.config, comm
        self.transformer = whole.transformer
        for block in self.transformer.h:
            block.attn = ParallelSelfAttention.from_dense(block.attn, comm)
            block.mlp = ParallelMLP.from_dense(block.mlp, comm)
        wte = self.transformer.wte = VocabParallelEmbedding.from_dense(whole.transformer.wte, comm)
        self.lm_head = ColumnParallelLinear(wte.weight.data, None, comm, whole.config.n_embd,
                                            whole.config.vocab_size, wte.start, wte.stop)
        self.lm_head.weight = wte.weight  # tied, as in the dense model: one Parameter, this rank's rows

    def forward(self, idx, targets=None):
        """This rank's part of the logits and the loss (the dense GPT's ``forward``, split).

        Returns ``(logits, loss)``: logits (B, T, stop - start), this rank's vocabulary
        columns ``lm_head.start:lm_head.stop`` (Megatron's ``parallel_output``: never
        gathered); loss the mean cross-entropy, the same scalar on every rank, or None
        without targets. Raises ValueError as the dense GPT does. Collective."""
        logits = self.lm_head(self._trunk(idx))  # f inside: the head uses all of x on every rank
        if targets is None:
            return logits, None
        b, t, v = logits.shape
        target_ids = self._target_ids(targets, b, t)
        loss = vocab_parallel_cross_entropy(logits.reshape(b * t, v), target_ids.reshape(-1), self.comm,
                                            self.lm_head.start)
        return logits, loss

    def generate(self, *args, **kwargs):
        """Not on the split model: sampling needs every token's logit. Raises
        NotImplementedError naming what to do instead."""
        raise NotImplementedError("TensorParallelGPT.generate: sampling needs the whole logits; build a dense model "
                                  "with GPT(model.config).load_state_dict(model.full_state_dict()) (every rank calls "
                                  "full_state_dict) and call its generate")

    def full_state_dict(self) -> dict:
        """The dense GPT's state dict (its names and shapes), put together from every rank's
        shards: a collective (every rank calls it; every rank gets the whole dict). The
        shards travel as one pickled record per rank (:func:`minidist.p2p.agree`), fine for
        the course's models. Load it into ``GPT(config)`` with ``load_state_dict``."""
        mine = self.state_dict()
        everyone = agree(self.comm, None, mine, what="full_state_dict")
        return OrderedDict((name, join_shards(name, [their[name] for their in everyone])) for name in mine)


def join_shards(name: str, shards: list):
    """One dense parameter from the ranks' pieces, in rank order (module docstring's layout):
    attention's c_attn keeps q, k and v apart (each rank holds its heads' rows of each), the
    MLP's c_fc and the tied embedding and head are cut by rows, both c_proj weights by
    columns; every other parameter is whole on every rank, and rank 0's copy is returned."""
    if ".attn.c_attn." in name:
        parts = [s.reshape(3, -1, *s.shape[1:]) for s in shards]
        joined = np.concatenate(parts, axis=1)
        return joined.reshape(-1, *joined.shape[2:])
    if ".mlp.c_fc." in name or name in ("transformer.wte.weight", "lm_head.weight"):
        return np.concatenate(shards)
    if name.endswith("c_proj.weight"):
        return np.concatenate(shards, axis=1)
    return shards[0]


def parallelize_gpt(model: GPT, comm) -> TensorParallelGPT:
    """A copy of ``model`` whose blocks hold only this rank's shards (module docstring); the
    model itself is left as it was. Every rank must pass the same dense model (the same
    seed); the copy computes what it computes, the same logits and loss on every rank, with
    one all-reduce forward and one backward per attention and per MLP. Parameter names are
    the dense model's, shapes sharded (the tied embedding and head by vocabulary rows);
    ``full_state_dict()`` gives the dense weights back; the logits it returns are this rank's
    vocabulary columns (:meth:`TensorParallelGPT.forward`).
    Collective when run (forward, backward, full_state_dict).

    Raises ValueError when ``comm`` has more ranks than heads, or the model has dropout.
    Source: Shoeybi et al. 2019, section 3.
    """
    return TensorParallelGPT(model, comm)
