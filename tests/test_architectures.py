"""The architectures the fused runtime reads from a GGUF beside llama and qwen2 (test_gguf_formats.py): Llama 3's RoPE
frequencies, qwen3 (q and k normed per head, heads wider than hidden / heads), phi3 (fused q, k, v and gate, up
tensors), gemma 2 (GELU, a scaled tied embedding, the blocks' outputs normed, soft caps on scores and logits, every
other layer sliding, heads of 256), gemma 3 (q and k normed, five layers in six sliding, with RoPE of their own) and
smollm3 (llama's tensors, every 4th layer without RoPE; also on the lean runtime, from its transformers module).

Each on a tiny random GGUF of that architecture (tests/tiny_gguf.py), whose 40 test tokens pass the sliding layers'
window of 8: logits against transformers' float32 module of the same file and against llama.cpp's; rows alone, in a
pass and beside other sequences, bit for bit; greedy and seeded output with speculation that of plain decoding. And a
file it does not cover is said in one line.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_checks import check_speculation_identity, llama_cpp_logits, tiny_files
from runtime_checks import check_runtime
from tiny import float32_error
from tiny_gguf import WINDOW, write_tiny_gguf

from exactspec.backends.fused import PRODUCTS, FusedRuntime, gguf_unavailable
from exactspec.backends.gguf_file import GGUFFile
from exactspec.backends.lean import LeanRuntime
from exactspec.backends.reference import reference_module

BASE = {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "ffn": 512}
SHAPES = {"llama3": BASE, "qwen3": BASE | {"head_dim": 128}, "phi3": BASE, "gemma2": BASE | {"head_dim": 256},
          "gemma3": BASE | {"layers": 6},  # gemma 3's sixth layer is its first global one
          "smollm3": BASE | {"layers": 4}}  # smollm3's fourth layer is its first without RoPE
ARCHITECTURES = list(SHAPES)
IDS = [(37 * i) % 3000 + 10 for i in range(40)]
assert len(IDS) > 2 * WINDOW


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Callable[[str, str], Path]:
    return tiny_files(tmp_path_factory.mktemp("architectures"), SHAPES.get)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_float32_weights_compute_the_modules_function(files, arch):
    """F32 weights: the model the file holds, within 4x transformers' own float32 error of its module, where llama.cpp
    (whose products round activations) is no nearer. The module is the architecture's own transformers class, so the
    norms, caps, windows and RoPE are checked against an implementation written apart from ours."""
    path = files(arch, "F32")
    assert gguf_unavailable(GGUFFile(path)) is None
    module = reference_module(path)
    with torch.no_grad():
        reference = module(torch.tensor([IDS])).logits[0].float()
    ours = (FusedRuntime.from_gguf(path, "float").extend(IDS, len(IDS)) - reference).abs().max()
    theirs = (llama_cpp_logits(path, IDS) - reference).abs().max()
    assert ours <= 4 * float32_error(module, IDS) and ours <= theirs, (ours, theirs)


@pytest.mark.slow
def test_phi3s_window_is_the_models(tmp_path):
    """phi3's sliding window, which llama.cpp disables, is applied on every layer as transformers' Phi3 applies it:
    F32 logits within 4x float32's error of the module past the window (and not those of a model without it)."""
    path = write_tiny_gguf(tmp_path / "phi3-window.gguf", seed=0, architecture="phi3", window=WINDOW, **BASE)
    module = reference_module(path)
    assert module.config.sliding_window == WINDOW
    with torch.no_grad():
        reference = module(torch.tensor([IDS])).logits[0].float()
    ours = FusedRuntime.from_gguf(path, "float").extend(IDS, len(IDS))
    assert (ours - reference).abs().max() <= 4 * float32_error(module, IDS)
    unwindowed = FusedRuntime.from_gguf(write_tiny_gguf(tmp_path / "phi3.gguf", seed=0, architecture="phi3", **BASE))
    assert not torch.allclose(unwindowed.extend(IDS, len(IDS))[WINDOW:], reference[WINDOW:], atol=1e-3)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("products", PRODUCTS)
def test_k_quant_logits_against_the_module_and_llama_cpp(files, arch, products):
    """A Q4_K_M file, as test_gguf_formats.py holds llama's and qwen2's: float products no farther from the module
    than llama.cpp; integer products (each row's inputs in bytes per 32, as llama.cpp rounds them) within 10% of its
    mean difference and 1.5x its largest."""
    path = files(arch, "Q4_K_M")
    module = reference_module(path)
    with torch.no_grad():
        reference = module(torch.tensor([IDS])).logits[0].float()
    ours = (FusedRuntime.from_gguf(path, products).extend(IDS, len(IDS)) - reference).abs()
    theirs = (llama_cpp_logits(path, IDS) - reference).abs()
    if products == "float":
        assert ours.max() <= theirs.max(), (ours.max(), theirs.max())
    else:
        assert ours.mean() <= 1.1 * theirs.mean() and ours.max() <= 1.5 * theirs.max(), (ours.mean(), theirs.mean())


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_rows_are_the_same_alone_in_a_pass_and_in_a_pool(files, arch):
    runtime = FusedRuntime.from_gguf(files(arch, "Q4_K_M"))
    check_runtime(runtime)


@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.slow) if a != "gemma3" else a
                                  for a in ARCHITECTURES])
def test_speculation_keeps_plain_decodings_output(files, arch):
    """Greedy and seeded output with prompt lookup at k = 4 and auto, past the sliding window, is plain decoding's."""
    check_speculation_identity(files(arch, "Q4_K_M"), ("prompt-lookup",))


def test_smollm3_on_the_lean_runtime(files):
    """smollm3's transformers module (what a SmolLM3 directory loads) on the lean runtime: logits within 4x float32's
    error of the module, and no farther than llama.cpp's of the same file; its 4th layer turns nothing by RoPE (turned,
    the logits leave the module by far more); rows alone, in a pass and in its pool, bit for bit."""
    path = files("smollm3", "F32")
    module = reference_module(path)
    with torch.no_grad():
        reference = module(torch.tensor([IDS])).logits[0].float()
    runtime = LeanRuntime(module, "float32")
    assert runtime.rope_layers == (True, True, True, False)
    ours = (runtime.extend(IDS, len(IDS)) - reference).abs().max()
    theirs = (llama_cpp_logits(path, IDS) - reference).abs().max()
    bound = 4 * float32_error(module, IDS)
    assert ours <= bound and ours <= theirs, (ours, theirs)
    runtime.rollback(0)
    runtime.rope_layers = (True,) * 4
    assert (runtime.extend(IDS, len(IDS)) - reference).abs().max() > 100 * bound
    check_runtime(LeanRuntime(module, "float32"))


def test_what_it_does_not_cover_is_said_in_one_line(files, tmp_path, capsys):
    """A RoPE it does not scale (YaRN), or a head only partly turned: gguf_unavailable names it, and an explicit
    ``--backend fused`` exits 2 with that line (smollm3's too, whose files transformers does not convert)."""
    import gguf

    from exactspec.cli import main

    yarn = ("rope.scaling.type", "yarn", "its RoPE is scaled by yarn")  # the key, its new value, the line's words
    partial = ("rope.dimension_count", 64, "turns part of each head")
    for arch, name, (key, value, said) in (("qwen3", "yarn", yarn), ("qwen3", "partial", partial),
                                           ("smollm3", "smollm3-yarn", yarn)):
        path = _rewritten(gguf.GGUFReader(files(arch, "F32")), tmp_path / f"{name}.gguf", {f"{arch}.{key}": value})
        assert said in gguf_unavailable(GGUFFile(path))
        assert main(["generate", "hi", "--model", str(path), "--backend", "fused", "--max-new-tokens", "2"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--backend fused cannot run {name}.gguf: " in err and said in err, err


def _rewritten(source, path: Path, change: dict) -> Path:
    """``source``'s file with the metadata ``change`` (key: new value) made, its tensors as they are."""
    import gguf

    arch = source.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(path, arch)
    for key, field in source.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        sub_type = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        value = change.pop(key, field.contents())
        if isinstance(value, str):
            vtype = gguf.GGUFValueType.STRING
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    for key, value in change.items():
        writer.add_key_value(key, value, gguf.GGUFValueType.STRING if isinstance(value, str) else
                             gguf.GGUFValueType.UINT32)
    for tensor in source.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_shape=tuple(int(d) for d in tensor.shape[::-1]),
                          raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
