"""The clients people use, against ``exactspec serve`` on the default model (SmolLM2-135M-Instruct, with its
default drafter and speculation): instructor (JSON-schema and tools modes), pydantic-ai (an agent with a tool,
tool_choice required, a structured output, whole and streamed) and langchain-openai (``with_structured_output``,
``bind_tools`` forcing a call, whole and streamed). Each client's own parsing must succeed and give what the schema
allows; what each client sent is read off the wire, so that a test cannot pass down another path than the one it
names. A 135M model's answers are not judged for sense, only for their form. Nothing here may reach another host:
every connection but to this machine is refused at once, by name, so a client that would download (tiktoken's
encodings) fails, never hangs."""

from __future__ import annotations

import functools
import json
import operator
import socket
from dataclasses import dataclass
from typing import Literal

import instructor
import openai
import pytest
from instructor.core import IncompleteOutputException
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field
from pydantic_ai import Agent
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import ToolCallPart, ToolReturnPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.output import NativeOutput
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings
from pydantic_ai.usage import UsageLimits

from exactspec.server.batching import BatchSettings
from exactspec.server.serving import DEFAULT_MODEL_NAME, ServerOptions, load_server
from exactspec.server.settings import ServerSettings

KEY = "sesame"
LOOPBACK = {"127.0.0.1", "::1", "localhost"}
GREEDY = {"temperature": 0, "max_tokens": 120}


class Pet(BaseModel):
    kind: Literal["cat", "dog", "bird"]
    name: str = Field(max_length=20)


class Person(BaseModel):
    """A person and their pets (a nested model: its schema refers to ``Pet`` under ``$defs``)."""

    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=150)
    pets: list[Pet] = Field(max_length=3)


class Weather(BaseModel):
    city: str = Field(max_length=30)
    sunny: bool


TEXT = "Alice is 30 years old and has a cat called Tom."
ASK_WEATHER = "What is the weather in Paris?"


# --- the server, the wire and the fence -------------------------------------------------------------------------------


class OffThisMachine(ConnectionRefusedError):
    """A client tried to reach a host other than this machine."""


def _refuse_other_hosts(host) -> None:
    host = host.decode() if isinstance(host, bytes) else host
    if host is not None and host not in LOOPBACK:
        raise OffThisMachine(f"test_clients: a client tried to reach {host}; only this machine's server may be asked")


@pytest.fixture(scope="module")
def fenced(tmp_path_factory):
    """Every connection to another host refused (names and addresses), tracing off, tiktoken's cache empty (so a
    token count would have to download, and is refused)."""
    resolve, connect, connect_ex = socket.getaddrinfo, socket.socket.connect, socket.socket.connect_ex

    def checked_resolve(host, *args, **kwargs):
        _refuse_other_hosts(host)
        return resolve(host, *args, **kwargs)

    def checked(method):
        def call(sock, address):
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                _refuse_other_hosts(address[0])
            return method(sock, address)
        return call

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket, "getaddrinfo", checked_resolve)
        patch.setattr(socket.socket, "connect", checked(connect))
        patch.setattr(socket.socket, "connect_ex", checked(connect_ex))
        for name in ("LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2", "LANGCHAIN_TRACING"):
            patch.setenv(name, "false")
        for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "LANGSMITH_API_KEY"):
            patch.delenv(name, raising=False)
        patch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path_factory.mktemp("tiktoken")))
        yield


@pytest.fixture(scope="module")
def server(fenced):
    """``exactspec serve --backend fused --max-batch-size 2 --max-model-len 1024 --port 0`` with an API key, in this
    process: the default model, drafter and speculation (auto, its pass costs measured at start). The runtime is
    named: choosing it (``auto``) measures each for 10-30 s, and picks by the machine's load."""
    server = load_server(ServerOptions(backend="fused", batch=BatchSettings(max_batch_size=2, max_model_len=1024),
                                       settings=ServerSettings(port=0, api_key=KEY)))
    server.start()
    yield server
    server.shutdown(timeout=5)


@dataclass
class Wire:
    """The JSON bodies a client sent, in order; its HTTP clients (sync and async) record each request."""

    bodies: list

    def record(self, request) -> None:
        self.bodies.append(json.loads(request.read()) if request.content else None)

    async def record_async(self, request) -> None:
        self.record(request)

    def http_client(self):
        return openai.DefaultHttpxClient(event_hooks={"request": [self.record]})

    def async_http_client(self):
        return openai.DefaultAsyncHttpxClient(event_hooks={"request": [self.record_async]})


@pytest.fixture
def wire() -> Wire:
    return Wire([])


def openai_client(server, wire: Wire) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60,
                         http_client=wire.http_client())


def refused_by_the_fence(error: BaseException | None) -> bool:
    """Whether the fence's refusal is among the error's causes (each client wraps it in its own errors)."""
    while error is not None:
        if isinstance(error, OffThisMachine):
            return True
        error = error.__cause__ or error.__context__
    return False


def test_the_fence_refuses_other_hosts_at_once(server):
    """What the clients below would do if they reached out: refused, not hung. A token count (langchain's, through
    tiktoken's encodings, which it would download) and an SDK left pointing at OpenAI."""
    chat = ChatOpenAI(base_url=server.url + "/v1", api_key=KEY, model=DEFAULT_MODEL_NAME, max_retries=0)
    with pytest.raises(Exception) as counted:
        chat.get_num_tokens("How many tokens?")
    with pytest.raises(openai.APIConnectionError) as listed:
        openai.OpenAI(api_key=KEY, max_retries=0, timeout=5).models.list()
    assert refused_by_the_fence(counted.value) and refused_by_the_fence(listed.value)


# --- instructor -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS])
def test_instructor_returns_a_validated_model(server, wire, mode):
    """No retries: the first answer must parse and validate (types, required fields, the bounds and the enum)."""
    client = instructor.from_openai(openai_client(server, wire), mode=mode)
    person, completion = client.chat.completions.create_with_completion(
        model=DEFAULT_MODEL_NAME, response_model=Person, max_retries=0,
        messages=[{"role": "user", "content": TEXT}], **GREEDY)
    assert isinstance(person, Person) and all(isinstance(pet, Pet) for pet in person.pets)
    [sent] = wire.bodies
    choice = completion.choices[0]
    if mode is instructor.Mode.JSON_SCHEMA:
        assert sent["response_format"]["type"] == "json_schema" and "tools" not in sent
        assert choice.finish_reason == "stop"
        answer = choice.message.content
    else:
        assert sent["tool_choice"] == {"type": "function", "function": {"name": "Person"}}
        [call] = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and call.function.name == "Person"
        answer = call.function.arguments
    assert Person.model_validate_json(answer).model_dump() == person.model_dump()


def test_instructor_reads_a_call_that_max_tokens_cuts_short_as_incomplete(server, wire):
    """finish reason "length", not "tool_calls" with arguments that are not JSON: instructor says the answer is
    incomplete instead of failing to parse it."""
    client = instructor.from_openai(openai_client(server, wire), mode=instructor.Mode.TOOLS)
    with pytest.raises(IncompleteOutputException):
        client.chat.completions.create(model=DEFAULT_MODEL_NAME, response_model=Person, max_retries=0,
                                       messages=[{"role": "user", "content": TEXT}], temperature=0, max_tokens=5)


# --- pydantic-ai ------------------------------------------------------------------------------------------------------


@dataclass
class ToolFirst(AbstractCapability):
    """The run's first request must call the named function tool; later ones are pydantic-ai's own choice."""

    name: str

    def get_model_settings(self):
        return lambda ctx: ModelSettings(tool_choice=[self.name]) if ctx.run_step == 1 else ModelSettings()


def agent(server, wire: Wire, output_type, **kwargs) -> Agent:
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60,
                                http_client=wire.async_http_client())
    model = OpenAIChatModel(DEFAULT_MODEL_NAME, provider=OpenAIProvider(openai_client=client))
    return Agent(model, output_type=output_type, model_settings=ModelSettings(**GREEDY), **kwargs)


def run(agent: Agent, prompt: str, streamed: bool, **kwargs) -> tuple[object, list]:
    """The agent's output and its messages, from a run or a streamed run."""
    if not streamed:
        result = agent.run_sync(prompt, **kwargs)
        return result.output, result.all_messages()
    with agent.run_stream_sync(prompt, **kwargs) as response:
        return response.get_output(), response.all_messages()


@pytest.mark.parametrize("streamed", [False, True])
def test_pydantic_ai_calls_the_tool_then_gives_its_structured_output(server, wire, streamed):
    """An agent with a function tool and a structured output (pydantic-ai's output tool, so no text is allowed: it
    asks tool_choice required). Its first step must call the tool (a named tool_choice); the tool runs on arguments
    pydantic-ai validated, and the run ends with the output validated; whole, and streamed."""
    weather = agent(server, wire, Weather, capabilities=[ToolFirst("get_weather")])
    cities = []

    @weather.tool_plain
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"It is sunny in {city}."

    output, messages = run(weather, ASK_WEATHER, streamed, usage_limits=UsageLimits(request_limit=4))
    assert isinstance(output, Weather)
    assert all(body.get("stream", False) == streamed for body in wire.bodies)
    assert wire.bodies[0]["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert all(body["tool_choice"] == "required" for body in wire.bodies[1:]) and len(wire.bodies) >= 2
    assert {tool["function"]["name"] for tool in wire.bodies[-1]["tools"]} == {"get_weather", "final_result"}
    parts = [part for message in messages for part in message.parts]
    called = [part for part in parts if isinstance(part, ToolCallPart)]
    assert called[0].tool_name == "get_weather" and called[-1].tool_name == "final_result"
    assert cities and all(isinstance(city, str) for city in cities)
    assert any(isinstance(part, ToolReturnPart) and part.tool_name == "get_weather" for part in parts)
    assert Weather.model_validate(called[-1].args_as_dict()) == output


def test_pydantic_ai_native_output_is_a_json_schema_answer(server, wire):
    """NativeOutput: the model's own structured output (response_format json_schema), no tools."""
    result = agent(server, wire, NativeOutput(Person)).run_sync(TEXT, usage_limits=UsageLimits(request_limit=1))
    assert isinstance(result.output, Person)
    [sent] = wire.bodies
    assert sent["response_format"]["type"] == "json_schema" and "tools" not in sent


# --- langchain-openai -------------------------------------------------------------------------------------------------


def chat_model(server, wire: Wire) -> ChatOpenAI:
    return ChatOpenAI(base_url=server.url + "/v1", api_key=KEY, model=DEFAULT_MODEL_NAME, max_retries=0, timeout=60,
                      http_client=wire.http_client(), **GREEDY)


@tool
def get_weather(city: str, unit: Literal["C", "F"]) -> str:
    """The weather in a city."""
    return f"20 {unit} in {city}"


@pytest.mark.parametrize("method", [None, "function_calling"])
def test_langchain_structured_output_parses(server, wire, method):
    """``with_structured_output``: its default (json_schema, response_format) and function calling (a named
    tool_choice); the raw answer parsed with no parsing error."""
    structured = chat_model(server, wire).with_structured_output(
        Person, include_raw=True, **({"method": method} if method else {}))
    answer = structured.invoke(TEXT)
    assert answer["parsing_error"] is None and isinstance(answer["parsed"], Person)
    [sent] = wire.bodies
    if method is None:
        assert sent["response_format"]["type"] == "json_schema" and "tools" not in sent
    else:
        assert sent["tool_choice"] == {"type": "function", "function": {"name": "Person"}}
        assert answer["raw"].tool_calls[0]["name"] == "Person"


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("choice, wire_choice", [
    ("get_weather", {"type": "function", "function": {"name": "get_weather"}}),
    ("any", "required"),
])
def test_langchain_bind_tools_with_a_forced_call_parses_its_tool_calls(server, wire, choice, wire_choice, streamed):
    """``bind_tools`` with tool_choice forcing a call (the tool by name, or "any", which langchain sends as
    required), whole and streamed (the chunks added up): the AIMessage's tool_calls parse, with arguments the tool's
    own schema accepts, and the tool runs on them."""
    bound = chat_model(server, wire).bind_tools([get_weather], tool_choice=choice)
    message = functools.reduce(operator.add, bound.stream(ASK_WEATHER)) if streamed else bound.invoke(ASK_WEATHER)
    [sent] = wire.bodies
    assert sent["tool_choice"] == wire_choice and sent.get("stream", False) == streamed
    assert message.invalid_tool_calls == [] and message.response_metadata["finish_reason"] == "tool_calls"
    assert message.tool_calls and {call["name"] for call in message.tool_calls} == {"get_weather"}
    for call in message.tool_calls:
        get_weather.args_schema.model_validate(call["args"])
        assert get_weather.invoke(call["args"]).startswith("20 ")


def test_langchain_bind_tools_without_a_choice_is_refused_by_name(server, wire):
    """tool_choice left out is auto, which the default model's template cannot serve (it writes no calls): a 400
    naming tool_choice reaches the caller as the SDK's BadRequestError, at once."""
    with pytest.raises(openai.BadRequestError) as refused:
        chat_model(server, wire).bind_tools([get_weather]).invoke(ASK_WEATHER)
    assert refused.value.body["param"] == "tool_choice" and len(wire.bodies) == 1
