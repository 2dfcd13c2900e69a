"""minidist.course.checks.layout_search (exercise 16's puzzle): a search over planner.memory and
planner.step_time passes on the three scenarios; a fixed layout fails where it should, each with
its hint (another GPU count, a rule of check_layout, tp across nodes, out of memory, and a layout
that fits but is slow, whose hint names the term of the step where it loses most: recomputation's
compute, the data-parallel all-reduce, the bubble); planner.plan is refused inside the answer."""
import itertools

import pytest

from minidist import planner
from minidist.course.checks import LearnerError
from minidist.course.checks import layout_search as layout_checks


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
