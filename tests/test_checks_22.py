"""minidist.course.checks.serving (exercise 22): a right decode step and a right admission rule pass;
answers wrong in each usual way fail with their own hint: keys appended after attending (the first
position sees nothing), the new token's position embedding one off, a cache whose length never
grows, a missing 1/sqrt(head_dim), the engine's cached forward as the answer or called by it; an
admission rule that counts the prompts' blocks only, that forgets the running requests' blocks,
that reserves the longest possible sequence for each (safe, too slow), that never admits, that
returns a bad count, or that calls the checks' own rule. The checks' oracles are checked too: the
NumPy recomputation against the engine's GPT.forward, and the simulation's block accounting
against requests run alone (steps, a pool of exactly one request's blocks) and against the
engine's PagedKVCache."""
import math

import numpy as np
import pytest

from minidist.course.checks import STUB_HINT, LearnerError
from minidist.course.checks import serving as serving_checks
from minidist.models.gpt import GPT, GPTConfig
from minidist.serving import PagedKVCache, Request, Scheduler
from minidist.tensor import Tensor, no_grad

OWN = "own implementation, not yours"


def run(module, x):
    return module(Tensor(x[None])).data[0]


def decode_with(mistake=None):
    """A decode step, right or with one mistake."""

    def decode_step(model, cache, token):
        tr, config = model.transformer, model.config
        n_head, c = config.n_head, config.n_embd
        d = c // n_head
        position = cache["length"] + (1 if mistake == "position" else 0)
        x = tr.wte.weight.data[token] + tr.wpe.weight.data[position]
        for layer, block in enumerate(tr.h):
            q, k, v = run(block.attn.c_attn, run(block.ln_1, x)).reshape(3, n_head, d)
            if mistake != "after":
                cache["keys"][layer].append(k)
                cache["values"][layer].append(v)
            keys = np.stack(cache["keys"][layer], axis=1)
            values = np.stack(cache["values"][layer], axis=1)
            scores = np.einsum("hd,htd->ht", q, keys) / (1.0 if mistake == "scale" else np.sqrt(d))
            weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
            weights /= weights.sum(axis=-1, keepdims=True)
            if mistake == "after":
                cache["keys"][layer].append(k)
                cache["values"][layer].append(v)
            x = x + run(block.attn.c_proj, np.einsum("ht,htd->hd", weights, values).reshape(c))
            x = x + run(block.mlp, run(block.ln_2, x))
        if mistake != "no_grow":
            cache["length"] += 1
        return run(model.lm_head, run(tr.ln_f, x))

    return decode_step


def engine_inside(model, cache, token):
    """The engine's cached forward, called inside the answer."""
    from minidist.models.kv_cache import KVCache

    cache.setdefault("engine", KVCache(model.config.block_size))
    cache["length"] += 1
    return model.forward_cached(np.array([[token]]), cache["engine"]).data[0]


def test_the_right_decode_step_passes():
    verdict = serving_checks.check_decode_step(decode_with())
    assert verdict.startswith("decode_step: ok") and "20 greedy tokens the same" in verdict


@pytest.mark.parametrize("mistake, said", [
    ("after", "BEFORE attending"),
    ("position", "the new token sits at position cache['length']"),
    ("no_grow", "add 1 to cache['length']"),
    ("scale", "sqrt(head_dim)"),
])
def test_a_wrong_decode_step_fails_with_its_hint(mistake, said):
    with pytest.raises(AssertionError) as caught:
        serving_checks.check_decode_step(decode_with(mistake))
    assert said in str(caught.value), str(caught.value)


def test_the_engine_as_the_decode_step_fails():
    with pytest.raises(AssertionError, match=OWN):
        serving_checks.check_decode_step(GPT.forward_cached)
    with pytest.raises(LearnerError, match="called minidist.models.gpt.GPT.forward_cached"):
        serving_checks.check_decode_step(engine_inside)


def test_a_stub_says_so():
    def decode_step(model, cache, token):
        raise NotImplementedError()

    with pytest.raises(LearnerError, match=STUB_HINT[:40]):
        serving_checks.check_decode_step(decode_step)


def test_the_diagnosis_oracle_is_the_engines_recomputation():
    """recompute_logits (NumPy, used to name the mistake) equals GPT.forward to 1e-12; its
    variants are what the mistakes compute (checked by the right hints above)."""
    model = GPT(GPTConfig(**serving_checks.CONFIG), rng=5, dtype="float64")
    ids = [3, 1, 4, 1, 5, 9, 2]
    with no_grad():
        expected = model(np.array([ids]))[0].data[0, -1]
    np.testing.assert_allclose(serving_checks.recompute_logits(model, ids), expected, rtol=0, atol=1e-12)
    assert not np.allclose(serving_checks.recompute_logits(model, ids, shift=1), expected)


# ----------------------------------------------------------------------------- admission


def reserving(length, running_counted=True, minus=1):
    """An admission rule, first come first served, reserving length(request) positions each."""

    def admit(waiting, running, num_blocks, block_size):
        left = num_blocks - (sum(-(-length(r, minus) // block_size) for r in running) if running_counted else 0)
        k = 0
        for request in waiting:
            need = -(-length(request, minus) // block_size)
            if need > left:
                break
            left, k = left - need, k + 1
        return k

    return admit


def whole(request, minus):
    return request.prompt_len + request.max_tokens - minus


def prompt_only(request, minus):
    return request.prompt_len + getattr(request, "generated", 0)


def test_the_right_rules_pass():
    assert serving_checks.check_admission(reserving(whole)).startswith("admit: ok")
    assert serving_checks.check_admission(reserving(whole, minus=0)).startswith("admit: ok")  # one position to spare


@pytest.mark.parametrize("rule, said", [
    (reserving(prompt_only), "not the prompt's blocks only"),
    (reserving(whole, running_counted=False), "blocks are not free until it finishes"),
    (reserving(lambda r, m: serving_checks.MAX_LEN), "a reserved maximum per request"),
    (lambda waiting, running, num_blocks, block_size: 0, "starved"),
    (lambda waiting, running, num_blocks, block_size: len(waiting) + 1, "0 <= k <= len(waiting)"),
    (lambda waiting, running, num_blocks, block_size: -1, "0 <= k <= len(waiting)"),
])
def test_a_wrong_rule_fails_with_its_hint(rule, said):
    with pytest.raises(AssertionError) as caught:
        serving_checks.check_admission(rule)
    assert said in str(caught.value), str(caught.value)


def test_the_checks_own_rule_is_refused():
    with pytest.raises(AssertionError, match=OWN):
        serving_checks.check_admission(serving_checks.exact_admit)
    with pytest.raises(LearnerError, match="called minidist.course.checks.serving.exact_admit"):
        serving_checks.check_admission(lambda *args: serving_checks.exact_admit(*args))


@pytest.mark.parametrize("prompt, wanted, block_size", [(3, 10, 4), (8, 1, 4), (5, 12, 8), (1, 1, 1), (16, 17, 16)])
def test_the_simulation_counts_blocks_as_the_engine(prompt, wanted, block_size):
    """One request alone: it takes wanted steps (a prefill, then one token a step); a pool of
    exactly ceil((prompt + wanted - 1) / block_size) blocks suffices and one fewer runs out, as
    the engine's PagedKVCache counts when the Scheduler serves the request."""
    need = math.ceil((prompt + wanted - 1) / block_size)
    stream = [(0, prompt, wanted)]
    assert serving_checks.simulate(serving_checks.exact_admit, need, block_size, stream, "alone") == wanted
    if need > 1:
        greedy = reserving(prompt_only)  # admits on the prompt's blocks, then grows until the pool is empty
        if math.ceil(prompt / block_size) <= need - 1:
            with pytest.raises(AssertionError, match="out of blocks"):
                serving_checks.simulate(greedy, need - 1, block_size, stream, "short")
    model = GPT(GPTConfig(vocab_size=7, block_size=40, n_layer=1, n_head=1, n_embd=4), rng=0, dtype="float64")
    scheduler = Scheduler(model, kv_block_size=block_size, num_kv_blocks=need + 2, max_batch=1)
    scheduler.add(Request([1] * prompt, wanted, seed=0))
    most, steps = 0, 0
    while scheduler.has_work():
        scheduler.step()
        steps += 1
        most = max(most, scheduler.kv_cache.num_blocks - scheduler.kv_cache.num_free_blocks)
    cache = PagedKVCache(need, block_size)
    cache.allocate(0, prompt + wanted - 1)  # the engine's own count of the positions' blocks
    assert steps == wanted and cache.num_free_blocks == 0
    assert most == need or (wanted == 1 and most == 0)  # a one-token request frees its blocks within its step
