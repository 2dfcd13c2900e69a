"""minidist.parallel.pipeline.plot: the Gantt chart of a pipeline schedule, beside the schedules.

The chart is read by eye, so the tests read what was drawn: one box per action (found by its
gid, the action's string), the colours and hatches of the boxes, the legend's entries.
"""
import ast
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from minidist import tracing
from minidist.parallel import pipeline
from minidist.parallel.pipeline import schedules as S
from minidist.parallel.pipeline.plot import SCHEDULE_COLORS, plot_schedule

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def boxes(ax) -> dict:
    """Each drawn box by its action's string (the patch's gid)."""
    return {patch.get_gid(): patch for patch in ax.patches}


def legend_labels(ax) -> list[str]:
    return [text.get_text() for text in ax.get_legend().get_texts()]


def test_one_box_per_action_at_its_simulated_time():
    schedule = S.one_f_one_b(3, 5)
    result = S.simulate(schedule, t_forward=1, t_backward=2)
    ax = plot_schedule([result.timeline(actions) for actions in schedule], time_unit="t_f")
    drawn = boxes(ax)
    assert len(ax.patches) == len(drawn) == sum(len(row) for row in schedule) == 30
    for action, start, end in result.timeline(schedule[1]):
        box = drawn[str(action)]
        assert (box.get_x(), box.get_width()) == pytest.approx((start, end - start))
        assert box.get_y() + box.get_height() / 2 == pytest.approx(1)  # rank 1's row
    assert ax.get_xlabel() == "time (t_f)"
    assert legend_labels(ax) == ["forward", "backward"]


def test_one_stage_per_rank_draws_every_box_of_a_kind_alike():
    schedule = S.gpipe(4, 3)
    result = S.simulate(schedule)
    ax = plot_schedule([result.timeline(actions) for actions in schedule])
    forwards = {tuple(p.get_facecolor()) for gid, p in boxes(ax).items() if "F" in gid}
    assert forwards == {matplotlib.colors.to_rgba(SCHEDULE_COLORS["F"])}
    assert not any(p.get_hatch() for p in ax.patches)


def test_interleaved_chart_tells_a_ranks_two_stages_apart():
    # p = 2 ranks, v = 2: rank 0 holds stages 0 and 2. The old chart drew 0F0 and 2F0 alike.
    p, m, v = 2, 4, 2
    schedule = S.interleaved_1f1b(p, m, v)
    result = S.simulate(schedule, t_forward=1 / v, t_backward=2 / v)
    ax = plot_schedule([result.timeline(actions) for actions in schedule])
    drawn = boxes(ax)
    for kind in "FB":
        first, second = drawn[f"0{kind}0"], drawn[f"2{kind}0"]
        assert (first.get_facecolor(), first.get_hatch()) != (second.get_facecolor(), second.get_hatch())
        assert second.get_hatch() and not first.get_hatch()
        # same stage position on another rank, same style: rank 1's stages 1 and 3
        assert drawn[f"1{kind}0"].get_facecolor() == first.get_facecolor()
        assert (drawn[f"3{kind}0"].get_facecolor(), drawn[f"3{kind}0"].get_hatch()) == \
            (second.get_facecolor(), second.get_hatch())
    assert legend_labels(ax) == ["forward", "backward", "stages 0, 1 (chunk 0)", "stages 2, 3 (chunk 1)"]


def test_interleaved_legend_names_stage_ranges_on_four_ranks():
    schedule = S.interleaved_1f1b(4, 8, 2)
    result = S.simulate(schedule, t_forward=0.5, t_backward=1)
    ax = plot_schedule([result.timeline(actions) for actions in schedule])
    assert legend_labels(ax)[-2:] == ["stages 0-3 (chunk 0)", "stages 4-7 (chunk 1)"]


def test_rows_of_strings_and_of_a_zero_bubble_run():
    ax = plot_schedule([[("0F0", 0.0, 1.0), ("0I0", 3.0, 4.0), ("0W0", 4.0, 5.0)],
                        [("1F0", 1.0, 2.0), ("1I0", 2.0, 3.0), ("1W0", 3.0, 4.0)]], title="zb")
    assert sorted(boxes(ax)) == ["0F0", "0I0", "0W0", "1F0", "1I0", "1W0"]
    assert legend_labels(ax) == ["forward", "backward (input)", "backward (weights)"]
    assert ax.get_title() == "zb"


def test_bad_rows_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="'0X0' is not of the form"):
        plot_schedule([[("0X0", 0.0, 1.0)]])
    with pytest.raises(ValueError, match="rank 1's 1F0 ends at 1.0 before it starts at 2.0"):
        plot_schedule([[("0F0", 0.0, 1.0)], [("1F0", 2.0, 1.0)]])


def test_the_package_exports_the_plot():
    assert pipeline.plot_schedule is plot_schedule
    assert pipeline.SCHEDULE_COLORS is SCHEDULE_COLORS


def test_tracing_imports_nothing_from_the_parallel_wings():
    # tracing is below the wings (DDP counts through its CountingComm): no arrow may point up.
    tree = ast.parse((ROOT / "minidist" / "tracing.py").read_text(encoding="utf-8"))
    imported = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    imported += [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    assert not [name for name in imported if name and name.startswith("minidist.parallel")]


def test_the_old_name_in_tracing_says_where_it_went():
    with pytest.raises(AttributeError, match=r"from minidist\.parallel\.pipeline\.plot import plot_schedule"):
        tracing.plot_schedule  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        tracing.nothing  # noqa: B018
