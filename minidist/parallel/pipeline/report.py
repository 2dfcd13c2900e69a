"""What a pipeline run reports at each epoch's end: the measured bubble beside the simulator's,
why the two may disagree, each stage's peak activation memory, and pipeline 0's stages gathered
into rank 0's whole model to score it. Used by the flushing schedules' run
(:class:`~minidist.parallel.pipeline.train.PipelineRun`), PipeDream's driver and 3-D's report."""
from __future__ import annotations

import os

import numpy as np

from minidist import backend, nn
from minidist.collectives import gather
from minidist.parallel.pipeline import schedules
from minidist.parallel.pipeline.grid import ProcessGrid


def gather_pipeline_model(grid: ProcessGrid, stage_modules: list) -> None:
    """Copy every stage's parameters of pipeline 0 (dp_rank 0) into the whole model held by
    its pp_rank 0: one ``collectives.gather`` over the pipeline, each rank's parameters laid
    end to end (``nn.parameters_to_vector``) and padded to the longest. ``stage_modules``: the
    model's stages in order (``split_model``), stage s on pp_rank s mod S. The other pipelines
    hold the same parameters (their gradients were averaged) and take no part."""
    if grid.dp_rank != 0 or grid.pp_size == 1:
        return
    owned = [[p for s in range(r, len(stage_modules), grid.pp_size) for p in stage_modules[s].parameters()]
             for r in range(grid.pp_size)]
    sizes = [sum(p.size for p in params) for params in owned]
    mine = nn.parameters_to_vector(owned[grid.pp_rank])
    padded = backend.get_array_module(mine).zeros(max(sizes), dtype=mine.dtype)
    padded[:mine.size] = mine
    gathered = gather(grid.pp_comm, padded, root=0)
    if grid.pp_rank == 0:
        for r in range(1, grid.pp_size):
            nn.vector_to_parameters(gathered[r][:sizes[r]], owned[r])


def measured_bubble(busy, total) -> float:
    """The bubble of a pipeline run: 1 - compute time / step time, averaged over the ranks
    (``busy``, ``total``: seconds per rank, 1-D arrays); NaN when no step ran."""
    return float(np.mean(1.0 - busy / np.where(total > 0, total, np.nan)))


def bubble_note(measured: float, simulated: float, action_seconds: float, world_size: int) -> str:
    """Why a measured bubble exceeds the simulator's, in one sentence (empty when it does not
    by more than 0.05): ``action_seconds`` is the mean compute time of one forward or backward
    of a micro-batch on one stage; the cores are this process's (``os.sched_getaffinity``)."""
    if not measured > simulated + 0.05:
        return ""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    crowd = f"; {world_size} ranks share {cores} cores here" if world_size > cores else ""
    return (f"note: the measured bubble ({measured:.3f}) exceeds the simulator's ({simulated:.3f}): a stage computes "
            f"only {action_seconds * 1e6:.0f} us per micro-batch pass, about what a message costs{crowd}; the "
            "simulator counts neither, so here more micro-batches can even be slower. benchmarks/bench_pipeline.py "
            "uses stages long enough for the formula (p - 1)/(m + p - 1) to show")




def epoch_reporter(comm, work, model, grid, stage_modules, step, scaler, log, actions):
    """``train_pipeline``'s ``on_epoch_end`` (on every rank: two gathers, then rank 0
    scores and logs with the workload's report) and the dict where it keeps the last epoch's
    figures for the result."""
    num_stages, pp, dp = len(stage_modules), grid.pp_size, grid.dp_size
    simulated = schedules.simulate(actions, 1.0, 1.0, 1.0).bubble_fraction
    actions_per_step = max(len(row) for row in actions)  # forward and backward passes of the busiest rank
    last = {"simulated": simulated}

    def on_epoch_end(epoch, loss, seconds):
        figures = gather(comm, step.measurements(), root=0)
        step.reset_measurements()
        gather_pipeline_model(grid, stage_modules)
        if comm.Get_rank() != 0:
            return None
        busy, total, steps = figures[:, 0], figures[:, 1], figures[:, 2]
        bubble = measured_bubble(busy, total)
        peaks = [int(max(figures[d * pp + s % pp, 4 + s // pp] for d in range(dp))) for s in range(num_stages)]
        note = "" if "bubble" in last else bubble_note(
            bubble, simulated, float(np.sum(busy) / max(1.0, np.sum(steps) * actions_per_step)), comm.Get_size())
        last.update(bubble=bubble, peaks=peaks, sent=int(figures[:, 3].sum()))
        extra = (f"  bubble={bubble:.3f} (simulated {simulated:.3f})  "
                 f"activation_kib_per_stage={','.join(f'{p / 1024:.1f}' for p in peaks)}")
        row = work.report(model, epoch, loss, seconds, log, extra + scaler.describe(), world_size=dp)
        if note:
            log(note)
        row.update(bubble=bubble, peak_activation_bytes=peaks)
        return row

    return on_epoch_end, last
