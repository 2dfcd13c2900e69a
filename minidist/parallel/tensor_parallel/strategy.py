"""``--strategy tp`` declares itself: tensor parallelism's flags (``--sequence-parallel``; ``--tp``,
the tensor-parallel ranks of a group, taken by the strategies that compose tp with another
dimension), what a tp run reads (every rank the same batch), and how its checkpoints resume on
another number of ranks or are joined into one model."""
from __future__ import annotations

from minidist.parallel.tensor_parallel.reshard import consolidate_tensor_parallel
from minidist.parallel.tensor_parallel.train import check_tensor_parallel, train_tensor_parallel
from minidist.strategy import Flag, Strategy
from minidist.train import TrainConfig

TP = Flag("--tp", "tp", dict(
    type="positive_int", help="fsdp, 3d and cp: tensor-parallel ranks of a group (neighbouring ranks); cp: a dp "
                              "group is cp x tp ranks, cp on each tp rank's heads; fsdp: FSDP shards "
                              "over the ranks / tp replicas, each one tp group; 3d: the ranks of each stage, with --dp "
                              "pipelines side by side, each pipeline has ranks / (dp x tp) stages (default: "
                              f"{TrainConfig().tp})"))
SEQUENCE_PARALLEL = Flag("--sequence-parallel", "sequence_parallel", dict(
    action="store_true", help="tp, fsdp with --tp and 3d: also cut the activations between the split layers "
                              "(LayerNorms, residuals) by positions, each rank holding 1/N of them (Korthikanti et al. "
                              "2022); --block-size must be a multiple of the number of tensor-parallel ranks"))
# An elastic resume of a tp run may also turn sequence parallelism on or off: a layout of the
# activations, not of the state (the checkpoint holds the same weights and moments either way).
LAYOUT_NOTES = {"sequence_parallel": "the activations between the split layers are cut by positions or not; the state "
                                     "is the same and the step computes the same numbers, to rounding"}


STRATEGY = Strategy(
    name="tp", driver=train_tensor_parallel, summary="tp (tensor parallelism, --model gpt only)", models=("gpt",),
    models_why=" (it splits the transformer's layers)", flags=(SEQUENCE_PARALLEL,), check=check_tensor_parallel,
    one_batch=lambda config: "--strategy tp splits the model, every rank reads the same batch",
    replicas=lambda config, world_size: 1, global_batch=True,
    mixed_precision=lambda config: "; --strategy tp trains in fp32", elastic=lambda config: True,
    resize_rule=lambda config: " (--strategy tp needs one that divides --n-head and 4 x --n-embd)",
    layout_notes=LAYOUT_NOTES, consolidate=consolidate_tensor_parallel)
