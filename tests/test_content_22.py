"""Lesson 22 (serving) and its deck against their own outputs and their sources.

Every number the prose quotes is checked against what a cell printed in the committed notebook
(cells found by a phrase they contain), and the saved timings against the benchmark's JSON they
were read from. The arithmetic the lesson does (intensities, KV bytes, GPT-3's what-if from Table
2.1 of Brown et al. 2020, the H100's ridge point) is recomputed here from the formulas, and the
timeline's steps from a scheduler-free replay of the two policies, so that a changed engine fails
here and not silently in the prose. The live timing cell is ``# NBVAL_IGNORE_OUTPUT`` and the
prose quotes none of it.
"""
import ast
import json
import re

import pytest
from lesson_outputs import ROOT, cell_with, lesson, lesson_prose, number, printed

from minidist.course import quiz

NAME = "22_serving"
BENCH = json.loads((ROOT / "notebooks" / "measurements" / "bench_serving_run1.json").read_text())


@pytest.fixture(scope="module")
def nb():
    return lesson(NAME)


@pytest.fixture(scope="module")
def text(nb):
    return lesson_prose(nb)


def test_prefill_and_decode_intensities(nb, text):
    out = printed(cell_with(nb, "weights = 12 * layers * c * c"))
    weights = 12 * 4 * 512 * 512 + 65 * 512
    assert f"{weights:,} of them in matrix products" in out
    assert f"{4 * weights / 1e6:.1f} MB of weights:   0.5 FLOP/byte" in out and "32.0 FLOP/byte" in out
    assert "reads all 50.5 MB of weights" in text and f"{4 * weights / 1e6:.1f}" == "50.5"
    assert "half a FLOP per byte" in text
    roof = printed(cell_with(nb, "decode at 0.5 FLOP/byte can reach"))
    assert f"ridge point {BENCH['roofline']['ridge_flop_per_byte']:.2f} FLOP/byte" in roof
    assert "at most 1.04 GFLOP/s" in roof and "1.04 for its intensity" in text
    assert "timed-phases" == cell_with(nb, "prefill = time.perf_counter() - start").id
    assert cell_with(nb, "prefill = time.perf_counter() - start").source.startswith("# NBVAL_IGNORE_OUTPUT")


def test_the_kv_cache_is_exact_and_its_size(nb, text):
    out = printed(cell_with(nb, "small = GPT("))
    assert "positions held 26, largest logit difference from recomputing below 1e-12" in out
    assert "the same tokens: True" in out
    size = printed(cell_with(nb, "GPT3 = dict("))
    per_token = 2 * 96 * 12288 * 2  # Table 2.1: 96 layers, d_model 12,288; 16-bit
    assert f"{per_token:,} bytes = {per_token / 2**20:.1f} MiB per token" in size and per_token == 4_718_592
    assert f"{per_token * 2048 / 2**30:.1f} GiB for one sequence of 2,048 tokens" in size
    assert f"equals them at {350e9 / (per_token * 2048):.0f} full sequences" in size
    assert f"holds {int((640e9 - 350e9) // (per_token * 2048))} full-length sequences" in size
    assert f"at least {1e3 * 350e9 / (8 * 3.35e12):.1f} ms per token" in size
    assert "16,384 bytes = 16 KiB per token" in size and 2 * 4 * 512 * 4 == 16384
    assert "4.5 MiB per token: a single full-length GPT-3 sequence holds 9 GiB" in text
    assert "36 of them weigh as much as the 350 GB of weights" in text
    dec = BENCH["decode"]
    assert f"{dec['recompute_ms_per_token_batch_1']:.1f} ms per token recomputing" in size
    assert (f"recomputation took {dec['recompute_ms_per_token_batch_1']:.1f} ms per token against "
            f"{dec['rows'][0]['ms_per_step']:.1f} ms with the cache, {dec['cache_speedup_batch_1']:.1f} times") in text


def test_batching_on_the_roofline(nb, text):
    out = printed(cell_with(nb, 'rows = BENCH["decode"]["rows"]'))
    rows = {r["batch"]: r for r in BENCH["decode"]["rows"]}
    for batch, r in rows.items():
        assert re.search(rf"^\s*{batch} \|\s+{r['ms_per_step']:.1f} \|\s+{r['tokens_per_second']:.1f} \|", out, re.M)
    one = rows[1]
    assert (f"took {one['ms_per_step']:.1f} ms at batch 1, {one['tokens_per_second']:.1f} tokens/s, and reached "
            f"{one['gflops']:.2f} GFLOP/s") in text
    assert f"grow {rows[8]['tokens_per_second_vs_batch_1']:.2f} times" in text
    assert f"({one['ms_per_step']:.1f} to {rows[8]['ms_per_step']:.1f} ms)" in text
    assert f"batch 32 gives {rows[32]['tokens_per_second']:.1f} tokens/s" in text
    assert f"batch\n64 gives {rows[64]['tokens_per_second']:.1f}".replace("\n", " ") in text
    assert f"doubled to {rows[64]['ms_per_step']:.1f} ms" in text and f"({rows[2]['ms_per_step']:.1f} ms)" in text
    below = [r["roofline_gflops"] / r["gflops"] for b, r in rows.items() if r["memory_bound"] and b != 2]
    assert 2 <= min(below) and max(below) <= 3.5 and "by a factor of 2 to 3.5 on the memory side" in text
    assert rows[2]["roofline_gflops"] / rows[2]["gflops"] > 3.5  # the noisy batch 2, named as such
    ridge_batch = BENCH["decode"]["batch_where_compute_bound"]
    assert f"compute-bound from a batch of about {ridge_batch:.1f}" in out and "(about 11 sequences" in text
    assert [r["memory_bound"] for r in rows.values()] == [b < ridge_batch for b in rows]
    assert round(989 / 3.35) == 295 and "the ridge is at 295" in text  # chapter 13's H100 datasheet figures
    assert any("image/png" in o.get("data", {}) for o in cell_with(nb, "decode on chapter 13's roofline").outputs)


def replay(stream, policy, max_batch=4):
    """Steps of each request under static or continuous batching, the scheduler's rules replayed
    without a model: admit first come first served into free rows (static: only into an empty
    batch), the first token at admission, one more each step, leave after the last."""
    waiting, running, first, last, step = [], [], {}, {}, 0
    pending = list(enumerate(stream))
    while pending or waiting or running:
        waiting += [(i, n) for i, (a, _, n) in pending if a == step]
        pending = [(i, s) for i, s in pending if s[0] != step]
        if policy == "continuous" or not running:
            while waiting and len(running) < max_batch:
                i, n = waiting.pop(0)
                running.append([i, n, 0])
                first[i] = step
        for seq in running:
            seq[2] += 1
            last[seq[0]] = step
        running = [seq for seq in running if seq[2] < seq[1]]
        step += 1
    return step, first, last


def test_the_timeline(nb, text):
    cell = cell_with(nb, "STREAM = [")
    out = printed(cell)
    stream = ast.literal_eval(re.search(r"STREAM = (\[.*?\])  #", cell.source, re.S).group(1))
    for policy in ("static", "continuous"):
        steps, first, last = replay(stream, policy)
        block = out.split(f"{policy:10}:")[1]
        assert block.startswith(f" {steps} steps")
        assert f"first token at {[first[i] for i in range(10)]}" in block
        assert f"last token at  {[last[i] for i in range(10)]}" in block
        waits = [first[i] - stream[i][0] for i in range(10)]
        worst = max(last[i] + 1 - stream[i][0] for i in range(10))
        assert f"first token: mean {sum(waits) / 10:.1f}" in block and f"worst {worst}" in block
    assert "take 30 steps instead of 58" in text and "3.0 steps on average for its first token instead of 22.9" in text
    assert "finishes 30 steps after it arrived instead of 50" in text
    assert "has drawn its 30 tokens, at step 29" in text and "request 1 (4 tokens) is done at step 3" in text
    assert "request 3, which arrived at step 1, waits until step 30" in text
    assert "admits request 3 at step 1" in text and "request 4 at step 4" in text
    ratio = BENCH["stream"]["continuous_over_static"]
    assert f"throughput {ratio['throughput']:.2f}x, latency p50 {ratio['latency_p50']:.2f}x, p99 " \
           f"{ratio['latency_p99']:.2f}x" in out
    assert (f"{ratio['throughput']:.2f} times the tokens per second" in text and
            f"{ratio['latency_p50']:.2f} of static's and the 99th percentile to {ratio['latency_p99']:.2f}" in text)


def test_paged_kv(nb, text):
    tables = printed(cell_with(nb, "snapshot_at=10"))
    held = [len(m.split(", ")) for m in re.findall(r"block table \[([\d, ]+)\]", tables)]
    assert f"{sum(held)} of the pool's 20 blocks in use; the run took 30 steps" in tables
    assert "pool of 20 blocks (the same\nsteps".replace("\n", " ") in text
    kv = BENCH["kv_memory"]
    out = printed(cell_with(nb, 'kv = BENCH["kv_memory"]'))
    assert f"{kv['paged_peak_bytes']:,} bytes ({kv['paged_over_reserved']:.3f} of it)" in out
    share = kv["stored_positions_peak_bytes"] / kv["paged_peak_bytes"]
    assert f"({share:.0%} of the blocks held)" in out
    assert f"never held more than {kv['paged_over_reserved']:.3f} of what" in text
    assert f"{round(100 * share)} % of the blocks it held were filled" in text
    assert kv["reserved_maximum_bytes"] == 8 * 96 * 2 * 2 * 128 * 4  # max_batch x block_size x KV bytes per position
    preempted = printed(cell_with(nb, "num_kv_blocks=12"))
    assert "preemptions; every request's tokens equal generate of it alone with its seed: True" in preempted
    assert number(r"(\d+) preemptions", preempted) >= 1


def test_tensor_parallel_decode_and_replicas(nb, text):
    out = printed(cell_with(nb, "def tp_rank("))
    assert out.count("logits against the dense model below 1e-12") == 2
    assert out.count("its KV pool 12,288 bytes (the dense model's cache of 16 positions: 24,576)") == 2
    assert out.count("bytes sent per decode step [2056, 2056, 2056]") == 2 and "(2,056 here)" in text
    tp = BENCH["tp"]
    assert tp["tp_2"][0]["bytes_sent"] == tp["closed_form_bytes_per_rank"] == 1188096
    assert f"{tp['closed_form_bytes_per_rank']:,.0f} bytes sent per rank per step" in text
    assert f"{tp['tp_2_over_one_time']:.2f} times one rank's" in text and f"time {tp['tp_2_over_one_time']:.2f}x" in out
    assert "(9 all-reduces of B·C floats, 1 + 2 per layer" in text and BENCH["decode"]["config"]["n_layer"] == 4
    replicas = printed(cell_with(nb, "def replica_rank("))
    assert "7 requests on 3 replicas" in replicas and "generate of it alone: True" in replicas


def test_int8_and_the_endpoint(nb, text):
    out = printed(cell_with(nb, "q_model = quantization.quantize_dynamic(model)"))
    ratio = number(r"\(([\d.]+)x fewer\)", out)
    assert f"{ratio:.2f} times fewer bytes" in text and 3.5 < ratio < 4
    diff, top = number(r"largest difference ([\d.]+)", out), number(r"logits up to ([\d.]+)", out)
    assert f"at most {diff:.3f} where they reach {top:.2f}" in text and "same most likely token: True" in out
    serve = printed(cell_with(nb, "server = CompletionServer("))
    answer = re.search(r"POST /v1/completions: '(.*)' length", serve).group(1)
    streamed = "".join(re.findall(r"event: \{'text': '(.*?)', 'finish_reason': None\}", serve))
    assert len(streamed) == 5 and streamed == answer[:5]  # "its five tokens are the first five of the answer"
    assert "event: {'text': '', 'finish_reason': 'length'}\n  event: [DONE]" in serve
    assert "max_tokens past the block size: 400" in serve and "stopped: True" in serve


def test_the_deck_asks_what_the_lesson_computes():
    deck = {q["id"]: q for q in quiz.load_deck(NAME)}
    right = {i: next(a for a in q["answers"] if a.get("correct")) for i, q in deck.items()}
    assert right["kv-per-token"]["value"] * 2**10 == 2 * 32 * 4096 * 2
    assert right["gpt3-sequence"]["value"] * 2**30 == 2 * 96 * 12288 * 2 * 2048
    assert right["intensity-batch"]["value"] == 2 * 24 / 2  # 2 FLOPs per weight per token, 2 bytes per weight
    assert right["blocks-needed"]["value"] == -(-(37 + 60 - 1) // 16)
    assert right["time-per-token"]["value"] == 7e9 * 2 / 2e12 * 1e3


def test_the_deck_has_twelve_questions_some_numeric_none_guessable_by_length():
    """The rule of tests/test_quiz.py for the decks of chapter 13 on: at least 12 questions, 3 of them
    numeric, no single-choice question whose right option is strictly the longest or the shortest."""
    questions = quiz.load_deck(NAME)
    assert len(questions) >= 12 and sum(q["type"] == "numeric" for q in questions) >= 3
    for q in questions:
        if q["type"] == "multiple_choice":
            right = [len(a["answer"]) for a in q["answers"] if a["correct"]][0]
            others = [len(a["answer"]) for a in q["answers"] if not a["correct"]]
            assert min(others) <= right <= max(others), q["id"]
