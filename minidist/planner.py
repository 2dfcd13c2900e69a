"""Choosing a layout: how many GPUs go to data (dp), pipeline (pp) and tensor (tp) parallelism,
and with which micro-batch, ZeRO stage and recomputation, for a transformer on a cluster.

Everything here is a closed form, evaluated per GPU; nothing runs. ``memory`` counts bytes by
category, ``step_time`` adds up the seconds of one training step (global batch B sequences of s
tokens), ``plan`` tries every layout and ranks those that fit. The symbols: l layers, h hidden
size, a heads, V vocabulary, s sequence length, b micro-batch, m = B / (dp b) micro-batches per
pipeline and step, t = tp, p = pp, d = dp, v = interleaved chunks per stage, e bytes per value.

Memory per GPU (the stage that holds the most; the first, or the last with the output layer):

- model state (Rajbhandari et al., "ZeRO", SC 2020, section 3.1): e bytes per parameter, e per
  gradient, K per parameter of optimizer state (K = 12 for mixed-precision Adam: an fp32 master
  copy and two fp32 moments; 8 for the engine's float32 AdamW). ZeRO stage 1 divides the
  optimizer state by d, stage 2 also the gradients, stage 3 also the parameters (rounded up:
  d equal shards). A stage's parameters: its l/p layers (matrices and column-parallel biases
  split over t, norms and row-parallel biases replicated: Megatron's split), the embedding
  (V h / t, rounded up) and learned positions on the first stage, the final norm and (untied,
  or tied with p > 1, where Megatron keeps a copy of the embedding) V h / t on the last;
- activations (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
  Models", MLSys 2023, sections 4.1-4.3) per layer and micro-batch, bytes in 16 bits:
  s b h (34 + 5 a s / h) alone; s b h (10 + 24/t + 5 a s / (h t)) with TP; s b h / t (34 + 5 a s / h)
  with TP and sequence parallelism; selective recomputation drops the 5 a s / h term; full
  recomputation keeps the layer's input, 2 s b h (/t with SP), plus one layer's activations
  while it is recomputed (chapter 10's count; the paper leaves that buffer out). Written with
  e: values e(16 s b h + 2 a s^2 b), dropout masks 2 s b h + a s^2 b bytes; the replicated part
  without SP is 4 s b h values and the 2 s b h masks. 1F1B keeps min(p, m) micro-batches in
  flight on the first stage (Narayanan et al., "Efficient Large-Scale Language Model Training
  on GPU Clusters Using Megatron-LM", SC 2021, section 2.2), the interleaved schedule
  (1 + (p-1)/(p v)) times that (Korthikanti et al., section 4.2.2). The last stage holds the
  output layer's: the final norm's and the projection's inputs (2 e s b h) and the fp32 logits
  (4 s b V), over t; the first the embedding's dropout mask, s b h per micro-batch in flight.
  Left out: temporary buffers (communication buckets, workspaces) and the allocator.

Step time, each term an alpha-beta count (``minidist.costmodel``; nothing overlaps):

- compute: the model's FLOPs, 6 Psi + 12 l s h per token (forward and backward of every
  weight, Kaplan et al. 2020, plus attention's scores; chapter 13), which equals Narayanan et
  al.'s 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) when Psi = 12 l h^2 + V h. Recomputation adds the
  FLOPs it repeats: full, one more forward of the layers (2 Psi_layers + 4 l s h per token:
  Narayanan's 96 B s l h^2 (...)); selective, attention's scores (4 l s h). Divided over the
  GPUs at ``Cluster.mfu`` of their peak;
- TP: per layer and micro-batch 2 all-reduces forward and 2 backward (2 more in the recomputed
  forward) of b s h values over t ranks, on NVLink when t <= gpus_per_node, else the network
  (Narayanan et al., section 3.2; with SP a reduce-scatter and an all-gather, the same bytes);
- PP: each stage sends every micro-batch's activations forward and its gradient back, b s h / t
  values each (Narayanan's scatter/gather, section 4.1), v times as many with interleaving; on
  the network when the pipeline spans nodes (t p > gpus_per_node);
- DP: the stage's gradients, ring all-reduce 2(d-1)/d of their bytes (ZeRO 1 and 2: a
  reduce-scatter and an all-gather, the same; ZeRO 3: one more all-gather, 3(d-1)/d);
- bubble: (p-1)/(v m) of the compute, TP and PP time (Narayanan et al., section 2.2).

The ranks sit TP innermost, then PP, then DP (``parallel.mesh.DeviceMesh``), so a TP group is
on one node when t <= gpus_per_node and a DP group spans nodes when t p d > gpus_per_node.

Mixtures of experts (``ModelSpec.n_expert > 0``, presets ``deepseek-v3`` and ``mixtral-8x7b``):
``Layout.ep`` spreads the routed experts over ep ranks inside each data-parallel group; their
state divides by ep, the FLOPs count the *active* parameters, a fifth term ``"ep"`` prices the
dispatch and combine all-to-alls, and the experts' gradients are all-reduced over dp / ep
replicas: :mod:`minidist.planner_moe` has the counts and their sources.

Longer than 400 lines: the planner's formulas (memory, compute, the three kinds of traffic, the
bubble) and its search are one model of a step, checked against each other in one test file; the
presets are data.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from minidist import planner_moe
from minidist.costmodel import CostModel

GiB = 2 ** 30
RECOMPUTE = ("none", "selective", "full")


# ----------------------------------------------------------------------------- models


@dataclass(frozen=True)
class ModelSpec:
    """A transformer's shapes. ``parameters`` is counted from them (``published``: the figure
    its paper gives, for the tests). Defaults are GPT-2's: MLP 4h with GELU, biases, LayerNorm,
    learned positions, output tied to the embedding; LLaMA sets ``ffn_hidden``, ``gated_mlp``
    (SwiGLU, 3 matrices), ``bias=False``, ``norm="rmsnorm"``, no learned positions, untied, and
    ``kv_heads`` (grouped-query attention: k and v have kv_heads heads)."""

    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    ffn_hidden: int | None = None
    kv_heads: int | None = None
    gated_mlp: bool = False
    bias: bool = True
    norm: str = "layernorm"
    learned_positions: bool = True
    tied_embeddings: bool = True
    published: float | None = None
    source: str = ""
    n_expert: int = 0
    n_shared_expert: int = 0
    top_k: int = 0
    expert_ffn: int | None = None
    dense_layers: int = 0
    attention_params: int | None = None
    score_width: int | None = None
    published_active: float | None = None

    def __post_init__(self):
        if self.n_expert < 0 or (self.n_expert and not 1 <= self.top_k <= self.n_expert):
            raise ValueError(f"{self.name}: need n_expert >= 0 and, with experts, 1 <= top_k <= n_expert; got "
                             f"n_expert={self.n_expert}, top_k={self.top_k}")
        if not 0 <= self.dense_layers <= self.layers or (self.dense_layers and not self.n_expert):
            raise ValueError(f"{self.name}: dense_layers={self.dense_layers} must lie in 0 .. layers and needs "
                             "n_expert > 0 (a dense model's layers are all dense)")

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def expert_width(self) -> int:
        """f_e, the hidden width of one expert (``expert_ffn``, default ``ffn``)."""
        return self.expert_ffn or self.ffn

    def attention_split(self) -> int:
        """One layer's attention parameters, all split over t: q, k, v, the output projection and
        q, k, v's biases, or ``attention_params`` when given (an attention of another shape:
        DeepSeek's multi-head latent attention, ``planner_moe.mla_parameters``)."""
        if self.attention_params is not None:
            return self.attention_params
        h, kv = self.hidden, (self.kv_heads or self.heads) * (self.hidden // self.heads)
        return h * (h + 2 * kv) + h * h + ((h + 2 * kv) if self.bias else 0)

    def layer_parameters(self) -> tuple[int, int]:
        """``(split, replicated)`` parameters of one (dense) layer under TP: q, k, v, the MLP's
        first matrix(es) and their biases are split over t, the output projections too; their
        biases and the norms are replicated (Megatron-LM's column- and row-parallel layers). A MoE
        layer's: ``planner_moe.moe_layer_parameters``."""
        h = self.hidden
        matrices_in = self.ffn * h * (2 if self.gated_mlp else 1)
        split = self.attention_split() + matrices_in + self.ffn * h
        replicated = (2 if self.norm == "layernorm" else 1) * h * 2
        if self.bias:
            split += 0 if self.gated_mlp else self.ffn
            replicated += 2 * h
        return split, replicated

    @property
    def embedding_parameters(self) -> int:
        """The token embedding, the output layer unless tied, and learned positions."""
        positions = self.seq_len * self.hidden if self.learned_positions else 0
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + positions

    @property
    def norm_parameters(self) -> int:
        return (2 if self.norm == "layernorm" else 1) * self.hidden

    @property
    def parameters(self) -> int:
        """Psi: every parameter once (a tied output layer counts once; every expert: the total)."""
        if self.n_expert:
            return planner_moe.total_parameters(self)
        split, replicated = self.layer_parameters()
        return self.layers * (split + replicated) + self.embedding_parameters + self.norm_parameters

    @property
    def active_parameters(self) -> int:
        """The parameters one token uses: ``parameters`` for a dense model; with experts, k routed
        experts of E per MoE layer (``planner_moe.active_parameters``)."""
        return planner_moe.active_parameters(self) if self.n_expert else self.parameters


def _gpt(name, layers, hidden, heads, seq_len=2048, vocab=51200, published=None, source=""):
    return ModelSpec(name, layers, hidden, heads, vocab, seq_len, published=published, source=source)


def _llama(name, layers, hidden, heads, ffn, kv_heads, seq_len, published, source):
    return ModelSpec(name, layers, hidden, heads, 32000, seq_len, ffn_hidden=ffn, kv_heads=kv_heads, gated_mlp=True,
                     bias=False, norm="rmsnorm", learned_positions=False, tied_embeddings=False,
                     published=published, source=source)


_GPT2 = "Radford et al. 2019; counts of the released checkpoints (HuggingFace gpt2*)"
_SC21 = "Narayanan et al., SC 2021, Table 1 (V = 51,200, s = 2048)"
MODELS = {m.name: m for m in (
    ModelSpec("gpt2", 12, 768, 12, 50257, 1024, published=124.44e6, source=_GPT2),
    ModelSpec("gpt2-medium", 24, 1024, 16, 50257, 1024, published=354.82e6, source=_GPT2),
    ModelSpec("gpt2-large", 36, 1280, 20, 50257, 1024, published=774.03e6, source=_GPT2),
    ModelSpec("gpt2-xl", 48, 1600, 25, 50257, 1024, published=1557.6e6, source=_GPT2),
    _gpt("gpt3-175b", 96, 12288, 96, vocab=50257, published=175.0e9,
         source="Brown et al. 2020, Table 2.1 (GPT-3 175B)"),
    _gpt("sc21-1.7b", 24, 2304, 24, published=1.7e9, source=_SC21),
    _gpt("sc21-18b", 40, 6144, 48, published=18.4e9, source=_SC21),
    _gpt("sc21-39b", 48, 8192, 64, published=39.1e9, source=_SC21),
    _gpt("sc21-76b", 60, 10240, 80, published=76.1e9, source=_SC21),
    _gpt("sc21-146b", 80, 12288, 96, published=145.6e9, source=_SC21),
    _gpt("sc21-1t", 128, 25600, 160, published=1008.0e9, source=_SC21),
    _llama("llama-7b", 32, 4096, 32, 11008, 32, 2048, 6.74e9, "Touvron et al. 2023 (LLaMA 7B; 6,738,415,616)"),
    _llama("llama-70b", 80, 8192, 64, 28672, 8, 4096, 68.98e9,
           "Touvron et al. 2023, Llama 2 70B (GQA with 8 kv heads; 68,976,648,192)"),
    # Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts", Table 1): 32 layers, h 4096, 32 heads, 8 kv heads,
    # SwiGLU experts of width 14336, 8 experts top-2, V 32000, context 32768; 46.7B total, 12.9B active
    # (Mistral AI's announcement, mistral.ai/news/mixtral-of-experts).
    ModelSpec("mixtral-8x7b", 32, 4096, 32, 32000, 32768, ffn_hidden=14336, kv_heads=8, gated_mlp=True, bias=False,
              norm="rmsnorm", learned_positions=False, tied_embeddings=False, n_expert=8, top_k=2,
              published=46.7e9, published_active=12.9e9,
              source="Jiang et al. 2024, Mixtral of Experts, Table 1; 46.7B total / 12.9B active (Mistral AI)"),
    # DeepSeek-V3 (DeepSeek-AI, arXiv 2412.19437, section 4.2): 61 layers, h 7168, 128 heads of MLA (d_h 128,
    # r_kv 512, r_q 1536, rope 64), every FFN but the first three a MoE of 1 shared + 256 routed experts of width
    # 2048, 8 active; 671B total, 37B active; V 129,280 and the dense FFN's 18,432 from the released
    # inference/configs/config_671B.json; pre-training sequences of 4K. MLA is counted exactly (its parameters
    # and its scores' width a (d_qk + d_v) / 2 = 128 x 320 / 2); its activations are approximated by the
    # multi-head formula of h and a (the planner's Korthikanti count), and the multi-token prediction module
    # (14B more) is left out, as the 671B leave it out.
    ModelSpec("deepseek-v3", 61, 7168, 128, 129280, 4096, ffn_hidden=18432, gated_mlp=True, bias=False,
              norm="rmsnorm", learned_positions=False, tied_embeddings=False, n_expert=256, n_shared_expert=1,
              top_k=8, expert_ffn=2048, dense_layers=3,
              attention_params=planner_moe.mla_parameters(7168, 128, 1536, 512, 128, 64, 128),
              score_width=128 * (128 + 64 + 128) // 2, published=671e9, published_active=37e9,
              source="DeepSeek-AI 2024, DeepSeek-V3 Technical Report (arXiv 2412.19437), section 4.2"),
)}


def get_model(name) -> ModelSpec:
    """A preset by name, or ``name`` itself when it is a :class:`ModelSpec`. Raises ValueError
    naming the presets for an unknown name."""
    if isinstance(name, ModelSpec):
        return name
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; the presets are: {', '.join(MODELS)} "
                         "(or pass a planner.ModelSpec)")
    return MODELS[name]


# ----------------------------------------------------------------------------- cluster, layout


@dataclass(frozen=True)
class Cluster:
    """The machine. Defaults: DGX A100 80 GB nodes as in Narayanan et al. (SC 2021, section 5):
    8 GPUs per node on NVSwitch, 312 TFLOP/s dense 16-bit peak each (NVIDIA A100 datasheet),
    NVLink 3 at 300 GB/s per direction per GPU (600 GB/s both ways), eight 200 Gb/s HDR
    InfiniBand adapters per node, 25 GB/s per GPU. Latencies (alpha, seconds per step of a ring)
    from NCCL's own tuning model (``src/graph/tuning.cc``, hwLat ring/Simple): 3.4 us on NVLink,
    9.6 us on the network. ``mfu``: the fraction of the peak that the GPU sustains on the FLOPs
    it runs (the MFU a layout with no communication, bubble or recomputation would reach): a
    stated assumption, 0.5 by default. ``gpu_memory`` in bytes. Raises ValueError with the fix
    for a GPU count that does not fill whole nodes, or values out of range."""

    gpus: int
    gpus_per_node: int = 8
    gpu_memory: int = 80 * GiB
    peak_flops: float = 312e12
    mfu: float = 0.5
    nvlink_alpha: float = 3.4e-6
    nvlink_bandwidth: float = 300e9
    network_alpha: float = 9.6e-6
    network_bandwidth: float = 25e9

    def __post_init__(self):
        for name in ("gpus", "gpus_per_node", "gpu_memory"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"Cluster.{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(f"{self.gpus} GPUs do not fill whole nodes of {self.gpus_per_node}; use a multiple of "
                             f"{self.gpus_per_node} (or fewer GPUs than one node)")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"Cluster.mfu must lie in (0, 1], got {self.mfu!r}")

    def link(self, span: int) -> CostModel:
        """The alpha-beta model of a group whose ranks lie ``span`` ranks apart at most: NVLink
        when they fit in one node, the network otherwise."""
        if span <= self.gpus_per_node:
            return CostModel(alpha=self.nvlink_alpha, beta=1 / self.nvlink_bandwidth)
        return CostModel(alpha=self.network_alpha, beta=1 / self.network_bandwidth)


@dataclass(frozen=True)
class Layout:
    """dp x pp x tp GPUs, a micro-batch of ``micro_batch`` sequences, ZeRO stage 0-3 over dp,
    recomputation "none" | "selective" | "full", Megatron's sequence parallelism,
    ``interleave`` (v) model chunks per pipeline stage, and ``ep``: the experts of a model with
    experts spread over ep ranks inside each data-parallel group (Megatron-Core's and DeepSeek-V3's
    way: ep divides dp, dp / ep ranks hold each expert; the ep ranks are dp's fastest, so an ep
    group spans t p ep ranks). Raises ValueError for values out of range or ep not dividing dp."""

    dp: int
    pp: int
    tp: int
    micro_batch: int = 1
    zero_stage: int = 0
    recompute: str = "none"
    sequence_parallel: bool = False
    interleave: int = 1
    ep: int = 1

    def __post_init__(self):
        for name in ("dp", "pp", "tp", "micro_batch", "interleave", "ep"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"Layout.{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"Layout.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"Layout.recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        if self.dp % self.ep:
            raise ValueError(f"Layout.ep={self.ep} must divide dp={self.dp}: the experts are spread over ep ranks of "
                             "each data-parallel group (dp / ep ranks hold each expert)")

    @property
    def gpus(self) -> int:
        return self.dp * self.pp * self.tp

    def __str__(self):
        extra = (" sp" if self.sequence_parallel else "") + (f" v={self.interleave}" if self.interleave > 1 else "")
        extra += f" ep={self.ep}" if self.ep > 1 else ""
        return (f"dp={self.dp} pp={self.pp} tp={self.tp} mb={self.micro_batch} zero={self.zero_stage} "
                f"recompute={self.recompute}{extra}")


# ----------------------------------------------------------------------------- memory


def activation_bytes_per_layer(model, seq_len: int, micro_batch: int, tp: int = 1, sequence_parallel: bool = False,
                               recompute: str = "none", element_size: int = 2, mask_size: int = 1) -> int:
    """Bytes one layer keeps for its backward, per micro-batch (Korthikanti et al. 2023, eq. 1-5,
    generalised to ``element_size`` e bytes per value and ``mask_size`` per dropout mask entry,
    0 without dropout). With e = 2: s b h (34 + 5 a s / h) for t = 1; see the module docstring.
    ``recompute="full"`` gives the kept input only (the recomputation buffer is added by
    :func:`memory`). Integer bytes (sizes that t does not divide are rounded up)."""
    m = get_model(model)
    sbh, as2b = seq_len * micro_batch * m.hidden, m.heads * seq_len * seq_len * micro_batch
    if recompute == "full":
        return math.ceil(element_size * sbh / (tp if sequence_parallel else 1))
    split = element_size * 12 * sbh
    replicated = element_size * 4 * sbh + mask_size * 2 * sbh
    if recompute != "selective":
        split += element_size * 2 * as2b + mask_size * as2b
    if sequence_parallel:
        return math.ceil((split + replicated) / tp)
    return replicated + math.ceil(split / tp)


def in_flight(layout: Layout, microbatches: int) -> float:
    """Micro-batches' activations the first stage holds at its peak: min(p, m) under 1F1B,
    times (1 + (p-1)/(p v)) interleaved (Korthikanti et al. 2023, section 4.2.2)."""
    p, v = layout.pp, layout.interleave
    return min(p, microbatches) * (1 + (p - 1) / (p * v) if v > 1 else 1)


def _stage_parameters(m: ModelSpec, layout: Layout, stage: int) -> int:
    """The stage's parameters on one GPU, routed experts left out (:func:`_stage_experts`)."""
    t, p = layout.tp, layout.pp
    split, replicated = m.layer_parameters()
    if not m.n_expert:
        count = m.layers // p * (math.ceil(split / t) + replicated)
    else:
        dense, moe = planner_moe.layer_counts(m, p, stage)
        moe_split, moe_replicated, _ = planner_moe.moe_layer_parameters(m)
        count = dense * (math.ceil(split / t) + replicated) + moe * (math.ceil(moe_split / t) + moe_replicated)
    embedding = math.ceil(m.vocab / t) * m.hidden
    if stage == 0:
        count += embedding + (m.seq_len * m.hidden if m.learned_positions else 0)
    if stage == p - 1:
        count += m.norm_parameters + (embedding if (not m.tied_embeddings or p > 1) else 0)
    return count


def _stage_experts(m: ModelSpec, layout: Layout, stage: int) -> int:
    """The routed experts' parameters one GPU of the stage holds: ceil(E / ep) experts (split
    over t when ep = 1) per MoE layer of the stage. 0 for a dense model."""
    if not m.n_expert:
        return 0
    moe = planner_moe.layer_counts(m, layout.pp, stage)[1]
    return moe * math.ceil(m.n_expert / layout.ep) * math.ceil(planner_moe.expert_parameters(m) / layout.tp)


def _model_state(m: ModelSpec, layout: Layout, stage: int, element_size: int, optimizer_bytes: int) -> tuple:
    """``(parameters, gradients, optimizer, experts)`` bytes of the stage on one GPU: ZeRO
    divides the non-expert state by d, the experts' by their dp / ep replicas; ``experts`` the
    routed experts' share of the three."""
    zero, d = layout.zero_stage, layout.dp
    psi = _stage_parameters(m, layout, stage)
    params = element_size * (math.ceil(psi / d) if zero >= 3 else psi)
    grads = element_size * (math.ceil(psi / d) if zero >= 2 else psi)
    optimizer = optimizer_bytes * (math.ceil(psi / d) if zero >= 1 else psi)
    experts = _stage_experts(m, layout, stage)
    if not experts:
        return params, grads, optimizer, 0
    r = planner_moe.expert_replicas(layout)
    extra = (element_size * (math.ceil(experts / r) if zero >= 3 else experts),
             element_size * (math.ceil(experts / r) if zero >= 2 else experts),
             optimizer_bytes * (math.ceil(experts / r) if zero >= 1 else experts))
    return params + extra[0], grads + extra[1], optimizer + extra[2], sum(extra)


def memory(model, layout: Layout, seq_len: int | None = None, global_batch: int | None = None, *,
           element_size: int = 2, optimizer_bytes: int = 12, mask_size: int = 1, stage: int | None = None) -> dict:
    """Per-GPU bytes by category: ``{"parameters", "gradients", "optimizer", "activations",
    "total", "stage"}`` for ``stage`` (0 .. pp-1), or the stage with the largest total (the
    first or the last) when None. ``element_size``: bytes per parameter, gradient and activation
    value (2 for 16-bit training, 4 for the engine's float32); ``optimizer_bytes``: K per
    parameter (12: Adam in mixed precision, 8: float32 AdamW). ``global_batch`` sets m, the
    micro-batches per step (the in-flight count); without it m = pp. Formulas and sources: the
    module docstring. With experts (:mod:`minidist.planner_moe`) the candidates are every stage
    whose layers differ, and the dict adds ``"experts"``: the routed experts' parameter,
    gradient and optimizer bytes (within the three). A MoE layer's activations are counted as a
    dense layer's (Korthikanti's formula of h and a). Raises ValueError as :func:`check_layout`."""
    m = get_model(model)
    s = m.seq_len if seq_len is None else seq_len
    check_layout(m, layout, s, global_batch)
    if stage is None:
        stages = planner_moe.stage_candidates(m, layout.pp) if m.n_expert else sorted({0, layout.pp - 1})
        both = [memory(m, layout, s, global_batch, element_size=element_size, optimizer_bytes=optimizer_bytes,
                       mask_size=mask_size, stage=i) for i in stages]
        return max(both, key=lambda r: (r["total"], -r["stage"]))
    if not 0 <= stage < layout.pp:
        raise ValueError(f"stage must lie in 0 .. {layout.pp - 1}, got {stage}")
    d, t, p, b = layout.dp, layout.tp, layout.pp, layout.micro_batch
    params, grads, optimizer, experts = _model_state(m, layout, stage, element_size, optimizer_bytes)
    microbatches = p if global_batch is None else global_batch // (d * b)
    layer = activation_bytes_per_layer(m, s, b, t, layout.sequence_parallel, layout.recompute, element_size, mask_size)
    held = in_flight(layout, microbatches) if stage == 0 else min(p - stage, microbatches)
    layers = sum(planner_moe.layer_counts(m, p, stage)) if m.n_expert else m.layers // p
    activations = math.ceil(layers * held * layer)
    if layout.recompute == "full":  # one layer's activations while it is recomputed
        activations += activation_bytes_per_layer(m, s, b, t, layout.sequence_parallel, "none", element_size,
                                                  mask_size)
    split_sp = t if layout.sequence_parallel else 1
    if stage == 0:  # the embedding's dropout mask, per micro-batch in flight
        activations += math.ceil(mask_size * s * b * m.hidden / split_sp * in_flight(layout, microbatches))
    if stage == p - 1:  # the final norm's and the projection's inputs, the fp32 logits
        activations += math.ceil(2 * element_size * s * b * m.hidden / split_sp) + math.ceil(4 * s * b * m.vocab / t)
    total = params + grads + optimizer + activations
    result = {"parameters": params, "gradients": grads, "optimizer": optimizer, "activations": activations,
              "total": total, "stage": stage}
    if m.n_expert:
        result["experts"] = experts
    return result


def check_layout(model, layout: Layout, seq_len: int, global_batch: int | None = None) -> None:
    """Raise ValueError, naming the rule, when ``layout`` cannot run ``model``: t must divide the
    heads, p the layers, dp x micro_batch the global batch; interleaving needs p > 1, v p to
    divide the layers and m to be a multiple of p (Megatron-LM's rules); s must fit the model's
    learned positions. A model with experts may cut its layers unevenly (v = 1, p <= l:
    ``planner_moe.layer_counts``) and takes ep as ``planner_moe.check_experts`` says."""
    m = get_model(model)
    if m.heads % layout.tp:
        raise ValueError(f"tp={layout.tp} does not divide the {m.heads} attention heads")
    uneven = m.n_expert and layout.interleave == 1 and layout.pp <= m.layers
    if m.layers % (layout.pp * layout.interleave) and not uneven:
        note = " (with experts, pp <= layers and interleave 1 may cut them unevenly)" if m.n_expert else ""
        raise ValueError(f"pp={layout.pp} x interleave={layout.interleave} does not divide the {m.layers} layers{note}")
    planner_moe.check_experts(m, layout)
    if global_batch is not None and global_batch % (layout.dp * layout.micro_batch):
        raise ValueError(f"dp={layout.dp} x micro_batch={layout.micro_batch} does not divide the global batch "
                         f"{global_batch}")
    if layout.interleave > 1:
        microbatches = layout.pp if global_batch is None else global_batch // (layout.dp * layout.micro_batch)
        if layout.pp == 1 or microbatches % layout.pp:
            raise ValueError(f"interleave={layout.interleave} needs pp > 1 and a number of micro-batches "
                             f"({microbatches}) divisible by pp={layout.pp}")
    if m.learned_positions and seq_len > m.seq_len:
        raise ValueError(f"seq_len={seq_len} exceeds {m.name}'s {m.seq_len} learned positions; use --seq-len "
                         f"<= {m.seq_len}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")


# ----------------------------------------------------------------------------- step time


def model_flops(model, global_batch: int, seq_len: int | None = None) -> float:
    """FLOPs the model needs per step: (6 Psi + 12 l s h) per token, B s tokens (chapter 13;
    Narayanan et al.'s 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) when Psi = 12 l h^2 + V h). With
    experts Psi is the *active* parameters, and h in the scores' term ``score_width`` if given."""
    m = get_model(model)
    s = m.seq_len if seq_len is None else seq_len
    return global_batch * s * (6 * m.active_parameters + 12 * m.layers * s * (m.score_width or m.hidden))


def recompute_flops(model, global_batch: int, seq_len: int, recompute: str) -> float:
    """FLOPs recomputation adds per step: full, one more forward of the layers, (2 Psi_layers +
    4 l s h) per token; selective, attention's scores and their product with v, 4 l s h."""
    m = get_model(model)
    tokens, attention = global_batch * seq_len, 4 * m.layers * seq_len * (m.score_width or m.hidden)
    if recompute == "full" and m.n_expert:  # the layers' active parameters: all but embeddings, final norm
        return tokens * (2 * (m.active_parameters - m.embedding_parameters - m.norm_parameters) + attention)
    if recompute == "full":
        return tokens * (2 * m.layers * sum(m.layer_parameters()) + attention)
    return tokens * attention if recompute == "selective" else 0.0


def tp_bytes(model, layout: Layout, seq_len: int, global_batch: int, *, element_size: int = 2,
             byte_factor: float | None = None) -> tuple[float, float]:
    """``(messages, bytes)`` each GPU sends per step for TP: (l/p) layers x m micro-batches x 4
    all-reduces (6 with full recomputation) of b s h values, each ``byte_factor`` x its size
    (default the ring's 2(t-1)/t) in 2(t-1) messages. (0, 0) when t = 1."""
    m = get_model(model)
    t = layout.tp
    if t == 1:
        return 0.0, 0.0
    layers = planner_moe.ceil_div(m.layers, layout.pp) if m.n_expert else m.layers // layout.pp  # the busiest stage
    count = layers * global_batch // (layout.dp * layout.micro_batch)
    count *= 6 if layout.recompute == "full" else 4
    size = element_size * layout.micro_batch * seq_len * m.hidden
    factor = 2 * (t - 1) / t if byte_factor is None else byte_factor
    return count * 2 * (t - 1), count * factor * size


def pp_bytes(model, layout: Layout, seq_len: int, global_batch: int, *, element_size: int = 2) -> tuple[float, float]:
    """``(messages, bytes)`` the busiest GPU of a pipeline sends per step, messages of b s h / t
    values (Narayanan et al.'s scatter/gather): each of its v stages sends m activations forward
    and m gradients back, except the pipeline's first stage (no gradient to send back) and its
    last (no activation to send on). With p >= 3 a rank holding no end stage sends 2 v m; with
    p = 2 every rank holds one end, (2 v - 1) m. (0, 0) when p = 1."""
    m = get_model(model)
    if layout.pp == 1:
        return 0.0, 0.0
    microbatches = global_batch // (layout.dp * layout.micro_batch)
    v = layout.interleave
    count = (2 * v if layout.pp > 2 else 2 * v - 1) * microbatches
    return count, count * element_size * layout.micro_batch * seq_len * m.hidden / layout.tp


def dp_bytes(model, layout: Layout, *, element_size: int = 2, byte_factor: float | None = None) -> tuple[float, float]:
    """``(messages, bytes)`` each GPU sends per step for DP: its stage's gradients (the largest
    stage's, e bytes each), all-reduced: ``byte_factor`` x their bytes, default the ring's
    2(d-1)/d in 2(d-1) messages; ZeRO stage 3 sends 1.5 times that (3(d-1)/d: a reduce-scatter
    and two all-gathers). (0, 0) when d = 1. With experts, the routed experts' gradients are
    all-reduced over their r = dp / ep replicas only (2(r-1)/r, 2(r-1) messages more), the rest
    over d; the stage sending the most bytes counts."""
    m = get_model(model)
    d = layout.dp
    if d == 1:
        return 0.0, 0.0
    factor = 2 * (d - 1) / d if byte_factor is None else byte_factor
    scale = 1.5 if layout.zero_stage == 3 else 1.0
    if m.n_expert:
        return _dp_bytes_experts(m, layout, factor, scale, element_size, byte_factor)
    values = max(_stage_parameters(m, layout, i) for i in {0, layout.pp - 1})
    return 2 * (d - 1) * scale, factor * scale * element_size * values


def _dp_bytes_experts(m, layout, factor, scale, element_size, byte_factor) -> tuple[float, float]:
    """:func:`dp_bytes` of a model with experts: the non-expert gradients over d, the experts'
    over their r replicas, the stage with the most bytes."""
    r = planner_moe.expert_replicas(layout)
    expert_factor = (2 * (r - 1) / r if byte_factor is None else byte_factor) if r > 1 else 0.0
    sent = max(factor * _stage_parameters(m, layout, i) + expert_factor * _stage_experts(m, layout, i)
               for i in planner_moe.stage_candidates(m, layout.pp))
    messages = 2 * (layout.dp - 1) + (2 * (r - 1) if r > 1 else 0)
    return messages * scale, scale * element_size * sent


def step_time(model, layout: Layout, cluster: Cluster, global_batch: int, seq_len: int | None = None, *,
              element_size: int = 2) -> dict:
    """Seconds of one step by term: ``{"compute", "tp", "pp", "dp", "bubble", "total"}`` (and
    ``"ep"``, the experts' all-to-alls, ``planner_moe.all_to_all_bytes``, for a model with
    experts: on the link of the ep group's span t p ep, in the pipeline's bubble as TP is), plus
    ``"model_flops"``, ``"hardware_flops"`` (with recomputation), ``"mfu"`` (model FLOPs over
    total time x GPUs x peak) and ``"tflops_per_gpu"`` (hardware FLOPs per second and GPU, the
    figure Narayanan et al. report). Each communication term is messages x alpha + bytes / bandwidth
    on its link (:meth:`Cluster.link`). Raises ValueError when the layout does not use the
    cluster's GPUs or breaks a rule of :func:`check_layout`."""
    m = get_model(model)
    s = m.seq_len if seq_len is None else seq_len
    check_layout(m, layout, s, global_batch)
    if layout.gpus != cluster.gpus:
        raise ValueError(f"the layout uses dp x pp x tp = {layout.gpus} GPUs, the cluster has {cluster.gpus}")
    useful = model_flops(m, global_batch, s)
    hardware = useful + recompute_flops(m, global_batch, s, layout.recompute)
    compute = hardware / (cluster.gpus * cluster.peak_flops * cluster.mfu)
    t, p, d = layout.tp, layout.pp, layout.dp
    times = {"compute": compute}
    for name, (messages, nbytes), span in (
            ("tp", tp_bytes(m, layout, s, global_batch, element_size=element_size), t),
            ("pp", pp_bytes(m, layout, s, global_batch, element_size=element_size), t * p),
            ("dp", dp_bytes(m, layout, element_size=element_size), t * p * d)):
        link = cluster.link(span)
        times[name] = messages * link.alpha + nbytes * link.beta
    if m.n_expert:
        messages, nbytes = planner_moe.all_to_all_bytes(m, layout, s, global_batch, element_size=element_size)
        link = cluster.link(t * p * layout.ep)
        times["ep"] = messages * link.alpha + nbytes * link.beta
    microbatches = global_batch // (d * layout.micro_batch)
    critical = compute + times["tp"] + times["pp"] + (times["ep"] if m.n_expert else 0.0)
    times["bubble"] = (p - 1) / (layout.interleave * microbatches) * critical
    times["total"] = sum(times.values())
    times.update(model_flops=useful, hardware_flops=hardware,
                 mfu=useful / (times["total"] * cluster.gpus * cluster.peak_flops),
                 tflops_per_gpu=hardware / (times["total"] * cluster.gpus) / 1e12)
    return times


# ----------------------------------------------------------------------------- the search


@dataclass(frozen=True)
class Prediction:
    """One layout's predicted ``memory`` (bytes by category) and ``time`` (seconds by term)."""

    layout: Layout
    memory: dict
    time: dict


@dataclass
class Plan:
    """What :func:`plan` found: ``best`` (up to ``top`` predictions, fastest first), ``feasible``
    (how many layouts fit), ``rejected``: ``{reason: (count, an example Layout, its message)}``."""

    model: ModelSpec
    cluster: Cluster
    global_batch: int
    seq_len: int
    best: list = field(default_factory=list)
    feasible: int = 0
    rejected: dict = field(default_factory=dict)

    def reject(self, reason: str, layout: Layout, message: str, count: int = 1) -> None:
        """Count ``count`` layouts rejected for ``reason`` (the first one seen is the example)."""
        seen, example, first = self.rejected.get(reason, (0, layout, message))
        self.rejected[reason] = (seen + count, example, first)


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order, from the trials up to sqrt(n)."""
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return small + [n // k for k in reversed(small) if k * k != n]


def plan(model, cluster: Cluster, global_batch: int, seq_len: int | None = None, top: int = 5, *,
         micro_batches=(1, 2, 4, 8), zero_stages=(0, 1, 2, 3), recompute=RECOMPUTE, sequence_parallel=(False, True),
         interleave=(1,), allow_tp_across_nodes: bool = False, distinct: bool = True, element_size: int = 2,
         optimizer_bytes: int = 12, headroom: float = 0.0, expert_parallel=None) -> Plan:
    """Every layout of ``cluster.gpus`` = dp x pp x tp with the given options, ranked by
    :func:`step_time`; at equal time the simpler first: a lower ZeRO stage, less recomputation, no
    SP, then less memory. ``distinct``: only the first of each shape (dp, pp, tp, micro-batch, v)
    goes into ``best``, so that it shows different layouts. Skipped as redundant: ZeRO
    stages with dp = 1, sequence parallelism with tp = 1. Rejected, with a reason: tp not
    dividing the heads, pp the layers (x interleave), dp x micro-batch the global batch; TP
    across nodes (tp > gpus_per_node, unless ``allow_tp_across_nodes``); out of memory (by how
    much), a layout fitting only ``(1 - headroom)`` of each GPU's memory (the rest kept free for
    what the formulas leave out). A (dp, pp, tp) whose heads, layers or nodes rule out all its
    options is counted whole, without building them, so that a cluster of 10**9 GPUs is planned
    in seconds. With experts the search adds ep (``expert_parallel``, default: every divisor of dp
    up to E; :func:`_expert_degrees`). Raises ValueError for a batch or ``top`` < 1, a headroom
    outside [0, 1), an unknown model (the presets named), ``expert_parallel`` for a dense model."""
    m = get_model(model)
    s = m.seq_len if seq_len is None else seq_len
    if not (isinstance(global_batch, int) and global_batch >= 1) or not (isinstance(top, int) and top >= 1):
        raise ValueError(f"global_batch and top must be integers >= 1, got {global_batch!r} and {top!r}")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must lie in [0, 1), got {headroom!r}")
    check_layout(m, Layout(1, 1, 1), s)  # the sequence length
    result = Plan(m, cluster, global_batch, s)
    limit = cluster.gpu_memory * (1 - headroom)
    found = []
    for tp in _divisors(cluster.gpus):
        for pp in _divisors(cluster.gpus // tp):
            dp = cluster.gpus // (tp * pp)
            eps = _expert_degrees(m, dp, expert_parallel)
            options = _options(dp, pp, tp, micro_batches, zero_stages, recompute, sequence_parallel, interleave, eps)
            if _rejected_whole(result, m, s, pp, options):
                continue
            for layout in options:
                try:
                    check_layout(m, layout, s, global_batch)
                except ValueError as error:
                    result.reject(_reason(str(error)), layout, str(error))
                    continue
                if tp > cluster.gpus_per_node and not allow_tp_across_nodes:
                    result.reject("TP across nodes", layout, f"tp={tp} spans nodes of {cluster.gpus_per_node} GPUs")
                    continue
                need = memory(m, layout, s, global_batch, element_size=element_size, optimizer_bytes=optimizer_bytes)
                if need["total"] > limit:
                    over = (need["total"] - limit) / GiB
                    usable = " usable" if headroom else ""
                    result.reject("out of memory", layout, f"needs {need['total'] / GiB:.1f} GiB, {over:.1f} GiB "
                                                           f"over the {limit / GiB:.0f} GiB{usable}")
                    continue
                time = step_time(m, layout, cluster, global_batch, s, element_size=element_size)
                found.append(Prediction(layout, need, time))
    found.sort(key=lambda f: (f.time["total"], f.layout.zero_stage, RECOMPUTE.index(f.layout.recompute),
                              f.layout.sequence_parallel, f.memory["total"], str(f.layout)))
    result.feasible = len(found)
    if distinct:
        shapes = {}
        for f in found:
            shapes.setdefault(_shape(f.layout), f)
        found = list(shapes.values())
    result.best = found[:top]
    return result


def _options(dp, pp, tp, micro_batches, zero_stages, recompute, sequence_parallel, interleave, eps=(1,)) -> list:
    return [Layout(dp, pp, tp, b, zero, mode, sp, v, ep)
            for b in micro_batches for zero in (zero_stages if dp > 1 else (0,)) for mode in recompute
            for sp in (sequence_parallel if tp > 1 else (False,)) for v in (interleave if pp > 1 else (1,))
            for ep in eps]


def _shape(layout: Layout) -> tuple:
    """What :func:`plan`'s ``distinct`` keeps one layout of: (dp, pp, tp, micro-batch, v, ep)."""
    return layout.dp, layout.pp, layout.tp, layout.micro_batch, layout.interleave, layout.ep


def _expert_degrees(m: ModelSpec, dp: int, expert_parallel) -> tuple:
    """The ep degrees :func:`plan` tries with ``dp``: (1,) for a dense model; else those of
    ``expert_parallel`` (default: every divisor of dp up to E) that divide dp. Raises ValueError
    for ``expert_parallel`` given with a dense model."""
    if expert_parallel is not None and not m.n_expert:
        raise ValueError(f"expert_parallel={expert_parallel!r} needs a model with experts; {m.name} is dense")
    if not m.n_expert:
        return (1,)
    if expert_parallel is None:
        return tuple(ep for ep in _divisors(dp) if ep <= m.n_expert)
    return tuple(ep for ep in expert_parallel if dp % ep == 0)


def _rejected_whole(result: Plan, m, s, pp, options) -> bool:
    """Whether every layout of ``options`` (one dp, pp, tp) fails for one reason that does not
    depend on its other choices, the first :func:`check_layout` checks: tp not dividing the
    heads, pp (x every interleave) not dividing the layers. Then they are counted with the first
    as the example, and True."""
    if not options:
        return True
    first = options[0]
    try:  # the heads, then the layers of the first option (no global batch: that depends on mb)
        check_layout(m, first, s)
    except ValueError as error:
        reason = _reason(str(error))
        if reason == "tp does not divide the heads" or (reason == "pp does not divide the layers" and all(
                m.layers % (pp * v.interleave) for v in options)):
            result.reject(reason, first, str(error), len(options))
            return True
        return False
    return False


def _reason(message: str) -> str:
    for key, reason in (("heads", "tp does not divide the heads"), ("layers", "pp does not divide the layers"),
                        ("global batch", "dp x micro-batch does not divide the global batch"),
                        ("interleave", "interleaving: micro-batches not a multiple of pp"),
                        ("expert tensor", "ep with tp > 1 (not modelled)"),
                        ("routed experts", "ep more than the experts")):
        if key in message:
            return reason
    return message
