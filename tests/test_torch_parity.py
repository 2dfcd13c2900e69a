"""The same expressions in PyTorch (float64): values and gradients must agree.
Skipped when torch is not installed (it is not a dependency)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import minidist.functions as F  # noqa: E402
from minidist import Tensor, nn, optim  # noqa: E402

rng = np.random.default_rng(3)

def both(fn_md, fn_t, *arrays):
    md = [Tensor(a.copy(), requires_grad=True) for a in arrays]
    th = [torch.tensor(a, requires_grad=True) for a in arrays]
    out_md, out_t = fn_md(*md), fn_t(*th)
    np.testing.assert_allclose(out_md.data, out_t.detach().numpy(), rtol=1e-10, atol=1e-12)
    v = rng.standard_normal(out_md.shape)
    out_md.backward(v)
    out_t.backward(torch.tensor(v))
    for a, b in zip(md, th):
        np.testing.assert_allclose(a.grad, b.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_elementwise_and_broadcasting():
    both(lambda a, b: (a * b - a / b + 2) ** 2 - (-a).exp() + b.log(),
         lambda a, b: (a * b - a / b + 2) ** 2 - (-a).exp() + b.log(),
         rng.standard_normal((3, 4)), rng.uniform(0.5, 2, (4,)))


def test_activations_and_reductions():
    both(lambda a: a.relu().sum(axis=0) + a.tanh().mean(axis=1, keepdims=True) + a.sigmoid().max(axis=0),
         lambda a: a.relu().sum(dim=0) + a.tanh().mean(dim=1, keepdim=True) + a.sigmoid().amax(dim=0),
         rng.standard_normal((5, 4)))


def test_matmul_batched_and_transpose():
    both(lambda a, b: (a @ b).transpose(0, 2, 1).reshape(2, -1),
         lambda a, b: (a @ b).permute(0, 2, 1).reshape(2, -1),
         rng.standard_normal((2, 3, 4)), rng.standard_normal((4, 5)))


def test_indexing():
    idx = np.array([2, 0, 2])
    both(lambda a: a[idx, 1:] * 2 + a[1, 1:], lambda a: a[torch.tensor(idx), 1:] * 2 + a[1, 1:],
         rng.standard_normal((3, 4)))


def test_log_softmax_and_cross_entropy():
    targets = np.array([1, 0, 3])
    both(lambda a: a.log_softmax(axis=-1), lambda a: torch.log_softmax(a, dim=-1), rng.standard_normal((3, 4)))
    both(lambda a: F.cross_entropy(a, targets),
         lambda a: torch.nn.functional.cross_entropy(a, torch.tensor(targets)), rng.standard_normal((3, 4)))


def test_training_steps_match_torch_sgd_with_momentum_and_weight_decay():
    model = nn.mlp([6, 8, 3], rng=0, dtype="float64")
    reference = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).double()
    with torch.no_grad():
        for (_, p), q in zip(model.named_parameters(), reference.parameters()):
            q.copy_(torch.from_numpy(p.data))
    opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)
    opt_t = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)
    for _ in range(5):
        x = rng.standard_normal((10, 6))
        y = rng.integers(0, 3, 10)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt_t.zero_grad()
        torch.nn.functional.cross_entropy(reference(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt_t.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        np.testing.assert_allclose(p.data, q.detach().numpy(), rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- the transformer (issue 19)

TF = torch.nn.functional


def test_transformer_ops_match_torch():
    idx = np.array([[3, 1, 3], [0, 3, 2]])
    both(lambda a: F.softmax(a, dim=1), lambda a: torch.softmax(a, dim=1), rng.standard_normal((2, 4, 3)))
    both(lambda a: F.gelu(a), lambda a: TF.gelu(a), 3 * rng.standard_normal((4, 5)))
    both(lambda a: F.gelu(a, approximate="tanh"), lambda a: TF.gelu(a, approximate="tanh"),
         3 * rng.standard_normal((4, 5)))
    both(lambda x, w, b: F.layer_norm(x, 6, w, b), lambda x, w, b: TF.layer_norm(x, (6,), w, b),
         rng.standard_normal((2, 3, 6)), rng.standard_normal(6), rng.standard_normal(6))
    both(lambda x, w: F.layer_norm(x, (3, 6), w), lambda x, w: TF.layer_norm(x, (3, 6), w),
         rng.standard_normal((2, 3, 6)), rng.standard_normal((3, 6)))
    both(lambda w: F.embedding(idx, w), lambda w: TF.embedding(torch.tensor(idx), w), rng.standard_normal((4, 5)))
    targets = np.array([1, -1, 3, 0])
    both(lambda a: F.cross_entropy(a, targets, ignore_index=-1),
         lambda a: TF.cross_entropy(a, torch.tensor(targets), ignore_index=-1), rng.standard_normal((4, 5)))


@pytest.mark.parametrize("is_causal", [False, True])
def test_attention_matches_torch(is_causal):
    both(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=is_causal),
         lambda q, k, v: TF.scaled_dot_product_attention(q, k, v, is_causal=is_causal),
         rng.standard_normal((2, 3, 5, 4)), rng.standard_normal((2, 3, 5, 4)), rng.standard_normal((2, 3, 5, 6)))
    mask = rng.random((5, 5)) > 0.3
    mask[:, 0] = True  # no row without a key
    both(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
         lambda q, k, v: TF.scaled_dot_product_attention(q, k, v, attn_mask=torch.tensor(mask)),
         rng.standard_normal((1, 2, 5, 3)), rng.standard_normal((1, 2, 5, 3)), rng.standard_normal((1, 2, 5, 3)))


def torch_gpt(params, idx, targets, config):
    """nanoGPT's forward written with torch.nn.functional, on a dict name -> torch tensor."""
    b, t = idx.shape
    c, h = config.n_embd, config.n_head
    x = params["transformer.wte.weight"][idx] + params["transformer.wpe.weight"][:t]
    for i in range(config.n_layer):
        p = {k[len(f"transformer.h.{i}."):]: v for k, v in params.items() if k.startswith(f"transformer.h.{i}.")}
        a = TF.layer_norm(x, (c,), p["ln_1.weight"], p["ln_1.bias"])
        q, k, v = TF.linear(a, p["attn.c_attn.weight"], p["attn.c_attn.bias"]).split(c, dim=2)
        q, k, v = (z.view(b, t, h, c // h).transpose(1, 2) for z in (q, k, v))
        y = TF.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + TF.linear(y, p["attn.c_proj.weight"], p["attn.c_proj.bias"])
        m = TF.layer_norm(x, (c,), p["ln_2.weight"], p["ln_2.bias"])
        m = TF.gelu(TF.linear(m, p["mlp.c_fc.weight"], p["mlp.c_fc.bias"]), approximate="tanh")
        x = x + TF.linear(m, p["mlp.c_proj.weight"], p["mlp.c_proj.bias"])
    x = TF.layer_norm(x, (c,), params["transformer.ln_f.weight"], params["transformer.ln_f.bias"])
    logits = TF.linear(x, params["transformer.wte.weight"])  # the tied head
    return logits, TF.cross_entropy(logits.view(b * t, -1), targets.view(-1), ignore_index=-1)


def test_gpt_logits_loss_and_gradients_match_torch():
    from minidist.models import GPT, GPTConfig

    config = GPTConfig(vocab_size=11, block_size=5, n_layer=2, n_head=2, n_embd=8)
    model = GPT(config, rng=0, dtype="float64")
    for p in model.parameters():  # away from zero biases and unit LayerNorm weights
        p.data = p.data + 0.1 * rng.standard_normal(p.shape)
    idx, targets = rng.integers(0, 11, (3, 5)), rng.integers(0, 11, (3, 5))
    targets[0, 1] = -1
    logits, loss = model(idx, targets)
    loss.backward()
    params = {n: torch.tensor(p.data, requires_grad=True) for n, p in model.named_parameters()}
    logits_t, loss_t = torch_gpt(params, torch.tensor(idx), torch.tensor(targets), config)
    loss_t.backward()
    np.testing.assert_allclose(logits.data, logits_t.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(loss.data, loss_t.item(), rtol=1e-10)
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.grad, params[name].grad.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_adam_steps_match_torch(name):
    model = nn.mlp([6, 8, 3], rng=0, dtype="float64")
    reference = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).double()
    with torch.no_grad():
        for p, q in zip(model.parameters(), reference.parameters()):
            q.copy_(torch.from_numpy(p.data))
    options = {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-7, "weight_decay": 0.05}
    opt = getattr(optim, name)(model.parameters(), **options)
    opt_t = getattr(torch.optim, name)(reference.parameters(), **options)
    for _ in range(6):
        x, y = rng.standard_normal((10, 6)), rng.integers(0, 3, 10)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        total = nn.utils.clip_grad_norm_(model.parameters(), 0.3)
        opt.step()
        opt_t.zero_grad()
        TF.cross_entropy(reference(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        total_t = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.3)
        opt_t.step()
        np.testing.assert_allclose(total, total_t.item(), rtol=1e-12)
    for p, q in zip(model.parameters(), reference.parameters()):
        np.testing.assert_allclose(p.data, q.detach().numpy(), rtol=1e-10, atol=1e-12)
