"""Context parallelism around tensor parallelism: a GPT split by heads over tp, its sequence cut over cp.

``train --model gpt --strategy cp --tp T [--dp D]`` lays the P ranks out as a (D, C, T) mesh,
names ("dp", "cp", "tp"), tp fastest (tp talks at every layer four times, cp at every layer's
attention, dp once a step), C = P / (D T)::

    P = 8, D = C = T = 2:   dp_rank 0  cp_rank 0 [0 1]  cp_rank 1 [2 3]     tp groups [0 1] [2 3] [4 5] [6 7]
                            dp_rank 1  cp_rank 0 [4 5]  cp_rank 1 [6 7]     cp groups [0 2] [1 3] [4 6] [5 7]
                                                                            dp x cp   [0 2 4 6] [1 3 5 7]

The model is built in torchtitan's order (``parallelize_llama`` in
``torchtitan/models/llama3/infra/parallelize.py``: ``apply_tp``, then
``apply_cp_to_attention_module`` on each block's inner attention, then data parallelism):

1. **tp** (:func:`~minidist.parallel.tensor_parallel.gpt.apply_tp`, unchanged): every rank of a
   tp group holds its heads of attention, its MLP features and its vocabulary rows;
2. **cp** (:func:`apply_cp_to_tp`): the tp model's modules taken over, and only what knows
   where a position lies replaced, as :mod:`.gpt` does for the dense GPT: the token embedding
   looks up this cp rank's positions (then sums over tp as before), the position embedding
   their true positions, and each block's attention runs ``context_parallel_attention`` over
   the cp group on this tp rank's *local* heads (the cp ranks of a group hold the same heads,
   since they share the tp coordinate). Ulysses then trades positions for heads among those
   local heads, so C must divide n_head / T. The loss is the vocabulary-parallel cross-entropy
   of this rank's positions, summed over cp with each rank's share (:func:`.gpt.context_parallel_loss`).
   With ``--sequence-parallel`` the tp group cuts this cp rank's positions once more
   (Korthikanti et al. 2023): its column-parallel layers all-gather them back before attention,
   so attention still sees the cp part whole; each cp part's length must divide by T;
3. **dp** (``DistributedDataParallel``): over the D x C ranks of the same tp coordinate, the
   group torchtitan's ``ParallelDims`` flattens as ``dp_cp`` (for its loss and gradients;
   ``dp_shard_cp`` when FSDP shards over it). Each rank's cp loss starts its backward scaled by
   C (:mod:`.gpt`), so the average over dp x cp is the one-process gradient of that tp shard.
   The tp shards stay split; the whole parameters (LayerNorms, the position embedding, the
   row-parallel biases) are the same on every tp rank, as under ``--strategy tp``.

FSDP in place of DDP (:func:`apply_fsdp_over_dp_cp`: torchtitan's ``dp_shard_cp``, FSDP's
shards cut over the same dp x cp ranks, its reduce-scatter averaging over them as DDP's
all-reduce does) is built at the model's level (``train.parallelize(..., sharding_strategy=)``)
but not on the command line yet: it needs a way to ask for it that ``TrainConfig`` lacks.
"""
from __future__ import annotations

from minidist import backend, nn
from minidist.models.gpt import Block
from minidist.parallel.context_parallel.dispatch import context_parallel_attention
from minidist.parallel.context_parallel.gpt import ShardPositionEmbedding, context_parallel_loss
from minidist.parallel.context_parallel.layout import check_variant, rank_positions
from minidist.parallel.fsdp.compose import WHOLE_MODULES
from minidist.parallel.fsdp.fsdp import FullyShardedDataParallel
from minidist.parallel.tensor_parallel.gpt import (
    ParallelSelfAttention,
    SequenceParallelPositionEmbedding,
    TensorParallelGPT,
)
from minidist.parallel.tensor_parallel.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy
from minidist.tensor import Tensor


def dp_cp_group(comm, mesh):
    """The ranks of ``comm`` that share this rank's tp coordinate of ``mesh`` (a DeviceMesh with
    "tp"): the dp x cp ranks that hold the same tp shards, in rank order (torchtitan's flattened
    ``dp_cp``). One ``comm.Split``: collective over ``comm``; ``Free()`` it at the end."""
    return comm.Split(color=mesh.get_local_rank("tp"), key=comm.Get_rank())


class ContextParallelHeadsAttention(ParallelSelfAttention):
    """A tp rank's heads of causal self-attention (``tensor_parallel.ParallelSelfAttention``,
    the same c_attn and c_proj Parameters and names) with the attention itself run over the cp
    group ``comm`` by ``context_parallel_attention`` with ``variant``: x (B, t, C) this cp
    rank's positions (under sequence parallelism its tp block of them) -> the same shape.
    ``counter``: a ``BlockCounter`` or None. Collective over tp and cp."""

    def __init__(self, tp_attn: ParallelSelfAttention, comm, variant: str, counter=None):
        super().__init__(tp_attn.c_attn, tp_attn.c_proj, (tp_attn.first_head, tp_attn.last_head), tp_attn.head_dim)
        self.cp_comm, self.variant, self.counter = comm, variant, counter

    def forward(self, x):
        h, d = self.last_head - self.first_head, self.head_dim
        qkv = self.c_attn(x)  # (B, t, 3 h d): every position of this cp rank (sequence parallelism gathers them)
        b, t = qkv.shape[:2]
        qkv = qkv.reshape(b, t, 3, h, d).transpose(2, 0, 3, 1, 4)
        y = context_parallel_attention(qkv[0], qkv[1], qkv[2], self.cp_comm, is_causal=True, variant=self.variant,
                                       counter=self.counter)
        return self.c_proj(y.transpose(0, 2, 1, 3).reshape(b, t, h * d))


class ShardVocabParallelEmbedding(VocabParallelEmbedding):
    """A tp rank's vocabulary rows of the token embedding (``VocabParallelEmbedding``, the same
    Parameter, still tied to the output layer) looked up at this cp rank's positions: ids
    (B, T) the whole sequence -> (B, t, C), or (B, t / tp, C) under sequence parallelism.
    Collective over tp."""

    def __init__(self, tp_wte: VocabParallelEmbedding, comm, variant: str):
        super().__init__(tp_wte.weight.data, tp_wte.comm, tp_wte.num_embeddings, tp_wte.start, tp_wte.stop,
                         tp_wte.sequence_parallel)
        self.weight = tp_wte.weight  # the one Parameter the output layer shares
        self.cp_comm, self.variant = comm, variant

    def forward(self, ids):
        ids = ids.data if isinstance(ids, Tensor) else ids
        mine = rank_positions(ids.shape[1], self.cp_comm.Get_size(), self.cp_comm.Get_rank(), self.variant)
        return super().forward(ids[:, backend.get_array_module(ids).asarray(mine)])


class ShardSequenceParallelPositionEmbedding(SequenceParallelPositionEmbedding):
    """The position embedding under sequence parallelism (the same Parameter) at this cp
    rank's true positions: positions (T,) of the whole sequence -> (t / tp, C), this tp rank's
    block of this cp rank's positions. Collective over tp in backward."""

    def __init__(self, sp_wpe: SequenceParallelPositionEmbedding, comm, variant: str):
        super().__init__(sp_wpe, sp_wpe.comm)
        self.cp_comm, self.variant = comm, variant

    def forward(self, positions):
        mine = rank_positions(len(positions), self.cp_comm.Get_size(), self.cp_comm.Get_rank(), self.variant)
        return super().forward(positions[backend.get_array_module(positions).asarray(mine)])


class ContextTensorParallelGPT(TensorParallelGPT):
    """What :func:`apply_cp_to_tp` returns: a tensor-parallel GPT (``comm``: its tp group) whose
    every rank runs each layer on its cp part of every sequence (module docstring).
    ``model(idx, targets) -> (logits, loss)``: idx and targets the whole (B, T) sequences on
    every rank; logits (B, t, V / tp), this cp rank's positions (``layout.rank_positions``'
    order) and this tp rank's vocabulary columns; loss the one-process mean, the same on every
    rank of the cp x tp group. ``state_dict`` and ``full_state_dict`` as the tp model's (the
    dense names, tp shards). Collective when run."""

    def __init__(self, tp_model: TensorParallelGPT, cp_comm, variant: str = "ring", counter=None):
        nn.Module.__init__(self)  # not TensorParallelGPT.__init__: the modules are tp_model's, already split
        check_variant(variant)
        self.config, self.comm, self.sequence_parallel = tp_model.config, tp_model.comm, tp_model.sequence_parallel
        self.cp_comm, self.variant = cp_comm, variant
        self.transformer, self.lm_head = tp_model.transformer, tp_model.lm_head
        for block in self.transformer.h:
            block.attn = ContextParallelHeadsAttention(block.attn, cp_comm, variant, counter)
        self.transformer.wte = ShardVocabParallelEmbedding(self.transformer.wte, cp_comm, variant)
        wpe = self.transformer.wpe
        self.transformer.wpe = (ShardSequenceParallelPositionEmbedding(wpe, cp_comm, variant)
                                if self.sequence_parallel else ShardPositionEmbedding(wpe, cp_comm, variant))

    def forward(self, idx, targets=None):
        """This rank's logits and the whole sequence's loss (class docstring). Raises ValueError
        as the dense GPT does. Collective."""
        ids = self._token_ids(idx)
        logits = self.lm_head(self._trunk(ids))
        return logits, None if targets is None else self.loss(logits, self._target_ids(targets, *ids.shape))

    def loss(self, logits, targets):
        """The mean cross-entropy of the whole sequences ``targets`` (B, T) (-1 left out) from
        this rank's logits (B, t, V / tp): the vocabulary-parallel loss of this cp rank's
        positions (over tp), weighted by their share and summed over cp. The same scalar Tensor
        on every rank of the cp x tp group. Raises ValueError when the logits are not this
        rank's part of T positions. Collective."""
        targets = self._token_ids(targets, "targets")
        b, t = targets.shape
        positions = rank_positions(t, self.cp_comm.Get_size(), self.cp_comm.Get_rank(), self.variant)
        if logits.shape[:2] != (b, len(positions)):
            raise ValueError(f"ContextTensorParallelGPT.loss: logits {logits.shape} are not this cp rank's "
                             f"{len(positions)} positions of targets {targets.shape}")

        def cross_entropy(part, ids):
            return vocab_parallel_cross_entropy(part, ids, self.comm, self.lm_head.start)

        return context_parallel_loss(logits, targets, positions, self.cp_comm, cross_entropy)


def apply_cp_to_tp(tp_model: TensorParallelGPT, cp_comm, config, counter=None) -> ContextTensorParallelGPT:
    """The context-parallel step after tp (torchtitan's ``apply_cp_to_attention_module`` after
    ``apply_tp``): ``tp_model`` (its modules taken over, not copied) laid out over ``cp_comm``
    with ``config.cp_variant`` (module docstring). Raises ValueError for an unknown variant."""
    return ContextTensorParallelGPT(tp_model, cp_comm, config.cp_variant, counter)


def apply_fsdp_over_dp_cp(model, dp_cp_comm, sharding_strategy: str = "FULL_SHARD") -> FullyShardedDataParallel:
    """The data-parallel step of the composition with FSDP instead of DDP (torchtitan's
    ``apply_fsdp`` over ``dp_shard_cp``): ``model`` (laid out for cp, perhaps split by tp) sharded
    over ``dp_cp_comm`` with ``sharding_strategy``, one unit per ``Block`` and, under tp, one per
    module whose parameters every tp rank holds whole (``fsdp.compose.WHOLE_MODULES`` and the cp
    position embedding), so that their flat layout is the same on every tp rank. Raises what
    ``FullyShardedDataParallel`` raises."""
    policy = (Block, *WHOLE_MODULES, ShardPositionEmbedding) if isinstance(model, TensorParallelGPT) else None
    return FullyShardedDataParallel(model, dp_cp_comm, sharding_strategy, auto_wrap_policy=policy)
