"""Benchmark prompt readers, on the shipped files and on broken input."""

from __future__ import annotations

from pathlib import Path

import pytest

from exactspec.bench.prompts import read_prompts, select_prompts
from exactspec.errors import UsageError

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


KINDS = ["qa", "rag", "summarization", "translation", "writing", "roleplay", "humaneval"]


def test_every_kind_of_prompt_from_two_files_the_first_of_each_category():
    files = [DATA / "spec_bench_question.jsonl", DATA / "HumanEval.jsonl.gz"]
    prompts = select_prompts(files, categories=KINDS, per_category=2)
    assert [p.category for p in prompts].count("humaneval") == 2 and len(prompts) == 2 * len(KINDS)
    for kind in KINDS:
        source = files[1] if kind == "humaneval" else files[0]
        first = [p.id for p in read_prompts(source, category=kind, limit=2)]
        assert [p.id for p in prompts if p.category == kind] == first, kind
    assert [p.chat for p in prompts] == [p.category != "humaneval" for p in prompts]
    # --limit caps the whole selection, in file order
    assert select_prompts(files, categories=KINDS, per_category=2, limit=5) == prompts[:5]
    # no categories named: the first of every category in both files
    one_each = select_prompts(files, per_category=1)
    assert len(one_each) == len({p.category for p in one_each}) and {"qa", "math", "humaneval"} <= {
        p.category for p in one_each}


def test_the_last_of_each_category_are_the_held_out_prompts_in_file_order():
    """--last: the last N of each category (the held-out prompts), each file's in its own order."""
    files = [DATA / "spec_bench_question.jsonl", DATA / "HumanEval.jsonl.gz"]
    prompts = select_prompts(files, categories=KINDS, per_category=2, last=True)
    assert len(prompts) == 2 * len(KINDS)
    for kind in KINDS:
        every = read_prompts(files[1] if kind == "humaneval" else files[0], category=kind)
        assert [p.id for p in prompts if p.category == kind] == [p.id for p in every[-2:]], kind


def test_an_id_an_earlier_file_holds_is_named_by_its_file(tmp_path):
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text('{"question_id": 1, "category": "qa", "turns": ["w1"]}\n')
    prompts = select_prompts([tmp_path / "a.jsonl", tmp_path / "b.jsonl"])
    assert [p.id for p in prompts] == ["1", "b.jsonl:1"]


@pytest.mark.parametrize("files, kwargs, message", [
    (["spec_bench_question.jsonl"], dict(categories=["qa", "poetry"]), "no prompts of category 'poetry'"),
    (["spec_bench_question.jsonl", "HumanEval.jsonl.gz"], dict(categories=["qa"]), "HumanEval.jsonl.gz of category qa"),
    (["spec_bench_question.jsonl", "nope.jsonl"], dict(limit=1), "not found"),
    (["spec_bench_question.jsonl"], dict(per_category=0), "--per-category must be >= 1"),
])
def test_a_selection_that_cannot_be_made_is_refused(files, kwargs, message):
    with pytest.raises(UsageError, match=message):
        select_prompts([DATA / name for name in files], **kwargs)


def test_the_code_edit_workload_asks_for_edits_of_exactspecs_own_functions():
    """``--prompts code-edits``: one chat prompt per function of 12-40 lines that exactspec ships, each asking to
    rename a variable the function uses (and shows) or to remove its comments, with the function's source; beside a
    prompt file in one run, and the same prompts on every call."""
    import ast
    import re

    from exactspec.bench.edits import CODE_EDITS

    prompts = select_prompts([CODE_EDITS])
    assert len(prompts) >= 50 and len({p.id for p in prompts}) == len(prompts)
    assert all(p.category == "edit" and p.chat for p in prompts)
    for prompt in prompts:
        source = prompt.text.split("```python\n", 1)[1].rsplit("\n```", 1)[0]
        function = ast.parse(source).body[0]  # the function itself, moved to the left margin: it parses
        assert isinstance(function, ast.FunctionDef) and prompt.id.endswith(f":{function.name}")
        assert 12 <= len(source.splitlines()) <= 40
        renamed = re.search(r"rename the variable `(\w+)` to `(\w+)`", prompt.text)
        if renamed:
            uses = [node for node in ast.walk(function) if isinstance(node, ast.Name) and node.id == renamed[1]]
            assert len(uses) >= 3 and renamed[2] == f"{renamed[1]}_value"
        else:
            assert "remove every comment" in prompt.text and "#" in source
    assert select_prompts([CODE_EDITS]) == prompts
    both = select_prompts([DATA / "mt_bench_question.jsonl", CODE_EDITS], per_category=1)
    assert [p.category for p in both][-1] == "edit" and len({p.category for p in both}) > 2
