"""Resharding a checkpoint: state saved in pieces by N ranks, loaded by M.

ZeRO-1 keeps each rank's optimizer moments for one shard of a flat, padded vector of the
parameters (``parallel.zero.FlatParameter``); FSDP keeps the parameters themselves that way,
one vector per unit. A checkpoint gathers every rank's pieces into one file, so on the same
number of ranks each rank takes its own piece back. On another number the pieces no longer fit:
N shards of ``ceil(n / N)`` numbers, the last padded, are not M shards of ``ceil(n / M)``.

The fix is torch.distributed.checkpoint's (DCP): every saved piece carries its *metadata*, the
length ``numel`` of the whole tensor it belongs to (without padding) and where the piece lies in
it (``offset``, ``length``: DCP's chunk offsets and sizes); a rank of the new run asks for the
range it holds now and copies the overlapping parts of the saved pieces into it::

    saved by N = 3 (numel 10, shards of 4):  [0 1 2 3][4 5 6 7][8 9 . .]      (. padding)
    wanted by M = 2 (shards of 5):           [0 1 2 3 4][5 6 7 8 9]
    rank 1 of M reads 5..8 from piece 1, 8..10 from piece 2; nothing from the padding

Reading costs one pass over the saved numbers per rank (here all on rank 0, which reads the one
file: :class:`~minidist.fault.Checkpointer` ``gathered=True``); the padding of the old layout is
never read (positions >= numel are zeros in the new one) and a position no saved piece covers is
an error, not a silent zero.

:class:`ShardLayout` says which leaves of a rank's training state are such pieces (the
drivers build it from their FlatParameters); :func:`shard_metadata` is what a checkpoint stores
beside each rank's part; :func:`reshard_parts` turns N saved parts into M.
"""
from __future__ import annotations

import copy

import numpy as np

# The optimizer state's keys that hold one array per parameter (SGD, Adam/AdamW).
MOMENT_KEYS = ("velocity", "exp_avg", "exp_avg_sq")


class ReshardError(ValueError):
    """Saved pieces that cannot make the state a rank of the new run needs (a tensor of another
    length: another model; a range no piece covers; a checkpoint without shard metadata). The
    message names the piece and the difference."""


class ShardLayout:
    """Which leaves of one rank's training state are pieces of flat vectors, and where.

    Args:
        model: ``{name: (flat, sharded)}`` for the model's ``state_dict`` entries that are
            pieces (FSDP's ``<unit>.flat_param``); ``flat`` has ``numel``, ``padded``,
            ``shard_size`` and ``shard_bounds(rank)`` (``parallel.zero.FlatParameter``),
            ``sharded`` False when every rank holds the whole padded vector (NO_SHARD).
        optimizer: one ``(flat, sharded)`` per parameter the optimizer steps, whose moments
            (:data:`MOMENT_KEYS`) are pieces of that flat vector (ZeRO-1's one shard, FSDP's
            units).
        names: ``{id(parameter): [its names in the module]}`` for the parameters inside the
            model's flat vectors (``flat.params``): saved with each piece (the tensors' names
            and shapes) so that ``checkpoint consolidate`` can cut the vector offline.
    """

    def __init__(self, model: dict | None = None, optimizer: list | None = None, names: dict | None = None):
        self.model, self.optimizer, self.names = dict(model or {}), list(optimizer or []), names

    def bounds(self, flat, sharded: bool, rank: int) -> tuple[int, int]:
        """(offset, length) of rank ``rank``'s piece of ``flat``."""
        start, stop = flat.shard_bounds(rank) if sharded else (0, flat.padded)
        return start, stop - start

    def pieces(self, rank: int, optimizer_state) -> list[dict]:
        """Rank ``rank``'s pieces: ``{"path", "numel", "offset", "length"}`` each (``path``: the
        keys from the state's top down to the leaf, e.g. ``["optimizer", "exp_avg", 0]``); the
        optimizer's moments those of ``optimizer_state`` has (SGD: velocity; Adam: two)."""
        out = []
        for name, (flat, sharded) in self.model.items():
            offset, length = self.bounds(flat, sharded, rank)
            entry = {"path": ["model", name], "numel": flat.numel, "offset": offset, "length": length}
            if self.names is not None:  # the tensors inside, for `checkpoint consolidate`
                entry["tensors"] = [{"names": self.names[id(p)], "shape": list(shape)}
                                    for p, shape in zip(flat.params, flat.shapes)]
            out.append(entry)
        keys = [k for k in MOMENT_KEYS if isinstance(optimizer_state, dict) and k in optimizer_state]
        for key in keys:
            for i, (flat, sharded) in enumerate(self.optimizer):
                offset, length = self.bounds(flat, sharded, rank)
                out.append({"path": ["optimizer", key, i], "numel": flat.numel, "offset": offset, "length": length})
        return out


def shard_metadata(layout: ShardLayout | None, rank: int, state: dict) -> list[dict] | None:
    """What a checkpoint stores beside rank ``rank``'s ``state`` (its ``"shards"`` entry): the
    pieces of :meth:`ShardLayout.pieces`, or None without a layout."""
    if layout is None:
        return None
    return layout.pieces(rank, state.get("optimizer"))


def leaf(state, path):
    """The value at ``path`` (a list of keys and indices) in nested dicts and lists."""
    for key in path:
        state = state[key]
    return state


def _set_leaf(state, path, value):
    for key in path[:-1]:
        state = state[key]
    state[path[-1]] = value


def assemble(parts: list, path: list, numel: int, offset: int, length: int):
    """The numbers ``offset .. offset + length`` of the whole tensor at ``path``, from the saved
    ``parts`` (each with its ``"shards"`` metadata): each part's piece that overlaps the range
    copied in, positions >= ``numel`` zeros (padding). None when the saved pieces are None (an
    optimizer before its first step). Raises ReshardError for a piece of another ``numel``, or
    pieces that do not tile the vector in rank order (:func:`check_tiling`)."""
    pieces = []
    for rank, part in enumerate(parts):
        meta = next((m for m in part.get("shards") or [] if list(m["path"]) == list(path)), None)
        if meta is None:
            raise ReshardError(f"rank {rank}'s part of the checkpoint has no piece at {'/'.join(map(str, path))}")
        if meta["numel"] != numel:
            raise ReshardError(f"{'/'.join(map(str, path))} holds {meta['numel']} numbers in the checkpoint, "
                               f"{numel} in this run (another model?)")
        pieces.append((meta, leaf(part, path)))
    if all(array is None for _, array in pieces):
        return None
    check_tiling(path, numel, pieces)
    dtype = next(np.asarray(a).dtype for _, a in pieces if a is not None)
    out = np.zeros(length, dtype=dtype)
    covered = np.zeros(length, dtype=bool)
    stop = min(offset + length, numel)
    for meta, array in pieces:
        lo, hi = max(offset, meta["offset"]), min(stop, meta["offset"] + meta["length"])
        if lo < hi and array is not None:
            out[lo - offset : hi - offset] = np.asarray(array).reshape(-1)[lo - meta["offset"] : hi - meta["offset"]]
            covered[lo - offset : hi - offset] = True
    missing = np.flatnonzero(~covered[: max(0, stop - offset)])
    if missing.size:  # not expected after check_tiling
        raise ReshardError(f"{'/'.join(map(str, path))}: positions {offset + missing[0]}.. of {numel} are in no saved "
                           "piece (a checkpoint missing a rank's part?)")
    return out


def check_tiling(path: list, numel: int, pieces: list) -> None:
    """That the saved ``pieces`` (``(metadata, array)`` in rank order) are the whole vector at
    ``path`` once: every piece whole (offset 0, at least ``numel`` long: NO_SHARD), or rank r's
    piece starting where rank r - 1's ends, from 0 to ``numel`` or beyond (the padding), as
    FlatParameter cuts it; and each array as long as its metadata says. Offsets swapped between
    two ranks (each piece where the other's belongs, the checksum valid) would cover the vector
    once but put every number of both in the wrong place. Raises ReshardError naming the ranks."""
    where = "/".join(map(str, path))
    for rank, (meta, array) in enumerate(pieces):
        if array is not None and np.asarray(array).size != meta["length"]:
            raise ReshardError(f"{where}: rank {rank}'s piece holds {np.asarray(array).size} numbers, its metadata "
                               f"says {meta['length']}")
    if all(meta["offset"] == 0 and meta["length"] >= numel for meta, _ in pieces):
        return
    end = 0
    for rank, (meta, _) in enumerate(pieces):
        if meta["offset"] < end or (rank == 0 and meta["offset"] != 0):
            before = f"where rank {rank - 1}'s ends at {end}" if rank else "not 0"
            raise ReshardError(f"{where}: rank {rank}'s piece starts at {meta['offset']}, {before}: the saved offsets "
                               "do not tile the vector once in rank order (swapped or edited pieces)")
        if meta["offset"] > end:
            raise ReshardError(f"{where}: positions {end}.. of {numel} are in no saved piece (rank {rank}'s starts at "
                               f"{meta['offset']}: a checkpoint missing a rank's part?)")
        end = meta["offset"] + meta["length"]
    if end < numel:
        raise ReshardError(f"{where}: positions {end}.. of {numel} are in no saved piece (a checkpoint missing a "
                           "rank's part?)")


def reshard_parts(parts: list, layout: ShardLayout, world_size: int) -> list:
    """The training state of each of ``world_size`` ranks from the ``parts`` N ranks saved:
    rank 0's part (the replicated leaves: step, position, schedule, generators, scaler, the
    optimizer's step counts) with every piece of ``layout`` assembled for the new rank from all
    the saved pieces (:func:`assemble`). Raises ReshardError when a part has no shard metadata
    (a checkpoint written before it was saved: resume it on its own number of ranks) or the
    pieces do not fit."""
    lacking = [rank for rank, part in enumerate(parts) if not isinstance(part, dict) or part.get("shards") is None]
    if lacking:
        raise ReshardError(f"it was written without shard metadata (rank {lacking[0]}'s part has none: an older "
                           f"checkpoint), so it resumes only on its own {len(parts)} ranks")
    out = []
    for rank in range(world_size):
        part = copy.copy(parts[0])
        for top in ("model", "optimizer"):
            if top in part:
                part[top] = _copy_tree(part[top])
        pieces = layout.pieces(rank, part.get("optimizer"))
        for meta in pieces:
            _set_leaf(part, meta["path"], assemble(parts, meta["path"], meta["numel"], meta["offset"], meta["length"]))
        part["shards"] = pieces
        out.append(part)
    return out


def _copy_tree(value):
    """Dicts and lists copied (not the arrays in them), so a leaf can be replaced in one copy."""
    if isinstance(value, dict):
        return {k: _copy_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_tree(v) for v in value]
    return value


def consolidate(state: dict) -> dict:
    """The whole model's ``state_dict`` (name -> array) of a checkpoint's ``state``: a replicated
    one's ``"model"``; a gathered one's (``"ranks"``) rank 0 ``"model"`` when it is whole (ZeRO-1),
    else each piece of ``"shards"`` under ``model`` put back together from every rank's part and
    cut into its tensors by their names and shapes (FSDP). Raises ReshardError naming what is
    missing (pieces without the tensors' names and shapes, from an older checkpoint)."""
    if "ranks" not in state:
        return dict(state["model"])
    parts = state["ranks"]
    first = parts[0]
    flat = [m for m in first.get("shards") or [] if m["path"][0] == "model"]
    if not flat:
        return dict(first["model"])
    out = {}
    for meta in flat:
        if "tensors" not in meta:
            raise ReshardError(f"the piece {'/'.join(map(str, meta['path']))} lacks its tensors' names and shapes")
        whole = assemble(parts, meta["path"], meta["numel"], 0, meta["numel"])
        start = 0
        for tensor in meta["tensors"]:
            size = int(np.prod(tensor["shape"], dtype=np.int64))
            for name in tensor["names"]:
                out[name] = whole[start : start + size].reshape(tensor["shape"]).copy()
            start += size
    return out
