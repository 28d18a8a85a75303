"""The server's shared suffix index (issue 36): every finished answer goes into one index that every request's
retrieval drafter reads, bounded in tokens, safe across threads, kept across restarts where asked."""

from __future__ import annotations

import random
import threading

import pytest
from tiny import tiny_llama

from exactspec.backends import LeanRuntime
from exactspec.errors import UsageError
from exactspec.proposers.retrieval import SharedIndex
from exactspec.sampling import SamplingParams
from exactspec.server import BatchSettings, build_scheduler
from exactspec.server.scheduler import GenerationRequest


def documents(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6) for _ in range(rng.randrange(1, 30))] for _ in range(count)]


def tables(index: SharedIndex) -> tuple[dict, dict]:
    return index._successors._counts, index._successors._best


def test_forgetting_the_oldest_answers_leaves_what_indexing_the_rest_alone_gives():
    """Past its capacity the index forgets whole documents, oldest first, taking their counts back exactly: its
    tables (counts and best successors, ties aside) are those of an index given only the documents it kept."""
    index = SharedIndex(capacity=120)
    for document in documents(0, 60):
        index.add(document)
        assert index.tokens <= 120
    fresh = SharedIndex(capacity=120)
    for document in index.documents:
        fresh.add(document)
    assert tables(index)[0] == tables(fresh)[0]
    for key, (token, support) in tables(index)[1].items():
        assert support == tables(fresh)[1][key][1] == max(tables(index)[0][key].values())
        assert tables(index)[0][key][token] == support


def test_a_capacity_below_one_token_is_refused():
    for capacity in (0, -5):
        with pytest.raises(UsageError, match="capacity must be >= 1"):
            SharedIndex(capacity)
        with pytest.raises(UsageError, match="datastore-capacity must be >= 1"):
            BatchSettings(drafter="retrieval", datastore_capacity=capacity)


def test_answers_added_on_one_thread_while_drafts_read_on_another():
    """Adding (with evictions) on one thread while another reads: no error, and the bound holds throughout."""
    index = SharedIndex(capacity=200)
    stop, errors = threading.Event(), []

    def read():
        rng = random.Random(1)
        while not stop.is_set():
            try:
                index.best_next([rng.randrange(6) for _ in range(rng.randrange(2, 6))])
                index.top_next([rng.randrange(6), rng.randrange(6)], 3)
            except Exception as error:  # noqa: BLE001 - any error is the failure under test
                errors.append(error)
    reader = threading.Thread(target=read)
    reader.start()
    for document in documents(2, 3000):
        index.add(document)
        assert index.tokens <= 200
    stop.set()
    reader.join()
    assert not errors


PROMPTS = ([3, 4, 5, 6, 7], [9, 10, 11, 12, 13])


def answers(scheduler, prompts) -> list[tuple[list[int], int]]:
    """Each prompt's greedy answer (24 tokens) in turn, one request at a time, with its accepted draft tokens."""
    results = []
    for prompt in prompts:
        handle = scheduler.submit(GenerationRequest(list(prompt), max_tokens=24, sampling=SamplingParams()))
        tokens, _, _ = handle.collect()
        results.append((tokens, scheduler.metrics.accepted_tokens))
    return results


def test_a_request_drafts_from_the_answers_of_earlier_ones_and_keeps_its_tokens(tmp_path):
    """The same prompts asked again draft from the answers the server learned the first time: far more draft
    tokens are accepted, and every answer is the first time's. Kept at shutdown (--datastore-save), a new server
    reads them back and drafts from them on its first request."""
    runtime = LeanRuntime(tiny_llama(seed=0, init_range=0.5))
    settings = BatchSettings(drafter="retrieval", speculation="always", max_batch_size=2, max_model_len=64,
                             save_learned=tmp_path / "store")
    scheduler = build_scheduler(runtime, settings, set())
    scheduler.start()
    first = answers(scheduler, PROMPTS)
    accepted_first = first[-1][1]
    again = answers(scheduler, PROMPTS)
    scheduler.shutdown(timeout=5)
    assert [tokens for tokens, _ in again] == [tokens for tokens, _ in first]
    assert again[-1][1] - accepted_first > max(2 * accepted_first, 24)
    assert (tmp_path / "store" / SharedIndex.FILE).is_file()

    restarted = build_scheduler(runtime, settings, set())
    restarted.start()
    after_restart = answers(restarted, PROMPTS[:1])
    restarted.shutdown(timeout=5)
    assert after_restart[0][0] == first[0][0] and after_restart[0][1] > first[0][1] + 12


def test_a_saved_index_for_another_vocabulary_is_refused_in_one_line(tmp_path):
    index = SharedIndex(capacity=100)
    index.add([1, 2, 3, 4])
    index.save(tmp_path, vocab_size=7)
    with pytest.raises(UsageError, match="vocabulary of 7 tokens"):
        SharedIndex(capacity=100).load(tmp_path, vocab_size=8)
