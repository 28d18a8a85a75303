"""ServerSettings check themselves when made, as BatchSettings do: one line naming the field as the CLI's flag."""

from __future__ import annotations

import math

import pytest

from exactspec.errors import UsageError
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
