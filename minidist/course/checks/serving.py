"""The checks of exercise 22: the decode step with a KV cache, and an admission rule under a KV
block budget (chapter 22).

1. :func:`check_decode_step` takes your ``decode_step(model, cache, token)``: one position of a
   float64 ``models.gpt.GPT`` run with a KV cache. ``cache`` is the dict :func:`new_cache` makes,
   ``{"keys": [[] per layer], "values": [[] per layer], "length": 0}``; your step appends this
   position's keys and values, each (n_head, head_dim), to every layer's lists, attends the query
   to every position the lists hold (its own included), adds 1 to ``cache["length"]`` and returns
   the next-token logits (vocab_size,). The check feeds a prompt one token at a time (prefill as
   decode steps), then draws :data:`GENERATED` tokens greedily with your step, and compares every
   step's logits with the **recomputation**: the engine's ``GPT.forward`` on the whole sequence so
   far, its last position, to :data:`LOGITS_TOL` (float64), and the tokens with greedy decoding by
   recomputation. Fresh weights at every call. A wrong step is diagnosed against the check's own
   NumPy recomputation with the usual mistakes put in (:func:`recompute_logits`): keys appended
   after attending (a position that does not see itself), the new token's position embedding one
   off, the cache never grown.

2. :func:`check_admission` takes your ``admit(waiting, running, num_blocks, block_size)``: how many
   requests at the head of the queue ``waiting`` (a list of :class:`Waiting`, first come first
   served) may start now, given the requests ``running`` (a list of :class:`Running`) and a pool of
   ``num_blocks`` KV blocks of ``block_size`` positions. The check simulates the stream as the
   engine's ``Scheduler`` runs it, without preemption (:func:`simulate`): an admitted request
   takes the blocks of its prompt at once (prefill, one token drawn); every step after, it stores
   one more position and draws one more token, taking a new block whenever its positions cross
   into one; after ``max_tokens`` tokens it finishes and gives its blocks back. A request drawing
   n tokens holds prompt + n - 1 positions at its end. Three things must hold on every stream of
   :data:`STREAMS`: no running request ever needs a block when none is free (**out of blocks**);
   no request waits while the pool is empty (**starved**); and the stream ends within
   :data:`STEP_SLACK` of the steps of the exact rule (a rule that reserves every request's
   longest possible length, the pool's reserved maximum, is safe but too slow: the **target**).

A failure raises ``AssertionError("what: problem\\nHint: ...")``; your code raising gives a
:class:`minidist.course.checks.LearnerError` with your line. While your code runs, the engine's
cached and fused attention (``GPT.forward``, ``GPT.forward_cached``, ``Block.forward``,
``CausalSelfAttention.forward``, ``scaled_dot_product_attention``, the KV caches' ``attend``) and
this module's reference rules raise. On success each check returns its verdict::

    from minidist.course.checks import serving as serving_checks
    print(serving_checks.check_decode_step(decode_step))
    print(serving_checks.check_admission(admit))
"""
from __future__ import annotations

import math
import secrets
import sys
from typing import NamedTuple

import numpy as np

from minidist import functions
from minidist.course.checks import call_learner, check_own_code, fail, forbidding
from minidist.course.checks.integrity import unchanged
from minidist.models import gpt, kv_cache
from minidist.serving import kv_cache as paged
from minidist.tensor import Tensor, no_grad

CONFIG = dict(vocab_size=13, block_size=40, n_layer=2, n_head=2, n_embd=16)
PROMPT_LENGTHS = (1, 5)  # the prompts the decode step is run on, one token at a time
GENERATED = 20  # tokens drawn greedily after each prompt
LOGITS_TOL = 1e-10  # float64: the same sums as the recomputation in another order

HINTS = {
    "order": ("append this position's key and value to the layer's lists BEFORE attending: the query of position t "
              "attends to positions 0..t, itself included (causal attention keeps the diagonal)"),
    "position": ("the new token sits at position cache['length'] (0 for the first token): add wpe[cache['length']] "
                 "before the blocks, and add 1 to cache['length'] only once, after the last layer"),
    "grow": ("every step must append one key and one value per layer and add 1 to cache['length']; the next step "
             "attends to everything appended so far"),
    "logits": ("per layer: x + c_proj(attention(ln_1(x))), then x + mlp(ln_2(x)); after the last layer ln_f, then "
               "lm_head (the logits of this one position, shape (vocab_size,)); the attention is softmax(q . K / "
               "sqrt(head_dim)) over the cached positions, times V, one head at a time"),
    "shape": "return the logits of this one position: a float array of shape (vocab_size,)",
    "prompt_only": ("a running request keeps growing: it will hold prompt + max_tokens - 1 positions before it "
                    "finishes, so count ceil((prompt + max_tokens - 1) / block_size) blocks for each, not the "
                    "prompt's blocks only"),
    "running": ("a running request's blocks are not free until it finishes: count the blocks every running request "
                "holds and will still take (its whole length), and admit only what fits in the rest of the pool"),
    "starved": ("when nothing runs, the head of the queue fits the empty pool (the check makes sure): admit it; a "
                "rule that waits for more room than the pool has never starts anything"),
    "slow": ("reserve for each request the blocks of its own longest length, prompt + max_tokens - 1, not the most "
             "any request could hold: a reserved maximum per request is what paged KV exists to avoid"),
    "count": "return an int k, 0 <= k <= len(waiting): the first k waiting requests start now, in queue order",
}


# ----------------------------------------------------------------------------- 1. the decode step


def new_cache(n_layer: int) -> dict:
    """An empty cache for :func:`check_decode_step`: one list of keys and one of values per layer
    (each entry an (n_head, head_dim) array), and the positions held."""
    return {"keys": [[] for _ in range(n_layer)], "values": [[] for _ in range(n_layer)], "length": 0}


def _run(module, x: np.ndarray) -> np.ndarray:
    """A module of the engine on one position's vector x (C,) -> (C',)."""
    return module(Tensor(x[None])).data[0]


def recompute_logits(model, ids, *, self_attend: bool = True, shift: int = 0) -> np.ndarray:
    """The next-token logits (V,) of the last of ``ids``, recomputed over the whole sequence in NumPy
    from ``model``'s weights (the oracle for the diagnosis; the grading compares with the engine's
    ``GPT.forward``). ``self_attend=False``: each position attends to the earlier ones only (keys
    appended after attending); ``shift``: the position embeddings taken ``shift`` rows on."""
    tr, c, h = model.transformer, model.config.n_embd, model.config.n_head
    d, t = c // h, len(ids)
    x = tr.wte.weight.data[np.asarray(ids)] + tr.wpe.weight.data[np.arange(t) + shift]  # (T, C)
    mask = np.tril(np.ones((t, t), dtype=bool), 0 if self_attend else -1)
    for block in tr.h:
        qkv = block.attn.c_attn(block.ln_1(Tensor(x))).data.reshape(t, 3, h, d).transpose(1, 2, 0, 3)
        scores = np.where(mask, qkv[0] @ qkv[1].transpose(0, 2, 1) / math.sqrt(d), -np.inf)  # (H, T, T)
        top = np.max(scores, axis=-1, keepdims=True)
        weights = np.exp(scores - np.where(np.isfinite(top), top, 0.0))
        y = (weights / np.maximum(weights.sum(-1, keepdims=True), 1e-300)) @ qkv[2]  # (H, T, d)
        x = x + block.attn.c_proj(Tensor(y.transpose(1, 0, 2).reshape(t, c))).data
        x = x + block.mlp(block.ln_2(Tensor(x))).data
    return model.lm_head(tr.ln_f(Tensor(x[-1:]))).data[0]


def _diagnose(model, ids, got, cache) -> str:
    """The hint for a step whose logits ``got`` differ from the recomputation of ``ids``."""
    if cache["length"] != len(ids) or any(len(k) != len(ids) for k in cache["keys"]):
        return HINTS["grow"]
    for variant, hint in (({"self_attend": False}, "order"), ({"shift": 1}, "position"), ({"shift": -1}, "position")):
        try:
            expected = recompute_logits(model, ids, **variant)
        except IndexError:  # a shift past the position table
            continue
        if np.all(np.isfinite(expected)) and np.allclose(got, expected, rtol=0, atol=1e-8):
            return HINTS[hint]
    return HINTS["logits"]


def _step(decode_step, model, cache, token, what):
    got = call_learner(what, decode_step, model, cache, int(token), name="your decode_step",
                       hint=HINTS["order"] + "; " + HINTS["grow"])
    array = np.asarray(got.data if hasattr(got, "data") and not isinstance(got, np.ndarray) else got)
    if array.shape != (model.config.vocab_size,) or array.dtype.kind != "f":
        fail(what, f"returned {type(got).__name__} of shape {array.shape}", HINTS["shape"])
    return array.astype(np.float64)


def _generate(decode_step, model, prompt) -> list:
    """Run ``prompt`` then :data:`GENERATED` greedy tokens through your step, each step's logits
    against the recomputation; returns the tokens drawn."""
    cache, ids, drawn = new_cache(model.config.n_layer), [], []
    for i in range(len(prompt) + GENERATED):
        token = prompt[i] if i < len(prompt) else drawn[-1]
        ids.append(int(token))
        what = (f"prompt of {len(prompt)}: decode_step at position {i} "
                f"({'prompt token' if i < len(prompt) else f'generated token {i - len(prompt) + 1}'})")
        got = _step(decode_step, model, cache, token, what)
        with no_grad():
            expected = model(np.asarray([ids]))[0].data[0, -1]
        if not np.allclose(got, expected, rtol=0, atol=LOGITS_TOL):
            worst = float(np.nanmax(np.abs(got - expected))) if np.all(np.isfinite(got)) else float("nan")
            fail(what, f"the logits differ from the recomputation over the {len(ids)} positions by {worst:.3g} "
                       f"(allowed {LOGITS_TOL:g})", _diagnose(model, ids, got, cache))
        if i >= len(prompt) - 1:
            drawn.append(int(np.argmax(got)))
    return drawn[:GENERATED]


ENGINE_ATTENTION = (gpt.GPT.forward, gpt.GPT.forward_cached, gpt.GPT.generate, gpt.Block.forward,
                    gpt.CausalSelfAttention.forward, gpt.cached_attention, functions.scaled_dot_product_attention,
                    kv_cache.KVCache.attend, kv_cache.attend_in_tiles, paged.PagedBatch.attend)


@forbidding(*ENGINE_ATTENTION, recompute_logits)
@unchanged(sys.modules[__name__], gpt, np)
def check_decode_step(decode_step) -> str:
    """Check your ``decode_step(model, cache, token)`` (module docstring, part 1). Returns the
    verdict; raises AssertionError with a hint, or LearnerError."""
    check_own_code(decode_step, "decode_step")
    model = gpt.GPT(gpt.GPTConfig(**CONFIG), rng=secrets.randbits(32), dtype="float64").eval()
    rng = np.random.default_rng(secrets.randbits(32))
    lines = []
    for length in PROMPT_LENGTHS:
        prompt = rng.integers(0, CONFIG["vocab_size"], size=length).tolist()
        drawn = _generate(decode_step, model, prompt)
        with no_grad():  # greedy decoding by recomputation: the oracle's tokens
            ids = list(prompt)
            for _ in range(GENERATED):
                ids.append(int(np.argmax(model(np.asarray([ids]))[0].data[0, -1])))
        if drawn != ids[length:]:
            fail(f"prompt of {length}: the {GENERATED} tokens drawn greedily", f"expected {ids[length:]}, got {drawn}",
                 "each step's logits matched: draw the next token with np.argmax of your step's logits")
        lines.append(f"prompt of {length}: every step's logits equal the recomputation to {LOGITS_TOL:g}, "
                     f"{GENERATED} greedy tokens the same")
    return "decode_step: ok\n" + "\n".join(lines)


# ----------------------------------------------------------------------------- 2. admission


class Waiting(NamedTuple):
    """A request in the queue: its prompt's tokens and the tokens it asks for."""

    prompt_len: int
    max_tokens: int


class Running(NamedTuple):
    """A request being served: its prompt, what it asks for, the tokens drawn so far (>= 1)."""

    prompt_len: int
    max_tokens: int
    generated: int


# (num_blocks, block_size, [(arrival step, prompt_len, max_tokens), ...]): mixed lengths; the first stream
# runs out of blocks when the prompts alone are counted, the second starves a rule that waits for more room
STREAMS = (
    (12, 4, [(0, 3, 20), (0, 2, 14), (0, 5, 3), (1, 1, 30), (2, 6, 6), (2, 2, 9), (4, 4, 12), (6, 8, 2),
             (7, 1, 17), (9, 3, 5), (12, 2, 25), (15, 7, 8)]),
    (6, 8, [(0, 20, 28), (0, 1, 4), (1, 2, 40), (3, 5, 5), (3, 9, 11), (10, 1, 1), (10, 3, 16)]),
    (20, 4, [(s, 1 + (7 * s) % 9, 2 + (11 * s) % 23) for s in range(24)]),
)
MAX_LEN = 48  # the most positions any request may hold (the model's block_size): the reserved maximum
STEP_SLACK = 1.1  # the stream must end within 10 % of the exact rule's steps


def blocks_for(positions: int, block_size: int) -> int:
    """Blocks that hold ``positions`` positions: ceil(positions / block_size)."""
    return -(-positions // block_size)


def exact_admit(waiting, running, num_blocks: int, block_size: int) -> int:
    """The reference rule: first come first served, each request reserving the blocks of its own
    longest length, prompt + max_tokens - 1 positions."""
    left = num_blocks - sum(blocks_for(r.prompt_len + r.max_tokens - 1, block_size) for r in running)
    k = 0
    for w in waiting:
        need = blocks_for(w.prompt_len + w.max_tokens - 1, block_size)
        if need > left:
            break
        left, k = left - need, k + 1
    return k


def _first_fit(needs, left: int) -> int:
    """How many of ``needs`` (blocks, in queue order) fit in ``left`` blocks, first come first served."""
    k = 0
    for need in needs:
        if need > left:
            break
        left, k = left - need, k + 1
    return k


def _mistake(k: int, views, num_blocks: int, block_size: int) -> str | None:
    """The hint for admitting ``k`` requests where the exact rule admits fewer: the count of a rule
    that forgets the running requests ("running") or of one that counts prompts only ("prompt_only");
    None when both would admit as many."""
    waiting, running = views
    forgets_running = _first_fit([blocks_for(w.prompt_len + w.max_tokens - 1, block_size) for w in waiting], num_blocks)
    held = sum(blocks_for(r.prompt_len + r.generated - 1, block_size) for r in running)
    prompts_only = _first_fit([blocks_for(w.prompt_len, block_size) for w in waiting], num_blocks - held)
    if forgets_running == prompts_only:
        return None  # both mistakes admit k here: a later admission may tell them apart
    return "running" if k == forgets_running else "prompt_only"


def simulate(admit, num_blocks: int, block_size: int, stream, what: str, call=None) -> int:
    """Run ``stream`` under the rule ``admit`` (module docstring, part 2); returns the steps until
    every request has finished. ``call(admit, waiting, running)`` calls the rule (the learner's
    through :func:`call_learner`). Fails on out of blocks, a starved queue, a bad count."""
    call = call or (lambda rule, waiting, running: rule(waiting, running, num_blocks, block_size))
    pending = sorted(enumerate(stream), key=lambda item: (item[1][0], item[0]))
    queue, running, free, step = [], [], num_blocks, 0  # running: [id, prompt, max, generated, blocks held]
    overcommitted = None  # the hint for the first admission past the pool's whole-length reservation
    while pending or queue or running:
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, wanted) = pending.pop(0)
            queue.append((i, prompt, wanted))
        views = [Waiting(p, m) for _, p, m in queue], [Running(p, m, g) for _, p, m, g, _ in running]
        k = call(admit, *views)
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= len(queue):
            fail(f"{what}, step {step}", f"admit returned {k!r} with {len(queue)} waiting", HINTS["count"])
        if k == 0 and queue and not running:
            fail(f"{what}, step {step}", f"nothing runs, all {num_blocks} blocks are free, and request {queue[0][0]} "
                 f"(prompt {queue[0][1]}, max_tokens {queue[0][2]}) at the head of the queue was not admitted: "
                 "starved", HINTS["starved"])
        decoding, started = list(running), queue[:k]
        del queue[:k]
        if overcommitted is None and k > exact_admit(*views, num_blocks, block_size):
            overcommitted = _mistake(k, views, num_blocks, block_size)
        for i, prompt, wanted in started:  # prefill: the prompt's blocks at once, the first token drawn
            need = blocks_for(prompt, block_size)
            if need > free:
                fail(f"{what}, step {step}", f"request {i} was admitted with a prompt of {prompt} ({need} blocks) "
                     f"when {free} were free: out of blocks", HINTS["running"])
            free -= need
            running.append([i, prompt, wanted, 1, need])
        for seq in decoding:  # one more position stored, one more token drawn
            if blocks_for(seq[1] + seq[3], block_size) > seq[4]:
                if free == 0:
                    fail(f"{what}, step {step}", f"request {seq[0]} (prompt {seq[1]}, max_tokens {seq[2]}, "
                         f"{seq[3]} drawn) needs a new block for position {seq[1] + seq[3] - 1} and none of the "
                         f"{num_blocks} is free: out of blocks", HINTS[overcommitted] if overcommitted else
                         HINTS["running"] + "; and " + HINTS["prompt_only"])
                free, seq[4] = free - 1, seq[4] + 1
            seq[3] += 1
        for seq in [s for s in running if s[3] >= s[2]]:  # finished: its blocks back
            free += seq[4]
            running.remove(seq)
        step += 1
    return step


def reserved_maximum_admit(waiting, running, num_blocks: int, block_size: int) -> int:
    """The safe but slow rule: every request reserves :data:`MAX_LEN` positions (a contiguous
    cache's reservation), first come first served."""
    per = blocks_for(MAX_LEN, block_size)
    return max(0, min(len(waiting), num_blocks // per - len(running)))


@forbidding(exact_admit, reserved_maximum_admit, simulate)
@unchanged(sys.modules[__name__], np)
def check_admission(admit) -> str:
    """Check your ``admit(waiting, running, num_blocks, block_size)`` (module docstring, part 2)
    on :data:`STREAMS`. Returns the verdict; raises AssertionError with a hint, or LearnerError."""
    check_own_code(admit, "admit")

    def learner(rule, waiting, running, num_blocks, block_size, what):
        return call_learner(what, rule, list(waiting), list(running), num_blocks, block_size, name="your admit",
                            hint=HINTS["count"])

    lines = []
    for n, (num_blocks, block_size, stream) in enumerate(STREAMS):
        what = f"stream {n} ({len(stream)} requests, {num_blocks} blocks of {block_size})"
        target = simulate(exact_admit, num_blocks, block_size, stream, what)
        steps = simulate(admit, num_blocks, block_size, stream, what,
                         call=lambda rule, w, r, nb=num_blocks, bs=block_size, what=what: learner(rule, w, r, nb, bs,
                                                                                                   what))
        if steps > STEP_SLACK * target:
            fail(what, f"every request finished, in {steps} steps: the target is {math.floor(STEP_SLACK * target)} "
                       f"({target} for the exact reservation, +{round(100 * (STEP_SLACK - 1))} %)", HINTS["slow"])
        lines.append(f"{what}: never out of blocks, none starved, {steps} steps (target <= "
                     f"{math.floor(STEP_SLACK * target)})")
    return "admit: ok\n" + "\n".join(lines)


__all__ = ["CONFIG", "GENERATED", "HINTS", "LOGITS_TOL", "MAX_LEN", "STEP_SLACK", "STREAMS", "Running", "Waiting",
           "blocks_for", "check_admission", "check_decode_step", "exact_admit", "new_cache", "recompute_logits",
           "reserved_maximum_admit", "simulate"]
