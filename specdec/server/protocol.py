"""OpenAI request and response shapes: parse and check a request body, build the responses and stream chunks.

Every check fails with :class:`BadRequest` (HTTP 400, an OpenAI-style error body naming the field), never with a
traceback.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass

from specdec.sampling import SamplingParams
from specdec.server.scheduler import GenerationRequest

MAX_STOP_SEQUENCES = 4


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "server_error"}


class ApiError(Exception):
    """An error answered with an HTTP status and an OpenAI error body."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 500) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES[self.status], "param": self.param,
                          "code": self.code}}


class BadRequest(ApiError):
    """HTTP 400."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message, param, code, status=400)


@dataclass(frozen=True)
class Job:
    """A checked request: what to generate, and how to answer."""

    chat: bool
    prompt: str | list[int] | list[dict]  # completion text, token ids, or chat messages
    max_tokens: int | None  # None: up to the context
    sampling: SamplingParams
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool

    def generation_request(self, prompt_ids: list[int], max_length: int) -> GenerationRequest:
        room = max_length - len(prompt_ids)
        if room < 1:
            raise BadRequest(f"the prompt has {len(prompt_ids)} tokens; this model's context is {max_length} "
                             "tokens", "messages" if self.chat else "prompt", "context_length_exceeded")
        max_tokens = room if self.max_tokens is None else self.max_tokens
        if max_tokens > room:
            raise BadRequest(f"max_tokens is {max_tokens}, but the prompt has {len(prompt_ids)} tokens and this "
                             f"model's context is {max_length} tokens: at most {room}", "max_tokens",
                             "context_length_exceeded")
        return GenerationRequest(prompt_ids=prompt_ids, max_tokens=max_tokens, sampling=self.sampling,
                                 seed=self.seed, stop_at_eos=not self.ignore_eos)


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BadRequest(f"the request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def parse_job(body: dict, chat: bool, model_name: str) -> Job:
    model = _field(body, "model", str, None)
    if model is not None and model != model_name:
        raise BadRequest(f"the model {model!r} does not exist; this server serves {model_name!r}", "model",
                         "model_not_found")
    if _field(body, "n", int, 1) != 1:
        raise BadRequest("only n = 1 is supported", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0) != 0.0:
            raise BadRequest(f"{name} is not supported: it would change the target's distribution", name)
    if body.get("logprobs") not in (None, False, 0):
        raise BadRequest("logprobs are not supported", "logprobs")
    max_tokens = _field(body, "max_completion_tokens", int, None) if chat else None
    max_tokens = _field(body, "max_tokens", int, max_tokens if chat else 16)
    if max_tokens is not None and max_tokens < 1:
        raise BadRequest(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    temperature = _number(body, "temperature", 1.0)
    if temperature < 0:
        raise BadRequest(f"temperature must be >= 0, got {temperature}", "temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = _field(body, "top_k", int, 0)
    if top_k < -1:
        raise BadRequest(f"top_k must be >= 0 (or -1: no limit), got {top_k}", "top_k")
    stream_options = _field(body, "stream_options", dict, None) or {}
    return Job(
        chat=chat,
        prompt=_messages(body) if chat else _prompt(body),
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=temperature, top_k=max(top_k, 0), top_p=top_p),
        seed=_field(body, "seed", int, None),
        stop=_stop(body),
        stream=_field(body, "stream", bool, False),
        include_usage=_field(stream_options, "include_usage", bool, False, "stream_options.include_usage"),
        ignore_eos=_field(body, "ignore_eos", bool, False),
    )


def _field(body: dict, name: str, kind: type, default, param: str | None = None):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise BadRequest(f"{param or name} must be {_KIND_NAMES[kind]}, got {json.dumps(value)[:40]}", param or name)
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"{name} must be a number, got {json.dumps(value)[:40]}", name)
    return float(value)


_KIND_NAMES = {str: "a string", int: "an integer", bool: "true or false", dict: "an object", list: "an array"}


def _prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise BadRequest("prompt must be a non-empty string or a non-empty array of token ids (one prompt per "
                     "request)", "prompt")


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty array", "messages")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string role", "messages")
        checked.append({"role": message["role"], "content": _content(message.get("content"), i)})
    return checked


def _content(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                         and isinstance(part.get("text"), str) for part in content):
        return "".join(part["text"] for part in content)
    raise BadRequest(f"messages[{i}].content must be a string or an array of text parts", "messages")


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or len(stops) > MAX_STOP_SEQUENCES
            or not all(isinstance(s, str) and s for s in stops)):
        raise BadRequest(f"stop must be a non-empty string or an array of up to {MAX_STOP_SEQUENCES} of them",
                         "stop")
    return tuple(stops)


# --- responses -------------------------------------------------------------------------------------------------------


class Response:
    """The id, timestamps and shapes of one answer, for a chat or a plain completion."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def whole(self, text: str, finish_reason: str, usage: dict) -> dict:
        choice = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return self._envelope("chat.completion" if self.chat else "text_completion", [choice], usage=usage)

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False) -> dict:
        choice: dict = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])

    def usage_chunk(self, usage: dict) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], usage=usage)

    def _envelope(self, kind: str, choices: list, usage: dict | None = None) -> dict:
        envelope = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            envelope["usage"] = usage
        return envelope


def usage(prompt_tokens: int, completion_tokens: int, draft_tokens: int, accepted_tokens: int) -> dict:
    """OpenAI's usage, and what speculation did for this request."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "speculation": {"draft_tokens": draft_tokens, "accepted_tokens": accepted_tokens}}
