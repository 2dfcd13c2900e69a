"""Tiled (flash) attention, minidist.attention.flash_attention: finite-difference gradients in
float64; outputs and dQ, dK, dV equal to the dense op (ScaledDotProductAttention, a separate
code path that builds the whole (T, S) weights) to 1e-12, causal and not, for tile sizes that
do not divide T, exceed it, or are 1; the tiles visited against the dense causal mask; every
error; the bytes held for backward growing as T·d against the dense op's T²
(``memory.track``, with the closed form); and scaled_dot_product_attention's dispatch.

The tests taking the ``device`` fixture run again under CuPy when a GPU is present
(tests/conftest.py), and test_flash_attention_stays_on_the_gpu is marked for it.
"""
import numpy as np
import pytest
from gradcheck import check_gradients

import minidist.functions as F
from minidist import Tensor, attention, backend, memory

rng = np.random.default_rng(31)


def r(*shape):
    return rng.standard_normal(shape)


def dense_and_flash(q, k, v, grad, device="cpu", **options):
    """Output and (dq, dk, dv) of the dense op and of the tiled op on the same float64 inputs,
    as NumPy arrays: [(out, dq, dk, dv) dense, (out, dq, dk, dv) flash]."""
    xp = backend.module_for(device)
    block_size = options.pop("block_size", attention.FLASH_BLOCK_SIZE)
    results = []
    for attend in (lambda *t: F.scaled_dot_product_attention(*t, **options),
                   lambda *t: attention.flash_attention(*t, block_size=block_size, **options)):
        inputs = [Tensor(xp.asarray(a), requires_grad=True) for a in (q, k, v)]
        out = attend(*inputs)
        out.backward(xp.asarray(grad))
        results.append([backend.to_numpy(a) for a in (out.data, *(t.grad for t in inputs))])
    return results


# ---------------------------------------------------------------- against finite differences

GRADCHECKS = {  # (T, S, d, e, is_causal, block_size)
    "causal_tiles_uneven": (7, 7, 3, 2, True, 3),
    "full_tiles_uneven": (7, 7, 3, 2, False, 3),
    "causal_more_keys": (3, 5, 2, 3, True, 2),
    "causal_more_queries": (5, 3, 2, 2, True, 2),
    "one_position": (1, 1, 3, 3, True, 4),
    "tile_bigger_than_T": (4, 4, 2, 2, True, 16),
    "tile_of_one": (3, 4, 2, 2, False, 1),
}


@pytest.mark.parametrize("name", sorted(GRADCHECKS))
def test_gradients_match_finite_differences(name, device):
    t, s, d, e, is_causal, block_size = GRADCHECKS[name]
    check_gradients(lambda q, k, v: attention.flash_attention(q, k, v, is_causal=is_causal, block_size=block_size),
                    r(1, 2, t, d), r(1, 2, s, d), r(1, 2, s, e), device=device)


# ---------------------------------------------------------------- against the dense op

SHAPES = {  # (B, H, T, S, d, e, block_size)
    "T_not_divisible": (2, 3, 37, 37, 8, 8, 8),
    "T_divisible": (2, 2, 32, 32, 4, 4, 8),
    "one_position": (2, 3, 1, 1, 4, 4, 8),
    "tile_bigger_than_T": (1, 2, 20, 20, 4, 6, 64),
    "tile_of_one": (1, 1, 6, 6, 2, 2, 1),
    "more_keys": (1, 2, 5, 13, 4, 3, 4),
    "more_queries": (1, 2, 13, 5, 4, 3, 4),
}


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_equal_to_dense_attention(name, is_causal, device):
    b, h, t, s, d, e, block_size = SHAPES[name]
    q, k, v, grad = r(b, h, t, d), r(b, h, s, d), r(b, h, s, e), r(b, h, t, e)
    dense, flash = dense_and_flash(q, k, v, grad, device, is_causal=is_causal, block_size=block_size)
    for what, want, got in zip(("out", "dq", "dk", "dv"), dense, flash):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12, err_msg=what)


def test_scale_and_large_scores_stay_finite():
    """Scores of several hundred (a large scale) overflow a naive exp; the running max keeps
    the tiled result equal to the dense one."""
    q, k, v, grad = 30 * r(1, 1, 9, 4), 30 * r(1, 1, 9, 4), r(1, 1, 9, 4), r(1, 1, 9, 4)
    dense, flash = dense_and_flash(q, k, v, grad, is_causal=True, scale=0.9, block_size=4)
    assert all(np.isfinite(a).all() for a in flash)
    for want, got in zip(dense, flash):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_float32_stays_float32():
    q = Tensor(r(1, 2, 9, 4).astype(np.float32), requires_grad=True)
    out = attention.flash_attention(q, q, q, is_causal=True, block_size=4)
    out.sum().backward()
    assert out.dtype == np.float32 and q.grad.dtype == np.float32


# ---------------------------------------------------------------- the tiles visited


@pytest.mark.parametrize("t, s, block_size", [(12, 12, 4), (10, 10, 4), (5, 9, 2), (9, 5, 2), (1, 1, 8)])
def test_causal_tiles_cover_exactly_the_lower_triangle(t, s, block_size):
    """Put the visited tiles' masks together: the dense causal mask (numpy.tril), each allowed
    (query, key) pair in exactly one tile, in either loop order; the pairs left out see nothing."""
    want = np.tril(np.ones((t, s), dtype=bool))
    for keys_outer in (False, True):
        seen = np.zeros((t, s), dtype=int)
        for rows, cols, mask in attention.tile_pairs(t, s, block_size, True, keys_outer=keys_outer):
            seen[rows, cols] += True if mask is None else mask
        np.testing.assert_array_equal(seen, want)


def test_causal_skips_the_tiles_above_the_diagonal():
    """n tiles a side: n(n + 1) / 2 pairs causal (of n^2), 3 of them crossing the diagonal at n = 3."""
    visited = list(attention.tile_pairs(12, 12, 4, True))
    assert len(visited) == 6 and sum(mask is not None for _, _, mask in visited) == 3
    assert len(list(attention.tile_pairs(12, 12, 4, False))) == 9


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("shapes, match", [
    (((2, 4, 3), (2, 4, 3), (2, 4, 3)), "must be \\(B, H, T, d\\)"),
    (((1, 2, 4, 3), (1, 3, 4, 3), (1, 3, 4, 3)), "the same B and H"),
    (((1, 2, 4, 3), (1, 2, 4, 5), (1, 2, 4, 3)), "the same d"),
    (((1, 2, 4, 3), (1, 2, 4, 3), (1, 2, 6, 3)), "the same S"),
    (((1, 2, 0, 3), (1, 2, 4, 3), (1, 2, 4, 3)), "T and S must be >= 1"),
])
def test_bad_shapes_are_refused(shapes, match):
    with pytest.raises(ValueError, match=match):
        attention.flash_attention(*(Tensor(np.zeros(s)) for s in shapes))


@pytest.mark.parametrize("block_size", [0, -3, 2.5, True, "64"])
def test_bad_block_size_is_refused(block_size):
    q = Tensor(r(1, 1, 4, 2))
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        attention.flash_attention(q, q, q, block_size=block_size)


def test_dtypes_are_checked():
    q = r(1, 1, 4, 2)
    with pytest.raises(TypeError, match="one float dtype"):
        attention.flash_attention(q, q.astype(np.float32), q)
    with pytest.raises(TypeError, match="one float dtype"):
        attention.flash_attention(*(np.ones((1, 1, 4, 2), dtype=np.int64),) * 3)


# ---------------------------------------------------------------- memory held for backward


def held_for_backward(attend, b, h, t, d):
    """memory.track's peak over one forward of ``attend`` on float32 (B, H, T, d) q, k, v."""
    q, k, v = (Tensor(r(b, h, t, d).astype(np.float32), requires_grad=True) for _ in range(3))
    with memory.track() as tracker:
        out = attend(q, k, v)
    del out
    return tracker.peak_bytes


def test_memory_grows_as_T_d_instead_of_T_squared():
    """Dense keeps the (T, T) weights: doubling T nearly quadruples its peak. The tiled op keeps
    q, k, v, O (T·d each) and the log-sum-exp (T per head): exactly double, and exactly
    4 bytes · B·H·T·(4d + 1)."""
    b, h, d = 1, 2, 4
    dense = lambda *t: attention.ScaledDotProductAttention.apply(*t, scale=0.5, is_causal=True)
    flash = lambda *t: attention.flash_attention(*t, is_causal=True, block_size=32)
    sizes = (128, 256)
    flash_peaks = [held_for_backward(flash, b, h, t, d) for t in sizes]
    dense_peaks = [held_for_backward(dense, b, h, t, d) for t in sizes]
    assert flash_peaks == [4 * b * h * t * (4 * d + 1) for t in sizes]
    assert flash_peaks[1] / flash_peaks[0] == 2.0
    assert dense_peaks[1] / dense_peaks[0] > 3.7
    assert dense_peaks[0] > 7 * flash_peaks[0]


# ---------------------------------------------------------------- scaled_dot_product_attention's dispatch


def test_sdpa_dispatches_to_the_tiled_op_only_where_the_rule_says():
    long, short = F.FLASH_MIN_SEQUENCE, F.FLASH_MIN_SEQUENCE // 2
    cases = [  # (T, options, expected op)
        (long, {"is_causal": True}, attention.FlashAttention),
        (long, {}, attention.FlashAttention),
        (short, {"is_causal": True}, attention.ScaledDotProductAttention),
        (long, {"attn_mask": np.ones((long, long), dtype=bool)}, attention.ScaledDotProductAttention),
        (long, {"dropout_p": 0.1, "generator": np.random.default_rng(0)}, attention.ScaledDotProductAttention),
    ]
    for t, options, op in cases:
        q = Tensor(r(1, 1, t, 2).astype(np.float32), requires_grad=True)
        assert F.scaled_dot_product_attention(q, q, q, **options)._ctx.fn is op, (t, options)


# ---------------------------------------------------------------- on the GPU


@pytest.mark.skipif(not backend.cuda_available(), reason="needs CuPy and a GPU")
def test_flash_attention_stays_on_the_gpu():
    """Under CuPy: the output and gradients are CuPy arrays, equal to the CPU's float64 result."""
    q, k, v, grad = r(2, 2, 33, 8), r(2, 2, 33, 8), r(2, 2, 33, 8), r(2, 2, 33, 8)
    cpu = dense_and_flash(q, k, v, grad, "cpu", is_causal=True, block_size=8)[1]
    xp = backend.module_for("cuda")
    inputs = [Tensor(xp.asarray(a), requires_grad=True) for a in (q, k, v)]
    out = attention.flash_attention(*inputs, is_causal=True, block_size=8)
    out.backward(xp.asarray(grad))
    assert all(backend.device_of(a) == "cuda" for a in (out.data, *(t.grad for t in inputs)))
    for want, got in zip(cpu, (out.data, *(t.grad for t in inputs))):
        np.testing.assert_allclose(backend.to_numpy(got), want, rtol=0, atol=1e-12)
