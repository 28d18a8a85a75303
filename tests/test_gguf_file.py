"""A GGUF file read as stored (exactspec/backends/gguf_file.py), and the fused runtime repacking its Q4_0, Q4_1 and
Q8_0 blocks as they are (exactspec/backends/fused/stored.py): the same weights as gguf-py reads them, the module's
logits, and bad files refused in one line."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tiny import float32_error
from tiny_gguf import write_tiny_gguf

from exactspec.backends import LeanRuntime
from exactspec.backends.fused import FusedRuntime, unavailable
from exactspec.backends.fused.stored import stored_q8, tensor_names
from exactspec.backends.gguf_file import GGUFFile, q8_rows
from exactspec.errors import UsageError
from exactspec.models import load_model

STORED_TYPES = ["Q4_0", "Q4_1", "Q8_0"]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gguf-file")
    return {kind: write_tiny_gguf(folder / f"tiny-{kind}.gguf", seed=0, tensor_type=kind)
            for kind in STORED_TYPES + ["F32"]}


@pytest.mark.parametrize("kind", STORED_TYPES + ["F32"])
def test_tensors_and_metadata_are_what_gguf_py_reads(files, kind):
    ours, theirs = GGUFFile(files[kind]), gguf.GGUFReader(files[kind])
    assert ours.field("general.architecture") == "llama" and ours.field("llama.block_count") == 2
    assert len(ours.field("tokenizer.ggml.tokens")) == 49152
    assert sorted(ours.tensors) == sorted(t.name for t in theirs.tensors)
    for tensor in theirs.tensors:
        mine = ours.tensors[tensor.name]
        assert mine.type_name == tensor.tensor_type.name and mine.shape == tuple(int(d) for d in tensor.shape[::-1])
        assert np.array_equal(mine.data.reshape(-1), np.asarray(tensor.data).reshape(-1).view(np.uint8))


@pytest.mark.parametrize("kind", STORED_TYPES)
def test_q8_rows_are_the_stored_weights_exactly(files, kind):
    """d q + m, per 32 values, is gguf-py's de-quantisation of every matrix, value for value."""
    source = GGUFFile(files[kind])
    matrices = [t for t in source.tensors.values() if t.type_name == kind]
    assert len(matrices) >= 14
    for tensor in matrices:
        q, d, m = q8_rows(tensor)
        values = (q.reshape(q.shape[0], -1, 32) * d[..., None] + m[..., None]).reshape(tensor.shape)
        expected = gguf.quants.dequantize(np.asarray(tensor.data), getattr(gguf.GGMLQuantizationType, kind))
        assert np.array_equal(values, expected.reshape(tensor.shape)), tensor.name


def _module(path: Path) -> torch.nn.Module:
    """The file as exactspec converts it for its PyTorch runtimes (a transformers module, in float32)."""
    return load_model(str(path), dtype="float32", backend="lean").model


@pytest.mark.parametrize("kind", [pytest.param("Q4_0", marks=pytest.mark.slow), "Q4_1",
                                  pytest.param("Q8_0", marks=pytest.mark.slow)])
def test_the_fused_runtime_repacks_the_stored_blocks_and_computes_the_modules_logits(files, kind):
    """Every matrix (q, k and v with llama.cpp's row order undone, the output, gate and up, down, the LM head) comes
    from the file's blocks, and with float products the logits are those of the lean runtime in float32 over the
    module's weights, within 4x transformers' own float32 error (tiny.float32_error); and of the runtime that
    searched the module's weights for their grid."""
    model = _module(files[kind])
    if unavailable(model, "int8") is not None:
        pytest.skip(unavailable(model, "int8"))
    stored = FusedRuntime(model, "int8", gguf=files[kind], products="float")
    assert stored.stored_matrices == 4 * 2 + 1
    sequence = list(range(3, 63)) * 2
    bound = 4 * float32_error(model, sequence)
    logits = stored.extend(sequence, len(sequence))
    for other in (LeanRuntime(model, "float32"), FusedRuntime(model, "int8", products="float")):
        assert (logits - other.extend(sequence, len(sequence))).abs().max() <= bound


def test_blocks_that_do_not_hold_the_modules_weights_are_left_to_the_grid_search(files):
    """A matrix whose stored weights match the module's in no row order (another model's), or that is not stored
    in a Q8 block format (F32), is not taken from the file."""
    q41, f32 = GGUFFile(files["Q4_1"]), GGUFFile(files["F32"])
    names = tensor_names(2, q41.tensors)[1]  # layer 0's output projection
    q, d, m = q8_rows(q41.tensors[names[0]])
    weight = torch.from_numpy((q.reshape(q.shape[0], -1, 32) * d[..., None] + m[..., None]).reshape(q.shape))
    assert stored_q8(q41, names, weight, 4, 2) is not None
    assert stored_q8(q41, names, weight + 1e-3, 4, 2) is None
    assert stored_q8(f32, names, weight, 4, 2) is None


def test_a_truncated_or_foreign_file_is_one_line(files, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(files["Q4_1"].read_bytes()[:-1000])
    with pytest.raises(UsageError, match="truncated") as error:
        GGUFFile(truncated)
    assert "\n" not in str(error.value) and "truncated.gguf" in str(error.value)
    foreign = tmp_path / "foreign.gguf"
    foreign.write_bytes(b"not a model at all")
    with pytest.raises(UsageError, match="not a GGUF file"):
        GGUFFile(foreign)


@pytest.mark.parametrize("kind", STORED_TYPES)
def test_the_fused_runtime_read_from_the_file_alone_is_the_converted_modules_bit_for_bit(files, kind):
    """From the file alone (its metadata, its blocks as stored, no transformers module): the logits of the runtime
    built from the module the file converts to, with the same blocks, bit for bit: a prompt's bulk pass, decode
    steps, a chain after a rollback and a tree; 4-bit blocks kept in 4 bits (their integer products are the bytes',
    integer for integer)."""
    direct = FusedRuntime.from_gguf(files[kind])
    assert direct.stored_matrices == 4 * 2 + 1
    assert direct.weights == ("int8" if kind == "Q8_0" else "int4")
    converted = FusedRuntime(_module(files[kind]), "int8", gguf=files[kind])
    outputs = []
    for runtime in (direct, converted):
        sequence = list(range(3, 63)) * 2
        logits = [runtime.extend(sequence, len(sequence))]
        logits += [runtime.extend([token], 1) for token in (5, 9, 17)]
        runtime.rollback(len(sequence) + 1)
        logits += [runtime.extend([7, 8, 9], 3), runtime.extend_tree([1, 2, 3, 4], [0, 0, 1, 1])]
        outputs.append(torch.cat(logits))
    assert torch.equal(outputs[0], outputs[1])
    assert direct.max_length == converted.max_length == 512
    assert (direct.weight_bytes < converted.weight_bytes) == ("int4" in direct.weights)


def test_what_the_fused_runtime_does_not_read_directly_is_named_and_converted(files, monkeypatch, caplog, tmp_path):
    """A file whose sizes the tiles for blocks do not fit (a hidden size of 72, not whole groups of 32) is not read
    directly (one reason, in words, said under --verbose); load_model then runs the fused runtime from the file's
    transformers conversion (float16 tiles), and a Q4_1 file from the file alone, with llama.cpp's tokenizer."""
    from exactspec import logs
    from exactspec.backends.fused import gguf_unavailable

    odd = write_tiny_gguf(tmp_path / "tiny-72.gguf", seed=0, tensor_type="F32", hidden=72, heads=3, kv_heads=1,
                          ffn=136)
    assert gguf_unavailable(GGUFFile(files["Q4_1"])) is None
    assert "do not fit" in gguf_unavailable(GGUFFile(odd))
    monkeypatch.setattr(logs, "_verbose", True)
    direct, converted = (load_model(str(path), backend="fused") for path in (files["Q4_1"], odd))
    assert [r.getMessage() for r in caplog.records if "transformers conversion" in r.getMessage()] == [
        "the fused runtime runs tiny-72.gguf from its transformers conversion: its sizes (hidden, head, "
        "intermediate: (72, 24, 136)) do not fit its int8 tiles"]
    assert direct.model is None and isinstance(direct.runtime, FusedRuntime) and direct.backend_name == "fused"
    assert converted.model is not None and converted.runtime is None
    ids = direct.tokenizer.encode("Hello, world")
    assert ids == converted.tokenizer.encode("Hello, world") and direct.vocab_size == converted.vocab_size


def test_auto_measures_without_converting_a_file_the_fused_runtime_reads(files, monkeypatch):
    """--backend auto on a GGUF the fused runtime reads from the file alone times llama.cpp and the fused runtime,
    and converts nothing (the lean runtime, which would need the conversion, is no candidate); it runs the faster."""
    pytest.importorskip("llama_cpp")
    from exactspec import models
    from exactspec import runtime_choice as choice
    from exactspec.api import SpecDecoder

    def no_conversion(path):
        raise AssertionError(f"converted {path}")

    monkeypatch.setattr(models, "transformers_directory", no_conversion)
    decoder = SpecDecoder.load(str(files["Q4_1"]), drafter="prompt-lookup", threads=2)
    (entry,) = [value for key, value in choice.CACHE.entries().items() if str(files["Q4_1"].resolve()) in key]
    measured = {m["backend"]: m["decode_ms"] + m["score_ms"] for m in entry["measurements"]}
    assert set(measured) == {"llama.cpp", "fused"}
    assert decoder.target.backend_name == entry["backend"] == min(measured, key=measured.get)
    assert decoder.generate("Hello", max_new_tokens=4).token_ids


def test_a_tensor_whose_shape_the_metadata_contradicts_is_one_line_naming_it(files, tmp_path):
    """A file whose feed-forward size says 96 while its gate, up and down matrices hold 128: the load stops with one
    line naming the file and the first such tensor, before anything runs (and the command exits 2)."""
    from exactspec.backends.fused import gguf_unavailable
    from exactspec.cli import main

    data = bytearray(files["Q4_1"].read_bytes())
    key = b"llama.feed_forward_length"
    at = data.index(key) + len(key)
    assert int.from_bytes(data[at : at + 4], "little") == 4 and int.from_bytes(data[at + 4 : at + 8], "little") == 128
    data[at + 4 : at + 8] = (96).to_bytes(4, "little")
    bad = tmp_path / "bad-shape.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(UsageError, match=r"bad-shape.gguf: tensor blk.0.ffn_gate.weight is \[128, 64\], where the "
                                         r"file's metadata makes it \[96, 64\]"):
        gguf_unavailable(GGUFFile(bad))
    assert main(["generate", "--model", str(bad), "hi", "--max-new-tokens", "2"]) == 2


def test_two_threads_reading_one_file_at_once_parse_its_header_once():
    """read_gguf: a draft model's loading reads its target's header on a thread of its own while the target loads;
    both get the one parse (the default model's header: 49,152 tokens and their merges)."""
    import threading

    from exactspec.backends import gguf_file
    from exactspec.models import default_model_path

    path = default_model_path()
    gguf_file._read_once.cache_clear()
    parsed, found, start = [], [], threading.Barrier(2)
    original = gguf_file.GGUFFile.__init__

    def counted(self, *args, **kwargs):
        parsed.append(True)
        original(self, *args, **kwargs)

    gguf_file.GGUFFile.__init__ = counted
    try:
        threads = [threading.Thread(target=lambda: (start.wait(), found.append(gguf_file.read_gguf(path))))
                   for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        gguf_file.GGUFFile.__init__ = original
    assert len(parsed) == 1 and found[0] is found[1]
