"""FSDP with tensor parallelism inside it (2-D): ``train --model gpt --strategy fsdp --tp T``.

The P ranks form a :class:`~minidist.parallel.mesh.DeviceMesh` of shape (P / T, T), names
("dp", "tp"), tp fastest, so a tensor-parallel group is T neighbouring ranks (one node's fast
links: tp talks at every layer, dp once per unit and step)::

    P = 4, T = 2:   dp_rank 0  [0 1]      tp groups [0 1] [2 3]   (split the same layers)
                    dp_rank 1  [2 3]      dp groups [0 2] [1 3]   (shard the same tp shards)

A run is built as torchtitan builds one (``parallelize_llama``: apply_tp, then apply_fsdp, each
a short function over one dimension of the mesh): :func:`parallelize` splits the dense GPT over
the tp group (:func:`~minidist.parallel.tensor_parallel.gpt.apply_tp`: heads, MLP features,
vocabulary rows, Shoeybi et al. 2019), then shards what each tp rank holds over the dp group
(:func:`apply_fsdp`: one unit per block and the root, Zhao et al., VLDB 2023). Each of the P / T
dp coordinates reads its part of the global batch, the T ranks of a tp group the same windows.
With T = 1 the tp step is skipped and the run is ``--strategy fsdp`` as it was, bit for bit.

What the composition adds to each half: the clipping norm counts each parameter once
(``FullyShardedDataParallel.clip_grad_norm_`` with the tp group: cut parameters' squares summed
over dp and tp, whole ones over dp only); the loss is the vocabulary-parallel one (the logits
are each tp rank's vocabulary columns); the dense weights are FSDP's full state dict of each tp
rank, joined over tp (:func:`dense_state`). The parameters that every tp rank holds whole (the
LayerNorms, the position embedding, the row-parallel biases) must get the same update on every
tp rank to the last bit, or the tp ranks drift apart: their gradients are summed over dp in
units whose flat layout is the same on every tp rank (the blocks, whose shards are equal since
T divides n_head and 4 n_embd; the position embedding and the last LayerNorm get units of their
own, :data:`WHOLE_MODULES`, because the root also holds the vocabulary rows, cut unevenly when T
does not divide the vocabulary, which would move them to other offsets and another order of
summation).

Checkpoints gather every rank's part (its units' shards and moments) into one file, each piece
saved with its offsets in its dp group (:class:`ReplicaShardLayout`). They resume on the same
mesh, bit for bit, or, with ``--global-batch-size``, on another number of replicas of the same T
(:func:`reshard_replicas`: each tp coordinate's pieces cut again over the new dp size); another T
is refused by the checkpoint's fingerprint (joining the tp shards out of the flat pieces and
cutting both ways again is not written). :func:`consolidate_fsdp` makes the dense model of one.
"""
from __future__ import annotations

import numpy as np

from minidist import nn
from minidist.models.gpt import Block
from minidist.parallel.fsdp.fsdp import FullyShardedDataParallel
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.tensor_parallel.gpt import (
    SequenceParallelLayerNorm,
    SequenceParallelPositionEmbedding,
    TensorParallelGPT,
    apply_tp,
    is_sharded,
    join_shards,
    join_state_dicts,
)
from minidist.resharding import ReshardError, ShardLayout, consolidate, reshard_parts
from minidist.tracing import CountingComm

MESH_NAMES = ("dp", "tp")
# The modules outside the blocks whose parameters every tp rank holds whole: units of their own
# under tp (module docstring). The blocks' LayerNorms are inside Block units, which come first.
WHOLE_MODULES = (nn.Embedding, nn.LayerNorm, SequenceParallelPositionEmbedding, SequenceParallelLayerNorm)


class CountedMesh:
    """The (P / T, T) ("dp", "tp") mesh of ``comm`` (collective: a ``DeviceMesh``), each group
    wrapped in a ``tracing.CountingComm`` (its bytes counted apart: ``traffic[name]``) that names
    its ranks as the job numbers them (a timeout names the silent rank: ``mesh.rank_names``).
    ``get_group``, ``get_local_rank`` and ``size`` as DeviceMesh's; ``free()`` at the end.
    Raises ValueError when ``tp`` does not divide the ranks (``mesh.check_mesh``)."""

    def __init__(self, comm, tp: int):
        size = comm.Get_size()
        self.mesh = DeviceMesh(comm, (max(size // tp, 1), tp), MESH_NAMES)
        self.traffic = {}
        for name in MESH_NAMES:
            self.traffic[name] = CountingComm(self.mesh.get_group(name), allow_collectives=True, keep_messages=False)
            self.traffic[name].rank_names = self.mesh.rank_names(name)

    def get_group(self, name: str) -> CountingComm:
        """The counted sub-communicator along ``name`` ("dp" or "tp")."""
        return self.traffic[name]

    def get_local_rank(self, name: str) -> int:
        """This rank's coordinate along ``name``."""
        return self.mesh.get_local_rank(name)

    def size(self, name: str | None = None) -> int:
        """The ranks along ``name`` (all of them for None)."""
        return self.mesh.size(name)

    def free(self) -> None:
        """Release the sub-communicators (collective)."""
        self.mesh.free()


def apply_fsdp(model, dp_comm, config) -> FullyShardedDataParallel:
    """The FSDP step of a composition (torchtitan's ``apply_fsdp``): ``model`` sharded over
    ``dp_comm`` with ``config.sharding_strategy``, one unit per GPT ``Block`` plus the root; a
    tensor-parallel GPT's whole modules outside the blocks get units of their own
    (:data:`WHOLE_MODULES`, module docstring). Raises what FullyShardedDataParallel raises."""
    policy = (Block, *WHOLE_MODULES) if isinstance(model, TensorParallelGPT) else None
    return FullyShardedDataParallel(model, dp_comm, config.sharding_strategy, auto_wrap_policy=policy)


def parallelize(model, mesh, config) -> FullyShardedDataParallel:
    """``model`` (the dense model, the same on every rank) split over ``mesh``'s tp group when
    it has more than one rank, then sharded over its dp group (module docstring). ``mesh``: a
    :class:`CountedMesh` or a DeviceMesh with "dp" and "tp". Collective over the mesh."""
    # TP first, then FSDP (torchtitan's order). TP cuts each layer along its meaning (q, k, v
    # by heads, c_fc by features, the embedding by vocabulary rows), so it needs the layers as
    # matrices; FSDP only lays whatever parameters a module holds end to end and cuts that
    # vector into equal pieces, so it takes each tp rank's shards as they are. The other way
    # round TP would find flat vectors instead of matrices, and FSDP's gathers, run inside the
    # tp layers, would rebuild the whole layers on every rank.
    if mesh.size("tp") > 1:
        model = apply_tp(model, mesh.get_group("tp"), config)
    return apply_fsdp(model, mesh.get_group("dp"), config)


def tp_group(mesh):
    """The mesh's tp group when it has more than one rank, else None (plain FSDP)."""
    return mesh.get_group("tp") if mesh.size("tp") > 1 else None


def loss_function(work, model, mesh):
    """``loss_of(x, y) -> scalar Tensor`` of the training step: the workload's loss of the
    logits (tp = 1, as ``--strategy fsdp`` always did) or, under tp, the GPT's own
    vocabulary-parallel loss (``TensorParallelGPT.forward``: the logits are this rank's
    vocabulary columns, never gathered)."""
    if tp_group(mesh) is None:
        return lambda x, y: work.loss(work.forward(model, x), y)
    return lambda x, y: model(x, y)[1]


def evaluated_model(model, mesh):
    """What the workload's evaluation runs: the FSDP wrapper (tp = 1), or under tp the wrapped
    ``TensorParallelGPT`` itself, whose forward FSDP's hooks gather and free, and which the
    workload scores with its own (vocabulary-parallel) loss since it is a GPT. Collective."""
    return model if tp_group(mesh) is None else model.module


def clip_function(model, mesh, grad_clip):
    """The step's ``clip_grad_norm()`` (None without clipping): FSDP's norm over dp, and under
    tp the cut parameters' squares also over tp (``tensor_parallel.is_sharded``)."""
    if not grad_clip:
        return None
    tp = tp_group(mesh)
    return lambda: model.clip_grad_norm_(grad_clip, tp_comm=tp, is_cut=is_sharded if tp is not None else None)


def dense_state(model, mesh) -> dict:
    """The dense model's state dict on every rank: FSDP's full state dict (collective over dp),
    under tp each tp rank's shards joined over tp (``tensor_parallel.join_state_dicts``,
    collective over tp; RuntimeError when a whole parameter differs between the tp ranks)."""
    state = model.full_state_dict()
    tp = tp_group(mesh)
    return state if tp is None else join_state_dicts(tp, state)


class ReplicaShardLayout(ShardLayout):
    """A ``resharding.ShardLayout`` whose pieces are always those of dp rank ``dp_rank`` (the
    Checkpointer names a rank by its number in the job; under tp a rank's pieces are cut by its
    dp coordinate): the offsets a checkpoint saves beside each rank's part, so that
    :func:`reshard_replicas` and :func:`consolidate_fsdp` can put each tp coordinate's
    vectors back together. Arguments as ShardLayout's, plus ``dp_rank``."""

    def __init__(self, dp_rank: int, **kwargs):
        super().__init__(**kwargs)
        self.dp_rank = dp_rank

    def pieces(self, rank: int, optimizer_state) -> list[dict]:
        return super().pieces(self.dp_rank, optimizer_state)


class SavedFlat:
    """The layout of a flat vector of ``numel`` numbers saved in a checkpoint, cut for
    ``world_size`` ranks as ``parallel.zero.FlatParameter`` cuts it (``numel``, ``shard_size``,
    ``padded``, ``shard_bounds``): what ``resharding.ShardLayout`` needs of a vector whose
    parameters this rank does not hold (another tp rank's units)."""

    def __init__(self, numel: int, world_size: int):
        self.numel, self.shard_size = int(numel), -(-int(numel) // world_size)
        self.padded = self.shard_size * world_size

    def shard_bounds(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_size, (rank + 1) * self.shard_size


def reshard_replicas(parts: list, world_size: int, tp: int, sharded: bool = True) -> list:
    """The Checkpointer's ``reshard`` under tp: the training state of each of ``world_size``
    ranks (dp' = world_size / tp replicas of the same ``tp``) from the ``parts`` that dp x tp
    ranks saved (rank order). The parts of tp coordinate t (ranks t, tp + t, ...) are one FSDP
    run over dp ranks of tp rank t's units, each piece saved with its offsets
    (``resharding``): they are cut again for dp' ranks (``resharding.reshard_parts``, the
    vectors' lengths read from the saved metadata) and go to ranks d' tp + t. ``sharded``:
    False under NO_SHARD (every rank holds its whole vectors). Another tp is not resharded (the
    checkpoint's fingerprint refuses it first). Raises ReshardError naming the problem."""
    if len(parts) % tp or world_size % tp:
        raise ReshardError(f"fsdp with --tp {tp}: {len(parts)} saved parts or {world_size} ranks are not whole tp "
                           f"groups of {tp}")
    replicas, out = world_size // tp, [None] * world_size
    for t in range(tp):
        mine = parts[t::tp]
        saved = [meta for meta in mine[0].get("shards") or [] if meta["path"][0] in ("model", "optimizer")]
        model = {meta["path"][1]: (SavedFlat(meta["numel"], replicas), sharded) for meta in saved
                 if meta["path"][0] == "model"}
        moments = {meta["path"][2]: meta["numel"] for meta in saved if meta["path"][0] == "optimizer"}
        layout = ShardLayout(model=model, optimizer=[(SavedFlat(moments[i], replicas), sharded)
                                                     for i in range(len(moments))])
        for d, part in enumerate(reshard_parts(mine, layout, replicas)):
            out[d * tp + t] = part
    return out


def consolidate_fsdp(state: dict) -> dict:
    """The dense model's state dict of an fsdp checkpoint ``state`` (``checkpoint
    consolidate``): ``resharding.consolidate`` (each unit's pieces joined and cut into its
    tensors), and under tp (the fingerprint's ``tp`` T > 1) that of each tp coordinate's parts
    (ranks t, T + t, ...), the T results joined as the split model cut them
    (``tensor_parallel.join_shards``). Raises what those raise (ReshardError, RuntimeError)."""
    config = state.get("config") if isinstance(state.get("config"), dict) else {}
    tp = int(config.get("tp") or 1)
    if tp == 1 or "ranks" not in state:
        return consolidate(state)
    pieces = [consolidate({"ranks": state["ranks"][t::tp]}) for t in range(tp)]
    return {name: join_shards(name, [np.asarray(piece[name]) for piece in pieces]) for name in pieces[0]}
