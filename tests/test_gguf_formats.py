"""The fused runtime reading GGUF files of every block format and architecture it covers, from the file alone
(exactspec/backends/gguf_file.py, exactspec/backends/fused/stored.py): each format's weights as gguf-py de-quantises
them, bit for bit; logits against a float32 reference (transformers' own module of the same file) and against
llama.cpp's on the same file; rows alone and in passes; and greedy output with speculation that of plain decoding.

Tiny random GGUFs: llama and qwen2 (biases on q, k and v; q and k in the module's row order), hidden 256 so that
llama.cpp's K-quant mixes (Q4_K_M: Q4_K with Q6_K for the output and some attn_v and ffn_down; Q5_K_M; Q6_K) keep
whole blocks of 256.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_checks import check_speculation_identity, llama_cpp_logits, tiny_files
from runtime_checks import check_runtime
from tiny import float32_error

from exactspec.backends.fused import PRODUCTS, FusedRuntime, gguf_unavailable
from exactspec.backends.gguf_file import GGUFFile, dequantized
from exactspec.backends.reference import reference_module

FORMATS = ["Q4_K_M", "Q5_K_M", "Q6_K", "Q5_0", "Q5_1", "F16", "BF16", "F32"]
SHAPE = {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "ffn": 512}
IDS = [(37 * i) % 3000 + 10 for i in range(40)]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Callable[[str, str], Path]:
    """The file of an architecture and a format, written when first asked for."""
    return tiny_files(tmp_path_factory.mktemp("gguf-formats"), lambda arch: SHAPE)


def formats(fast: tuple[str, ...]) -> list:
    """FORMATS, those not in ``fast`` marked slow."""
    return [kind if kind in fast else pytest.param(kind, marks=pytest.mark.slow) for kind in FORMATS]


@pytest.mark.parametrize("kind", formats(("Q4_K_M", "Q5_K_M", "Q5_1")))
def test_each_format_is_what_gguf_py_de_quantises(files, kind):
    """Every tensor, bit for bit against gguf-py's reader (another implementation of the same formats)."""
    path = files("qwen2", kind)
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    kinds = set()
    for tensor in theirs.tensors:
        mine = ours.tensors[tensor.name]
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(mine.shape).astype(np.float32)
        assert np.array_equal(dequantized(mine), expected), tensor.name
        kinds.add(mine.type_name)
    assert kind.removesuffix("_M") in kinds, "the file holds the format under test"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", formats(("Q4_K_M",)))
@pytest.mark.parametrize("products", PRODUCTS)
def test_logits_against_a_float32_reference_and_llama_cpp(files, arch, kind, products):
    """Read from the file alone, the runtime computes the model the file holds, against transformers' float32 module
    of the same file. With float products: within 4x transformers' own float32 error (``tiny.float32_error``), and
    no farther than llama.cpp's logits on the same file. With integer products, each row's inputs are quantised to
    bytes per 32 as llama.cpp quantises them (per 32 for Q5_0 and Q5_1, per 256 for K-quants): its mean difference is
    within 5% of llama.cpp's (the same scheme's errors differ by 1-2% here, from where each rounding falls), and its
    largest within 1.5x (the largest of 10^6 values is one outlier, 0.8-1.25x of llama.cpp's here)."""
    path = files(arch, kind)
    assert gguf_unavailable(GGUFFile(path)) is None
    fused = FusedRuntime.from_gguf(path, products)
    module = reference_module(path)
    with torch.no_grad():
        reference = module(torch.tensor([IDS])).logits[0].float()
    ours = (fused.extend(IDS, len(IDS)) - reference).abs()
    theirs = (llama_cpp_logits(path, IDS) - reference).abs()
    if products == "float":
        assert ours.max() <= 4 * float32_error(module, IDS) and ours.max() <= theirs.max()
    else:
        assert ours.mean() <= 1.05 * theirs.mean() and ours.max() <= 1.5 * theirs.max(), (ours.mean(), theirs.mean())


@pytest.mark.parametrize("kind, kept", [("Q4_K_M", "int4_k"), ("Q5_K_M", "int5_k"), ("Q6_K", "int6_k"),
                                        ("Q5_0", "int5"), ("Q5_1", "int5")])
def test_each_block_format_is_kept_in_its_own_bits_and_what_is_read_of_it_shrinks(files, kind, kept):
    """Integer products hold each 4-, 5- and 6-bit format in its own bits and scales, so a pass reads less than the
    bytes per weight that float products hold (1.25 or 1.5 bytes a weight): at most 0.75 / 1.25 of it (Q5_1's 5
    bits and float16 scales against its bytes with float scales), the norms on top."""
    path = files("qwen2", kind)
    narrow, wide = (FusedRuntime.from_gguf(path, products) for products in ("integer", "float"))
    assert kept in narrow.weights.split("+") and kept not in wide.weights.split("+")
    assert narrow.weight_bytes < 0.65 * wide.weight_bytes


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_k_quant_runtime_is_what_the_house_asks_of_a_runtime(files, arch):
    """Declarations, cache and rollback, and the pool: rows alone = in a pass = beside other sequences, bit for bit,
    with the mixed formats of a Q4_K_M file (Q4_K in nibbles and Q6_K in 6 bits, each under its own integer scales:
    Q6_K the LM head and some ffn_down; where they join, some layers' qkv, a part each) and qwen2's biases (split
    between the parts)."""
    runtime = FusedRuntime.from_gguf(files(arch, "Q4_K_M"))
    assert set(runtime.weights.split("+")) == {"int4_k", "int6_k"}
    assert any(len(matrix.parts()) == 2 for matrix in runtime._matrices)
    check_runtime(runtime)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_speculation_keeps_plain_decodings_output_on_a_k_quant_file(files, arch):
    """Greedy and seeded (the invariant sampler) output with prompt lookup and retrieval, at k = 4 and auto, is
    plain decoding's, token for token."""
    check_speculation_identity(files(arch, "Q4_K_M"), ("prompt-lookup", "retrieval"))


def test_the_packed_copy_gives_the_sources_logits_and_follows_the_source(files, tmp_path, monkeypatch, capsys):
    """The first start packs the file (one line) and keeps the packed matrices in exactspec's cache; the next reads
    them memory-mapped, with the same logits bit for bit; a changed source file is packed anew, and its old copy
    deleted; a copy of another layout version is deleted (one line) and packed anew; a corrupt or truncated packed
    copy is said to be so in one line, and packed anew."""
    import os

    from exactspec.backends.fused import packed_file

    monkeypatch.setenv("EXACTSPEC_CACHE", str(tmp_path))
    source = tmp_path / "model.gguf"
    source.write_bytes(files("qwen2", "Q4_K_M").read_bytes())

    def start() -> tuple[torch.Tensor, str]:
        logits = FusedRuntime.from_gguf(source).extend(IDS, len(IDS))
        return logits, capsys.readouterr().err

    packed, said = start()
    assert "packing model.gguf" in said and packed_file.packed_path(source).is_file()
    again, said = start()
    assert said == "" and torch.equal(again, packed)
    stat, old = source.stat(), packed_file.packed_path(source)
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the source changed
    assert not packed_file.packed_path(source).is_file()
    assert "packing model.gguf" in start()[1]
    assert not old.exists(), "the changed source's old copy is deleted when the new one is written"
    kept = packed_file.packed_path(source)
    monkeypatch.setattr(packed_file, "LAYOUT_VERSION", packed_file.LAYOUT_VERSION + 1)  # the kernels' layout changed
    newer, said = start()
    assert not kept.exists(), "the older layout's copy is deleted"
    assert "packed in layout version" in said and "packing model.gguf" in said and torch.equal(newer, packed)
    monkeypatch.undo()
    monkeypatch.setenv("EXACTSPEC_CACHE", str(tmp_path))
    assert "packing model.gguf" in start()[1]  # and the other way: the newer layout's copy goes
    assert len(list((tmp_path / "packed").glob("*.sdpack"))) == 1
    for damage in (lambda data: data[:-5000], lambda data: data[:-200] + bytes(200)):
        kept.write_bytes(damage(kept.read_bytes()))
        logits, said = start()
        lines = said.strip().splitlines()
        assert "stale or corrupt" in lines[0] and "packing model.gguf" in said and torch.equal(logits, packed)


def test_damage_anywhere_in_a_packed_copy_an_unknown_format_and_a_killed_packing_are_found(files, tmp_path,
                                                                                          monkeypatch, capsys):
    """Each of a packed copy's bytes is under its matrix's checksum (a sampled one left 98% of the 1.5B's bytes
    unchecked: a flipped byte there gave other tokens, exit 0, nothing said); a header whose checksum holds but that
    names a format the kernels do not know is repacked, not a traceback; the partial file of a packing killed
    while it wrote is removed at the next start."""
    import json
    import zlib

    from exactspec.backends.fused import packed_file

    monkeypatch.setenv("EXACTSPEC_CACHE", str(tmp_path))
    source = tmp_path / "model.gguf"
    source.write_bytes(files("qwen2", "Q4_K_M").read_bytes())
    packed = FusedRuntime.from_gguf(source).extend(IDS, len(IDS))
    kept = packed_file.packed_path(source)
    data = bytearray(kept.read_bytes())
    trailer = packed_file.TRAILER
    length = int.from_bytes(data[-12:-4], "little")
    header = json.loads(data[len(data) - trailer - length : len(data) - trailer])
    largest = max(header["matrices"], key=lambda entry: entry["bytes"])
    data[largest["offset"] + largest["bytes"] // 3] ^= 0x40  # a third of the way in: no sampled stretch
    kept.write_bytes(bytes(data))
    capsys.readouterr()
    logits = FusedRuntime.from_gguf(source).extend(IDS, len(IDS))
    said = capsys.readouterr().err
    assert "a matrix's checksum does not match" in said and "packing model.gguf" in said
    assert torch.equal(logits, packed)

    data = bytearray(kept.read_bytes())  # the repacked copy, its header rewritten with an unknown format
    length = int.from_bytes(data[-12:-4], "little")
    header = json.loads(data[len(data) - trailer - length : len(data) - trailer])
    header["matrices"][0]["format"] = "q3_z"
    text = json.dumps(header).encode()
    end = len(data) - trailer - length
    kept.write_bytes(bytes(data[:end]) + text + packed_file.MAGIC + len(text).to_bytes(8, "little")
                     + zlib.crc32(text).to_bytes(4, "little"))
    logits = FusedRuntime.from_gguf(source).extend(IDS, len(IDS))
    lines = capsys.readouterr().err.strip().splitlines()
    assert "in format 'q3_z', which the kernels do not know" in lines[0] and torch.equal(logits, packed)

    killed = kept.with_suffix(".999999999.partial")  # no such process
    killed.write_bytes(bytes(1024))
    mine = kept.with_suffix(f".{os.getpid()}.partial")  # a packing still running (this process)
    mine.write_bytes(bytes(16))
    FusedRuntime.from_gguf(source)
    assert not killed.exists() and mine.exists()
