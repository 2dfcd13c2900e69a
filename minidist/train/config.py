"""What a run is: ``TrainConfig`` (one field per ``train`` flag; the defaults the command line
starts from), the fields that shape a run and their digest, ``TrainResult``."""
from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field

from minidist import p2p

MODELS = ("mlp", "gpt")
DATASETS = ("digits", "mnist", "shakespeare")
PS_MODES = ("sync", "async", "ssp")
PIPEDREAM_SCHEDULES = ("pipedream", "pipedream-2bw")  # no flush: train_pipedream
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble", *PIPEDREAM_SCHEDULES)
# The pipeline's default MLP: 8 Linear layers, so that 4 stages, or 4 ranks x 2 interleaved
# stages, each hold at least one (64-128-...-128-10 on digits).
PIPELINE_HIDDEN = (128,) * 7
# ... and its default learning rate. Measured on 4 ranks, seeds 0 and 1, 20 epochs: at 0.05 the
# deeper MLP's test accuracy swings (down to 0.87 at epoch 15, 0.96 at the end) and with --dp 2,
# whose lr doubles, it diverges; at 0.02 every schedule, and --dp 2, ends at 0.967 and 0.976.
PIPELINE_LR = 0.02
# PipeDream's default momentum. Stale gradients act like extra momentum (Mitliagkas et al.,
# "Asynchrony begets momentum", 2016): measured on digits, 4 ranks, lr 0.02, momentum 0.9 keeps
# every no-flush variant below 0.66 test accuracy after 3-4 epochs (2BW on one rank, one version
# behind, falls to 0.15), where 1F1B is at 0.93; at 0.5 stashing ends at 0.971 after 20 epochs,
# vertical sync 0.962, 2BW 0.976.
PIPEDREAM_MOMENTUM = 0.5
# --model gpt's defaults where a flag serves both models (the MLP's are TrainConfig's): AdamW's
# peak lr and decoupled weight decay, and the batch (windows per step, per rank). With the sizes
# and steps of TrainConfig (4 blocks, 4 heads, width 64, context 64, 800 steps, 100 of warm-up)
# they are the cheapest setting tried that ends below 2.0 nats per character with room to spare,
# measured on the course's 2-core machine (one BLAS thread, about 0.12 s a step when it is not
# loaded): lr 5e-3 crosses 2.0 between steps 600 and 700 and ends at 1.944 (seed 0; in 1000-step
# runs seed 1 stays within 0.01 of seed 0); 2e-3 ends at 2.048 after 800 steps, 3e-3 at 1.921
# after 1000; width 96 (lr 3e-3) is 0.07 lower at step 400 than width 64 but takes twice as long a
# step; 1000 steps end at 1.883.
GPT_LR = 5e-3
GPT_WEIGHT_DECAY = 0.1
GPT_BATCH_SIZE = 32
# Each model's own defaults of the fields both models use (TrainConfig's None stands for them), so that
# ``TrainConfig(model="gpt")`` is the run ``train --model gpt`` starts.
MODEL_DEFAULTS = {
    "mlp": {"lr": 0.05, "weight_decay": 0.0, "batch_size": 32, "dataset": "digits"},
    "gpt": {"lr": GPT_LR, "weight_decay": GPT_WEIGHT_DECAY, "batch_size": GPT_BATCH_SIZE, "dataset": "shakespeare"},
}


@dataclass
class TrainConfig:
    """What ``python -m minidist train`` trains, one field per flag (the defaults are the
    flags' defaults; ``minidist.cli`` checks the ranges before building one).

    strategy: the name of a registered strategy (``minidist.strategy.names()``, one per wing).
    epochs (>= 1), batch_size (>= 1, per rank).
    lr (> 0), momentum (in [0, 1)), weight_decay (>= 0): :class:`minidist.optim.SGD`.
    hidden: hidden layer sizes of the MLP. seed: data split, initialisation, shuffling.
    (The command line's defaults for --strategy pipeline are PIPELINE_HIDDEN and PIPELINE_LR.)
    scale_lr: multiply lr by the number of data-parallel workers (Goyal et al. 2017);
    None means the strategy's default (on for ddp, off for ps).
    warmup_epochs (>= 0): ramp the lr up linearly over this many epochs of steps.
    ps_mode (one of PS_MODES), num_servers (>= 1), staleness (>= 0, ssp's bound): ps only.
    dataset: "digits" or "mnist" (then data_dir holds the IDX files). device: "cpu" or "cuda".
    progress: show a tqdm bar on the reporting rank. timeout: seconds every blocking wait
    of ddp, ps and pipeline may take before it raises (a dead or stuck peer); by default
    ``p2p.get_timeout()``, the engine's one deadline (300 s, or ``MINIDIST_TIMEOUT``).
    schedule (one of PIPELINE_SCHEDULES), microbatches (>= 1, per pipeline and step), dp
    (>= 1, pipelines side by side), stages_per_rank (>= 1, interleaved only): pipeline only.
    weight_stashing, vertical_sync: ``--schedule pipedream`` only (:func:`train_pipedream`).
    checkpoint_dir: where :class:`Checkpointer` saves the training state every
    ``checkpoint_every`` (>= 1; 0: DEFAULT_CHECKPOINT_EVERY) global steps; resume: continue from
    its newest valid checkpoint; save_model: a path for the final weights (``.npz`` of the
    state dict); stop_after_steps: stop (as if killed) after this global step, for tests;
    kill_at_step, kill_rank: rank ``kill_rank`` SIGKILLs itself at the end of global step
    ``kill_at_step``, once per checkpoint folder (``Checkpointer.after_step``), for tests.
    Every strategy but ps async/ssp and the PipeDream schedules.
    precision: "fp32", "fp16" or "bf16" (:mod:`minidist.precision`: autocast around forward and
    loss, float32 master weights); loss_scale: "dynamic", "none", a number > 0 (static) or None,
    the precision's default (dynamic for fp16, none for bf16 and fp32). Single, ddp, pipeline.
    replay_step: rerun the run from ``checkpoint_dir``'s checkpoint before this global step up to
    it, report it and stop (:func:`minidist.replay.replay`). Single and ddp.
    comm_hook (one of ``comm_hooks.COMM_HOOKS``: none, fp16, bf16, int8, topk) and topk_ratio (in
    (0, 1], topk only): what each DDP bucket sends (``minidist.parallel.data_parallel.comm_hooks``); ddp only.
    all_reduce: DDP's all-reduce algorithm (``ddp.DDP_ALGORITHMS``: auto, ring, recursive_doubling, tree, naive,
    hierarchical, torus, multi_ring, the last three over ``minidist.node_layout``'s nodes); ddp without zero, int8 or
    topk only.
    model: "mlp" (the classifier above) or "gpt" (``minidist.models.gpt``, a character-level language model on
    ``dataset="shakespeare"``; ``minidist.workloads``). Its fields: steps (>= 1) optimizer steps, evaluated
    every ``eval_every`` (>= 1) steps; for gpt ``epochs`` is derived, ceil(steps / eval_every) evaluation
    intervals, each one ``fit`` epoch. n_layer, n_head, n_embd (divisible by n_head), block_size (the context
    T), dropout (in [0, 1)): the GPTConfig. warmup_steps (>= 0): AdamW's lr rises linearly over them, then
    follows a cosine to a tenth of ``lr`` at the last step. grad_clip (>= 0; 0: none): the bound of the
    global gradient norm (``nn.utils.clip_grad_norm_``). lr, weight_decay, batch_size and dataset serve
    both models; left None they take the model's own (:data:`MODEL_DEFAULTS`: the MLP's 0.05, 0, 32,
    digits; the GPT's GPT_LR, GPT_WEIGHT_DECAY, GPT_BATCH_SIZE, shakespeare), so ``TrainConfig(model=
    "gpt")`` is the run ``train --model gpt`` starts (``dataclasses.replace`` keeps the values a config
    already has: give them again when changing the model); the other MLP fields
    (epochs, momentum, hidden, warmup_epochs) do not apply to gpt, nor the gpt fields to mlp.
    sequence_parallel: with strategy "tp" or "3d" (tensor parallelism, gpt only), also cut the
    activations between the split layers by positions (``minidist.parallel.tensor_parallel``).
    tp: with strategy "3d" (``minidist.parallel.three_d``), the tensor-parallel ranks of each stage;
    with ``dp`` the pipelines side by side, the pipeline has world_size / (dp x tp) ranks; with
    strategy "fsdp", the tensor-parallel ranks inside each FSDP replica (``fsdp.compose``).
    zero: with strategy "ddp", shard the optimizer's state over the ranks (ZeRO-1,
    ``minidist.parallel.zero``). sharding_strategy: with strategy "fsdp" (``minidist.parallel.fsdp``),
    "FULL_SHARD" (ZeRO-3), "SHARD_GRAD_OP" (ZeRO-2), "NO_SHARD" or "HYBRID_SHARD" (FULL_SHARD in a node).
    global_batch_size: None, or G (>= 1) samples per step whatever the number of ranks M (single,
    ddp, ddp --zero, fsdp): each rank reads its part of G (``per_rank_config``: G / M, or, when
    M does not divide G, parts off by one whose gradients are weighted by their rows,
    ``loss_weight``), the epoch is ``data.GlobalBatchSampler``'s, the lr is ``lr`` for G on any M (no linear scaling),
    and a checkpoint resumes on another number of ranks (``fault.is_elastic``).
    cp_variant: with strategy "cp" (``minidist.parallel.context_parallel``), how attention reaches the other ranks'
    positions: "ring", "zigzag", "allgather" or "ulysses".
    n_expert, top_k, capacity_factor, aux_loss_coef, bias_update_rate: with strategy "single" or "ep" and model "gpt",
    a mixture of experts in place of each block's MLP (``models.moe``; n_expert 0: dense), set by the ep wing's flags.
    sync_every (>= 1), outer_lr (> 0), outer_momentum (in [0, 1)), nesterov, fragments (1..sync_every): with
    strategy "diloco" (``minidist.parallel.local_sgd``), the inner steps between syncs H, the outer SGD on the
    pseudo-gradients, and Streaming DiLoCo's fragments (1: DiLoCo).
    """

    strategy: str = "single"
    epochs: int = 20
    batch_size: int | None = None  # None: the model's (MODEL_DEFAULTS)
    lr: float | None = None
    momentum: float = 0.9
    weight_decay: float | None = None
    hidden: tuple = (128,)
    seed: int = 0
    scale_lr: bool | None = None
    warmup_epochs: float = 0.0
    ps_mode: str = "sync"
    num_servers: int = 1
    staleness: int = 2
    dataset: str | None = None
    data_dir: str | None = None
    device: str = "cpu"
    progress: bool = True
    timeout: float = field(default_factory=p2p.get_timeout)  # 300 s, or MINIDIST_TIMEOUT
    schedule: str = "1f1b"
    microbatches: int = 4
    dp: int = 1
    stages_per_rank: int = 2
    weight_stashing: bool = True
    vertical_sync: bool = False
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    save_model: str | None = None
    stop_after_steps: int | None = None
    replay_step: int | None = None
    kill_at_step: int | None = None
    kill_rank: int = 0
    precision: str = "fp32"
    loss_scale: str | float | None = None
    comm_hook: str = "none"
    topk_ratio: float = 0.01
    all_reduce: str = "auto"
    model: str = "mlp"
    steps: int = 800
    eval_every: int = 100
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 64
    dropout: float = 0.0
    warmup_steps: int = 100
    grad_clip: float = 1.0
    sequence_parallel: bool = False
    tp: int = 1
    zero: bool = False
    sharding_strategy: str = "FULL_SHARD"
    global_batch_size: int | None = None
    cp_variant: str = "ring"
    n_expert: int = 0
    top_k: int = 2
    capacity_factor: float | None = 1.25
    aux_loss_coef: float = 0.01
    bias_update_rate: float = 0.0
    sync_every: int = 10
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    fragments: int = 1

    def __post_init__(self):
        for name, value in MODEL_DEFAULTS.get(self.model, MODEL_DEFAULTS["mlp"]).items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.model == "gpt" and self.eval_every >= 1:  # one fit epoch per evaluation interval
            self.epochs = math.ceil(self.steps / self.eval_every)


# TrainConfig fields that do not change what a run computes, so the ranks of one job may differ
# in them: how it shows progress, how long a wait may take, and paths that name the same files
# from different nodes (checkpoint_dir counts by whether it is given).
NOT_RUN_FIELDS = ("progress", "timeout", "save_model", "data_dir", "checkpoint_dir")


def run_fields(config: TrainConfig) -> dict:
    """The fields of ``config`` that shape the run (every TrainConfig field but
    :data:`NOT_RUN_FIELDS`, plus ``checkpointing``: whether ``checkpoint_dir`` is given), by
    name, in the dataclass's order. Every rank of a job must have the same ones: the command
    line compares them at start-up (:func:`run_digest`)."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in NOT_RUN_FIELDS}
    fields["checkpointing"] = config.checkpoint_dir is not None
    return fields


def run_digest(config: TrainConfig) -> str:
    """One hash of :func:`run_fields` (SHA-256 of their ``repr``, 16 hex digits): equal on two
    ranks exactly when their configurations shape the same run."""
    return hashlib.sha256(repr(sorted(run_fields(config).items())).encode()).hexdigest()[:16]


@dataclass
class TrainResult:
    """What a strategy reports: the final test accuracy (fraction in [0, 1]; NaN for gpt), the
    per-epoch history (dicts with epoch, loss, train_accuracy, test_accuracy, seconds; for gpt
    per evaluation: step, loss, train_loss, val_loss, seconds, ms_per_step, tokens_per_second),
    strategy-specific figures (e.g. bytes sent, printed before the last line), the trained
    model, and for gpt the final validation loss (nats per character) and a generated sample."""

    test_accuracy: float
    history: list = field(default_factory=list)
    figures: dict = field(default_factory=dict)
    model: object = None
    val_loss: float | None = None
    sample: str | None = None
