"""Prompts to train on: the first user turn of each conversation (ShareGPT by default), or of JSON / JSONL records,
or the paragraphs of plain-text files; each with the data's own first answer where the record has one.

The drafters learn mostly from what the target answers to these prompts (``targetdata``): what must be predicted is
the target's output. The data's own answers, fed to the target as written, add positions three times cheaper (one
pass instead of one per token), still labelled with the target's distributions.
"""

from __future__ import annotations

import random
from pathlib import Path

from exactspec.errors import UsageError

Exchange = tuple[str, "str | None"]  # (prompt, the data's own answer to it, if any)


def exchanges(sources: list[str] | None, seed: int) -> list[Exchange]:
    """Every prompt of the sources (ShareGPT when None) with its answer, shuffled with ``seed``."""
    from exactspec import sharegpt

    found: list[Exchange] = []
    if not sources:
        found = [pair for turns in sharegpt.conversations(sharegpt.default_path()) if (pair := _first_exchange(turns))]
    for source in sources or []:
        found += _exchanges_of(Path(source))
    found = [(prompt, answer) for prompt, answer in found if prompt.strip()]
    if not found:
        raise UsageError("the training data holds no prompts")
    random.Random(seed).shuffle(found)
    return found


def _exchanges_of(path: Path) -> list[Exchange]:
    from exactspec.datastore import json_records

    if not path.is_file():
        raise UsageError(f"training data file not found: {path}")
    text = path.read_text(encoding="utf-8", errors="replace")
    stripped = text.lstrip()
    if path.suffix.lower() in (".json", ".jsonl") and stripped[:1] in "[{":
        return [pair for record in json_records(stripped) if (pair := _record_exchange(record))]
    return [(paragraph.strip(), None) for paragraph in text.split("\n\n") if paragraph.strip()]


def _record_exchange(record: object) -> Exchange | None:
    """A record's prompt and answer: ShareGPT ``conversations``, OpenAI ``messages``, or a ``prompt``/``text``/
    ``question`` field (with an ``answer``/``response``/``output``/``completion`` field); a bare string is its own
    prompt."""
    if isinstance(record, str):
        return record, None
    if not isinstance(record, dict):
        return None
    for key in ("conversations", "messages"):
        if isinstance(record.get(key), list):
            return _first_exchange(record[key])
    answer = next((value for key in ("answer", "response", "output", "completion")
                   if isinstance(value := record.get(key), str) and value.strip()), None)
    for key in ("prompt", "text", "question", "instruction", "turns"):
        value = record.get(key)
        if isinstance(value, list) and value and isinstance(value[0], str):  # MT-bench: "turns"
            return value[0], answer
        if isinstance(value, str):
            return value, answer
    return None


def _first_exchange(turns: list) -> Exchange | None:
    """The first user turn with a text, and the assistant turn right after it when there is one."""
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            continue
        role = turn.get("from", turn.get("role"))
        text = turn.get("value", turn.get("content"))
        if role in ("human", "user") and isinstance(text, str) and text.strip():
            reply = turns[i + 1] if i + 1 < len(turns) and isinstance(turns[i + 1], dict) else {}
            answer = reply.get("value", reply.get("content"))
            is_answer = reply.get("from", reply.get("role")) in ("gpt", "assistant", "chatgpt", "bard")
            return text, answer if is_answer and isinstance(answer, str) and answer.strip() else None
    return None
