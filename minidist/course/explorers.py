"""Explorers: sliders over a closed form, for where a learner would rather move a slider than re-run a cell.

:func:`layout_explorer` is the memory and layout explorer of chapter 16, after the memory widget of
HuggingFace's "Ultra-Scale Playbook" (2025): pick a model, a cluster and a layout (dp, pp, tp,
micro-batch, ZeRO stage, recomputation, sequence parallelism) and see the per-GPU memory by
category against the GPU's memory, and the predicted step time term by term, both from
:mod:`minidist.planner` (the formulas and their sources are there). :func:`layout_report` is the
same answer as text: the widget's callback prints it, a front end without widgets (or a script,
or nbval) gets it alone.
"""
from __future__ import annotations

import html

import matplotlib.pyplot as plt

from minidist import planner

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
                 f"of {gpu_memory_gib:g} GiB")
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
    callback every control calls."""
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
        report = layout_report(**values)
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
    update()
    return box


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
