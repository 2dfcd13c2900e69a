"""Adam and AdamW against their closed forms (Kingma & Ba 2015, Algorithm 1; Loshchilov & Hutter 2019,
Algorithm 2, with torch's bias correction), L2 against decoupled decay, a bit-identical resume through a
checkpoint file, gradient clipping and the warm-up + cosine schedule."""
import math

import numpy as np
import pytest

import minidist.functions as F
from minidist import Tensor, nn, optim
from minidist.checkpoint_io import load_checkpoint, save_checkpoint


def param(values):
    return Tensor(np.array(values, dtype=np.float64), requires_grad=True)


def test_one_adamw_step_is_the_closed_form():
    p = param([1.0, -2.0, 0.5])
    p.grad = np.array([0.5, 0.1, -4.0])
    opt = optim.AdamW([p], lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    opt.step()
    # step 1: m = 0.1 g, v = 0.001 g², m / (1 - 0.9) = g, v / (1 - 0.999) = g², so the step is
    # lr · g / (|g| + eps): sign(g) · lr, after the weights shrink by 1 - lr · wd = 0.99
    g = np.array([0.5, 0.1, -4.0])
    expected = np.array([1.0, -2.0, 0.5]) * 0.99 - 0.1 * g / (np.abs(g) + 1e-8)
    np.testing.assert_allclose(p.data, expected, rtol=1e-15)
    np.testing.assert_allclose(opt.exp_avg[0], 0.1 * g, rtol=1e-15)
    np.testing.assert_allclose(opt.exp_avg_sq[0], 0.001 * g * g, rtol=1e-14)


def test_adamw_steps_follow_algorithm_2_written_out():
    lr, (b1, b2), eps, wd = 0.05, (0.8, 0.95), 1e-6, 0.2
    p = param([0.3, -1.2])
    opt = optim.AdamW([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    x, m, v = [0.3, -1.2], [0.0, 0.0], [0.0, 0.0]
    for t, grads in enumerate([[1.0, -0.5], [0.2, 0.3], [-2.0, 0.0]], start=1):
        p.grad = np.array(grads)
        opt.step()
        for i, g in enumerate(grads):  # scalar Python, one weight at a time
            x[i] *= 1 - lr * wd
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            x[i] -= lr * (m[i] / (1 - b1**t)) / (math.sqrt(v[i] / (1 - b2**t)) + eps)
        np.testing.assert_allclose(p.data, x, rtol=1e-14)
    assert opt.steps == 3 and opt.step_count == [3]


def test_adam_adds_l2_to_the_gradient_where_adamw_decays_the_weights():
    # a zero gradient: AdamW only shrinks the weight; Adam's L2 term becomes the gradient, and
    # Adam's normalisation turns it into a full step of lr against the weight's sign
    a, w = param([2.0, -3.0]), param([2.0, -3.0])
    a.grad = w.grad = np.zeros(2)
    optim.Adam([a], lr=0.1, weight_decay=0.5).step()
    optim.AdamW([w], lr=0.1, weight_decay=0.5).step()
    np.testing.assert_allclose(w.data, [2.0 * 0.95, -3.0 * 0.95], rtol=1e-15)
    np.testing.assert_allclose(a.data, [2.0 - 0.1, -3.0 + 0.1], rtol=1e-8)  # eps: 1e-8 of the step
    # without decay the two are the same algorithm
    a, w = param([1.0]), param([1.0])
    for g in ([0.3], [-0.1]):
        a.grad, w.grad = np.array(g), np.array(g)
        optim.Adam([a], lr=0.1).step()
        optim.AdamW([w], lr=0.1, weight_decay=0.0).step()
    np.testing.assert_array_equal(a.data, w.data)


def test_adam_defaults_are_torchs():
    opt = optim.AdamW([param([1.0])])
    assert (opt.lr, opt.betas, opt.eps, opt.weight_decay) == (1e-3, (0.9, 0.999), 1e-8, 0.01)
    assert optim.Adam([param([1.0])]).weight_decay == 0.0


def test_parameters_without_gradient_are_skipped_and_keep_their_step():
    p, q = param([1.0]), param([1.0])
    opt = optim.AdamW([p, q], lr=0.1)
    p.grad = np.array([1.0])
    opt.step()
    assert q.data[0] == 1.0 and opt.step_count == [1, 0] and opt.exp_avg[1] is None
    opt.zero_grad()
    assert p.grad is None


def train(model, opt, batches, schedule=None):
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        if schedule is not None:
            schedule.step()
        opt.step()


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_resume_through_a_checkpoint_file_is_bit_identical(tmp_path, name):
    data = np.random.default_rng(0)
    batches = [(data.standard_normal((6, 4)), data.integers(0, 3, 6)) for _ in range(6)]

    def fresh():
        model = nn.mlp([4, 5, 3], rng=1)
        opt = getattr(optim, name)(model.parameters(), lr=0.01, weight_decay=0.1)
        return model, opt, optim.WarmupCosineLR(opt, warmup_steps=2, max_steps=5, min_lr=0.001)

    model, opt, schedule = fresh()
    train(model, opt, batches, schedule)
    resumed, opt2, schedule2 = fresh()
    train(resumed, opt2, batches[:3], schedule2)
    save_checkpoint(tmp_path / "ckpt.npz", {"model": dict(resumed.state_dict()), "optimizer": opt2.state_dict(),
                                            "schedule": {k: v for k, v in vars(schedule2).items() if k != "optimizer"}})
    resumed, opt2, schedule2 = fresh()
    state = load_checkpoint(tmp_path / "ckpt.npz")
    resumed.load_state_dict(state["model"])
    opt2.load_state_dict(state["optimizer"])
    for key, value in state["schedule"].items():
        setattr(schedule2, key, value)
    assert opt2.betas == (0.9, 0.999) and opt2.step_count == [3, 3, 3, 3]
    train(resumed, opt2, batches[3:], schedule2)
    for p, q in zip(model.parameters(), resumed.parameters()):
        np.testing.assert_array_equal(p.data, q.data)


def test_load_state_dict_copies_and_checks_the_length():
    p = param([1.0, 2.0])
    p.grad = np.array([0.1, 0.2])
    opt = optim.AdamW([p])
    opt.step()
    state = opt.state_dict()
    state["exp_avg"][0][:] = 7
    assert opt.exp_avg[0][0] != 7  # state_dict hands out copies
    with pytest.raises(ValueError, match="2 exp_avg entries for 1 parameters"):
        opt.load_state_dict({**state, "exp_avg": state["exp_avg"] * 2})


def test_optimizer_errors():
    with pytest.raises(ValueError, match="empty parameter list"):
        optim.AdamW([])
    with pytest.raises(ValueError, match="requires_grad"):
        optim.Adam([Tensor(np.ones(2))])
    with pytest.raises(ValueError, match="lr must be >= 0"):
        optim.AdamW([param([1.0])], lr=-1)
    with pytest.raises(ValueError, match=r"betas must be two numbers in \[0, 1\)"):
        optim.AdamW([param([1.0])], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="eps"):
        optim.Adam([param([1.0])], eps=-1e-8)
    with pytest.raises(ValueError, match="weight_decay"):
        optim.AdamW([param([1.0])], weight_decay=-0.1)


# ---------------------------------------------------------------- clipping


def test_clip_grad_norm_scales_only_above_the_limit():
    p, q, r = param([0.0, 0.0]), param([0.0]), param([5.0])
    p.grad, q.grad = np.array([3.0, 0.0]), np.array([4.0])  # norm 5; r has no gradient
    total = nn.utils.clip_grad_norm_([p, q, r], max_norm=1.0)
    assert isinstance(total, float) and total == 5.0
    np.testing.assert_allclose(np.concatenate([p.grad, q.grad]), np.array([3.0, 0.0, 4.0]) / (5.0 + 1e-6), rtol=1e-15)
    before = p.grad.copy()
    assert nn.utils.clip_grad_norm_([p, q], max_norm=10.0) == pytest.approx(1.0, rel=1e-6)
    np.testing.assert_array_equal(p.grad, before)


def test_clip_grad_norm_inf_and_single_tensor_and_errors():
    p = param([0.0, 0.0, 0.0])
    p.grad = np.array([1.0, -6.0, 2.0])
    assert nn.utils.clip_grad_norm_(p, 3.0, norm_type=float("inf")) == 6.0
    np.testing.assert_allclose(p.grad, np.array([1.0, -6.0, 2.0]) * 3.0 / (6.0 + 1e-6))
    assert nn.clip_grad_norm_([param([1.0])], 1.0) == 0.0  # no gradients at all
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        nn.utils.clip_grad_norm_(p, 0.0)
    with pytest.raises(ValueError, match="norm_type"):
        nn.utils.clip_grad_norm_(p, 1.0, norm_type=0.5)


# ---------------------------------------------------------------- the schedule


def test_warmup_cosine_values():
    opt = optim.AdamW([param([1.0])], lr=0.6)
    schedule = optim.WarmupCosineLR(opt, warmup_steps=3, max_steps=7, min_lr=0.1)
    seen = []
    for _ in range(9):
        schedule.step()
        seen.append(opt.lr)
    cosine = [0.1 + 0.5 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in (1, 2, 3, 4)]
    np.testing.assert_allclose(seen, [0.2, 0.4, 0.6, *cosine, 0.1, 0.1], rtol=1e-15)
    assert seen[6] == pytest.approx(0.1)  # the end of the decay is min_lr


def test_warmup_cosine_errors():
    opt = optim.AdamW([param([1.0])], lr=0.1)
    with pytest.raises(ValueError, match="warmup_steps < max_steps"):
        optim.WarmupCosineLR(opt, 5, 5)
    with pytest.raises(ValueError, match="min_lr"):
        optim.WarmupCosineLR(opt, 1, 5, min_lr=0.2)
