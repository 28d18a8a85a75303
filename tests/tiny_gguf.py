"""A tiny random-initialised llama model written as a GGUF file, for tests that need llama.cpp and transformers.

``write_tiny_gguf`` writes, in about 0.2 s (plus about 2 s, once per process, to read the vocabulary source), a
GGUF file that both llama-cpp-python and transformers load (``Llama(model_path=...)``;
``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)``) and that computes the same function in both: tests
can then compare the two runtimes on one set of weights without the real model's minutes per test. Its tokenizer
and chat template are the real ones, copied from the default model's GGUF (SmolLM2-135M-Instruct), so prompts,
chat formatting and token ids look like the real model's; only the weights are random.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

# llama; llama3 (llama with Llama 3's RoPE frequencies, rope_freqs.weight); qwen2 (biases on q, k and v, and q and k
# stored in the module's row order, as every architecture but llama's); qwen3 (q and k normed per head, heads wider
# than hidden / heads); phi3 (q, k and v in one tensor, gate and up in one); gemma2 (GELU, a scaled and tied
# embedding, the blocks' outputs normed, soft caps on scores and logits, every other layer sliding); gemma3 (gemma2's
# without the caps, with q and k normed, five layers in six sliding with RoPE of their own); smollm3 (llama's tensors,
# every 4th layer without RoPE, as llama.cpp and transformers' SmolLM3 fix it)
ARCHITECTURES = ("llama", "llama3", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "smollm3")
# whose q and k rows llama.cpp's converter interleaves for its rotary layout (llama_cpp_layout)
INTERLEAVED_QK = ("llama", "smollm3")
WINDOW = 8  # the sliding layers' window: a few keys, so that a test's tokens pass it
GEMMA2_SOFTCAPS = (4.0, 3.0)  # scores', logits': small enough to bite on a random model's (real: 50 and 30)
GEMMA3_ROPE_FREQ_BASE = 1e6  # its global layers' (the local ones' is 10000)
# Llama 3's RoPE scaling (the converter's rope_freqs), its original context shortened so that a tiny head's
# frequencies fall on each side of it: scaled, interpolated and kept
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
BIAS_STD = 0.5
ROPE_FREQ_BASE = 10000.0
RMS_NORM_EPS = 1e-5
# the logits' standard deviation across the vocabulary at a typical position: big enough that the top tokens
# stand apart (top-1 probability of a few percent over 49152 tokens, a clear top-2 gap), small enough that the
# distribution is far from one-hot, so sampling tests see real randomness
LOGIT_STD = 2.0
NORM_WEIGHT_STD = 0.1  # RMSNorm weights are 1 + this much noise: near 1, but not an identity a bug could hide behind

# file_type (general.file_type, llama.cpp's LLAMA_FTYPE) and the storage type of the 2-D weights, per tensor_type;
# 1-D tensors (the norms) stay F32 in every file, as llama.cpp's own converter writes them
TENSOR_TYPES: dict[str, tuple[gguf.LlamaFileType, gguf.GGMLQuantizationType]] = {
    "F32": (gguf.LlamaFileType.ALL_F32, gguf.GGMLQuantizationType.F32),
    "F16": (gguf.LlamaFileType.MOSTLY_F16, gguf.GGMLQuantizationType.F16),
    "Q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, gguf.GGMLQuantizationType.Q8_0),
    "Q4_0": (gguf.LlamaFileType.MOSTLY_Q4_0, gguf.GGMLQuantizationType.Q4_0),
    "Q4_1": (gguf.LlamaFileType.MOSTLY_Q4_1, gguf.GGMLQuantizationType.Q4_1),
    "Q5_0": (gguf.LlamaFileType.MOSTLY_Q5_0, gguf.GGMLQuantizationType.Q5_0),
    "Q5_1": (gguf.LlamaFileType.MOSTLY_Q5_1, gguf.GGMLQuantizationType.Q5_1),
    "BF16": (gguf.LlamaFileType.MOSTLY_BF16, gguf.GGMLQuantizationType.BF16),
}
# K-quant mixes, which gguf-py cannot write: llama.cpp's quantizer makes them from the F32 file (rows in whole
# blocks of 256)
LLAMA_CPP_TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K")


@dataclass(frozen=True)
class TinyShape:
    """The hyperparameters of one tiny model."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    context: int
    vocab: int
    head_size: int = 0  # a head's width where it is not hidden / heads

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads


@dataclass(frozen=True)
class MetadataField:
    """One GGUF key-value pair, as read from a file: enough to write it again unchanged."""

    key: str
    value: Any
    vtype: gguf.GGUFValueType
    sub_type: gguf.GGUFValueType | None  # the element type of an array, else None


def write_tiny_gguf(path: str | Path, *, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                    ffn: int = 128, context: int = 512, seed: int = 0, tensor_type: str = "F32",
                    vocab_from: str | Path | None = None, architecture: str = "llama", head_dim: int = 0,
                    window: int | None = None, tokenizer: tuple[MetadataField, ...] | None = None,
                    token_rows: tuple[tuple[int, ...], int] | None = None) -> Path:
    """Write a random-initialised llama model with ``vocab_from``'s tokenizer to ``path``; return the path.

    The weights depend only on the shape arguments and ``seed``; ``tensor_type`` (F32, F16, Q8_0, Q4_0 or Q4_1) is how
    the 2-D weights are stored, so files of one seed and different types hold the same model, rounded differently.
    ``vocab_from`` is the GGUF file whose ``tokenizer.*`` metadata (vocabulary, merges, special ids, chat template)
    is copied; by default the default model's. The output matrix is untied from the token embedding.
    ``architecture``: one of ARCHITECTURES; ``head_dim``: a head's width, where not hidden / heads; ``window``: the
    sliding window (gemma's WINDOW by default; phi3's none, as llama.cpp applies none to phi3). A
    ``tensor_type`` of LLAMA_CPP_TYPES is written as F32, then quantised by llama.cpp's quantizer.
    ``tokenizer``: the ``tokenizer.*`` fields themselves, instead of ``vocab_from``'s (tests/tiny_vocabularies.py
    makes some). ``token_rows`` (rows, vocabulary): token i's embedding and output rows are row ``rows[i]`` of the
    weights drawn for a model of that vocabulary and the same seed: a model over a sub-vocabulary of another that
    computes what it does on the tokens they share.
    """
    if tensor_type in LLAMA_CPP_TYPES:
        from exactspec.backends.llamacpp.quantize import quantize

        source = write_tiny_gguf(Path(path).with_suffix(".f32.gguf"), layers=layers, hidden=hidden, heads=heads,
                                 kv_heads=kv_heads, ffn=ffn, context=context, seed=seed, vocab_from=vocab_from,
                                 architecture=architecture, head_dim=head_dim, window=window, tokenizer=tokenizer,
                                 token_rows=token_rows)
        quantize(source, Path(path), tensor_type, threads=2)
        source.unlink()
        return Path(path)
    if tensor_type not in TENSOR_TYPES:
        raise ValueError(f"tensor_type must be one of {sorted(TENSOR_TYPES)}, not {tensor_type!r}")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {ARCHITECTURES}, not {architecture!r}")
    if hidden % heads or heads % kv_heads or (head_dim or hidden // heads) % 2:
        raise ValueError("hidden must split into heads of an even size, and heads into kv_heads groups")
    block = gguf.GGML_QUANT_SIZES[TENSOR_TYPES[tensor_type][1]][0]  # values per quantisation block; 1 for F32/F16
    if hidden % block or ffn % block:
        raise ValueError(f"{tensor_type} stores rows in blocks of {block} values: hidden and ffn must be multiples")
    tokenizer = tokenizer or tokenizer_fields(str(vocab_from or _default_gguf()))
    vocab = _vocab_size(tokenizer) if token_rows is None else token_rows[1]
    shape = TinyShape(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, context=context,
                      vocab=vocab, head_size=head_dim)
    file_type, weight_type = TENSOR_TYPES[tensor_type]

    path = Path(path)
    arch = "llama" if architecture == "llama3" else architecture
    writer = gguf.GGUFWriter(path, arch)  # writes general.architecture itself
    weights = architecture_weights(architecture, shape, seed)
    if token_rows is not None:
        rows = np.array(token_rows[0])
        weights = {name: w[rows] if name in ("token_embd.weight", "output.weight") else w
                   for name, w in weights.items()}
        shape = TinyShape(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, context=context,
                          vocab=len(rows), head_size=head_dim)
    _add_hyperparameters(writer, shape, file_type)
    _add_architecture(writer, architecture, WINDOW if window is None and architecture.startswith("gemma") else window)
    for field in tokenizer:
        writer.add_key_value(field.key, field.value, field.vtype, sub_type=field.sub_type)
    for name, weight in weights.items():
        _add_tensor(writer, name, llama_cpp_layout(name, weight, shape) if arch in INTERLEAVED_QK else weight,
                    weight_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _default_gguf() -> Path:
    from exactspec.models import default_model_path

    return default_model_path()


@functools.lru_cache(maxsize=4)
def tokenizer_fields(source: str) -> tuple[MetadataField, ...]:
    """Every ``tokenizer.*`` key-value pair of the GGUF file ``source``, in file order.

    Cached: parsing ~100k vocabulary and merge strings takes the reader a couple of seconds, the rest of a
    tiny model's writing a fraction of one.
    """
    reader = gguf.GGUFReader(source)
    fields = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        sub_type = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        if sub_type == gguf.GGUFValueType.ARRAY:
            raise ValueError(f"nested arrays are not supported: {key} in {source}")
        fields.append(MetadataField(key, field.contents(), vtype, sub_type))
    return tuple(fields)


def _vocab_size(fields: tuple[MetadataField, ...]) -> int:
    for field in fields:
        if field.key == gguf.Keys.Tokenizer.LIST:
            return len(field.value)
    raise ValueError("the vocabulary source has no tokenizer.ggml.tokens")


def _add_hyperparameters(writer: gguf.GGUFWriter, shape: TinyShape, file_type: gguf.LlamaFileType) -> None:
    """The general.* and llama.* keys llama.cpp and transformers read (transformers: its llama key mapping)."""
    writer.add_type("model")
    writer.add_name("tiny-random-model")  # transformers reads general.name (a name with "mistral" would remap it)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_vocab_size(shape.vocab)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_layer_norm_rms_eps(RMS_NORM_EPS)
    writer.add_rope_freq_base(GEMMA3_ROPE_FREQ_BASE if writer.arch == "gemma3" else ROPE_FREQ_BASE)
    writer.add_rope_dimension_count(shape.head_dim)  # transformers takes head_dim from this key
    if shape.head_size:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)


def _add_architecture(writer: gguf.GGUFWriter, architecture: str, window: int | None) -> None:
    """The keys an architecture adds: a sliding window, gemma 2's caps."""
    if window:
        writer.add_sliding_window(window)
    if architecture == "gemma2":
        writer.add_attn_logit_softcapping(GEMMA2_SOFTCAPS[0])
        writer.add_final_logit_softcapping(GEMMA2_SOFTCAPS[1])


def architecture_weights(architecture: str, shape: TinyShape, seed: int) -> dict[str, np.ndarray]:
    """:func:`random_weights` as ``architecture`` holds them, with what it adds drawn apart (so that the shared
    weights are the same in every architecture): qwen2's biases, norms per head and of the blocks' outputs, Llama 3's
    RoPE frequencies; phi3's fused tensors; gemma's tied embedding, scaled as it scales it back."""
    weights = random_weights(shape, seed)
    rng = np.random.default_rng(seed + 2)

    def norm(size: int) -> np.ndarray:
        return (1.0 + NORM_WEIGHT_STD * rng.standard_normal(size)).astype(np.float32)

    if architecture == "qwen2":
        weights |= qkv_biases(shape, seed)
    if architecture == "llama3":
        weights["rope_freqs.weight"] = llama3_rope_factors(shape.head_dim, ROPE_FREQ_BASE)
    for i in range(shape.layers):
        if architecture in ("qwen3", "gemma3"):
            weights |= {f"blk.{i}.attn_q_norm.weight": norm(shape.head_dim),
                        f"blk.{i}.attn_k_norm.weight": norm(shape.head_dim)}
        if architecture.startswith("gemma"):
            weights |= {f"blk.{i}.post_attention_norm.weight": norm(shape.hidden),
                        f"blk.{i}.post_ffw_norm.weight": norm(shape.hidden)}
        if architecture == "phi3":
            parts = [weights.pop(f"blk.{i}.{part}.weight") for part in ("attn_q", "attn_k", "attn_v")]
            weights[f"blk.{i}.attn_qkv.weight"] = np.concatenate(parts)
            gate = weights.pop(f"blk.{i}.ffn_gate.weight")
            weights[f"blk.{i}.ffn_up.weight"] = np.concatenate([gate, weights[f"blk.{i}.ffn_up.weight"]])
    if architecture.startswith("gemma"):  # tied; the embedding times sqrt(hidden) of LOGIT_STD
        del weights["output.weight"]
        weights["token_embd.weight"] *= np.float32(LOGIT_STD / np.sqrt(shape.hidden))
    return dict(sorted(weights.items(), key=lambda item: _tensor_order(item[0])))


def _tensor_order(name: str) -> tuple[int, str]:
    """Layers in order, the model-wide tensors around them (as llama.cpp's converter writes them)."""
    parts = name.split(".")
    return (int(parts[1]) + 1, name) if parts[0] == "blk" else (0 if parts[0] != "output" else 10**6, name)


def llama3_rope_factors(head_dim: int, theta: float) -> np.ndarray:
    """[head_dim / 2]: what each RoPE frequency is divided by under LLAMA3_ROPE (Llama 3's rule: wavelengths
    under the original context's 1/high_freq_factor kept, over its 1/low_freq_factor divided by the factor, and
    smoothly between), as llama.cpp's converter writes rope_freqs."""
    rope = LLAMA3_ROPE
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelength = 2 * np.pi / freqs
    original = rope["original_max_position_embeddings"]
    low, high = original / rope["low_freq_factor"], original / rope["high_freq_factor"]
    smooth = (original / wavelength - rope["low_freq_factor"]) / (rope["high_freq_factor"] - rope["low_freq_factor"])
    factors = np.where(wavelength < high, 1.0, np.where(wavelength > low, rope["factor"],
                                                        1.0 / ((1 - smooth) / rope["factor"] + smooth)))
    return factors.astype(np.float32)


def random_weights(shape: TinyShape, seed: int) -> dict[str, np.ndarray]:
    """All tensors of the model, float32, by llama.cpp name, in transformers' layout (the q/k rows too).

    numpy shapes are (out_features, in_features), as in transformers; GGUF records the reversed order. Matrices
    are drawn with std 1/sqrt(in_features) so that activations stay of order 1 through the layers; the token
    embedding has std 1 (every layer RMS-normalises its input, so only its size relative to the layers' updates
    matters), and the output matrix is scaled so that logits have about LOGIT_STD across the vocabulary.
    These are exactly the weights transformers loads from the written file (F32), whatever runtime computes them.
    """
    rng = np.random.default_rng(seed)
    s, h = shape, shape.hidden
    q_rows, kv_rows = s.heads * s.head_dim, s.kv_heads * s.head_dim

    def matrix(rows: int, cols: int, std: float | None = None) -> np.ndarray:
        return rng.normal(0.0, std if std is not None else cols ** -0.5, size=(rows, cols)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + NORM_WEIGHT_STD * rng.standard_normal(h)).astype(np.float32)  # (hidden,)

    weights = {"token_embd.weight": matrix(s.vocab, h, std=1.0)}  # (vocab, hidden)
    for i in range(s.layers):
        weights |= {
            f"blk.{i}.attn_norm.weight": norm(),
            f"blk.{i}.attn_q.weight": matrix(q_rows, h),  # (heads*head_dim, hidden)
            f"blk.{i}.attn_k.weight": matrix(kv_rows, h),  # (kv_heads*head_dim, hidden)
            f"blk.{i}.attn_v.weight": matrix(kv_rows, h),  # (kv_heads*head_dim, hidden)
            f"blk.{i}.attn_output.weight": matrix(h, q_rows),  # (hidden, heads*head_dim)
            f"blk.{i}.ffn_norm.weight": norm(),
            f"blk.{i}.ffn_gate.weight": matrix(s.ffn, h),  # (ffn, hidden)
            f"blk.{i}.ffn_up.weight": matrix(s.ffn, h),  # (ffn, hidden)
            f"blk.{i}.ffn_down.weight": matrix(h, s.ffn),  # (hidden, ffn)
        }
    weights["output_norm.weight"] = norm()
    weights["output.weight"] = matrix(s.vocab, h, std=LOGIT_STD * h ** -0.5)  # (vocab, hidden), untied
    return weights


def qkv_biases(shape: TinyShape, seed: int) -> dict[str, np.ndarray]:
    """Each layer's q, k and v biases (qwen2's), float32, drawn apart from the weights so those stay the same."""
    rng = np.random.default_rng(seed + 1)
    rows = {"attn_q": shape.heads * shape.head_dim, "attn_k": shape.kv_heads * shape.head_dim,
            "attn_v": shape.kv_heads * shape.head_dim}
    return {f"blk.{i}.{part}.bias": (BIAS_STD * rng.standard_normal(n)).astype(np.float32)
            for i in range(shape.layers) for part, n in rows.items()}


def llama_cpp_layout(name: str, weight: np.ndarray, shape: TinyShape) -> np.ndarray:
    """``weight`` as llama.cpp stores it: q/k rows reordered for its rotary embedding, the rest unchanged.

    transformers rotates the pair (x[i], x[i + head_dim/2]) of each head; llama.cpp's llama rope rotates the
    adjacent pair (x[2i], x[2i+1]). llama.cpp's converter therefore interleaves each head's two halves of the
    q/k rows, and transformers' GGUF loader undoes exactly that on loading. (Both runtimes would agree on any
    q/k written, since the loader inverts whatever is there; interleaving here is what makes the model they
    compute the one ``random_weights`` drew.)
    """
    if ".attn_q." in name:
        return _interleave_halves(weight, shape.heads)
    if ".attn_k." in name:
        return _interleave_halves(weight, shape.kv_heads)
    return weight


def _interleave_halves(weight: np.ndarray, heads: int) -> np.ndarray:
    """weight: (heads*head_dim, in) -> same shape; row h*head_dim + 2i + j <- row h*head_dim + j*head_dim/2 + i."""
    rows, cols = weight.shape
    half = rows // heads // 2
    return weight.reshape(heads, 2, half, cols).swapaxes(1, 2).reshape(rows, cols)  # (heads, half, 2, in)


def _add_tensor(writer: gguf.GGUFWriter, name: str, tensor: np.ndarray, weight_type: gguf.GGMLQuantizationType,
                ) -> None:
    """Add one tensor, stored as weight_type if it is a matrix; vectors (norms) stay F32."""
    if tensor.ndim == 1 or weight_type == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, tensor)
    elif weight_type == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, tensor.astype(np.float16))
    else:  # quantised: rows of in_features values become rows of bytes; the writer recovers the shape from them
        writer.add_tensor(name, gguf.quants.quantize(tensor, weight_type), raw_dtype=weight_type)
