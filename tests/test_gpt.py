"""minidist.models.gpt: nanoGPT's names and shapes, GPT-2's initialisation, the tied head, gradients of a
whole block and a whole small model against finite differences (float64), overfitting one batch, seeded
sampling, and every error."""
import math

import numpy as np
import pytest

from minidist import Tensor, nn, optim
from minidist.course.checks import numerical_gradient
from minidist.models import GPT, GPTConfig
from minidist.models.gpt import Block

SMALL = GPTConfig(vocab_size=11, block_size=5, n_layer=2, n_head=2, n_embd=8)  # uneven sizes
rng = np.random.default_rng(7)


def small_gpt(**changes):
    config = GPTConfig(**{**SMALL.__dict__, **changes})
    return GPT(config, rng=0, dtype="float64")


def test_parameter_names_and_shapes_are_nanogpts():
    model = small_gpt()
    shapes = {name: p.shape for name, p in model.named_parameters()}
    v, t, c = 11, 5, 8
    expected = {"transformer.wte.weight": (v, c), "transformer.wpe.weight": (t, c)}
    for i in range(2):
        h = f"transformer.h.{i}."
        expected.update({h + "ln_1.weight": (c,), h + "ln_1.bias": (c,),
                         h + "attn.c_attn.weight": (3 * c, c), h + "attn.c_attn.bias": (3 * c,),
                         h + "attn.c_proj.weight": (c, c), h + "attn.c_proj.bias": (c,),
                         h + "ln_2.weight": (c,), h + "ln_2.bias": (c,),
                         h + "mlp.c_fc.weight": (4 * c, c), h + "mlp.c_fc.bias": (4 * c,),
                         h + "mlp.c_proj.weight": (c, 4 * c), h + "mlp.c_proj.bias": (c,)})
    expected.update({"transformer.ln_f.weight": (c,), "transformer.ln_f.bias": (c,)})
    assert shapes == expected  # lm_head.weight is wte's, listed once
    assert list(shapes) == list(expected)


def test_without_bias_there_are_no_bias_parameters():
    names = [n for n, _ in small_gpt(bias=False).named_parameters()]
    assert not any(n.endswith(".bias") for n in names) and "transformer.h.1.ln_2.weight" in names


def test_lm_head_is_tied_to_the_token_embedding():
    model = small_gpt()
    assert model.lm_head.weight is model.transformer.wte.weight
    assert sum(p is model.lm_head.weight for p in model.parameters()) == 1
    state = model.state_dict()
    assert list(state)[-1] == "lm_head.weight" and "transformer.wte.weight" in state
    np.testing.assert_array_equal(state["lm_head.weight"], state["transformer.wte.weight"])
    other = GPT(SMALL, rng=1, dtype="float64")
    other.load_state_dict(state)
    assert other.lm_head.weight is other.transformer.wte.weight
    idx = rng.integers(0, 11, (2, 5))
    np.testing.assert_array_equal(other(idx)[0].data, model(idx)[0].data)


def test_num_params_follows_nanogpt():
    model = small_gpt()
    v, t, c, layers = 11, 5, 8, 2
    per_block = 2 * 2 * c + (3 * c * c + 3 * c) + (c * c + c) + (4 * c * c + 4 * c) + (4 * c * c + c)
    total = v * c + t * c + layers * per_block + 2 * c
    assert model.num_params(non_embedding=False) == total == model.num_parameters()
    assert model.num_params() == total - t * c


def test_initialisation_is_gpt2s():
    config = GPTConfig(vocab_size=300, block_size=64, n_layer=4, n_head=4, n_embd=64)
    model = GPT(config, rng=0, dtype="float64")
    params = dict(model.named_parameters())
    residual = np.concatenate([p.data.ravel() for n, p in params.items() if n.endswith("c_proj.weight")])
    other = np.concatenate([p.data.ravel() for n, p in params.items()
                            if n.endswith(".weight") and p.ndim == 2 and not n.endswith("c_proj.weight")])
    assert abs(residual.std() / (0.02 / math.sqrt(2 * 4)) - 1) < 0.02
    assert abs(other.std() / 0.02 - 1) < 0.01 and abs(other.mean()) < 1e-3
    assert all(np.all(p.data == 0) for n, p in params.items() if n.endswith(".bias"))
    assert all(np.all(p.data == 1) for n, p in params.items() if n.endswith("ln_1.weight") or "ln_f.weight" in n)


def test_same_seed_same_weights():
    a, b, c = GPT(SMALL, rng=3), GPT(SMALL, rng=3), GPT(SMALL, rng=4)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        np.testing.assert_array_equal(p.data, q.data, err_msg=name)
    assert p.dtype == np.float32
    assert not np.array_equal(a.transformer.wte.weight.data, c.transformer.wte.weight.data)


def test_logits_and_loss():
    model = small_gpt()
    idx, targets = rng.integers(0, 11, (3, 4)), rng.integers(0, 11, (3, 4))
    logits, loss = model(idx)
    assert logits.shape == (3, 4, 11) and loss is None
    logits, loss = model(Tensor(idx), targets)
    z = logits.data - logits.data.max(-1, keepdims=True)
    log_probs = z - np.log(np.exp(z).sum(-1, keepdims=True))
    expected = -np.take_along_axis(log_probs, targets[..., None], -1).mean()
    np.testing.assert_allclose(loss.data, expected, rtol=1e-13)
    assert abs(float(loss.data) - math.log(11)) < 0.1  # small initial weights: close to uniform


def test_targets_of_minus_one_are_left_out():
    model = small_gpt()
    idx, targets = rng.integers(0, 11, (2, 5)), rng.integers(0, 11, (2, 5))
    masked = targets.copy()
    masked[:, 3:] = -1
    _, loss = model(idx, masked)
    logits, _ = model(idx)
    from minidist import functions as F

    expected = F.cross_entropy(logits[:, :3].reshape(6, 11), targets[:, :3].reshape(-1))
    np.testing.assert_allclose(loss.data, expected.data, rtol=1e-13)


def test_causal_position_t_does_not_see_later_tokens():
    model = small_gpt()
    idx = rng.integers(0, 11, (1, 5))
    changed = idx.copy()
    changed[0, 3:] = (idx[0, 3:] + 1) % 11
    a, b = model(idx)[0].data, model(changed)[0].data
    np.testing.assert_array_equal(a[:, :3], b[:, :3])
    assert not np.allclose(a[:, 3:], b[:, 3:])


def check_parameter_gradients(model, loss_of, entries=None, rtol=1e-5, atol=1e-8):
    """Every parameter's gradient of ``loss_of(model)`` against central differences (h = 1e-6):
    all entries, or ``entries`` random ones of each parameter (every parameter still checked)."""
    model.zero_grad()
    loss_of(model).backward()
    pick = np.random.default_rng(0)
    for name, p in model.named_parameters():
        flat = p.data.reshape(-1)  # a view: perturbing it perturbs the model
        chosen = range(flat.size) if entries is None or flat.size <= entries else pick.choice(flat.size, entries)
        for j in chosen:
            old = flat[j]
            flat[j] = old + 1e-6
            plus = float(loss_of(model).data)
            flat[j] = old - 1e-6
            minus = float(loss_of(model).data)
            flat[j] = old
            np.testing.assert_allclose(p.grad.reshape(-1)[j], (plus - minus) / 2e-6, rtol=rtol, atol=atol,
                                       err_msg=f"{name}[{j}]")


def test_block_gradients_match_finite_differences():
    block = Block(SMALL, rng=np.random.default_rng(0), dtype="float64", device="cpu")
    for p in block.parameters():  # away from the zero biases and unit LayerNorm weights
        p.data = p.data + 0.3 * rng.standard_normal(p.shape)
    x = rng.standard_normal((2, 5, 8))
    v = rng.standard_normal((2, 5, 8))
    x_tensor = Tensor(x, requires_grad=True)
    check_parameter_gradients(block, lambda m: (m(Tensor(x)) * v).sum())
    (block(x_tensor) * v).sum().backward()
    numeric = numerical_gradient(lambda xs: float((block(Tensor(xs[0])).data * v).sum()), [x.copy()])[0]
    np.testing.assert_allclose(x_tensor.grad, numeric, rtol=1e-5, atol=1e-8)


def test_whole_gpt_gradients_match_finite_differences_with_tied_weights():
    model = small_gpt()
    for p in model.parameters():
        p.data = p.data + 0.1 * rng.standard_normal(p.shape)
    idx = np.array([[1, 4, 4, 10, 0], [4, 4, 2, 9, 3], [7, 1, 0, 0, 5]])  # repeated tokens
    targets = np.array([[4, 4, 10, 0, 2], [4, 2, 9, 3, 3], [1, 0, 0, 5, 6]])
    # every parameter, 12 entries of each (all of them would take 20 s); wte's rows 4 and 0 repeat
    check_parameter_gradients(model, lambda m: m(idx, targets)[1], entries=12)


def test_shorter_sequences_and_t_equal_one():
    model = small_gpt()
    logits, loss = model(np.array([[3], [7]]), np.array([[1], [2]]))
    assert logits.shape == (2, 1, 11) and np.isfinite(loss.data)


def test_gpt_overfits_one_batch():
    config = GPTConfig(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=16)
    model = GPT(config, rng=0)
    batch = np.random.default_rng(1).integers(0, 13, (4, 9))
    idx, targets = batch[:, :-1], batch[:, 1:]
    optimizer = optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    first = None
    for _ in range(100):
        optimizer.zero_grad()
        _, loss = model(idx, targets)
        loss.backward()
        optimizer.step()
        first = first if first is not None else float(loss.data)
    assert first > 2.3  # about log(13) = 2.56 at the start
    assert float(loss.data) < 0.05  # memorised: 32 next tokens, each predicted with p > 0.95


def test_dropout_is_seeded_and_off_in_eval():
    config = GPTConfig(**{**SMALL.__dict__, "dropout": 0.3})
    idx = rng.integers(0, 11, (2, 5))
    a, b = GPT(config, rng=0, dtype="float64"), GPT(config, rng=0, dtype="float64")
    first, again = a(idx)[0].data, a(idx)[0].data
    assert not np.array_equal(first, again)  # a new mask each call
    np.testing.assert_array_equal(b(idx)[0].data, first)  # the same seed, the same masks
    a.eval()
    np.testing.assert_array_equal(a(idx)[0].data, a(idx)[0].data)
    np.testing.assert_allclose(a(idx)[0].data, small_gpt()(idx)[0].data, rtol=1e-12)  # eval: no dropout


def test_generate_is_seeded_crops_the_context_and_top_1_is_greedy():
    model = small_gpt()
    start = np.array([[1, 2], [3, 4]])
    out = model.generate(start, 9, rng=5)  # 11 tokens from a block of 5: the context is cropped
    assert out.shape == (2, 11) and out.dtype == np.int64
    np.testing.assert_array_equal(out[:, :2], start)
    np.testing.assert_array_equal(model.generate(start, 9, rng=5), out)
    assert out.min() >= 0 and out.max() < 11
    greedy = model.generate(start, 4, top_k=1)
    ids = start
    for _ in range(4):
        logits, _ = model(ids[:, -5:])
        ids = np.concatenate([ids, logits.data[:, -1].argmax(-1)[:, None]], axis=1)
    np.testing.assert_array_equal(greedy, ids)


def test_sampling_follows_the_temperature_and_top_k():
    from minidist.models.gpt import sample_next

    logits = np.log(np.array([[0.1, 0.2, 0.3, 0.4]])).repeat(20000, axis=0)
    draws = sample_next(logits, None, np.random.default_rng(0))
    np.testing.assert_allclose(np.bincount(draws, minlength=4) / 20000, [0.1, 0.2, 0.3, 0.4], atol=0.01)
    draws = sample_next(logits, 2, np.random.default_rng(0))
    np.testing.assert_allclose(np.bincount(draws, minlength=4) / 20000, [0, 0, 3 / 7, 4 / 7], atol=0.01)


# ---------------------------------------------------------------- errors


def test_config_errors():
    with pytest.raises(ValueError, match=r"n_embd \(10\) must be divisible by n_head \(4\)"):
        GPTConfig(vocab_size=5, block_size=4, n_layer=1, n_head=4, n_embd=10)
    with pytest.raises(ValueError, match="vocab_size must be an int >= 1"):
        GPTConfig(vocab_size=0, block_size=4, n_layer=1, n_head=1, n_embd=4)
    with pytest.raises(ValueError, match="dropout"):
        GPTConfig(vocab_size=5, block_size=4, n_layer=1, n_head=1, n_embd=4, dropout=1.0)
    with pytest.raises(TypeError, match="GPTConfig"):
        GPT({"vocab_size": 5})


def test_input_errors_name_the_limit():
    model = small_gpt()
    with pytest.raises(ValueError, match="vocab_size = 11"):
        model(np.array([[0, 11]]))
    with pytest.raises(ValueError, match="vocab_size = 11"):
        model(np.array([[-1, 2]]))
    with pytest.raises(ValueError, match="block_size = 5"):
        model(np.zeros((1, 6), dtype=int))
    with pytest.raises(ValueError, match=r"shape \(B, T\)"):
        model(np.zeros(4, dtype=int))
    with pytest.raises(ValueError, match=r"shape \(B, T\)"):
        model(np.zeros((1, 4)))
    with pytest.raises(ValueError, match="targets must have the shape of idx"):
        model(np.zeros((2, 4), dtype=int), np.zeros((2, 3), dtype=int))
    with pytest.raises(ValueError, match="in \\[0, 11\\)"):
        model(np.zeros((1, 3), dtype=int), np.array([[0, 1, 11]]))


def test_generate_errors():
    model = small_gpt()
    with pytest.raises(ValueError, match="temperature"):
        model.generate(np.array([[1]]), 2, temperature=0)
    with pytest.raises(ValueError, match="top_k"):
        model.generate(np.array([[1]]), 2, top_k=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(np.array([[1]]), -1)


def test_clip_grad_norm_on_a_gpt():
    model = small_gpt()
    _, loss = model(rng.integers(0, 11, (2, 5)), rng.integers(0, 11, (2, 5)))
    loss.backward()
    grads = np.concatenate([p.grad.ravel() for p in model.parameters()])
    total = nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    np.testing.assert_allclose(total, np.linalg.norm(grads), rtol=1e-12)
    clipped = np.concatenate([p.grad.ravel() for p in model.parameters()])
    np.testing.assert_allclose(np.linalg.norm(clipped), 1e-3, rtol=1e-5)
