"""Mixture of experts in the layout planner: the counts :mod:`minidist.planner` adds for a model
whose MLPs are E experts of which each token uses k (``ModelSpec.n_expert > 0``).

A model with experts differs from a dense one in four counts, each a closed form:

- parameters: a MoE layer holds attention, its shared experts and a router (E h, a Linear without
  bias), all replicated over the expert-parallel ranks, and E routed experts, each a (gated) MLP of
  width f_e, spread over ``ep`` ranks: ceil(E / ep) experts per rank (``expert_parallel.dispatch.
  expert_owners``' runs). The first ``dense_layers`` layers keep a dense MLP of width ``ffn``
  (DeepSeek-V3 section 4.2: "all FFNs except for the first three layers"). *Total* counts every
  expert, *active* the k routed experts a token uses (plus everything else): the 6 x active FLOPs
  per token of the scaling book's section 4 rule (Austin et al., "How to Scale Your Model", 2025);
- memory: expert parameters, gradients and optimizer state divide by ep; ZeRO shards them over
  the dp / ep ranks that replicate each expert (the rest over dp, as for a dense model);
- traffic: per MoE layer and micro-batch a dispatch and a combine all-to-all forward and two in the
  backward (the backward of an all-to-all is the reverse one; GShard, Lepikhin et al. 2020), two
  more in a fully recomputed forward. Each rank sends its b s tokens' k copies, e k b s h bytes,
  of which (ep - 1) / ep leave it for a uniform router: ``costmodel.terms("all_to_all", ...)``'s
  pairwise exchange, (ep - 1) alpha + (ep - 1) / ep n beta. Expert gradients are all-reduced over
  the dp / ep replicas of each expert only (``parallel.expert_parallel``);
- the roofline: an expert's matrices on t tokens do 2 t h f_e FLOPs per matrix and read e h f_e
  bytes of weights, t / (e/2) FLOP per byte, so they are compute-bound once t >= (e / 2) ridge; a
  batch of B tokens gives each expert t = B k / E of them, so the layer needs B >= (E / k)(e / 2)
  ridge (:func:`compute_bound_batch`; benchmarks/bench_experts.py measures it, part d).

Nothing here imports the planner (no cycle): the functions read a ``ModelSpec``'s fields.
"""
from __future__ import annotations

from minidist.costmodel import terms


def expert_parameters(m) -> int:
    """One routed expert's parameters: (3 if gated else 2) h f_e, plus f_e + h biases with
    ``bias`` (a GPT MLP of width f_e). DeepSeek-V3 and Mixtral: SwiGLU, no biases."""
    f, h = m.expert_width, m.hidden
    return (3 if m.gated_mlp else 2) * h * f + ((f + h) if m.bias else 0)


def moe_layer_parameters(m) -> tuple[int, int, int]:
    """``(split, replicated, experts)`` of one MoE layer: ``split`` attention and the shared
    experts (split over t as a dense MLP), ``replicated`` the norms, the attention output's bias
    and the router (E h), ``experts`` the E routed experts (spread over ep; each carries its own
    biases, :func:`expert_parameters`)."""
    h = m.hidden
    split = m.attention_split() + m.n_shared_expert * expert_parameters(m)
    replicated = (2 if m.norm == "layernorm" else 1) * h * 2 + m.n_expert * h + (h if m.bias else 0)
    return split, replicated, m.n_expert * expert_parameters(m)


def layer_counts(m, pp: int, stage: int) -> tuple[int, int]:
    """``(dense, moe)`` layers pipeline stage ``stage`` of ``pp`` holds: the l layers cut in
    contiguous runs, the first l mod pp stages one more (``numpy.array_split``'s sizes; pp need
    not divide l for a model with experts: DeepSeek-V3's 61 layers on 16 stages), of which the
    first ``dense_layers`` of the model are dense."""
    base, extra = divmod(m.layers, pp)
    start = stage * base + min(stage, extra)
    count = base + (1 if stage < extra else 0)
    dense = max(0, min(start + count, m.dense_layers) - start)
    return dense, count - dense


def total_parameters(m) -> int:
    """Every parameter once: dense layers, MoE layers with all E experts, embeddings, final norm."""
    split, replicated = m.layer_parameters()
    moe_split, moe_replicated, experts = moe_layer_parameters(m)
    moe_layers = m.layers - m.dense_layers
    return (m.dense_layers * (split + replicated) + moe_layers * (moe_split + moe_replicated + experts)
            + m.embedding_parameters + m.norm_parameters)


def active_parameters(m) -> int:
    """The parameters one token uses: as :func:`total_parameters` with k routed experts of E."""
    experts_unused = (m.n_expert - m.top_k) * expert_parameters(m)
    return total_parameters(m) - (m.layers - m.dense_layers) * experts_unused


def stage_moe_layers(m, pp: int) -> int:
    """The most MoE layers any of the ``pp`` stages holds (the all-to-alls' critical path)."""
    return max(layer_counts(m, pp, stage)[1] for stage in range(pp))


def all_to_all_bytes(m, layout, seq_len: int, global_batch: int, *, element_size: int = 2) -> tuple[float, float]:
    """``(messages, bytes)`` each GPU sends per step for the experts: the busiest stage's MoE
    layers x m micro-batches x 4 all-to-alls (6 with full recomputation), each of one rank's
    input n = e k b s h bytes over ep ranks, priced as ``costmodel.terms("all_to_all",
    "pairwise", n, ep)``: ep - 1 messages and (ep - 1) / ep n bytes. (0, 0) when ep = 1."""
    ep = layout.ep
    if ep == 1:
        return 0.0, 0.0
    microbatches = global_batch // (layout.dp * layout.micro_batch)
    count = stage_moe_layers(m, layout.pp) * microbatches * (6 if layout.recompute == "full" else 4)
    n = element_size * m.top_k * layout.micro_batch * seq_len * m.hidden
    messages, sent, _ = terms("all_to_all", "pairwise", n, ep)
    return count * messages, count * sent


def compute_bound_batch(n_expert: int, top_k: int, peak_flops: float, bandwidth: float,
                        element_size: int = 2) -> float:
    """Tokens per batch at which an MoE layer's experts become compute-bound on the roofline
    (chapter 13): an expert's matrix W (h x f) on t tokens does 2 t h f FLOPs and reads e h f
    bytes of weights, intensity 2 t / e, so it needs t >= (e / 2) ridge, ridge = peak_flops /
    bandwidth (FLOP per byte); the batch gives each expert t = B k / E tokens, so
    B >= (E / k) (e / 2) ridge (activations' bytes left out: t << h, f). With E = k = 1 the dense
    MLP's bound, (e/2) ridge. Raises ValueError unless 1 <= top_k <= n_expert and the rates > 0."""
    if not (isinstance(n_expert, int) and isinstance(top_k, int) and 1 <= top_k <= n_expert):
        raise ValueError(f"need integers 1 <= top_k <= n_expert, got top_k={top_k!r}, n_expert={n_expert!r}")
    if not (peak_flops > 0 and bandwidth > 0 and element_size > 0):
        raise ValueError(f"peak_flops, bandwidth and element_size must be > 0, got {peak_flops!r}, {bandwidth!r}, "
                         f"{element_size!r}")
    return n_expert / top_k * element_size / 2 * peak_flops / bandwidth


def mla_parameters(hidden: int, heads: int, q_lora_rank: int, kv_lora_rank: int, qk_nope_dim: int,
                   qk_rope_dim: int, v_dim: int) -> int:
    """One layer's multi-head latent attention parameters (DeepSeek-V2/V3; the modules of
    deepseek-ai/DeepSeek-V3 ``inference/model.py``, class ``MLA``): the query down-projection
    h x r_q and its RMSNorm, the up-projection r_q x a (d_nope + d_rope), the joint key-value
    down-projection h x (r_kv + d_rope) and its RMSNorm, the up-projection r_kv x a (d_nope + d_v),
    and the output a d_v x h. No biases."""
    q = hidden * q_lora_rank + q_lora_rank + q_lora_rank * heads * (qk_nope_dim + qk_rope_dim)
    kv = hidden * (kv_lora_rank + qk_rope_dim) + kv_lora_rank + kv_lora_rank * heads * (qk_nope_dim + v_dim)
    return q + kv + heads * v_dim * hidden


def check_experts(m, layout) -> None:
    """Raise ValueError, naming the fix, when ``layout``'s ep cannot run ``m``: ep > 1 needs
    experts, at most E ranks (each holds one at least), and tp = 1 (expert tensor parallelism,
    Megatron-Core's ``expert_tensor_parallel_size``, is not modelled)."""
    ep = layout.ep
    if ep > 1 and not m.n_expert:
        raise ValueError(f"ep={ep} needs a model with experts; {m.name} is dense (use ep=1)")
    if ep > max(m.n_expert, 1):
        raise ValueError(f"ep={ep} is more than the {m.n_expert} routed experts (each ep rank holds one at least)")
    if ep > 1 and layout.tp > 1:
        raise ValueError(f"ep={ep} with tp={layout.tp}: expert tensor parallelism is not modelled; use tp=1 or ep=1")


def expert_replicas(layout) -> int:
    """How many ranks hold each expert: dp / ep (the ranks whose expert gradients are summed)."""
    return layout.dp // layout.ep


def stage_candidates(m, pp: int) -> list[int]:
    """The stages whose memory can be the largest: the first stage of each (dense, moe) layer
    composition (later stages of one composition hold fewer micro-batches in flight under 1F1B)
    and the last stage (the output layer)."""
    first = {}
    for stage in range(pp):
        first.setdefault(layer_counts(m, pp, stage), stage)
    return sorted(set(first.values()) | {pp - 1})


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for integers, exactly."""
    return -(-a // b)

