"""The puzzle of exercise 16: choose a 3-D layout that fits and is within 1 % of the fastest.

:func:`check_choose_layout` takes your ``choose_layout(model, cluster, global_batch) ->
planner.Layout``: ``model`` a preset name of :mod:`minidist.planner` (``planner.get_model(model)``
gives its shapes), ``cluster`` a :class:`minidist.planner.Cluster`, ``global_batch`` the
sequences per step. It calls it on each of :data:`SCENARIOS` (GPT-3 175B on 512 and on 1024
A100s, global batch 1536 sequences of 2048 tokens; Llama 2 70B on 256, batch 512) and checks the
layout it returns against the planner's own model of a step:

- it is a :class:`~minidist.planner.Layout` that uses every GPU (dp x pp x tp = ``cluster.gpus``)
  and keeps the rules of ``planner.check_layout`` (tp divides the heads, pp the layers, dp x
  micro-batch the global batch, ...), with tp inside a node (tp <= ``cluster.gpus_per_node``: NVLink);
- it fits: ``planner.memory(...)["total"]`` is at most :data:`USABLE` of the GPU's memory (72 of
  80 GiB; the rest left for what the formulas leave out, as ``python -m minidist plan`` does);
- it is fast: ``planner.step_time(...)["total"]`` is within :data:`TOLERANCE` (1 %) of the best
  layout ``planner.plan`` finds with the same headroom.

A slow layout's hint names the term of ``step_time`` where it loses most against the best one
(the bubble, the data-parallel all-reduce, tensor or pipeline traffic, recomputation's extra
compute). ``planner.plan`` may not be called by your function: the search is yours to write, from
``planner.memory``, ``planner.step_time`` and ``planner.check_layout``. A failure raises
``AssertionError("what: problem\\nHint: ...")``::

    from minidist.course.checks import layout_search as layout_checks
    print(layout_checks.check_choose_layout(choose_layout))
"""
from __future__ import annotations

import sys

from minidist import planner
from minidist.course.checks import call_learner, check_own_code, fail, forbidding
from minidist.course.checks.integrity import unchanged

SCENARIOS = (("gpt3-175b", 512, 1536), ("gpt3-175b", 1024, 1536), ("llama-70b", 256, 512))
HEADROOM = 0.1
USABLE = 1 - HEADROOM
TOLERANCE = 0.01

TERMS = {
    "bubble": ("its pipeline bubble, (pp - 1)/m of the step with m = B / (dp mb) micro-batches, is larger: fewer "
               "stages, or more micro-batches per pipeline (a smaller dp or micro-batch)"),
    "dp": ("its data-parallel all-reduce costs more: the gradients of a stage cross the network once a step, so "
           "fewer, larger replicas (more pp or tp) or a lower ZeRO stage (ZeRO-3 sends 1.5 times the bytes)"),
    "tp": ("its tensor-parallel traffic costs more: four all-reduces per layer and micro-batch of b s h values, "
           "so tp only as large as memory needs, and never beyond a node's NVLink"),
    "pp": "its pipeline sends more: every micro-batch's activations cross each stage boundary",
    "compute": ("it computes more: recomputation repeats the forward (full: of every layer; selective: "
                "attention's scores); recompute only when nothing else makes the layout fit"),
}
HINTS = {
    "type": "return a planner.Layout(dp, pp, tp, micro_batch, zero_stage, recompute, sequence_parallel)",
    "gpus": "dp x pp x tp must be the cluster's GPUs, cluster.gpus: every GPU holds one rank",
    "rules": ("the layout breaks a rule of planner.check_layout; try each candidate with it (it raises ValueError "
              "with the reason) and skip those it refuses"),
    "tp_nodes": ("tp crosses nodes: a tensor-parallel group talks at every layer and must stay on one node's NVLink, "
                 "tp <= cluster.gpus_per_node"),
    "memory": ("the layout does not fit: planner.memory(model, layout, seq_len, global_batch)['total'] must be at "
               "most {usable:.0%} of cluster.gpu_memory. More pp or tp split the weights, ZeRO splits the optimizer "
               "state over dp, sequence parallelism and recomputation cut the activations"),
    "search": ("search: for every tp dividing the GPUs (up to a node), every pp dividing the rest, and every "
               "micro-batch, ZeRO stage, recomputation and sequence parallelism, keep the layouts check_layout "
               "accepts and memory fits, and take the fastest by step_time(...)['total']"),
}


def best(model: str, gpus: int, global_batch: int) -> planner.Prediction:
    """The planner's fastest layout for the scenario (with :data:`HEADROOM`)."""
    return planner.plan(model, planner.Cluster(gpus), global_batch, top=1, headroom=HEADROOM).best[0]


def _problem(what, layout, model, cluster, global_batch, target):
    """(what, problem, hint) for your layout, or None; ``target`` the planner's best Prediction."""
    if not isinstance(layout, planner.Layout):
        return what, f"expected a planner.Layout, got {type(layout).__name__}", HINTS["type"]
    if layout.gpus != cluster.gpus:
        return what, f"{layout} uses {layout.gpus} GPUs, the cluster has {cluster.gpus}", HINTS["gpus"]
    m = planner.get_model(model)
    try:
        planner.check_layout(m, layout, m.seq_len, global_batch)
    except ValueError as error:
        return what, f"{layout}: {error}", HINTS["rules"]
    if layout.tp > cluster.gpus_per_node:
        return what, f"{layout}: tp = {layout.tp} spans nodes of {cluster.gpus_per_node} GPUs", HINTS["tp_nodes"]
    need = planner.memory(m, layout, m.seq_len, global_batch)["total"]
    if need > USABLE * cluster.gpu_memory:
        return (what, f"{layout} needs {need / planner.GiB:.1f} GiB per GPU, more than the {USABLE:.0%} usable "
                      f"({USABLE * cluster.gpu_memory / planner.GiB:.0f} GiB)", HINTS["memory"].format(usable=USABLE))
    time = planner.step_time(m, layout, cluster, global_batch)
    limit = (1 + TOLERANCE) * target.time["total"]
    if time["total"] <= limit:
        return None
    worst = max(TERMS, key=lambda term: time[term] - target.time[term])
    return (what, f"{layout} takes {time['total']:.2f} s per step, more than {limit:.2f} s (1 % over the best, "
                  f"{target.layout}: {target.time['total']:.2f} s); {worst} {time[worst]:.2f} s against "
                  f"{target.time[worst]:.2f} s", f"{TERMS[worst]}. Or {HINTS['search']}")


@forbidding(planner.plan)
@unchanged(sys.modules[__name__], planner)
def check_choose_layout(choose_layout) -> str:
    """Check your ``choose_layout(model, cluster, global_batch)`` on :data:`SCENARIOS` (module
    docstring); one verdict line per scenario."""
    check_own_code(choose_layout, "choose_layout")
    lines = ["choose_layout: ok"]
    for model, gpus, global_batch in SCENARIOS:
        cluster = planner.Cluster(gpus)
        what = f"choose_layout({model!r}, Cluster({gpus}), global_batch={global_batch})"
        layout = call_learner(what, choose_layout, model, cluster, global_batch)
        target = best(model, gpus, global_batch)
        problem = _problem(what, layout, model, cluster, global_batch, target)
        if problem:
            fail(*problem)
        m = planner.get_model(model)
        need = planner.memory(m, layout, m.seq_len, global_batch)["total"] / planner.GiB
        time = planner.step_time(m, layout, cluster, global_batch)["total"]
        lines.append(f"{model} on {gpus} GPUs, batch {global_batch}: {layout}, {need:.1f} GiB, {time:.2f} s per step "
                     f"(the planner's best {target.time['total']:.2f} s)")
    return "\n".join(lines)


__all__ = ["HEADROOM", "HINTS", "SCENARIOS", "TERMS", "TOLERANCE", "USABLE", "best", "check_choose_layout"]
