"""Structured output through the server (issue 37): the official openai client's ``parse`` with a pydantic model,
``response_format`` and vLLM's ``guided_*`` fields; constrained answers under load, speculating, are each the
request's plain constrained decoding alone."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from test_grammars import SCHEMA
from tiny_gguf import write_tiny_gguf

from specdec.api import SpecDecoder
from specdec.engine import GenerationConfig
from specdec.grammars import GrammarSpec
from specdec.loading import load_target
from specdec.sampling import SamplingParams
from specdec.server import BatchSettings, build_scheduler
from specdec.server.app import OpenAIServer, ServerSettings

PROMPTS = ["Describe a lamp as JSON.", "An item:", "{\"name\": \"cup\"}", "Give me JSON about a chair."]


class Item(BaseModel):
    name: str = Field(max_length=10)
    count: int = Field(ge=0, le=99)
    colour: str = Field(pattern="^(red|green|blue)$")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """A random model over the default model's vocabulary and chat template."""
    return str(write_tiny_gguf(tmp_path_factory.mktemp("structured") / "tiny.gguf"))


@pytest.fixture(scope="module")
def server(model):
    loaded = load_target(model, drafters=("prompt-lookup",), backend="fused")
    settings = BatchSettings(drafter="prompt-lookup", speculation="always", max_batch_size=4, max_model_len=512)
    server = OpenAIServer(build_scheduler(loaded.runtime, settings, loaded.stop_ids), loaded.target.tokenizer,
                          "tiny", ServerSettings(port=0))
    server.start()
    yield server
    server.shutdown(timeout=5)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


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


def test_metrics_count_constrained_requests_and_forced_tokens(client, server):
    before = server.scheduler.metrics.constrained_requests
    client.completions.create(model="tiny", prompt="x", max_tokens=40, temperature=0,
                              extra_body={"guided_regex": "The answer is: [0-9]{2}"})
    assert server.scheduler.metrics.constrained_requests == before + 1
    assert server.scheduler.metrics.forced_tokens > 0
