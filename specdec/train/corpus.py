"""Prompts to train on: the first user turn of each conversation (ShareGPT by default), or of JSON / JSONL records,
or the paragraphs of plain-text files.

The drafters learn from what the target answers to these prompts (``targetdata``), not from the texts' own
answers: what must be predicted is the target's output.
"""

from __future__ import annotations

import random
from pathlib import Path

from specdec.errors import UsageError


def prompt_texts(sources: list[str] | None, seed: int) -> list[str]:
    """Every prompt text of the sources (ShareGPT when None), shuffled with ``seed``."""
    from specdec import sharegpt

    texts: list[str] = []
    if not sources:
        texts = [text for turns in sharegpt.conversations(sharegpt.default_path()) if (text := _first_user(turns))]
    for source in sources or []:
        texts += _texts_of(Path(source))
    texts = [text for text in texts if text.strip()]
    if not texts:
        raise UsageError("the training data holds no prompts")
    random.Random(seed).shuffle(texts)
    return texts


def _texts_of(path: Path) -> list[str]:
    from specdec.datastore import json_records

    if not path.is_file():
        raise UsageError(f"training data file not found: {path}")
    text = path.read_text(encoding="utf-8", errors="replace")
    stripped = text.lstrip()
    if path.suffix.lower() in (".json", ".jsonl") and stripped[:1] in "[{":
        return [prompt for record in json_records(stripped) if (prompt := _record_prompt(record))]
    return [paragraph.strip() for paragraph in text.split("\n\n") if paragraph.strip()]


def _record_prompt(record: object) -> str | None:
    """A record's prompt: ShareGPT ``conversations``, OpenAI ``messages``, or a ``prompt``/``text``/``question``
    field; a bare string is its own prompt."""
    if isinstance(record, str):
        return record
    if not isinstance(record, dict):
        return None
    for key in ("conversations", "messages"):
        if isinstance(record.get(key), list):
            return _first_user(record[key])
    for key in ("prompt", "text", "question", "instruction", "turns"):
        value = record.get(key)
        if isinstance(value, list) and value and isinstance(value[0], str):  # MT-bench: "turns"
            return value[0]
        if isinstance(value, str):
            return value
    return None


def _first_user(turns: list) -> str | None:
    for turn in turns:
        if not isinstance(turn, dict):
            continue
        role = turn.get("from", turn.get("role"))
        text = turn.get("value", turn.get("content"))
        if role in ("human", "user") and isinstance(text, str) and text.strip():
            return text
    return None
