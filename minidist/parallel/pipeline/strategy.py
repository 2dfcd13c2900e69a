"""``--strategy pipeline`` declares itself: the schedule's flags (also taken by ``--strategy 3d``),
the rules between them, a pipeline's own defaults (a deeper MLP, a smaller lr), and how its
checkpoints resume on another layout or are joined into one model. A schedule that never
flushes (``--schedule pipedream``, ``pipedream-2bw``) is PipeDream's variant, with its own driver
and flags."""
from __future__ import annotations

from types import SimpleNamespace

from minidist import nn
from minidist.models.gpt import GPT, GPTConfig
from minidist.parallel.pipeline.elastic import PipelineLayout, consolidate_stages
from minidist.parallel.pipeline.train import check_pipeline, model_stages, train_pipeline
from minidist.parallel.pipeline.train_pipedream import train_pipedream
from minidist.strategy import Flag, Strategy
from minidist.train import (
    PIPEDREAM_MOMENTUM,
    PIPEDREAM_SCHEDULES,
    PIPELINE_HIDDEN,
    PIPELINE_LR,
    PIPELINE_SCHEDULES,
    TrainConfig,
)

_D = TrainConfig()
SCHEDULE = Flag("--schedule", "schedule", dict(
    choices=PIPELINE_SCHEDULES,
    help=f"pipeline: the schedule, {', '.join(PIPELINE_SCHEDULES)} (default: {_D.schedule})"))
MICROBATCHES = Flag("--microbatches", "microbatches", dict(
    type="positive_int", help=f"pipeline: micro-batches per batch; 1 is naive model parallelism (default: "
                              f"{_D.microbatches})"))
DP = Flag("--dp", "dp", dict(
    type="positive_int", help="pipeline and 3d: pipelines side by side (data x pipeline parallelism); must divide the "
                              f"number of ranks (default: {_D.dp})"))
STAGES_PER_RANK = Flag("--stages-per-rank", "stages_per_rank", dict(
    type="positive_int", help=f"pipeline with --schedule interleaved: stages per rank (default: {_D.stages_per_rank})"))
NO_WEIGHT_STASHING = Flag("--no-weight-stashing", "weight_stashing", dict(
    action="store_false", help="pipeline with --schedule pipedream: run each backward on the latest weights, not on "
                               "the version its forward used (to see what stashing is for)"))
VERTICAL_SYNC = Flag("--vertical-sync", "vertical_sync", dict(
    action="store_true", help="pipeline with --schedule pipedream: every stage runs a micro-batch on the weight "
                              "version the first stage used for it"))
FLAGS = (SCHEDULE, MICROBATCHES, DP, STAGES_PER_RANK)  # a pipeline's, also 3d's

# What an elastic resume of a pipeline (or of 3d) may change besides the number of ranks: each
# field's logged line (the stages are joined into the dense model and cut again:
# pipeline.elastic.reshard_pipeline).
LAYOUT_NOTES = {
    "dp": "another number of pipelines, each reading G / dp samples a step; the stages' state is joined and cut again",
    "tp": "another number of tensor-parallel ranks per stage; each parameter's and moment's shards are joined and cut "
          "again",
    "stages_per_rank": "another number of stages per rank; the stages' state is joined and cut again",
    "schedule": "another flushing schedule computes the same step (the same equal micro-batches, flushed)",
    "microbatches": "each pipeline's G / dp samples are cut into that many equal micro-batches: the step's mean loss "
                    "and gradient are the same",
}
RELAYOUT = ("dp", "tp", "stages_per_rank", "schedule")  # a change of these at as many ranks is cut again


def check_flags(config, given: set) -> None:
    """Raise ValueError for schedule flags that the chosen ``--schedule`` would ignore, and for a
    PipeDream schedule with the GPT (pipeline and 3d)."""
    schedule = config.schedule
    if "stages_per_rank" in given and schedule != "interleaved":
        raise ValueError(f"--stages-per-rank applies to --schedule interleaved only (the other schedules hold one "
                         f"stage per rank), not to --schedule {schedule}")
    for flag in (NO_WEIGHT_STASHING, VERTICAL_SYNC):
        if flag.field in given and schedule != "pipedream":
            raise ValueError(f"{flag.flag} applies to --schedule pipedream only (the schedule that updates after "
                             f"every backward), not to --schedule {schedule}")
    if "microbatches" in given and schedule == "pipedream":
        raise ValueError("--microbatches does not apply to --schedule pipedream: each batch of --batch-size is one "
                         "micro-batch and one update (pipedream-2bw accumulates --microbatches per update)")
    if config.model == "gpt" and schedule in PIPEDREAM_SCHEDULES:
        raise ValueError(f"--schedule {schedule} trains the MLP only; --model gpt runs the flushing schedules (gpipe, "
                         "1f1b, interleaved, zero-bubble)")


def stage_model(state: dict):
    """A model of the shape a pipeline or 3-D checkpoint ``state`` trained (its values unused) and
    ``split(num_stages)``, its cut into stages as the drivers cut it (``pipeline.train.
    model_stages``): the GPT of the saved ``metadata``'s configuration, or the MLP of the
    fingerprint's --hidden with the features read off the first stage's first Linear weight and
    the classes off the last stage's last one. Raises KeyError or ValueError when the checkpoint
    lacks them."""
    config = state["config"]
    if config.get("model") == "gpt":
        model = GPT(GPTConfig(**state["metadata"]["gpt_config"]))
    else:
        layout, parts = PipelineLayout.of(config), state["ranks"]
        last = parts[layout.rank(0, layout.pp - 1)]["model"]  # its last stage is the model's: the last Linear
        prefix = f"{layout.stages_per_rank - 1}."
        final = max((key for key in last if key.startswith(prefix) and key.endswith(".weight")),
                    key=lambda key: int(key.split(".")[1]))
        sizes = [parts[0]["model"]["0.0.weight"].shape[1], *config["hidden"], last[final].shape[0]]
        model = nn.mlp(sizes)
    shape = SimpleNamespace(model=config.get("model", "mlp"), n_layer=config.get("n_layer"))
    return model, lambda n: model_stages(shape, model, n)


def consolidate_pipeline(state: dict) -> dict:
    """The dense state_dict of a pipeline's or 3d's checkpoint ``state`` (``checkpoint
    consolidate``): pipeline 0's stages, and their tp shards, joined
    (``elastic.consolidate_stages``) in a model of the checkpoint's shape (:func:`stage_model`).
    Raises ReshardError, KeyError or ValueError naming what does not fit."""
    model, split = stage_model(state)
    return consolidate_stages(state, model, split)


def one_batch(config) -> str | None:
    """Why the pipelines of ``config`` read one batch a step (one pipeline), or None."""
    return "one pipeline (--dp 1) has one batch per step" if config.dp == 1 else None


def defaults(config) -> dict:
    """A pipeline's MLP is deeper (8 Linear layers, so 4 stages of 2 interleaved each hold one)
    and trains at a smaller lr (``train.PIPELINE_LR``); the GPT keeps its own."""
    return {"lr": PIPELINE_LR, "hidden": PIPELINE_HIDDEN} if config.model == "mlp" else {}


STRATEGY = Strategy(
    name="pipeline", driver=train_pipeline, summary="pipeline", flags=FLAGS, check=check_pipeline,
    check_flags=check_flags, one_batch=one_batch, replicas=lambda config, world_size: config.dp,
    global_batch=True, elastic=lambda config: True,
    elastic_label="pipeline (also on another --dp, number of stages, --microbatches or flushing --schedule)",
    resize_rule=lambda config: (f" (--strategy pipeline needs a multiple of --dp {config.dp} with a stage for each "
                                "rank of a pipeline)"),
    layout_notes=LAYOUT_NOTES, relayout=RELAYOUT, consolidate=consolidate_pipeline, defaults=defaults)

PIPEDREAM = Strategy(
    name="pipedream", driver=train_pipedream, summary="pipeline --schedule pipedream", models=("mlp",),
    variant_of="pipeline", when=lambda config: config.schedule in PIPEDREAM_SCHEDULES,
    flags=(NO_WEIGHT_STASHING, VERTICAL_SYNC), check=check_pipeline, global_batch=True,
    mixed_precision=lambda config: f", not to --schedule {config.schedule}",
    checkpoints=lambda config: (f"applies to the flushing schedules only (gpipe, 1f1b, interleaved, zero-bubble): "
                                f"--schedule {config.schedule} never flushes, so no step boundary is free of "
                                "micro-batches in flight and stashed weight versions to save"),
    defaults=lambda config: {**defaults(config), "momentum": PIPEDREAM_MOMENTUM})
