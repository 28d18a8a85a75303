"""The retrieval drafter's indexes: the right continuations on constructed sequences, at a cost that does not grow
with the context; the datastore's build, save, load and errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tiny import save_with_tokenizer, tiny_llama

from exactspec import datastore as datastores
from exactspec.backends import LeanRuntime
from exactspec.cli import main
from exactspec.errors import UsageError
from exactspec.proposers.retrieval import RetrievalProposer, SessionIndex, continuation
from exactspec.sampling import SamplingParams

GREEDY = SamplingParams()


def draft(context: list[int], k: int = 4, **kwargs) -> list[int]:
    return RetrievalProposer(**kwargs).propose(context, k, GREEDY, None).tokens


def test_a_repeat_is_continued():
    assert draft([1, 2, 3, 4, 9, 1, 2]) == [3, 4, 9, 1]


def test_an_overlapping_run_continues_itself():
    assert draft([5, 5, 5, 5], k=3) == [5, 5, 5]


def test_unicode_text_as_code_points():
    text = "naïve café — naïve ca"
    assert "".join(map(chr, draft([ord(c) for c in text], k=3))) == "fé "


def test_a_match_at_the_very_end_continues_into_what_was_just_written():
    # the tail (7, 8) occurred once before, ending right before the last two tokens
    assert draft([6, 7, 8, 7, 8], k=5) == [7, 8, 7, 8, 7]


def test_the_longest_suffix_wins_over_the_better_supported_shorter_one():
    context = [9, 1, 2, 5, 8, 1, 2, 7, 8, 1, 2, 7, 9, 1, 2]
    assert draft(context, k=1) == [5]  # (9, 1, 2) -> 5 once, though (1, 2) -> 7 twice


def test_the_best_supported_continuation_wins_and_ties_go_to_the_latest():
    assert draft([1, 2, 7, 3, 1, 2, 7, 4, 1, 2, 5, 6, 1, 2], k=1) == [7]  # 7 twice, 5 once
    assert draft([1, 2, 5, 3, 1, 2, 7, 4, 1, 2], k=1) == [7]  # once each: the latest


def test_no_draft_without_a_match_of_min_order():
    assert draft([1, 2, 3, 4, 5, 1]) == []  # only a single token matches
    assert draft([1, 2, 3, 4, 5, 1], min_order=1) == [2, 3, 4, 5]


def test_following_a_growing_context_equals_indexing_it_at_once():
    context = [int(x) for x in np.random.default_rng(0).integers(0, 6, 300)]
    follower = RetrievalProposer()
    for end in range(10, 301, 7):
        assert follower.propose(context[:end], 5, GREEDY, None).tokens == draft(context[:end], k=5)
    follower.propose([40, 41, 40, 41], 2, GREEDY, None)  # another request: the index starts over
    assert follower.session.tokens == [40, 41, 40, 41]


class CountingIndex(SessionIndex):
    lookups = 0

    def best_next(self, suffix):
        CountingIndex.lookups += 1
        return super().best_next(suffix)


def test_a_proposal_costs_the_same_whatever_the_length_of_the_context():
    costs = []
    for length in (100, 20_000):
        rng = np.random.default_rng(1)
        tokens = [int(x) for x in rng.integers(0, 1000, length)] + [1, 2, 3, 4, 1, 2]
        index = CountingIndex()
        index.extend(tokens)
        CountingIndex.lookups = 0
        assert continuation([index], tokens, 4) == [3, 4, 1, 2]
        costs.append(CountingIndex.lookups)
    assert costs[0] == costs[1]


def test_several_continuations_for_a_token_tree():
    context = [1, 2, 7, 8, 1, 2, 7, 8, 1, 2, 5, 6, 1, 2]
    assert RetrievalProposer().propose_many(context, 2, width=3) == [[7, 8], [5, 6]]


# the datastore ----------------------------------------------------------------------------------------------

def test_datastore_agrees_with_the_session_index_and_keeps_documents_apart(tmp_path):
    rng = np.random.default_rng(2)
    documents = [[int(x) for x in rng.integers(0, 5, n)] for n in (400, 300)]
    stream = np.array(documents[0] + [-1] + documents[1])
    store = datastores.build(stream, vocab_size=5, sources=["synthetic"])
    counts: dict[tuple, dict[int, int]] = {}
    for doc in documents:
        for order in range(2, datastores.MAX_ORDER + 1):
            for end in range(order, len(doc)):
                key = tuple(doc[end - order : end])
                counts.setdefault(key, {}).setdefault(doc[end], 0)
                counts[key][doc[end]] += 1
    for key, successors in counts.items():
        support = max(successors.values())
        best = min(t for t, c in successors.items() if c == support)  # the store breaks ties by token id
        assert store.best_next(list(key)) == (best, support)
    store.save(tmp_path / "store")
    loaded = datastores.load(tmp_path / "store", vocab_size=5)
    assert loaded.num_entries == store.num_entries
    for key in list(counts)[:50]:
        assert loaded.best_next(list(key)) == store.best_next(list(key))


def test_no_suffix_crosses_a_document_boundary():
    store = datastores.build(np.array([1, 2, 3, -1, 4, 5, 6]), vocab_size=8, sources=[])
    assert store.best_next([2, 3]) is None  # the document ends there
    assert store.best_next([3, 4]) is None  # would span two documents
    assert store.best_next([4, 5]) == (6, 1)


def test_retrieval_drafts_from_the_datastore_when_the_session_has_nothing():
    store = datastores.build(np.array([10, 11, 12, 13, 14, -1, 10, 11, 12, 13, 99]), vocab_size=100, sources=[])
    assert RetrievalProposer(store).propose([3, 10, 11], 3, GREEDY, None).tokens == [12, 13, 14]


def test_a_datastore_drafts_only_with_retrieval():
    """The rule lives in one place (choices.check_datastore_drafter); the proposers' factory and the server's
    scheduler ask it, and the Python API asks it before it loads anything."""
    from exactspec.api import SpecDecoder
    from exactspec.proposers import make_proposer
    from exactspec.server import BatchSettings, build_scheduler

    store = datastores.build(np.array([1, 2, 3, 1, 2, 4]), vocab_size=64, sources=[])
    target = LeanRuntime(tiny_llama(seed=0))
    assert isinstance(make_proposer("retrieval", target, None, store), RetrievalProposer)
    refusal = "a datastore drafts only with --drafter retrieval or hybrid, not prompt-lookup"
    with pytest.raises(UsageError, match=refusal):
        make_proposer("prompt-lookup", target, None, store)
    with pytest.raises(UsageError, match=refusal):
        build_scheduler(target, BatchSettings(drafter="prompt-lookup"), {1}, store)
    with pytest.raises(UsageError, match=refusal):
        SpecDecoder.load(model="/nowhere", drafter="prompt-lookup", datastore="/nowhere either")


def test_missing_and_corrupt_datastores_are_one_line_errors(tmp_path):
    with pytest.raises(UsageError, match="no datastore at"):
        datastores.load(tmp_path / "nowhere")
    store = datastores.build(np.array([1, 2, 3, 1, 2, 4]), vocab_size=8, sources=[])
    store.save(tmp_path / "store")
    with pytest.raises(UsageError, match="built for a vocabulary of 8"):
        datastores.load(tmp_path / "store", vocab_size=9)
    (tmp_path / "store" / datastores.ARRAYS).write_bytes(b"not a numpy archive")
    with pytest.raises(UsageError, match="corrupt datastore"):
        datastores.load(tmp_path / "store")


def test_json_records_are_read_up_to_a_cut_off_record(tmp_path):
    conversations = [{"id": "a", "conversations": [{"from": "human", "value": "hello there"},
                                                   {"from": "gpt", "value": "general kenobi"}]},
                     {"id": "b", "conversations": [{"from": "human", "value": "second"}]}]
    text = json.dumps(conversations)
    cut = tmp_path / "cut.json"
    cut.write_text(text[: text.index("second") + 3])  # cut off inside the second record
    assert [t for _, t in datastores.read_texts([cut])] == ["hello there\ngeneral kenobi"]
    lines = tmp_path / "lines.jsonl"
    lines.write_text("\n".join(json.dumps(c) for c in conversations))
    assert len(list(datastores.read_texts([lines]))) == 2


def test_datastore_command_builds_describes_and_drafts(tmp_path, capsys):
    model = save_with_tokenizer(tiny_llama(seed=0), tmp_path / "model")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("w5 w6 w7 w8 w9 w10 " * 20)
    code = main(["datastore", "build", "--from", str(corpus), "--out", str(tmp_path / "store"),
                 "--model", str(model)])
    out = capsys.readouterr().out
    assert code == 0 and "120 tokens" in out and "suffixes" in out
    assert main(["datastore", "info", str(tmp_path / "store")]) == 0
    assert "120 tokens" in capsys.readouterr().out
    code = main(["generate", "w5 w6 w7", "--model", str(model), "--datastore", str(tmp_path / "store"),
                 "--max-new-tokens", "8", "--json", "--no-chat", "--dtype", "float32"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["stats"]["draft_tokens"] > 0  # the corpus's continuation was drafted
    assert main(["datastore", "info", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_a_datastore_for_a_gguf_is_tokenized_as_its_runtimes_tokenize(tmp_path, capsys, monkeypatch):
    from tiny_gguf import write_tiny_gguf

    from exactspec.models import load_model

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", seed=0)

    def no_conversion(*args, **kwargs):
        raise AssertionError("the GGUF was converted to a transformers model for its tokenizer")

    monkeypatch.setattr("exactspec.models.transformers_directory", no_conversion)
    text = "def add(a, b):\n    return a + b\n"
    (tmp_path / "corpus.py").write_text(text)
    assert main(["datastore", "build", "--from", str(tmp_path / "corpus.py"), "--out", str(tmp_path / "store"),
                 "--model", str(gguf)]) == 0, capsys.readouterr().err
    ids = load_model(str(gguf), backend="fused").tokenizer.encode(text, add_special_tokens=False)
    store = datastores.load(tmp_path / "store")
    assert store.header["num_tokens"] == len(ids)
    assert store.best_next(ids[:3]) == (ids[3], 1)  # the file's own ids: the runtime's tokenizer's
