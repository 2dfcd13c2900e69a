"""The paged KV cache, the continuous-batching scheduler and distributed decoding (issue 34, parts 2
and 3). The oracles: the GPT run on each whole sequence without a cache (logits, float64, 1e-12),
and ``GPT.generate`` of each request alone with the same seed (its tokens), whatever shared its batch,
on the sim's ranks and under mpiexec; the block budget counted by hand."""
from pathlib import Path

import numpy as np
import pytest
from mpitools import JOB_ENV, mpiexec_or_skip

from minidist import launch, sim
from minidist.models.gpt import GPT, GPTConfig
from minidist.serving import Event, PagedKVCache, ReplicaFront, Request, Scheduler, TensorParallelDecoder, serve_replica
from minidist.tensor import no_grad
from minidist.tracing import CountingComm

CONFIG = GPTConfig(vocab_size=13, block_size=24, n_layer=2, n_head=2, n_embd=8)


@pytest.fixture(scope="module")
def model():
    return GPT(CONFIG, rng=0, dtype="float64")


def requests(n, seed=0):
    """n requests of mixed prompt lengths, token counts and sampling settings."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(0, CONFIG.vocab_size, size=int(rng.integers(1, 9))).tolist()
        out.append(Request(prompt, int(rng.integers(1, 12)), temperature=float(rng.choice([0.5, 1.0, 1.5])),
                           top_k=[None, 3][i % 2], seed=100 + i))
    return out


def alone(model, request):
    """The oracle: GPT.generate of the request alone (no cache), its drawn tokens."""
    out = model.generate(np.array([request.prompt_ids]), request.max_tokens, temperature=request.temperature,
                         top_k=request.top_k, rng=request.seed, use_cache=False)
    return out[0, len(request.prompt_ids):].tolist()


def run(scheduler, arrivals, check=None):
    """Step ``scheduler`` until it is idle, adding ``arrivals[step]`` (lists of requests) before each
    step; returns ({id: tokens}, {id: reason}, {id: request}) and calls ``check(scheduler)`` after
    each step."""
    tokens, reasons, sent, step = {}, {}, {}, 0
    while step in arrivals or scheduler.has_work():
        for request in arrivals.get(step, []):
            sent[scheduler.add(request)] = request
        for event in scheduler.step():
            assert isinstance(event, Event) and event.request_id not in reasons
            if event.token_id is not None:
                tokens.setdefault(event.request_id, []).append(event.token_id)
            if event.finished:
                reasons[event.request_id] = event.reason
        if check:
            check(scheduler)
        step += 1
    return tokens, reasons, sent


def test_paged_attention_gives_each_row_the_logits_of_its_whole_sequence(model):
    cache = PagedKVCache(num_blocks=12, block_size=3)
    rng = np.random.default_rng(1)
    seqs = {name: rng.integers(0, CONFIG.vocab_size, size=n).tolist() for name, n in (("a", 7), ("b", 2), ("c", 4))}
    for name, ids in seqs.items():  # prefill each alone
        cache.allocate(name, len(ids))
        model.forward_cached(np.array([ids]), cache.batch([name]))
    for _ in range(5):  # decode the three together, each at its own length
        new = rng.integers(0, CONFIG.vocab_size, size=3)
        logits = model.forward_cached(new[:, None], cache.batch(["b", "a", "c"])).data
        for row, name in enumerate(["b", "a", "c"]):
            seqs[name].append(int(new[row]))
            with no_grad():
                whole = model(np.array([seqs[name]]))[0].data[0, -1]
            np.testing.assert_allclose(logits[row], whole, rtol=0, atol=1e-12)
    # blocks: ceil(12/3) + ceil(7/3) + ceil(9/3) = 4 + 3 + 3 taken, 2 free, the tables disjoint
    assert cache.num_free_blocks == 2 and cache.lengths == {"a": 12, "b": 7, "c": 9}
    taken = sum(cache.block_tables.values(), [])
    assert len(set(taken)) == len(taken) == 10
    assert cache.free("a") == 4 and cache.num_free_blocks == 6 and cache.free("zzz") == 0


def test_every_request_draws_what_generate_draws_for_it_alone_joining_and_leaving_mid_run(model):
    reqs = requests(10)
    arrivals = {0: reqs[:4], 2: reqs[4:7], 5: reqs[7:9], 9: reqs[9:]}  # more than max_batch, arriving mid-run
    sizes = []
    tokens, reasons, sent = run(Scheduler(model, kv_block_size=4, max_batch=3), arrivals,
                                lambda s: sizes.append(len(s.running)))
    assert set(reasons.values()) == {"length"} and len(sent) == 10
    for request_id, request in sent.items():
        assert tokens[request_id] == alone(model, request), request_id
    assert max(sizes) == 3 and 0 < min(sizes[:-1])  # the batch stays full while requests wait


def test_the_block_budget_is_respected_requests_wait_or_are_preempted_and_draw_the_same(model):
    reqs = [Request([1, 2, 3, 4, 5], 10, seed=i) for i in range(4)]  # 15 positions: 4 blocks of 4 each
    budget = 6
    scheduler = Scheduler(model, kv_block_size=4, num_kv_blocks=budget, max_batch=4)

    def check(s):
        used = sum(len(t) for t in s.kv_cache.block_tables.values())
        assert used + s.kv_cache.num_free_blocks == budget and used <= budget

    tokens, reasons, sent = run(scheduler, {0: reqs}, check)
    assert scheduler.preemptions > 0 and scheduler.kv_cache.num_free_blocks == budget
    for request_id, request in sent.items():
        assert tokens[request_id] == alone(model, request)
    with pytest.raises(ValueError, match="needs 5 KV blocks of 4 positions, the pool has 4"):
        Scheduler(model, kv_block_size=4, num_kv_blocks=4).add(Request([1] * 10, 8))


def test_static_batching_closes_the_batch_until_it_has_finished(model):
    reqs = [Request([1], 2, seed=0), Request([2], 9, seed=1), Request([3], 2, seed=2)]
    scheduler = Scheduler(model, max_batch=2, policy="static")
    first_tokens = {}
    step = 0
    for request in reqs:
        scheduler.add(request)
    while scheduler.has_work():
        for event in scheduler.step():
            first_tokens.setdefault(event.request_id, step)
        step += 1
    assert first_tokens == {0: 0, 1: 0, 2: 9}  # request 2 waits for request 1's nine tokens
    continuous = Scheduler(model, max_batch=2)
    tokens, _, _ = run(continuous, {0: reqs})
    assert tokens[2] == alone(model, reqs[2])


def test_cancel_frees_the_blocks_and_reports_the_request_finished(model):
    scheduler = Scheduler(model, kv_block_size=2, num_kv_blocks=20)
    keep = scheduler.add(Request([1, 2, 3], 6, seed=0))
    drop = scheduler.add(Request([4, 5, 6, 7, 8], 10, seed=1))
    queued = scheduler.add(Request([1], 8, seed=2))
    scheduler.step()
    scheduler.step()
    held = len(scheduler.kv_cache.block_tables[drop])
    free = scheduler.kv_cache.num_free_blocks
    scheduler.cancel(drop)
    scheduler.cancel(12345)  # unknown: ignored
    assert scheduler.kv_cache.num_free_blocks == free + held and drop not in scheduler.kv_cache.block_tables
    events = scheduler.step()
    assert events[0] == Event(drop, None, True, "cancelled")
    assert all(e.request_id != drop for e in events[1:])
    tokens, reasons, _ = run(scheduler, {})
    assert drop not in reasons and reasons[keep] == reasons[queued] == "length"
    assert scheduler.kv_cache.num_free_blocks == 20 and not scheduler.has_work()


@pytest.mark.parametrize("request_, message", [
    (Request([], 3), "the prompt is empty"),
    (Request([1, 13], 3), "prompt token 13 is not an id of the vocabulary"),
    (Request([1, -1], 3), "prompt token -1"),
    (Request([1] * 20, 5), r"plus max_tokens \(5\) is longer than the model's block_size \(24\); ask for at most 4"),
    (Request([1], 0), "max_tokens must be an int >= 1"),
    (Request([1], 3, temperature=0), "temperature must be > 0"),
    (Request([1], 3, top_k=0), "top_k must be None or an int >= 1"),
    ("hello", "takes a Request"),
])
def test_bad_requests_are_clear_errors_and_the_scheduler_goes_on(model, request_, message):
    scheduler = Scheduler(model)
    with pytest.raises(ValueError, match=message):
        scheduler.add(request_)
    assert not scheduler.has_work()
    good = Request([1, 2], 3, seed=4)
    tokens, _, _ = run(scheduler, {0: [good]})
    assert list(tokens.values()) == [alone(model, good)]


def test_bad_settings_are_clear_errors(model):
    with pytest.raises(ValueError, match="kv_block_size must be an int >= 1"):
        Scheduler(model, kv_block_size=0)
    with pytest.raises(ValueError, match="policy must be 'continuous' or 'static'"):
        Scheduler(model, policy="greedy")
    cache = PagedKVCache(2, 4)
    with pytest.raises(MemoryError, match="3 block"):
        cache.allocate("a", 9)


# ---------------------------------------------------------------- distributed decoding, on the sim


def test_tensor_parallel_decode_draws_the_one_process_tokens_with_half_the_kv_per_rank(model):
    reqs = requests(5, seed=3)

    def rank(comm):
        counted = CountingComm(comm, allow_collectives=True)
        decoder = TensorParallelDecoder(model, counted)
        # the gathered logits against the dense model's, prefill then decode
        cache = PagedKVCache(8, 4)
        cache.allocate(0, 5)
        ids = [1, 2, 3, 4, 5]
        first = decoder.forward_cached(np.array([ids]), cache.batch([0]))
        sent = []
        for token in (6, 7, 8, 9, 10, 11):  # decode steps at growing lengths (the blocks cross a boundary)
            before = counted.nbytes
            logits = decoder.forward_cached(np.array([[token]]), cache.batch([0]))
            sent.append(counted.nbytes - before)
            ids.append(token)
        with no_grad():
            whole = model(np.array([ids]))[0].data[0, -1]
        scheduler = Scheduler(decoder, kv_block_size=4, max_batch=3)
        tokens, _, sent_requests = run(scheduler, {0: reqs[:3], 2: reqs[3:]})
        return first, logits[0], whole, sent, cache.nbytes, tokens, sent_requests

    results = sim.run(rank, 2)
    dense_cache = PagedKVCache(8, 4)
    dense_cache.allocate(0, 5)
    dense_first = model.forward_cached(np.array([[1, 2, 3, 4, 5]]), dense_cache.batch([0])).data[0]
    for first, last, whole, sent, kv_bytes, tokens, sent_requests in results:
        np.testing.assert_allclose(first[0], dense_first, rtol=0, atol=1e-12)
        np.testing.assert_allclose(last, whole, rtol=0, atol=1e-12)
        assert kv_bytes * 2 == dense_cache.nbytes  # one head of two per rank
        assert len(set(sent)) == 1  # a decode step sends as much at any context length
        for request_id, request in sent_requests.items():
            assert tokens[request_id] == alone(model, request)
    assert results[0][5] == results[1][5]


def test_replicas_behind_one_front_serve_every_request_as_one_process_would(model):
    reqs = requests(7, seed=4)

    def rank(comm):
        scheduler = Scheduler(model, kv_block_size=4, max_batch=2)
        if comm.Get_rank() != 0:
            return serve_replica(comm, scheduler)
        front = ReplicaFront(comm, scheduler)
        for request in reqs[:5]:
            front.add(request)
        assert front.served == [2, 2, 1]
        front = ReplicaFront(comm, scheduler)
        tokens, reasons, sent = run(front, {0: reqs[:5], 3: reqs[5:]})
        front.close()
        return tokens, reasons, sent, front.served

    results = sim.run(rank, 3)
    tokens, reasons, sent, served = results[0]
    # five at once go 2, 2, 1 (the least loaded, lowest rank first); two more to the least loaded then
    assert sum(served) == 7 and min(served) >= 1 and set(reasons.values()) == {"length"}
    for request_id, request in sent.items():
        assert tokens[request_id] == alone(model, request)
    assert results[1] > 0 and results[2] > 0  # steps the replicas ran


@pytest.mark.mpi
def test_tensor_parallel_and_replicated_serving_under_mpiexec():
    """tests/mpi/serving_tp.py on 2 real ranks: TP 2 decode and 2 replicas, each request's tokens
    equal to GPT.generate of it alone in one process (float64), half the KV bytes per TP rank."""
    mpiexec_or_skip()
    script = Path(__file__).parent / "mpi" / "serving_tp.py"
    result = launch.launch(script, 2, timeout=180, env=JOB_ENV)
    assert result.ok and "SERVING TP OK" in result.stdout, result.stdout + result.stderr[-3000:]
