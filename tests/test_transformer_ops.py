"""The transformer's ops (minidist.attention through nn.functional) and layers: finite-difference
gradients in float64 (random cotangent), closed forms, stability, the causal mask, and every error."""
import math

import numpy as np
import pytest
from gradcheck import check_gradients

import minidist.functions as F
from minidist import Tensor, attention, nn
from minidist.functions import ShapeError

rng = np.random.default_rng(19)


def r(*shape):
    return rng.standard_normal(shape)


# ---------------------------------------------------------------- gradients against finite differences

FLOAT_MASK = r(2, 1, 3, 4)  # drawn once: every finite-difference evaluation sees the same mask

GRADCHECKS = {
    "softmax_last": (lambda a: F.softmax(a), [r(3, 5)]),
    "softmax_dim0": (lambda a: F.softmax(a, dim=0), [r(3, 5)]),
    "softmax_3d_middle": (lambda a: F.softmax(a, dim=1), [r(2, 3, 4)]),
    "gelu_none": (lambda a: F.gelu(a), [3 * r(4, 5)]),
    "gelu_tanh": (lambda a: F.gelu(a, approximate="tanh"), [3 * r(4, 5)]),
    "layer_norm_affine": (lambda x, w, b: F.layer_norm(x, 5, w, b), [r(2, 3, 5), r(5), r(5)]),
    "layer_norm_no_bias": (lambda x, w: F.layer_norm(x, 5, w), [r(2, 3, 5), r(5)]),
    "layer_norm_bias_only": (lambda x, b: F.layer_norm(x, 5, None, b), [r(2, 3, 5), r(5)]),
    "layer_norm_plain": (lambda x: F.layer_norm(x, 7), [r(3, 7)]),
    "layer_norm_two_axes": (lambda x, w, b: F.layer_norm(x, (3, 5), w, b), [r(2, 3, 5), r(3, 5), r(3, 5)]),
    "layer_norm_one_row": (lambda x, w, b: F.layer_norm(x, 6, w, b, eps=1e-3), [r(6), r(6), r(6)]),
    "embedding_repeats": (lambda w: F.embedding(np.array([[0, 2, 2], [1, 0, 2]]), w), [r(4, 3)]),
    "embedding_1d": (lambda w: F.embedding(np.array([3, 3, 3, 0]), w), [r(5, 2)]),
    "attention": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
                  [r(2, 3, 4, 5), r(2, 3, 4, 5), r(2, 3, 4, 6)]),
    "attention_causal": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                         [r(2, 3, 5, 4), r(2, 3, 5, 4), r(2, 3, 5, 3)]),
    "attention_causal_rectangular": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                     [r(1, 2, 3, 4), r(1, 2, 5, 4), r(1, 2, 5, 2)]),
    "attention_T1": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                     [r(2, 1, 1, 3), r(2, 1, 1, 3), r(2, 1, 1, 3)]),
    "attention_3d_scale": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=0.7),
                           [r(3, 4, 2), r(3, 6, 2), r(3, 6, 5)]),
    "attention_bool_mask": (lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, attn_mask=np.array([[True, False, True], [True, True, False]])), [r(2, 2, 2, 3), r(2, 2, 3, 3),
                                                                                   r(2, 2, 3, 3)]),
    "attention_float_mask": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=FLOAT_MASK),
                             [r(2, 3, 3, 2), r(2, 3, 4, 2), r(2, 3, 4, 2)]),
    # a fresh generator per call: the same dropout mask in every finite-difference evaluation
    "attention_dropout": (lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, dropout_p=0.4, is_causal=True, generator=np.random.default_rng(7)),
        [r(2, 2, 4, 3), r(2, 2, 4, 3), r(2, 2, 4, 3)]),
    "cross_entropy_ignore_index": (lambda a: F.cross_entropy(a, np.array([0, -1, 4, -1]), ignore_index=-1),
                                   [r(4, 5)]),
}


@pytest.mark.parametrize("name", sorted(GRADCHECKS))
def test_gradients_match_finite_differences(name, device):
    fn, arrays = GRADCHECKS[name]
    check_gradients(fn, *arrays, device=device)


# ---------------------------------------------------------------- values


def test_softmax_is_stable_and_sums_to_one():
    out = F.softmax(Tensor(np.array([[1000.0, 0.0, -1000.0], [-1e4, -1e4, -1e4]])))
    np.testing.assert_allclose(out.data, [[1.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3]], atol=1e-15)
    x = r(4, 6)
    np.testing.assert_allclose(F.softmax(Tensor(x), dim=0).data.sum(axis=0), np.ones(6))


def test_softmax_under_autocast_computes_in_float32():
    from minidist import precision

    with precision.autocast("fp16"):
        out = F.softmax(Tensor(np.array([[10.0, 0.0]], dtype=np.float16)))
    assert out.dtype == np.float32


def test_gelu_matches_its_formulas():
    x = np.linspace(-6, 6, 41)
    exact = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x])
    tanh = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    np.testing.assert_allclose(F.gelu(Tensor(x)).data, exact, rtol=1e-15, atol=1e-300)
    # 1 + tanh(u) cancels in the left tail (absolute error ~1e-16 |x|); the op's σ(2u) form does not
    np.testing.assert_allclose(nn.GELU(approximate="tanh")(Tensor(x)).data, tanh, rtol=1e-14, atol=1e-14)
    left = np.array([-9.0, -8.0])
    u = math.sqrt(2 / math.pi) * (left + 0.044715 * left**3)
    np.testing.assert_allclose(F.gelu(Tensor(left), approximate="tanh").data, left / (1 + np.exp(-2 * u)),
                               rtol=1e-14)
    assert 1 + math.tanh(u[1]) == 0 and F.gelu(Tensor(left), approximate="tanh").data[1] < 0  # not rounded to 0
    assert np.abs(exact - tanh).max() < 1e-3  # the approximation is close, not equal
    assert F.gelu(Tensor(np.ones(3, dtype=np.float32))).dtype == np.float32


def test_gelu_tanh_at_huge_inputs_is_finite_and_quiet():
    import warnings

    x = Tensor(np.array([-1000.0, -20.0, 1000.0], dtype=np.float32), requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warning from exp(-2u)
        out = F.gelu(x, approximate="tanh")
        out.sum().backward()
    np.testing.assert_array_equal(out.data, [0.0, 0.0, 1000.0])
    np.testing.assert_array_equal(x.grad, [0.0, 0.0, 1.0])


def test_erf_keeps_dtype_and_odd_symmetry():
    x = np.array([-3.0, -0.5, 0.0, 0.5, 3.0], dtype=np.float32)
    out = attention.erf(x)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, [math.erf(v) for v in x.astype(float)], rtol=1e-7)


def test_layer_norm_normalises_each_row():
    x = 5 + 3 * r(4, 7)
    out = nn.LayerNorm(7, dtype="float64")(Tensor(x)).data
    np.testing.assert_allclose(out.mean(axis=-1), 0, atol=1e-12)
    np.testing.assert_allclose(out.var(axis=-1), 1, rtol=1e-4)  # var / (var + eps) with eps = 1e-5
    w, b = r(7), r(7)
    expected = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * w + b
    np.testing.assert_allclose(F.layer_norm(Tensor(x), 7, Tensor(w), Tensor(b)).data, expected, rtol=1e-12)


def test_layer_norm_saves_mean_and_rstd_not_a_normalised_copy():
    x = Tensor(r(3, 4), requires_grad=True)
    out = F.layer_norm(x, 4, Tensor(r(4), requires_grad=True))
    saved = out._ctx.saved
    assert [s.shape for s in saved if s is not None] == [(3, 4), (4,), (3, 1), (3, 1)]


def test_layer_norm_without_bias_has_none():
    ln = nn.LayerNorm(6, bias=False)
    assert ln.bias is None and [n for n, _ in ln.named_parameters()] == ["weight"]
    assert nn.LayerNorm(6, elementwise_affine=False).parameters() == []


def test_embedding_rows_and_accumulated_gradient():
    emb = nn.Embedding(5, 3, rng=0, dtype="float64")
    idx = np.array([[4, 1, 4], [4, 0, 1]])
    out = emb(idx)
    np.testing.assert_array_equal(out.data, emb.weight.data[idx])
    out.sum().backward()
    np.testing.assert_array_equal(emb.weight.grad[:, 0], [1, 2, 0, 0, 3])  # row 4 used three times


def test_attention_matches_the_formula_with_a_causal_mask():
    q, k, v = r(2, 3, 4, 5), r(2, 3, 4, 5), r(2, 3, 4, 2)
    scores = q @ k.swapaxes(-1, -2) / math.sqrt(5)
    scores = np.where(np.tril(np.ones((4, 4), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    expected = weights / weights.sum(-1, keepdims=True) @ v
    out = F.scaled_dot_product_attention(Tensor(q), Tensor(k), Tensor(v), is_causal=True)
    np.testing.assert_allclose(out.data, expected, rtol=1e-12)


def test_causal_attention_does_not_look_ahead():
    q, k, v = (Tensor(r(1, 2, 5, 3), requires_grad=True) for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out[:, :, 2].sum().backward()  # position 2 may depend on keys and values 0..2 only
    assert np.all(k.grad[:, :, 3:] == 0) and np.all(v.grad[:, :, 3:] == 0)
    assert np.all(k.grad[:, :, :3] != 0) and np.all(q.grad[:, :, [0, 1, 3, 4]] == 0)


def test_attention_is_stable_with_huge_scores():
    q = Tensor(np.full((1, 1, 3, 2), 1e4))
    out = F.scaled_dot_product_attention(q, q, Tensor(r(1, 1, 3, 2)), is_causal=True)
    assert np.isfinite(out.data).all()


def test_fused_attention_keeps_one_score_array():
    q, k, v = (Tensor(r(2, 3, 4, 5), requires_grad=True) for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    shapes = [s.shape for s in out._ctx.saved if s is not None]
    assert shapes.count((2, 3, 4, 4)) == 1


def test_attention_dropout_is_seeded_and_scales_the_kept_weights():
    q, k, v = Tensor(np.zeros((1, 1, 4, 2))), Tensor(np.zeros((1, 1, 4, 2))), Tensor(np.ones((1, 1, 4, 1)))
    a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5, generator=np.random.default_rng(3)).data
    b = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5, generator=np.random.default_rng(3)).data
    np.testing.assert_array_equal(a, b)
    # uniform weights 1/4, each kept one scaled by 2: every output is a multiple of 0.5
    np.testing.assert_allclose(a * 2, np.round(a * 2))
    assert len(np.unique(a)) > 1


def test_cross_entropy_ignore_index_leaves_rows_out():
    logits, targets = r(4, 3), np.array([2, -100, 0, -100])
    kept = F.cross_entropy(Tensor(logits[[0, 2]]), targets[[0, 2]])
    np.testing.assert_allclose(F.cross_entropy(Tensor(logits), targets).data, kept.data, rtol=1e-15)
    assert np.isnan(F.cross_entropy(Tensor(logits), np.full(4, -1), ignore_index=-1).data)


def test_cross_entropy_over_language_model_logits():
    logits, targets = r(2, 3, 5), rng.integers(0, 5, (2, 3))
    flat = F.cross_entropy(Tensor(logits).reshape(6, 5), targets.reshape(-1))
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = -np.take_along_axis(log_probs, targets[..., None], -1).mean()
    np.testing.assert_allclose(flat.data, expected, rtol=1e-14)


# ---------------------------------------------------------------- containers


def test_module_list_and_dict_name_nested_parameters():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(2)

    root = nn.Module()
    root.body = nn.ModuleDict(emb=nn.Embedding(3, 2, rng=0), h=nn.ModuleList([Block(), Block()]))
    names = [n for n, _ in root.named_parameters()]
    assert names == ["body.emb.weight", "body.h.0.ln.weight", "body.h.0.ln.bias", "body.h.1.ln.weight",
                     "body.h.1.ln.bias"]
    assert root.body["h"][-1] is root.body.h[1] and len(root.body.h[:1]) == 1
    assert list(root.body) == ["emb", "h"] and "emb" in root.body


def test_shared_parameter_comes_once_in_parameters_and_under_both_names_in_the_state():
    root = nn.Module()
    root.a, root.b = nn.Linear(2, 2, rng=0), nn.Linear(2, 2, rng=1)
    root.b.weight = root.a.weight
    assert [n for n, _ in root.named_parameters()] == ["a.weight", "a.bias", "b.bias"]
    assert len(root.parameters()) == 3 and root.num_parameters() == 8
    state = root.state_dict()
    assert list(state) == ["a.weight", "a.bias", "b.weight", "b.bias"]
    root.load_state_dict(state)
    assert root.b.weight is root.a.weight


def test_container_errors():
    with pytest.raises(TypeError, match="not a Module"):
        nn.ModuleList([nn.ReLU(), 3])
    with pytest.raises(TypeError, match="not a Module"):
        nn.ModuleDict(a=3)
    with pytest.raises(KeyError, match="cannot name a module"):
        nn.ModuleDict(parameters=nn.ReLU())
    with pytest.raises(KeyError, match="cannot name a module"):
        nn.ModuleDict({"1x": nn.ReLU()})


# ---------------------------------------------------------------- errors


def test_embedding_index_errors_name_the_limit():
    emb = nn.Embedding(4, 2)
    with pytest.raises(IndexError, match=r"\[0, 4\) \(num_embeddings = 4\)"):
        emb(np.array([0, 4]))
    with pytest.raises(IndexError, match="num_embeddings = 4"):
        emb(np.array([-1]))
    with pytest.raises(TypeError, match="integers"):
        emb(np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match=">= 1"):
        nn.Embedding(0, 3)


def test_layer_norm_shape_errors():
    with pytest.raises(ShapeError, match="trailing axes"):
        nn.LayerNorm(4)(Tensor(r(2, 5)))
    with pytest.raises(ShapeError, match="weight and bias must have shape"):
        F.layer_norm(Tensor(r(2, 5)), 5, Tensor(r(4)))


def test_gelu_and_softmax_errors():
    with pytest.raises(ValueError, match="'none' or 'tanh'"):
        nn.GELU(approximate="fast")
    with pytest.raises(ValueError, match="'none' or 'tanh'"):
        F.gelu(Tensor(r(2)), approximate="erf")
    with pytest.raises(ShapeError, match="out of range"):
        F.softmax(Tensor(r(2, 3)), dim=2)


def test_attention_errors():
    q = Tensor(r(1, 2, 3, 4))
    with pytest.raises(ShapeError, match="same leading axes"):
        F.scaled_dot_product_attention(q, Tensor(r(1, 3, 3, 4)), Tensor(r(1, 3, 3, 4)))
    with pytest.raises(ShapeError, match="same d"):
        F.scaled_dot_product_attention(q, Tensor(r(1, 2, 3, 5)), Tensor(r(1, 2, 3, 4)))
    with pytest.raises(ShapeError, match="same S"):
        F.scaled_dot_product_attention(q, q, Tensor(r(1, 2, 2, 4)))
    with pytest.raises(ValueError, match="not both"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=np.ones((3, 3), bool), is_causal=True)
    with pytest.raises(ValueError, match="needs generator="):
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        F.scaled_dot_product_attention(q, q, q, dropout_p=1.0, generator=np.random.default_rng(0))
    with pytest.raises(ShapeError, match="does not broadcast"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=np.ones((2, 3), bool))


def test_cross_entropy_names_ignore_index_in_its_range_error():
    with pytest.raises(ValueError, match="ignore_index=-100"):
        F.cross_entropy(Tensor(r(2, 3)), np.array([-1, 1]))
