"""Benchmark prompt readers, on the shipped files and on broken input."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdec.bench.prompts import read_prompts
from specdec.errors import UsageError

DATA = Path(__file__).resolve().parents[1] / "data"


def test_mt_bench_first_turns_with_the_chat_template():
    prompts = read_prompts(DATA / "mt_bench_question.jsonl")
    assert len(prompts) == 80
    assert prompts[0].chat and prompts[0].category == "writing" and prompts[0].text.startswith("Compose")


def test_spec_bench_categories_and_limit():
    summaries = read_prompts(DATA / "spec_bench_question.jsonl", category="summarization")
    assert len(summaries) == 80 and {p.category for p in summaries} == {"summarization"}
    assert len(read_prompts(DATA / "spec_bench_question.jsonl", limit=7)) == 7


def test_humaneval_gzipped_plain_completion():
    prompts = read_prompts(DATA / "HumanEval.jsonl.gz")
    assert len(prompts) == 164
    assert not prompts[0].chat and prompts[0].id == "HumanEval/0" and "def " in prompts[0].text


@pytest.mark.parametrize(
    "content, message",
    [("{not json}\n", "not valid JSON"), ('{"question": "x"}\n', "expected a 'turns' list"), ("\n", "no prompts")],
)
def test_bad_files_are_refused(tmp_path, content, message):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(UsageError, match=message):
        read_prompts(path)


def test_missing_file_and_empty_category(tmp_path):
    with pytest.raises(UsageError, match="not found"):
        read_prompts(tmp_path / "nope.jsonl")
    with pytest.raises(UsageError, match="category"):
        read_prompts(DATA / "mt_bench_question.jsonl", category="poetry")
