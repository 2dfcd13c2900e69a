"""minidist.course.checks.layout_search (exercise 16's puzzle): a search over planner.memory and
planner.step_time passes on the three scenarios; a fixed layout fails where it should, each with
its hint (another GPU count, a rule of check_layout, tp across nodes, out of memory, and a layout
that fits but is slow, whose hint names the term of the step where it loses most: recomputation's
compute, the data-parallel all-reduce, the bubble); planner.plan is refused inside the answer. The
second part, mesh_checks.check_farthest_link: the links each dimension's groups cross under a mesh
order, with a hint for the order read backwards, a group judged by its span alone (tp = 3
straddling nodes of 8), a dimension of size 1 and a wrong type."""
import itertools
import math

import numpy as np
import pytest

from minidist import planner
from minidist.course.checks import LearnerError
from minidist.course.checks import layout_search as layout_checks
from minidist.course.checks import mesh as mesh_checks


def search(model, cluster, global_batch):
    """The solution: every layout the rules and memory allow, the fastest by step_time."""
    m = planner.get_model(model)
    found = []
    for tp in (t for t in range(1, cluster.gpus_per_node + 1) if cluster.gpus % t == 0):
        for pp in (p for p in range(1, cluster.gpus // tp + 1) if (cluster.gpus // tp) % p == 0):
            dp = cluster.gpus // (tp * pp)
            for mb, zero, recompute, sp in itertools.product((1, 2, 4, 8), (0, 1, 2, 3) if dp > 1 else (0,),
                                                             planner.RECOMPUTE, (False, True) if tp > 1 else (False,)):
                layout = planner.Layout(dp, pp, tp, mb, zero, recompute, sp)
                try:
                    planner.check_layout(m, layout, m.seq_len, global_batch)
                except ValueError:
                    continue
                if planner.memory(m, layout, m.seq_len, global_batch)["total"] <= 0.9 * cluster.gpu_memory:
                    found.append((planner.step_time(m, layout, cluster, global_batch)["total"], str(layout), layout))
    return min(found)[2]


def fixed(dp_of_gpus, pp, tp, **options):
    """A layout chosen without a search: dp the GPUs left over by pp and tp (or a function of the GPUs)."""
    def choose(model, cluster, global_batch):
        dp = dp_of_gpus(cluster.gpus) if callable(dp_of_gpus) else cluster.gpus // (pp * tp)
        return planner.Layout(dp, pp, tp, **options)
    return choose


def test_the_search_passes_every_scenario():
    verdict = layout_checks.check_choose_layout(search)
    assert verdict.startswith("choose_layout: ok")
    assert "gpt3-175b on 512 GPUs, batch 1536: dp=8 pp=8 tp=8 mb=1 zero=1 recompute=none, 66.4 GiB, 47.71 s" in verdict


@pytest.mark.parametrize("choose, fragment", [
    (lambda model, cluster, batch: (8, 8, 8), "return a planner.Layout"),
    (fixed(lambda gpus: 8, 8, 4), "must be the cluster's GPUs"),
    (fixed(None, 64, 8), "try each candidate with it"),
    (fixed(None, 8, 16, zero_stage=1), "must stay on one node's NVLink"),
    (fixed(None, 1, 8, zero_stage=1), "the layout does not fit"),
    (fixed(None, 8, 8, zero_stage=1, recompute="full"), "recomputation repeats the forward"),
    (fixed(None, 2, 8, zero_stage=2, sequence_parallel=True), "data-parallel all-reduce costs more"),
    (fixed(None, 8, 4, zero_stage=1, recompute="selective"), "pipeline bubble"),
])
def test_each_wrong_layout_gets_its_hint(choose, fragment):
    with pytest.raises(AssertionError, match="Hint: ") as caught:
        layout_checks.check_choose_layout(choose)
    assert fragment in str(caught.value), str(caught.value)


def test_the_planners_own_search_is_refused():
    def planned(model, cluster, global_batch):
        return planner.plan(model, cluster, global_batch, headroom=0.1).best[0].layout

    with pytest.raises(LearnerError, match="own implementation, not yours"):
        layout_checks.check_choose_layout(planned)


# -- the puzzle's second part: the links a mesh order puts each dimension on (checks/mesh.py) --------

def farthest_link(shape, order, tiers):
    """The solution: every group of every dimension, each member's node and rack."""
    grid = np.arange(math.prod(shape.values())).reshape([shape[name] for name in order])
    found = {}
    for name in ("dp", "pp", "tp"):
        groups = np.moveaxis(grid, order.index(name), -1).reshape(-1, shape[name])
        found[name] = max(2 if len(set(g // tiers[1])) > 1 else 1 if len(set(g // tiers[0])) > 1 else 0
                          for g in groups)
    return found


def spanned(shape, order, tiers):
    """The span of a group alone: stride (size - 1) + 1 ranks, against a node's and a rack's."""
    found = {}
    for name in ("dp", "pp", "tp"):
        stride = math.prod(shape[n] for n in order[order.index(name) + 1:])
        span = stride * (shape[name] - 1) + 1
        found[name] = 0 if shape[name] == 1 or span <= tiers[0] else 1 if span <= tiers[1] else 2
    return found


def test_farthest_link_passes_and_pp_outermost_puts_pp_across_racks():
    verdict = mesh_checks.check_farthest_link(farthest_link)
    assert verdict.startswith("farthest_link: ok")
    # Megatron-Core's order (tp-cp-ep-dp-pp, innermost first): tp on NVLink, dp in a rack, pp across racks
    assert "('pp', 'dp', 'tp') of {'dp': 4, 'pp': 4, 'tp': 8} on nodes of 8, racks of 32: tp node, dp rack, " \
           "pp network" in verdict


@pytest.mark.parametrize("answer, fragment", [
    (lambda shape, order, tiers: farthest_link(shape, tuple(reversed(order)), tiers), "the last name varies fastest"),
    (spanned, "still straddle two nodes"),
    (lambda shape, order, tiers: {**farthest_link(shape, order, tiers), "dp": 1}, "expected"),
    (lambda shape, order, tiers: [0, 0, 0], 'return a dict {"dp": tier'),
    (lambda shape, order, tiers: {n: 1 if shape[n] == 1 else v for n, v in farthest_link(shape, order, tiers).items()},
     "a dimension of size 1 has groups of one rank"),
])
def test_each_wrong_farthest_link_gets_its_hint(answer, fragment):
    with pytest.raises(AssertionError, match="Hint: ") as caught:
        mesh_checks.check_farthest_link(answer)
    assert fragment in str(caught.value), str(caught.value)
