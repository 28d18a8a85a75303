"""What the house asks of every runtime, as one check a runtime's test calls (tests/templates/test_runtime.py.tmpl).

- It declares what it is (``base.CausalLM``): its name, device, vocabulary, length, the bytes a decode pass reads,
  its precision's label, what computes its rows, and its remedy where they depend on the pass.
- ``extend`` keeps ``tokens`` and hands back the logits asked for; a cache extended in pieces gives what one pass
  gives (bit for bit where its rows do not depend on the pass: ``rows_are_pass_invariant``, which the load probe
  asks too; else within ``tolerance``); ``rollback`` forgets, and extending again gives the same logits.
- Where it declares a pool (``base.Pooled``): rows of several sequences in one pass give each sequence's logits as
  the runtime gives them alone, slots close and refill, and a full pool says so (``PoolFull``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exactspec.backends.base import CausalLM, Pooled, PoolFull, Row, declares, rows_are_pass_invariant


def _same(a: torch.Tensor, b: torch.Tensor, exact: bool, tolerance: float) -> None:
    if exact:
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, rtol=0, atol=tolerance)


def check_declarations(runtime: CausalLM) -> None:
    assert isinstance(runtime.name, str) and runtime.name
    assert isinstance(runtime.device, torch.device) and runtime.vocab_size > 0 and runtime.max_length > 16
    assert runtime.weight_bytes > 0 and runtime.tokens == []
    assert runtime.precision_label and runtime.runtime_label and isinstance(runtime.pass_invariant, bool)
    assert isinstance(runtime.remedy(Path("model.gguf")), str)


def check_cache(runtime: CausalLM, ids: list[int], exact: bool, tolerance: float) -> None:
    """One pass over ``ids``, against pieces, and again after rollbacks."""
    runtime.rollback(0)
    whole = runtime.extend(ids, len(ids))
    assert whole.shape == (len(ids), runtime.vocab_size) and runtime.tokens == ids
    runtime.rollback(0)
    pieces = torch.cat([runtime.extend(ids[:3], 3), runtime.extend(ids[3:4], 1), runtime.extend(ids[4:], len(ids) - 4)])
    _same(pieces, whole, exact, tolerance)
    runtime.rollback(4)
    assert runtime.tokens == ids[:4]
    _same(runtime.extend(ids[4:], 2), whole[-2:], exact, tolerance)
    assert runtime.extend([], 0).shape[0] == 0 and runtime.tokens == ids
    runtime.rollback(0)


def check_pool(runtime: CausalLM, sequences: list[list[int]], exact: bool, tolerance: float) -> None:
    """The runtime's pool, where it declares one: each row as the runtime computes its sequence alone."""
    if not declares(runtime, Pooled):
        return
    alone = []
    for ids in sequences:
        runtime.rollback(0)
        alone.append(runtime.extend(ids, 2))
    runtime.rollback(0)
    pool = runtime.pool(len(sequences), 64)
    assert pool.vocab_size == runtime.vocab_size and pool.max_slots == len(sequences)
    slots = [pool.open() for _ in sequences]
    with pytest.raises(PoolFull):
        pool.open()
    logits = pool.forward([Row(slot, ids[:-1], 1) for slot, ids in zip(slots, sequences)])
    assert [tuple(x.shape) for x in logits] == [(1, runtime.vocab_size)] * len(sequences)
    last = pool.forward([Row(slot, ids[-1:], 1) for slot, ids in zip(slots, sequences)])
    for before, after, expected in zip(logits, last, alone):
        _same(torch.cat([before, after]), expected, exact, tolerance)
    pool.close(slots[0])
    refilled = pool.open()
    _same(pool.forward([Row(refilled, sequences[0], 2)])[0], alone[0], exact, tolerance)
    assert len(pool.slots) == len(sequences)


def check_runtime(runtime: CausalLM, tolerance: float = 1e-4) -> None:
    """Every check above, on a fresh runtime; bit for bit where its rows do not depend on the pass."""
    check_declarations(runtime)
    exact = rows_are_pass_invariant(runtime)
    assert exact or not runtime.pass_invariant  # what it declares, the load probe (which it spares) would find
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, runtime.vocab_size, (12,), generator=generator).tolist()
    check_cache(runtime, ids, exact, tolerance)
    sequences = [torch.randint(0, runtime.vocab_size, (n,), generator=generator).tolist() for n in (5, 9, 3)]
    check_pool(runtime, sequences, exact, tolerance)
