"""Int8 post-training quantization: the round-trip error bound (scale / 2), the int32 product
against int64 NumPy, bytes, accuracy on digits against the float model, and bad inputs."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from minidist import backend, data, nn, train
from minidist.quantization import (
    MAX_IN_FEATURES,
    QuantizedLinear,
    dequantize,
    model_bytes,
    quantize_dynamic,
    quantize_per_channel,
    quantize_per_tensor,
)
from minidist.tensor import Tensor
from minidist.train import train_single

FLOATS = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, width=32)
ARRAYS = hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=6), elements=FLOATS)


def _bound_holds(x, q, scale):
    """|x - q * scale| <= scale / 2 elementwise, in float64 (the float32 inputs are exact there)."""
    error = np.abs(x.astype(np.float64) - q.astype(np.float64) * scale.astype(np.float64))
    return bool(np.all(error <= scale.astype(np.float64) / 2 * (1 + 1e-12)))


@settings(max_examples=60, deadline=None)
@given(ARRAYS)
def test_per_tensor_round_trip_error_is_at_most_half_a_step(x):
    q, scale = quantize_per_tensor(x)
    assert q.dtype == np.int8 and q.shape == x.shape and scale.dtype == np.float32 and scale.shape == ()
    assert q.size == 0 or np.abs(q).max() <= 127
    assert _bound_holds(x, q, scale)
    if x.size and np.abs(x).max() >= 127 * np.finfo(np.float32).tiny:  # above the smallest scale's reach,
        # the largest magnitude takes code +-127: the whole range is used
        assert np.abs(q).max() == 127
    # dequantize is the same q * scale, in float32
    np.testing.assert_allclose(dequantize(q, scale), x, rtol=0, atol=float(scale) / 2 * 1.0001)


@settings(max_examples=60, deadline=None)
@given(ARRAYS, st.integers(-3, 2))
def test_per_channel_round_trip_error_is_at_most_half_a_channel_step(w, axis):
    if not -w.ndim <= axis < w.ndim:
        axis = 0
    q, scale = quantize_per_channel(w, axis=axis)
    assert q.dtype == np.int8 and q.shape == w.shape and scale.shape == (w.shape[axis],)
    shape = [1] * w.ndim
    shape[axis] = -1
    assert _bound_holds(w, q, scale.reshape(shape))
    back = dequantize(q, scale, axis=axis)
    assert back.dtype == np.float32 and back.shape == w.shape


def test_subnormal_and_huge_values_keep_the_bound():
    """Values near float32's limits: a subnormal max would give a subnormal scale, rounded too
    coarsely for the bound; float32's largest value must not overflow the scale."""
    tiny = np.finfo(np.float32).smallest_subnormal
    for x in (np.array([tiny, -3 * tiny, 7 * tiny], np.float32),
              np.array([np.finfo(np.float32).max, 1.0, -1e30], np.float32)):
        q, scale = quantize_per_tensor(x)
        assert np.isfinite(scale) and scale > 0 and _bound_holds(x, q, scale)


def test_finite_values_beyond_a_float32_scale_are_an_error_not_nan():
    """float64 values whose scale max|x| / 127 exceeds float32's largest number (3.4e38) have no
    float32 scale: the scale became inf and the codes 0, so dequantizing gave NaN (0 * inf)."""
    huge = np.array([1e300, -1.0, 3.0])
    for call in (lambda: quantize_per_tensor(huge), lambda: quantize_per_channel(np.stack([huge, huge / 1e300]))):
        with pytest.raises(ValueError, match=r"max \|x\| = 1e\+300 .* float32 scale .* at most 4\.32e\+40"):
            call()
    edge = np.array([4.3e40, 1.0])  # the scale 3.39e38 still fits float32 (the values themselves do not)
    q, scale = quantize_per_tensor(edge)
    assert np.isfinite(scale) and q.tolist() == [127, 0] and _bound_holds(edge, q, scale)


def test_per_channel_scales_are_each_rows_max_over_127():
    """Hand-made: a row of small weights keeps its own fine scale (a per-tensor scale would
    round it all to 0)."""
    w = np.array([[0.001, -0.005, 0.003], [100.0, -40.0, 20.0], [0.0, 0.0, 0.0]], np.float32)
    q, scale = quantize_per_channel(w, axis=0)
    np.testing.assert_allclose(scale, [0.005 / 127, 100.0 / 127, 1.0], rtol=1e-6)
    np.testing.assert_array_equal(q, [[25, -127, 76], [127, -51, 25], [0, 0, 0]])  # 25.4, 76.2, -50.8, 25.4
    q_tensor, _ = quantize_per_tensor(w)
    assert np.all(q_tensor[0] == 0)  # what per-channel avoids


def test_the_int32_accumulation_equals_the_exact_integer_product():
    """Oracle: NumPy's int64 product of the same codes; the float output is that product
    times the two scales plus the bias."""
    rng = np.random.default_rng(0)
    linear = nn.Linear(300, 20, rng=1)
    linear.weight.data = (rng.standard_normal((20, 300)) * 3).astype(np.float32)
    x = rng.standard_normal((7, 300)).astype(np.float32) * 5
    layer = QuantizedLinear.from_float(linear)
    qx, sx = quantize_per_tensor(x)
    exact = qx.astype(np.int64) @ layer.qweight.astype(np.int64).T
    assert np.abs(exact).max() > 127 * 127  # the sum leaves int16's range: int8/int16 accumulators would wrap
    expected = exact.astype(np.float64) * float(sx) * layer.weight_scale.astype(np.float64) + linear.bias.data
    y = layer(Tensor(x)).data
    assert y.dtype == np.float32 and y.shape == (7, 20)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


def test_the_worst_case_accumulation_does_not_overflow():
    """All codes at +-127 over the largest allowed in_features: still exact in int32."""
    layer = QuantizedLinear(np.full((1, MAX_IN_FEATURES), -127, np.int8), np.ones(1, np.float32))
    y = layer(np.ones((1, MAX_IN_FEATURES), np.float32)).data  # input codes all 127, scale 1/127
    assert float(y[0, 0]) == pytest.approx(-127 * 127 * MAX_IN_FEATURES / 127, rel=1e-6)
    with pytest.raises(ValueError, match="overflow"):
        QuantizedLinear(np.zeros((1, MAX_IN_FEATURES + 1), np.int8), np.ones(1, np.float32))


def test_leading_axes_and_the_device(device):
    xp = backend.module_for(device)
    linear = nn.Linear(8, 3, rng=0, device=device)
    layer = QuantizedLinear.from_float(linear)
    x = xp.asarray(np.random.default_rng(2).standard_normal((2, 5, 8)).astype(np.float32))
    y = layer(Tensor(x)).data
    assert y.shape == (2, 5, 3) and backend.device_of(y) == device
    reference = linear(Tensor(x)).data
    # error of an int8 linear: both roundings, at most (|x|max * sum|w| / 127) per output
    bound = float(xp.abs(x).max()) * float(xp.abs(linear.weight.data).sum(axis=1).max()) / 127
    assert float(xp.abs(y - reference).max()) <= bound


def test_an_int8_model_is_about_four_times_smaller_and_within_one_point_on_digits():
    dataset = data.load_digits(seed=0)
    fp32 = train_single(train.TrainConfig(epochs=5, progress=False), dataset, report=False).model
    int8 = quantize_dynamic(fp32)
    assert [type(m).__name__ for m in int8] == ["QuantizedLinear", "ReLU", "QuantizedLinear"]
    assert type(fp32[0]) is nn.Linear  # the float model is not changed
    weights = sum(m.weight.data.size for m in fp32 if isinstance(m, nn.Linear))
    assert sum(m.weight.data.nbytes for m in fp32 if isinstance(m, nn.Linear)) == 4 * weights
    assert sum(m.qweight.nbytes for m in int8 if isinstance(m, QuantizedLinear)) == weights  # 4x fewer
    assert model_bytes(fp32) == 4 * fp32.num_parameters()
    # int8 weights (1 byte each) + float32 bias and per-row scales (4 bytes each)
    assert model_bytes(int8) == weights + 4 * 2 * (128 + 10)
    assert model_bytes(fp32) / model_bytes(int8) > 3.5
    acc32 = train.accuracy(fp32, dataset.X_test, dataset.y_test)
    acc8 = train.accuracy(int8, dataset.X_test, dataset.y_test)
    assert acc32 > 0.9
    assert acc8 >= acc32 - 0.01


@pytest.mark.parametrize("call, error, match", [
    (lambda: quantize_per_tensor(np.arange(4, dtype=np.int32)), TypeError, "floating"),
    (lambda: quantize_per_channel(np.ones((2, 3), np.float32), axis=2), ValueError, "out of range"),
    (lambda: quantize_per_channel(np.ones((2, 3), np.float32), axis=0.5), TypeError, "axis must be an int"),
    (lambda: quantize_per_channel(np.float32(1.0)), ValueError, "0-d"),
    (lambda: quantize_per_tensor(np.array([1.0, np.nan], np.float32)), ValueError, "NaN"),
    (lambda: quantize_per_tensor([1.0, 2.0]), TypeError, "array"),
    (lambda: dequantize(np.ones(3, np.float32), 1.0), TypeError, "int8"),
    (lambda: dequantize(np.ones((2, 3), np.int8), np.ones(3, np.float32)), ValueError, "axis"),
    (lambda: dequantize(np.ones((2, 3), np.int8), np.ones(3, np.float32), axis=0), ValueError, r"\(2,\)"),
    (lambda: QuantizedLinear.from_float(nn.ReLU()), TypeError, "nn.Linear"),
    (lambda: QuantizedLinear(np.ones((2, 3), np.float32), np.ones(2)), TypeError, "int8"),
    (lambda: QuantizedLinear.from_float(nn.Linear(3, 2))(np.ones((4, 5), np.float32)), ValueError, "in_features=3"),
    (lambda: quantize_dynamic(nn.mlp([3, 2]), dtype="int4"), ValueError, "int8"),
    (lambda: quantize_dynamic(nn.mlp([3, 2]), {nn.ReLU}), TypeError, "nn.Linear"),
    (lambda: model_bytes([1, 2]), TypeError, "Module"),
])
def test_bad_inputs_raise_clear_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()
