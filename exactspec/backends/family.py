"""The llama family (llama, mistral, qwen2, smollm3) as PyTorch computes it: which models it covers, a layer's weights
(one fused product for q, k and v, one for gate and up, each through the kernel for its precision, ``linear.py``),
the norms, RoPE, the feed-forward block, and attention that reads whole blocks of keys.

Shared below the runtimes' wings: the lean runtime computes every pass with it, and the fused runtime its prompts'
bulk passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from exactspec.backends import native
from exactspec.backends.gguf_file import GGUFFile, Tensor, dequantized
from exactspec.backends.linear import Linear, make_linear

FAMILIES = ("llama", "mistral", "qwen2", "smollm3")  # the transformers modules it computes (``supports``)
CONVERTED_FAMILIES = ("llama", "mistral", "qwen2")  # those whose GGUF files transformers converts (not smollm3's)
KEY_BLOCK = 256  # keys attention reduces over at a time; caches hold whole blocks (see blocked_attention)


def supports(model) -> bool:
    """Whether this family's code computes what the transformers module computes for ``model``."""
    config = model.config
    return (
        getattr(config, "model_type", None) in FAMILIES
        and rope_parameters(config).get("rope_type", "default") == "default"
        and getattr(config, "hidden_act", "silu") == "silu"
        and getattr(config, "pretraining_tp", 1) == 1
        and not getattr(config, "use_sliding_window", False)  # qwen2's switch; mistral's window caps max_length
    )


def head_dim_of(config) -> int:
    """A head's width: the config's own, or the hidden size shared among the heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


LINEARS = ("qkv", "out", "gate_up", "down")  # a layer's products


@dataclass
class Layer:
    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden]: before the feed-forward block
    qkv: Linear  # [n, hidden] -> [n, (heads + 2 * kv_heads) * head_dim]
    out: Linear  # [n, heads * head_dim] -> [n, hidden]
    gate_up: Linear  # [n, hidden] -> [n, 2 * intermediate]
    down: Linear  # [n, intermediate] -> [n, hidden]
    q_norm: torch.Tensor | None = None  # [head_dim]: each head's q RMS-normed before RoPE (qwen3, gemma 3)
    k_norm: torch.Tensor | None = None  # [head_dim]: and its k
    attn_out_norm: torch.Tensor | None = None  # [hidden]: attention's output normed before the residual add (gemma)
    ffn_out_norm: torch.Tensor | None = None  # [hidden]: the feed-forward block's output, likewise


@dataclass(frozen=True)
class Architecture:
    """What a model computes differently from llama's pass, model-wide (the defaults: llama's)."""

    activation: str = "silu"  # the feed-forward gate's: silu, or gelu_tanh (GELU's tanh approximation)
    embed_scale: float = 1.0  # the token embedding times this (gemma: sqrt(hidden))
    attention_scale: float = 0.0  # q . k times this; 0: 1 / sqrt(head_dim)
    attention_softcap: float = 0.0  # scores capped softly, cap tanh(s / cap); 0: not (gemma 2)
    logit_softcap: float = 0.0  # the logits, likewise (gemma 2)


@dataclass(frozen=True)
class KeysRead:
    """What each query of a pass reads of the cache. For the C kernels' attention (``LlamaSequence.row_attention``): how
    many keys it reads (``n_keys`` [n]) and, for a tree's node, which cache columns in order (``key_cols`` [n,
    span]; None: the first n_keys), and both as fused.c reads them (``rows``). For :func:`blocked_attention`: its
    ``bias`` over whole blocks and, for a tree, each node's gathered columns (``tree_keys`` [n, span])."""

    n_keys: np.ndarray | None = None  # int32
    key_cols: np.ndarray | None = None  # int32
    rows: native.RowKeys | None = None  # the two above as the C kernels' attention reads them, made once per pass
    bias: torch.Tensor | None = None
    tree_keys: torch.Tensor | None = None


@dataclass(frozen=True)
class LlamaSpec:
    """What a llama-family runtime holds of a model beside its layers: its sizes, RoPE, the token embedding and the
    final norm; from a transformers module (:func:`spec_of_module`) or read from a GGUF file."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    max_length: int  # the most positions: trained, or the sliding window
    rope_theta: float
    embed: torch.Tensor | StoredRows  # [vocab, hidden]
    final_norm: torch.Tensor  # [hidden]
    device: torch.device
    architecture: Architecture = Architecture()
    rope_factors: torch.Tensor | None = None  # [head_dim / 2]: each frequency divided by its factor (Llama 3's)
    local_rope_theta: float | None = None  # the sliding-window layers' RoPE base, where theirs differs (gemma 3)
    windows: tuple[int, ...] = ()  # per layer: the most keys a query attends, 0 all; () all everywhere
    rope_layers: tuple[bool, ...] = ()  # per layer: whether it turns q and k by RoPE (smollm3's NoPE: not); () all


class StoredRows:
    """A GGUF's token embedding [vocab, hidden] left as stored: indexing by token ids de-quantises those rows alone
    (float32), so a model of 150k tokens keeps no float copy of its embedding."""

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor
        self.shape = torch.Size(tensor.shape)
        self.dtype = torch.float32

    def __getitem__(self, ids) -> torch.Tensor:  # [n] token ids -> [n, hidden] float32
        index = np.asarray(ids.cpu() if isinstance(ids, torch.Tensor) else ids, dtype=np.int64).reshape(-1)
        rows = Tensor(self.tensor.name, self.tensor.type_name, (len(index), self.shape[1]), self.tensor.data[index])
        return torch.from_numpy(dequantized(rows)).reshape(*np.shape(ids), self.shape[1])

    def to(self, dtype: torch.dtype) -> StoredRows | torch.Tensor:
        if dtype == torch.float32:
            return self
        return torch.from_numpy(dequantized(self.tensor).copy()).to(dtype)

    def float(self) -> StoredRows:
        return self

    def detach(self) -> StoredRows:
        return self


def spec_of_module(model) -> LlamaSpec:
    config = model.config
    return LlamaSpec(
        hidden=config.hidden_size, layers=config.num_hidden_layers, heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads, head_dim=head_dim_of(config), intermediate=config.intermediate_size,
        eps=config.rms_norm_eps,
        max_length=min(config.max_position_embeddings, getattr(config, "sliding_window", None) or 2**62),
        rope_theta=rope_parameters(config).get("rope_theta", getattr(config, "rope_theta", 10000.0)),
        embed=model.get_input_embeddings().weight.detach(), final_norm=model.model.norm.weight.detach(),
        device=next(model.parameters()).device,
        rope_layers=tuple(bool(rotates) for rotates in getattr(config, "no_rope_layers", None) or ()))


# the architectures read from a GGUF file directly (spec_of_gguf); mistral's files are llama's
GGUF_FAMILIES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "smollm3")
GEMMA3_LOCAL_ROPE_THETA = 10000.0  # gemma 3's sliding layers turn by this base, whatever the file's
GEMMA3_PATTERN = 6  # gemma 3: of every 6 layers, the first 5 slide and the 6th reads everything
SMOLLM3_NOPE_INTERVAL = 4  # smollm3: every 4th layer turns nothing by RoPE (llama.cpp fixes it, the file says nothing)


def gguf_head_dim(source: GGUFFile) -> int:
    """A head's width: the file's key length where it gives one (qwen3, gemma), else the hidden size per head."""
    arch = source.field("general.architecture")
    heads = source.field(f"{arch}.attention.head_count")
    return source.field(f"{arch}.attention.key_length", source.field(f"{arch}.embedding_length") // heads)


def gguf_uncovered(source: GGUFFile) -> str | None:
    """Why :func:`spec_of_gguf` does not read this file's model (None where it does)."""
    arch = source.field("general.architecture")
    if arch not in GGUF_FAMILIES:
        return f"its architecture ({arch}) is not read from a GGUF file directly yet"
    if source.field(f"{arch}.rope.scaling.type", "none") not in ("none", "linear"):
        return f"its RoPE is scaled by {source.field(f'{arch}.rope.scaling.type')}"
    if source.field(f"{arch}.rope.scaling.attn_factor", 1.0) != 1.0:
        return "its RoPE's cos and sin are scaled (rope.scaling.attn_factor)"
    head_dim = gguf_head_dim(source)
    if source.field(f"{arch}.attention.value_length", head_dim) != head_dim:
        return "its values are not as wide as its keys"
    if source.field(f"{arch}.rope.dimension_count", head_dim) != head_dim:
        return "its RoPE turns part of each head only"
    if any(name in source.tensors for name in ("rope_factors_long.weight", "rope_factors_short.weight")):
        return "its RoPE is scaled by LongRoPE"
    if "token_embd.weight" not in source.tensors or "output_norm.weight" not in source.tensors:
        return "it lacks the token embedding or the final norm"
    return None


def spec_of_gguf(source: GGUFFile) -> LlamaSpec:
    """The sizes, RoPE, embedding and final norm of a GGUF file's model, read from its metadata and tensors (the
    embedding left as stored: :class:`StoredRows`); :func:`gguf_uncovered` first."""
    arch = source.field("general.architecture")
    field = lambda key, default=None: source.field(f"{arch}.{key}", default)  # noqa: E731
    hidden, heads, layers = field("embedding_length"), field("attention.head_count"), field("block_count")
    tensor = lambda name: torch.from_numpy(dequantized(source.tensors[name]).copy())  # noqa: E731
    rope_factors = tensor("rope_freqs.weight") if "rope_freqs.weight" in source.tensors else None
    if field("rope.scaling.type", "none") == "linear" and field("rope.scaling.factor", 1.0) != 1.0:
        linear = torch.full((gguf_head_dim(source) // 2,), float(field("rope.scaling.factor")))
        rope_factors = linear if rope_factors is None else rope_factors * linear
    window = field("attention.sliding_window", 0)
    return LlamaSpec(
        hidden=hidden, layers=layers, heads=heads, kv_heads=field("attention.head_count_kv", heads),
        head_dim=gguf_head_dim(source), intermediate=field("feed_forward_length"),
        eps=field("attention.layer_norm_rms_epsilon"), max_length=field("context_length"),
        rope_theta=field("rope.freq_base", 10000.0), embed=StoredRows(source.tensors["token_embd.weight"]),
        final_norm=tensor("output_norm.weight"), device=torch.device("cpu"),
        architecture=_gguf_architecture(source), rope_factors=rope_factors,
        local_rope_theta=GEMMA3_LOCAL_ROPE_THETA if arch == "gemma3" else None,
        windows=tuple(window if _slides(arch, i) else 0 for i in range(layers)) if window else (),
        rope_layers=gguf_rope_layers(source))


def gguf_rope_layers(source: GGUFFile) -> tuple[bool, ...]:
    """Per layer of a GGUF's model, whether it turns q and k by RoPE (smollm3: all but every 4th); () all."""
    arch = source.field("general.architecture")
    if arch != "smollm3":
        return ()
    return tuple((i + 1) % SMOLLM3_NOPE_INTERVAL != 0 for i in range(source.field(f"{arch}.block_count")))


def _slides(arch: str, layer: int) -> bool:
    """Whether a layer of a model with a sliding window reads through it (gemma 2: every other layer, from the
    first; gemma 3: five in six; phi3 and the rest: every layer)."""
    if arch == "gemma2":
        return layer % 2 == 0
    if arch == "gemma3":
        return layer % GEMMA3_PATTERN < GEMMA3_PATTERN - 1
    return True


def _gguf_architecture(source: GGUFFile) -> Architecture:
    """How a GGUF's model computes apart from llama's: gemma's GELU, scaled embedding, attention scale and soft
    caps (its 27B scales q by the hidden size per head, as llama.cpp does; the rest by the head's width)."""
    arch = source.field("general.architecture")
    if not arch.startswith("gemma"):
        return Architecture()
    hidden, heads = source.field(f"{arch}.embedding_length"), source.field(f"{arch}.attention.head_count")
    gemma_27b = source.field(f"{arch}.block_count") == GEMMA_27B_LAYERS[arch]
    return Architecture(
        activation="gelu_tanh", embed_scale=float(np.sqrt(np.float32(hidden))),
        attention_scale=float(np.float32(hidden // heads) ** -0.5) if gemma_27b else 0.0,
        attention_softcap=float(source.field(f"{arch}.attn_logit_softcapping", 0.0)),
        logit_softcap=float(source.field(f"{arch}.final_logit_softcapping", 0.0)))


GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # how llama.cpp knows a 27B, whose q it scales otherwise


@torch.no_grad()
def build_layers(model, precision: str, dtype: torch.dtype) -> tuple[list[Layer], Linear]:
    """The layers' fused matmuls and the LM head, with their weights in ``precision``."""
    layers = [_fuse(layer, precision, dtype) for layer in model.model.layers]
    head = model.get_output_embeddings()
    return layers, make_linear(head.weight, head.bias, precision)


def _fuse(layer, precision: str, dtype: torch.dtype) -> Layer:
    attention, mlp = layer.self_attn, layer.mlp
    projections = (attention.q_proj, attention.k_proj, attention.v_proj)
    biases = [p.bias for p in projections]
    qkv_bias = None if all(b is None for b in biases) else torch.cat(
        [p.bias if p.bias is not None else p.weight.new_zeros(p.weight.shape[0]) for p in projections]
    )
    gate_up_bias = None if mlp.gate_proj.bias is None else torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias])
    return layer_of(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                    torch.cat([p.weight for p in projections]), attention.o_proj.weight,
                    torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), mlp.down_proj.weight, precision, dtype,
                    biases=(qkv_bias, attention.o_proj.bias, gate_up_bias, mlp.down_proj.bias))


def layer_of(input_norm: torch.Tensor, post_norm: torch.Tensor, qkv: torch.Tensor, out: torch.Tensor,
             gate_up: torch.Tensor, down: torch.Tensor, precision: str, dtype: torch.dtype,
             biases: tuple = (None, None, None, None)) -> Layer:
    """A layer from its norms and its four products' weights [out, in] (and biases), held in ``precision``."""
    linears = [make_linear(weight, bias, precision) for weight, bias in zip((qkv, out, gate_up, down), biases)]
    return Layer(input_norm.to(dtype), post_norm.to(dtype), *linears)


def rope_parameters(config) -> dict:
    return getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers' LlamaRMSNorm: normalise in float32, scale in the input's dtype."""
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def project_qkv(layer: Layer, h: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, heads: int,
                kv_heads: int, head_dim: int, eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [n, heads, hd], k and v [n, kv_heads, hd] of the normed hidden states h [n, hidden], q and k normed per
    head where the layer says (with ``eps``), then rotated to the positions whose cos and sin ([n, hd]) are given
    (None: a layer without RoPE, smollm3's NoPE)."""
    n = h.shape[0]
    qkv = layer.qkv(h)  # [n, (heads + 2 * kv_heads) * hd]
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(n, heads + kv_heads, head_dim)
    if layer.q_norm is not None:
        qk = torch.cat([rms_norm(qk[:, :heads], layer.q_norm, eps), rms_norm(qk[:, heads:], layer.k_norm, eps)], 1)
    if cos is not None:
        qk = _apply_rope(qk, cos, sin)
    return qk[:, :heads], qk[:, heads:], qkv[:, (heads + kv_heads) * head_dim :].view(n, kv_heads, head_dim)


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}


def mlp(layer: Layer, x: torch.Tensor, eps: float, activation: str = "silu") -> torch.Tensor:  # [n, hidden]
    """The feed-forward block's output (to add to x): down(act(gate) * up) of the normed x, act one of
    ACTIVATIONS."""
    gate, up = layer.gate_up(rms_norm(x, layer.post_norm, eps)).chunk(2, dim=-1)  # [n, intermediate] each
    return layer.down(ACTIVATIONS[activation](gate) * up)


def added(x: torch.Tensor, output: torch.Tensor, norm: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The residual stream x after a block's ``output`` is added, normed first where the layer norms it (gemma)."""
    return x + (output if norm is None else rms_norm(output, norm, eps))


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # x [n, heads, hd]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def whole_blocks(length: int) -> int:
    """``length`` rounded up to whole blocks of KEY_BLOCK keys."""
    return -(-length // KEY_BLOCK) * KEY_BLOCK


def blocked_mask(mask: torch.Tensor | None, start: int, n: int, device: torch.device) -> torch.Tensor:
    """[1, n, whole_blocks(start+n)]: True where query i may attend key j; ``mask`` [n, start+n] as given (None:
    causal), keys past start+n never."""
    span = whole_blocks(start + n)
    if mask is None:
        mask = causal_mask(start, n, device) if n > 1 else torch.ones(1, start + n, dtype=torch.bool, device=device)
    return F.pad(mask, (0, span - mask.shape[-1]))[None]


def attention_bias(allowed: torch.Tensor, kv_heads: int, group: int, dtype: torch.dtype) -> torch.Tensor:
    """``allowed`` [B or 1, n, S] as what :func:`blocked_attention` adds to its scores: [B * kv_heads or 1,
    group * n, S], 0 where allowed and -inf elsewhere, in the rows' order there (each query once per head of a
    kv head's group). Made once per pass."""
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
    batch, n, span = bias.shape
    bias = bias[:, None, None].expand(batch, 1 if batch == 1 else kv_heads, group, n, span)
    return bias.reshape(-1, group * n, span)


def tree_reading(mask: torch.Tensor, start: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For a tree pass (``mask`` [n, start+n]: the cache, then each node's ancestry, itself included): each node's
    keys in the order its branch lays them out as a chain (the cache, then its ancestors root first, then padding),
    as cache columns [n, span], and what it may read of them [n, 1, span]."""
    n = mask.shape[0]
    branches = [torch.nonzero(mask[i, start:]).flatten() + start for i in range(n)]  # ancestors in depth order
    span = whole_blocks(start + max(len(b) for b in branches))
    columns = torch.zeros(n, span, dtype=torch.long, device=device)  # padding reads column 0: finite, masked
    allowed = torch.zeros(n, 1, span, dtype=torch.bool, device=device)
    columns[:, :start] = torch.arange(start, device=device)
    for i, branch in enumerate(branches):
        columns[i, start : start + len(branch)] = branch
        allowed[i, 0, : start + len(branch)] = True
    return columns, allowed


def blocked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor
                      ) -> torch.Tensor:  # [B, heads, n, hd]
    """softmax(q k^T / sqrt(hd) + bias) v, invariant to the pass: q [B, heads, n, hd]; keys and values [B, kv_heads,
    S, hd], S whole blocks of KEY_BLOCK keys (those no query may see: finite); ``bias`` from
    :func:`attention_bias`.

    Block by block, with a running maximum and sum (flash attention's online softmax), every row reduces over the
    same whole blocks in the same order, and every matmul's row is computed as it is alone: a row's result is
    the same bit for bit whatever the number of rows in the pass, whichever sequences share it, and however many
    blocks the pass reads beyond the row's own (a block a row may not see leaves its maximum, sum and output
    exactly as they were). PyTorch's fused attention is not: one query and several take different paths."""
    batch, heads, n, hd = q.shape
    kv_heads = keys.shape[1]
    rows = heads // kv_heads * n  # a kv head's queries: its group of heads, each over the n positions
    q = q.reshape(batch * kv_heads, rows, hd)
    top = total = out = None
    for block in range(0, keys.shape[2], KEY_BLOCK):
        k = keys[:, :, block : block + KEY_BLOCK].reshape(batch * kv_heads, KEY_BLOCK, hd)
        v = values[:, :, block : block + KEY_BLOCK].reshape(batch * kv_heads, KEY_BLOCK, hd)
        scores = torch.baddbmm(bias[..., block : block + KEY_BLOCK], q, k.transpose(1, 2), alpha=hd**-0.5)
        block_top = scores.amax(-1, keepdim=True)  # [B * kv_heads, rows, 1]
        new_top = block_top if top is None else torch.maximum(top, block_top)
        weights = scores.sub_(new_top).exp_()
        block_total, block_out = weights.sum(-1, keepdim=True), torch.bmm(weights, v)
        if top is None:
            total, out = block_total, block_out
        else:  # earlier blocks rescaled to the new maximum: by 1 exactly where this block adds nothing
            rescale = torch.exp(top - new_top)
            total, out = total * rescale + block_total, out * rescale + block_out
        top = new_top
    return (out / total).view(batch, heads, n, hd)


def causal_mask(start: int, n: int, device: torch.device) -> torch.Tensor | None:
    """[n, start+n] True where query i (position start+i) may attend key j; None for one query (sees all)."""
    if n == 1:
        return None
    keys = torch.arange(start + n, device=device)
    return keys[None, :] <= (start + torch.arange(n, device=device))[:, None]
