"""Explorers: sliders over a closed form, for where a learner would rather move a slider than re-run a cell.

:func:`layout_explorer` is the memory and layout explorer of chapter 16, after the memory widget of
HuggingFace's "Ultra-Scale Playbook" (2025): pick a model, a cluster and a layout (dp, pp, tp,
micro-batch, ZeRO stage, recomputation, sequence parallelism) and see the per-GPU memory by
category against the GPU's memory, and the predicted step time term by term, both from
:mod:`minidist.planner` (the formulas and their sources are there). :func:`layout_report` is the
same answer as text: the widget's callback prints it, a front end without widgets (or a script,
or nbval) gets it alone.

:func:`schedule_explorer` is the pipeline schedule explorer of chapter 08: pick p ranks, m
micro-batches, a schedule (and v stages per rank for interleaved 1F1B) and see the timeline and
the bubble, played by :func:`minidist.parallel.pipeline.schedules.simulate` and drawn by
:func:`minidist.parallel.pipeline.plot_schedule`. :func:`schedule_report` is its text.
"""
from __future__ import annotations

import html
import io

import matplotlib.pyplot as plt

from minidist import planner
from minidist.parallel.pipeline.plot import plot_schedule
from minidist.parallel.pipeline.schedules import check_count, simulate
from minidist.parallel.pipeline.train import FLUSHING_SCHEDULES

try:  # without ipywidgets (or IPython) the explorers answer in text
    import ipywidgets as widgets
    from IPython import get_ipython
except ImportError:
    widgets = get_ipython = None

CATEGORIES = ("parameters", "gradients", "optimizer", "activations")
TERMS = ("compute", "tp", "pp", "dp", "bubble")


def layout_report(model: str = "gpt3-175b", gpus: int = 1024, dp: int = 8, pp: int = 16, tp: int = 8,
                  micro_batch: int = 1, zero_stage: int = 0, recompute: str = "full", sequence_parallel: bool = False,
                  global_batch: int = 1536, seq_len: int | None = None, gpu_memory_gib: float = 80,
                  gpus_per_node: int = 8, width: int = 40) -> str:
    """The explorer's answer as text: per-GPU memory by category in GiB (the fullest pipeline
    stage, :func:`planner.memory`) with a bar of ``width`` characters per ``gpu_memory_gib``, whether
    it fits, and :func:`planner.step_time`'s terms in seconds with the MFU. A layout that cannot run
    (dp x pp x tp not the GPU count, a degree that does not divide the heads, layers or batch, an
    unknown model) gives one line saying why, not an exception: the sliders can reach it."""
    try:
        spec = planner.get_model(model)
        s = spec.seq_len if seq_len is None else seq_len
        cluster = planner.Cluster(gpus, gpus_per_node, int(gpu_memory_gib * planner.GiB))
        layout = planner.Layout(dp, pp, tp, micro_batch, zero_stage, recompute, sequence_parallel)
        if layout.gpus != gpus:
            raise ValueError(f"dp x pp x tp = {dp} x {pp} x {tp} = {layout.gpus}, not the {gpus} GPUs")
        mem = planner.memory(spec, layout, s, global_batch)
        time = planner.step_time(spec, layout, cluster, global_batch, s)
    except ValueError as error:
        return f"{model} on {gpus} GPUs, dp={dp} pp={pp} tp={tp}: cannot run: {error}"
    limit = cluster.gpu_memory
    lines = [f"{spec.name} on {gpus} GPUs: {layout}, global batch {global_batch} x {s} tokens",
             f"memory per GPU (pipeline stage {mem['stage']}) in GiB, bar = {width} chars per {gpu_memory_gib:g} GiB:"]
    for name in CATEGORIES + ("total",):
        lines.append(f"  {name:<12}{mem[name] / planner.GiB:8.1f}  {_bar(mem[name], limit, width)}")
    free = (limit - mem["total"]) / planner.GiB
    lines.append(f"  {'fits' if free >= 0 else 'OUT OF MEMORY'}: {abs(free):.1f} GiB {'free' if free >= 0 else 'over'} "
                 f"{'of' if free >= 0 else 'the'} {gpu_memory_gib:g} GiB")
    parts = " + ".join(f"{name} {time[name]:.2f}" for name in TERMS)
    lines.append(f"step time {time['total']:.2f} s = {parts}; MFU {time['mfu']:.1%}, "
                 f"{time['tflops_per_gpu']:.1f} TFLOP/s per GPU")
    return "\n".join(lines)


def _bar(nbytes: float, limit: float, width: int) -> str:
    cells = round(nbytes / limit * width)
    return "#" * min(cells, width) + ("|>" if cells > width else "")


def layout_explorer(model: str = "gpt3-175b", gpus: int = 1024, dp: int = 8, pp: int = 16, tp: int = 8,
                    micro_batch: int = 1, zero_stage: int = 0, recompute: str = "full",
                    sequence_parallel: bool = False, global_batch: int = 1536, gpu_memory_gib: float = 80,
                    widget: bool | None = None):
    """The memory and layout explorer: an ipywidgets box (dropdowns for the model, GPUs, memory,
    recomputation and ZeRO stage; sliders for pp, tp and the micro-batch, dp following from
    them; a checkbox for sequence parallelism) that draws the per-GPU memory as a stacked
    matplotlib bar against the GPU's memory line and prints :func:`layout_report`. ``widget``:
    True builds it, False returns the text, None builds it only inside a running notebook
    kernel with ipywidgets installed (elsewhere: the text). The box's ``update()`` is the
    callback every control calls; it returns the report, which ``report`` holds and the box's
    ``text/plain`` display shows (a notebook saved without widget state, a static viewer and
    nbval see the report, not ``VBox(children=...)``)."""
    start = dict(model=model, gpus=gpus, dp=dp, pp=pp, tp=tp, micro_batch=micro_batch, zero_stage=zero_stage,
                 recompute=recompute, sequence_parallel=sequence_parallel, global_batch=global_batch,
                 gpu_memory_gib=gpu_memory_gib)
    if widget is None:
        widget = _in_notebook()
    if not widget:
        return layout_report(**start)
    return _build(start)


def _in_notebook() -> bool:
    if widgets is None:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


def _build(start: dict):
    if widgets is None:
        raise ImportError("the explorer's widget needs ipywidgets: pip install ipywidgets (or widget=False for text)")

    def choice(options, value, description):
        options = sorted(set(options) | {value})
        return widgets.SelectionSlider(options=options, value=value, description=description)

    controls = {
        "model": widgets.Dropdown(options=list(planner.MODELS), value=start["model"], description="model"),
        "gpus": widgets.Dropdown(options=sorted({8 * 2 ** k for k in range(10)} | {start["gpus"]}),
                                 value=start["gpus"], description="GPUs"),
        "gpu_memory_gib": widgets.Dropdown(options=sorted({16, 24, 40, 80, 141, start["gpu_memory_gib"]}),
                                           value=start["gpu_memory_gib"], description="GiB per GPU"),
        "tp": choice([1, 2, 4, 8, 16], start["tp"], "tp"),
        "pp": choice([1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64], start["pp"], "pp"),
        "micro_batch": choice([1, 2, 4, 8, 16], start["micro_batch"], "micro-batch"),
        "global_batch": widgets.Dropdown(options=sorted({256, 512, 1024, 1536, 2048, 3072, start["global_batch"]}),
                                         value=start["global_batch"], description="global batch"),
        "zero_stage": widgets.Dropdown(options=[0, 1, 2, 3], value=start["zero_stage"], description="ZeRO stage"),
        "recompute": widgets.Dropdown(options=list(planner.RECOMPUTE), value=start["recompute"],
                                      description="recompute"),
        "sequence_parallel": widgets.Checkbox(value=start["sequence_parallel"], description="sequence parallel"),
    }
    text, figure = widgets.HTML(), widgets.Output()

    def update(_change=None):
        values = {name: control.value for name, control in controls.items()}
        values["dp"] = max(1, values["gpus"] // (values["tp"] * values["pp"]))
        report = box.report = layout_report(**values)
        text.value = f"<pre>{html.escape(report)}</pre>"
        figure.clear_output(wait=True)
        with figure:
            fig = _draw(values)
            plt.show()
            plt.close(fig)
        return report

    for control in controls.values():
        control.observe(update, names="value")
    box = widgets.VBox([widgets.HBox([widgets.VBox(list(controls.values())[:5]),
                                      widgets.VBox(list(controls.values())[5:])]), figure, text])
    box.update, box.controls, box.text = update, controls, text
    box._repr_mimebundle_ = _with_plain_text(box)
    update()
    return box


def _with_plain_text(box):
    """The box's display: the widget for live front ends, its ``report`` as the plain text."""
    def bundle(**kwargs):
        return {**widgets.VBox._repr_mimebundle_(box, **kwargs), "text/plain": box.report}
    return bundle


def _draw(values: dict):
    """One stacked bar of the memory by category, and the GPU's memory as a line."""
    fig, ax = plt.subplots(figsize=(6.5, 1.8))
    try:
        layout = planner.Layout(values["dp"], values["pp"], values["tp"], values["micro_batch"], values["zero_stage"],
                                values["recompute"], values["sequence_parallel"])
        mem = planner.memory(values["model"], layout, None, values["global_batch"])
    except ValueError:
        mem = dict.fromkeys(CATEGORIES, 0)
    left = 0.0
    for name in CATEGORIES:
        ax.barh([0], [mem[name] / planner.GiB], left=left, label=name)
        left += mem[name] / planner.GiB
    ax.axvline(values["gpu_memory_gib"], color="k", linestyle="--", label="GPU memory")
    ax.set(yticks=[], xlabel="GiB per GPU", xlim=(0, max(left, values["gpu_memory_gib"]) * 1.1))
    ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, 1.45))
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------ the pipeline schedule explorer (chapter 08)
# The flushing schedules of minidist.parallel.pipeline (the CLI's --schedule names) and their names in the lesson.
SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "interleaved 1F1B", "zero-bubble": "ZB-H1"}
# Characters of the text timeline: one per time unit; an action's first cell is its kind, the rest lower case.
IDLE = "."


def schedule_report(p: int = 4, m: int = 8, v: int = 1, schedule: str = "1f1b") -> str:
    """The schedule explorer's answer as text: an ASCII timeline per rank, then the makespan, the
    simulated bubble fraction beside its closed form, and the peak micro-batches in flight per rank.

    ``p`` pipeline ranks, ``m`` micro-batches, ``schedule`` one of ``"gpipe"``, ``"1f1b"``,
    ``"interleaved"`` (``v`` stages per rank) or ``"zero-bubble"`` (ZB-H1), the names of
    ``minidist train --schedule``. The actions are the schedule's own lists
    (:mod:`minidist.parallel.pipeline.schedules`), played by ``simulate`` with every pass of one
    stage on one micro-batch taking one unit: F = I = W = 1, a whole backward B = I + W = 2
    (interleaved: a stage is 1/v of a rank's layers, so a unit is t_f / v; the makespan is
    given in t_f, the forward of a 1/p-of-the-model stage). The timeline has one character per
    unit: ``F``, ``I``, ``W`` for one-unit passes, ``Bb`` for a backward, ``.`` for idle; every
    action starts at an upper-case letter, at the simulator's start time.

    The bubble is the idle share of p x makespan (``simulate(...).bubble_fraction``); its closed
    forms: (p - 1)/(m + p - 1) for GPipe and 1F1B (Huang et al. 2019; Narayanan et al. 2021),
    (p - 1)/(v m + p - 1) for interleaved 1F1B (Narayanan et al., SC 2021, sec. 2.2.2, derive it
    for m a multiple of p; ``interleaved_1f1b``'s uneven rounds of at least p micro-batches keep
    it for every m >= p; v = 1 is 1F1B), (p - 1)/(3m + p - 1) for ZB-H1 with m >= p at
    t_f = t_I = t_W (Qi et al., ICLR 2024, sec. 2.1: makespan m(t_f + t_I + t_W) +
    (p - 1)(t_f + t_I - t_W)). For m < p those two do not hold (v > 1), and the report says so:
    the simulator is the reference.

    Raises ValueError naming the fix for a count that is not an integer >= 1, an unknown
    schedule, or v > 1 with a schedule other than interleaved (it has one stage per rank)."""
    p = check_count("schedule_report", "p (pipeline ranks)", p)
    m = check_count("schedule_report", "m (micro-batches)", m)
    v = check_count("schedule_report", "v (stages per rank)", v)
    if schedule not in FLUSHING_SCHEDULES:
        raise ValueError(f"schedule_report: schedule must be one of {', '.join(map(repr, FLUSHING_SCHEDULES))}, "
                         f"got {schedule!r} (PipeDream does not flush: chapter 09)")
    if v > 1 and schedule != "interleaved":
        raise ValueError(f"schedule_report: v = {v} stages per rank is interleaved 1F1B's; {schedule!r} puts one "
                         f"stage on each rank: pass v=1, or schedule='interleaved'")
    actions = FLUSHING_SCHEDULES[schedule][0](p, m, v)
    result = simulate(actions, t_forward=1, t_backward=1, t_weight=1)
    unit = "t_f" if v == 1 else f"t_f/{v}"
    lines = [f"{SCHEDULE_NAMES[schedule]}, p = {p} rank{'s' * (p > 1)}, m = {m} micro-batch{'es' * (m > 1)}"
             + (f", v = {v} stages per rank" if schedule == "interleaved" else "")
             + f"; one character = {unit}: F forward"
             + (", I input gradient, W weight gradient" if schedule == "zero-bubble" else ", Bb backward")
             + f", {IDLE} idle"]
    lines += schedule_timeline(actions, result, unit)
    lines.append(f"makespan {result.makespan / v:g} t_f; bubble (idle share of p x makespan): simulated "
                 f"{result.bubble_fraction:.4f}, {_closed_form(p, m, v, schedule)}")
    what = "micro-batches" if v == 1 else f"stage micro-batches (each 1/{v} of a rank's layers)"
    lines.append(f"peak {what} in flight per rank: {' '.join(map(str, result.peak_in_flight))}")
    return "\n".join(lines)


def schedule_timeline(actions, result, unit: str = "units") -> list[str]:
    """The text timeline of ``actions`` (one list of Actions per rank) as played in ``result``
    (a ``SimulationResult`` whose start and end times are whole numbers of units): the time
    every 10 units (``unit`` names one, at most 7 characters) over a ruler, then one line per
    rank, ``"rank r |"`` and one character per unit (an action's kind at its start, lower case
    over the rest of it, ``.`` where the rank is idle). Raises ValueError for a start or end
    time that is not a whole number of units."""
    width = _whole(result.makespan)
    ruler = "".join("|" if t % 10 == 0 else " " for t in range(width + 1))
    labels = "".join(f"{t:<10d}" for t in range(0, width + 1, 10))
    lines = [f"{unit:>7} {labels}".rstrip(), f"{'':>7} {ruler}".rstrip()]
    for rank, row in enumerate(actions):
        cells = [IDLE] * width
        for a in row:
            start, end = _whole(result.start[a]), _whole(result.end[a])
            cells[start:end] = [a.kind] + [a.kind.lower()] * (end - start - 1)
        lines.append(f"rank {rank:<2d}|{''.join(cells)}")
    return lines


def _whole(time: float) -> int:
    if time != round(time):
        raise ValueError(f"schedule_timeline: time {time!r} is not a whole number of units; simulate with whole "
                         "pass times (e.g. t_forward=1, t_backward=1, t_weight=1)")
    return round(time)


def _closed_form(p: int, m: int, v: int, schedule: str) -> str:
    """The bubble's closed form for ``schedule`` at unit pass times, evaluated, and where it holds."""
    if schedule == "interleaved":
        formula, denominator, holds, why = "(p-1)/(v m+p-1)", v * m + p - 1, m >= p or v == 1, "m >= p"
    elif schedule == "zero-bubble":
        formula, denominator, holds, why = "(p-1)/(3m+p-1)", 3 * m + p - 1, m >= p, "m >= p"
    else:
        formula, denominator, holds, why = "(p-1)/(m+p-1)", m + p - 1, True, ""
    value = f"{formula} = {p - 1}/{denominator} = {(p - 1) / denominator:.4f}"
    return value if holds else f"{value} (derived for {why}; here m = {m}, p = {p}: the simulator is the reference)"


def schedule_explorer(p: int = 4, m: int = 8, v: int = 2, schedule: str = "1f1b", widget: bool | None = None):
    """The pipeline schedule explorer: an ipywidgets box (sliders p 1-8, m 1-16 and v 1-4, the
    last used, and enabled, by the interleaved schedule only; a dropdown of the schedules) that
    draws the timeline with :func:`plot_schedule` (times in t_f) and prints :func:`schedule_report`.
    ``widget``: True builds it, False returns the text, None builds it only inside a running
    notebook kernel with ipywidgets installed (elsewhere: the text,
    ``schedule_report(p, m, v if schedule == "interleaved" else 1, schedule)``). The box's
    ``update()`` is the callback every control calls (``chart`` then holds the PNG, ``text`` the
    report in HTML); it returns the report, which ``report``
    holds and the box's ``text/plain`` display shows (a notebook saved without widget state, a
    static viewer and nbval see the report). Raises ValueError as :func:`schedule_report` for
    bad starting values."""
    start = dict(p=p, m=m, v=v if schedule == "interleaved" else 1, schedule=schedule)
    report = schedule_report(**start)  # bad starting values fail here, before any widget is built
    if widget is None:
        widget = _in_notebook()
    if not widget:
        return report
    if widgets is None:
        raise ImportError("the explorer's widget needs ipywidgets: pip install ipywidgets (or widget=False for text)")
    # A chart of p = 8, m = 16, v = 4 (1024 boxes) takes seconds: the sliders redraw when let go.
    slider = dict(min=1, continuous_update=False)
    controls = {
        "p": widgets.IntSlider(value=p, max=max(8, p), description="p (ranks)", **slider),
        "m": widgets.IntSlider(value=m, max=max(16, m), description="m (micro-b.)", **slider),
        "v": widgets.IntSlider(value=v, max=max(4, v), description="v (interl.)", **slider),
        "schedule": widgets.Dropdown(options=[(name, key) for key, name in SCHEDULE_NAMES.items()], value=schedule,
                                     description="schedule"),
    }
    # The chart goes in as a PNG (an Image widget, not an Output one: nbclient cannot run an
    # Output widget without keeping widget state, which the course's notebooks do not keep).
    text, chart = widgets.HTML(), widgets.Image(format="png")

    def update(_change=None):
        values = {name: control.value for name, control in controls.items()}
        interleaved = values["schedule"] == "interleaved"
        controls["v"].disabled = not interleaved
        values["v"] = values["v"] if interleaved else 1
        report = box.report = schedule_report(**values)
        text.value = f"<pre>{html.escape(report)}</pre>"
        fig = _draw_schedule(**values)
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=80)
        plt.close(fig)
        chart.value = png.getvalue()
        return report

    for control in controls.values():
        control.observe(update, names="value")
    box = widgets.VBox([widgets.HBox([widgets.VBox([controls["p"], controls["m"]]),
                                      widgets.VBox([controls["v"], controls["schedule"]])]), chart, text])
    box.update, box.controls, box.text, box.chart = update, controls, text, chart

    box._repr_mimebundle_ = _with_plain_text(box)
    update()
    return box


def _draw_schedule(p: int, m: int, v: int, schedule: str):
    """The schedule's Gantt chart (plot_schedule), times in t_f: an interleaved pass takes 1/v."""
    actions = FLUSHING_SCHEDULES[schedule][0](p, m, v)
    result = simulate(actions, t_forward=1 / v, t_backward=1 / v, t_weight=1 / v)
    fig, ax = plt.subplots(figsize=(9, 0.4 * p + 1.3))
    plot_schedule([result.timeline(row) for row in actions], ax=ax, time_unit="t_f", label_microbatches=m <= 8,
                  title=f"{SCHEDULE_NAMES[schedule]}: makespan {result.makespan:g} t_f, "
                        f"bubble {result.bubble_fraction:.1%}")
    fig.tight_layout()
    return fig
