"""A named ``tool_choice`` (issue 60): where the chat template writes calls in a format exactspec knows, the answer
is that call as the template writes it, its opening forced (``<tool_call>\\n{"name": "Person", "arguments": `` on
Qwen2.5's), its arguments under the function's schema; the model then writes the arguments as it was trained to,
not an object in which it puts the function's name (instructor's TOOLS mode on the 1.5B: right 2/5 before)."""

from __future__ import annotations

import json

import pytest

from exactspec.backends import gguf_tokenizer
from exactspec.grammars import grammar_for
from exactspec.models import default_model_path
from exactspec.server.tools import HERMES, LLAMA3_JSON, tool_calling
from exactspec.vocabularies import TokenText

PERSON = {"type": "function", "function": {"name": "Person", "parameters": {
    "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"]}}}
OTHER = {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}
NAMED = {"type": "function", "function": {"name": "Person"}}
ARGUMENTS = '{"name": "Ann", "age": 3}'


@pytest.fixture(scope="module")
def text() -> TokenText:
    """The default model's vocabulary as bytes (no weights)."""
    tokenizer = gguf_tokenizer(default_model_path())
    return TokenText(tokenizer, tokenizer.vocab_size)


@pytest.mark.parametrize("form, call", [
    (HERMES, '<tool_call>\n{"name": "Person", "arguments": ' + ARGUMENTS + '}\n</tool_call>'),
    (LLAMA3_JSON, '{"name": "Person", "parameters": ' + ARGUMENTS + '}'),
])
def test_a_named_function_is_the_templates_call_with_its_opening_forced(text, form, call):
    calling = tool_calling([PERSON, OTHER], NAMED, None, f"... {form.marker} ...")
    grammar = grammar_for(calling.grammar(), text, {text.tokenizer.eos_token_id})
    opening = call[: call.index(ARGUMENTS)].encode()
    assert text.text_of(grammar.forced(64)).startswith(opening)  # through the arguments' key, no model asked
    grammar.reset()
    assert grammar.advance(text.encode(call.encode())[0]) and grammar.accepting
    grammar.reset()
    other = call.replace('"Person"', '"other"', 1)
    assert not grammar.advance(text.encode(other.encode())[0])  # the named function only
    calls = calling.calls(call)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("Person", json.loads(ARGUMENTS))]


def test_a_named_function_on_a_template_without_a_call_format_is_its_arguments_alone(text):
    calling = tool_calling([PERSON, OTHER], NAMED, None, "a template that writes no calls")
    grammar = grammar_for(calling.grammar(), text, {text.tokenizer.eos_token_id})
    assert grammar.advance(text.encode(ARGUMENTS.encode())[0]) and grammar.accepting
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calling.calls(ARGUMENTS)] == \
        [("Person", ARGUMENTS)]
