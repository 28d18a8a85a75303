"""A lean runtime for llama-family models (llama, mistral, qwen2), run from the weights of a transformers model.

What it saves over calling the transformers module: one fused matmul for q, k and v and one for gate and up,
each through the fastest kernel for its weight precision (``linear.py``); a KV cache preallocated to the
request and written by position (rollback is only a length; no tensor grows per step); RoPE tables computed
once; no per-module Python dispatch; the LM head only where logits are needed. On the CPU the activations, norms,
attention and KV cache are float32 whatever the weights' precision, and each kind of pass (one position; several)
may hold its weights in its own precision.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from specdec.backends import native
from specdec.backends.base import FeatureSource, ShallowRunner, TreeScorer, streamed_parameters
from specdec.backends.linear import DTYPE_OF, Linear, PassPrecisions, activation_dtype, make_linear, precision_name

FAMILIES = ("llama", "mistral", "qwen2")
KEY_BLOCK = 256  # keys attention reduces over at a time; caches hold whole blocks (see blocked_attention)
INITIAL_CAPACITY = KEY_BLOCK  # cache positions allocated when nothing was reserved; doubled when a request needs more


def supports(model) -> bool:
    """Whether this runtime computes what the transformers module computes for ``model``."""
    config = model.config
    return (
        getattr(config, "model_type", None) in FAMILIES
        and _rope_parameters(config).get("rope_type", "default") == "default"
        and getattr(config, "hidden_act", "silu") == "silu"
        and getattr(config, "pretraining_tp", 1) == 1
        and not getattr(config, "use_sliding_window", False)  # qwen2's switch; mistral's window caps max_length
    )


LINEARS = ("qkv", "out", "gate_up", "down")  # a layer's products


@dataclass
class _Layer:
    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    qkv: Linear  # [n, hidden] -> [n, (heads + 2 * kv_heads) * head_dim]
    out: Linear  # [n, heads * head_dim] -> [n, hidden]
    gate_up: Linear  # [n, hidden] -> [n, 2 * intermediate]
    down: Linear  # [n, intermediate] -> [n, hidden]


class LlamaRuntime(TreeScorer, FeatureSource, ShallowRunner):
    """The CausalLM protocol for llama-family models: KV cache over one sequence, extended and rolled back."""

    def __init__(self, model, precisions: PassPrecisions | str | None = None) -> None:
        if not supports(model):
            raise ValueError("LlamaRuntime supports llama, mistral and qwen2 models with default RoPE")
        config = model.config
        self.device = next(model.parameters()).device
        if precisions is None:
            precisions = precision_name(next(model.parameters()).dtype)
        if isinstance(precisions, str):
            precisions = PassPrecisions.uniform(precisions)
        self.dtype = activation_dtype(precisions.score, self.device)
        if any(activation_dtype(p, self.device) != self.dtype for p in precisions.all):
            raise ValueError(f"passes in {precisions} would need two activation dtypes on {self.device.type}")
        self.precisions = precisions
        self.weight_bytes = streamed_parameters(model) * DTYPE_OF[precisions.decode].itemsize
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.max_length = min(config.max_position_embeddings, getattr(config, "sliding_window", None) or 2**62)
        self.embed = model.get_input_embeddings().weight.detach().to(self.dtype)  # [vocab, hidden]
        self.vocab_size = self.embed.shape[0]
        self.final_norm = model.model.norm.weight.detach().to(self.dtype)
        self._weights = self._build_weights(model, precisions)
        rope = _rope_parameters(config)
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, device=self.device).float() / self.head_dim))
        self.tokens: list[int] = []
        self._hidden: torch.Tensor | None = None  # [capacity, hidden] once keep_hidden_states() was called
        self._keys: list[torch.Tensor] = []  # per layer [kv_heads, capacity, head_dim]
        self._values: list[torch.Tensor] = []
        self._cos = self._sin = torch.empty(0, self.head_dim, device=self.device)  # [capacity, head_dim]
        self._capacity = 0
        self._shallow = _Shallow()  # positions after the cache run through the first layers only (extend_shallow)
        # on the CPU each query's attention is fused.c's, computed as it is alone; elsewhere blocked_attention
        self.row_attention = native.covers_attention(self.head_dim, self.dtype, self.device)

    def _build_weights(self, model, precisions: PassPrecisions) -> dict:
        """Per precision: the layers and LM head a pass in it computes with."""
        return {precision: _build(model, precision, self.dtype) for precision in set(precisions.all)}

    def reserve(self, length: int) -> None:
        """Hold at least ``length`` positions (capped at max_length), so that no pass reallocates the cache."""
        self._resize(min(max(length, self._capacity), self.max_length))

    def rollback(self, length: int) -> None:
        del self.tokens[length:]  # positions past the length are overwritten by the next extend
        self._shallow = _Shallow()

    def keep_hidden_states(self) -> None:
        """From now on keep every cached position's final hidden state (what drafters that read the target's
        features need); the cost is one norm over every new position instead of only where logits are wanted."""
        if self._hidden is None:
            self._hidden = torch.empty(self._capacity, self.embed.shape[1], dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def extend(self, token_ids: list[int], num_logits: int) -> torch.Tensor:  # [num_logits, vocab]
        """Append ``token_ids``; the logits after the last ``num_logits`` of them. Tokens that
        :meth:`extend_shallow` ran through the first layers since the last extend are not run there again."""
        if not token_ids:
            return torch.empty(0, self.vocab_size, device=self.device)
        start, n = len(self.tokens), len(token_ids)
        return self._forward(token_ids, num_logits, slice(start, start + n), _causal_mask(start, n, self.device))

    @torch.inference_mode()
    def extend_shallow(self, token_ids: list[int], layers: int) -> torch.Tensor:  # [n, hidden]
        """Run ``token_ids`` through the first ``layers`` layers only, after the cache and the tokens run so since
        the last extend; the hidden states they leave (the residual stream, unnormed). Their keys and values stay
        in those layers' cache: the next :meth:`extend` over the same tokens starts at layer ``layers`` for them
        (self-speculation's shared cache). Anything else (a rollback, a tree, other tokens) drops them."""
        if not 1 <= layers <= self.num_layers:
            raise ValueError(f"layers must be in 1..{self.num_layers}, got {layers}")
        if self._shallow.layers not in (0, layers):
            self._shallow = _Shallow()
        start, n = len(self.tokens) + len(self._shallow.tokens), len(token_ids)
        self._make_room(start + n)
        x = self._layers(self._embedded(token_ids), 0, layers, start, slice(start, start + n),
                         _causal_mask(start, n, self.device))
        self._shallow.layers = layers
        self._shallow.tokens += token_ids
        self._shallow.states.append(x)
        return x

    @torch.inference_mode()
    def layer_states(self, token_ids: list[int]) -> torch.Tensor:  # [num_layers + 1, n, hidden]
        """Append ``token_ids`` (as :meth:`extend` would, without logits) and return the residual stream of the
        pass after every layer (index 0: the embeddings; L: after the first L layers), as early exits read it."""
        start, n = len(self.tokens), len(token_ids)
        self._make_room(start + n)
        self._shallow = _Shallow()
        positions, mask = slice(start, start + n), _causal_mask(start, n, self.device)
        states = [self._embedded(token_ids)]
        for index in range(self.num_layers):
            states.append(self._layers(states[-1], index, index + 1, start, positions, mask))
        self.tokens += token_ids
        if self._hidden is not None:
            self._hidden[start : start + n] = rms_norm(states[-1], self.final_norm, self.eps)
        return torch.stack(states)

    @torch.inference_mode()
    def extend_tree(self, token_ids: list[int], parents: list[int]) -> torch.Tensor:  # [n, vocab]
        """Append a token tree in one pass: ``token_ids[0]`` follows the cache, each other token follows
        ``token_ids[parents[i]]`` (parents come first). Each position attends to the cache and its own ancestors
        and sits at the position of its depth; the logits after every token are returned. The cache then holds the
        tree in this order: :meth:`keep_path` compacts the branch that was accepted."""
        start, n = len(self.tokens), len(token_ids)
        depth = [0] * n
        ancestry = torch.eye(n, dtype=torch.bool, device=self.device)  # [n, n]: ancestry[i, j]: j is i or above it
        for i in range(1, n):
            if not 0 <= parents[i] < i:
                raise ValueError(f"node {i}'s parent {parents[i]} does not come before it")
            depth[i] = depth[parents[i]] + 1
            ancestry[i] |= ancestry[parents[i]]
        mask = torch.cat([torch.ones(n, start, dtype=torch.bool, device=self.device), ancestry], dim=1)
        positions = start + torch.tensor(depth, device=self.device)
        return self._forward(token_ids, n, positions, mask)

    @torch.inference_mode()
    def keep_path(self, start: int, path: list[int]) -> None:
        """After :meth:`extend_tree` at cache length ``start``: keep the tree nodes ``path`` (indexes into that
        tree, root first, each a child of the one before) as the positions after ``start``; drop the rest."""
        if path == list(range(len(path))):  # the branch already sits in place (a chain's prefix): nothing moves
            del self.tokens[start + len(path) :]
            return
        slots = torch.tensor([start + node for node in path], device=self.device)
        for buffers in (self._keys, self._values):
            for buffer in buffers:
                buffer[:, start : start + len(path)] = buffer[:, slots]
        if self._hidden is not None:
            self._hidden[start : start + len(path)] = self._hidden[slots]
        self.tokens[start:] = [self.tokens[start + node] for node in path]

    def _forward(self, token_ids: list[int], num_logits: int, positions: slice | torch.Tensor,
                 mask: torch.Tensor | None) -> torch.Tensor:  # [num_logits, vocab]
        """One pass over ``token_ids``, written to the cache after it at their rotary ``positions`` (a slice for a
        chain: the tables are viewed, not copied; [n] for a tree), each query attending to the keys ``mask``
        [n, start+n] allows (None: all)."""
        start, n = len(self.tokens), len(token_ids)
        self._make_room(start + n)
        lm_head = self.pass_weights(n, isinstance(positions, slice))[1]
        reused, shallow = self._reusable_shallow(token_ids, positions), self._shallow
        self._shallow = _Shallow()
        if reused:  # the first positions ran the shared layers while drafting: the rest run them now (a chain)
            x = torch.cat(shallow.states)[:reused]
            if reused < n:
                rest = self._layers(self._embedded(token_ids[reused:]), 0, shallow.layers, start + reused,
                                    slice(start + reused, start + n), mask[reused:])
                x = torch.cat([x, rest])
        else:
            x = self._embedded(token_ids)  # [n, hidden]
        x = self._layers(x, shallow.layers if reused else 0, self.num_layers, start, positions, mask)
        self.tokens += token_ids
        if self._hidden is not None:  # every position normed, kept; else only where logits are wanted
            self._hidden[start : start + n] = rms_norm(x, self.final_norm, self.eps)
        if num_logits == 0:
            return torch.empty(0, self.vocab_size, device=self.device)
        normed = self._hidden[start + n - num_logits : start + n] if self._hidden is not None else \
            rms_norm(x[n - num_logits :], self.final_norm, self.eps)  # [num_logits, hidden]
        return lm_head(normed)  # [num_logits, vocab]

    def _layers(self, x: torch.Tensor, first: int, end: int, start: int, positions: slice | torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        """Layers ``first``..``end-1`` over the hidden states x of the positions after ``start`` (their keys and
        values written to those layers' cache), in the precision of a pass over that many positions."""
        layers = self.pass_weights(x.shape[0], isinstance(positions, slice))[0]
        cos, sin = self._cos[positions], self._sin[positions]  # [n, head_dim] each
        reading = self._keys_read(mask, start, x.shape[0], isinstance(positions, torch.Tensor))
        for index in range(first, end):
            layer = layers[index]
            x = x + self._attention(layer, rms_norm(x, layer.input_norm, self.eps), self._keys[index],
                                    self._values[index], start, cos, sin, reading)
            x = x + mlp(layer, x, self.eps)
        return x

    def _keys_read(self, mask: torch.Tensor | None, start: int, n: int, tree: bool) -> KeysRead:
        """What each of a pass's n queries after ``start`` reads of the cache: the causal prefix for a chain; for a
        tree (``mask`` [n, start+n]), the cache and its own ancestors, laid out as its branch lays them out as a
        chain."""
        columns, allowed = _tree_reading(mask, start, self.device) if tree else (None, None)
        if self.row_attention:
            if columns is None:
                n_keys, key_cols = np.arange(start + 1, start + n + 1, dtype=np.int32), None
            else:
                n_keys = allowed.sum(-1).flatten().numpy().astype(np.int32)
                key_cols = np.ascontiguousarray(columns.numpy(), dtype=np.int32)
            return KeysRead(n_keys=n_keys, key_cols=key_cols,
                            rows=native.RowKeys(np.zeros(n, dtype=np.int64), n_keys, key_cols))
        if allowed is None:
            allowed = blocked_mask(mask, start, n, self.device)
        return KeysRead(bias=attention_bias(allowed, self.kv_heads, self.heads // self.kv_heads, self.dtype),
                        tree_keys=columns)

    def _embedded(self, token_ids: list[int]) -> torch.Tensor:  # [n, hidden]
        return self.embed[torch.tensor(token_ids, dtype=torch.long, device=self.device)]

    def _make_room(self, end: int) -> None:
        """Grow the cache to hold positions up to ``end``."""
        if end > self._capacity:
            self._grow(end)

    def _reusable_shallow(self, token_ids: list[int], positions: slice | torch.Tensor) -> int:
        """How many of a chain pass's first tokens :meth:`extend_shallow` already ran (0 when not these tokens)."""
        shallow = self._shallow
        if not shallow.tokens or not isinstance(positions, slice) or len(shallow.tokens) > len(token_ids):
            return 0
        return len(shallow.tokens) if token_ids[: len(shallow.tokens)] == shallow.tokens else 0

    def pass_weights(self, positions: int, chain: bool) -> tuple[list[_Layer], Linear]:
        """The weights of a pass over ``positions`` new tokens, a chain of them or a tree."""
        return self.weights_for(positions)

    def weights_for(self, positions: int) -> tuple[list[_Layer], Linear]:
        """The layers and LM head of a pass over ``positions`` new tokens, in that kind of pass's precision."""
        return self._weights[self.precisions.for_positions(positions)]

    def _attention(self, layer: _Layer, h: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                   cos: torch.Tensor, sin: torch.Tensor, reading: KeysRead) -> torch.Tensor:  # [n, hidden]
        """A chain's queries attend to the cache as it lies; a tree's each to its own keys in its branch's chain
        order (``reading``), so that every node computes what its branch computes as a chain."""
        n, heads, hd = h.shape[0], self.heads, self.head_dim
        q, k, v = project_qkv(layer, h, cos, sin, heads, self.kv_heads, hd)
        keys[:, start : start + n] = k.transpose(0, 1)
        values[:, start : start + n] = v.transpose(0, 1)
        if reading.rows is not None:  # fused.c's attention, each query alone
            return layer.out(native.attention(q, keys, values, reading.rows))
        if reading.tree_keys is None:
            span = reading.bias.shape[-1]
            attended = blocked_attention(q.transpose(0, 1)[None], keys[None, :, :span], values[None, :, :span],
                                         reading.bias)[0].transpose(0, 1)  # [n, heads, hd]
        else:  # one batch entry per node: [n, kv_heads, span, hd]
            attended = blocked_attention(q[:, :, None], keys[:, reading.tree_keys].transpose(0, 1),
                                         values[:, reading.tree_keys].transpose(0, 1), reading.bias)[:, :, 0]
        return layer.out(attended.reshape(n, heads * hd))

    def _grow(self, needed: int) -> None:
        capacity = max(INITIAL_CAPACITY, self._capacity)
        while capacity < needed:
            capacity *= 2
        self._resize(min(capacity, self.max_length))

    def _resize(self, capacity: int) -> None:
        capacity = whole_blocks(capacity)  # attention reads whole blocks of keys
        if capacity == self._capacity:
            return
        shape = (self.kv_heads, capacity, self.head_dim)
        used = min(len(self.tokens), capacity)
        for buffers in (self._keys, self._values):
            for i in range(self.num_layers):
                # zeros: attention reads the unwritten positions of its last block, masked; they must be finite
                resized = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if i < len(buffers):
                    resized[:, :used] = buffers[i][:, :used]
                    buffers[i] = resized
                else:
                    buffers.append(resized)
        if self._hidden is not None:
            resized = torch.empty(capacity, self._hidden.shape[1], dtype=self.dtype, device=self.device)
            resized[:used] = self._hidden[:used]
            self._hidden = resized
        self._cos, self._sin = self.rope_tables(capacity)
        self._capacity = capacity

    def rope_tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:  # [length, head_dim] each
        """cos and sin of the rotary angles at positions 0..length-1."""
        positions = torch.arange(length, device=self.device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq[None]  # [length, head_dim / 2]
        angles = torch.cat([freqs, freqs], dim=-1)  # [length, head_dim]
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)

    @property
    def precision_label(self) -> str:
        """The weights' precision, per kind of pass."""
        return str(self.precisions)

    @property
    def runtime_label(self) -> str:
        """What computes this runtime's rows, as a notice names it."""
        return f"specdec's runtime ({self.precision_label})"

    def remedy(self, path) -> str:
        """What makes this runtime's rows the same in any pass, where they are not."""
        why = native.unavailable() or "its sizes or precision are not theirs (inputs in chunks of 8, float weights)"
        return f"specdec's row kernels, which compute each row as it is alone, do not run here: {why}"

    @property
    def pass_invariant(self) -> bool:
        """Whether every row is computed as it is alone by construction: its products and attention are fused.c's
        row kernels (``native``), as on any x86 CPU with AVX2 where they were built. Where they are not (CUDA, a
        missing build, float64), the libraries' kernels decide, and the load probe measures what they do."""
        linears = [linear for layers, head in self._weights.values()
                   for linear in [head] + [getattr(layer, name) for layer in layers for name in LINEARS]]
        return self.row_attention and all(isinstance(linear, native.RowProduct) for linear in linears)

    @property
    def num_layers(self) -> int:
        return len(self.weights_for(1)[0])


@dataclass(frozen=True)
class KeysRead:
    """What each query of a pass reads of the cache. For fused.c's attention (``LlamaRuntime.row_attention``): how
    many keys it reads (``n_keys`` [n]) and, for a tree's node, which cache columns in order (``key_cols`` [n,
    span]; None: the first n_keys), and both as fused.c reads them (``rows``). For :func:`blocked_attention`: its
    ``bias`` over whole blocks and, for a tree, each node's gathered columns (``tree_keys`` [n, span])."""

    n_keys: np.ndarray | None = None  # int32
    key_cols: np.ndarray | None = None  # int32
    rows: native.RowKeys | None = None  # the two above as fused.c's attention reads them, made once per pass
    bias: torch.Tensor | None = None
    tree_keys: torch.Tensor | None = None


@dataclass
class _Shallow:
    """Tokens after the cache that ran through the first ``layers`` layers only, and the states they left."""

    layers: int = 0
    tokens: list[int] = field(default_factory=list)
    states: list[torch.Tensor] = field(default_factory=list)  # [n, hidden] per extend_shallow call


@torch.no_grad()
def _build(model, precision: str, dtype: torch.dtype) -> tuple[list[_Layer], Linear]:
    """The layers' fused matmuls and the LM head, with their weights in ``precision``."""
    layers = [_fuse(layer, precision, dtype) for layer in model.model.layers]
    head = model.get_output_embeddings()
    return layers, make_linear(head.weight, head.bias, precision)


def _fuse(layer, precision: str, dtype: torch.dtype) -> _Layer:
    attention, mlp = layer.self_attn, layer.mlp
    projections = (attention.q_proj, attention.k_proj, attention.v_proj)
    biases = [p.bias for p in projections]
    qkv_bias = None if all(b is None for b in biases) else torch.cat(
        [p.bias if p.bias is not None else p.weight.new_zeros(p.weight.shape[0]) for p in projections]
    )
    gate_up_bias = None if mlp.gate_proj.bias is None else torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias])
    return _Layer(
        input_norm=layer.input_layernorm.weight.to(dtype),
        post_norm=layer.post_attention_layernorm.weight.to(dtype),
        qkv=make_linear(torch.cat([p.weight for p in projections]), qkv_bias, precision),
        out=make_linear(attention.o_proj.weight, attention.o_proj.bias, precision),
        gate_up=make_linear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), gate_up_bias, precision),
        down=make_linear(mlp.down_proj.weight, mlp.down_proj.bias, precision),
    )


def _rope_parameters(config) -> dict:
    return getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers' LlamaRMSNorm: normalise in float32, scale in the input's dtype."""
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def project_qkv(layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [n, heads, hd], k and v [n, kv_heads, hd] of the normed hidden states h [n, hidden], q and k rotated to
    the positions whose cos and sin ([n, hd]) are given."""
    n = h.shape[0]
    qkv = layer.qkv(h)  # [n, (heads + 2 * kv_heads) * hd]
    qk = _apply_rope(qkv[:, : (heads + kv_heads) * head_dim].view(n, heads + kv_heads, head_dim), cos, sin)
    return qk[:, :heads], qk[:, heads:], qkv[:, (heads + kv_heads) * head_dim :].view(n, kv_heads, head_dim)


def mlp(layer: _Layer, x: torch.Tensor, eps: float) -> torch.Tensor:  # [n, hidden]
    """The feed-forward block's output (to add to x): down(silu(gate) * up) of the normed x."""
    gate, up = layer.gate_up(rms_norm(x, layer.post_norm, eps)).chunk(2, dim=-1)  # [n, intermediate] each
    return layer.down(F.silu(gate) * up)


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
        mask = _causal_mask(start, n, device) if n > 1 else torch.ones(1, start + n, dtype=torch.bool, device=device)
    return F.pad(mask, (0, span - mask.shape[-1]))[None]


def attention_bias(allowed: torch.Tensor, kv_heads: int, group: int, dtype: torch.dtype) -> torch.Tensor:
    """``allowed`` [B or 1, n, S] as what :func:`blocked_attention` adds to its scores: [B * kv_heads or 1,
    group * n, S], 0 where allowed and -inf elsewhere, in the rows' order there (each query once per head of a
    kv head's group). Made once per pass."""
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
    batch, n, span = bias.shape
    bias = bias[:, None, None].expand(batch, 1 if batch == 1 else kv_heads, group, n, span)
    return bias.reshape(-1, group * n, span)


def _tree_reading(mask: torch.Tensor, start: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
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


def _causal_mask(start: int, n: int, device: torch.device) -> torch.Tensor | None:
    """[n, start+n] True where query i (position start+i) may attend key j; None for one query (sees all)."""
    if n == 1:
        return None
    keys = torch.arange(start + n, device=device)
    return keys[None, :] <= (start + torch.arange(n, device=device))[:, None]
