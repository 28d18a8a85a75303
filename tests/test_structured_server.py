"""Structured output through the server (issue 37): the official openai client's ``parse`` with a pydantic model,
``response_format`` and vLLM's ``guided_*`` fields; constrained answers under load, speculating, are each the
request's plain constrained decoding alone."""

from __future__ import annotations

import contextlib
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from test_grammars import SCHEMA
from tiny_gguf import write_tiny_gguf

from exactspec.api import SpecDecoder
from exactspec.engine import GenerationConfig
from exactspec.grammars import GrammarSpec
from exactspec.loading import load_target
from exactspec.sampling import SamplingParams
from exactspec.server import BatchSettings, build_scheduler
from exactspec.server.app import OpenAIServer, ServerSettings

PROMPTS = ["Describe a lamp as JSON.", "An item:", "{\"name\": \"cup\"}", "Give me JSON about a chair."]


class Item(BaseModel):
    name: str = Field(max_length=10)
    count: int = Field(ge=0, le=99)
    colour: str = Field(pattern="^(red|green|blue)$")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """A random model over the default model's vocabulary and chat template."""
    return str(write_tiny_gguf(tmp_path_factory.mktemp("structured") / "tiny.gguf"))


def serve_gguf(path: str, names: str | tuple[str, ...], **batch) -> OpenAIServer:
    """A started server over a GGUF on the fused runtime, drafting by prompt lookup, as ``names``."""
    loaded = load_target(path, drafters=("prompt-lookup",), backend="fused")
    settings = BatchSettings(drafter="prompt-lookup", **batch)
    server = OpenAIServer(build_scheduler(loaded.runtime, settings, loaded.stop_ids), loaded.target.tokenizer,
                          names, ServerSettings(port=0))
    server.start()
    return server


@pytest.fixture(scope="module")
def server(model):
    server = serve_gguf(model, "tiny", speculation="always", max_batch_size=4, max_model_len=512)
    yield server
    server.shutdown(timeout=5)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_the_grammar_engines_tokenizer_is_built_at_start_not_by_the_first_structured_request(model):
    """A server builds what every grammar compiles against (0.6 s for the default model's vocabulary) as it starts,
    apart: its first structured request does not wait for it."""
    from exactspec.grammars import llg_tokenizer

    loaded = load_target(model, backend="fused")
    settings = BatchSettings(drafter="none", max_batch_size=1, max_model_len=256)
    server = OpenAIServer(build_scheduler(loaded.runtime, settings, loaded.stop_ids), loaded.target.tokenizer,
                          "tiny", ServerSettings(port=0))
    llg_tokenizer.cache_clear()
    server.start()
    try:
        deadline = time.monotonic() + 30
        while llg_tokenizer.cache_info().currsize == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert llg_tokenizer.cache_info().currsize == 1  # no request was sent
    finally:
        server.shutdown(timeout=5)


def test_the_clients_parse_returns_a_validated_object(client):
    completion = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "An item?"}],
                                               response_format=Item, max_tokens=80, temperature=0)
    item = completion.choices[0].message.parsed
    assert isinstance(item, Item) and completion.choices[0].finish_reason == "stop"
    assert Item.model_validate_json(completion.choices[0].message.content) == item


def test_json_object_and_a_streamed_schema_answer_are_valid_json(client, server):
    """Any JSON object (its strings unbounded: a bias towards closing them lets a random model finish one), and a
    schema's answer streamed."""
    closing = {str(server.tokenizer.encode(text, add_special_tokens=False)[0]): 30 for text in ('"', "}", "1")}
    whole = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "JSON, please."}],
                                           response_format={"type": "json_object"}, max_tokens=120, seed=3,
                                           temperature=0.7, logit_bias=closing)
    assert whole.choices[0].finish_reason == "stop" and isinstance(json.loads(whole.choices[0].message.content), dict)
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "An item?"}], max_tokens=200, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.8, 11)])
def test_constrained_answers_under_load_are_each_the_plain_constrained_decoding(client, model, temperature, seed):
    """Eight requests at once, four at a time, each drafted with prompt lookup and every draft scored, under a JSON
    Schema, greedy and seeded: each is, token for token, its prompt's constrained decoding alone without a drafter
    (the engine)."""
    body = {"max_tokens": 160, "temperature": temperature, "extra_body": {"guided_json": SCHEMA}}
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda prompt: client.completions.create(
            model="tiny", prompt=prompt, seed=seed, **body), PROMPTS * 2))
    plain = SpecDecoder.load(model, drafter="none", backend="fused")
    config = GenerationConfig(max_new_tokens=160, num_draft_tokens=1, sampling=SamplingParams(temperature=temperature),
                              seed=seed)
    for prompt, answer in zip(PROMPTS * 2, answers):
        expected = plain.generate_ids(plain.encode(prompt, chat=False), config, grammar=GrammarSpec.json_schema(SCHEMA))
        assert answer.choices[0].text == expected.text
        jsonschema.validate(json.loads(answer.choices[0].text), SCHEMA)


def test_a_schema_that_max_tokens_cannot_complete_ends_with_length(client):
    answer = client.completions.create(model="tiny", prompt="x", max_tokens=3,
                                       extra_body={"guided_json": SCHEMA})
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 3


def test_a_bad_grammar_fails_alone_and_the_server_goes_on(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt="x", max_tokens=3, extra_body={"guided_grammar": "start: ?"})
    assert refused.value.body["param"] == "guided_grammar" and "grammar" in refused.value.body["message"]
    assert client.completions.create(model="tiny", prompt="x", max_tokens=3, temperature=0).choices[0].text


def test_a_gbnf_grammar_that_repeats_a_group_is_answered_in_its_language(client):
    """Issue 60: ``root ::= ("a"+)+ "b"`` was 400 invalid_grammar (converted to Lark as ``"a"++``)."""
    for seed in (1, 2, 3):
        answer = client.completions.create(model="tiny", prompt="Say:", max_tokens=32, temperature=1.0, seed=seed,
                                           extra_body={"guided_grammar": 'root ::= ("a"+)+ "b"'}).choices[0]
        assert answer.finish_reason == "stop" and re.fullmatch("a+b", answer.text), answer


def test_metrics_count_constrained_requests_and_forced_tokens(client, server):
    before = server.scheduler.metrics.constrained_requests
    client.completions.create(model="tiny", prompt="x", max_tokens=40, temperature=0,
                              extra_body={"guided_regex": "The answer is: [0-9]{2}"})
    assert server.scheduler.metrics.constrained_requests == before + 1
    assert server.scheduler.metrics.forced_tokens > 0


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                           "unit": {"enum": ["C", "F"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, CLOCK)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def valid_calls(calls) -> list[str]:
    """The calls' names, each call's arguments checked against its function's schema."""
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [call.function.name for call in calls]


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_calls_validate_whole_and_streamed(client, parallel):
    for temperature, seed in ((0.0, None), (0.9, 5)):
        answer = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, CLOCK],
                                                tool_choice="required", parallel_tool_calls=parallel,
                                                max_tokens=200, temperature=temperature, seed=seed)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        names = valid_calls(choice.message.tool_calls)
        assert names and (parallel or len(names) == 1)
        streamed = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, CLOCK],
                                                  tool_choice="required", parallel_tool_calls=parallel,
                                                  max_tokens=200, temperature=temperature, seed=seed, stream=True)
        deltas, finish = [], None
        for chunk in streamed:
            deltas += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls"
        assert [(d.function.name, d.function.arguments) for d in deltas] == \
            [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_tool_calls_streamed_carry_the_logprobs_and_the_speculation_summary_of_whole_answers(server, client):
    """Under tools a streamed answer is held until it ends (it may be calls): its chunk then carries the tokens'
    log-probabilities, as the whole answer does (48 entries whole, none streamed before), and its last chunk the
    ``include_speculation`` summary, as without tools."""
    from test_server import stream

    asked = {"messages": ASK, "tools": [WEATHER, CLOCK], "tool_choice": "required", "max_tokens": 120,
             "temperature": 0, "logprobs": True, "top_logprobs": 2}
    whole = client.chat.completions.create(model="tiny", **asked)
    expected = [(entry.token, entry.logprob) for entry in whole.choices[0].logprobs.content]
    assert expected and whole.choices[0].finish_reason == "tool_calls"
    body = {**asked, "model": "tiny", "stream_options": {"include_speculation": True}}
    events = [event for event in stream(server, "/v1/chat/completions", body) if event != "[DONE]"]
    streamed = [(entry["token"], entry["logprob"]) for event in events for choice in event["choices"]
                for entry in ((choice.get("logprobs") or {}).get("content") or [])]
    assert streamed == expected
    last = [event for event in events if event["choices"] and event["choices"][0]["finish_reason"]][-1]
    assert last["choices"][0]["finish_reason"] == "tool_calls"
    assert last["exactspec"]["summary"]["completion_tokens"] == whole.usage.completion_tokens


def test_a_named_function_is_called_with_valid_arguments_and_the_conversation_goes_on(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    answer = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, CLOCK], tool_choice=named,
                                            max_tokens=60, temperature=0)
    call = answer.choices[0].message.tool_calls[0]
    assert valid_calls([call]) == ["get_time"] and answer.choices[0].finish_reason == "tool_calls"
    follow = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    assert client.chat.completions.create(model="tiny", messages=follow, max_tokens=4).choices[0].message.content


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_call_that_max_tokens_cuts_short_is_its_text_and_finishes_with_length(client, choice):
    """Calls cut short by max_tokens are no calls: the answer is their text, with finish reason "length", whole and
    streamed. Clients read "length" as an incomplete answer (instructor raises IncompleteOutputException); "tool_calls"
    would hand them arguments that are not JSON."""
    asked = dict(model="tiny", messages=ASK, tools=[WEATHER], tool_choice=choice, max_tokens=4, temperature=0)
    choice = client.chat.completions.create(**asked).choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    with pytest.raises(ValueError):
        json.loads(choice.message.content)
    chunks = [chunk.choices[0] for chunk in client.chat.completions.create(**asked, stream=True) if chunk.choices]
    assert not any(c.delta.tool_calls for c in chunks) and chunks[-1].finish_reason == "length"
    assert "".join(c.delta.content or "" for c in chunks) == choice.message.content


@pytest.mark.parametrize("params, param", [
    ({"tools": [WEATHER]}, "tool_choice"),  # auto, on a template without a tool-call format
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"functions": [WEATHER["function"]]}, "functions"),
])
def test_tool_requests_that_cannot_be_served_are_refused_by_name(client, params, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, **params)
    assert refused.value.body["param"] == param


def test_tool_choice_none_answers_in_text(client):
    answer = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="none",
                                            max_tokens=4)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content is not None


@contextlib.contextmanager
def serving(path, name: str):
    """A server over the GGUF at ``path`` (prompt lookup, always speculating) and an openai client of it."""
    loaded = load_target(str(path), drafters=("prompt-lookup",), backend="fused")
    settings = BatchSettings(drafter="prompt-lookup", speculation="always", max_batch_size=2, max_model_len=1024)
    server = OpenAIServer(build_scheduler(loaded.runtime, settings, loaded.stop_ids), loaded.target.tokenizer,
                          name, ServerSettings(port=0))
    server.start()
    try:
        yield server, openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    finally:
        server.shutdown(timeout=5)


@pytest.mark.slow  # the 0.5B's vocabulary and template: about 20 s
def test_auto_on_a_template_with_tool_calls_is_text_or_calls_under_their_schemas(tmp_path):
    """tool_choice auto on Qwen2.5's template (a random model over its vocabulary): the answer is text, or, once
    it opens ``<tool_call>`` (a bias makes it), calls under their functions' schemas, returned as tool_calls.
    Streamed, text comes as it is generated (its first characters show it is no call), a call whole."""
    from exactspec.models import model_path

    try:
        qwen = model_path("qwen2.5-coder-0.5b")
    except Exception as error:
        pytest.skip(f"the 0.5B's parts are not installed: {error}")
    with serving(write_tiny_gguf(tmp_path / "qwen-vocab.gguf", vocab_from=qwen), "qwen") as (server, client):
        text = client.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER, CLOCK], max_tokens=8,
                                              temperature=0, logit_bias={"27": -100})  # 27: "<"
        assert text.choices[0].message.tool_calls is None and text.choices[0].message.content
        opening = server.tokenizer.encode("<tool_call>", add_special_tokens=False)
        assert len(opening) == 1
        streamed = list(client.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER, CLOCK],
                                                       max_tokens=8, temperature=0, logit_bias={"27": -100},
                                                       stream=True))
        ask_call = dict(model="qwen", messages=ASK, tools=[WEATHER, CLOCK], max_tokens=200, temperature=0,
                        logit_bias={str(opening[0]): 100}, parallel_tool_calls=False)  # else call after call
        called = client.chat.completions.create(**ask_call)
        streamed_call = list(client.chat.completions.create(**ask_call, stream=True))
    assert called.choices[0].finish_reason == "tool_calls"
    assert valid_calls(called.choices[0].message.tool_calls)
    # text streams as it comes once its first characters show it is no call; a call comes whole, with no text
    pieces = [c.choices[0].delta.content for c in streamed if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1 and "".join(pieces) == text.choices[0].message.content
    assert not any(c.choices[0].delta.content for c in streamed_call if c.choices)
    deltas = [c.choices[0].delta.tool_calls for c in streamed_call if c.choices and c.choices[0].delta.tool_calls]
    assert [d[0].function.name for d in deltas] == [called.choices[0].message.tool_calls[0].function.name]
    assert streamed_call[-1].choices[0].finish_reason == "tool_calls"


# A chat template that asks for calls as Llama 3.1-3.3's do: one bare JSON object with "parameters" (its marker
# sentence is theirs; the rest is this test's own, over the default model's vocabulary and markers)
LLAMA3_STYLE_TEMPLATE = """{% for message in messages %}<|im_start|>{{ message['role'] }}
{% if message.get('tool_calls') %}{% for call in message['tool_calls'] %}{"name": "{{ call['function']['name'] }}", \
"parameters": {{ call['function']['arguments'] | tojson }}}{% endfor %}{% else %}{{ message['content'] }}{% endif %}\
<|im_end|>
{% endfor %}{% if tools %}<|im_start|>system
To call a function, respond with JSON for a function call. Respond in the format {"name": function name, \
"parameters": dictionary of argument name and its value}.
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_auto_on_a_template_with_llama3_json_calls_is_text_or_one_call(tmp_path):
    """tool_choice auto where the template asks for Llama 3's bare JSON calls: text (streamed as it comes), or,
    once the answer opens with "{" (a bias makes it), one call with "parameters" under its function's schema,
    returned as tool_calls, whole and streamed; the conversation goes on with the call in its history."""
    from dataclasses import replace

    from tiny_gguf import tokenizer_fields

    from exactspec.models import default_model_path

    fields = tuple(replace(f, value=LLAMA3_STYLE_TEMPLATE) if f.key == "tokenizer.chat_template" else f
                   for f in tokenizer_fields(str(default_model_path())))
    with serving(write_tiny_gguf(tmp_path / "llama3-calls.gguf", tokenizer=fields), "llama3") as (server, client):
        brace = server.tokenizer.encode("{", add_special_tokens=False)
        assert len(brace) == 1
        ask = dict(model="llama3", messages=ASK, tools=[WEATHER, CLOCK], temperature=0)
        text = client.chat.completions.create(**ask, max_tokens=8, logit_bias={str(brace[0]): -100})
        streamed = list(client.chat.completions.create(**ask, max_tokens=8, logit_bias={str(brace[0]): -100},
                                                       stream=True))
        called = client.chat.completions.create(**ask, max_tokens=200, logit_bias={str(brace[0]): 100})
        streamed_call = list(client.chat.completions.create(**ask, max_tokens=200, logit_bias={str(brace[0]): 100},
                                                            stream=True))
        message = called.choices[0].message
        after = client.chat.completions.create(model="llama3", max_tokens=4, tools=[WEATHER, CLOCK], messages=[
            *ASK, {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in message.tool_calls]},
            {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "12 C"}])
    assert text.choices[0].message.tool_calls is None and text.choices[0].message.content
    pieces = [c.choices[0].delta.content for c in streamed if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1 and "".join(pieces) == text.choices[0].message.content
    assert called.choices[0].finish_reason == "tool_calls" and message.content is None
    assert len(valid_calls(message.tool_calls)) == 1  # this format writes one call
    deltas = [c.choices[0].delta.tool_calls for c in streamed_call if c.choices and c.choices[0].delta.tool_calls]
    assert [(d[0].function.name, d[0].function.arguments) for d in deltas] == \
        [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")


# A chat template that asks for calls as Qwen2.5's and Hermes' do, in <tool_call> tags (its marker is theirs; the rest
# is this test's own, over the default model's vocabulary and markers)
HERMES_STYLE_TEMPLATE = """{% for message in messages %}<|im_start|>{{ message['role'] }}
{% if message.get('tool_calls') %}{% for call in message['tool_calls'] %}<tool_call>
{"name": "{{ call['function']['name'] }}", "arguments": {{ call['function']['arguments'] }}}
</tool_call>{% endfor %}{% else %}{{ message['content'] }}{% endif %}<|im_end|>
{% endfor %}{% if tools %}<|im_start|>system
For each function call, return a json object with function name and arguments within <tool_call></tool_call> tags.
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% endif %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_a_named_function_on_a_template_with_tool_calls_is_the_call_as_the_template_writes_it(tmp_path):
    """tool_choice naming a function where the template writes <tool_call> calls: the answer opens the call as the
    template does (its bytes, joined from the logprobs, show it), the arguments under the function's schema, and
    comes back as one call to that function, whole and streamed; the conversation goes on with it."""
    from dataclasses import replace

    from tiny_gguf import tokenizer_fields

    from exactspec.models import default_model_path

    fields = tuple(replace(f, value=HERMES_STYLE_TEMPLATE) if f.key == "tokenizer.chat_template" else f
                   for f in tokenizer_fields(str(default_model_path())))
    named = {"type": "function", "function": {"name": "get_weather"}}
    with serving(write_tiny_gguf(tmp_path / "hermes-calls.gguf", tokenizer=fields), "hermes") as (server, client):
        ask = dict(model="hermes", messages=ASK, tools=[WEATHER, CLOCK], tool_choice=named, temperature=0,
                   max_tokens=200, logprobs=True)
        called = client.chat.completions.create(**ask)
        streamed = list(client.chat.completions.create(**ask, stream=True))
        calls = called.choices[0].message.tool_calls
        after = client.chat.completions.create(model="hermes", max_tokens=4, tools=[WEATHER, CLOCK], messages=[
            *ASK, {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
            {"role": "tool", "tool_call_id": calls[0].id, "content": "12 C"}])
    assert called.choices[0].finish_reason == "tool_calls" and called.choices[0].message.content is None
    assert valid_calls(calls) == ["get_weather"]
    written = b"".join(bytes(entry.bytes) for entry in called.choices[0].logprobs.content).decode()
    opening, closing = '<tool_call>\n{"name": "get_weather", "arguments": ', "}\n</tool_call>"
    assert written.startswith(opening) and written.endswith(closing)
    assert json.loads(written[len(opening): -len(closing)]) == json.loads(calls[0].function.arguments)
    deltas = [c.choices[0].delta.tool_calls for c in streamed if c.choices and c.choices[0].delta.tool_calls]
    assert [(d[0].function.name, d[0].function.arguments) for d in deltas] == \
        [(c.function.name, c.function.arguments) for c in calls]
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_each_of_n_choices_has_a_matcher_of_its_own(client):
    """n = 3 seeded samples under one schema, compiled once: each choice keeps to it on its own (a matcher shared
    between them would take the other choices' tokens and refuse, or let through, what it should not)."""
    answer = client.completions.create(model="tiny", prompt="An item:", n=3, seed=4, temperature=0.9, max_tokens=160,
                                       extra_body={"guided_json": SCHEMA})
    assert len(answer.choices) == 3 and len({c.text for c in answer.choices}) > 1
    for choice in answer.choices:
        jsonschema.validate(json.loads(choice.text), SCHEMA)
