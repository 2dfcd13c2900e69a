"""A pipeline's checkpoint on another layout: the stages joined into the dense model and cut again.

A pipeline (``train --strategy pipeline``) or 3-D (``--strategy 3d``) checkpoint holds one part
per rank (:class:`~minidist.fault.Checkpointer`, ``gathered=True``), in rank order: rank
(d, s) of a (D, S) grid (``pipeline.grid``: rank = d S + s), or (d, s, t) of a (D, S, T) mesh
(rank = (d S + s) T + t). Each part is the state of ``nn.Sequential(*its stages)``: keys such
as ``1.0.weight`` (the rank's second stage, its first layer), its optimizer's moments (SGD's
momentum, AdamW's ``exp_avg``/``exp_avg_sq`` and per-parameter ``step`` counts) in the order of
its parameters, and its layers' random generators. None of that fits another number of
pipelines, of stages (pp, or V stages a rank with ``--schedule interleaved``, which numbers
them r, r + S, ...), or of tensor-parallel ranks.

With a fixed global batch (``--global-batch-size``) the state *means* the same on any layout:
the D pipelines hold the same weights (their gradients were averaged), the micro-batches are
equal, so the step is the global batch's mean whatever D, S, T or their number. The new run's
rank 0 therefore (:func:`reshard_pipeline`; Megatron-LM's checkpoint converter does the same
offline):

1. joins pipeline 0's parts into the dense model's state: every stage's parameters, each named
   as the dense model names it (:func:`rank_maps`, from the run's own model split the old way),
   their tp shards joined (``tensor_parallel.join_shards``), each moment and step count the
   same way; the tied token embedding, which the first and the last stage each hold, once (the
   first stage's copy: both were updated with the same summed gradient);
2. cuts that state for each rank of the new layout (the model split the new way; tp shards by
   ``tensor_parallel.plan.shard_of``); the step, schedule, position, windows and the default
   generator are rank 0's, the same on every rank.

Costs one dense copy of the weights and of each moment on rank 0. The data position needs no
change: with G fixed a step is the same G samples on any layout (``data.GlobalBatchSampler``,
``data.TokenWindows``). Not resharded: PipeDream's schedules (no flush: each stage keeps
several weight versions, stashed per micro-batch, and its updates follow no global batch, so no
dense state is "the model" at a step; :func:`check_global_batch_layout`, which says which layouts
take a global batch at all, refuses them) and 3d with ``--zero`` (AdamW's moments are ZeRO-1
shards of a flat vector over dp).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from minidist import nn
from minidist.parallel.tensor_parallel.plan import join_shards, shard_of
from minidist.resharding import MOMENT_KEYS, ReshardError
from minidist.train import PIPEDREAM_SCHEDULES, PIPELINE_SCHEDULES, TrainConfig

FLUSHING = tuple(s for s in PIPELINE_SCHEDULES if s not in PIPEDREAM_SCHEDULES)  # the schedules that take a G


def check_global_batch_layout(world_size: int, config: TrainConfig) -> None:
    """Raise ValueError, naming the values that work, when ``config.global_batch_size`` G cannot
    be one step of D = ``config.dp`` pipelines on ``world_size`` ranks (of the pipeline grid):
    a PipeDream schedule (no flush: each stage updates after every micro-batch's backward, from
    one of several stashed weight versions, so no step is a global batch's mean and no single
    dense state could be cut again for another layout), D not dividing G, or
    ``config.microbatches`` not dividing G / D (equal micro-batches make the pipeline's mean of
    micro-batch means the mean over its G / D samples, so the step is the global batch's on any
    layout)."""
    g, dp, m = config.global_batch_size, config.dp, config.microbatches
    if config.schedule in PIPEDREAM_SCHEDULES:
        raise ValueError(f"--global-batch-size applies to the flushing schedules ({', '.join(FLUSHING)}), "
                         f"not to --schedule {config.schedule}: it updates each stage after every micro-batch from "
                         "stashed weight versions, with no flush, so no step is one global batch and its checkpoint "
                         "holds no one model to cut again for another layout; give it --batch-size instead")
    if g % dp:
        raise ValueError(f"--global-batch-size {g} is not divisible by --dp {dp} (each pipeline reads G / dp samples a "
                         f"step); use a multiple of {dp}, or --dp among "
                         f"{[d for d in range(1, world_size + 1) if g % d == 0 and world_size % d == 0]}")
    if (g // dp) % m:
        raise ValueError(f"--global-batch-size {g} gives each of the {dp} pipelines {g // dp} samples a step, which "
                         f"--microbatches {m} does not divide (equal micro-batches make the step's mean loss the "
                         f"global batch's); use --microbatches among "
                         f"{[k for k in range(1, g // dp + 1) if (g // dp) % k == 0]}, or another G")


@dataclass(frozen=True)
class PipelineLayout:
    """A pipeline run's layout: ``dp`` pipelines of ``pp`` ranks, each rank ``stages_per_rank``
    stages (V: 1 but for ``--schedule interleaved``), each stage over ``tp`` tensor-parallel
    ranks (1 for ``--strategy pipeline``). ``num_stages`` = pp x V; ``world_size`` = dp x pp x tp."""

    dp: int
    pp: int
    tp: int = 1
    stages_per_rank: int = 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def rank(self, d: int, s: int, t: int = 0) -> int:
        """The rank of coordinate (d, s, t): row-major, tp fastest (``DeviceMesh``'s order)."""
        return (d * self.pp + s) * self.tp + t

    @classmethod
    def of(cls, config) -> PipelineLayout:
        """The layout a checkpoint's fingerprint (a dict: ``Checkpointer.fingerprint``) or a
        TrainConfig describes. Raises ReshardError when the fields do not make one (world size
        not a multiple of dp x tp)."""
        get = config.get if isinstance(config, dict) else lambda k, default=None: getattr(config, k, default)
        dp, tp, size = int(get("dp", 1) or 1), int(get("tp", 1) or 1), int(get("world_size", 0) or 0)
        if get("strategy") == "pipeline":
            tp = 1
        if size < 1 or size % (dp * tp):
            raise ReshardError(f"a layout of {size} ranks with dp {dp} and tp {tp} has no whole pipelines")
        v = int(get("stages_per_rank", 1) or 1) if get("schedule") == "interleaved" else 1
        return cls(dp, size // (dp * tp), tp, v)

    def describe(self) -> str:
        """``dp 2 x pp 2`` (and ``x tp 2``, ``, 2 stages per rank`` when they are not 1)."""
        return (f"dp {self.dp} x pp {self.pp}" + (f" x tp {self.tp}" if self.tp > 1 else "")
                + (f", {self.stages_per_rank} stages per rank" if self.stages_per_rank > 1 else ""))


@dataclass(frozen=True)
class RankMap:
    """One pipeline rank's part of the dense model: ``keys`` (its state-dict key -> the dense
    parameter's name), ``order`` (its optimizer's parameters, as dense names), ``generators``
    (its layers' random generators, in ``modules()`` order, as indices into the whole chain's)."""

    keys: dict
    order: list
    generators: list


def has_generator(module) -> bool:
    """Whether ``module`` owns a NumPy generator (a Dropout: the Checkpointer saves its state)."""
    return isinstance(getattr(module, "generator", None), np.random.Generator)


def rank_maps(model, stage_modules: list, pp: int) -> list[RankMap]:
    """The :class:`RankMap` of each of ``pp`` pipeline ranks when ``model``'s chain is cut into
    ``stage_modules`` (rank r holds stages r, r + pp, ...: the drivers' numbering, interleaved
    included). ``model``: the module whose ``named_parameters`` name the dense state (the MLP,
    the GPT or its tensor-parallel copy: same names); the stages: a cut of a chain over its own
    layers (``split_model``: no copies), so parameters are matched by identity. Raises
    ReshardError when ``pp`` does not divide the stages."""
    if pp < 1 or len(stage_modules) % pp:
        raise ReshardError(f"{len(stage_modules)} stages do not spread evenly over {pp} pipeline ranks")
    names = {id(p): name for name, p in model.named_parameters()}  # a tied Parameter under its first name
    chain = [m for stage in stage_modules for m in stage.modules() if has_generator(m)]
    index = {id(m): i for i, m in enumerate(chain)}
    maps = []
    for r in range(pp):
        held = [stage_modules[s] for s in range(r, len(stage_modules), pp)]
        keys = {key: names[id(p)] for key, p in nn.Sequential(*held).named_parameters(remove_duplicate=False)}
        order = [names[i] for i in {id(p): None for stage in held for p in stage.parameters()}]
        generators = [index[id(m)] for stage in held for m in stage.modules() if has_generator(m)]
        maps.append(RankMap(keys, order, generators))
    return maps


def _join(name: str, shards: list):
    return shards[0] if len(shards) == 1 else join_shards(name, shards)


def join_stages(parts: list, layout: PipelineLayout, maps: list[RankMap], optimizer: bool = True) -> dict:
    """The dense state of pipeline 0's ``parts`` (a checkpoint's ``"ranks"``, written on
    ``layout``; ``maps``: :func:`rank_maps` of that layout): ``{"model": {name: array},
    "moments": {key: {name: array or None}}, "steps": {name: count}, "generators": {index:
    state}}`` (module docstring, step 1; the weights alone when ``optimizer`` is False). Raises
    ReshardError naming what does not fit: another number of parts, a key, moment or generator
    the parts lack or hold more of."""
    if len(parts) != layout.world_size:
        raise ReshardError(f"{len(parts)} ranks' parts, but its layout ({layout.describe()}) has {layout.world_size}")
    model, moments, steps, generators = {}, {key: {} for key in MOMENT_KEYS}, {}, {}
    try:
        for s, rank_map in enumerate(maps):
            row = [parts[layout.rank(0, s, t)] for t in range(layout.tp)]
            saved = set(row[0]["model"])
            if saved != set(rank_map.keys):
                raise ReshardError(f"pipeline rank {s}'s part holds {sorted(saved ^ set(rank_map.keys))[:3]} that "
                                   "its stages do not (or the reverse): a checkpoint of another model or cut")
            for key, name in rank_map.keys.items():
                model.setdefault(name, _join(name, [part["model"][key] for part in row]))
            if not optimizer:
                continue
            optimizers = [part["optimizer"] for part in row]
            for key in (k for k in MOMENT_KEYS if k in optimizers[0]):
                if any(len(o[key]) != len(rank_map.order) for o in optimizers):
                    raise ReshardError(f"pipeline rank {s}'s optimizer/{key} holds {len(optimizers[0][key])} moments "
                                       f"for the {len(rank_map.order)} parameters of its stages")
                for i, name in enumerate(rank_map.order):
                    if name not in moments[key]:
                        values = [o[key][i] for o in optimizers]
                        moments[key][name] = None if values[0] is None else _join(name, values)
            for i, name in enumerate(rank_map.order):
                if "step" in optimizers[0]:
                    steps.setdefault(name, optimizers[0]["step"][i])
            rng = row[0]["rng"][1:]  # after the default generator
            if len(rng) == len(rank_map.generators):
                generators.update(zip(rank_map.generators, rng))
    except KeyError as error:
        raise ReshardError(f"a rank's part of the checkpoint lacks {error}") from None
    except RuntimeError as error:  # a whole parameter whose tp copies differ
        raise ReshardError(str(error)) from None
    return {"model": model, "moments": {k: v for k, v in moments.items() if v}, "steps": steps,
            "generators": generators}


def cut_stages(dense: dict, layout: PipelineLayout, maps: list[RankMap], template: dict, n_head: int,
               generators: list) -> list:
    """The parts of every rank of ``layout`` (rank order) from :func:`join_stages`' ``dense``:
    each rank's parameters, moments and step counts by its :class:`RankMap` (``maps``:
    :func:`rank_maps` of ``layout``), tp shards cut by ``shard_of`` (``n_head`` heads); the rest
    of ``template`` (an old part: step, position, schedule, windows, the default generator) as
    it is. A layer generator the old parts did not say (a tensor-parallel copy holds other
    Dropouts than the dense model; only with --dropout 0, whose masks are never drawn) takes
    its state in ``generators`` (the chain's, this run's). Raises ReshardError naming a tensor
    the joined state lacks."""
    def cut(name, whole, t):
        return whole if whole is None or layout.tp == 1 else shard_of(name, whole, t, layout.tp, n_head)

    out = [None] * layout.world_size
    try:
        for d in range(layout.dp):
            for s, rank_map in enumerate(maps):
                for t in range(layout.tp):
                    part = copy.copy(template)
                    part["model"] = {key: cut(name, dense["model"][name], t) for key, name in rank_map.keys.items()}
                    optimizer = dict(template["optimizer"])
                    for key, whole in dense["moments"].items():
                        optimizer[key] = [cut(name, whole[name], t) for name in rank_map.order]
                    if "step" in optimizer:
                        optimizer["step"] = [dense["steps"][name] for name in rank_map.order]
                    part["optimizer"] = optimizer
                    part["rng"] = [template["rng"][0]] + [dense["generators"].get(g, generators[g])
                                                          for g in rank_map.generators]
                    out[layout.rank(d, s, t)] = part
    except KeyError as error:
        raise ReshardError(f"the joined checkpoint lacks {error} (another model?)") from None
    return out


def reshard_pipeline(parts: list, layout: PipelineLayout, model, split, n_head: int = 1) -> list:
    """The parts of each rank of this run's ``layout`` from the ``parts`` a pipeline or 3-D run
    saved on another (read from the parts' own fingerprint, ``PipelineLayout.of``): joined
    (:func:`join_stages`) and cut again (:func:`cut_stages`), module docstring. ``model``: this
    run's (rank 0's) model, whose parameter names name the dense state; ``split(num_stages)``:
    its chain cut into that many stages as the driver cuts it; ``n_head``: the GPT's heads (for
    tp shards). Rank 0 of the new run calls it (``Checkpointer(reshard=...)``). Raises
    ReshardError naming what does not fit (module docstring: a PipeDream or ZeRO checkpoint,
    another model, parts of another number)."""
    saved = parts[0].get("config") if isinstance(parts[0], dict) else None
    if not isinstance(saved, dict):
        raise ReshardError("its parts do not say the layout that wrote them (no fingerprint)")
    if saved.get("zero"):
        raise ReshardError("a 3d run with --zero keeps AdamW's moments as ZeRO-1 shards of a flat vector over dp; it "
                           "resumes on its own layout only")
    old = PipelineLayout.of(saved)
    try:
        old_stages, new_stages = split(old.num_stages), split(layout.num_stages)
    except ValueError as error:
        raise ReshardError(f"its {old.num_stages} stages ({old.describe()}) do not cut this model: {error}") from None
    chain = [m for stage in new_stages for m in stage.modules() if has_generator(m)]
    dense = join_stages(parts, old, rank_maps(model, old_stages, old.pp))
    return cut_stages(dense, layout, rank_maps(model, new_stages, layout.pp), parts[0], n_head,
                      [m.generator.bit_generator.state for m in chain])


def consolidate_stages(state: dict, model, split) -> dict:
    """The dense ``state_dict`` (name -> array; a tied parameter under each of its names, as
    ``model.state_dict()``) of a pipeline or 3-D checkpoint ``state`` (a gathered one:
    ``"ranks"`` and ``"config"``): pipeline 0's stages and tp shards joined
    (:func:`join_stages`). ``model``: a model of the run's shape, whose parameter names name the
    state (its values unused); ``split(num_stages)``: its chain cut as the driver cut it.
    ``checkpoint consolidate`` calls it. Raises ReshardError naming what does not fit."""
    layout = PipelineLayout.of(state.get("config") or {})
    try:
        stages = split(layout.num_stages)
    except ValueError as error:
        raise ReshardError(f"its {layout.num_stages} stages ({layout.describe()}) do not cut this model: {error}") \
            from None
    joined = join_stages(state["ranks"], layout, rank_maps(model, stages, layout.pp), optimizer=False)["model"]
    first = {id(p): name for name, p in model.named_parameters()}
    return {name: joined[first[id(p)]] for name, p in model.named_parameters(remove_duplicate=False)}
