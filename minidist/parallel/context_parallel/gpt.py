"""The GPT laid out for context parallelism from outside: each rank runs every layer on its positions.

Under context parallelism (cp) every rank holds the whole model and a part of every sequence
(:mod:`.layout`). Nothing in the GPT but attention and the position embedding knows where a
position sits, so the dense model (``minidist.models.gpt``, left as it is) is laid out by
swapping three of its submodules, as ``tensor_parallel.gpt`` swaps its split layers in:

- the token embedding (:class:`ShardTokenEmbedding`) is handed the whole (B, T) token ids and
  embeds only this rank's positions, so the GPT's own trunk checks the whole sequence's length
  and ids and runs its blocks on (B, t, C);
- the position embedding (:class:`ShardPositionEmbedding`) looks up this rank's *true*
  positions (zig-zag's are two ranges far apart), not 0..t-1;
- each block's attention (:class:`ContextParallelSelfAttention`) is the dense one's c_attn and
  c_proj around ``context_parallel_attention``: its q, k, v are this rank's positions.

The parameters keep the dense names and shapes and are the same on every rank (replicated,
as in data parallelism). The loss (:func:`context_parallel_loss`) is the mean over the whole
sequence, the one-process loss: each rank's mean over its positions, weighted by its share of
the positions, summed over the cp group (one all-reduce of a number). Its backward starts each
rank's part with its weight times P: each rank's parameter gradients then hold P times its part
of the gradient (the attention's messages carry the other ranks' parts of its keys' and values'
gradients home), so the *average* over the cp ranks is the gradient of the one-process loss,
and one data-parallel average over all dp x cp ranks finishes the step (torchtitan does the
same: FSDP over the flattened dp and cp dimensions averages the gradients).
"""
from __future__ import annotations

import copy

from minidist import backend, nn
from minidist import functions as F
from minidist.collectives import all_reduce
from minidist.models.gpt import GPT
from minidist.parallel.context_parallel.dispatch import context_parallel_attention
from minidist.parallel.context_parallel.layout import check_variant, rank_positions
from minidist.tensor import Function


class ShardTokenEmbedding(nn.Module):
    """The token embedding (the dense module's weight, tied to the output layer) looked up at
    this rank's positions: ids (B, T) the whole sequence -> (B, t, C)."""

    def __init__(self, dense: nn.Embedding, comm, variant: str):
        super().__init__()
        self.weight, self.comm, self.variant = dense.weight, comm, variant

    def forward(self, ids):
        positions = rank_positions(ids.shape[1], self.comm.Get_size(), self.comm.Get_rank(), self.variant)
        return F.embedding(ids[:, backend.get_array_module(ids).asarray(positions)], self.weight)


class ShardPositionEmbedding(nn.Module):
    """The position embedding (block_size, C), whole, looked up at this rank's true positions:
    given the whole sequence's positions 0..T-1 -> (t, C)."""

    def __init__(self, dense: nn.Embedding, comm, variant: str):
        super().__init__()
        self.weight, self.comm, self.variant = dense.weight, comm, variant

    def forward(self, positions):
        mine = rank_positions(len(positions), self.comm.Get_size(), self.comm.Get_rank(), self.variant)
        return F.embedding(positions[backend.get_array_module(positions).asarray(mine)], self.weight)


class ContextParallelSelfAttention(nn.Module):
    """Causal self-attention on this rank's positions (B, t, C) -> (B, t, C): the dense
    ``CausalSelfAttention``'s c_attn and c_proj (same names, same Parameters) around
    ``context_parallel_attention`` over ``comm`` with ``variant``. ``counter``: a
    ``BlockCounter`` shared by the layers, or None. Collective."""

    def __init__(self, dense, comm, variant: str, counter=None):
        super().__init__()
        if dense.attn_dropout.p or dense.resid_dropout.p:
            raise ValueError("context parallelism here needs dropout = 0: each rank would draw its own masks for its "
                             "positions, not the one-process model's; build the GPT with GPTConfig(dropout=0.0)")
        self.c_attn, self.c_proj = dense.c_attn, dense.c_proj
        self.n_head, self.n_embd = dense.n_head, dense.n_embd
        self.comm, self.variant, self.counter = comm, variant, counter

    def forward(self, x):
        b, t, c = x.shape
        qkv = self.c_attn(x).reshape(b, t, 3, self.n_head, c // self.n_head).transpose(2, 0, 3, 1, 4)
        y = context_parallel_attention(qkv[0], qkv[1], qkv[2], self.comm, is_causal=True, variant=self.variant,
                                       counter=self.counter)
        return self.c_proj(y.transpose(0, 2, 1, 3).reshape(b, t, c))


class ContextParallelLoss(Function):
    """The cp group's loss from each rank's mean: forward all-reduces (sums) ``weight`` x the
    rank's mean (a scalar) over ``comm``; backward hands the rank's mean ``grad`` x weight x
    ``scale`` (module docstring: scale = P, so that averaging the ranks' gradients gives the
    one-process gradient). Collective forward."""

    @staticmethod
    def forward(ctx, mean, *, comm, weight, scale):
        ctx.factor = weight * scale
        return all_reduce(comm, (mean * weight).reshape(1)).reshape(())

    @staticmethod
    def backward(ctx, grad):
        return (grad * ctx.factor,)


def context_parallel_loss(logits, targets, positions, comm, cross_entropy=None):
    """The mean cross-entropy of the whole sequence from this rank's part of the logits
    (B, t, V) at ``positions`` and the whole ``targets`` (B, T) (-1: left out): the same scalar
    Tensor on every cp rank, the one-process loss (module docstring). ``cross_entropy(logits
    (N, V), targets (N,))``: the mean over this rank's positions, -1 left out (default
    ``functions.cross_entropy``; under tp the vocabulary-parallel one, V this rank's columns).
    Collective."""
    b, t, v = logits.shape
    mine = targets[:, backend.get_array_module(targets).asarray(positions)]
    counted, total = int((mine != -1).sum()), int((targets != -1).sum())
    if cross_entropy is None:
        mean = F.cross_entropy(logits.reshape(b * t, v), mine.reshape(-1), ignore_index=-1)
    else:
        mean = cross_entropy(logits.reshape(b * t, v), mine.reshape(-1))
    return ContextParallelLoss.apply(mean, comm=comm, weight=counted / max(total, 1), scale=comm.Get_size())


class ContextParallelGPT(GPT):
    """What :func:`parallelize_gpt` returns: a GPT whose every rank runs each layer on its part of
    every sequence (module docstring). ``model(idx, targets) -> (logits, loss)``: idx and targets
    the whole (B, T) sequences on every rank of ``comm`` (the cp group); logits this rank's
    positions (B, t, V), in the order ``layout.rank_positions`` gives; loss the one-process mean,
    the same on every rank. Parameters: the dense model's names, shapes and values (a copy).
    Collective when run."""

    def __init__(self, dense: GPT, comm, variant: str = "ring", counter=None):
        nn.Module.__init__(self)  # not GPT.__init__: the weights are the dense model's
        check_variant(variant)
        whole = copy.deepcopy(dense)  # one deepcopy: the tied embedding and head stay one Parameter
        self.config, self.comm, self.variant = whole.config, comm, variant
        self.transformer, self.lm_head = whole.transformer, whole.lm_head
        for block in self.transformer.h:
            block.attn = ContextParallelSelfAttention(block.attn, comm, variant, counter)
        self.transformer.wte = ShardTokenEmbedding(whole.transformer.wte, comm, variant)
        self.transformer.wpe = ShardPositionEmbedding(whole.transformer.wpe, comm, variant)

    def forward(self, idx, targets=None):
        """This rank's logits and the whole sequence's loss (class docstring). Raises ValueError
        as the dense GPT does, or for a sequence too short for the cp ranks. Collective."""
        ids = self._token_ids(idx)
        logits = self.lm_head(self._trunk(ids))
        if targets is None:
            return logits, None
        b, t = ids.shape
        positions = rank_positions(t, self.comm.Get_size(), self.comm.Get_rank(), self.variant)
        return logits, context_parallel_loss(logits, self._target_ids(targets, b, t), positions, self.comm)

    def generate(self, *args, **kwargs):
        """Not on the cp model: it computes a part of each sequence. Raises NotImplementedError."""
        raise NotImplementedError("ContextParallelGPT.generate: sampling needs every position; build a dense model "
                                  "with GPT(model.config).load_state_dict(model.state_dict()) (the weights are the "
                                  "same on every rank) and call its generate")


def parallelize_gpt(model: GPT, comm, variant: str = "ring", counter=None) -> ContextParallelGPT:
    """A copy of ``model`` laid out for context parallelism over ``comm`` (the cp group) with
    ``variant`` (module docstring); ``model`` is left as it was. Every rank passes the same
    dense model. Raises ValueError for an unknown variant or a model with dropout."""
    return ContextParallelGPT(model, comm, variant, counter)


def apply_cp(model: GPT, cp_comm, config, counter=None) -> ContextParallelGPT:
    """The context-parallel step of a composition (torchtitan's ``apply_cp_to_attention_module``
    in ``parallelize_llama``, after tp and before fsdp): ``model`` laid out over ``cp_comm`` with
    ``config.cp_variant`` (:func:`parallelize_gpt`, whose errors it raises)."""
    return parallelize_gpt(model, cp_comm, config.cp_variant, counter)
