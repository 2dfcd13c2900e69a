"""Expert parallelism: the experts of each MoE layer spread over the ranks of an ``ep`` group, the
tokens sent to them and back by all-to-alls.

A mixture of experts (``minidist.models.moe``) multiplies a layer's parameters by E and its FLOPs
per token by k; expert parallelism spreads the E experts over P ranks, so each holds E / P of
them, and moves the tokens instead of the weights ("much more lightweight than TP: we just route
the hidden states", the Ultra-Scale Playbook). The files, in reading order:

- ``dispatch``  which rank holds which expert; dispatch and combine as ``all_to_all_v`` (counts
                first), each the other's backward
- ``gpt``       the MoE GPT laid out from outside: this rank's experts, gradients reduced by who
                holds them, the clipping norm, the dense state dict
- ``train``     the driver of ``train --model gpt --n-expert E --strategy ep [--dp D]`` and of
                the one-process MoE (``--strategy single --n-expert E``)
- ``strategy``  ``STRATEGY``, ``MOE_SINGLE`` and the expert flags

Sources: Lepikhin et al., "GShard" (2020); Fedus et al., "Switch Transformers" (2021); DeepSeek-AI,
"DeepSeek-V3 Technical Report" (2024); Megatron-Core's ``megatron/core/transformer/moe/``;
torchtitan's ``torchtitan/distributed/expert_parallel.py``.
"""
from minidist.parallel.expert_parallel.dispatch import AllToAllDispatcher, Combine, Dispatch, expert_owners
from minidist.parallel.expert_parallel.gpt import (
    apply_ep,
    clip_grad_norm_,
    dense_state_dict,
    moe_layers,
    reduce_gradients,
    split_parameters,
)

__all__ = ["AllToAllDispatcher", "Dispatch", "Combine", "expert_owners", "apply_ep", "reduce_gradients",
           "clip_grad_norm_", "dense_state_dict", "moe_layers", "split_parameters"]
