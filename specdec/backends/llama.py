"""A lean runtime for llama-architecture models, run from the weights of a transformers model.

What it saves over calling the transformers module: one fused matmul for q, k and v and one for gate and up;
a KV cache written by position into preallocated buffers (rollback is only a length; no tensor grows per
step); no per-module Python dispatch; the LM head only where logits are needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

INITIAL_CAPACITY = 256  # cache positions allocated at first; doubled when a request needs more


def supports(model) -> bool:
    """Whether this runtime computes exactly what the transformers module computes for ``model``."""
    config = model.config
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return (
        getattr(config, "model_type", None) == "llama"
        and rope.get("rope_type", "default") == "default"
        and not getattr(config, "attention_bias", False)
        and not getattr(config, "mlp_bias", False)
        and getattr(config, "hidden_act", "silu") == "silu"
        and getattr(config, "pretraining_tp", 1) == 1
    )


@dataclass
class _Layer:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    out: torch.Tensor  # [hidden, heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


class LlamaRuntime:
    """The CausalLM protocol for llama models: KV cache over one sequence, extended and rolled back."""

    def __init__(self, model) -> None:
        if not supports(model):
            raise ValueError("LlamaRuntime supports llama models with default RoPE and no biases")
        config = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.max_length = config.max_position_embeddings
        self.embed = model.get_input_embeddings().weight  # [vocab, hidden]
        self.lm_head = model.get_output_embeddings().weight  # [vocab, hidden]
        self.vocab_size = self.lm_head.shape[0]
        self.final_norm = model.model.norm.weight
        self.layers = [_fuse(layer) for layer in model.model.layers]
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, device=self.device).float() / self.head_dim))
        self.tokens: list[int] = []
        self._keys: list[torch.Tensor] = []  # per layer [kv_heads, capacity, head_dim]
        self._values: list[torch.Tensor] = []
        self._capacity = 0

    def rollback(self, length: int) -> None:
        del self.tokens[length:]  # positions past the length are overwritten by the next extend

    @torch.inference_mode()
    def extend(self, token_ids: list[int], num_logits: int) -> torch.Tensor:  # [num_logits, vocab]
        if not token_ids:
            return torch.empty(0, self.vocab_size, device=self.device)
        start, n = len(self.tokens), len(token_ids)
        self._ensure_capacity(start + n)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)  # [n]
        cos, sin = self._rope(start, n)  # [n, head_dim] each
        mask = _causal_mask(start, n, self.device)  # [n, start+n] or None
        x = self.embed[ids]  # [n, hidden]
        for layer, keys, values in zip(self.layers, self._keys, self._values):
            x = x + self._attention(layer, _rms_norm(x, layer.input_norm, self.eps), keys, values, start, cos, sin,
                                    mask)
            gate, up = (_rms_norm(x, layer.post_norm, self.eps) @ layer.gate_up.T).chunk(2, dim=-1)  # [n, inter]
            x = x + (F.silu(gate) * up) @ layer.down.T
        self.tokens += token_ids
        if num_logits == 0:
            return torch.empty(0, self.vocab_size, device=self.device)
        return _rms_norm(x[n - num_logits :], self.final_norm, self.eps) @ self.lm_head.T  # [num_logits, vocab]

    def _attention(self, layer: _Layer, h: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                   cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:  # [n, hidden]
        n = h.shape[0]
        q, k, v = (h @ layer.qkv.T).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1
        )
        q = _apply_rope(q.view(n, self.heads, self.head_dim), cos, sin).transpose(0, 1)  # [heads, n, hd]
        k = _apply_rope(k.view(n, self.kv_heads, self.head_dim), cos, sin).transpose(0, 1)  # [kv_heads, n, hd]
        keys[:, start : start + n] = k
        values[:, start : start + n] = v.view(n, self.kv_heads, self.head_dim).transpose(0, 1)
        attended = F.scaled_dot_product_attention(
            q[None], keys[None, :, : start + n], values[None, :, : start + n], attn_mask=mask,
            enable_gqa=self.heads != self.kv_heads,
        )  # [1, heads, n, hd]
        return attended[0].transpose(0, 1).reshape(n, self.heads * self.head_dim) @ layer.out.T

    def _rope(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(start, start + n, device=self.device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq[None]  # [n, head_dim / 2]
        angles = torch.cat([freqs, freqs], dim=-1)  # [n, head_dim]
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)

    def _ensure_capacity(self, needed: int) -> None:
        if needed <= self._capacity:
            return
        capacity = max(INITIAL_CAPACITY, self._capacity)
        while capacity < needed:
            capacity *= 2
        capacity = min(capacity, self.max_length)
        shape = (self.kv_heads, capacity, self.head_dim)
        used = len(self.tokens)
        for buffers in (self._keys, self._values):
            for i in range(len(self.layers)):
                grown = torch.empty(shape, dtype=self.dtype, device=self.device)
                if i < len(buffers):
                    grown[:, :used] = buffers[i][:, :used]
                    buffers[i] = grown
                else:
                    buffers.append(grown)
        self._capacity = capacity


def _fuse(layer) -> _Layer:
    attention, mlp = layer.self_attn, layer.mlp
    return _Layer(
        input_norm=layer.input_layernorm.weight,
        qkv=torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]).contiguous(),
        out=attention.o_proj.weight,
        post_norm=layer.post_attention_layernorm.weight,
        gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).contiguous(),
        down=mlp.down_proj.weight,
    )


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers' LlamaRMSNorm: normalise in float32, scale in the input's dtype."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # x [n, heads, hd]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def _causal_mask(start: int, n: int, device: torch.device) -> torch.Tensor | None:
    """[n, start+n] True where query i (position start+i) may attend key j; None for one query (sees all)."""
    if n == 1:
        return None
    keys = torch.arange(start + n, device=device)
    return keys[None, :] <= (start + torch.arange(n, device=device))[:, None]
