"""Pipeline parallelism: a model cut into stages on different ranks, micro-batches flowing through.

- ``schedules``  pure data: gpipe, one_f_one_b, interleaved_1f1b, zero_bubble return per-rank
                 action lists (``2F0``, ``1B3``); validate checks one, simulate measures it
- ``stage``      split_model: cut an ``nn.Sequential`` into contiguous stages; WeightStash:
                 a stage's weight versions (PipeDream)
- ``executor``   PipelineStage and ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B /
                 ScheduleZeroBubble: run a schedule's actions over a communicator
                 (``torch.distributed.pipelining``'s names)
- ``grid``       the 2-D rank grid of data x pipeline parallelism (``dp_rank``, ``pp_rank``)
- ``step``       one training step of a pipeline (schedule step, loss to every rank, dp average)
- ``pipedream``  PipeDream: no flush, an update after every backward; weight stashing, vertical
                 sync, PipeDream-2BW (SchedulePipeDream, SchedulePipeDream2BW, PipeDreamStage)
- ``elastic``    reshard_pipeline: a flushing pipeline's (or 3d's) checkpoint cut again for
                 another layout (dp, stages, stages per rank, tp) through the dense model
- ``plot``       plot_schedule: a schedule's timeline (simulated or run) as a Gantt chart, one
                 box per action; a rank's several stages (interleaved) told apart by hatching
"""
from minidist.parallel.pipeline.executor import (
    PipelineError,
    PipelineSchedule,
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZeroBubble,
)
from minidist.parallel.pipeline.plot import SCHEDULE_COLORS, plot_schedule
from minidist.parallel.pipeline.schedules import (
    Action,
    ScheduleError,
    SimulationResult,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    parse_schedule,
    simulate,
    validate,
    zero_bubble,
)
from minidist.parallel.pipeline.stage import split_model

__all__ = ["Action", "ScheduleError", "SimulationResult", "gpipe", "interleaved_1f1b", "one_f_one_b",
           "parse_schedule", "plot_schedule", "SCHEDULE_COLORS", "simulate", "split_model", "validate", "zero_bubble",
           "PipelineError", "PipelineSchedule", "PipelineStage", "Schedule1F1B", "ScheduleGPipe",
           "ScheduleInterleaved1F1B", "ScheduleZeroBubble"]
