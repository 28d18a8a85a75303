"""The pool of KV-cache slots: rows of any lengths in one pass compute what each sequence computes alone."""

from __future__ import annotations

import pytest
import torch
from tiny import require_pass_invariant, tiny_llama

from exactspec.backends import LeanRuntime
from exactspec.backends.base import PoolFull, Row


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, init_range=0.5).double()


def logits_alone(model, ids: list[int], last: int) -> torch.Tensor:  # [last, vocab]
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -last:]


def test_rows_of_different_lengths_in_one_pass_match_each_sequence_alone(model):
    pool = LeanRuntime(model).pool(max_slots=4, max_length=64)
    sequences = [[3, 4, 5, 6, 7], [9, 10], [11, 12, 13, 14, 15, 16, 17], [20]]
    slots = [pool.open() for _ in sequences]
    outputs = pool.forward([Row(slot, ids, len(ids)) for slot, ids in zip(slots, sequences)])
    for ids, logits in zip(sequences, outputs):
        torch.testing.assert_close(logits, logits_alone(model, ids, len(ids)), rtol=0, atol=1e-12)
    more = [[1, 2], [3], [4, 5, 6], [7]]  # then a pass with rows given out of slot order, some wanting 1 logit
    rows = [Row(slot, ids, 1) for slot, ids in zip(slots, more)][::-1]
    for ids, extra, logits in zip(sequences, more, pool.forward(rows)[::-1]):
        torch.testing.assert_close(logits, logits_alone(model, ids + extra, 1), rtol=0, atol=1e-12)
        sequences[sequences.index(ids)] = ids + extra


def test_closing_a_slot_moves_the_last_into_its_place_and_keeps_its_cache(model):
    pool = LeanRuntime(model).pool(max_slots=3, max_length=64)
    sequences = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
    slots = [pool.open() for _ in sequences]
    pool.forward([Row(slot, ids, 0) for slot, ids in zip(slots, sequences)])
    pool.close(slots[0])
    assert [s.index for s in pool.slots] == [0, 1] and slots[2].index == 0 and slots[0].index == -1
    # a pass over a subset of slots that is not at the front of the pool (gathered, not a view)
    logits = pool.forward([Row(slots[1], [12], 1)])[0]
    torch.testing.assert_close(logits, logits_alone(model, sequences[1] + [12], 1), rtol=0, atol=1e-12)
    logits = pool.forward([Row(slots[2], [13], 1)])[0]
    torch.testing.assert_close(logits, logits_alone(model, sequences[2] + [13], 1), rtol=0, atol=1e-12)


def test_rollback_is_a_length_and_a_full_pool_refuses(model):
    pool = LeanRuntime(model).pool(max_slots=1, max_length=16)
    slot = pool.open()
    pool.forward([Row(slot, [3, 4, 5, 6], 0)])
    slot.length = 2  # forget 5, 6
    logits = pool.forward([Row(slot, [7, 8], 2)])[0]
    torch.testing.assert_close(logits, logits_alone(model, [3, 4, 7, 8], 2), rtol=0, atol=1e-12)
    with pytest.raises(PoolFull):
        pool.open()
    with pytest.raises(ValueError):
        pool.forward([Row(slot, list(range(3, 16)), 1)])  # past max_length


@pytest.mark.parametrize("precision", ["float32", "float16", "bfloat16"])
def test_a_rows_logits_are_the_same_bit_for_bit_whatever_shares_its_pass(precision):
    """In each precision the runtime runs: a sequence's logits, one position at a time on the single-sequence
    runtime, equal those of its rows in pool passes beside other sequences of other lengths (some crossing into a
    second block of keys), and those of one pass over its positions; bit for bit."""
    runtime = require_pass_invariant(LeanRuntime(tiny_llama(seed=0, init_range=0.5), precision))
    sequence = list(range(3, 63)) * 5  # 300 positions: past the first block of 256 keys
    runtime.extend(sequence[:250], 0)
    alone = torch.cat([runtime.extend([token], 1) for token in sequence[250:260]])  # [10, vocab]
    runtime.rollback(250)
    assert torch.equal(runtime.extend(sequence[250:260], 10), alone)
    assert torch.equal(logits_beside_others(runtime, sequence[:250], sequence[250:260]), alone)


def logits_beside_others(runtime, prefix: list[int], tokens: list[int]) -> torch.Tensor:  # [len(tokens), vocab]
    """A sequence's logits at ``tokens`` in a pool over ``runtime``: its prefix prefilled beside three other
    sequences of 40, 140 and 240 tokens, then one position a pass, beside 0 to 3 of the others' drafts of 1 to 5
    tokens (forgotten after each pass)."""
    pool = runtime.pool(max_slots=4, max_length=512)
    watched, others = pool.open(), [pool.open() for _ in range(3)]
    pool.forward([Row(watched, prefix, 0)] + [Row(slot, [5 + i] * (40 + 100 * i), 0)
                                              for i, slot in enumerate(others)])
    rows = []
    for j, token in enumerate(tokens):
        beside = [Row(slot, [7] * (1 + (j + i) % 5), 1) for i, slot in enumerate(others[: j % 4])]
        rows.append(pool.forward([Row(watched, [token], 1)] + beside)[0])
        for row in beside:
            row.slot.length -= len(row.token_ids)
    return torch.cat(rows)
