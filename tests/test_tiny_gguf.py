"""The tiny random GGUF model (tests/tiny_gguf.py) is one model to llama.cpp and to transformers.

Loading the file in transformers costs about 3 s for the tokenizer and 4 s for the model (its GGUF reader parses
the ~100k vocabulary and merge strings, for the model twice: config and weights); the llama.cpp side and the
file's writing take a fraction of a second once the vocabulary source has been read.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_gguf import TinyShape, llama_cpp_layout, random_weights, write_tiny_gguf

llama_cpp = pytest.importorskip("llama_cpp")

SHAPE = TinyShape(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, context=512, vocab=49152)
SEED = 0


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-gguf") / "tiny-f32.gguf"
    return write_tiny_gguf(path, layers=SHAPE.layers, hidden=SHAPE.hidden, heads=SHAPE.heads,
                           kv_heads=SHAPE.kv_heads, ffn=SHAPE.ffn, context=SHAPE.context, seed=SEED)


@pytest.fixture(scope="module")
def transformers_model(tiny_path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_path.parent, gguf_file=tiny_path.name, dtype=torch.float32)


def _llama(path: Path, kv_type: int) -> llama_cpp.Llama:
    return llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False, type_k=kv_type,
                           type_v=kv_type, n_threads=2)


# Tolerances on |llama.cpp logit - transformers logit|, as a fraction of the largest |logit| (about 10 here; the
# logits' spread across the vocabulary is about 2).
# - F32 KV cache: both runtimes compute in float32 and differ only in the order of their roundings (SIMD partial
#   sums against BLAS blocking, their own exp and rsqrt). Each rounding is within u = 2**-24 = 6e-8 of its value;
#   the difference grows with the terms per sum (at most ffn = 128) and the operations along the path (two
#   layers of about ten), so it stays below about 1e3 * u = 6e-5 of the values' size: 1e-4 of the largest logit
#   bounds it (measured: about 5e-7). A weight or hyperparameter the two read differently moves logits by about
#   their spread, 2.
# - F16 KV cache (llama.cpp's default, the one exactspec's runtime uses): K and V are stored rounded to half
#   precision (2**-11 = 4.9e-4 relative), and llama.cpp's CPU product with a half-precision operand rounds the
#   other one (the queries, the attention weights) to half as well; about four such roundings per layer, on
#   attention outputs of the residual stream's size, give at most 4 * 2**-11 = 2e-3 of the logits' size
#   (measured: about 3e-4).
KV_TOLERANCES = {"f32-kv": (llama_cpp.GGML_TYPE_F32, 1e-4), "f16-kv": (llama_cpp.GGML_TYPE_F16, 2e-3)}


@pytest.mark.parametrize("kv", KV_TOLERANCES)
def test_llama_cpp_logits_match_transformers(tiny_path: Path, transformers_model: torch.nn.Module, kv: str,
                                             ) -> None:
    """Every position's logits agree between llama.cpp and transformers."""
    kv_type, relative_tolerance = KV_TOLERANCES[kv]
    ids = [1] + np.random.default_rng(1).integers(3, SHAPE.vocab, size=19).tolist()
    llm = _llama(tiny_path, kv_type)
    llm.eval(ids)
    ours = np.asarray(llm.scores[: len(ids)], dtype=np.float64)  # (positions, vocab)

    with torch.no_grad():
        theirs = transformers_model(torch.tensor([ids])).logits[0].double().numpy()  # (positions, vocab)

    tolerance = relative_tolerance * np.abs(theirs).max()
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=tolerance)
    # with every logit within the tolerance, the top token can differ only where the top two are within 2x of it
    top2 = np.sort(theirs, axis=-1)[:, -2:]  # (positions, 2)
    clear = top2[:, 1] - top2[:, 0] > 2 * tolerance
    assert (ours.argmax(-1) == theirs.argmax(-1))[clear].all()


def test_transformers_loads_the_drawn_weights(transformers_model: torch.nn.Module) -> None:
    """transformers' q/k projections are the drawn ones: the file lays their rows out as llama.cpp's converter does
    (transformers' loader undoes that layout). Both runtimes would agree with any layout; this pins which model."""
    drawn = random_weights(SHAPE, SEED)
    attention = transformers_model.model.layers[0].self_attn
    assert torch.equal(attention.q_proj.weight, torch.from_numpy(drawn["blk.0.attn_q.weight"]))
    assert torch.equal(attention.k_proj.weight, torch.from_numpy(drawn["blk.0.attn_k.weight"]))
    assert not np.array_equal(llama_cpp_layout("blk.0.attn_q.weight", drawn["blk.0.attn_q.weight"], SHAPE),
                              drawn["blk.0.attn_q.weight"])


def test_tokenizer_and_chat_template_match_transformers(tiny_path: Path) -> None:
    """The copied SmolLM2 tokenizer tokenizes alike in both runtimes, special tokens and chat template included."""
    from transformers import AutoTokenizer

    llm = _llama(tiny_path, llama_cpp.GGML_TYPE_F16)
    tokenizer = AutoTokenizer.from_pretrained(tiny_path.parent, gguf_file=tiny_path.name)
    assert llm.n_vocab() == len(tokenizer) == SHAPE.vocab
    for text in ["Hello world", "  The quick brown fox, 123 jumps!\n\n", "naïve café 日本語 🙂"]:
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == tokenizer.encode(
            text, add_special_tokens=False)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert llm.tokenize(chat.encode(), add_bos=False, special=True) == tokenizer.encode(
        chat, add_special_tokens=False)
    assert llm.metadata["tokenizer.chat_template"] == tokenizer.chat_template
