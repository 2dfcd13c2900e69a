"""Draw a pipeline schedule: a Gantt chart, ranks down, time across.

The schedules (``schedules.py``) are lists of actions; the simulator and the executor give each
action a start and an end. :func:`plot_schedule` draws those boxes, one per action, coloured by
the kind of pass, so that the white gaps, the bubble, can be seen. An interleaved schedule puts
several stages on one rank (Narayanan et al., SC 2021, call them model chunks: rank r holds
stages r, r + p, ...); their boxes differ in shade and hatching, so the chart shows when a
micro-batch comes round a rank for the second time.
"""
from __future__ import annotations

from minidist.parallel.pipeline.schedules import Action

# Colours of a pipeline schedule's passes: forward, whole backward, input-gradient, weight-gradient.
SCHEDULE_COLORS = {"F": "#4c72b0", "B": "#55a868", "I": "#8fbf7f", "W": "#c44e52"}
PASS_NAMES = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weights)"}
# A rank's j-th stage (model chunk j): its boxes are mixed with this much white and hatched so.
CHUNK_LIGHTEN = (0.0, 0.45, 0.65, 0.8)
CHUNK_HATCHES = ("", "///", "...", "xxx")


def chunk_style(color: str, chunk: int) -> dict:
    """The face colour, hatch and edge colour of a box of a rank's ``chunk``-th stage (0: solid).

    ``color``: a matplotlib colour (the pass's, ``SCHEDULE_COLORS``). Chunks beyond the fourth
    reuse the fourth's style. Returns keyword arguments for ``Axes.barh``."""
    from matplotlib.colors import to_rgb  # noqa: PLC0415 (matplotlib: see plot_schedule)

    j = min(chunk, len(CHUNK_LIGHTEN) - 1)
    base = to_rgb(color)
    face = tuple(c + (1.0 - c) * CHUNK_LIGHTEN[j] for c in base)
    if j == 0:
        return {"color": face, "edgecolor": "white", "hatch": None}
    return {"color": face, "edgecolor": base, "hatch": CHUNK_HATCHES[j]}


def _stage_ranges(stages: list[int]) -> str:
    if stages == list(range(stages[0], stages[-1] + 1)) and len(stages) > 2:
        return f"stages {stages[0]}-{stages[-1]}"
    return ("stage " if len(stages) == 1 else "stages ") + ", ".join(map(str, stages))


def plot_schedule(rows, ax=None, title=None, time_unit="", label_microbatches=True):
    """Draw a pipeline schedule as a Gantt chart: ranks down, time across.

    Args:
        rows: one list per rank of ``(action, start, end)``; ``action`` is a pipeline
            ``Action`` or its string (``"1F3"``: stage 1, forward, micro-batch 3). Build it
            from the schedule simulator, ``[result.timeline(actions) for actions in
            schedule]`` (times in units of a forward), or from a real run,
            ``[[(e.action, e.start, e.end) for e in timeline] for timeline in per_rank]``
            (seconds).
        ax: a matplotlib Axes to draw on (default: a new figure).
        title: the Axes' title.
        time_unit: written on the time axis (``"s"``, ``"ms"``, ``"t_f"``).
        label_microbatches: write each box's micro-batch number in it.

    F boxes are blue, B green, I light green, W red (``SCHEDULE_COLORS``); a white gap is a
    bubble: the rank waits. A rank that holds several stages (interleaved 1F1B) draws its
    lowest stage solid and the next ones lighter and hatched (``chunk_style``), and the legend
    says which stages each style shows. One patch per action, in row order; each patch's gid
    is its action's string (``"2F0"``), for tests and SVG output. Returns the Axes.

    Raises ValueError for an action string that is not ``<stage><F|B|I|W><micro-batch>``
    (``Action.from_str``) or an end before its start.
    """
    # pyplot takes about a second to import: the MPI ranks that import the pipeline package
    # draw nothing, so only a call to this function pays for it.
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.patches import Patch  # noqa: PLC0415

    parsed = [[(Action.from_str(a) if isinstance(a, str) else a, start, end) for a, start, end in row] for row in rows]
    chunks = [{s: j for j, s in enumerate(sorted({a.stage for a, _, _ in row}))} for row in parsed]
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.5 * len(rows) + 1.3))
    end_time = 0.0
    kinds, used_chunks = set(), {}
    for rank, row in enumerate(parsed):
        for action, start, end in row:
            if end < start:
                raise ValueError(f"plot_schedule: rank {rank}'s {action} ends at {end} before it starts at {start}")
            chunk = chunks[rank][action.stage]
            kinds.add(action.kind)
            used_chunks.setdefault(chunk, set()).add(action.stage)
            style = chunk_style(SCHEDULE_COLORS[action.kind], chunk)
            (box,) = ax.barh(rank, end - start, left=start, height=0.8, linewidth=0.6, **style).patches
            box.set_gid(str(action))
            if label_microbatches and end - start > 0:
                ax.text((start + end) / 2, rank, str(action.microbatch), ha="center", va="center",
                        fontsize=7, color="white" if chunk == 0 else "black")
            end_time = max(end_time, end)
    ax.set_yticks(range(len(rows)), [f"rank {r}" for r in range(len(rows))])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, end_time * 1.01 if end_time else 1)
    ax.set_xlabel(f"time ({time_unit})" if time_unit else "time")
    handles = [Patch(color=SCHEDULE_COLORS[k], label=PASS_NAMES[k]) for k in "FBIW" if k in kinds]
    if len(used_chunks) > 1:  # several stages per rank: say which style is which stage
        for chunk in sorted(used_chunks):
            style = chunk_style("0.45", chunk)
            handles.append(Patch(facecolor=style["color"], edgecolor=style["edgecolor"], hatch=style["hatch"],
                                 label=f"{_stage_ranges(sorted(used_chunks[chunk]))} (chunk {chunk})"))
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    if title:
        ax.set_title(title)
    return ax
