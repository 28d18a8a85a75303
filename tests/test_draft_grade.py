"""Draft-grade copies of a draft model (backends/fused/draft_grade.py): made once and kept with checksums, rebuilt
where damaged or stale, a cut head whose kept rows compute what the full head's do, 4-bit and 3-bit matrices, and not
one token of the target's output changed by drafting with one."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch
from tiny_gguf import write_tiny_gguf

from exactspec.backends.fused import FusedRuntime, packed_file
from exactspec.backends.fused.draft_grade import DraftGradeRuntime, copy_path, four_bits, three_bits_values
from exactspec.backends.fused.stored import packed_q8
from exactspec.backends.gguf_file import read_gguf
from exactspec.backends.native import unavailable
from exactspec.backends.runtime_kind import DraftGrade
from exactspec.draft_grades import RECIPES, Measured, best

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=f"the fused runtime cannot run here: {unavailable()}")

SHAPE = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128}
IDS = [(37 * i) % 3000 + 10 for i in range(24)]
KEPT = np.unique(np.concatenate([np.arange(0, 4000, 3), IDS])).astype(np.int32)  # a vocabulary holding the prompt


@pytest.fixture
def draft(tmp_path, monkeypatch):
    """A tiny Q5_0 draft model (5-bit matrices, which a draft-grade copy re-quantises to 4), its cache in tmp_path."""
    monkeypatch.setenv("EXACTSPEC_CACHE", str(tmp_path / "cache"))
    return write_tiny_gguf(tmp_path / "draft.gguf", seed=3, tensor_type="Q5_0", **SHAPE)


def graded(path, bits=4, asked=None) -> DraftGradeRuntime:
    def vocabulary():
        if asked is not None:
            asked.append(True)
        return KEPT, 0.9

    return DraftGradeRuntime.of_file(read_gguf(path), DraftGrade(bits=bits), vocabulary)


def test_a_cut_head_keeps_the_full_heads_logits_on_its_rows_and_minus_infinity_elsewhere(draft):
    """With the stored bits, the copy differs from the model only in the head's rows it dropped: each kept row's logit
    is the full model's, bit for bit (each row of a product is computed alone); every other is -inf (q = 0)."""
    full = FusedRuntime.from_gguf(draft).extend(IDS, len(IDS))  # [n, vocab]
    cut = graded(draft, bits=None)
    logits = cut.extend(IDS, len(IDS))
    assert logits.shape == full.shape
    assert torch.equal(logits[:, KEPT], full[:, KEPT])
    outside = np.setdiff1d(np.arange(full.shape[1]), KEPT)
    assert bool(torch.isneginf(logits[:, outside]).all())
    assert cut.weight_bytes < FusedRuntime.from_gguf(draft).weight_bytes


def test_four_bits_reads_fewer_bytes_and_stays_near_the_model(draft):
    """Re-quantised to 4 bits, the copy streams fewer bytes than with its 5 stored bits, and its logits follow the
    full model's: correlated above 0.97 over every kept token and position (0.99 measured; a model of another seed
    is near 0). Only acceptance rests on this: the target judges every drafted token."""
    full = FusedRuntime.from_gguf(draft).extend(IDS, len(IDS))[:, KEPT]
    stored, four = graded(draft, bits=None), graded(draft, bits=4)
    assert four.weight_bytes < stored.weight_bytes
    assert "int4" in four.weights and "int5" in stored.weights
    logits = four.extend(IDS, len(IDS))[:, KEPT]
    assert float(torch.corrcoef(torch.stack([logits.flatten(), full.flatten()]))[0, 1]) > 0.97


def test_three_bits_read_fewer_bytes_than_four_and_stay_near_the_model(draft):
    """Re-quantised to 3 bits (int3_r: 0.44 bytes a weight against int4's 0.625), the copy streams fewer bytes than
    the 4-bit one, and its logits still follow the full model's: correlated above 0.9 over every kept token and
    position (0.96 measured; a model of another seed is near 0)."""
    full = FusedRuntime.from_gguf(draft).extend(IDS, len(IDS))[:, KEPT]
    four, three = graded(draft, bits=4), graded(draft, bits=3)
    assert three.weight_bytes < four.weight_bytes  # (a tiny model: each 8 rows' head of 64 bytes is a good share)
    assert set(three.weights.split("+")) == {"int3_r"}
    logits = three.extend(IDS, len(IDS))[:, KEPT]
    assert float(torch.corrcoef(torch.stack([logits.flatten(), full.flatten()]))[0, 1]) > 0.9


def test_values_already_on_eight_levels_under_a_rows_steps_are_kept_exactly():
    """Weights that are 8 levels of a row's integer steps (d sc q - dmin mn, each group reaching both ends) come
    back as those integers: the grid the kernels read is the one they were on."""
    generator = np.random.default_rng(1)
    q = generator.integers(0, 8, size=(16, 96)).astype(np.uint8)
    q[:, ::32], q[:, 1::32] = 0, 7
    d, dmin = np.float32(0.001), np.float32(0.002)
    sc = generator.integers(1, 256, size=(16, 3))
    sc[:, 0] = 255  # each row's greatest scale and min are 255 steps: the rows' d and dmin are these
    mn = generator.integers(0, 256, size=(16, 3))
    mn[:, 0] = 255
    values = q.reshape(16, 3, 32) * (d * sc)[..., None].astype(np.float32) - (dmin * mn)[..., None].astype(np.float32)
    found_q, found_sc, found_mn, found_d, found_dmin = three_bits_values(values.reshape(16, 96).astype(np.float32))
    assert np.array_equal(found_sc, sc) and np.array_equal(found_mn, mn) and np.array_equal(found_q, q)
    assert np.allclose(found_d, d) and np.allclose(found_dmin, dmin)


def test_values_already_on_sixteen_levels_are_kept_exactly():
    """Weights that are 16 levels of a float16 step over a float16 least, per 32 inputs, come back as they are."""
    generator = np.random.default_rng(0)
    q = generator.integers(0, 16, size=(16, 64)).astype(np.float32)
    q[:, ::32] = 0  # each group reaches both ends: its range is the grid's
    q[:, 1::32] = 15
    scale = np.float16(0.03125) * generator.integers(1, 8, size=(16, 2)).astype(np.float16)
    offset = generator.normal(size=(16, 2)).astype(np.float16)
    values = (q.reshape(16, 2, 32) * scale[..., None].astype(np.float32) + offset[..., None].astype(np.float32))
    packed = four_bits(values.reshape(16, 64))
    expected = packed_q8(torch.from_numpy(q.astype(np.uint8)), torch.from_numpy(scale.astype(np.float32)),
                         torch.from_numpy(offset.astype(np.float32)), bits=4)
    assert torch.equal(packed, expected)


def test_the_copy_is_made_once_and_read_after(draft, capsys):
    asked = []
    first = graded(draft, asked=asked).extend(IDS, len(IDS))
    made = capsys.readouterr().err
    second = graded(draft, asked=asked).extend(IDS, len(IDS))
    assert "making a draft-grade copy of draft.gguf" in made
    assert "making" not in capsys.readouterr().err and len(asked) == 1
    assert torch.equal(first, second)


def test_a_damaged_copy_is_said_in_one_line_and_made_again(draft, capsys):
    """A flipped byte in a matrix or in the embeddings kept beside them: one line, the copy made again, the same
    logits as before the damage."""
    before = graded(draft).extend(IDS, len(IDS))
    kept = copy_path(draft, DraftGrade(bits=4))
    for part in ("matrices", "arrays"):
        data = bytearray(kept.read_bytes())
        length = int.from_bytes(data[-12:-4], "little")
        header = json.loads(data[len(data) - packed_file.TRAILER - length : len(data) - packed_file.TRAILER])
        entry = max(header[part], key=lambda e: e["bytes"])
        data[entry["offset"] + entry["bytes"] // 2] ^= 0x10
        kept.write_bytes(bytes(data))
        capsys.readouterr()
        after = graded(draft).extend(IDS, len(IDS))
        said = [line for line in capsys.readouterr().err.splitlines() if "stale or corrupt" in line]
        assert len(said) == 1 and "checksum does not match" in said[0], said
        assert torch.equal(after, before)


def test_a_killed_builds_partial_file_is_removed_at_the_next_start(draft):
    graded(draft)
    kept = copy_path(draft, DraftGrade(bits=4))
    partial = kept.with_suffix(".999999999.partial")  # no such process
    partial.write_bytes(b"half a copy")
    graded(draft)
    assert not partial.exists() and kept.exists()


def test_a_changed_source_is_another_copy(draft, tmp_path):
    """The copy is keyed by the source's identity (path, size, time): a rewritten file is copied anew, and its old
    copy is pruned as the new one is written."""
    graded(draft)
    old = copy_path(draft, DraftGrade(bits=4))
    write_tiny_gguf(draft, seed=4, tensor_type="Q5_0", **SHAPE)
    graded(draft)
    assert copy_path(draft, DraftGrade(bits=4)) != old and not old.exists()


@pytest.mark.parametrize("bits", [None, 4, 3])
def test_a_copys_one_call_chain_is_its_python_chain(draft, bits):
    """The copy's chain in one C call (chain.c over the cut head and the kept embeddings) drafts what a chain of
    passes in Python does over its full-width logits (-inf off the vocabulary), and leaves the same cache."""
    one, python = graded(draft, bits=bits), graded(draft, bits=bits)
    for runtime in (one, python):
        runtime.extend(IDS[:-1], 1)
    drafted, _ = one.draft_chain([IDS[-1]], 6)
    logits, chain = python.extend([IDS[-1]], 1)[0], []
    for _ in range(6):
        chain.append(int(logits.argmax()))
        logits = python.extend([chain[-1]], 1)[0]
    assert drafted == chain and set(drafted) <= set(KEPT.tolist())
    assert one.tokens == python.tokens[:-1]
    assert torch.equal(one.extend([drafted[-1]], 1), logits[None])


@pytest.mark.slow  # two models, each drafter greedy and seeded, and a server: about 40 s
def test_drafting_with_a_copy_changes_no_token_alone_or_served(draft, tmp_path):
    """A draft model drafting as its draft-grade copy (the default, --draft-grade auto) gives plain decoding's tokens,
    greedy and seeded (the invariant sampler), through the library and through the server's batched drafts."""
    from exactspec.api import SpecDecoder
    from exactspec.server.batching import BatchSettings
    from exactspec.server.serving import ServerOptions, load_server
    from exactspec.server.settings import ServerSettings

    target = write_tiny_gguf(tmp_path / "target.gguf", seed=5, tensor_type="Q8_0", layers=3, hidden=128, heads=4,
                             kv_heads=2, ffn=256)
    prompt = "the quick brown fox jumps over the lazy dog " * 3
    outputs: dict = {}
    for drafter, grade in (("none", "off"), ("draft-model", "auto"), ("hybrid", "auto"), ("draft-model", "off")):
        decoder = SpecDecoder.load(str(target), draft_model=str(draft), drafter=drafter, backend="fused", threads=2,
                                   draft_grade=grade)
        if drafter != "none":
            assert ("draft-grade" in decoder.engine.proposer.models[0].model.precision_label if drafter == "hybrid"
                    else ("draft-grade" in decoder.engine.proposer.model.precision_label) == (grade == "auto"))
        for temperature, seed in ((0.0, None), (0.8, 11)):
            result = decoder.generate(prompt, max_new_tokens=20, num_draft_tokens=4, temperature=temperature,
                                      seed=seed, chat=False)
            outputs.setdefault((temperature, seed), set()).add(tuple(result.token_ids))
    assert all(len(found) == 1 for found in outputs.values()), outputs

    settings = ServerSettings(port=0)
    batch = BatchSettings(drafter="draft-model", speculation="always", max_batch_size=2, max_model_len=256)
    server = load_server(ServerOptions(model=str(target), backend="fused", draft_model=str(draft), threads=2,
                                       batch=batch, settings=settings))
    server.start()
    try:
        answer = httpx.post(server.url + "/v1/completions", json={"model": server.model_name, "prompt": prompt,
                                                                  "max_tokens": 20, "temperature": 0}, timeout=60)
    finally:
        server.shutdown(timeout=5)
    greedy = next(iter(outputs[(0.0, None)]))
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == decoder.tokenizer.decode(list(greedy))


def test_the_draft_cost_bench_times_each_way_of_drafting_beside_the_target(draft, tmp_path, capsys):
    """python -m exactspec.bench.draft_cost: one row per way of drafting (as it is, each draft-grade copy, each
    copy's one-call chain, and that chain as a round after one accepted whole), each a share of the target's step,
    with the floors its bytes set; each copy reads no more bytes than the one before (the vocabulary cut, 4 bits, 3
    bits in the feed-forward matrices, in all)."""
    from exactspec.bench import draft_cost

    target = write_tiny_gguf(tmp_path / "target.gguf", seed=5, tensor_type="Q8_0", layers=3, hidden=128, heads=4,
                             kv_heads=2, ffn=256)
    assert draft_cost.main(["--model", str(target), "--draft-model", str(draft), "--repeats", "2", "--context",
                            "16", "--threads", "2"]) == 0
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and "---" not in line and "runtime" not in line}
    copies = [f"draft-grade ({grade.label})" for grade in (DraftGrade(bits=None), *RECIPES)]
    assert list(rows) == ["target", "draft, as it is", *copies, *(f"{copy}, one call" for copy in copies),
                          *(f"{copy}, one call after a round accepted whole" for copy in copies)]
    megabytes = [float(rows[name][1].split()[0].replace(",", "")) for name in ["draft, as it is", *copies]]
    assert megabytes == sorted(megabytes, reverse=True) and megabytes[0] > megabytes[1] > megabytes[-1]  # (to 0.1 MB)


def test_best_is_the_highest_gain_of_the_recipes_that_keep_the_floor_of_the_four_bit_copys_agreement():
    four, mixed, three = RECIPES
    found = [Measured(four, 0.9, 0.26, 1.3), Measured(mixed, 0.87, 0.2, 1.36), Measured(three, 0.84, 0.18, 1.4)]
    assert best(found).grade == mixed  # three gains most, but keeps 0.933 of the 4-bit copy's agreement, under 0.95
    assert best([Measured(four, 0.9, 0.26, 1.3), Measured(three, 0.8, 0.18, 1.4)]).grade == four
    assert best([Measured(four, 0.5, 0.26, 1.1), Measured(three, 0.49, 0.18, 1.2)]).grade == three


def test_auto_measures_each_recipe_for_the_pair_once_and_keeps_the_choice(draft, tmp_path, monkeypatch, caplog):
    """--draft-grade auto: each recipe's copy is made and fed the same held-out text as the model as stored; the
    recipe chosen is best() of what was measured, said at --verbose; a second load reads the choice kept for the pair
    and measures nothing."""
    import logging

    from exactspec import draft_grades
    from exactspec.backends import gguf_tokenizer, kind
    from exactspec.loading import MEASURED, load_draft

    target = write_tiny_gguf(tmp_path / "target.gguf", seed=4, tensor_type="Q8_0", layers=3, hidden=128, heads=4,
                             kv_heads=2, ffn=256)
    found = []
    measured = draft_grades.measured
    monkeypatch.setattr(draft_grades, "measured", lambda *a: found.extend(measured(*a)) or found)
    with caplog.at_level(logging.INFO, logger="exactspec.detail"):
        loaded = load_draft(draft, target, "fused", MEASURED, threads=1)
    assert [m.grade for m in found] == list(RECIPES)
    assert all(0 <= m.agreement <= 1 and m.cost > 0 for m in found)
    assert found[2].cost < found[1].cost < found[0].cost  # 3 bits in more matrices: fewer bytes a step
    chosen = best(found).grade
    assert loaded.runtime.grade == chosen
    assert any(chosen.label in record.getMessage() and "agrees" in record.getMessage() for record in caplog.records)
    monkeypatch.setattr(draft_grades, "measured", lambda *a: pytest.fail("measured again"))
    assert draft_grades.chosen_grade(kind("fused"), draft, target, 0.8, lambda: gguf_tokenizer(draft),
                                     lambda: (KEPT, 0.9)) == chosen
