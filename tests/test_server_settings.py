"""ServerSettings and ServerOptions check themselves when made, as BatchSettings do: one line naming the field as the
CLI's flag."""

from __future__ import annotations

import math

import pytest

from exactspec.errors import UsageError
from exactspec.server.serving import ServerOptions
from exactspec.server.settings import ServerSettings


def test_the_defaults_and_the_edges_of_each_range_are_taken():
    ServerSettings()
    ServerSettings(port=0, max_body_bytes=1024, max_header_line=256, max_head_bytes=256, read_timeout=0.01,
                   body_timeout=0.01, head_timeout=0.01, stall_seconds=0.01, api_key="k")
    ServerSettings(port=65535)


@pytest.mark.parametrize("field, value, words", [
    ("port", -1, "port must be in 0..65535, got -1"),
    ("port", 65536, "port must be in 0..65535, got 65536"),
    ("max_body_bytes", 1023, "max-body-bytes must be >= 1024, got 1023"),
    ("max_header_line", 255, "max-header-line must be >= 256, got 255"),
    ("max_head_bytes", 0, "max-head-bytes must be >= 256, got 0"),
    ("read_timeout", 0.0, "read-timeout must be > 0 seconds, got 0"),
    ("body_timeout", -1.0, "body-timeout must be > 0 seconds, got -1"),
    ("head_timeout", math.nan, "head-timeout must be > 0 seconds, got nan"),
    ("stall_seconds", 0, "stall-seconds must be > 0 seconds, got 0"),
    ("api_key", " ", "api-key must not be empty"),
])
def test_a_bad_value_is_refused_in_one_line_naming_its_field(field, value, words):
    with pytest.raises(UsageError) as refused:
        ServerSettings(**{field: value})
    message = str(refused.value)
    assert message.startswith(words) and "\n" not in message


@pytest.mark.parametrize("names, words", [
    ("", "served-model-name must not be empty or blank, got ''"),
    (("tiny", " \t"), "served-model-name must not be empty or blank, got ' \\t'"),
    (("tiny", "a\x01b"), "served-model-name 'a\\x01b' holds a control character (U+0001)"),
    ("tiny\n", "served-model-name 'tiny\\n' holds a control character (U+000A)"),
    ("ti\u200bny", "served-model-name 'ti\\u200bny' holds a control character (U+200B)"),
    ("a\u2028b", "served-model-name 'a\\u2028b' holds a control character (U+2028)"),
    (" tiny", "served-model-name ' tiny' starts or ends with whitespace"),
    (("tiny", "org/tiny "), "served-model-name 'org/tiny ' starts or ends with whitespace"),
])
def test_a_served_name_no_client_could_ask_for_is_refused_in_one_line(names, words):
    with pytest.raises(UsageError) as refused:
        ServerOptions(served_model_name=names)
    message = str(refused.value)
    assert message.startswith(words) and "\n" not in message, message


@pytest.mark.parametrize("names", [None, "tiny", ("tiny", "org/tiny:q4_1", "qwen2.5-coder-1.5b", "my model", "é")])
def test_names_clients_can_ask_for_are_taken(names):
    assert ServerOptions(served_model_name=names).served_model_name == names
