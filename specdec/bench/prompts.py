"""Readers for benchmark prompt files: MT-bench / Spec-Bench JSONL and HumanEval JSONL (optionally gzipped)."""

from __future__ import annotations

import argparse
import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from specdec.errors import UsageError


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    text: str
    chat: bool  # MT-bench style questions go through the chat template; HumanEval is completed as plain text


def read_prompts(path: str | Path, category: str | None = None, limit: int | None = None) -> list[BenchPrompt]:
    """Prompts from a JSONL file: records with ``turns`` (first turn, chat) or ``prompt`` (plain completion)."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"prompt file not found: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    prompts = []
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                prompt = _parse(json.loads(line), number)
            except json.JSONDecodeError as error:
                raise UsageError(f"{path}:{number}: not valid JSON ({error.msg})") from None
            if category is None or prompt.category == category:
                prompts.append(prompt)
            if limit is not None and len(prompts) >= limit:
                break
    if not prompts:
        raise UsageError(f"no prompts in {path}" + (f" with category {category!r}" if category else ""))
    return prompts


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
    """The flags the ``python -m specdec.bench.*`` scripts share: which prompts, how many, how long an answer,
    which model, how many threads."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="data/mt_bench_question.jsonl")
    parser.add_argument("--limit", type=int, default=limit)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--model", default=None)
    parser.add_argument("--threads", type=int, default=None)
    return parser
