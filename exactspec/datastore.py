"""A retrieval datastore: for every suffix of 2 to ``max_order`` tokens seen in a corpus, the token that most
often followed it and how often (its support).

Built once from text files with ``exactspec datastore build --from FILE... --out DIR``, saved as one ``.npz`` of
sorted arrays plus a JSON header, and loaded read-only. A suffix is looked up by its 64-bit polynomial hash
(binary search in the sorted hashes of its order): a lookup costs O(log entries), whatever the context. A hash
collision can only make a draft worse, never the output different.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from exactspec.errors import UsageError

FORMAT_VERSION = 1
MAX_ORDER = 6
MIN_ORDER = 2
HASH_BASE = 0x100000001B3  # odd, so multiplication permutes 64-bit values
MASK = (1 << 64) - 1
ARRAYS = "tables.npz"
HEADER = "datastore.json"


def suffix_hash(tokens: Sequence[int]) -> int:
    """The hash of a token sequence, as the vectorised build computes it (wrapping 64-bit arithmetic)."""
    h = 0
    for token in tokens:
        h = (h * HASH_BASE + int(token) + 1) & MASK
    return h


@dataclass
class _Table:
    hashes: np.ndarray  # [entries] uint64, sorted
    tokens: np.ndarray  # [entries] int32: the most frequent successor
    support: np.ndarray  # [entries] int32: how often it followed


class Datastore:
    """The ContinuationIndex of a corpus (see proposers/retrieval.py)."""

    def __init__(self, tables: dict[int, _Table], header: dict, directory: Path | None = None) -> None:
        self.tables = tables
        self.header = header
        self.directory = directory
        self.max_order = max(tables) if tables else MIN_ORDER

    def check_vocabulary(self, vocab_size: int) -> None:
        if self.header["vocab_size"] != vocab_size:
            raise UsageError(f"the datastore at {self.directory} was built for a vocabulary of "
                             f"{self.header['vocab_size']} tokens; this model has {vocab_size}")

    def best_next(self, suffix: Sequence[int]) -> tuple[int, int] | None:
        table = self.tables.get(len(suffix))
        if table is None or not len(table.hashes):
            return None
        h = np.uint64(suffix_hash(suffix))
        i = int(np.searchsorted(table.hashes, h))
        if i < len(table.hashes) and table.hashes[i] == h:
            return int(table.tokens[i]), int(table.support[i])
        return None

    def top_next(self, suffix: Sequence[int], width: int) -> list[tuple[int, int]]:
        hit = self.best_next(suffix)
        return [hit] if hit is not None and width > 0 else []  # the store keeps one successor per suffix

    @property
    def num_entries(self) -> int:
        return sum(len(t.hashes) for t in self.tables.values())

    @property
    def nbytes(self) -> int:
        return sum(t.hashes.nbytes + t.tokens.nbytes + t.support.nbytes for t in self.tables.values())

    def describe(self) -> str:
        h = self.header
        return (f"datastore: {h['num_tokens']:,} tokens from {len(h['sources'])} file(s), "
                f"{self.num_entries:,} suffixes of {MIN_ORDER}-{self.max_order} tokens, {self.nbytes / 1e6:.1f} MB, "
                f"vocabulary {h['vocab_size']}")

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        arrays = {}
        for order, table in self.tables.items():
            arrays[f"hashes_{order}"] = table.hashes
            arrays[f"tokens_{order}"] = table.tokens
            arrays[f"support_{order}"] = table.support
        np.savez(directory / ARRAYS, **arrays)
        (directory / HEADER).write_text(json.dumps(self.header, indent=1))


def build(token_ids: np.ndarray, vocab_size: int, sources: list[str], max_order: int = MAX_ORDER) -> Datastore:
    """Index ``token_ids`` (one stream; documents separated by -1, which no suffix crosses)."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    tables = {}
    hashes = np.zeros(len(tokens), dtype=np.uint64)  # hash of the suffix of the current order ending at i
    valid = np.ones(len(tokens), dtype=bool)  # the suffix lies inside one document
    with np.errstate(over="ignore"):
        for order in range(1, max_order + 1):
            shifted = np.zeros_like(hashes)
            shifted[1:] = hashes[:-1]
            hashes = shifted * np.uint64(HASH_BASE) + (tokens + 1).astype(np.uint64) if order > 1 else \
                (tokens + 1).astype(np.uint64)
            ok = tokens >= 0
            if order > 1:
                prev = np.zeros_like(valid)
                prev[1:] = valid[:-1]
                ok &= prev
            valid = ok
            if order >= MIN_ORDER:
                tables[order] = _most_frequent_successors(hashes, tokens, valid)
    header = {"format": FORMAT_VERSION, "vocab_size": int(vocab_size), "num_tokens": int((tokens >= 0).sum()),
              "max_order": max_order, "sources": sources}
    return Datastore(tables, header)


def _most_frequent_successors(hashes: np.ndarray, tokens: np.ndarray, valid: np.ndarray) -> _Table:
    """For each distinct suffix hash, its most frequent successor (ties: the smaller token id) and its count."""
    ends = np.flatnonzero(valid[:-1] & (tokens[1:] >= 0))  # suffixes that have a successor in the same document
    keys, successors = hashes[ends], tokens[ends + 1]
    order = np.lexsort((successors, keys))
    keys, successors = keys[order], successors[order]
    if not len(keys):
        empty = np.zeros(0, dtype=np.int32)
        return _Table(np.zeros(0, dtype=np.uint64), empty, empty)
    run_start = np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1]) | (successors[1:] != successors[:-1])])
    run_count = np.diff(np.r_[run_start, len(keys)])
    run_key, run_token = keys[run_start], successors[run_start]
    best = np.lexsort((-run_count, run_key))  # per key, the largest count first
    run_key, run_token, run_count = run_key[best], run_token[best], run_count[best]
    first = np.r_[True, run_key[1:] != run_key[:-1]]
    return _Table(run_key[first], run_token[first].astype(np.int32), run_count[first].astype(np.int32))


def load(directory: str | Path, vocab_size: int | None = None) -> Datastore:
    """Load a saved datastore; a missing, corrupt or mismatched one is a one-line UsageError."""
    directory = Path(directory)
    if not (directory / HEADER).is_file() or not (directory / ARRAYS).is_file():
        raise UsageError(f"no datastore at {directory} (expected {HEADER} and {ARRAYS}; "
                         f"build one with: exactspec datastore build --from FILE... --out {directory})")
    try:
        header = json.loads((directory / HEADER).read_text())
        if header.get("format") != FORMAT_VERSION:
            raise ValueError(f"format {header.get('format')!r}, expected {FORMAT_VERSION}")
        tables = {}
        with np.load(directory / ARRAYS) as arrays:
            for order in range(MIN_ORDER, int(header["max_order"]) + 1):
                table = _Table(arrays[f"hashes_{order}"], arrays[f"tokens_{order}"], arrays[f"support_{order}"])
                if not (len(table.hashes) == len(table.tokens) == len(table.support)):
                    raise ValueError(f"tables of order {order} differ in length")
                if len(table.hashes) > 1 and not bool(np.all(table.hashes[1:] > table.hashes[:-1])):
                    raise ValueError(f"hashes of order {order} are not sorted")
                tables[order] = table
    except Exception as error:  # any damage to the files is the user's input, reported in one line
        raise UsageError(f"corrupt datastore at {directory}: {str(error).splitlines()[0] if str(error) else error!r}"
                         ) from None
    store = Datastore(tables, header, directory)
    if vocab_size is not None:
        store.check_vocabulary(vocab_size)
    return store


def read_texts(paths: Iterable[str | Path]) -> Iterator[tuple[str, str]]:
    """(source, text) for each document in the files: JSON / JSONL records (ShareGPT conversations, or any string
    fields), read record by record so that a file cut off mid-record still yields every complete one; any other
    file is one plain-text document."""
    for path in map(Path, paths):
        if not path.is_file():
            raise UsageError(f"corpus file not found: {path}")
        text = path.read_text(encoding="utf-8", errors="replace")
        stripped = text.lstrip()
        if path.suffix.lower() in (".json", ".jsonl") and stripped[:1] in "[{":
            for record in json_records(stripped):
                yield str(path), "\n".join(_strings(record))
        else:
            yield str(path), text


def json_records(text: str) -> Iterator[object]:
    """Top-level records of a JSON array or JSON lines, one at a time, stopping at the first incomplete one."""
    decoder = json.JSONDecoder()
    i = 1 if text.startswith("[") else 0
    while i < len(text):
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # a file cut off mid-record: keep what came before
        yield record


def _strings(record: object) -> Iterator[str]:
    """The text of a record: every string value, in order (ShareGPT's turns are the "value" fields)."""
    if isinstance(record, str):
        yield record
    elif isinstance(record, dict):
        for key, value in record.items():
            if key not in ("id", "from", "role"):
                yield from _strings(value)
    elif isinstance(record, list):
        for value in record:
            yield from _strings(value)


def build_from_files(sources: list[str], out: str | Path, model: str | None = None, max_tokens: int | None = None
                     ) -> Datastore:
    """Tokenize the corpus files with the model's tokenizer, index them, save to ``out``."""
    import sys

    from exactspec.models import load_tokenizer

    if max_tokens is not None and max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {max_tokens}")
    tokenizer, vocab_size = load_tokenizer(model)
    pieces: list[np.ndarray] = []
    total = 0
    for _, text in read_texts(sources):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if max_tokens is not None:
            ids = ids[: max_tokens - total]
        pieces += [np.asarray(ids, dtype=np.int64), np.array([-1])]
        total += len(ids)
        if max_tokens is not None and total >= max_tokens:
            break
    if total == 0:
        raise UsageError("the corpus holds no text")
    print(f"exactspec: indexing {total:,} tokens", file=sys.stderr)
    store = build(np.concatenate(pieces), vocab_size, [str(s) for s in sources])
    store.save(Path(out))
    return store
