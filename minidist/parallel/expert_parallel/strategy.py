"""``--strategy ep`` declares itself, with the expert flags it owns (``--n-expert``, ``--top-k``,
``--capacity-factor``, ``--aux-loss-coef``, ``--bias-update-rate``), data parallelism beside it
(the pipeline's ``--dp``: D groups of P / D ep ranks), and ``MOE_SINGLE``: the variant of
``--strategy single`` that trains the MoE GPT in one process when ``--n-expert`` is given."""
from __future__ import annotations

from minidist.parallel.expert_parallel.train import check_expert_parallel, train_expert_parallel, train_moe_single
from minidist.parallel.pipeline.strategy import DP
from minidist.strategy import Flag, Strategy
from minidist.train import TrainConfig

D = TrainConfig()
N_EXPERT = Flag("--n-expert", "n_expert", dict(
    type="positive_int", help="gpt: a mixture of E experts (GPT MLPs) in place of each block's MLP (single, ep; ep "
                              "spreads them over the ranks of an ep group, E >= ranks / --dp)"))
TOP_K = Flag("--top-k", "top_k", dict(
    type="positive_int", help=f"gpt with --n-expert: experts per token, 1 Switch, 2 GShard (default: {D.top_k})"))
CAPACITY_FACTOR = Flag("--capacity-factor", "capacity_factor", dict(
    type="positive_float", help="gpt with --n-expert: each expert takes at most ceil(factor * top_k * tokens / E) of "
                                f"the global batch's tokens, the rest dropped (default: {D.capacity_factor})"))
AUX_LOSS_COEF = Flag("--aux-loss-coef", "aux_loss_coef", dict(
    type="nonnegative_float", help=f"gpt with --n-expert: Switch's load-balancing alpha (default: {D.aux_loss_coef})"))
BIAS_UPDATE_RATE = Flag("--bias-update-rate", "bias_update_rate", dict(
    type="nonnegative_float", help="gpt with --n-expert: DeepSeek-V3's per-expert routing bias, moved by this much "
                                   f"per step against the load (default: {D.bias_update_rate:g}: off)"))
EXPERT_FLAGS = (N_EXPERT, TOP_K, CAPACITY_FACTOR, AUX_LOSS_COEF, BIAS_UPDATE_RATE)


def refuse_checkpoints(config) -> str | None:
    """Why an ep (or one-process MoE) run writes no checkpoint (each rank holds only its experts, and
    the routing bias is no parameter); None when only ``--save-model`` is asked: the final dense
    model is gathered and written (``train.ExpertParallelRun.finish``)."""
    if config.checkpoint_dir is None and not config.resume and config.kill_at_step is None:
        return None
    return ("does not apply to an MoE GPT yet (--n-expert): each ep rank holds only its experts, and their "
            "checkpoints are not written yet (--save-model writes the final model)")


STRATEGY = Strategy(
    name="ep", driver=train_expert_parallel,
    summary="ep (expert parallelism: a mixture of experts spread over the ranks; --n-expert, --top-k, --dp; --model "
            "gpt only)",
    models=("gpt",), models_why=" (it spreads the transformer's experts)", flags=EXPERT_FLAGS + (DP,),
    check=check_expert_parallel, global_batch=True, checkpoints=refuse_checkpoints,
    mixed_precision=lambda config: "; --strategy ep trains in fp32")

# --strategy single --n-expert E: the one-process MoE GPT (the ep run on one rank), the reference of ep.
MOE_SINGLE = Strategy(
    name="single-moe", label="single --n-expert", driver=train_moe_single, summary="single with --n-expert",
    variant_of="single", when=lambda config: bool(config.n_expert), models=("gpt",),
    check=lambda world_size, config: check_expert_parallel(1, config),
    models_why=" (experts replace the transformer's MLPs)", flags=EXPERT_FLAGS, one_process=True,
    one_batch=lambda config: "--strategy single has one worker", global_batch=True, checkpoints=refuse_checkpoints,
    mixed_precision=lambda config: "; an MoE GPT trains in fp32")
