"""GPT: a decoder-only transformer language model, GPT-2's layout with nanoGPT's names (**contract**).

Radford et al., "Language Models are Unsupervised Multitask Learners" (GPT-2, 2019), on the
Transformer's decoder (Vaswani et al., "Attention Is All You Need", 2017). The parameter
names and shapes are those of Karpathy's nanoGPT ``model.py``, so a state dict maps one to
one onto it (and onto Hugging Face's GPT-2 after transposing its Conv1D weights)::

    transformer.wte.weight            (V, C)    token embedding, tied to lm_head.weight
    transformer.wpe.weight            (T, C)    position embedding (T = block_size)
    transformer.h.{i}.ln_1.{weight,bias}          (C,)
    transformer.h.{i}.attn.c_attn.{weight,bias}   (3C, C), (3C,)   q, k, v in one product
    transformer.h.{i}.attn.c_proj.{weight,bias}   (C, C), (C,)
    transformer.h.{i}.ln_2.{weight,bias}          (C,)
    transformer.h.{i}.mlp.c_fc.{weight,bias}      (4C, C), (4C,)
    transformer.h.{i}.mlp.c_proj.{weight,bias}    (C, 4C), (C,)
    transformer.ln_f.{weight,bias}                (C,)
    lm_head.weight                    (V, C)    the same Parameter as transformer.wte.weight

(no ``.bias`` entries with ``bias=False``). A block is pre-norm, GPT-2's change to the
original Transformer: x = x + attn(ln_1(x)); x = x + mlp(ln_2(x)); a final ln_f follows the
last block. Attention is causal (token t sees tokens 0..t), one fused op
(``nn.functional.scaled_dot_product_attention``); the MLP uses GPT-2's tanh GELU.

Inference with a KV cache (:mod:`minidist.models.kv_cache`): :meth:`GPT.forward_cached` runs new
tokens after the positions a cache holds (prefill: the prompt; decode: one token a step), each
attention layer storing its keys and values there and attending to all of them; ``generate`` uses
it by default (``use_cache=False`` recomputes the whole context every step, as nanoGPT does).

Initialisation (GPT-2, section 2.3, as nanoGPT): every Linear and Embedding weight
N(0, 0.02²), biases 0, LayerNorm weights 1; the two residual projections of each block
(``c_proj``) N(0, (0.02 / sqrt(2 · n_layer))²), so the residual stream's variance does not
grow with depth. Weight tying (Press & Wolf, "Using the Output Embedding to Improve Language
Models", 2017): the output layer reuses the token embedding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from minidist import backend, nn
from minidist import functions as F
from minidist.models.kv_cache import KVCache
from minidist.models.moe import MoE, check_experts
from minidist.tensor import Tensor, no_grad

INIT_STD = 0.02  # GPT-2's weight scale


@dataclass
class GPTConfig:
    """The sizes of a :class:`GPT` (nanoGPT's ``GPTConfig``, without defaults for the sizes).

    vocab_size V (token ids 0..V-1), block_size T (the longest context), n_layer blocks,
    n_head heads of n_embd // n_head channels each, n_embd the width C; dropout (in [0, 1))
    after the embeddings, on the attention weights and after each residual branch; bias:
    Linear and LayerNorm biases (False is nanoGPT's "a bit better and faster").

    Mixture of experts (:mod:`minidist.models.moe`): n_expert E > 0 puts an MoE layer of E MLPs in
    place of each block's MLP (0: dense, the GPT as it always was), each token using top_k of
    them, each expert taking at most ceil(capacity_factor · top_k · tokens / E) (None: no limit);
    aux_loss_coef: Switch's load-balancing α; bias_update_rate: DeepSeek-V3's γ (0: no bias).

    Raises ValueError for a size < 1 or not an int, n_embd not divisible by n_head (naming
    both), dropout outside [0, 1), or expert settings that do not fit (top_k outside [1, E]).
    """

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = True
    n_expert: int = 0
    top_k: int = 2
    capacity_factor: float | None = 1.25
    aux_loss_coef: float = 0.01
    bias_update_rate: float = 0.0

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"GPTConfig: {name} must be an int >= 1, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}): each "
                             f"head takes n_embd // n_head channels; pick n_head among the divisors of {self.n_embd}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"GPTConfig: dropout must be in [0, 1), got {self.dropout!r}")
        if self.n_expert:
            check_experts(self.n_expert, self.top_k, self.capacity_factor, self.aux_loss_coef, self.bias_update_rate)


def _seed(gen) -> int:
    """A seed for a layer's own generator (its Dropout), drawn from the model's."""
    return int(gen.integers(2**63))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: (B, T, C) -> (B, T, C).

    ``c_attn`` makes q, k, v at once (channels [0, C) are q, [C, 2C) k, [2C, 3C) v, each split
    into n_head heads of C / n_head channels); the heads attend with the fused causal
    ``scaled_dot_product_attention`` (dropout on the weights in training, drawn from
    ``attn_dropout.generator``); ``c_proj`` mixes the heads back. No Python loop over the
    batch or the heads: (B, H) are the batch axes of one matrix product.
    """

    def __init__(self, config: GPTConfig, *, rng, dtype, device):
        super().__init__()
        c = config.n_embd
        self.c_attn = nn.Linear(c, 3 * c, bias=config.bias, rng=rng, dtype=dtype, device=device)
        self.c_proj = nn.Linear(c, c, bias=config.bias, rng=rng, dtype=dtype, device=device)
        self.attn_dropout = nn.Dropout(config.dropout, rng=_seed(rng))
        self.resid_dropout = nn.Dropout(config.dropout, rng=_seed(rng))
        self.n_head, self.n_embd = config.n_head, c

    def forward(self, x, kv_cache=None, layer=0):
        """(B, T, C) -> (B, T, C). With ``kv_cache`` (inference only, no dropout), the keys and values
        of these T positions are stored in it as layer ``layer``'s and the queries attend to every
        position it holds (:func:`cached_attention`)."""
        b, t, c = x.shape
        qkv = self.c_attn(x).reshape(b, t, 3, self.n_head, c // self.n_head).transpose(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # each (B, H, T, C / H)
        if kv_cache is not None:
            y = cached_attention(kv_cache, layer, q, k, v)
        else:
            p = self.attn_dropout.p if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                               generator=self.attn_dropout.generator)
        y = y.transpose(0, 2, 1, 3).reshape(b, t, c)  # the heads side by side again
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """The block's feed-forward part: Linear C -> 4C, tanh GELU, Linear 4C -> C, dropout."""

    def __init__(self, config: GPTConfig, *, rng, dtype, device):
        super().__init__()
        c = config.n_embd
        self.c_fc = nn.Linear(c, 4 * c, bias=config.bias, rng=rng, dtype=dtype, device=device)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * c, c, bias=config.bias, rng=rng, dtype=dtype, device=device)
        self.dropout = nn.Dropout(config.dropout, rng=_seed(rng))

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-norm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x)); (B, T, C) -> same.
    With ``config.n_expert`` the mlp is a mixture of experts (:class:`~minidist.models.moe.MoE`)."""

    def __init__(self, config: GPTConfig, *, rng, dtype, device):
        super().__init__()
        layer = {"rng": rng, "dtype": dtype, "device": device}
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias, dtype=dtype, device=device)
        self.attn = CausalSelfAttention(config, **layer)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias, dtype=dtype, device=device)
        self.mlp = MoE(config, mlp_class=MLP, **layer) if config.n_expert else MLP(config, **layer)

    def forward(self, x, kv_cache=None, layer=0):
        x = x + (self.attn(self.ln_1(x)) if kv_cache is None else self.attn(self.ln_1(x), kv_cache, layer))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 (**contract**): token ids (B, T) -> next-token logits (B, T, V) and the loss.

    Args:
        config: a :class:`GPTConfig`.
        rng: int seed or ``numpy.random.Generator`` for the weights and the dropout
            generators (default: ``nn``'s default generator); the same seed gives the same model.
        dtype: parameter dtype ("float32", or "float64" for gradient checks).
        device: "cpu" or "cuda" (default ``$MINIDIST_DEVICE`` or cpu).

    ``lm_head.weight`` *is* ``transformer.wte.weight``: ``parameters()`` yields it once (under
    the embedding's name), ``state_dict()`` lists it under both names, as torch does.

    Raises TypeError when ``config`` is not a GPTConfig.
    """

    def __init__(self, config: GPTConfig, *, rng=None, dtype="float32", device=None):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"GPT: config must be a GPTConfig, got {type(config).__name__}")
        gen = nn.as_generator(rng)
        layer = {"rng": gen, "dtype": dtype, "device": device}
        self.config = config
        self.transformer = nn.ModuleDict(
            wte=nn.Embedding(config.vocab_size, config.n_embd, **layer),
            wpe=nn.Embedding(config.block_size, config.n_embd, **layer),
            drop=nn.Dropout(config.dropout, rng=_seed(gen)),
            h=nn.ModuleList(Block(config, **layer) for _ in range(config.n_layer)),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias, dtype=dtype, device=device),
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False, **layer)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying
        self._init_weights(gen)

    def _init_weights(self, gen):
        """GPT-2's initialisation (module docstring), drawn in ``named_parameters`` order."""
        residual_std = INIT_STD / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            xp = backend.get_array_module(p.data)
            if name.endswith(".bias"):
                p.data = xp.zeros_like(p.data)
            elif name.endswith(".weight") and p.ndim == 2:  # Linear and Embedding weights
                std = residual_std if name.endswith("c_proj.weight") else INIT_STD
                p.data = xp.asarray((gen.standard_normal(p.shape) * std).astype(p.dtype))

    def _token_ids(self, idx, name="idx"):
        """``idx`` as an integer array on the model's device, checked against the config."""
        ids = idx.data if isinstance(idx, Tensor) else idx
        if backend.device_of(ids) == "cpu":  # a list, a NumPy array
            ids = np.asarray(ids)
        ids = backend.to_device(ids, self.transformer.wte.weight.device)
        if ids.ndim != 2 or ids.dtype.kind not in "iu":
            raise ValueError(f"GPT: {name} must be an integer array of shape (B, T), got shape {ids.shape}, dtype "
                             f"{ids.dtype}")
        return ids

    def _trunk(self, idx, kv_cache=None):
        """The blocks: token ids (B, T) -> the final LayerNorm's output (B, T, C); with
        ``kv_cache``, the T positions after those it holds (:meth:`forward_cached`)."""
        ids = self._token_ids(idx)
        b, t = ids.shape
        vocab, block = self.config.vocab_size, self.config.block_size
        if t > block:
            raise ValueError(f"GPT: a sequence of length {t} is longer than block_size = {block}; "
                             f"crop the context to its last {block} tokens (generate does)")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(f"GPT: token ids must be in [0, vocab_size = {vocab}); got values from "
                             f"{int(ids.min())} to {int(ids.max())}")
        xp = backend.get_array_module(ids)
        positions = xp.arange(t) if kv_cache is None else self._cache_positions(kv_cache, t, ids)
        x = self.transformer.wte(ids) + self.transformer.wpe(positions)  # (B, T, C) + (T, C) or (B, T, C)
        x = self.transformer.drop(x)
        for layer, block_ in enumerate(self.transformer.h):
            x = block_(x) if kv_cache is None else block_(x, kv_cache, layer)
        if kv_cache is not None:
            kv_cache.advance()
        return self.transformer.ln_f(x)

    def _cache_positions(self, kv_cache, t, ids):
        """The positions of ``kv_cache``'s next t tokens on the ids' device, checked against
        block_size (the position embedding has no row beyond it)."""
        positions = kv_cache.reserve(t)
        last, block = int(np.max(backend.to_numpy(positions))) if t else -1, self.config.block_size
        if last >= block:
            raise ValueError(f"GPT: with the KV cache, position {last} is past block_size = {block} (the position "
                             f"embedding has {block} rows); stop at {block} positions, or recompute the last "
                             f"{block} tokens without the cache (generate(use_cache=False) crops the context)")
        return backend.to_device(positions, backend.device_of(ids))

    def forward(self, idx, targets=None):
        """Logits and loss (nanoGPT's ``GPT.forward``).

        Args:
            idx: integer token ids (B, T), an array or Tensor, 1 <= T <= block_size.
            targets: integer ids (B, T) of the next tokens, or None; -1 marks a position left
                out of the loss (nanoGPT's ``ignore_index=-1``).

        Returns:
            ``(logits, loss)``: logits (B, T, V) in the parameters' dtype; loss the mean
            cross-entropy over the B·T positions (a scalar Tensor), or None without targets.

        Raises:
            ValueError: idx not (B, T) integers, T > block_size, an id outside
                [0, vocab_size), targets of another shape or out of range.
        """
        x = self._trunk(idx)
        logits = self.lm_head(x)
        if targets is None:
            return logits, None
        b, t, v = logits.shape
        target_ids = self._target_ids(targets, b, t)
        return logits, F.cross_entropy(logits.reshape(b * t, v), target_ids.reshape(-1), ignore_index=-1)

    def forward_cached(self, idx, kv_cache):
        """The next-token logits of ``idx``, the tokens that follow the positions ``kv_cache``
        holds, storing their keys and values in it (inference: no graph is recorded).

        Prefill is a call on the prompt with an empty cache; decode a call on one token per
        sequence. Each layer attends to the cache's positions and the new ones (causally); the
        logits equal those of ``forward`` on the whole sequence at the same positions, to float
        rounding (1e-12 in float64), with far less work: the earlier positions are not run again.

        Args:
            idx: integer ids (B, t), t >= 1.
            kv_cache: a :class:`~minidist.models.kv_cache.KVCache` (or any object with its
                ``reserve``/``attend``/``advance``, such as a paged cache's batch).

        Returns the logits (B, V) of each row's last position, a Tensor in the parameters' dtype
        (on a tensor-parallel model, this rank's vocabulary columns).

        Raises ValueError as ``forward``, and when the cache is full or a position would pass
        block_size (naming the fix).
        """
        with no_grad():
            return self.lm_head(self._trunk(idx, kv_cache)[:, -1, :])

    def _target_ids(self, targets, b, t):
        """``targets`` as integer ids of shape (b, t) on the model's device, checked."""
        target_ids = self._token_ids(targets, "targets")
        if target_ids.shape != (b, t):
            raise ValueError(f"GPT: targets must have the shape of idx, ({b}, {t}); got {target_ids.shape}")
        return target_ids

    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, rng=None, use_cache=True):
        """Sample ``max_new_tokens`` tokens after ``idx``, one at a time (nanoGPT's ``generate``).

        Each step runs the model on the last ``block_size`` tokens (the context is cropped),
        divides the last position's logits by ``temperature``, keeps the ``top_k`` largest
        (None: all), and draws the next token from their softmax with ``rng`` (an int seed or
        a Generator; None: ``nn``'s default generator): the same seed gives the same text.
        No graph is recorded. For ``dropout > 0`` call ``model.eval()`` first, as in nanoGPT.

        ``use_cache`` (Hugging Face's name; the CLI's ``--no-kv-cache`` sets it False): with the
        KV cache the prompt is run once (prefill) and each step runs the new token only (decode),
        the same logits as recomputing to float rounding. Once the sequence is longer than
        block_size the cropped context starts at another position each step, so the cached
        keys (made at their old positions) no longer apply: from there on every step recomputes
        the last block_size tokens, as without the cache (nanoGPT's crop, the same tokens).

        Args:
            idx: integer ids (B, T0), T0 >= 1.
            max_new_tokens: int >= 0.
            temperature: > 0; lower is greedier.
            top_k: None or an int >= 1 (values above V act as V).

        Returns a NumPy int64 array (B, T0 + max_new_tokens) that starts with ``idx``.

        Raises ValueError for a bad argument or ids (as ``forward``).
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
            raise ValueError(f"generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if not temperature > 0:
            raise ValueError(f"generate: temperature must be > 0, got {temperature!r} (greedy decoding: top_k=1)")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1):
            raise ValueError(f"generate: top_k must be None or an int >= 1, got {top_k!r}")
        gen = nn.as_generator(rng)
        ids = backend.to_numpy(self._token_ids(idx)).astype(np.int64)
        block = self.config.block_size
        cache = KVCache(min(block, ids.shape[1] + max_new_tokens)) if use_cache else None
        with no_grad():
            for _ in range(max_new_tokens):
                if cache is not None and ids.shape[1] <= block:  # the cache holds ids[:, :cache.length]
                    last = self.forward_cached(ids[:, cache.length:], cache)
                else:  # no cache, or past block_size: the last block_size tokens, recomputed
                    last = self.lm_head(self._trunk(ids[:, -block:])[:, -1, :])
                logits = backend.to_numpy(last.data).astype(np.float64) / temperature
                ids = np.concatenate([ids, sample_next(logits, top_k, gen)[:, None]], axis=1)
        return ids

    def num_params(self, non_embedding=True) -> int:
        """The number of parameters, each counted once (the tied ``lm_head.weight`` is the
        token embedding). ``non_embedding=True`` (nanoGPT's default and convention, as in the
        scaling-law papers) leaves out the position embeddings ``wpe``; the token embeddings
        stay in, because as ``lm_head`` they are the last layer's weights."""
        total = self.num_parameters()
        return total - self.transformer.wpe.weight.size if non_embedding else total


def cached_attention(kv_cache, layer, q, k, v) -> Tensor:
    """The attention of q (B, H, t, d) Tensors with a KV cache: k and v stored as ``layer``'s
    next positions, q attending to every position held (``kv_cache.attend``, on raw arrays).
    Returns a Tensor (B, H, t, d) outside any graph: inference only (GPT.forward_cached runs
    under no_grad)."""
    return Tensor(kv_cache.attend(layer, q.data, k.data, v.data))


def sample_next(logits, top_k, gen) -> np.ndarray:
    """One token id per row of ``logits`` (B, V) (float64, NumPy): keep the ``top_k`` largest
    (None: all), softmax, and invert the cumulative distribution at one uniform draw per row
    from ``gen``. Returns int64 (B,)."""
    if top_k is not None and top_k < logits.shape[1]:
        kth = np.partition(logits, -top_k, axis=1)[:, -top_k:].min(axis=1, keepdims=True)
        logits = np.where(logits < kth, -np.inf, logits)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    cdf = np.cumsum(probs, axis=1)
    u = gen.random((logits.shape[0], 1)) * cdf[:, -1:]
    return np.minimum((cdf <= u).sum(axis=1), logits.shape[1] - 1).astype(np.int64)
