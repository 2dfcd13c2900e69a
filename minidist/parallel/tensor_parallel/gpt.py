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
contributions.

**Sequence parallelism** (Korthikanti et al., MLSys 2023, ``sequence_parallel=True``): what runs
between the split layers (the LayerNorms, the residual additions, the embeddings' sum) works on
this rank's block of t / T positions instead of on all t: the embedding reduce-scatters where
it all-reduced, each column-parallel layer all-gathers its input's positions, each row-parallel
layer reduce-scatters its output, and the head all-gathers ``ln_f``'s output. The parameters
that stay whole but now see only some positions (LayerNorm weights and biases, the position
embedding, the row-parallel biases) have each rank's part of their gradient summed over the
ranks: the LayerNorms' and the position embedding's through ``f`` where they are used, the
biases' inside the row-parallel op (Megatron sums the same gradients in one all-reduce after
the backward pass). The sequence length must be a multiple of T.
"""
from __future__ import annotations

import copy
import math
from collections import OrderedDict

import numpy as np

from minidist import backend, nn
from minidist import functions as F
from minidist.collectives import all_reduce
from minidist.models.gpt import GPT
from minidist.p2p import agree
from minidist.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, shard_bounds
from minidist.parallel.tensor_parallel.operators import communicate, copy_to_tensor_parallel_region, sequence_block
from minidist.parallel.tensor_parallel.plan import is_sharded, join_shards
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
    def from_dense(cls, attn, comm, sequence_parallel: bool = False) -> ParallelSelfAttention:
        """This rank's heads of a dense ``models.gpt.CausalSelfAttention`` (with
        ``sequence_parallel``, input and output are this rank's positions, (B, t / T, C)).
        Raises ValueError when ``comm`` has more ranks than heads, or the model has dropout
        (each rank would draw its own masks, and the split would no longer compute the dense
        model)."""
        if attn.attn_dropout.p or attn.resid_dropout.p:
            raise ValueError("tensor parallelism here needs dropout = 0: the split model's dropout masks would not "
                             "be the dense model's; build the GPT with GPTConfig(dropout=0.0)")
        c, d = attn.n_embd, attn.n_embd // attn.n_head
        first, last = shard_bounds(attn.n_head, comm, "heads")
        mine = np.arange(first * d, last * d)
        rows = np.concatenate([mine, c + mine, 2 * c + mine])
        c_attn = ColumnParallelLinear.from_dense(attn.c_attn, comm, rows=rows, sequence_parallel=sequence_parallel)
        c_proj = RowParallelLinear.from_dense(attn.c_proj, comm, columns=mine, sequence_parallel=sequence_parallel)
        return cls(c_attn, c_proj, (first, last), d)

    def forward(self, x):
        h = self.last_head - self.first_head
        qkv = self.c_attn(x)  # (B, t, 3 h d): every position, even when x holds a block of them
        b, t = qkv.shape[:2]
        qkv = qkv.reshape(b, t, 3, h, self.head_dim).transpose(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)  # (B, h, T, d)
        return self.c_proj(y.transpose(0, 2, 1, 3).reshape(b, t, h * self.head_dim))


class ParallelMLP(nn.Module):
    """The block's MLP with ``c_fc`` column-parallel and ``c_proj`` row-parallel (module
    docstring): (B, T, C) -> (B, T, C), whole on every rank; names as the dense ``MLP``'s."""

    def __init__(self, c_fc: ColumnParallelLinear, c_proj: RowParallelLinear):
        super().__init__()
        self.c_fc, self.gelu, self.c_proj = c_fc, nn.GELU(approximate="tanh"), c_proj

    @classmethod
    def from_dense(cls, mlp, comm, sequence_parallel: bool = False) -> ParallelMLP:
        """This rank's 4C / T features of a dense ``models.gpt.MLP`` (dropout must be 0; with
        ``sequence_parallel``, input and output are this rank's positions)."""
        if mlp.dropout.p:
            raise ValueError("tensor parallelism here needs dropout = 0 (see ParallelSelfAttention.from_dense)")
        return cls(ColumnParallelLinear.from_dense(mlp.c_fc, comm, sequence_parallel=sequence_parallel),
                   RowParallelLinear.from_dense(mlp.c_proj, comm, sequence_parallel=sequence_parallel))

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class SequenceParallelLayerNorm(nn.Module):
    """A dense ``nn.LayerNorm`` run on this rank's positions (module docstring): (B, t / T, C)
    -> the same. Its ``weight`` and ``bias`` (the dense module's Parameters, whole) go through
    ``f``, so backward sums the ranks' parts of their gradients: a collective."""

    def __init__(self, dense: nn.LayerNorm, comm):
        super().__init__()
        self.normalized_shape, self.eps, self.comm = dense.normalized_shape, dense.eps, comm
        self.weight, self.bias = dense.weight, dense.bias

    def forward(self, x):
        weight, bias = (None if p is None else copy_to_tensor_parallel_region(p, self.comm)
                        for p in (self.weight, self.bias))
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


class SequenceParallelPositionEmbedding(nn.Module):
    """The position embedding (block_size, C), whole, looked up at this rank's block of the
    positions it is given (module docstring): positions (t,) -> (t / T, C). The weight goes
    through ``f`` (each rank's gradient covers its positions only). Raises ValueError when T
    does not divide t. Collective in backward."""

    def __init__(self, dense: nn.Embedding, comm):
        super().__init__()
        self.weight, self.comm = dense.weight, comm

    def forward(self, positions):
        start, stop = sequence_block(len(positions), self.comm)
        return F.embedding(positions[start:stop], copy_to_tensor_parallel_region(self.weight, self.comm))


class TensorParallelGPT(GPT):
    """What :func:`parallelize_gpt` returns: a GPT whose blocks hold this rank's shards
    (``ParallelSelfAttention``, ``ParallelMLP``), whose tied token embedding and output layer
    hold this rank's vocabulary rows (``VocabParallelEmbedding``, a ``ColumnParallelLinear``
    sharing its weight), and whose position embedding and LayerNorms are whole (with
    ``sequence_parallel``, used on this rank's positions: :class:`SequenceParallelLayerNorm`,
    :class:`SequenceParallelPositionEmbedding`). Called as the dense GPT is, ``model(idx,
    targets) -> (logits, loss)`` (the loss the same on every rank, the logits this rank's
    columns); ``comm`` is its tensor-parallel group. Build it with :func:`parallelize_gpt`."""

    def __init__(self, dense: GPT, comm, sequence_parallel: bool = False):
        nn.Module.__init__(self)  # not GPT.__init__: the weights are the dense model's, not new ones
        check_split(dense.config, comm.Get_size())
        whole = copy.deepcopy(dense)  # one deepcopy: the tied embedding and head stay one Parameter
        self.config, self.comm, self.sequence_parallel = whole.config, comm, bool(sequence_parallel)
        self.transformer = whole.transformer
        sp = self.sequence_parallel
        for block in self.transformer.h:
            block.attn = ParallelSelfAttention.from_dense(block.attn, comm, sequence_parallel=sp)
            block.mlp = ParallelMLP.from_dense(block.mlp, comm, sequence_parallel=sp)
            if sp:
                block.ln_1 = SequenceParallelLayerNorm(block.ln_1, comm)
                block.ln_2 = SequenceParallelLayerNorm(block.ln_2, comm)
        if sp:
            self.transformer.ln_f = SequenceParallelLayerNorm(self.transformer.ln_f, comm)
            self.transformer.wpe = SequenceParallelPositionEmbedding(self.transformer.wpe, comm)
        wte = VocabParallelEmbedding.from_dense(whole.transformer.wte, comm, sequence_parallel=sp)
        self.transformer.wte = wte
        self.lm_head = ColumnParallelLinear(wte.weight.data, None, comm, whole.config.n_embd,
                                            whole.config.vocab_size, wte.start, wte.stop, sequence_parallel=sp)
        self.lm_head.weight = wte.weight  # tied, as in the dense model: one Parameter, this rank's rows

    def forward(self, idx, targets=None):
        """This rank's part of the logits and the loss (the dense GPT's ``forward``, split).

        Returns ``(logits, loss)``: logits (B, T, stop - start), this rank's vocabulary
        columns ``lm_head.start:lm_head.stop`` (Megatron's ``parallel_output``: never
        gathered); loss the mean cross-entropy, the same scalar on every rank, or None
        without targets. Raises ValueError as the dense GPT does. Collective."""
        logits = self.lm_head(self._trunk(idx))  # f (or the all-gather) inside: the head uses all of x
        if targets is None:
            return logits, None
        return logits, self.loss(logits, targets)

    def loss(self, logits, targets):
        """The mean cross-entropy of the whole vocabulary from this rank's part of the logits
        (B, T, stop - start), as :meth:`forward` computes it: the same scalar Tensor on every
        rank (:func:`~minidist.parallel.tensor_parallel.vocab.vocab_parallel_cross_entropy`).
        targets: next-token ids (B, T), -1 left out. A pipeline's last stage calls it on the
        head's output (the 3-D driver). Raises ValueError for targets of another shape.
        Collective."""
        b, t, v = logits.shape
        target_ids = self._target_ids(targets, b, t)
        return vocab_parallel_cross_entropy(logits.reshape(b * t, v), target_ids.reshape(-1), self.comm,
                                            self.lm_head.start)

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
        return join_state_dicts(self.comm, self.state_dict())

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale every gradient by ``max_norm / norm`` when the norm of the whole model's
        gradient exceeds ``max_norm`` (``nn.clip_grad_norm_`` of the dense model, split): the
        squares of this rank's shards (:func:`is_sharded`) are summed over the ranks in one
        all-reduce of one number, and the whole parameters' squares, the same on every rank,
        are added once. Returns the norm before clipping (a float, the same on every rank).
        Collective."""
        cut = {id(p) for name, p in self.named_parameters() if is_sharded(name)}
        sharded, whole = squares_by_kind(self.parameters(), cut)
        norm = math.sqrt(float(communicate(all_reduce, self.comm, np.array([sharded]))[0]) + whole)
        clip_to(self.parameters(), max_norm, norm)
        return norm


def squares_by_kind(params, sharded) -> tuple[float, float]:
    """The sums of squares of ``params``' gradients (parameters without one skipped), in
    float64, parameter by parameter in order: (those whose id is in ``sharded``, the others).
    The one sum of :meth:`TensorParallelGPT.clip_grad_norm_` and of the 3-D driver's
    ``ThreeDStep``, so that a one-stage pipeline clips the tp strategy's norm bit for bit."""
    totals = [0.0, 0.0]
    for p in params:
        if p.grad is not None:
            totals[id(p) not in sharded] += float((p.grad.astype(backend.get_array_module(p.grad).float64) ** 2).sum())
    return totals[0], totals[1]


def clip_to(params, max_norm: float, norm: float) -> None:
    """Scale every gradient of ``params`` by max_norm / (norm + 1e-6), in its own dtype, when
    ``norm`` (the whole model's, already summed over the ranks) exceeds ``max_norm``."""
    if norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad *= p.grad.dtype.type(scale)


def uneven_split(n_head: int, n_embd: int, tp: int) -> tuple[int, int] | None:
    """The one rule of every strategy that splits the GPT over ``tp`` tensor-parallel ranks
    (:func:`check_split`; the checks of ``--strategy tp``, ``3d`` and ``fsdp --tp``): each rank
    holds the same number of heads and of MLP features, so ``tp`` must divide n_head and
    4 · n_embd. Returns None when it does, else ``(which, n)``: which 0 for the heads (n =
    n_head), 1 for the MLP's hidden features (n = 4 · n_embd), the first that ``tp`` does not
    divide; each caller words the error for its own flags. The sizes that split evenly:
    :func:`even_split_sizes`."""
    for which, n in enumerate((n_head, 4 * n_embd)):
        if n % tp:
            return which, n
    return None


def even_split_sizes(n_head: int, n_embd: int) -> list[int]:
    """Every tensor-parallel size that splits a GPT of ``n_head`` heads of ``n_embd`` channels
    evenly (:func:`uneven_split` None), ascending: the divisors of n_head that divide 4 · n_embd."""
    return [t for t in range(1, n_head + 1) if uneven_split(n_head, n_embd, t) is None]


def check_split(config, world_size: int) -> None:
    """Raise ValueError, naming the fix, when a GPT of ``config`` (a ``GPTConfig``) cannot be
    split evenly over ``world_size`` tensor-parallel ranks: its heads (n_head) or the MLP's
    hidden features (4 · n_embd) not divisible by it (:func:`uneven_split`), or a vocabulary
    smaller than it. (The split layers themselves accept uneven cuts; the model does not, as
    Megatron does not: the rank with more heads would set every step's pace.)"""
    problem = uneven_split(config.n_head, config.n_embd, world_size)
    if problem is not None:
        what, n = ("n_head", "4 * n_embd")[problem[0]], problem[1]
        raise ValueError(f"cannot split the GPT over {world_size} tensor-parallel ranks: {what} = {n} is not "
                         f"divisible by {world_size} (each rank holds the same number of heads and MLP "
                         f"features); use a tensor-parallel size among {even_split_sizes(config.n_head, config.n_embd)}"
                         ", or change the model's sizes")
    if config.vocab_size < world_size:
        raise ValueError(f"cannot split a vocabulary of {config.vocab_size} tokens over {world_size} ranks: every "
                         f"rank needs at least one; use at most {config.vocab_size} ranks")


def join_state_dicts(comm, state: dict) -> OrderedDict:
    """The dense GPT's state dict from ``state``, this rank's shards of it by the dense names (a
    :class:`TensorParallelGPT`'s ``state_dict``, or FSDP's ``full_state_dict`` of one), joined
    over the tensor-parallel group ``comm`` (:func:`join_shards`, in rank order). Collective:
    every rank calls it and gets the whole dict; the shards travel as one pickled record per rank
    (:func:`minidist.p2p.agree`), fine for the course's models. Raises RuntimeError as
    :func:`join_shards` does (a whole parameter that differs between the ranks)."""
    everyone = agree(comm, None, state, what="full_state_dict")
    return OrderedDict((name, join_shards(name, [their[name] for their in everyone])) for name in state)


def parallelize_gpt(model: GPT, comm, sequence_parallel: bool = False) -> TensorParallelGPT:
    """A copy of ``model`` whose blocks hold only this rank's shards (module docstring); the
    model itself is left as it was (**contract**). Every rank must pass the same dense model
    (the same seed); the copy computes what it computes, the same loss on every rank, with
    one all-reduce forward and one backward per attention and per MLP (with
    ``sequence_parallel``: a reduce-scatter and an all-gather each way in their place, the
    activations between them cut by positions, and the sequence length a multiple of the
    number of ranks). Parameter names are
    the dense model's, shapes sharded (the tied embedding and head by vocabulary rows);
    ``full_state_dict()`` gives the dense weights back; the logits it returns are this rank's
    vocabulary columns (:meth:`TensorParallelGPT.forward`).
    Collective when run (forward, backward, full_state_dict).

    Raises ValueError (naming the fix) when the number of ranks does not divide n_head or
    4 · n_embd (:func:`check_split`), or the model has dropout.
    Source: Shoeybi et al. 2019, section 3; Korthikanti et al., MLSys 2023, section 4.2.2.
    """
    return TensorParallelGPT(model, comm, sequence_parallel=sequence_parallel)


def apply_tp(model: GPT, tp_comm, config) -> TensorParallelGPT:
    """The tensor-parallel step of a composition (torchtitan's ``apply_tp``): ``model`` (the
    dense GPT, the same on every rank) split over ``tp_comm`` with ``config.sequence_parallel``
    (a ``train.TrainConfig``; :func:`parallelize_gpt`, whose errors it raises)."""
    return parallelize_gpt(model, tp_comm, sequence_parallel=bool(getattr(config, "sequence_parallel", False)))
