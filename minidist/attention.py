"""The transformer's ops: softmax, scaled dot-product attention (dense, and tiled: flash),
LayerNorm, GELU, embedding.

Longer than 400 lines: attention's three forms (dense, its block steps, the tiled op built
from them) belong together, beside the other fused ops of the block they are part of.

Each is a :class:`~minidist.tensor.Function` with its forward beside its derivative, on raw
arrays, like the ops of :mod:`minidist.functions`. They are *fused*: one node of the graph
per layer, saving only what the derivative needs, instead of a chain of small ops that
would each keep its own input alive (a composed LayerNorm keeps five arrays the size of
its input; this one keeps the input and two numbers per row). The public functions that
check shapes and call them (``softmax``, ``scaled_dot_product_attention``, ``layer_norm``,
``gelu``, ``embedding``) live in :mod:`minidist.functions`, which is ``nn.functional``;
this file imports nothing from it, so the arrow points one way. The tiled op's public
function, :func:`flash_attention`, is the exception: it lives here and checks its own shapes.

Sources: the Transformer (Vaswani et al., "Attention Is All You Need", NeurIPS 2017);
LayerNorm (Ba, Kiros & Hinton, "Layer Normalization", 2016), with the backward written as
in Karpathy's llm.c ``doc/layernorm``; GELU (Hendrycks & Gimpel, "Gaussian Error Linear
Units", 2016); FlashAttention (Dao et al., NeurIPS 2022) and FlashAttention-2 (Dao 2023) for
the tiled op; the API is PyTorch's ``torch.nn.functional``.
"""
from __future__ import annotations

import math

import numpy

from minidist import backend
from minidist.tensor import Function, Tensor, as_tensors

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
GELU_CUBIC = 0.044715  # the cubic term of GELU's tanh approximation (Hendrycks & Gimpel, section 2)

# NumPy has no erf. math.erf is the C library's erf (correctly rounded to within an ulp, the
# function torch calls too), vectorised here: a Python call per element, about 60 ns, paid
# only by GELU(approximate="none"). CuPy ships its own elementwise erf in
# cupyx.scipy.special (part of CuPy, no SciPy needed), used on the GPU.
_numpy_erf = numpy.vectorize(math.erf, otypes=[numpy.float64])


def erf(x):
    """The error function, elementwise, for a NumPy or CuPy float array; same dtype out."""
    xp = backend.get_array_module(x)
    if xp is numpy:
        return _numpy_erf(x).astype(x.dtype, copy=False)
    from cupyx.scipy.special import erf as cupy_erf  # noqa: PLC0415 (optional dependency, with cupy)

    return cupy_erf(x)


# ---------------------------------------------------------------- softmax


class Softmax(Function):
    """softmax(a) = exp(a - max) / Σ exp(a - max) along ``axis`` (shifting by the row's
    maximum changes nothing mathematically and keeps exp from overflowing).
    Backward, with s the output: ds/da applied to g is s · (g - Σ g·s)."""

    @staticmethod
    def forward(ctx, a, axis=-1):
        xp = backend.get_array_module(a)
        out = a - a.max(axis=axis, keepdims=True)
        xp.exp(out, out=out)
        out /= out.sum(axis=axis, keepdims=True)
        ctx.save_for_backward(out)
        ctx.axis = axis
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved
        return (out * (grad - (grad * out).sum(axis=ctx.axis, keepdims=True)),)


# ---------------------------------------------------------------- attention


class ScaledDotProductAttention(Function):
    """softmax(q kᵀ · scale + mask) v, one op (Vaswani et al. 2017, eq. 1).

    q (..., T, d), k (..., S, d), v (..., S, e) with the same leading axes; out (..., T, e).
    Options: ``scale`` (a float, 1/sqrt(d) by default in the caller), ``is_causal`` (query i
    sees keys j <= i: the upper triangle set to -inf *before* the softmax, so those weights
    are exactly 0), ``mask`` (a boolean array, True = may attend, or a float array added to
    the scores; broadcast to (..., T, S)), ``keep`` (dropout on the weights: an array of 0
    and 1/(1-p), or None).

    Cost: the scores are a (..., T, S) array; the fused op keeps only the weights P (one
    such array) for backward, where the composed ops would keep the scores, the scaled and
    masked scores and the weights (three or four). Backward, with dO the output's gradient:
    dV = Pᵀ dO, dP = dO Vᵀ, dS = P ⊙ (dP - rowsum(dP ⊙ P)) (softmax's derivative),
    dQ = scale · dS K, dK = scale · dSᵀ Q. Masked weights are 0, so their dS is 0.
    """

    @staticmethod
    def forward(ctx, q, k, v, *, scale, is_causal=False, mask=None, keep=None):
        xp = backend.get_array_module(q)
        scores = q @ xp.swapaxes(k, -1, -2)
        scores *= scale
        if is_causal:  # torch's is_causal: row i keeps columns 0..i (top-left aligned)
            upper = xp.triu(xp.ones(scores.shape[-2:], dtype=bool), k=1)
            xp.copyto(scores, -xp.inf, where=upper)
        if mask is not None:
            if mask.dtype == bool:
                xp.copyto(scores, -xp.inf, where=~mask)
            else:
                scores += mask
        weights = scores  # softmax in place: the scores are not needed again
        weights -= weights.max(axis=-1, keepdims=True)
        xp.exp(weights, out=weights)
        weights /= weights.sum(axis=-1, keepdims=True)
        ctx.save_for_backward(q, k, v, weights, keep)
        ctx.scale = scale
        return (weights if keep is None else weights * keep) @ v

    @staticmethod
    def backward(ctx, grad):
        q, k, v, weights, keep = ctx.saved
        xp = backend.get_array_module(grad)
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        grad_v = None
        if need_v:
            dropped = weights if keep is None else weights * keep
            grad_v = xp.swapaxes(dropped, -1, -2) @ grad
        if not (need_q or need_k):
            return None, None, grad_v
        d_weights = grad @ xp.swapaxes(v, -1, -2)
        if keep is not None:
            d_weights *= keep
        d_weights -= (d_weights * weights).sum(axis=-1, keepdims=True)
        d_weights *= weights
        d_weights *= ctx.scale  # now dLoss/d(q kᵀ)
        grad_q = d_weights @ k if need_q else None
        grad_k = xp.swapaxes(d_weights, -1, -2) @ q if need_k else None
        return grad_q, grad_k, grad_v


# ---------------------------------------------------------------- attention by blocks
# The three steps every tiled or distributed attention is made of (FlashAttention-2, Dao 2023,
# Algorithms 1 and 2; Ring Attention, Liu et al. 2023): attend to one block of keys, merge two
# partial results, and the backward of one block given the final row statistics. They work on
# raw arrays; the tiled op and the context-parallel wing put them in their own order.


def causal_mask(q_positions, k_positions):
    """Which keys each query may see under causal attention: a bool array (Tq, Tk), True
    where the key's position is <= the query's. The positions are 1-D integer arrays (the
    tokens' places in the whole sequence), so a shard that holds non-adjacent chunks (zig-zag)
    gets its true mask."""
    xp = backend.get_array_module(q_positions)
    return xp.asarray(k_positions)[None, :] <= xp.asarray(q_positions)[:, None]


def attention_block(q, k, v, scale, mask=None):
    """Attention of queries to one block of keys, normalised within the block, with its
    log-sum-exp: the partial result that :func:`merge_attention` combines.

    q (..., Tq, d), k (..., Tk, d), v (..., Tk, e) arrays of one float dtype; ``mask`` None or
    a bool array broadcastable to (Tq, Tk), True where a query may see a key. Returns
    ``(o, lse)``: o (..., Tq, e) = softmax over this block's keys times v, and lse (..., Tq) =
    log Σ_j exp(scale · q·k_j) over the allowed keys. A row that may see no key of the block
    gets o = 0 and lse = -inf, so it adds nothing when merged (the off-diagonal blocks of a
    causal mask above the diagonal are such rows). Memory: one (..., Tq, Tk) array.
    """
    xp = backend.get_array_module(q)
    scores = q @ xp.swapaxes(k, -1, -2)
    scores *= scale
    if mask is not None:
        xp.copyto(scores, -xp.inf, where=~xp.broadcast_to(mask, scores.shape))
    row_max = scores.max(axis=-1, keepdims=True)
    row_max = xp.where(xp.isfinite(row_max), row_max, 0.0)  # an empty row: exp(-inf - 0) = 0
    scores -= row_max
    xp.exp(scores, out=scores)
    row_sum = scores.sum(axis=-1, keepdims=True)
    o = scores @ v
    o /= xp.where(row_sum > 0, row_sum, 1.0)
    with numpy.errstate(divide="ignore"):  # log 0 = -inf for an empty row, on purpose
        lse = (row_max + xp.log(row_sum))[..., 0]
    return o, lse


def merge_attention(o_a, lse_a, o_b, lse_b):
    """Two partial results over disjoint blocks of keys merged into the result over both:
    lse = logaddexp(lse_a, lse_b), o = exp(lse_a - lse) · o_a + exp(lse_b - lse) · o_b (the
    online softmax's rescaling, written with log-sum-exps so nothing overflows). Shapes as
    :func:`attention_block` returns them; rows empty in both stay o = 0, lse = -inf."""
    xp = backend.get_array_module(o_a)
    lse = xp.logaddexp(lse_a, lse_b)
    base = xp.where(xp.isfinite(lse), lse, 0.0)
    o = xp.exp(lse_a - base)[..., None] * o_a
    o += xp.exp(lse_b - base)[..., None] * o_b
    return o, lse


def attention_block_backward(q, k, v, do, lse, delta, scale, mask=None):
    """The gradients one block of keys contributes, given the *final* row statistics
    (FlashAttention-2, Algorithm 2): P = exp(scale · q kᵀ - lse) is the block's share of the
    full softmax, dV = Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP - delta), dQ = scale · dS K,
    dK = scale · dSᵀ Q, where delta = rowsum(dO ∘ O) with O the final output (so softmax's
    derivative needs no row of P from the other blocks).

    q (..., Tq, d), k (..., Tk, d), v (..., Tk, e), do (..., Tq, e), lse and delta (..., Tq),
    ``mask`` as in :func:`attention_block`. Returns ``(dq, dk, dv)``: dq is this block's *part*
    of q's gradient (sum it over the blocks), dk and dv the block's whole gradient from these
    queries. Memory: one (..., Tq, Tk) array, twice.
    """
    xp = backend.get_array_module(q)
    p = q @ xp.swapaxes(k, -1, -2)
    p *= scale
    p -= xp.where(xp.isfinite(lse), lse, 0.0)[..., None]
    if mask is not None:
        xp.copyto(p, -xp.inf, where=~xp.broadcast_to(mask, p.shape))
    xp.exp(p, out=p)
    dv = xp.swapaxes(p, -1, -2) @ do
    ds = do @ xp.swapaxes(v, -1, -2)
    ds -= delta[..., None]
    ds *= p
    ds *= scale
    return ds @ k, xp.swapaxes(ds, -1, -2) @ q, dv


# ---------------------------------------------------------------- tiled (flash) attention
# FlashAttention (Dao, Fu, Ermon, Rudra & Ré, "FlashAttention: Fast and Memory-Efficient Exact
# Attention with IO-Awareness", NeurIPS 2022) computes attention tile by tile, so the (T, S)
# scores never exist whole; FlashAttention-2 (Dao, "FlashAttention-2: Faster Attention with
# Better Parallelism and Work Partitioning", 2023) orders the loops as here.
#
# Forward (FlashAttention-2, Algorithm 1): for each tile of queries, walk the tiles of keys.
# Each key tile gives a partial result normalised within the tile (attention_block: its
# output and log-sum-exp), merged into the running one (merge_attention). This is the online
# softmax: Algorithm 1 carries the running max m and sum l and rescales O by exp(m - m') when
# a tile raises the max; here m and l travel together as lse = m + log l, the form the merge
# of two ranks' results needs too (Ring Attention, Liu et al. 2023). Saved for backward: q, k,
# v, the output O and lse, (..., T) numbers: O(T·d) in all, no (T, S) array.
#
# Backward (Algorithm 2): D = rowsum(dO ∘ O) once (flash-attention's
# csrc/flash_attn/src/flash_bwd_preprocess_kernel.h computes it the same way, before the main
# loop); then for each key tile (outer) and query tile (inner), P = exp(scale · q kᵀ - lse) is
# recomputed from the final lse (attention_block_backward), dK and dV of the key tile gather
# the query tiles' contributions and dQ of each query tile those of the key tiles.
#
# Causal (top-left aligned, as the dense op and torch): a key tile that starts after the last
# query of a query tile is entirely masked and is skipped, never computed (flash-attention's
# csrc/flash_attn/src/flash_fwd_kernel.h stops its key loop at n_block_max for this reason);
# only the tiles that cross the diagonal build a mask. For T = S that skips about half the
# tile pairs, so the tiled op does about half the dense op's matrix products forward.
#
# Cost against the dense op: forward the same products (halved when causal), backward one
# product more per tile pair (P recomputed), and a Python loop over tile pairs; memory held
# for backward O(T·d) instead of O(T·S), plus one (..., Br, Bc) temporary per tile pair.

FLASH_BLOCK_SIZE = 128  # rows of a query tile and of a key tile; measured in benchmarks/bench_attention.py


def tile_pairs(n_queries, n_keys, block_size, is_causal, *, keys_outer=False, xp=numpy, q_positions=None,
               k_positions=None):
    """The (query tile, key tile, mask) triples a tiled attention visits, in order.

    Tiles are slices of ``block_size`` positions (the last one shorter). Query tiles are the
    outer loop (forward, Algorithm 1) or, with ``keys_outer``, key tiles are (backward,
    Algorithm 2). Under ``is_causal`` a pair where no query sees any key is left out, and the
    mask is the tile's bool :func:`causal_mask` where the tile crosses the diagonal, None where
    every query sees every key (always None without ``is_causal``). ``q_positions`` and
    ``k_positions`` (1-D integer arrays, default 0, 1, ...) are the tokens' places in the whole
    sequence, ascending within a tile's run: a context-parallel rank's queries and keys are not
    at 0 .. T-1. ``xp``: the array module of the masks.
    """
    q_pos = xp.arange(n_queries) if q_positions is None else q_positions
    k_pos = xp.arange(n_keys) if k_positions is None else k_positions
    query_tiles = [slice(i, min(i + block_size, n_queries)) for i in range(0, n_queries, block_size)]
    key_tiles = [slice(j, min(j + block_size, n_keys)) for j in range(0, n_keys, block_size)]
    pairs = ([(rows, cols) for cols in key_tiles for rows in query_tiles] if keys_outer
             else [(rows, cols) for rows in query_tiles for cols in key_tiles])
    for rows, cols in pairs:
        mask = None
        if is_causal:
            q_tile, k_tile = q_pos[rows], k_pos[cols]
            if int(k_tile.min()) > int(q_tile.max()):
                continue  # above the diagonal: every key comes after every query of the tile
            if int(k_tile.max()) > int(q_tile.min()):  # the tile crosses the diagonal
                mask = causal_mask(q_tile, k_tile)
        yield rows, cols, mask


def tiled_attention(q, k, v, scale, is_causal=False, block_size=FLASH_BLOCK_SIZE, q_positions=None,
                    k_positions=None):
    """FlashAttention-2's forward (Algorithm 1) on raw arrays: ``(o, lse)``, o (..., T, e) the
    output and lse (..., T) the log-sum-exp of each query's scores, built tile by tile with the
    online softmax (:func:`attention_block`, :func:`merge_attention`); nothing of size T x S is
    ever held. Arguments as :class:`FlashAttention` and :func:`tile_pairs` take them (positions
    for a causal mask of a sequence's pieces). A query that sees no key gets o = 0, lse = -inf."""
    xp = backend.get_array_module(q)
    dtype = xp.result_type(q, k, v)
    out = xp.zeros(q.shape[:-1] + v.shape[-1:], dtype=dtype)
    lse = xp.full(q.shape[:-1], -xp.inf, dtype=dtype)
    started = set()  # query tiles that have their first key tile
    for rows, cols, mask in tile_pairs(q.shape[-2], k.shape[-2], block_size, is_causal, xp=xp,
                                       q_positions=q_positions, k_positions=k_positions):
        o_b, lse_b = attention_block(q[..., rows, :], k[..., cols, :], v[..., cols, :], scale, mask)
        if rows.start not in started:  # the first key tile of these queries: start the running result
            started.add(rows.start)
            out[..., rows, :], lse[..., rows] = o_b, lse_b
        else:  # the online softmax's step: rescale and add (merge_attention)
            out[..., rows, :], lse[..., rows] = merge_attention(out[..., rows, :], lse[..., rows], o_b, lse_b)
    return out, lse


def tiled_attention_backward(q, k, v, out, lse, grad, scale, is_causal=False, block_size=FLASH_BLOCK_SIZE,
                             q_positions=None, k_positions=None):
    """FlashAttention-2's backward (Algorithm 2) on raw arrays: ``(dq, dk, dv)`` from the
    forward's ``out`` and ``lse`` and the output's gradient ``grad``: D = rowsum(dO ∘ O) once,
    then P recomputed tile by tile from lse (:func:`attention_block_backward`), key tiles
    outer. Arguments as :func:`tiled_attention`'s."""
    xp = backend.get_array_module(grad)
    delta = (grad * out).sum(axis=-1)  # D = rowsum(dO ∘ O) (Algorithm 2, line 4)
    grad_q, grad_k, grad_v = xp.zeros_like(q), xp.zeros_like(k), xp.zeros_like(v)
    for rows, cols, mask in tile_pairs(q.shape[-2], k.shape[-2], block_size, is_causal, keys_outer=True, xp=xp,
                                       q_positions=q_positions, k_positions=k_positions):
        dq, dk, dv = attention_block_backward(q[..., rows, :], k[..., cols, :], v[..., cols, :], grad[..., rows, :],
                                              lse[..., rows], delta[..., rows], scale, mask)
        grad_q[..., rows, :] += dq
        grad_k[..., cols, :] += dk
        grad_v[..., cols, :] += dv
    return grad_q, grad_k, grad_v


class FlashAttention(Function):
    """softmax(q kᵀ · scale) v computed by tiles, saving O and the log-sum-exp only
    (FlashAttention-2, Dao 2023, Algorithms 1 and 2; the comment above says how).

    q (..., T, d), k (..., S, d), v (..., S, e), one float dtype, the same leading axes; out
    (..., T, e). Options: ``scale`` (a float), ``is_causal`` (query i sees keys 0..i, as the
    dense op), ``block_size`` (positions per tile, >= 1). Equal to
    :class:`ScaledDotProductAttention` up to rounding: the same sums, in another order.
    Forward and backward are :func:`tiled_attention` and :func:`tiled_attention_backward`.
    """

    @staticmethod
    def forward(ctx, q, k, v, *, scale, is_causal=False, block_size=FLASH_BLOCK_SIZE):
        out, lse = tiled_attention(q, k, v, scale, is_causal, block_size)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.is_causal, ctx.block_size = scale, is_causal, block_size
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved
        return tiled_attention_backward(q, k, v, out, lse, grad, ctx.scale, ctx.is_causal, ctx.block_size)


def flash_attention(q, k, v, is_causal=False, scale=None, block_size=FLASH_BLOCK_SIZE) -> Tensor:
    """Scaled dot-product attention by tiles (FlashAttention, Dao et al. 2022; FlashAttention-2,
    Dao 2023): the same result as ``functions.scaled_dot_product_attention`` without a mask or
    dropout, with O(T·d) memory held for backward instead of the (T, S) weights.

    Args:
        q: (B, H, T, d) float Tensor (a raw array is taken as a constant).
        k: (B, H, S, d); v: (B, H, S, e); the same dtype as q.
        is_causal: query i attends to keys 0..i only (top-left aligned, as torch); key tiles
            wholly above the diagonal are skipped.
        scale: multiplies the scores; default 1/sqrt(d).
        block_size: positions per query tile and per key tile (an int >= 1); T and S need not
            be multiples of it, and it may exceed them (one tile).

    Returns (B, H, T, e), differentiable in q, k and v (:class:`FlashAttention`).

    Raises:
        ValueError: inputs not 4-D, B or H that differ, d or S that disagree, T or S of 0;
            ``block_size`` not a positive int.
        TypeError: non-float inputs, or dtypes that differ.
    """
    q, k, v = as_tensors((q, k, v))
    if not q.ndim == k.ndim == v.ndim == 4 or not q.shape[:2] == k.shape[:2] == v.shape[:2]:
        raise ValueError(f"flash_attention: q {q.shape}, k {k.shape} and v {v.shape} must be (B, H, T, d), "
                         "(B, H, S, d) and (B, H, S, e) with the same B and H; split the heads first")
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise ValueError(f"flash_attention: q {q.shape} and k {k.shape} need the same d, k and v {v.shape} the same S")
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        raise ValueError(f"flash_attention: T and S must be >= 1, got q {q.shape} and k {k.shape}")
    if isinstance(block_size, bool) or not isinstance(block_size, (int, numpy.integer)) or block_size < 1:
        raise ValueError(f"flash_attention: block_size must be an int >= 1, got {block_size!r}")
    dtypes = {t.dtype for t in (q, k, v)}
    if len(dtypes) != 1 or not numpy.issubdtype(q.dtype, numpy.floating):
        raise TypeError(f"flash_attention: q, k and v must share one float dtype, got "
                        f"{', '.join(str(t.dtype) for t in (q, k, v))}; cast them to one float dtype first")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return FlashAttention.apply(q, k, v, scale=scale, is_causal=bool(is_causal), block_size=int(block_size))


# ---------------------------------------------------------------- normalisation


class LayerNorm(Function):
    """Layer normalisation over the last ``ndim`` axes (Ba et al. 2016):
    y = (x - mean) · rstd · weight + bias, rstd = 1 / sqrt(var + eps), var the biased
    variance (divided by the count, as PyTorch).

    Saves x, the weight and, per row, mean and rstd (llm.c's choice: two numbers per row
    instead of the normalised copy of x). Backward (llm.c ``doc/layernorm``), with
    n = (x - mean) · rstd recomputed and dn = dy · weight:
    dx = rstd · (dn - mean(dn) - n · mean(dn · n)), dweight = Σ dy · n, dbias = Σ dy
    (the sums over the leading axes, the means over the normalised ones).
    ``weight``/``bias`` may be None (no affine part).
    """

    @staticmethod
    def forward(ctx, x, weight=None, bias=None, *, ndim=1, eps=1e-5):
        xp = backend.get_array_module(x)
        axes = tuple(range(x.ndim - ndim, x.ndim))
        mean = x.mean(axis=axes, keepdims=True)
        out = x - mean
        var = (out * out).mean(axis=axes, keepdims=True)
        rstd = 1.0 / xp.sqrt(var + eps)
        out *= rstd
        if weight is not None:
            out *= weight
        if bias is not None:
            out += bias
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.axes = axes
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, mean, rstd = ctx.saved
        axes = ctx.axes
        leading = tuple(range(x.ndim - len(axes)))
        norm = (x - mean) * rstd
        need_x, need_w, need_b = ctx.needs_input_grad + (False,) * (3 - len(ctx.needs_input_grad))
        grad_w = (grad * norm).sum(axis=leading) if weight is not None and need_w else None
        grad_b = grad.sum(axis=leading) if need_b else None
        grad_x = None
        if need_x:
            d_norm = grad * weight if weight is not None else grad
            grad_x = d_norm - d_norm.mean(axis=axes, keepdims=True)
            grad_x -= norm * (d_norm * norm).mean(axis=axes, keepdims=True)
            grad_x *= rstd
        return grad_x, grad_w, grad_b


# ---------------------------------------------------------------- activation


class GELU(Function):
    """GELU(x) = x · Φ(x), Φ the standard normal CDF (Hendrycks & Gimpel 2016).

    ``approximate="none"``: Φ(x) = (1 + erf(x / sqrt 2)) / 2, derivative Φ(x) + x φ(x) with
    φ(x) = exp(-x²/2) / sqrt(2π). ``approximate="tanh"`` (GPT-2's): Φ(x) ≈ (1 + tanh(u)) / 2,
    u = sqrt(2/π) (x + 0.044715 x³). Since (1 + tanh(u)) / 2 = σ(2u) (the logistic sigmoid),
    it is computed as σ(2u) = 1 / (1 + exp(-2u)): NumPy's exp is about twice as fast as its
    tanh, and the forward is the costliest elementwise pass of a GPT block. Derivative:
    σ + x · 2u'(x) · σ (1 - σ), u' = sqrt(2/π) (1 + 3 · 0.044715 x²). Saves x and Φ(x) (σ):
    one array more than x alone, to skip recomputing the exp/erf in backward.
    """

    @staticmethod
    def forward(ctx, x, approximate="none"):
        xp = backend.get_array_module(x)
        if approximate == "tanh":
            cdf = x * x  # becomes -2u = -2 sqrt(2/π) (x + 0.044715 x³), then σ(2u)
            cdf *= -2 * SQRT_2_OVER_PI * GELU_CUBIC
            cdf -= 2 * SQRT_2_OVER_PI
            cdf *= x
            with numpy.errstate(over="ignore"):  # exp -> inf for x < -10 or so: σ = 1/inf = 0, exactly the limit
                xp.exp(cdf, out=cdf)
            cdf += 1.0
            xp.reciprocal(cdf, out=cdf)
        else:
            cdf = erf(x * (1.0 / math.sqrt(2.0)))
            cdf += 1.0
            cdf *= 0.5
        ctx.save_for_backward(x, cdf)
        ctx.approximate = approximate
        return x * cdf

    @staticmethod
    def backward(ctx, grad):
        x, cdf = ctx.saved
        xp = backend.get_array_module(x)
        if ctx.approximate == "tanh":
            slope = x * x  # x · 2u'(x) = x (2 sqrt(2/π) + 6 sqrt(2/π) 0.044715 x²)
            slope *= 6 * SQRT_2_OVER_PI * GELU_CUBIC
            slope += 2 * SQRT_2_OVER_PI
            slope *= x
            spread = 1.0 - cdf
            spread *= cdf
            slope *= spread
        else:
            slope = xp.exp(-0.5 * x * x)  # x φ(x)
            slope *= x * (1.0 / math.sqrt(2.0 * math.pi))
        slope += cdf
        slope *= grad
        return (slope,)


# ---------------------------------------------------------------- embedding


class Embedding(Function):
    """Rows of ``weight`` (V, C) picked by integer ``indices`` (any shape): out
    (*indices.shape, C). Backward scatters the output's gradient back into a (V, C) zero
    array, *adding* where an index repeats (a token seen twice gets both gradients)."""

    @staticmethod
    def forward(ctx, weight, *, indices):
        ctx.indices, ctx.weight_shape, ctx.dtype = indices, weight.shape, weight.dtype
        return weight[indices]

    @staticmethod
    def backward(ctx, grad):
        xp = backend.get_array_module(grad)
        out = xp.zeros(ctx.weight_shape, dtype=ctx.dtype)
        backend.scatter_add(out, ctx.indices.reshape(-1), grad.reshape(-1, ctx.weight_shape[-1]))
        return (out,)
