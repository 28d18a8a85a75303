"""OpenAI request and response shapes: the request bodies as pydantic models (types and ranges checked there),
the responses and stream chunks.

Every parameter a request may carry is declared here, honoured by the server, or refused: a parameter that is not
declared is answered with HTTP 400 naming it, never ignored. Every check fails with :class:`BadRequest` (an
OpenAI error body naming the field), never with a traceback.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from exactspec.choices import (
    DEFAULT_SAMPLING_METHOD,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    SAMPLING_METHODS,
    SEED_RANGE,
    SPECULATION_MODES,
)
from exactspec.errors import UsageError
from exactspec.grammars import Grammar, GrammarSpec
from exactspec.rounds import StopCondition
from exactspec.sampling import LogitsAdjustment, SamplingParams
from exactspec.server.scheduler import GenerationRequest, NotOffered, QueueFull, ShuttingDown
from exactspec.server.tools import ToolCalling, ToolError, tool_calling
from exactspec.vocabularies import token_name

MAX_CHOICES = 16  # n
MAX_JSON_DEPTH = 64  # nesting of the request body: deeper is refused before it is parsed
RETRY_AFTER_SECONDS = 1  # what a 429 or a 503 tells the client to wait before it asks again

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 503: "server_error"}

# What the scheduler's refusals answer over HTTP (OpenAI's error type is ERROR_TYPES' for the status): the one
# place an exception becomes a status, for every route. An exception is looked up by its own class, then by those it
# derives from (NotOffered is a ValueError); a class not here is the server's own fault, 500.
ERROR_STATUSES: dict[type[Exception], int] = {
    NotOffered: 400,  # the request asks for what this server does not offer (its param named)
    QueueFull: 429,  # the waiting queue is at its bound: retry later
    ShuttingDown: 503,  # the server takes no new requests
    UsageError: 400,  # a check refused the request's input
    ValueError: 400,
}


class ApiError(Exception):
    """An error answered with an HTTP status and an OpenAI error body."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 500) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


class BadRequest(ApiError):
    """HTTP 400."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message, param, code, status=400)


def api_error(error: Exception) -> ApiError:
    """The OpenAI error an exception answers: itself where it is one, else its row of :data:`ERROR_STATUSES` (with
    the field a :class:`NotOffered` names), else 500, an internal error."""
    if isinstance(error, ApiError):
        return error
    status = next((ERROR_STATUSES[kind] for kind in type(error).__mro__ if kind in ERROR_STATUSES), None)
    if status is None:
        return ApiError(f"internal error: {error}")
    return ApiError(str(error), getattr(error, "param", None), status=status)


# --- request bodies ---------------------------------------------------------------------------------------------------


def _encodable(text: str) -> str:
    """Text a tokenizer can take: UTF-8 encodable (a lone surrogate is not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the text is not valid Unicode (it holds a lone surrogate)") from None
    return text


Text = Annotated[str, AfterValidator(_encodable)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_encodable)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


def _null_allowed(schema: dict) -> None:
    """In a body's JSON schema, each optional field takes null too (what :class:`_Body` reads as its default)."""
    required = set(schema.get("required", ()))
    for name, field_schema in schema.get("properties", {}).items():
        options = field_schema.get("anyOf", [field_schema])
        if name in required or any(option.get("type") == "null" for option in options):
            continue
        kept = {key: field_schema.pop(key) for key in ("default", "title", "description") if key in field_schema}
        options = field_schema.pop("anyOf", None) or [dict(field_schema)]
        field_schema.clear()
        field_schema.update(anyOf=[*options, {"type": "null"}], **kept)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_null_allowed)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data):
        """An optional field sent as null takes its default, as in OpenAI's API (null is not sent), for OpenAI's
        fields and exactspec's alike."""
        if not isinstance(data, dict) or None not in data.values():
            return data
        optional = _optional_fields(cls)
        return {name: value for name, value in data.items() if value is not None or name not in optional}


@functools.cache
def _optional_fields(model: type[BaseModel]) -> frozenset[str]:
    """The fields of ``model`` that have a default, which null stands for (read once per model: pydantic's
    ``model_fields`` took 6 µs a read, 0.19 s for a chat of 30,000 messages)."""
    return frozenset(name for name, field in model.model_fields.items() if not field.is_required())


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class FunctionCall(_Body):
    name: Annotated[str, Field(min_length=1)]
    arguments: Text  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None  # None: an assistant's turn that only called tools
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call

    @model_validator(mode="before")
    @classmethod
    def _calls_need_no_content(cls, data):
        """An assistant's turn that called tools may leave its content out, as OpenAI's API lets it."""
        if isinstance(data, dict) and data.get("tool_calls") and "content" not in data:
            return {**data, "content": None}
        return data

    @model_validator(mode="after")
    def _has_content(self):
        if self.content is None and not self.tool_calls:
            raise ValueError("a message needs content (or, from the assistant, tool_calls)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)

    def for_template(self) -> dict:
        """The message as chat templates read it (transformers' convention: a call's arguments as an object)."""
        message = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": _arguments(call.function.arguments)}}
                for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDefinition(_Body):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict | None = None  # a JSON Schema; None: no arguments
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: Annotated[str, Field(min_length=1)]


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Body):
    include_usage: bool = False
    include_speculation: bool = False  # exactspec's: each chunk says how its tokens came (docs/serving.md)


class JsonSchemaFormat(BaseModel):
    """response_format's json_schema: OpenAI's fields (the schema itself may hold anything JSON Schema does)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    json_schema: dict = Field(default_factory=dict, alias="schema")  # OpenAI's "schema"; absent: any JSON
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_Body):
    """What chat and plain completions share."""

    model: str | None = None
    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0  # vLLM's extension: -1 or 0, no limit
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    seed: Annotated[int, Field(ge=SEED_RANGE[0], lt=SEED_RANGE[1])] | None = None
    sampling: Literal[SAMPLING_METHODS] = DEFAULT_SAMPLING_METHOD  # exactspec's: how draws are made (sampling.py)
    speculation: Literal[SPECULATION_MODES] | None = None  # exactspec's: this request's mode (None: the server's)
    num_draft_tokens: Annotated[int, Field(ge=1)] | None = None  # exactspec's: at most this many per round
    stop: NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    ignore_eos: bool = False  # vLLM's extension
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] = 0.0
    user: str | None = None  # an end-user id: changes nothing
    response_format: ResponseFormat | None = None  # structured output: a JSON object, or one a schema describes
    guided_json: dict | None = None  # vLLM's extensions: a JSON Schema, a regex, or a Lark or GBNF grammar
    guided_regex: Text | None = None
    guided_grammar: Text | None = None


class CompletionRequest(_Sampling):
    prompt: NonEmptyText | TokenIds | Annotated[list[NonEmptyText], Field(min_length=1, max_length=1)] | \
        Annotated[list[TokenIds], Field(min_length=1, max_length=1)]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    best_of: Literal[1] | None = None  # more candidates than returned is not implemented
    suffix: None = None  # insertion is not implemented


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


REFUSED = {  # parameters OpenAI defines that change the output and are not implemented: why, for the 400
    "best_of": "best_of (more candidates than returned) is not supported",
    "suffix": "suffix (insertion) is not supported",
    "functions": "functions (the deprecated function calling) are not supported: send tools",
    "function_call": "function_call (the deprecated function calling) is not supported: send tool_choice",
}


def json_depth_ok(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text nests no deeper than ``limit`` (counted on brackets outside strings, before parsing:
    a body of 100,000 nested lists must not reach the parser's recursion)."""
    depth, in_string, escaped = 0, False, False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            if depth > limit:
                return False
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return True


def parse_body(raw: bytes) -> dict:
    if not json_depth_ok(raw):
        raise BadRequest(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise BadRequest(f"the request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def validated(model: type[_Body], body: dict) -> _Body:
    """The body as ``model``, or a 400 naming the first field at fault."""
    for name, value in body.items():
        if name in REFUSED and _refused(name, value):
            raise BadRequest(REFUSED[name], name, "unsupported_parameter")
    body = {k: v for k, v in body.items() if k not in REFUSED or k in model.model_fields}  # harmless defaults
    try:
        return model.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(part) for part in _field_path(first["loc"], body)) or None
        if first["type"] == "extra_forbidden":
            raise BadRequest(f"{param} is not a parameter this server knows or supports", param,
                             "unsupported_parameter") from None
        value = json.dumps(first.get("input"), default=str)[:60]
        raise BadRequest(f"{param}: {first['msg']} (got {value})", param) from None


def _refused(name: str, value) -> bool:
    """Whether a REFUSED parameter's value asks for what is not implemented (its default asks for nothing)."""
    if value is None:
        return False
    if name == "best_of":
        return value != 1
    return True


def _field_path(loc: tuple, body: dict) -> list:
    """The path of the field at fault in the body, without pydantic's union branch names (``prompt.str``,
    ``stop.list[str]``): the parts of ``loc`` that index the body as it was sent."""
    path, node = [], body
    for part in loc:
        if isinstance(node, dict) and part in node or isinstance(node, list) and isinstance(part, int) and \
                0 <= part < len(node):
            path.append(part)
            node = node[part]
    return path


# --- a checked request ------------------------------------------------------------------------------------------------


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
    n: int = 1
    logprobs: int | None = None  # None: none; k: the chosen token's and the k most likely
    echo: bool = False
    adjustment: LogitsAdjustment | None = None  # logit_bias and penalties
    speculation: str | None = None  # "auto", "always" or "never"; None: the server's mode
    num_draft_tokens: int | None = None  # the most draft tokens per round; None: the server's
    include_speculation: bool = False  # stream chunks carry how each token came (a "exactspec" key)
    grammar: GrammarSpec | None = None  # structured output
    grammar_param: str | None = None  # the field that asked for it (named in a 400)
    tool_calling: ToolCalling | None = None  # the tools, and how the answer calls them
    model: str | None = None  # the name the request asked for (one the server answers to); None: its own

    def generation_request(self, prompt_ids: list[int], max_length: int, choice: int = 0,
                           stop: Callable[[], StopCondition] | None = None,
                           grammar: Callable[[], Grammar] | None = None) -> GenerationRequest:
        """The scheduler's request for choice ``choice`` of n (each its own seed, when seeded); ``stop`` makes its
        stop condition (the job's stop strings over the server's tokenizer), ``grammar`` its matcher.
        ``prompt_ids``: the prompt's, or their first ``max_length`` where there are more (the server tokenizes no
        further), which is refused as the longer prompt is."""
        room = max_length - len(prompt_ids)
        if room < 1:
            raise BadRequest(f"the prompt has {len(prompt_ids)} tokens or more; this model's context is {max_length} "
                             "tokens", "messages" if self.chat else "prompt", "context_length_exceeded")
        max_tokens = room if self.max_tokens is None else self.max_tokens
        if max_tokens > room:
            raise BadRequest(f"max_tokens is {max_tokens}, but the prompt has {len(prompt_ids)} tokens and this "
                             f"model's context is {max_length} tokens: at most {room}", "max_tokens",
                             "context_length_exceeded")
        return GenerationRequest(prompt_ids=prompt_ids, max_tokens=max_tokens, sampling=self.sampling,
                                 seed=choice_seed(self.seed, choice), stop_at_eos=not self.ignore_eos,
                                 adjustment=self.adjustment, logprobs=self.logprobs, speculation=self.speculation,
                                 max_draft_tokens=self.num_draft_tokens, stop=stop, grammar=grammar)


def choice_seed(seed: int | None, choice: int) -> int | None:
    """Choice 0 keeps the request's seed (n = 1 answers as before); choice i > 0 takes a seed of its own, derived
    from the request's, so that the n samples are independent and the whole answer reproducible."""
    if seed is None or choice == 0:
        return seed
    return (seed * 0x9E3779B97F4A7C15 + choice) % SEED_RANGE[1]


def check_served(name: str, model_names: tuple[str, ...]) -> None:
    """404 ``model_not_found`` for a name the server does not answer to (``model_names``), as OpenAI and vLLM answer
    a request or a ``GET /v1/models/{name}`` that names one."""
    if name not in model_names:
        served = ", ".join(repr(served) for served in model_names)
        raise ApiError(f"the model {name!r} does not exist; this server serves {served}", "model", "model_not_found",
                       status=404)


def parse_job(body: dict, chat: bool, model_names: tuple[str, ...], vocab_size: int, template: str | None = None
              ) -> Job:
    """The checked request; ``model_names``: the names the server answers to (the first its own, the others aliases:
    another is 404 ``model_not_found``, as OpenAI and vLLM answer); ``template``: the model's chat template (whether
    it can write tool calls)."""
    request = validated(ChatCompletionRequest if chat else CompletionRequest, body)
    if request.model is not None:
        check_served(request.model, model_names)
    if chat:
        max_tokens = request.max_tokens if request.max_tokens is not None else request.max_completion_tokens
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        if request.top_logprobs is not None and not request.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        prompt = [m.for_template() for m in request.messages]
    else:
        max_tokens = 16 if request.max_tokens is None else request.max_tokens
        logprobs = request.logprobs
        prompt = request.prompt[0] if isinstance(request.prompt, list) and isinstance(
            request.prompt[0], (str, list)) else request.prompt
        if request.echo and logprobs is not None:
            raise BadRequest("echo with logprobs (the prompt's log-probabilities) is not supported", "echo")
    if request.stream_options is not None and not request.stream:
        raise BadRequest("stream_options is only allowed when stream is true", "stream_options")
    stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    return Job(
        chat=chat,
        prompt=prompt,
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=request.temperature, top_k=max(request.top_k, 0), top_p=request.top_p,
                                method=request.sampling),
        seed=request.seed,
        stop=stop,
        stream=request.stream,
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        include_speculation=bool(request.stream_options and request.stream_options.include_speculation),
        ignore_eos=request.ignore_eos,
        n=request.n,
        logprobs=logprobs,
        echo=getattr(request, "echo", False),
        adjustment=_adjustment(request, vocab_size),
        speculation=request.speculation,
        num_draft_tokens=request.num_draft_tokens,
        model=request.model,
        **_structured_output(request, _tool_calling(request, template) if chat else None),
    )


def _tool_calling(request: ChatCompletionRequest, template: str | None) -> ToolCalling | None:
    choice = request.tool_choice.model_dump() if isinstance(request.tool_choice, BaseModel) else request.tool_choice
    tools = None if request.tools is None else [tool.model_dump() for tool in request.tools]
    try:
        return tool_calling(tools, choice, request.parallel_tool_calls, template)
    except ToolError as error:
        raise BadRequest(str(error), error.param) from None


def _structured_output(request: _Sampling, calling: ToolCalling | None) -> dict:
    """The job's grammar and the field that asked for it: the tool calls, response_format (json_object or
    json_schema), or one of vLLM's guided_json, guided_regex and guided_grammar; at most one."""
    asked = {} if calling is None else {"tool_choice" if calling.named else "tools": calling.grammar()}
    if request.response_format is not None and request.response_format.type != "text":
        form = request.response_format
        if form.type == "json_object":
            asked["response_format"] = GrammarSpec("json_object")
        elif form.json_schema is None:
            raise BadRequest("response_format json_schema needs its json_schema: {\"name\", \"schema\"}",
                             "response_format.json_schema")
        else:
            asked["response_format"] = GrammarSpec.json_schema(form.json_schema.json_schema or {})
    elif request.response_format is not None and request.response_format.json_schema is not None:
        raise BadRequest("response_format text takes no json_schema", "response_format.json_schema")
    if request.guided_json is not None:
        asked["guided_json"] = GrammarSpec.json_schema(request.guided_json)
    if request.guided_regex is not None:
        asked["guided_regex"] = GrammarSpec("regex", request.guided_regex)
    if request.guided_grammar is not None:
        asked["guided_grammar"] = GrammarSpec("grammar", request.guided_grammar)
    if len(asked) > 1:
        raise BadRequest(f"ask for one structured output, not {' and '.join(asked)}", list(asked)[1])
    return {"grammar": next(iter(asked.values())), "grammar_param": next(iter(asked)),
            "tool_calling": calling} if asked else {}


def _adjustment(request: _Sampling, vocab_size: int) -> LogitsAdjustment | None:
    bias = {}
    for key, value in (request.logit_bias or {}).items():
        if not key.isdigit() or not 0 <= int(key) < vocab_size:
            raise BadRequest(f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}", "logit_bias")
        bias[int(key)] = value
    adjustment = LogitsAdjustment(bias=bias, presence_penalty=request.presence_penalty,
                                  frequency_penalty=request.frequency_penalty)
    return adjustment if adjustment.active else None


# --- responses --------------------------------------------------------------------------------------------------------


class Response:
    """The id, timestamps and shapes of one answer, for a chat or a plain completion."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def choice(self, index: int, text: str, finish_reason: str, logprobs: dict | None,
               tool_calls: list[dict] | None = None) -> dict:
        """A whole answer's choice; with ``tool_calls``, a chat message that calls them (finish reason
        "tool_calls")."""
        choice = {"index": index, "finish_reason": "tool_calls" if tool_calls else finish_reason,
                  "logprobs": logprobs}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": None if tool_calls else text}
            if tool_calls:
                choice["message"]["tool_calls"] = tool_calls
        else:
            choice["text"] = text
        return choice

    def tool_calls_chunk(self, tool_calls: list[dict], index: int = 0, logprobs: dict | None = None) -> dict:
        """A stream's delta with the calls whole (each with its index among them, as OpenAI streams them), and the
        log-probabilities of the tokens that wrote them where asked."""
        delta = {"tool_calls": [{"index": i, **call} for i, call in enumerate(tool_calls)]}
        return self._envelope("chat.completion.chunk", [{"index": index, "finish_reason": None, "logprobs": logprobs,
                                                         "delta": delta}])

    def whole(self, choices: list[dict], usage: dict) -> dict:
        return self._envelope("chat.completion" if self.chat else "text_completion", choices, usage=usage)

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False, index: int = 0,
              logprobs: dict | None = None) -> dict:
        choice: dict = {"index": index, "finish_reason": finish_reason, "logprobs": logprobs}
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


def usage(prompt_tokens: int, completion_tokens: int, draft_tokens: int, accepted_tokens: int,
          cached_tokens: int = 0) -> dict:
    """OpenAI's usage (with the prompt tokens restored from the prefix cache), and what speculation did for this
    request."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
            "speculation": {"draft_tokens": draft_tokens, "accepted_tokens": accepted_tokens}}


def logprobs_payload(chat: bool, entries: list[TokenLogprob], text_offset: int = 0) -> dict:
    """OpenAI's logprobs object for the tokens given: chat's ``content`` list, each token with its own ``bytes`` (its
    ``token`` text lossy where it holds part of a character, as OpenAI's is), or the completions layout, which has
    no bytes and names such a token by them (:func:`token_name`); ``text_offset``: the characters before the
    choice's text (an echoed prompt)."""
    if chat:
        return {"content": [{"token": _lossy(e.piece), "logprob": e.logprob, "bytes": list(e.piece),
                             "top_logprobs": [{"token": _lossy(piece), "logprob": lp, "bytes": list(piece)}
                                              for piece, lp in e.top]} for e in entries]}
    return {"tokens": [token_name(e.piece) for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{token_name(piece): lp for piece, lp in e.top} for e in entries]
            if any(e.top for e in entries) else None,
            "text_offset": [text_offset + e.start for e in entries]}


def _lossy(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token: its bytes, the target's log-probability of it, its top alternatives (bytes and
    log-probability each), and ``start``: the characters of its choice's text before its first byte."""

    piece: bytes
    logprob: float
    top: list[tuple[bytes, float]]
    start: int
