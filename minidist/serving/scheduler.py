"""Continuous batching: requests join and leave the running batch at every step (Orca, vLLM).

A server that batches whole requests (**static batching**: take B requests, run them until the
longest is done, take the next B) wastes the batch: a request that wanted 5 tokens sits idle while
its neighbour draws 500, and a request that arrives meanwhile waits for the whole batch. Orca (Yu
et al., "Orca: A Distributed Serving System for Transformer-Based Generative Models", OSDI 2022)
schedules **per iteration** instead: each step of the model is one token for every running request,
and between two steps finished requests leave and waiting ones join. vLLM (Kwon et al., SOSP 2023)
adds the paged KV cache (:mod:`minidist.serving.kv_cache`), so that a request takes memory one block
at a time as it grows.

One :meth:`Scheduler.step`:

1. **admit**: waiting requests, first come first served, join while the batch has room
   (``max_batch``) and the free list holds their prompt's blocks (taken at once);
2. **prefill** each new request (its prompt in one forward with the cache; its first token
   sampled), one request at a time;
3. **decode** one token for every request that was running before this step, all in one batch of
   rows of different lengths; a request that needs a new block when none is free **preempts** the
   request admitted last (its blocks freed, back to the front of the queue with the tokens it has
   drawn, prefilled again later: vLLM's preemption by recompute, ``vllm/core/scheduler.py``,
   ``_preempt_by_recompute``);
4. requests with ``max_tokens`` tokens finish (reason ``"length"``) and free their blocks.

Sampling is per request: its own generator (``seed``), temperature and top-k, through
``models.gpt.sample_next``, so each request draws the tokens ``GPT.generate`` draws for it alone with
the same seed, whoever shares its batch. ``policy="static"`` keeps the batch closed until every
request in it has finished, for comparison (finished rows stop computing: the kindest static batch).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from minidist import backend
from minidist.models.gpt import sample_next
from minidist.serving.kv_cache import PagedKVCache


@dataclass
class Request:
    """A completion request: ``prompt_ids`` (token ids, at least one), ``max_tokens`` (>= 1) to draw,
    ``temperature`` (> 0), ``top_k`` (None: the whole vocabulary) and ``seed`` (None: fresh entropy)."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    seed: int | None = None


@dataclass
class Event:
    """What a step did to a request: a new ``token_id`` (None when none was drawn) and whether it
    ``finished``, with its ``reason``: ``"length"`` (max_tokens drawn; OpenAI's finish_reason),
    ``"cancelled"``, or ``"error: ..."``."""

    request_id: int
    token_id: int | None
    finished: bool
    reason: str | None


@dataclass
class Sequence:
    """A request being served: its tokens so far (prompt then drawn), its generator, when it ran."""

    request_id: int
    request: Request
    generator: np.random.Generator
    tokens: list = field(default_factory=list)  # drawn so far
    cached: int = 0  # positions in the KV cache

    @property
    def ids(self) -> list:
        """The prompt's ids, then the tokens drawn."""
        return list(self.request.prompt_ids) + self.tokens

    @property
    def finished(self) -> bool:
        """True once max_tokens tokens are drawn."""
        return len(self.tokens) >= self.request.max_tokens


def check_request(request, config) -> None:
    """Raise ValueError naming the fix when ``request`` cannot be served by a model of ``config``
    (a ``GPTConfig``): not a Request, an empty prompt, ids outside [0, vocab_size), max_tokens < 1,
    prompt + max_tokens > block_size (the positions the model has), temperature <= 0, top_k < 1."""
    if not isinstance(request, Request):
        raise ValueError(f"Scheduler.add takes a Request, got {type(request).__name__}")
    ids = request.prompt_ids
    if not isinstance(ids, (list, tuple, np.ndarray)) or len(ids) == 0:
        raise ValueError("the prompt is empty: give at least one token to start from")
    if any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < config.vocab_size for i in ids):
        bad = next(i for i in ids if isinstance(i, bool) or not isinstance(i, (int, np.integer))
                   or not 0 <= i < config.vocab_size)
        raise ValueError(f"prompt token {bad!r} is not an id of the vocabulary [0, {config.vocab_size})")
    n = request.max_tokens
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"max_tokens must be an int >= 1, got {n!r}")
    if len(ids) + n > config.block_size:
        raise ValueError(f"the prompt ({len(ids)} tokens) plus max_tokens ({n}) is longer than the model's "
                         f"block_size ({config.block_size}); ask for at most {config.block_size - len(ids)} tokens "
                         "or shorten the prompt")
    if isinstance(request.temperature, bool) or not isinstance(request.temperature, (int, float)) or \
            not request.temperature > 0:
        raise ValueError(f"temperature must be > 0, got {request.temperature!r} (greedy decoding: top_k=1)")
    k = request.top_k
    if k is not None and (isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {k!r}")


class Scheduler:
    """Iteration-level scheduling over a paged KV cache (module docstring).

    Args:
        model: a GPT (``models.gpt.GPT``, in eval mode, dropout off), or anything with its
            ``config`` and ``forward_cached(idx, kv_cache) -> logits (B, V)`` (a tensor-parallel
            decoder: :mod:`minidist.serving.tp_decode`).
        kv_block_size: positions per KV block (vLLM's default 16).
        num_kv_blocks: blocks in the pool; None: enough for ``max_batch`` sequences of block_size
            positions (never short). Fewer blocks make requests wait (or be preempted), never fail.
        max_batch: the most requests running at once.
        policy: ``"continuous"`` (join and leave at every step) or ``"static"`` (a new batch only
            when the last one has finished).

    Not thread-safe: one thread calls ``add``, ``cancel`` and ``step``. Raises ValueError for a bad
    argument.
    """

    def __init__(self, model, *, kv_block_size=16, num_kv_blocks=None, max_batch=8, policy="continuous"):
        for name, value in (("kv_block_size", kv_block_size), ("max_batch", max_batch),
                            ("num_kv_blocks", 1 if num_kv_blocks is None else num_kv_blocks)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"Scheduler: {name} must be an int >= 1, got {value!r}")
        if policy not in ("continuous", "static"):
            raise ValueError(f"Scheduler: policy must be 'continuous' or 'static', got {policy!r}")
        self.model, self.config, self.max_batch, self.policy = model, model.config, int(max_batch), policy
        if num_kv_blocks is None:
            num_kv_blocks = max_batch * -(-self.config.block_size // kv_block_size)
        self.kv_cache = PagedKVCache(num_kv_blocks, kv_block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self.pending_events: list[Event] = []
        self.next_id = 0
        self.preemptions = 0

    def add(self, request: Request) -> int:
        """Queue ``request``; returns its id. Raises ValueError (:func:`check_request`), also when
        its prompt and tokens could never fit in the whole pool."""
        check_request(request, self.config)
        need = self.kv_cache.blocks_for(len(request.prompt_ids) + request.max_tokens - 1)
        if need > self.kv_cache.num_blocks:
            raise ValueError(f"the request needs {need} KV blocks of {self.kv_cache.block_size} positions, the pool "
                             f"has {self.kv_cache.num_blocks}; ask for fewer tokens or make num_kv_blocks larger")
        request_id, self.next_id = self.next_id, self.next_id + 1
        generator = np.random.default_rng(request.seed)
        self.waiting.append(Sequence(request_id, request, generator))
        return request_id

    def cancel(self, request_id: int) -> None:
        """Stop ``request_id`` now, free its KV blocks; the next ``step`` reports it finished with
        reason ``"cancelled"``. Unknown or finished ids are ignored."""
        for queue in (self.waiting, self.running):
            for seq in list(queue):
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self.kv_cache.free(request_id)
                    self.pending_events.append(Event(request_id, None, True, "cancelled"))

    def has_work(self) -> bool:
        """True while a request waits or runs, or an event waits to be reported."""
        return bool(self.waiting or self.running or self.pending_events)

    def step(self) -> list[Event]:
        """One iteration (module docstring): admit, prefill the new requests, decode one token for
        the others. Returns the events in order: cancellations, then one per token drawn (the last
        of a request ``finished``)."""
        events, self.pending_events = self.pending_events, []
        decoding = list(self.running)
        for seq in self.admit():
            events.append(self.prefill(seq))
        self.running = [seq for seq in self.running if not seq.finished]
        decoding = self.make_room(decoding)
        if decoding:
            events.extend(self.decode(decoding))
        self.running = [seq for seq in self.running if not seq.finished]
        return events

    def admit(self) -> list[Sequence]:
        """Move waiting requests to the running batch while there is room and their blocks are free
        (first come, first served: one that does not fit stops the queue). Static: only into an
        empty batch."""
        if self.policy == "static" and self.running:
            return []
        admitted = []
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            if self.kv_cache.blocks_for(len(seq.ids)) > self.kv_cache.num_free_blocks:
                break
            self.waiting.popleft()
            self.kv_cache.allocate(seq.request_id, len(seq.ids))  # its blocks now, before the next one is weighed
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def prefill(self, seq: Sequence) -> Event:
        """Run ``seq``'s prompt (and the tokens it drew before a preemption) into its blocks and
        draw its next token."""
        ids = seq.ids  # its blocks were taken by admit
        logits = self.model.forward_cached(np.asarray([ids]), self.kv_cache.batch([seq.request_id]))
        seq.cached = len(ids)
        return self.sample(seq, logits_row(logits, 0))

    def make_room(self, decoding: list[Sequence]) -> list[Sequence]:
        """The requests of ``decoding`` that can take one more position, preempting the requests
        admitted last (themselves included) until the free list covers the rest."""
        while decoding:
            need = sum(self.kv_cache.blocks_needed(seq.request_id, 1) for seq in decoding)
            if need <= self.kv_cache.num_free_blocks:
                return decoding
            victim = self.running.pop()
            self.kv_cache.free(victim.request_id)
            victim.cached = 0
            self.waiting.appendleft(victim)
            self.preemptions += 1
            decoding = [seq for seq in decoding if seq is not victim]
        return decoding

    def decode(self, decoding: list[Sequence]) -> list[Event]:
        """One token for each request of ``decoding``, one forward for all of them."""
        last = np.asarray([[seq.ids[-1]] for seq in decoding])
        logits = self.model.forward_cached(last, self.kv_cache.batch([seq.request_id for seq in decoding]))
        events = []
        for row, seq in enumerate(decoding):
            seq.cached += 1
            events.append(self.sample(seq, logits_row(logits, row)))
        return events

    def sample(self, seq: Sequence, logits: np.ndarray) -> Event:
        """Draw ``seq``'s next token from ``logits`` (V,) as ``GPT.generate`` does; free its blocks
        when it is the last."""
        request = seq.request
        token = int(sample_next(logits[None] / request.temperature, request.top_k, seq.generator)[0])
        seq.tokens.append(token)
        finished = seq.finished
        if finished:
            self.kv_cache.free(seq.request_id)
        return Event(seq.request_id, token, finished, "length" if finished else None)

    def stats(self) -> dict:
        """Counts for a health check: requests waiting and running, KV blocks free and in all,
        preemptions so far."""
        return {"waiting": len(self.waiting), "running": len(self.running), "preemptions": self.preemptions,
                "kv_blocks_free": self.kv_cache.num_free_blocks, "kv_blocks": self.kv_cache.num_blocks}


def logits_row(logits, row: int) -> np.ndarray:
    """Row ``row`` of a model's logits (B, V) (a Tensor or an array) as float64 NumPy (V,)."""
    data = logits.data if hasattr(logits, "data") and not isinstance(logits, np.ndarray) else logits
    return backend.to_numpy(data[row]).astype(np.float64)
