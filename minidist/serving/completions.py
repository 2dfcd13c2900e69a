"""OpenAI's completions API as data: a request's JSON fields to a scheduler
:class:`~minidist.serving.scheduler.Request`, and the JSON of the answers and the errors
(:mod:`minidist.serving.server` moves them over HTTP).

The shapes follow OpenAI's API reference for the legacy completions
(https://platform.openai.com/docs/api-reference/completions), as vLLM's OpenAI server mirrors them
(vllm/entrypoints/openai/protocol.py, ``CompletionRequest`` / ``CompletionResponse``):

- request: ``prompt`` (one string), ``max_tokens`` (default 16, OpenAI's), ``temperature`` (default
  1; 0 is greedy), ``top_k`` (vLLM's extension; default all), ``seed``, ``stream``; ``model`` (any
  string: one model is served) and ``n`` (1) are accepted, any other field is refused, as vLLM's
  ``OpenAIBaseModel`` (``extra="forbid"``) does: ignoring ``stop`` or ``logprobs`` would answer a
  question that was not asked;
- answer: ``{"id": "cmpl-...", "object": "text_completion", "created", "model", "choices": [{"text",
  "index": 0, "logprobs": null, "finish_reason"}], "usage": {"prompt_tokens", "completion_tokens",
  "total_tokens"}}``; a streamed chunk is the same object without ``usage``, one token's text;
- error: ``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import json
import math

from minidist.serving.scheduler import Request

__all__ = ["DEFAULT_MAX_TOKENS", "FIELDS", "InvalidRequest", "completion_object", "completion_request",
           "error_object"]

# OpenAI's default for the completions API's max_tokens.
DEFAULT_MAX_TOKENS = 16
# The fields a completion request may carry.
FIELDS = ("prompt", "max_tokens", "temperature", "top_k", "seed", "stream", "model", "n")


class InvalidRequest(ValueError):
    """A request the server refuses (HTTP 400): ``str(error)`` names what is wrong and the fix,
    ``param`` the field at fault (None for the body as a whole)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def completion_request(body: bytes, tokenizer, block_size: int) -> tuple[Request, bool]:
    """The scheduler :class:`Request` of a ``POST /v1/completions`` body and whether to stream it.

    Args:
        body: the raw body, a JSON object with the fields of the module docstring.
        tokenizer: the model's ``data.CharTokenizer`` (``prompt`` is encoded with it).
        block_size: the model's context length: the prompt and ``max_tokens`` must fit in it.

    ``temperature`` 0 is greedy decoding, as OpenAI's: sent as ``top_k=1`` (the argmax, whatever
    the temperature) at temperature 1. Returns ``(request, stream)``. Raises
    :class:`InvalidRequest` naming the field and the fix for malformed JSON, a body that is not an
    object, an unknown field, a missing or empty prompt, a wrong type or value, characters outside
    the vocabulary (each named), or a prompt and ``max_tokens`` longer than ``block_size``.
    """
    fields = json_object(body)
    prompt = prompt_field(fields, tokenizer)
    max_tokens = integer_field(fields, "max_tokens", DEFAULT_MAX_TOKENS, 1)
    if len(prompt) + max_tokens > block_size:
        raise InvalidRequest(f"max_tokens {max_tokens} after a prompt of {len(prompt)} characters needs "
                             f"{len(prompt) + max_tokens} positions, more than the model's block size (context) of "
                             f"{block_size}; ask for max_tokens <= {max(block_size - len(prompt), 0)} or send a "
                             "shorter prompt", "max_tokens")
    temperature = fields.get("temperature", 1.0)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
            math.isfinite(temperature) and temperature >= 0):
        raise InvalidRequest(f"temperature must be a number >= 0 (0: greedy), got {json.dumps(temperature)}",
                             "temperature")
    top_k, seed = integer_field(fields, "top_k", None, 1), integer_field(fields, "seed", None, 0)
    stream = fields.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest(f"stream must be true or false, got {json.dumps(stream)}", "stream")
    if not isinstance(fields.get("model", ""), str):
        raise InvalidRequest(f"model must be a string, got {json.dumps(fields['model'])}", "model")
    if fields.get("n", 1) != 1 or isinstance(fields.get("n"), bool):
        raise InvalidRequest(f"n must be 1 (one completion per request), got {json.dumps(fields['n'])}", "n")
    if temperature == 0:  # greedy: the argmax, which top-k 1 draws whatever the temperature
        temperature, top_k = 1.0, 1
    request = Request(prompt_ids=[int(i) for i in tokenizer.encode(prompt)], max_tokens=max_tokens,
                      temperature=float(temperature), top_k=top_k, seed=seed)
    return request, stream


def json_object(body: bytes) -> dict:
    """The body's JSON object, whose fields are all in :data:`FIELDS`; InvalidRequest otherwise."""
    try:
        fields = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InvalidRequest(f"the body is not valid JSON ({error}); send an object such as "
                             '{"prompt": "To be", "max_tokens": 20}') from None
    if not isinstance(fields, dict):
        raise InvalidRequest(f"the body must be a JSON object with the request's fields, got {type(fields).__name__}")
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise InvalidRequest(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: this server "
                             f"takes {', '.join(FIELDS)}", unknown[0])
    return fields


def prompt_field(fields: dict, tokenizer) -> str:
    """``fields["prompt"]``: a non-empty string of the tokenizer's characters (those outside it,
    up to ten, named); InvalidRequest otherwise."""
    prompt = fields.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise InvalidRequest("prompt must be a non-empty string (one prompt per request: send several requests "
                             f"for several prompts), got {json.dumps(prompt)[:80]}", "prompt")
    outside = sorted(set(prompt) - set(tokenizer.vocab))
    if outside:
        one = len(outside) == 1
        raise InvalidRequest(f"prompt: {', '.join(map(repr, outside[:10]))}{' ...' if len(outside) > 10 else ''} "
                             f"{'is' if one else 'are'} not in the model's vocabulary of {tokenizer.vocab_size} "
                             f"characters (those of its training text); remove or replace {'it' if one else 'them'}",
                             "prompt")
    return prompt


def integer_field(fields: dict, name: str, default: int | None, minimum: int | None) -> int | None:
    """``fields[name]``, an integer >= ``minimum`` (JSON's true and false are not integers here),
    or ``default`` when absent (and when null, if the default is None); InvalidRequest otherwise."""
    value = fields.get(name, default)
    if value is None and default is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        least = "" if minimum is None else f" >= {minimum}"
        raise InvalidRequest(f"{name} must be an integer{least}, got {json.dumps(value)}", name)
    return value


def completion_object(completion_id: str, created: int, model: str, text: str, finish_reason: str | None,
                      usage: dict | None = None) -> dict:
    """OpenAI's ``text_completion`` object with one choice: a whole answer (with ``usage``) or one
    streamed chunk (``created``: Unix seconds; ``finish_reason`` None until the last)."""
    body = {"id": completion_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}]}
    if usage is not None:
        body["usage"] = usage
    return body


def error_object(message: str, type_: str = "invalid_request_error", param: str | None = None) -> dict:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code": null}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": None}}
