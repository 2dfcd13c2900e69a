"""minidist.course.explorers: the layout explorer's text (its numbers are the planner's), and the
widget built and driven headless (ipywidgets objects need no front end)."""
import matplotlib

matplotlib.use("Agg")

import pytest

from minidist import planner
from minidist.course import explorers


def test_layout_report_shows_the_planners_numbers():
    text = explorers.layout_report("gpt3-175b", 1024, dp=8, pp=16, tp=8, recompute="full", global_batch=1536)
    layout = planner.Layout(8, 16, 8, 1, 0, "full")
    mem = planner.memory("gpt3-175b", layout, None, 1536)
    time = planner.step_time("gpt3-175b", layout, planner.Cluster(1024), 1536)
    lines = text.splitlines()
    assert lines[0] == ("gpt3-175b on 1024 GPUs: dp=8 pp=16 tp=8 mb=1 zero=0 recompute=full, "
                        "global batch 1536 x 2048 tokens")
    assert f"  optimizer   {mem['optimizer'] / planner.GiB:8.1f}  ########" in lines
    assert f"  total       {mem['total'] / planner.GiB:8.1f}  {'#' * 14}" in lines  # 27.2 of 80 GiB: 14 of 40
    assert "  fits: 52.8 GiB free of 80 GiB" in lines
    assert lines[-1].startswith(f"step time {time['total']:.2f} s = compute {time['compute']:.2f} + tp ")
    assert lines[-1].endswith("MFU 31.8%, 132.3 TFLOP/s per GPU")


def test_layout_report_says_why_a_layout_cannot_run():
    over = explorers.layout_report("gpt3-175b", 1024, dp=128, pp=1, tp=8, global_batch=1536)
    assert "OUT OF MEMORY" in over and "|>" in over  # the bar stops at the GPU's memory
    assert explorers.layout_report("gpt3-175b", 1024, dp=8, pp=12, tp=8).endswith(
        "cannot run: dp x pp x tp = 8 x 12 x 8 = 768, not the 1024 GPUs")
    assert "does not divide the 25 attention heads" in explorers.layout_report("gpt2-xl", 8, dp=2, pp=1, tp=4)
    assert "unknown model 'bert'" in explorers.layout_report("bert", 8, dp=8, pp=1, tp=1)


def test_explorer_falls_back_to_text_outside_a_notebook():
    assert explorers.layout_explorer() == explorers.layout_report()  # pytest is no notebook kernel
    assert explorers.layout_explorer(widget=False, pp=8, dp=16) == explorers.layout_report(pp=8, dp=16)


def test_the_widget_builds_and_its_callback_runs_headless():
    pytest.importorskip("ipywidgets")
    box = explorers.layout_explorer(widget=True)
    assert box.text.value == f"<pre>{explorers.layout_report()}</pre>"
    box.controls["pp"].value = 8  # dp follows: 1024 / (8 x 8) = 16
    assert "dp=16 pp=8 tp=8" in box.text.value
    box.controls["zero_stage"].value = 1
    assert box.update() == explorers.layout_report(dp=16, pp=8, zero_stage=1)
    box.controls["model"].value = "gpt2-xl"  # 25 heads: tp = 8 cannot run, said in the text
    assert "does not divide the 25 attention heads" in box.text.value
    assert box._repr_mimebundle_()["text/plain"] == box.report == box.update()  # not VBox(children=...)


# ------------------------------------------------------------------ the schedule explorer (chapter 08)
import html  # noqa: E402
import re  # noqa: E402
from fractions import Fraction  # noqa: E402

from minidist.parallel.pipeline.schedules import (  # noqa: E402
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    simulate,
    zero_bubble,
)

GENERATORS = {"gpipe": lambda p, m, v: gpipe(p, m), "1f1b": lambda p, m, v: one_f_one_b(p, m),
              "interleaved": interleaved_1f1b, "zero-bubble": lambda p, m, v: zero_bubble(p, m)}
LENGTH = {"F": 1, "B": 2, "I": 1, "W": 1}  # units: t_f = t_I = t_W = 1, B = I + W


def timeline_rows(text: str) -> list[str]:
    return [line.split("|", 1)[1] for line in text.splitlines() if line.startswith("rank ")]


def test_schedule_report_draws_gpipe_by_hand():
    # p = 2, m = 2, t_f = 1, t_b = 2: rank 1's B0 ends at 5, then rank 0's B0 runs 5..7 and B1 7..9.
    text = explorers.schedule_report(2, 2, schedule="gpipe")
    assert timeline_rows(text) == ["FF...BbBb", ".FFBbBb.."]
    assert "makespan 9 t_f; bubble (idle share of p x makespan): simulated 0.3333, (p-1)/(m+p-1) = 1/3 = 0.3333" \
        in text.splitlines()
    assert text.splitlines()[-1] == "peak micro-batches in flight per rank: 2 2"


@pytest.mark.parametrize("schedule, p, m, v", [("1f1b", 4, 8, 1), ("gpipe", 3, 5, 1), ("interleaved", 4, 8, 2),
                                               ("interleaved", 2, 5, 3), ("interleaved", 3, 1, 2),
                                               ("zero-bubble", 4, 8, 1), ("zero-bubble", 3, 2, 1),
                                               ("1f1b", 1, 3, 1)])
def test_schedule_report_timeline_is_the_schedules_actions(schedule, p, m, v):
    actions = GENERATORS[schedule](p, m, v)
    result = simulate(actions, 1, 1, 1)
    text = explorers.schedule_report(p, m, v, schedule)
    rows = timeline_rows(text)
    assert len(rows) == p and all(len(row) == result.makespan for row in rows)
    for rank, row in enumerate(rows):
        cells = re.findall(r"([FBIW])([a-z]*)", row)  # every action: its kind, then lower case over the rest
        assert [kind for kind, _ in cells] == [a.kind for a in actions[rank]]
        assert [1 + len(rest) for _, rest in cells] == [LENGTH[a.kind] for a in actions[rank]]
        assert all(set(rest) <= {kind.lower()} for kind, rest in cells)
        starts = [i for i, c in enumerate(row) if c.isupper()]
        assert starts == [result.start[a] for a in actions[rank]]
        assert set(row) <= set("FBIWbiw.")
    idle = sum(row.count(".") for row in rows)
    assert idle / (p * len(rows[0])) == pytest.approx(result.bubble_fraction, abs=1e-12)
    assert f"makespan {result.makespan / v:g} t_f;" in text


@pytest.mark.parametrize("schedule, p, m, v, closed_form", [
    ("gpipe", 4, 8, 1, "(p-1)/(m+p-1) = 3/11"), ("1f1b", 8, 16, 1, "(p-1)/(m+p-1) = 7/23"),
    ("interleaved", 4, 8, 2, "(p-1)/(v m+p-1) = 3/19"), ("interleaved", 8, 16, 4, "(p-1)/(v m+p-1) = 7/71"),
    ("zero-bubble", 4, 8, 1, "(p-1)/(3m+p-1) = 3/27"), ("zero-bubble", 8, 8, 1, "(p-1)/(3m+p-1) = 7/31")])
def test_schedule_report_bubble_is_the_simulators_and_the_closed_form(schedule, p, m, v, closed_form):
    result = simulate(GENERATORS[schedule](p, m, v), 1, 1, 1)
    line = explorers.schedule_report(p, m, v, schedule).splitlines()[-2]
    assert f"simulated {result.bubble_fraction:.4f}, {closed_form} = {result.bubble_fraction:.4f}" in line
    fraction = Fraction(closed_form.split(" = ")[1])
    assert result.bubble_fraction == pytest.approx(float(fraction), abs=1e-12)
    assert "derived for" not in line


def test_schedule_report_peaks_and_where_a_closed_form_does_not_hold():
    peaks = explorers.schedule_report(4, 8).splitlines()[-1]
    assert peaks == "peak micro-batches in flight per rank: 4 3 2 1"  # 1F1B: min(m, p - r)
    assert explorers.schedule_report(4, 8, schedule="gpipe").endswith("per rank: 8 8 8 8")  # GPipe: m
    assert explorers.schedule_report(4, 8, 2, "interleaved").endswith(
        "peak stage micro-batches (each 1/2 of a rank's layers) in flight per rank: 11 9 7 5")
    short = explorers.schedule_report(4, 2, schedule="zero-bubble")  # ZB-H1's formula needs m >= p
    assert "simulated 0.4545, (p-1)/(3m+p-1) = 3/9 = 0.3333 (derived for m >= p; here m = 2, p = 4: " \
           "the simulator is the reference)" in short
    assert "(derived for m >= p; here m = 1, p = 3" in explorers.schedule_report(3, 1, 3, "interleaved")


def test_schedule_report_flags_the_closed_form_exactly_where_the_simulator_departs_from_it():
    for schedule in explorers.SCHEDULE_NAMES:
        for p in range(1, 7):
            for m in range(1, 11):
                for v in (1, 2, 3) if schedule == "interleaved" else (1,):
                    line = explorers.schedule_report(p, m, v, schedule).splitlines()[-2]
                    simulated, formula = re.search(r"simulated (\S+), .* = (\S+?)(?: \(|$)", line).groups()
                    assert ("derived for" in line) == (simulated != formula), line


@pytest.mark.parametrize("kwargs, message", [
    (dict(p=0), "p (pipeline ranks) must be an integer >= 1, got 0"),
    (dict(m=2.0), "m (micro-batches) must be an integer >= 1, got 2.0"),
    (dict(v=True, schedule="interleaved"), "v (stages per rank) must be an integer >= 1, got True"),
    (dict(v=2), "'1f1b' puts one stage on each rank: pass v=1, or schedule='interleaved'"),
    (dict(schedule="pipedream"), "schedule must be one of 'gpipe', '1f1b', 'interleaved', 'zero-bubble', got "
                                 "'pipedream' (PipeDream does not flush: chapter 09)")])
def test_schedule_report_refuses_what_cannot_run(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        explorers.schedule_report(**kwargs)
    if kwargs != dict(v=2):  # the explorer's v slider is interleaved's only: it ignores v for the others
        with pytest.raises(ValueError, match=re.escape(message)):
            explorers.schedule_explorer(**{"v": 1, **kwargs}, widget=True)  # before any widget is built


def test_schedule_explorer_falls_back_to_text_outside_a_notebook():
    assert explorers.schedule_explorer() == explorers.schedule_report(4, 8, 1, "1f1b")  # v: interleaved's only
    assert explorers.schedule_explorer(v=3, schedule="gpipe") == explorers.schedule_report(4, 8, 1, "gpipe")
    assert explorers.schedule_explorer(3, 6, 3, "interleaved", widget=False) == \
        explorers.schedule_report(3, 6, 3, "interleaved")


def test_the_schedule_widget_builds_and_its_callback_runs_headless():
    pytest.importorskip("ipywidgets")
    import matplotlib.pyplot as plt
    from IPython.core.formatters import DisplayFormatter

    open_before = set(plt.get_fignums())  # another test in this process may have left its own
    box = explorers.schedule_explorer(2, 4, widget=True)  # small: every change draws the chart again
    assert box.text.value == f"<pre>{html.escape(explorers.schedule_report(2, 4))}</pre>"
    assert box.controls["v"].disabled and box.controls["v"].value == 2
    box.controls["schedule"].value = "interleaved"  # the v slider comes into play
    assert not box.controls["v"].disabled
    assert box.text.value == f"<pre>{html.escape(explorers.schedule_report(2, 4, 2, 'interleaved'))}</pre>"
    box.controls["m"].value = 1  # m < p: the report says the closed form does not apply
    assert box.report == explorers.schedule_report(2, 1, 2, "interleaved")
    assert "the simulator is the reference" in box.text.value
    box.controls["schedule"].value = "zero-bubble"
    assert box.controls["v"].disabled and box.update() == explorers.schedule_report(2, 1, 1, "zero-bubble")
    assert (box.controls["p"].min, box.controls["p"].max, box.controls["m"].max, box.controls["v"].max) == (1, 8, 16, 4)
    assert set(plt.get_fignums()) == open_before  # every drawing closed its figure
    assert bytes(box.chart.value[:8]) == b"\x89PNG\r\n\x1a\n"  # the Gantt chart, as a PNG
    data, _ = DisplayFormatter().format(box)  # what a notebook saves: the widget, and the report as plain text
    assert data["text/plain"] == box.report == explorers.schedule_report(2, 1, 1, "zero-bubble")
    assert "application/vnd.jupyter.widget-view+json" in data
