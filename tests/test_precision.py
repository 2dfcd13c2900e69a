"""Mixed precision (minidist.precision): tensor-core emulation against NumPy oracles, underflow
of float16 gradients and loss scaling, the GradScaler's rules, bfloat16's range, training."""
import math

import ml_dtypes
import numpy as np
import pytest
from scenarios import assert_same_weights, assert_usage_error, stop_and_resume

from minidist import backend, cli, data, nn, optim, precision, sim, train
from minidist.functions import cross_entropy, linear, matmul, relu
from minidist.parallel.data_parallel import DistributedDataParallel
from minidist.parallel.data_parallel.train import train_ddp
from minidist.parallel.pipeline.train import train_pipeline
from minidist.tensor import Tensor

BF16 = np.dtype(ml_dtypes.bfloat16)
LOW = [np.dtype(np.float16), BF16]
# Overflow is what loss scaling detects (and skips); NumPy warns about it on the way.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")


def r(a, low):
    """Round to ``low`` and widen back to float64 (exact): the oracle's rounding. The emulated tensor core sums
    in float64 (precision.ACCUMULATE), so the oracle's products do too."""
    return np.asarray(a, dtype=np.float32).astype(low).astype(np.float64)


@pytest.fixture(scope="module")
def digits():
    return data.load_digits(seed=0)


@pytest.mark.parametrize("low", LOW, ids=["fp16", "bf16"])
def test_autocast_products_equal_float64_products_of_rounded_inputs_rounded(low):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((5, 7)).astype(np.float32), rng.standard_normal((7, 3)).astype(np.float32)
    w, bias = rng.standard_normal((4, 7)).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    with precision.autocast(low):
        product, lin = matmul(Tensor(a), Tensor(b)), linear(Tensor(a), Tensor(w), Tensor(bias))
    assert product.dtype == low and lin.dtype == low
    np.testing.assert_array_equal(product.data.astype(np.float64), r(r(a, low) @ r(b, low), low))
    np.testing.assert_array_equal(lin.data.astype(np.float64), r(r(a, low) @ r(w, low).T + r(bias, low), low))
    with precision.autocast("fp32"):  # off inside: plain float32
        assert matmul(Tensor(a), Tensor(b)).dtype == np.float32


@pytest.mark.parametrize("low", LOW, ids=["fp16", "bf16"])
def test_autocast_products_are_the_exact_sums_rounded_whatever_order_the_blas_adds_in(low):
    """issue 36: summed in float32 BLAS, a product's last bit depends on the CPU's OpenBLAS kernel (its order of
    additions) and flips the 16-bit rounding of some outputs, so a training run ended elsewhere under another
    kernel (chapter 11). Summed in float64 the outputs are the exact sums rounded once (math.fsum, which no order
    changes): the same on every CPU. Summed in float32, 14 of these 4096 float16 outputs were wrong (1 in bfloat16)."""
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((64, 4096)).astype(low), rng.standard_normal((4096, 64)).astype(low)
    with precision.autocast(low):
        product = matmul(Tensor(a), Tensor(b)).data
    wide_a, wide_b = a.astype(np.float64), b.astype(np.float64)  # each product of two 16-bit numbers is exact here
    exact = np.array([[math.fsum(wide_a[i] * wide_b[:, j]) for j in range(64)] for i in range(64)])
    np.testing.assert_array_equal(product, exact.astype(low))


@pytest.mark.parametrize("low", LOW, ids=["fp16", "bf16"])
def test_backward_rounds_activation_gradients_and_hands_float32_to_the_master_weights(low):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 5)).astype(np.float32)
    w1, w2 = (rng.standard_normal(s).astype(np.float32) for s in ((8, 5), (3, 8)))
    c = rng.standard_normal((6, 3)).astype(np.float32) * 1e-3
    p1, p2 = Tensor(w1, requires_grad=True), Tensor(w2, requires_grad=True)
    with precision.autocast(low):
        y = linear(relu(linear(Tensor(x), p1)), p2)
    (precision.autocast_float32(y) * Tensor(c)).sum().backward()
    # oracle: every product in float64 from rounded inputs, every result rounded
    h = r(r(x, low) @ r(w1, low).T, low)
    a = np.maximum(h, 0)
    g_y = r(c, low)
    g_a = r(g_y @ r(w2, low), low)  # the activation gradient, in the low dtype
    np.testing.assert_array_equal(p2.grad, r(g_y.T @ a, low))
    np.testing.assert_array_equal(p1.grad, r((g_a * (a > 0)).T @ r(x, low), low))
    assert p1.grad.dtype == np.float32 and p2.grad.dtype == np.float32


def test_saved_arrays_are_low_precision_and_a_weight_is_cast_once_per_autocast_block():
    w = Tensor(np.random.default_rng(2).standard_normal((4, 3)).astype(np.float32), requires_grad=True)
    x = Tensor(np.ones((2, 3), dtype=np.float32))
    with precision.autocast("fp16"):
        first, second = linear(x, w), linear(x, w)  # two micro-batches through one layer
    assert all(a.dtype == np.float16 for a in first._ctx.saved)  # half of float32's bytes kept for backward
    assert first._ctx.saved[1] is second._ctx.saved[1]  # one float16 copy of the weight
    with precision.autocast("fp16"):
        third = linear(x, w)
    assert third._ctx.saved[1] is not first._ctx.saved[1]  # a new block casts afresh (the weights may have moved)
    (first.sum() + second.sum()).backward()  # each use still has its own node: both gradients arrive
    np.testing.assert_array_equal(w.grad, np.full((4, 3), 4.0, dtype=np.float32))


def test_the_loss_is_float32_under_autocast():
    logits = Tensor(np.array([[1.0, 2.0, 3.0]], dtype=np.float32))
    with precision.autocast("fp16"):
        low = linear(logits, Tensor(np.eye(3, dtype=np.float32)))
        assert low.dtype == np.float16
        assert cross_entropy(low, np.array([2])).dtype == np.float32


def test_fp16_gradients_underflow_without_loss_scaling_and_come_back_with_it(digits):
    """Micikevicius et al. 2018, section 3.2: late in training many gradients are below float16's
    smallest subnormal (2**-24) and round to 0; scaling the loss moves them back into range."""
    model = train.train_single(train.TrainConfig(epochs=20, progress=False), digits, report=False).model
    x, y = Tensor(digits.X_train), digits.y_train  # the full batch: the mean makes the gradients small

    def zeros(dtype, scale=1.0):
        model.zero_grad()
        with precision.autocast(dtype):
            loss = cross_entropy(model(x), y)
        (loss * scale).backward()
        return sum(int((p.grad == 0).sum()) for p in model.parameters())

    fp32, fp16, scaled, bf16 = zeros("fp32"), zeros("fp16"), zeros("fp16", 1024.0), zeros("bf16")
    lost = fp16 - fp32  # measured: 226 of the 8063 non-zero entries of float32's gradient
    assert lost > 100
    assert scaled - fp32 < lost / 10 and abs(bf16 - fp32) < lost / 10


def _sgd_step(scaler, grad_value):
    p = Tensor(np.ones(3, dtype=np.float32), requires_grad=True)
    opt = optim.SGD([p], lr=0.5)
    p.grad = np.full(3, grad_value, dtype=np.float32) * np.float32(scaler.get_scale())
    stepped = scaler.step(opt)
    scaler.update()
    return stepped, p.data


def test_dynamic_scaler_skips_an_overflow_and_halves_then_grows():
    scaler = precision.GradScaler(init_scale=1024.0, growth_interval=3)
    stepped, weights = _sgd_step(scaler, np.inf)
    assert not stepped and scaler.get_scale() == 512.0 and scaler.skipped_steps == 1
    np.testing.assert_array_equal(weights, np.ones(3))  # untouched
    stepped, weights = _sgd_step(scaler, 0.25)
    assert stepped
    np.testing.assert_allclose(weights, 1 - 0.5 * 0.25)  # the unscaled gradient was applied
    _sgd_step(scaler, 0.25)
    assert scaler.get_scale() == 512.0
    _sgd_step(scaler, 0.25)  # the third good step in a row
    assert scaler.get_scale() == 1024.0 and scaler.steps == 4 and scaler.skipped_steps == 1
    _sgd_step(scaler, np.nan)
    assert scaler.get_scale() == 512.0 and scaler.skipped_steps == 2


def test_static_scaler_keeps_its_scale_but_still_skips_and_disabled_one_passes_through():
    static = precision.GradScaler(init_scale=128.0, dynamic=False, growth_interval=1)
    assert _sgd_step(static, np.inf)[0] is False and static.get_scale() == 128.0
    assert _sgd_step(static, 1.0)[0] is True and static.get_scale() == 128.0
    off = precision.GradScaler(enabled=False)
    loss = Tensor(np.float32(2.0))
    assert off.scale(loss) is loss and off.get_scale() == 1.0 and off.describe() == ""


def test_scaler_state_dict_round_trip_and_errors():
    a = precision.GradScaler(init_scale=256.0, growth_interval=5)
    _sgd_step(a, np.inf)
    _sgd_step(a, 1.0)
    b = precision.GradScaler(growth_interval=5)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    for scaler in (a, b):  # the growth tracker came along: 4 more good steps double both
        for _ in range(4):
            _sgd_step(scaler, 1.0)
    assert a.get_scale() == b.get_scale() == 256.0
    with pytest.raises(ValueError, match="same --precision and --loss-scale"):
        precision.GradScaler(dynamic=False).load_state_dict(a.state_dict())
    p = Tensor(np.ones(2, dtype=np.float32), requires_grad=True)
    p.grad = np.ones(2, dtype=np.float32)
    opt = optim.SGD([p], lr=0.1)
    a.unscale_(opt)
    with pytest.raises(RuntimeError, match="already called"):
        a.unscale_(opt)
    tiny = precision.GradScaler(init_scale=2.0 ** -24)
    with pytest.raises(FloatingPointError, match="diverged"):
        _sgd_step(tiny, np.inf)
    with pytest.raises(ValueError, match="init_scale"):
        precision.GradScaler(init_scale=0)


def test_bf16_keeps_float32_range_with_fewer_mantissa_bits():
    big, small = np.float32(1e30), np.float32(1e-30)
    for value in (big, small):
        back = np.float32(value).astype(BF16).astype(np.float32)
        assert abs(back - value) <= value * 2.0 ** -8  # 8 significant bits
    assert np.isinf(big.astype(np.float16)) and small.astype(np.float16) == 0
    one_plus = np.float32(1 + 2.0 ** -9)  # representable in float16 (11 bits), not in bfloat16 (8)
    assert one_plus.astype(np.float16) != 1 and one_plus.astype(BF16) == 1
    f16, b16, f32 = precision.finfo("fp16"), precision.finfo("bf16"), precision.finfo("fp32")
    assert (f16["exponent_bits"], f16["mantissa_bits"], f16["max"]) == (5, 10, 65504.0)
    assert (b16["exponent_bits"], b16["mantissa_bits"], b16["eps"]) == (8, 7, 2.0 ** -7)
    assert b16["smallest_normal"] == f32["smallest_normal"] == float(np.finfo(np.float32).tiny)
    assert f16["smallest_subnormal"] == 2.0 ** -24
    assert "bfloat16" in precision.format_table()
    with pytest.raises(ValueError, match="unknown precision"):
        precision.resolve_dtype("fp8")
    with pytest.raises(ValueError, match="CuPy has no bfloat16"):
        precision.autocast("bf16", device="cuda")


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_single_trains_to_95_percent_in_low_precision(dtype, digits):
    config = train.TrainConfig(precision=dtype, epochs=10, progress=False)
    result = train.train_single(config, digits, report=False)
    assert result.test_accuracy >= 0.95
    assert result.figures["precision"] == dtype
    assert ("loss_scale" in result.figures) == (dtype == "fp16")


def test_ddp_ranks_agree_on_skipping_an_overflowed_step(digits):
    def rank_fn(comm):
        ddp = DistributedDataParallel(nn.mlp([64, 16, 10], rng=0), comm)
        opt = optim.SGD(ddp.parameters(), lr=0.05)
        scaler = precision.GradScaler(init_scale=2.0 ** 40)  # overflows float16 until halved into range
        step = train.supervised_step(ddp, opt, precision="fp16", scaler=scaler)
        rank = comm.Get_rank()
        for i in range(12):
            rows = slice(32 * (2 * i + rank), 32 * (2 * i + rank + 1))
            step(digits.X_train[rows], digits.y_train[rows])
        return scaler.skipped_steps, scaler.get_scale(), [p.data.copy() for p in ddp.parameters()]

    (skip0, scale0, w0), (skip1, scale1, w1) = sim.run(rank_fn, 2)
    assert skip0 == skip1 >= 1 and scale0 == scale1 < 2.0 ** 40
    for a, b in zip(w0, w1):
        np.testing.assert_array_equal(a, b)


def test_ddp_trains_in_fp16_on_two_ranks(digits):
    config = train.TrainConfig(strategy="ddp", precision="fp16", epochs=6, progress=False, hidden=(64,))
    results = sim.run(lambda comm: train_ddp(comm, config, digits), 2)
    assert results[0].test_accuracy >= 0.9 and results[0].figures["precision"] == "fp16"


@pytest.mark.parametrize("args, message", [
    (["--strategy", "ps", "--precision", "fp16"],
     "--precision fp16 applies to --strategy single, ddp, fsdp and pipeline only, not to --strategy ps"),
    (["--strategy", "pipeline", "--schedule", "pipedream", "--precision", "bf16"], "not to --schedule pipedream"),
    (["--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
    (["--precision", "fp16", "--loss-scale", "0"], "loss scale must lie in [2^-24, 2^16] = [5.96e-08, 65536], got 0"),
    (["--precision", "fp16", "--loss-scale", "big"], "argument --loss-scale: must be dynamic, none or a number, got "
                                                     "'big'"),
    (["--loss-scale", "1024"], "--loss-scale applies to --precision fp16 or bf16 only"),
    (["--precision", "bf16", "--device", "cuda"], "--precision bf16 cannot run on --device cuda"),
])
def test_bad_precision_flags_are_usage_errors(args, message, capsys, monkeypatch):
    assert_usage_error(args, message, capsys, monkeypatch)


def test_precision_flags_become_the_config_and_its_scaler():
    parse = lambda *a: cli.train_config(cli.train_parser().parse_args(list(a)))
    assert (parse().precision, parse().loss_scale) == ("fp32", None)
    config = parse("--precision", "fp16", "--loss-scale", "512")
    assert (config.precision, config.loss_scale) == ("fp16", 512.0)
    static = precision.grad_scaler_for(config.precision, config.loss_scale)
    assert static.get_scale() == 512.0 and not static.dynamic
    assert precision.grad_scaler_for("fp16").dynamic and precision.grad_scaler_for("fp16").get_scale() == 2.0 ** 16
    assert not precision.grad_scaler_for("bf16").is_enabled()
    assert precision.grad_scaler_for("bf16", "dynamic").is_enabled()


def test_pipeline_stages_agree_on_skipping_when_one_stage_overflows():
    def rank_fn(comm):  # two stages: only rank 0's gradient overflowed
        p = Tensor(np.ones(2, dtype=np.float32), requires_grad=True)
        p.grad = np.array([np.inf if comm.Get_rank() == 0 else 1.0, 1.0], dtype=np.float32)
        scaler = precision.GradScaler(init_scale=4.0)
        stepped = scaler.step(optim.SGD([p], lr=0.1), comm=comm)
        scaler.update()
        return stepped, scaler.get_scale(), p.data.copy()

    for stepped, scale, weights in sim.run(rank_fn, 2):
        assert stepped is False and scale == 2.0
        np.testing.assert_array_equal(weights, np.ones(2))


def _pipeline(p, digits, ranks=2):
    config = train.TrainConfig(strategy="pipeline", precision=p, epochs=2, progress=False, hidden=(64, 64, 64),
                               lr=0.05)
    return sim.run(lambda comm: train_pipeline(comm, config, digits), ranks)[0]


@pytest.fixture(scope="module")
def fp32_pipeline(digits):
    return _pipeline("fp32", digits)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_pipeline_trains_in_low_precision_and_sends_half_the_bytes(dtype, digits, fp32_pipeline):
    low = _pipeline(dtype, digits)
    assert low.figures["precision"] == dtype
    # the loss curve follows float32's (measured within 2%; accuracy after 2 epochs still swings by 0.09)
    np.testing.assert_allclose([h["loss"] for h in low.history], [h["loss"] for h in fp32_pipeline.history],
                               rtol=0.05)
    assert low.figures["pipeline_bytes_sent"] < 0.51 * fp32_pipeline.figures["pipeline_bytes_sent"]
    if dtype == "fp16":  # the one-process run is the oracle: the same rounding, the same loss scale, in one stage
        one = _pipeline(dtype, digits, ranks=1)
        assert [h["loss"] for h in one.history] == [h["loss"] for h in low.history]


@pytest.mark.skipif(not backend.cuda_available(), reason="needs CuPy and a GPU")
def test_fp16_trains_on_cuda_and_bf16_is_refused_there(digits):
    result = train.train_single(train.TrainConfig(precision="fp16", device="cuda", epochs=10, progress=False),
                                     digits, report=False)
    assert result.test_accuracy >= 0.95
    x = Tensor(np.ones((2, 3), dtype=np.float32), device="cuda")
    with pytest.raises(ValueError, match="bfloat16 arrays cannot live on a GPU"):
        precision.cast(x, "bf16")


def test_fp16_stopped_and_resumed_restores_the_scaler_bit_identically(tmp_path, digits, monkeypatch):
    """The scale and its growth tracker are part of the training state (fault.Checkpointer's
    extra): a resumed run skips the same steps and ends with the uninterrupted run's weights."""
    # a scale that overflows at first and then keeps moving (halved, doubled every 7 good steps)
    monkeypatch.setattr(precision, "grad_scaler_for", lambda p, s=None: precision.GradScaler(2.0 ** 20,
                                                                                             growth_interval=7))

    config = train.TrainConfig(precision="fp16", epochs=2, progress=False, checkpoint_dir=str(tmp_path),
                               checkpoint_every=10)
    full, resumed = stop_and_resume(lambda config: train.train_single(config, digits, report=False), config, 55)
    assert full.figures["skipped_steps"] == resumed.figures["skipped_steps"] >= 1
    assert full.figures["loss_scale"] == resumed.figures["loss_scale"]
    assert_same_weights(full, resumed)
