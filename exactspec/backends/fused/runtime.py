"""exactspec's fused CPU runtime: a llama-family pass in one call into the C kernels (``*.c`` beside this file; built at
install as ``exactspec.backends._fused``).

:class:`FusedRuntime` keeps a llama-family sequence's cache (``sequence.py``: rollback, trees, shallow passes, hidden
states, as the lean runtime does) and computes every layer, and the LM head, in the C pass: int8 or float16
weights read once per pass whatever the row count, one thread team (PyTorch's OpenMP threads), norms, RoPE and
attention written around the products, and each row computed as it is alone (batch-invariant by construction, see
``pass.c``); a prompt runs through the same call, PASS_ROWS rows at a time, its products in the GEMM tiles, so
its positions hold the bits plain decoding would write. Its pool (``pool.py``) runs its rows through the same call.
As a draft model it drafts a whole chain in one call (:meth:`FusedRuntime.draft_chain`, ``chain.c``), where it holds
its head's vocabulary as a float table (:class:`ChainVocabulary`).

Where it cannot run (not built, a CPU without AVX2/FMA/F16C, a model it does not cover), :func:`unavailable` says
why in one line, and ``--backend auto`` passes it by.
"""

from __future__ import annotations

import ctypes
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from exactspec.backends import native
from exactspec.backends.base import CHAIN_LEAD, DraftsChains, Pooled
from exactspec.backends.family import (
    FAMILIES,
    LlamaSpec,
    gguf_head_dim,
    gguf_uncovered,
    head_dim_of,
    spec_of_gguf,
    spec_of_module,
    supports,
)
from exactspec.backends.fused import packed_file
from exactspec.backends.fused.cache import PassCache
from exactspec.backends.fused.stored import (
    StoredMatrix,
    check_shapes,
    float_matrix,
    gguf_matrices,
    module_blocks,
    packed_matrices,
    packed_q8,
    tensor_names,
)
from exactspec.backends.gguf_file import GGUFFile, dequantized
from exactspec.backends.linear import Linear
from exactspec.backends.native import MAX_HEAD_DIM, Layer, Model
from exactspec.backends.sequence import LlamaSequence
from exactspec.choices import MAX_DRAFT_TOKENS, MAX_TREE_WIDTH
from exactspec.errors import UsageError

MATRIX_NAMES = ("qkv", "out", "gate_up", "down")  # a layer's matrices, as the C kernels' Layer names them
# the norms some architectures add to a layer: GGUF tensor names, and the names the C kernels' Layer gives them
LAYER_NORMS = {"attn_q_norm": "q_norm", "attn_k_norm": "k_norm", "post_attention_norm": "attn_out_norm",
               "post_ffw_norm": "ffn_out_norm"}
WEIGHTS = ("float16", "int8")  # how the C pass holds the weights; activations, norms, attention and the cache: float32
# how it multiplies a byte format's weights: integer, each row's inputs quantised to bytes per block of 32 (row-local,
# so every row keeps its bits in any pass; 2-4x faster on every tile path measured: docs/benchmarks-history.md), or
# float, each weight converted to float (the bits of a float32 product over the weights, within float32's error)
PRODUCTS = ("integer", "float")
Q8_GROUP = 32  # inputs that share an int8 weight's scale and offset
# A chain pass over more positions than a round can score (k <= MAX_DRAFT_TOKENS drafts and the pending token) holds
# a prompt. It runs the C pass as rounds and steps do, so its positions hold the bits they would write; the count
# stays the runtime's PromptPasses count (what a prefix cache keeps is still decided by it).
PROMPT_POSITIONS = MAX_DRAFT_TOKENS + 2
PASS_ROWS = 64  # the most rows one C call takes (its scratch grows with them); more run in parts, each row alone
# The largest float32 embedding table a full-vocabulary runtime makes for its one-call chain (ChainVocabulary.full):
# a GGUF's embedding stays in its blocks and is read row by row, so its table is a copy (a 150k-token, 896-wide
# model's: 545 MB), made only where it is this small; a model whose float32 embedding is held unscaled lends it.
CHAIN_TABLE_BYTES = 64 << 20
CHAIN_RANKED = 16  # the chosen and its alternatives chain.c ranks at a depth at most (its MOST_RANKED)
CHAIN_MOST_LEAD = 64  # the most tokens chain.c's first pass feeds (its MOST_LEAD)
assert CHAIN_LEAD <= CHAIN_MOST_LEAD, "a chain's lead must fit chain.c's first pass"
assert MAX_TREE_WIDTH <= CHAIN_RANKED, "a tree's widest depth must fit the chain's ranking"


class FusedUnavailable(RuntimeError):
    """The fused runtime cannot run here, or not this model; the message says why in one line."""


def unavailable(model=None, weights: str = "float16") -> str | None:
    """Why the fused runtime cannot run ``model`` (or anything, for None) here, its weights held so; None where it
    can."""
    reason = native.unavailable()
    if reason is not None or model is None:
        return reason
    if next(model.parameters()).device.type != "cpu":
        return "it runs on the CPU only"
    if not supports(model):
        return f"it runs {', '.join(FAMILIES)} models with default RoPE, not {model.config.model_type}"
    config = model.config
    head_dim = head_dim_of(config)
    sizes = (config.hidden_size, head_dim, config.intermediate_size)
    if any(size % 8 for size in sizes) or head_dim > MAX_HEAD_DIM:
        return f"its sizes (hidden, head, intermediate: {sizes}) are not multiples of 8 up to a head of {MAX_HEAD_DIM}"
    if weights == "int8" and any(size % Q8_GROUP for size in (config.hidden_size, config.intermediate_size,
                                                              config.num_attention_heads * head_dim)):
        return f"int8 weights need inputs in whole groups of {Q8_GROUP}"
    layer = model.model.layers[0]
    if any(m.bias is not None for m in (layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                                        layer.mlp.down_proj, model.get_output_embeddings())):
        return "its output, feed-forward or LM head projections have biases"
    return None


def quantized8(weight: torch.Tensor) -> tuple[torch.Tensor, bool]:  # [ceil(out / 8) * in / 32 * 320] uint8
    """``weight`` [out, in] as the C Q8 tiles read it: per row and 32 inputs, bytes q with w = d q + m (d, m float32),
    repacked in blocks of 8 rows (fused.h); and whether every weight is kept exactly. Where the 32 values lie on a
    grid of at most 256 steps (a GGUF's Q4_0, Q4_1 and Q8_0 blocks, de-quantised), d is that grid's step and w is
    kept (to float rounding); elsewhere d spans the values' range in 255 steps."""
    out, inputs = weight.shape
    rows = -(-out // 8) * 8
    values = torch.zeros(rows, inputs, dtype=torch.float32)
    values[:out] = weight.float()
    values = values.view(rows, inputs // Q8_GROUP, Q8_GROUP)
    low, high = values.amin(-1, keepdim=True), values.amax(-1, keepdim=True)
    spread = (high - low).clamp_min(torch.finfo(torch.float32).tiny)
    step = spread / 255  # the general grid
    on_grid = torch.zeros_like(low, dtype=torch.bool)
    ordered = values.sort(-1).values
    gaps = ordered.diff(dim=-1)
    gap = torch.where(gaps > spread * 1e-4, gaps, torch.inf).amin(-1, keepdim=True)  # the smallest step between values
    for divisor in (4, 3, 2, 1):  # the stored grid's step: the smallest gap, or a fraction of it (levels skipped)
        candidate = spread / (spread * divisor / gap).round().clamp_min(1)  # the gap's estimate, refined by the range
        levels = (values - low) / candidate
        exact = ((levels - levels.round()).abs() < 1e-3).all(-1, keepdim=True) & (levels.round().amax(-1, True) <= 255)
        found = exact & torch.isfinite(candidate)
        step, on_grid = torch.where(found, candidate, step), on_grid | found
    q = ((values - low) / step).round().clamp(0, 255).to(torch.uint8)  # [rows, groups, 32]
    on_grid |= high == low  # one value: kept whatever the step
    return packed_q8(q.view(rows, inputs), step[..., 0], low[..., 0]), bool(on_grid.all())


def _matrices(layer) -> list[torch.Tensor]:
    """A layer's weight matrices as the C kernels multiply by them: qkv, out, gate and up, down."""
    attention, mlp = layer.self_attn, layer.mlp
    return [torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]),
            attention.o_proj.weight, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), mlp.down_proj.weight]


@dataclass
class FusedWeights:
    """A model's weights as the fused runtime builds from them, whatever they were read from."""

    spec: LlamaSpec
    # per C matrix (each layer's qkv, out, gate_up and down, then the LM head): a float tensor [out, in] (a
    # module's, held as the runtime chooses), or the matrix as a GGUF stores it
    matrices: list[torch.Tensor | StoredMatrix]
    input_norms: list[torch.Tensor]
    post_norms: list[torch.Tensor]
    qkv_biases: list[torch.Tensor | None]
    # per layer, the norms an architecture adds, by the name the C kernels' Layer gives them (LAYER_NORMS)
    layer_norms: list[dict[str, torch.Tensor]]


def module_weights(model, gguf: str | Path | None = None) -> FusedWeights:
    """A transformers module's weights; each matrix the GGUF it came from stores in a block format, as stored."""
    layers = model.model.layers
    matrices = [matrix.detach() for layer in layers for matrix in _matrices(layer)]
    matrices.append(model.get_output_embeddings().weight.detach())
    if gguf is not None:
        matrices = [stored if stored is not None else matrix
                    for matrix, stored in zip(matrices, module_blocks(matrices, GGUFFile(gguf), model.config))]
    return FusedWeights(
        spec=spec_of_module(model), matrices=matrices,
        input_norms=[layer.input_layernorm.weight.detach() for layer in layers],
        post_norms=[layer.post_attention_layernorm.weight.detach() for layer in layers],
        qkv_biases=[_qkv_bias(layer) for layer in layers], layer_norms=[{} for _ in layers])


def gguf_weights(source: GGUFFile, narrow: bool = True) -> FusedWeights:
    """A GGUF file's weights, from the file alone (``gguf_unavailable`` first): its matrices from their packed copy
    in exactspec's cache, else repacked (with a line of progress) into it, one matrix at a time, for this and the next
    start; ``narrow``: its 4-bit and 6-bit formats in their bits (integer products only)."""
    spec = spec_of_gguf(source)
    kept = packed_file.packed_path(source.path, narrow)
    packed = packed_file.read(kept)
    matrices = packed.matrices if packed is not None and len(packed.matrices) == 4 * spec.layers + 1 else \
        _packed(source, spec, kept, narrow)
    return weights_of(source, spec, matrices)


def weights_of(source: GGUFFile, spec: LlamaSpec, packed: list[StoredMatrix]) -> FusedWeights:
    """The weights of a GGUF file's model whose ``spec`` is read and whose fused matrices are ``packed`` (as stored,
    or a draft-grade copy's): the biases, norms and embedding read from the file."""
    matrices = gguf_matrices(source, spec.layers, spec.heads, spec.kv_heads, packed)
    norm = lambda name: torch.from_numpy(dequantized(source.tensors[name]).copy())  # noqa: E731
    weights = FusedWeights(
        spec=spec, matrices=matrices,
        input_norms=[norm(f"blk.{i}.attn_norm.weight") for i in range(spec.layers)],
        post_norms=[norm(f"blk.{i}.ffn_norm.weight") for i in range(spec.layers)],
        qkv_biases=[matrices[4 * i].bias for i in range(spec.layers)],
        layer_norms=[{name: norm(f"blk.{i}.{part}.weight") for part, name in LAYER_NORMS.items()
                      if f"blk.{i}.{part}.weight" in source.tensors} for i in range(spec.layers)])
    source.release()  # what it read of the file is copied; the embedding's rows are read again as tokens come
    return weights


def _packed(source: GGUFFile, spec: LlamaSpec, kept: Path, narrow: bool) -> list[StoredMatrix]:
    """The file's matrices repacked: written to ``kept`` as each is packed, then memory-mapped from it (so a first
    start holds one packed matrix at a time); where the cache cannot be written, held in memory."""
    count = 4 * spec.layers + 1
    progress = _Progress(f"exactspec: packing {source.path.name} for the fused runtime")

    def counted(matrices):
        for index, matrix in enumerate(matrices):
            yield matrix
            progress(index + 1, count)

    try:
        packed_file.write(kept, source.path,
                          counted(packed_matrices(source, spec.layers, spec.heads, spec.kv_heads, narrow)))
        progress.done(kept)
        _trim_heap()
        packed = packed_file.read(kept)
        if packed is not None:
            return packed.matrices
    except OSError as error:  # a cache that cannot be written: held in memory, and the next start packs again
        print(f"exactspec: could not keep the packed copy ({error})", file=sys.stderr)
    return list(packed_matrices(source, spec.layers, spec.heads, spec.kv_heads, narrow))


def _trim_heap() -> None:
    """Hand the C heap's free memory back to the system (glibc's malloc_trim), where packing's many freed pieces
    would otherwise stay in the process beside the weights it then maps."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


class _Progress:
    """One line on standard error, redrawn as matrices are packed (where it is a terminal: else once, at the end)."""

    def __init__(self, what: str) -> None:
        self.what, self.started = what, time.perf_counter()
        self.live = sys.stderr.isatty()

    def __call__(self, done: int, count: int) -> None:
        if self.live:
            print(f"\r{self.what}: {done}/{count} matrices", end="", file=sys.stderr, flush=True)

    def done(self, kept: Path) -> None:
        seconds = time.perf_counter() - self.started
        print(f"{chr(13) if self.live else ''}{self.what}: done in {seconds:.1f} s (once; kept in {kept.parent})",
              file=sys.stderr)


def gguf_unavailable(source: GGUFFile) -> str | None:
    """Why :meth:`FusedRuntime.from_gguf` cannot read this file's model (None where it can): an architecture or a
    block format it does not read yet, sizes its tiles do not fit, or a build that cannot run here."""
    reason = native.unavailable() or gguf_uncovered(source)
    if reason is not None:
        return reason
    arch = source.field("general.architecture")
    hidden, heads = source.field(f"{arch}.embedding_length"), source.field(f"{arch}.attention.head_count")
    sizes = (hidden, gguf_head_dim(source), source.field(f"{arch}.feed_forward_length"))
    if any(size % Q8_GROUP for size in sizes[::2]) or sizes[1] % 8 or sizes[1] > MAX_HEAD_DIM:
        return f"its sizes (hidden, head, intermediate: {sizes}) do not fit its int8 tiles"
    layers = source.field(f"{arch}.block_count")
    names = tensor_names(layers, source.tensors, arch)
    if any(name not in source.tensors for parts in names for name in parts):
        return "it lacks some of a layer's matrices"
    if ("blk.0.attn_q_norm.weight" in source.tensors) != ("blk.0.attn_k_norm.weight" in source.tensors):
        return "it norms q or k per head, not both"
    if arch.startswith("gemma") and not all(f"blk.0.{part}.weight" in source.tensors
                                            for part in ("post_attention_norm", "post_ffw_norm")):
        return "it lacks gemma's norms of the blocks' outputs"
    check_shapes(source, layers, hidden, heads, source.field(f"{arch}.attention.head_count_kv", heads), sizes[1],
                 sizes[2])
    if any(f"blk.0.{part}.bias" in source.tensors for part in ("attn_output", "ffn_gate", "ffn_up", "ffn_down")):
        return "its output or feed-forward projections have biases"
    return None


def _held(weight: torch.Tensor, weights: str) -> StoredMatrix:
    """A module's matrix in int8 or float16, or (auto) int8 where that keeps it exactly."""
    if weights != "float16":
        packed, exact = quantized8(weight)
        if exact or weights == "int8":
            return StoredMatrix("int8", weight.shape[0], weight.shape[1], packed)
    return float_matrix(weight.detach(), "float16")


def _check_products(products: str) -> str:
    if products not in PRODUCTS:
        raise ValueError(f"the fused runtime's products are {' or '.join(PRODUCTS)}, not {products}")
    return products


def _qkv_bias(layer) -> torch.Tensor | None:
    projections = (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)
    if all(p.bias is None for p in projections):
        return None
    return torch.cat([p.bias if p.bias is not None else p.weight.new_zeros(p.weight.shape[0]) for p in projections])


@dataclass(frozen=True)
class ChainVocabulary:
    """What a fused runtime's one-call chain (``chain.c``) reads of its vocabulary: the token id each row of its LM
    head stands for, ascending, and those tokens' embeddings as the runtime embeds them (``embedded``), which the chain
    feeds after choosing a row. A full head's is every id; a draft-grade model whose head keeps some rows sets its
    own (:attr:`FusedRuntime.chain_vocabulary`)."""

    ids: torch.Tensor  # [rows] int32
    embed: torch.Tensor  # [rows, hidden] float32

    @classmethod
    def of(cls, runtime: LlamaSequence, ids: torch.Tensor) -> ChainVocabulary:
        """The rows ``ids`` (ascending) of ``runtime``'s vocabulary, their embeddings copied."""
        ids = torch.as_tensor(ids, dtype=torch.int64)
        if len(ids) and (bool((ids.diff() <= 0).any()) or int(ids[0]) < 0 or int(ids[-1]) >= runtime.vocab_size):
            raise ValueError("a chain vocabulary's ids ascend within the vocabulary")
        return cls(ids.to(torch.int32).contiguous(), runtime.embedded(ids).to(torch.float32).contiguous())

    @classmethod
    def full(cls, runtime: LlamaSequence, most_bytes: int | None = None) -> ChainVocabulary | None:
        """Every id: the runtime's own embedding where it is a float32 table, unscaled (no copy); else a copy, or None
        where that would take more than ``most_bytes``."""
        ids = torch.arange(runtime.vocab_size, dtype=torch.int32)
        embed = runtime.embed
        if isinstance(embed, torch.Tensor) and embed.dtype == torch.float32 and embed.is_contiguous() and \
                runtime.architecture.embed_scale == 1.0:
            return cls(ids, embed)
        if most_bytes is not None and 4 * runtime.vocab_size * runtime.embed.shape[1] > most_bytes:
            return None
        return cls.of(runtime, ids)


class FusedRuntime(LlamaSequence, Pooled, DraftsChains):
    """The CausalLM protocol for llama-family models, every pass one call into the C kernels."""

    name = "fused"
    pass_invariant = True  # the C kernels compute each row alone, a prompt's rows too
    prompt_positions = PROMPT_POSITIONS  # a chain of this many is a prompt's (trees and rounds never are)

    def __init__(self, model, weights: str = "auto", gguf: str | Path | None = None,
                 products: str = "integer") -> None:
        """``weights``: float16; int8 with a float scale and offset per 32 inputs (``quantized8``); or auto: per
        matrix, int8 where that keeps every weight exactly (a GGUF's Q4_0, Q4_1 and Q8_0 weights: the default
        model's), so that the logits lose nothing and a pass streams 5/8 of float16's bytes, else float16. ``gguf``:
        the GGUF file ``model`` was converted from, whose block formats are then repacked as stored (``stored.py``),
        where the module's weights are searched for their grid otherwise. ``products``: PRODUCTS's."""
        if weights not in WEIGHTS + ("auto",):
            raise ValueError(f"the fused runtime holds weights in {' or '.join(WEIGHTS)} (or auto), not {weights}")
        reason = unavailable(model, "float16" if weights == "auto" else weights)
        if reason is not None:
            raise FusedUnavailable(f"the fused runtime cannot run this model: {reason}")
        if weights == "auto" and unavailable(model, "int8") is not None:
            weights = "float16"
        self._start(module_weights(model, gguf if weights != "float16" else None), weights, products)

    @classmethod
    def from_gguf(cls, path: str | Path | GGUFFile, products: str = "integer") -> FusedRuntime:
        """The runtime of a GGUF file's model, read from the file alone: its metadata, and each matrix in its
        stored format (``stored.py``), no transformers module and no de-quantised copy of its matrices, multiplied
        in ``products`` (PRODUCTS's). :func:`gguf_unavailable` says where it cannot."""
        source = path if isinstance(path, GGUFFile) else GGUFFile(path)
        reason = gguf_unavailable(source)
        if reason is not None:
            raise FusedUnavailable(f"the fused runtime cannot read {source.path.name} directly: {reason}")
        runtime = cls.__new__(cls)
        _check_products(products)
        runtime._start(gguf_weights(source, narrow=products == "integer"), "stored", products)
        return runtime

    def _start(self, source: FusedWeights, weights: str, products: str) -> None:
        self.products = _check_products(products)
        super().__init__(source.spec, torch.float32)
        self._library = native.library()
        self.threads = native.use_threads()
        self.team = native.TeamSize(self.threads)  # how many of them its passes run on, by their times
        self.stored_matrices = sum(isinstance(m, StoredMatrix) for m in source.matrices)  # repacked as stored
        self._matrices = self._held_matrices(source, weights)
        self.weights = "+".join(sorted({part.format for matrix in self._matrices for part in matrix.parts()}))
        self._model = self._c_model(source)
        norms = sum(norm.numel() for norm in source.input_norms + source.post_norms) + source.spec.hidden
        self.weight_bytes = sum(matrix.nbytes for matrix in self._matrices) + 4 * norms
        self.multiply_adds = sum(matrix.rows * matrix.inputs for matrix in self._matrices)  # a row's, per pass
        self._pass_cache: tuple[int, PassCache] | None = None  # (the cache's generation, what the C kernels read of it)
        self._head = native.MatrixProduct(self._model.lm_head)
        # the head's vocabulary for the one-call chain: a subclass (a draft-grade model's cut head) sets its own;
        # left None, a full head's is made at the chain's first use where it is small (ChainVocabulary.full)
        self.chain_vocabulary: ChainVocabulary | None = None

    @property
    def precision_label(self) -> str:
        integer = self.products == "integer" and any(held in native.INTEGER_FORMAT for held in self.weights.split("+"))
        return f"{self.weights} weights{', integer products' if integer else ''}, fused"

    @property
    def runtime_label(self) -> str:
        return f"exactspec's fused runtime ({self.precision_label})"

    def remedy(self, path) -> str:
        return "none is needed: it computes each row alone"

    def head_for(self, positions: int, chain: bool = True) -> Linear:
        return self._head  # one LM head: the C kernels' product over the held matrix, whatever the pass

    def run_layers(self, x: torch.Tensor, first: int, end: int, start: int, positions: slice | torch.Tensor,
                   mask: torch.Tensor | None) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        n = x.shape[0]
        columns = np.arange(start, start + n, dtype=np.int32)
        tree = isinstance(positions, torch.Tensor)  # a tree: each node reads the cache, then its ancestors
        reading = self._keys_read(mask, start, n, tree)
        rope = positions.numpy() if tree else columns
        return self.fused_pass(x, first, end, self._cache(), rope, np.zeros(n, dtype=np.int64), columns,
                               reading.n_keys, reading.key_cols)

    def final_normed(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        """The final norm in the C kernels (``sd_final_norm``), as the one-call chain norms its rows: every logit and
        kept hidden state of this runtime, its pool's and its chain's, is read from the same bits."""
        x = x.to(torch.float32, memory_format=torch.contiguous_format)
        normed = torch.empty_like(x)
        if len(x):
            self._library.sd_final_norm(ctypes.byref(self._model), x.data_ptr(), x.shape[0], normed.data_ptr())
        return normed

    @property
    def chain_ids(self) -> torch.Tensor | None:  # [rows] int32
        """The token ids of the LM head's rows, for the one-call chain; None where this runtime chains in Python: a
        model whose logits are capped softly (its cap is torch's tanh, whose bits C does not reproduce), or a full
        head whose float table would be a large copy (CHAIN_TABLE_BYTES)."""
        vocabulary = self._chain_vocabulary()
        return None if vocabulary is None else vocabulary.ids

    def _chain_vocabulary(self) -> ChainVocabulary | None:
        if self.architecture.logit_softcap:
            return None
        if self.chain_vocabulary is None and self._head.outputs == self.vocab_size:
            self.chain_vocabulary = ChainVocabulary.full(self, CHAIN_TABLE_BYTES)
        vocabulary = self.chain_vocabulary
        if vocabulary is not None and len(vocabulary.ids) != self._head.outputs:
            raise ValueError(f"the chain vocabulary has {len(vocabulary.ids)} ids for {self._head.outputs} head rows")
        return vocabulary

    @torch.inference_mode()
    def draft_chain(self, lead: list[int], k: int, width: int = 1, noise: torch.Tensor | None = None,
                    temperature: float = 1.0, allowed: torch.Tensor | None = None
                    ) -> tuple[list[int], list[list[int]]]:
        """DraftsChains's chain in one C call (``chain.c``): the sequence then stands as after ``extend(lead, 1)``
        and ``extend([token], 1)`` for the first k - 1 tokens (its tokens, cache, kept hidden states; no positions a
        shallow run left; ``prefilled`` as it was)."""
        vocabulary = self._chain_vocabulary()
        if vocabulary is None:
            raise UsageError("this runtime drafts its chains in Python (its chain_ids is None)")
        rows = len(vocabulary.ids)
        if not 1 <= width <= CHAIN_RANKED or k < 0:
            raise UsageError(f"a chain takes a width of 1 to {CHAIN_RANKED} and k >= 0")
        if not 1 <= len(lead) <= CHAIN_LEAD or not all(0 <= token < self.vocab_size for token in lead):
            raise UsageError(f"a chain's lead is 1 to {CHAIN_LEAD} tokens in the vocabulary")
        if noise is not None and (tuple(noise.shape) != (k, rows) or not temperature > 0):
            raise UsageError(f"a chain's noise is [k, {rows}] (one row per depth), at a temperature above 0")
        if allowed is not None and (tuple(allowed.shape) != (rows,) or not bool(allowed.any())):
            raise UsageError(f"a chain's allowed rows are [{rows}] bools, one at least true")
        allowed = None if allowed is None else allowed.to(torch.uint8).contiguous()
        if k == 0:
            return [], []
        start, fed = len(self.tokens), len(lead) + k - 1  # the columns it writes: start..start+fed-1
        self.rollback(start)  # positions a shallow run left after the cache go, as a pass drops them
        self._make_room(start + fed)
        if start + fed > self._capacity:
            raise UsageError(f"a chain of {k} after {start + len(lead)} tokens passes the model's {self.max_length} "
                             "positions")
        first = self._embedded(lead).to(torch.float32).contiguous()  # [lead, hidden]
        noise = None if noise is None else noise.to(torch.float64).contiguous()
        hidden = None if self._hidden is None else self._hidden[start : start + fed]  # [fed, hidden]: written there
        drafted, ranked = np.empty(k, dtype=np.int32), np.empty((k, width - 1), dtype=np.int32)
        native.use_threads(self.team.best())  # a few rows a pass: the size plain decoding measured fastest
        address = lambda tensor: None if tensor is None else tensor.data_ptr()  # noqa: E731
        code = self._library.sd_draft_chain(
            ctypes.byref(self._model), ctypes.byref(self._cache().struct), first.data_ptr(), len(lead), start, k,
            vocabulary.ids.data_ptr(), vocabulary.embed.data_ptr(), rows, address(noise), temperature,
            address(allowed), width - 1,
            drafted.ctypes.data, ranked.ctypes.data, address(hidden))
        if code != 0:  # -2: arguments chain.c does not take, which the checks above keep from it
            raise MemoryError("the chain could not allocate its scratch") if code == -1 else \
                ValueError(f"sd_draft_chain refused its arguments ({code})")
        tokens = drafted.tolist()
        self.tokens += list(lead) + tokens[:-1]
        return tokens, [[token for token in row if token >= 0] for row in ranked.tolist()]

    def pool(self, max_slots: int, max_length: int):
        from exactspec.backends.fused.pool import FusedPool

        return FusedPool(self, max_slots, max_length)

    def _held_matrices(self, source: FusedWeights, weights: str) -> list[StoredMatrix]:
        """Each matrix as the C pass reads it: as stored, or a module's in ``weights``: int8 (``quantized8``), float16,
        or auto: int8 where ``quantized8`` keeps every weight of the matrix exactly, else float16."""
        return [matrix if isinstance(matrix, StoredMatrix) else _held(matrix, weights) for matrix in source.matrices]

    def _c_model(self, source: FusedWeights) -> Model:
        """The C model over the held matrices and copies of the norms and biases (kept here, as the C kernels point into
        them)."""
        self._kept = []

        def held(tensor: torch.Tensor | None) -> int | None:
            if tensor is None:
                return None
            tensor = tensor.detach().float().contiguous()
            self._kept.append(tensor)
            return tensor.data_ptr()

        for matrix, bias in zip(self._matrices[0::4], source.qkv_biases):
            if bias is not None:
                matrix.bias = bias.detach().float().contiguous()
        spec = source.spec
        structs = (Layer * spec.layers)()
        for i, (struct, input_norm, post_norm, norms) in enumerate(zip(structs, source.input_norms,
                                                                        source.post_norms, source.layer_norms)):
            struct.input_norm, struct.post_norm = held(input_norm), held(post_norm)
            for name, norm in norms.items():
                setattr(struct, name, held(norm))
            struct.window, struct.rope = self.windows[i], self._rope_tables(i)
            for name, matrix in zip(MATRIX_NAMES, self._matrices[4 * i : 4 * i + 4]):
                setattr(struct, name, matrix.struct(self.products))
        self._layer_structs = structs
        head, architecture = self._matrices[-1], spec.architecture
        activation = {"silu": native.SILU, "gelu_tanh": native.GELU_TANH}[architecture.activation]
        return Model(spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.head_dim, spec.intermediate,
                     head.rows, spec.eps, activation, architecture.attention_scale, architecture.attention_softcap,
                     structs, held(spec.final_norm), head.struct(self.products))

    def _rope_tables(self, index: int) -> int:
        """fused.h's Layer.rope of layer ``index``: the tables its q and k turn by, or none (a NoPE layer)."""
        if not self.rope_layers[index]:
            return native.ROPE_NONE
        return native.ROPE_LOCAL if self.local_rope(index) else native.ROPE_MAIN

    def _cache(self) -> PassCache:
        """What the C kernels read of this sequence's cache, made again after the cache moved."""
        if self._pass_cache is None or self._pass_cache[0] != self.cache_generation:
            self._pass_cache = (self.cache_generation, PassCache(self._keys, self._values,
                                                                 self._capacity * self.head_dim, self._cos, self._sin,
                                                                 self._local_cos, self._local_sin))
        return self._pass_cache[1]

    def fused_pass(self, x: torch.Tensor, first: int, end: int, cache: PassCache, rope: np.ndarray,
                   base: np.ndarray, columns: np.ndarray, n_keys: np.ndarray, key_cols: np.ndarray | None = None,
                   ) -> torch.Tensor:  # [n, hidden]
        """Rows x [n, hidden] through layers first..end-1 in C passes of up to PASS_ROWS rows, in order (a row's keys
        are written before any later row reads them); the residual stream after them (a new tensor). Row i sits at
        RoPE position ``rope[i]``; its key and value are written at cache column ``columns[i]`` of the sequence that
        starts ``base[i]`` floats from each layer cache's base; it attends the first ``n_keys[i]`` columns there, or
        those ``key_cols[i]`` lists, in that order. Each row is computed as it is alone: the parts change no bit."""
        parts = [slice(at, at + PASS_ROWS) for at in range(0, x.shape[0], PASS_ROWS)]
        if len(parts) > 1:
            return torch.cat([self.fused_pass(x[p], first, end, cache, rope[p], base[p], columns[p], n_keys[p],
                                              None if key_cols is None else key_cols[p]) for p in parts])
        x = x.to(torch.float32, memory_format=torch.contiguous_format, copy=True)  # fused.c writes it
        arrays = [np.ascontiguousarray(a) for a in (rope.astype(np.int32), base.astype(np.int64),
                                                    columns.astype(np.int32), n_keys.astype(np.int32))]
        key_cols = None if key_cols is None else np.ascontiguousarray(key_cols, dtype=np.int32)
        rows = native.rows_struct(arrays, key_cols)
        timed = x.shape[0] == 1 and first == 0 and end == self.num_layers  # a decoding step: the team's measure
        threads = native.use_threads(self.team.choose() if timed else self.team.size)
        started = time.perf_counter()
        if self._library.sd_pass(ctypes.byref(self._model), ctypes.byref(cache.struct), ctypes.byref(rows),
                                 x.data_ptr(), first, end) != 0:
            raise MemoryError("the fused pass could not allocate its scratch")
        if timed:
            self.team.observe(threads, time.perf_counter() - started)
        return x
