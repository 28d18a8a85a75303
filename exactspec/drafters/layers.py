"""A llama decoder layer for drafters, trainable and with a KV cache for drafting.

Parameter names follow transformers' llama (``self_attn.q_proj``, ``mlp.gate_proj``, ...), so that a drafter can
start from a layer of its target and load published checkpoints, which use the same names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LayerShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float = 1e-5
    rope_theta: float = 10000.0

    @classmethod
    def of(cls, config) -> LayerShape:
        """The shape of a transformers llama-family config's layers."""
        heads = config.num_attention_heads
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        return cls(
            hidden=config.hidden_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate=config.intermediate_size,
            eps=getattr(config, "rms_norm_eps", 1e-5),
            rope_theta=rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)),
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


class KVCache:
    """Keys and values of one sequence for each layer, preallocated and written by position; rollback is a length."""

    def __init__(self, layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * layers  # [kv_heads, capacity, head_dim]
        self.values: list[torch.Tensor | None] = [None] * layers
        self.length = 0

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:  # k, v [kv_heads, n, hd] -> cached [kv_heads, start+n, hd]
        end = start + k.shape[1]
        if self.keys[layer] is None or self.keys[layer].shape[1] < end:
            self._grow(layer, end, k)
        self.keys[layer][:, start:end] = k
        self.values[layer][:, start:end] = v
        return self.keys[layer][:, :end], self.values[layer][:, :end]

    def _grow(self, layer: int, needed: int, like: torch.Tensor) -> None:
        capacity = 256
        while capacity < needed:
            capacity *= 2
        for buffers in (self.keys, self.values):
            grown = like.new_empty(like.shape[0], capacity, like.shape[2])
            if buffers[layer] is not None:
                grown[:, : buffers[layer].shape[1]] = buffers[layer]
            buffers[layer] = grown


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [n, head_dim] of the rotary angles at ``positions`` [n]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None]
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # x [B, heads, T, hd]
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, shape: LayerShape, bias: bool = False) -> None:
        super().__init__()
        self.shape = shape
        hd = shape.head_dim
        self.q_proj = nn.Linear(shape.hidden, shape.heads * hd, bias=bias)
        self.k_proj = nn.Linear(shape.hidden, shape.kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(shape.hidden, shape.kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(shape.heads * hd, shape.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None,
                index: int = 0, start: int = 0) -> torch.Tensor:  # x [B, T, hidden]
        """Causal self-attention over x; with a cache (B = 1), x sits at positions start.. after the cached ones."""
        s = self.shape
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, s.heads, s.head_dim).transpose(1, 2)  # [B, heads, T, hd]
        k = self.k_proj(x).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)  # [B, kv_heads, T, hd]
        v = self.v_proj(x).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        mask, causal = None, True
        if cache is not None:
            keys, values = cache.write(index, start, k[0], v[0])
            k, v = keys[None], values[None]
            causal = False
            if t > 1:
                seen, asking = torch.arange(start + t, device=x.device), start + torch.arange(t, device=x.device)
                mask = seen[None] <= asking[:, None]  # key j is visible to query i
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and t > 1,
                                             enable_gqa=s.heads != s.kv_heads)  # [B, heads, T, hd]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, s.heads * s.head_dim))


class MLP(nn.Module):
    def __init__(self, shape: LayerShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden, shape.intermediate, bias=False)
        self.up_proj = nn.Linear(shape.hidden, shape.intermediate, bias=False)
        self.down_proj = nn.Linear(shape.intermediate, shape.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks. ``input_norm=False`` drops the attention block's norm, as EAGLE's first
    layer does (its input is already a projection of normed features)."""

    def __init__(self, shape: LayerShape, input_norm: bool = True, attention_bias: bool = False) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden, shape.eps) if input_norm else None
        self.self_attn = Attention(shape, attention_bias)
        self.post_attention_layernorm = RMSNorm(shape.hidden, shape.eps)
        self.mlp = MLP(shape)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None,
                index: int = 0, start: int = 0) -> torch.Tensor:
        h = self.input_layernorm(x) if self.input_layernorm is not None else x
        x = x + self.self_attn(h, cos, sin, cache, index, start)
        return x + self.mlp(self.post_attention_layernorm(x))
