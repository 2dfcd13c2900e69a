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
