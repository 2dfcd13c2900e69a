"""``minidist serve`` (issue 34, part 4): the real HTTP endpoint, asked by a real client (httpx).

The server runs in a thread of this process on a free port, over a tiny untrained GPT saved as
``train --save-model`` saves one. Oracles: ``GPT.generate`` of each prompt alone with the same seed
(the texts of concurrent requests, batched by the scheduler, must equal them), OpenAI's response and
server-sent-event shapes, and the server's own health after each bad request. The command itself
(``python -m minidist serve``) runs in a subprocess, alone and tensor-parallel under ``mpiexec -n 2``,
and is stopped with Ctrl-C (SIGINT).
"""
import concurrent.futures
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
from mpitools import JOB_ENV, mpiexec_or_skip

from minidist import cli, data, workloads
from minidist.checkpoint_io import save_weights
from minidist.models.gpt import GPT, GPTConfig
from minidist.serving.server import CompletionServer

TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
BLOCK_SIZE = 64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny GPT (random weights: the texts only need to be the model's) saved with its description
    and vocabulary, as ``train --model gpt --save-model`` writes it; its path, model and tokenizer."""
    tokenizer = data.CharTokenizer(TEXT)
    config = GPTConfig(tokenizer.vocab_size, BLOCK_SIZE, n_layer=2, n_head=2, n_embd=16)
    model = GPT(config, rng=7, dtype="float64").eval()
    path = tmp_path_factory.mktemp("serve") / "tiny.npz"
    save_weights(path, model.state_dict(), {"model": "gpt", "gpt_config": dataclasses.asdict(config),
                                            "tokenizer": tokenizer.state_dict()})
    return path, model, tokenizer


@pytest.fixture(scope="module")
def server(checkpoint):
    """The server on a free port, serving from a thread; stopped at the end of the module."""
    _, model, tokenizer = checkpoint
    server = CompletionServer(model, tokenizer, port=0, model_name="tiny", max_batch=4, kv_block_size=8)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    assert server.ready.wait(10)
    yield server
    server.stop()
    thread.join(10)
    assert not thread.is_alive()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=10) as client:
        yield client


def alone(model, tokenizer, prompt, max_tokens, seed, temperature=1.0, top_k=None):
    """The oracle: ``GPT.generate`` of this one prompt, its new characters."""
    ids = model.generate(tokenizer.encode(prompt)[None, :], max_tokens, temperature=temperature, top_k=top_k, rng=seed)
    return tokenizer.decode(ids[0, len(prompt):])


def healthy(client) -> dict:
    answer = client.get("/health")
    assert answer.status_code == 200 and answer.json()["status"] == "ok"
    return answer.json()


def idle(client, timeout=5.0) -> dict:
    """/health once no request runs (the scheduler thread has caught up)."""
    deadline = time.monotonic() + timeout
    while (health := healthy(client))["requests_in_flight"] and time.monotonic() < deadline:
        time.sleep(0.01)
    return health


def events(response) -> list:
    """The server-sent events of a streamed answer, parsed one ``data:`` line at a time."""
    chunks = []
    for line in response.iter_lines():
        if line:
            assert line.startswith("data: "), line
            chunks.append(line[len("data: "):])
    return chunks


# ---------------------------------------------------------------------------------------
# Answers
# ---------------------------------------------------------------------------------------

ASKS = [dict(prompt="To be", max_tokens=30, seed=1), dict(prompt="Whether 'tis", max_tokens=12, seed=2),
        dict(prompt="the question", max_tokens=40, seed=3, temperature=0.7, top_k=5),
        dict(prompt="o", max_tokens=25, seed=4, temperature=0), dict(prompt="nobler in", max_tokens=5, seed=5)]


def test_concurrent_requests_are_each_what_the_model_draws_alone(server, checkpoint, client):
    _, model, tokenizer = checkpoint
    before = healthy(client)["requests_finished"].get("length", 0)
    with concurrent.futures.ThreadPoolExecutor(len(ASKS)) as pool:  # five at once, four decoded together at most
        answers = list(pool.map(lambda ask: client.post("/v1/completions", json=ask), ASKS))
    for ask, answer in zip(ASKS, answers):
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == "tiny"
        (choice,) = body["choices"]
        greedy = dict(temperature=1.0, top_k=1) if ask.get("temperature") == 0 else {}  # OpenAI's 0: greedy
        want = alone(model, tokenizer, ask["prompt"], ask["max_tokens"], ask["seed"],
                     **{"temperature": ask.get("temperature", 1.0), "top_k": ask.get("top_k"), **greedy})
        assert choice["text"] == want and choice["finish_reason"] == "length" and choice["index"] == 0
        assert body["usage"] == {"prompt_tokens": len(ask["prompt"]), "completion_tokens": ask["max_tokens"],
                                 "total_tokens": len(ask["prompt"]) + ask["max_tokens"]}
    health = idle(client)
    assert health["requests_finished"]["length"] == before + len(ASKS)


def test_a_streamed_answer_is_one_event_per_token_then_the_reason_and_done(checkpoint, client):
    _, model, tokenizer = checkpoint
    ask = dict(prompt="To be", max_tokens=20, seed=11, top_k=10)
    with client.stream("POST", "/v1/completions", json={**ask, "stream": True}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        chunks = events(response)
    assert chunks[-1] == "[DONE]" and len(chunks) == ask["max_tokens"] + 2
    bodies = [json.loads(chunk) for chunk in chunks[:-1]]
    assert len({b["id"] for b in bodies}) == 1 and all(b["object"] == "text_completion" for b in bodies)
    texts = [b["choices"][0]["text"] for b in bodies]
    reasons = [b["choices"][0]["finish_reason"] for b in bodies]
    assert all(len(t) == 1 for t in texts[:-1]) and texts[-1] == "" and reasons == [None] * 20 + ["length"]
    assert "".join(texts) == alone(model, tokenizer, ask["prompt"], 20, 11, top_k=10)
    whole = client.post("/v1/completions", json=ask).json()  # the same request, not streamed
    assert whole["choices"][0]["text"] == "".join(texts)


def test_a_client_that_leaves_cancels_its_request(server, client, monkeypatch):
    step = server.scheduler.scheduler.step
    # 0.2 s a token, so the server notices the client left long before the request could end by length
    # (at 5 ms a token, on a loaded machine it once drew all its tokens first)
    monkeypatch.setattr(server.scheduler.scheduler, "step", lambda: (time.sleep(0.2), step())[1])
    before = idle(client)
    with client.stream("POST", "/v1/completions",
                       json=dict(prompt="T", max_tokens=BLOCK_SIZE - 1, seed=0, stream=True)) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: {") and next(lines) == ""  # one token, then the client leaves
    after = idle(client)
    assert after["requests_in_flight"] == 0
    assert after["requests_finished"].get("cancelled", 0) == before["requests_finished"].get("cancelled", 0) + 1
    assert after["requests_finished"].get("length", 0) == before["requests_finished"].get("length", 0)
    assert after["kv_blocks_free"] == after["kv_blocks"]  # its KV blocks are back
    monkeypatch.setattr(server.scheduler.scheduler, "step", lambda: (time.sleep(0.02), step())[1])  # 20 ms a token
    with pytest.raises(httpx.ReadTimeout):  # a client that stops waiting for an answer not streamed: the same
        client.post("/v1/completions", json=dict(prompt="T", max_tokens=BLOCK_SIZE - 1, seed=0), timeout=0.1)
    last = idle(client)
    assert last["requests_finished"]["cancelled"] == after["requests_finished"]["cancelled"] + 1
    assert last["kv_blocks_free"] == last["kv_blocks"]
    ask = dict(prompt="To be", max_tokens=3, seed=1)  # and the server goes on
    assert client.post("/v1/completions", json=ask).json()["choices"][0]["finish_reason"] == "length"


# ---------------------------------------------------------------------------------------
# Bad requests: 400 with OpenAI's error, the field named, and the server goes on
# ---------------------------------------------------------------------------------------

BAD = [
    (b'{"prompt": "To be", "max_tokens": 5', None, "not valid JSON"),
    (b"\xff\xfe", None, "not valid JSON"),
    (b'["To be"]', None, "must be a JSON object"),
    (b'{"max_tokens": 5}', "prompt", "prompt must be a non-empty string"),
    (b'{"prompt": ["To", "be"]}', "prompt", "one prompt per request"),
    (b'{"prompt": ""}', "prompt", "prompt must be a non-empty string"),
    ('{"prompt": "To be, Z\u20ac"}'.encode(), "prompt", "'Z', '\u20ac' are not in the model's vocabulary of"),
    (b'{"prompt": "To be", "max_tokens": 60}', "max_tokens", "needs 65 positions, more than the model's block size"),
    (b'{"prompt": "To be", "max_tokens": "10"}', "max_tokens", 'max_tokens must be an integer >= 1, got "10"'),
    (b'{"prompt": "To be", "max_tokens": 0}', "max_tokens", "max_tokens must be an integer >= 1, got 0"),
    (b'{"prompt": "To be", "temperature": -1}', "temperature", "temperature must be a number >= 0"),
    (b'{"prompt": "To be", "temperature": true}', "temperature", "temperature must be a number >= 0"),
    (b'{"prompt": "To be", "top_k": 0}', "top_k", "top_k must be an integer >= 1, got 0"),
    (b'{"prompt": "To be", "seed": 1.5}', "seed", "seed must be an integer >= 0, got 1.5"),
    (b'{"prompt": "To be", "stream": "yes"}', "stream", 'stream must be true or false, got "yes"'),
    (b'{"prompt": "To be", "n": 2}', "n", "n must be 1"),
    (b'{"prompt": "To be", "stop": "\\n"}', "stop", "unknown field stop: this server takes prompt, max_tokens"),
]


@pytest.mark.parametrize("body, param, said", BAD, ids=[said for _, _, said in BAD])
def test_a_bad_request_is_a_400_naming_the_fix_and_the_server_goes_on(client, body, param, said):
    answer = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert said in error["message"] and error["type"] == "invalid_request_error" and error["param"] == param
    healthy(client)


def test_unknown_routes_and_methods_are_json_errors(client):
    missing = client.get("/v1/chat/completions")
    assert missing.status_code == 404 and "POST /v1/completions and GET /health" in missing.json()["error"]["message"]
    wrong = client.get("/v1/completions")
    assert wrong.status_code == 405 and "does not take GET" in wrong.json()["error"]["message"]
    healthy(client)


# ---------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.mpi)])
def test_the_command_listens_answers_and_stops_on_ctrl_c(checkpoint, tp):
    """``python -m minidist serve`` as a user runs it (``--tp 2``: under ``mpiexec -n 2``, rank 0
    serving, rank 1 following): concurrent requests each equal to the model alone, then SIGINT
    (Ctrl-C; mpiexec passes it to the ranks) ends every process with status 0 and one line."""
    path, _, _ = checkpoint
    model, tokenizer = workloads.load_language_model(path)  # float32, as the command loads it
    command = [sys.executable, "-m", "minidist", "serve", "--checkpoint", str(path), "--port", "0", "--tp", str(tp)]
    if tp > 1:
        command = [mpiexec_or_skip(), "-n", str(tp), sys.executable, "-m", "mpi4py", *command[1:]]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **JOB_ENV})
    try:
        line = process.stdout.readline()
        assert line.startswith("minidist serve: listening on http://127.0.0.1:"), (line, process.stderr.read())
        url = line.split("listening on ")[1].split()[0]
        with httpx.Client(base_url=url, timeout=30) as client:
            assert healthy(client)["model"] == "tiny"
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                asks = [dict(prompt="To be", max_tokens=12, seed=5), dict(prompt="the", max_tokens=20, seed=6)]
                answers = list(pool.map(lambda ask: client.post("/v1/completions", json=ask).json(), asks))
        for ask, answer in zip(asks, answers):
            want = alone(model, tokenizer, ask["prompt"], ask["max_tokens"], ask["seed"])
            assert answer["choices"][0]["text"] == want
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 0, err
    ours = [[line for line in text.splitlines() if not line.startswith("[mpiexec@")]  # mpiexec's: SIGINT passed on
            for text in (out, err)]
    assert ours == [[], ["minidist serve: stopped (Ctrl-C)"]]


def test_a_taken_port_a_missing_file_and_an_mlp_are_one_line_errors(checkpoint, tmp_path, capsys):
    path, _, _ = checkpoint
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["serve", "--checkpoint", str(path), "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "give another --port" in err
    assert cli.main(["serve", "--checkpoint", str(tmp_path / "none.npz")]) == 1
    assert "none.npz" in capsys.readouterr().err
    np.savez(tmp_path / "mlp.npz", **{"0.weight": np.zeros((2, 3), np.float32)})
    assert cli.main(["serve", "--checkpoint", str(tmp_path / "mlp.npz")]) == 2
    assert "holds no GPT" in capsys.readouterr().err
    assert cli.main(["serve", "--checkpoint", str(path), "--tp", "2"]) == 2  # not under mpiexec -n 2
    assert "--tp 2 needs 2 ranks, this job has 1: run `mpiexec -n 2 python -m mpi4py" in capsys.readouterr().err
