"""The GPT's KV cache (issue 34, part 1): prefill and decode with the cache give the logits of the
whole sequence recomputed (float64, 1e-12, at every step, with and without tiles), generate gives
the same tokens with and without it (past block_size too), its bytes are the formula's, and its
limits are clear errors."""
import numpy as np
import pytest

from minidist import functions, workloads
from minidist.cli import tools
from minidist.models.gpt import GPT, GPTConfig
from minidist.models.kv_cache import KVCache, attend_in_tiles, kv_cache_bytes
from minidist.tensor import Tensor, no_grad

CONFIG = GPTConfig(vocab_size=11, block_size=12, n_layer=2, n_head=2, n_embd=8)


@pytest.fixture(scope="module")
def model():
    return GPT(CONFIG, rng=0, dtype="float64")


def recomputed(model, ids):
    """The oracle: the last position's logits of the whole sequence, no cache."""
    with no_grad():
        return model(ids)[0].data[:, -1, :]


@pytest.mark.parametrize("tile", [None, 1, 5])
def test_prefill_then_decode_gives_the_recomputed_logits_at_every_step(model, tile):
    rng = np.random.default_rng(1)
    ids = rng.integers(0, CONFIG.vocab_size, size=(2, 4))
    cache = KVCache(CONFIG.block_size, tile=tile)
    logits = model.forward_cached(ids, cache).data
    np.testing.assert_allclose(logits, recomputed(model, ids), rtol=0, atol=1e-12)
    while ids.shape[1] < CONFIG.block_size:
        ids = np.concatenate([ids, rng.integers(0, CONFIG.vocab_size, size=(2, 1))], axis=1)
        logits = model.forward_cached(ids[:, -1:], cache).data
        np.testing.assert_allclose(logits, recomputed(model, ids), rtol=0, atol=1e-12)
    assert cache.length == CONFIG.block_size


def test_several_positions_after_a_filled_cache_and_no_graph(model):
    ids = np.arange(9)[None] % CONFIG.vocab_size
    cache = KVCache(10)
    model.forward_cached(ids[:, :3], cache)
    out = model.forward_cached(ids[:, 3:], cache)  # six positions at once after three held
    np.testing.assert_allclose(out.data, recomputed(model, ids), rtol=0, atol=1e-12)
    assert not out.requires_grad and cache.length == 9


def test_tiled_attention_equals_the_fused_causal_op():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 3, 7, 4)) for _ in range(3))
    dense = functions.scaled_dot_product_attention(Tensor(q), Tensor(k), Tensor(v), is_causal=True).data
    for tile in (None, 1, 3, 7):
        out = attend_in_tiles(q, k, v, np.arange(7), np.arange(7), tile)
        np.testing.assert_allclose(out, dense, rtol=0, atol=1e-13)
    # the last three queries after four cached keys: the bottom rows of the causal attention
    np.testing.assert_allclose(attend_in_tiles(q[:, :, 4:], k, v, np.arange(4, 7), np.arange(7), 2),
                               dense[:, :, 4:], rtol=0, atol=1e-13)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_generate_gives_the_same_tokens_with_and_without_the_cache_past_block_size(dtype):
    model = GPT(CONFIG, rng=3, dtype=dtype)
    prompt = np.array([[1, 2, 3], [4, 5, 6]])
    for top_k, temperature in ((None, 1.0), (3, 0.7)):
        with_cache = model.generate(prompt, 20, temperature=temperature, top_k=top_k, rng=5)
        without = model.generate(prompt, 20, temperature=temperature, top_k=top_k, rng=5, use_cache=False)
        assert with_cache.shape == (2, 23) and np.array_equal(with_cache, without)
    long_prompt = np.arange(15)[None] % CONFIG.vocab_size  # longer than block_size: cropped, recomputed
    assert np.array_equal(model.generate(long_prompt, 4, rng=0), model.generate(long_prompt, 4, rng=0,
                                                                                  use_cache=False))


def test_the_cache_s_bytes_are_the_formula_s(model):
    cache = KVCache(CONFIG.block_size)
    assert cache.nbytes == 0  # made at each layer's first use
    model.forward_cached(np.zeros((3, 5), dtype=int), cache)
    # 2 (k and v) x 2 layers x 3 sequences x 12 positions x 8 channels x 8 bytes
    assert cache.nbytes == kv_cache_bytes(2, 8, 3, 12, 8) == 2 * 2 * 3 * 12 * 8 * 8
    # GPT-3 175B in 16-bit: 4.5 MiB per token (96 layers, C = 12,288)
    assert kv_cache_bytes(96, 12288, 1, 1, 2) == 4.5 * 2**20


def test_a_full_cache_and_positions_past_block_size_are_clear_errors(model):
    cache = KVCache(4)
    model.forward_cached(np.zeros((1, 3), dtype=int), cache)
    with pytest.raises(ValueError, match="do not fit: the cache holds 3 of at most 4"):
        model.forward_cached(np.zeros((1, 2), dtype=int), cache)
    big = KVCache(20)
    model.forward_cached(np.zeros((1, 12), dtype=int), big)
    with pytest.raises(ValueError, match="position 12 is past block_size = 12.*use_cache=False"):
        model.forward_cached(np.zeros((1, 1), dtype=int), big)
    with pytest.raises(ValueError, match="max_len must be an int >= 1"):
        KVCache(0)
    other = KVCache(8)
    model.forward_cached(np.zeros((2, 2), dtype=int), other)
    with pytest.raises(ValueError, match="one cache per batch"):
        model.forward_cached(np.zeros((3, 1), dtype=int), other)


def test_the_cli_s_no_kv_cache_flag_gives_the_same_text(capsys):
    text = "abcabcabd " * 30
    config = GPTConfig(vocab_size=len(set(text)), block_size=8, n_layer=1, n_head=2, n_embd=8)
    tokenizer = workloads.load_text(text).tokenizer
    model = GPT(config, rng=0)
    assert workloads.generate_text(model, tokenizer, "ab", 12, seed=1) == \
        workloads.generate_text(model, tokenizer, "ab", 12, seed=1, use_cache=False)
    parser = tools.generate_parser()
    assert parser.parse_args(["--checkpoint", "x", "--prompt", "a", "--no-kv-cache"]).kv_cache is False
    assert parser.parse_args(["--checkpoint", "x", "--prompt", "a"]).kv_cache is True
