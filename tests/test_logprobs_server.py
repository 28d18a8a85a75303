"""Log-probabilities through the server on the default model (issue 60): each entry carries its token's own bytes,
so that the entries join into the answer's text exactly, even where a token holds part of a character (an emoji is
three or four byte tokens in SmolLM2's vocabulary); the token that ends the answer (``<|im_end|>``), which the text
does not hold, has none; a stop string keeps the entries of the tokens the text holds."""

from __future__ import annotations

import re

import pytest
from test_server import post, stream
from test_structured_server import serving

from exactspec.models import default_model_path

pytestmark = pytest.mark.slow  # the real default model: about 15 s

EMOJI = [{"role": "user", "content": "Repeat exactly: 🦄🐉🌈"}]
EMOJI_PROMPT = "Emoji: 🦄🐉🌈\nEmoji: 🦄🐉🌈\nEmoji:"


@pytest.fixture(scope="module")
def served():
    with serving(default_model_path(), "smol") as (server, client):
        yield server, client


def joined(entries) -> bytes:
    return b"".join(bytes(entry["bytes"]) for entry in entries)


def whole_and_streamed(server, body: dict) -> tuple[dict, list[dict]]:
    """The chat answer's choice whole, and its logprobs entries as streamed."""
    status, answer = post(server, "/v1/chat/completions", body)
    assert status == 200, answer
    events = [event for event in stream(server, "/v1/chat/completions", {**body, "stream": True})
              if event != "[DONE]"]
    streamed = [entry for event in events for choice in event["choices"]
                for entry in ((choice.get("logprobs") or {}).get("content") or [])]
    text = "".join(choice["delta"].get("content") or "" for event in events for choice in event["choices"])
    assert text == answer["choices"][0]["message"]["content"]
    return answer["choices"][0], streamed


def test_chat_logprobs_carry_each_tokens_own_bytes_and_join_into_the_content(served):
    server, _ = served
    body = {"model": "smol", "messages": EMOJI, "max_tokens": 40, "temperature": 0, "logprobs": True,
            "top_logprobs": 3}
    choice, streamed = whole_and_streamed(server, body)
    content, entries = choice["message"]["content"], choice["logprobs"]["content"]
    assert "🦄🐉🌈" in content and choice["finish_reason"] == "stop"  # ended at <|im_end|>
    assert joined(entries) == content.encode("utf-8")  # no U+FFFD's bytes, and no entry for <|im_end|>
    assert any(len(entry["bytes"]) < 4 and entry["token"] == "\ufffd" for entry in entries)  # a byte token
    assert streamed == entries
    for entry in entries:  # each alternative's bytes are its own: the tokens it names are distinct
        alternatives = [bytes(top["bytes"]) for top in entry["top_logprobs"]]
        assert len(alternatives) == 3 and len(set(alternatives)) == 3
        assert bytes(entry["bytes"]) in alternatives or entry["logprob"] < entry["top_logprobs"][-1]["logprob"]


@pytest.mark.parametrize("stop", ["🐉", " exactly"])
def test_a_stop_string_keeps_the_entries_of_the_tokens_the_content_holds(served, stop):
    """The content is cut where the stop string begins; the entries are the tokens whose bytes begin before the
    cut: their bytes start with the content's and end within the last of them (the whole content where the cut
    falls between two tokens)."""
    server, _ = served
    body = {"model": "smol", "messages": EMOJI, "max_tokens": 40, "temperature": 0, "logprobs": True,
            "stop": [stop]}
    choice, streamed = whole_and_streamed(server, body)
    content, entries = choice["message"]["content"].encode("utf-8"), choice["logprobs"]["content"]
    assert choice["finish_reason"] == "stop" and stop.encode() not in content and content
    assert joined(entries).startswith(content) and len(joined(entries[:-1])) < len(content)
    assert streamed == entries


def named_bytes(token: str) -> bytes:
    """A legacy completion's token name as bytes: ``bytes:\\xNN...`` for a token that is no whole text."""
    if token.startswith("bytes:"):
        return bytes(int(h, 16) for h in re.findall(r"\\x([0-9a-f]{2})", token))
    return token.encode("utf-8")


def test_completions_name_a_byte_token_by_its_bytes_and_keep_every_alternative(served):
    """Legacy completions have no ``bytes``: a token that splits a character is named ``bytes:\\xNN...`` (OpenAI's
    convention), so the tokens join into the text, each top_logprobs names as many alternatives as asked, and the
    text offsets count the characters before each token."""
    _, client = served
    completion = client.completions.create(model="smol", prompt=EMOJI_PROMPT, max_tokens=12, temperature=0,
                                           logprobs=3)
    choice = completion.choices[0]
    tokens, text = choice.logprobs.tokens, choice.text
    assert "🦄" in text and any(token.startswith("bytes:") for token in tokens)
    assert b"".join(named_bytes(token) for token in tokens) == text.encode("utf-8")
    assert all(len(top) == 3 for top in choice.logprobs.top_logprobs)
    data = b""
    for token, offset in zip(tokens, choice.logprobs.text_offset):
        assert offset == len(data.decode("utf-8", errors="ignore"))
        data += named_bytes(token)
