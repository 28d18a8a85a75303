"""Readers for benchmark prompt files: MT-bench / Spec-Bench JSONL and HumanEval JSONL (optionally gzipped)."""

from __future__ import annotations

import argparse
import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from exactspec.bench.edits import CATEGORY as EDIT
from exactspec.bench.edits import CODE_EDITS, code_edits
from exactspec.errors import UsageError


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    text: str
    chat: bool  # MT-bench style questions go through the chat template; HumanEval is completed as plain text


def read_prompts(path: str | Path, category: str | None = None, limit: int | None = None) -> list[BenchPrompt]:
    """Prompts from a JSONL file: records with ``turns`` (first turn, chat) or ``prompt`` (plain completion)."""
    prompts = []
    for prompt in _records(path):
        if category is None or prompt.category == category:
            prompts.append(prompt)
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise UsageError(f"no prompts in {path}" + (f" with category {category!r}" if category else ""))
    return prompts


def select_prompts(paths: list[str | Path], categories: list[str] | None = None, per_category: int | None = None,
                   limit: int | None = None, last: bool = False) -> list[BenchPrompt]:
    """Prompts from several files, in file order: those of ``categories`` (None: all), the first ``per_category``
    of each category (``last``: the last, the held-out prompts nothing is tuned on), at most ``limit`` in all. One
    benchmark run then holds every kind of prompt (Spec-Bench's qa, rag, summarization, translation; writing,
    roleplay; HumanEval) side by side. A prompt whose id an earlier file already holds is named ``file:id``, so
    per-prompt results stay apart. Each file must hold a prompt of the categories, and each category named must be
    found."""
    if per_category is not None and per_category < 1:
        raise UsageError(f"--per-category must be >= 1, got {per_category}")
    if limit is not None and limit < 1:
        raise UsageError(f"--limit must be >= 1, got {limit}")
    for path in paths:
        _existing(path)  # every file named is there, though --limit may stop before it is read
    wanted = None if categories is None else set(categories)
    taken: dict[str, int] = {}  # category -> prompts selected
    prompts: list[BenchPrompt] = []
    ids: set[str] = set()
    for path in paths:
        found = False  # the file holds a prompt of the categories asked for (taken, or over --per-category)
        first = len(prompts)
        for prompt in (reversed(list(_records(path))) if last else _records(path)):
            if limit is not None and len(prompts) >= limit:
                return prompts
            if wanted is not None and prompt.category not in wanted:
                continue
            found = True
            if taken.get(prompt.category, 0) == per_category:
                continue
            if prompt.id in ids:
                prompt = replace(prompt, id=f"{Path(path).name}:{prompt.id}")
            ids.add(prompt.id)
            taken[prompt.category] = taken.get(prompt.category, 0) + 1
            prompts.append(prompt)
        if last:
            prompts[first:] = prompts[first:][::-1]  # back in file order
        if not found:
            raise UsageError(f"no prompts in {path}" + (f" of category {', '.join(categories)}" if categories else ""))
    missing = [c for c in categories or () if c not in taken]
    if missing:
        raise UsageError(f"no prompts of category {', '.join(map(repr, missing))} in {', '.join(map(str, paths))}")
    return prompts


def _records(path: str | Path) -> Iterator[BenchPrompt]:
    """The prompts of a JSONL file (gzipped where it ends in .gz), in order, or the code-edit workload's
    (``CODE_EDITS``: bench/edits.py); one line naming the fault of a broken one."""
    if str(path) == CODE_EDITS:
        yield from (BenchPrompt(id=id, category=EDIT, text=text, chat=True) for id, text in code_edits())
        return
    path = _existing(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise UsageError(f"{path}:{number}: not valid JSON ({error.msg})") from None
            yield _parse(record, number)


def _existing(path: str | Path) -> Path:
    """The path of a prompt file that is there (or ``CODE_EDITS``, the workload made here); else one line saying it
    is not."""
    path = Path(path)
    if not path.is_file() and str(path) != CODE_EDITS:
        raise UsageError(f"prompt file not found: {path}")
    return path


def _parse(record: dict, number: int) -> BenchPrompt:
    if isinstance(record.get("turns"), list) and record["turns"]:
        return BenchPrompt(
            id=str(record.get("question_id", number)),
            category=str(record.get("category", "default")),
            text=str(record["turns"][0]),
            chat=True,
        )
    if isinstance(record.get("prompt"), str):
        return BenchPrompt(id=str(record.get("task_id", number)), category="humaneval", text=record["prompt"],
                           chat=False)
    raise UsageError(f"line {number}: expected a 'turns' list (MT-bench) or a 'prompt' string (HumanEval)")


def prompt_script_parser(description: str, limit: int) -> argparse.ArgumentParser:
    """The flags the ``python -m exactspec.bench.*`` scripts share: which prompts, how many, how long an answer,
    which model, how many threads."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="data/mt_bench_question.jsonl")
    parser.add_argument("--limit", type=int, default=limit)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--model", default=None)
    parser.add_argument("--threads", type=int, default=None)
    return parser
