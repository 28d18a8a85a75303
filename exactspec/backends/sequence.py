"""One sequence's KV cache over a llama-family model (llama, mistral, qwen2), shared below the runtimes' wings.

:class:`LlamaSequence` holds what every llama-family runtime does alike: a KV cache preallocated to the request and
written by position (rollback is only a length; no tensor grows per step), RoPE tables computed once, token trees,
self-speculation's shallow passes and the final hidden states. How a pass's rows go through the layers, and which LM
head reads them, each runtime declares (:meth:`LlamaSequence.run_layers`, :meth:`LlamaSequence.head_for`): the lean
runtime in PyTorch (``lean/``), the fused runtime in one call into the C kernels (``fused/``). Both may run PyTorch's
layers over this cache (:meth:`LlamaSequence.torch_layers`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from exactspec.backends import native
from exactspec.backends.base import FeatureSource, PromptPasses, ShallowRunner, TreeScorer
from exactspec.backends.family import (
    KeysRead,
    Layer,
    LlamaSpec,
    added,
    attention_bias,
    blocked_attention,
    blocked_mask,
    causal_mask,
    mlp,
    project_qkv,
    rms_norm,
    tree_reading,
    whole_blocks,
)
from exactspec.backends.linear import Linear

INITIAL_CAPACITY = 256  # cache positions allocated when nothing was reserved; doubled when a request needs more


class LlamaSequence(TreeScorer, FeatureSource, ShallowRunner, PromptPasses):
    """The CausalLM protocol's cache for llama-family models, extended and rolled back; the runtime built on it
    computes the rows (:meth:`run_layers`, :meth:`head_for`) and says how many positions a chain pass needs to run
    as a prompt's (``prompt_positions``)."""

    prompt_positions: int

    def __init__(self, spec: LlamaSpec, dtype: torch.dtype) -> None:
        """The cache's and the embeddings' bookkeeping for the model ``spec`` describes, activations in ``dtype``;
        the runtime built on it holds the layers' weights."""
        self.device = spec.device
        self.dtype = dtype
        self.heads = spec.heads
        self.kv_heads = spec.kv_heads
        self.head_dim = spec.head_dim
        self.eps = spec.eps
        self.max_length = spec.max_length
        self.num_layers = spec.layers
        self.embed = spec.embed.to(self.dtype)  # [vocab, hidden]
        self.vocab_size = self.embed.shape[0]
        self.final_norm = spec.final_norm.to(self.dtype)
        self.architecture = spec.architecture
        self.windows = spec.windows or (0,) * spec.layers
        self.rope_layers = spec.rope_layers or (True,) * spec.layers
        arange = torch.arange(0, self.head_dim, 2, device=self.device).float()
        self.inv_freq = 1.0 / (spec.rope_theta ** (arange / self.head_dim))
        if spec.rope_factors is not None:  # Llama 3's frequencies, each divided by its factor
            self.inv_freq = self.inv_freq / spec.rope_factors.to(self.device).float()
        # the sliding-window layers' own RoPE (gemma 3), or None: theirs is the others'
        self.local_inv_freq = None if spec.local_rope_theta is None else \
            1.0 / (spec.local_rope_theta ** (arange / self.head_dim))
        self.tokens: list[int] = []
        self.prefilled = 0  # the cache's first positions that prompt passes wrote (PromptPasses)
        self._hidden: torch.Tensor | None = None  # [capacity, hidden] once keep_hidden_states() was called
        self._keys: list[torch.Tensor] = []  # per layer [kv_heads, capacity, head_dim]
        self._values: list[torch.Tensor] = []
        self._cos = self._sin = torch.empty(0, self.head_dim, device=self.device)  # [capacity, head_dim]
        self._local_cos = self._local_sin = None  # the local layers' tables, where they have their own
        self._capacity = 0
        self.cache_generation = 0  # counts the cache's reallocations: what points into it must be made again
        self._shallow = _Shallow()  # positions after the cache run through the first layers only (extend_shallow)
        # on the CPU each query's attention is the C kernels', computed as it is alone; elsewhere blocked_attention
        self.row_attention = native.covers_attention(self.head_dim, self.dtype, self.device)

    # --- what each runtime declares ---------------------------------------------------------------------------------

    def run_layers(self, x: torch.Tensor, first: int, end: int, start: int, positions: slice | torch.Tensor,
                   mask: torch.Tensor | None) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        """Layers ``first``..``end-1`` over the hidden states x of the positions after ``start`` (a chain's
        ``positions`` are a slice, a tree's a tensor of RoPE positions; ``mask`` [n, start+n] what each may read,
        None: all), their keys and values written to those layers' cache."""
        raise NotImplementedError

    def head_for(self, positions: int, chain: bool = True) -> Linear:  # [m, hidden] -> [m, vocab]
        """The LM head a pass over ``positions`` new tokens (a chain of them, or a tree) applies to its final
        hidden states, normed."""
        raise NotImplementedError

    def final_normed(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        """The residual stream after the last layer, normed as the LM head reads it (and as hidden states are kept);
        a runtime may norm it with its own kernels, as long as every pass, pool and chain of its own does alike."""
        return rms_norm(x, self.final_norm, self.eps)

    def exit_logits(self, states: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        """The LM head over the residual stream after any layer (an early exit), normed as the last layer's is."""
        return self.logits(self.head_for(states.shape[0]), self.final_normed(states))

    def logits(self, head: Linear, normed: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        """The LM head ``head`` over final hidden states, normed; capped softly where the model caps them."""
        logits = head(normed)
        cap = self.architecture.logit_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap

    def scoring(self, index: int) -> native.Scoring:
        """How layer ``index``'s queries score their keys, and how many they read."""
        return native.Scoring(self.architecture.attention_scale, self.architecture.attention_softcap,
                              self.windows[index])

    def embedded(self, token_ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, hidden]
        """The tokens' embeddings, scaled where the model scales them (gemma)."""
        x = self.embed[token_ids]
        scale = self.architecture.embed_scale
        return x if scale == 1.0 else x * torch.tensor(scale, dtype=x.dtype)

    def local_rope(self, index: int) -> bool:
        """Whether layer ``index`` turns its q and k by the local tables (a sliding layer with RoPE of its own)."""
        return self.local_inv_freq is not None and self.windows[index] > 0

    def layer_rope(self, index: int, tables: tuple[torch.Tensor, torch.Tensor],
                   local: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The cos and sin ([n, head_dim] each) layer ``index`` turns its q and k by, of a pass's ``tables`` and
        ``local`` ones (:meth:`local_rope`); (None, None) for a layer without RoPE (smollm3's NoPE layers)."""
        if not self.rope_layers[index]:
            return None, None
        return local if self.local_rope(index) else tables

    # --- the sequence ------------------------------------------------------------------------------------------------

    def reserve(self, length: int) -> None:
        """Hold at least ``length`` positions (capped at max_length), so that no pass reallocates the cache."""
        self._resize(min(max(length, self._capacity), self.max_length))

    def runs_as_prompt(self, positions: int, chain: bool = True) -> bool:
        """Whether a pass (or a pool row) over ``positions`` new tokens runs as a prompt's: a chain of
        ``prompt_positions`` or more."""
        return chain and positions >= self.prompt_positions

    def rollback(self, length: int) -> None:
        del self.tokens[length:]  # positions past the length are overwritten by the next extend
        self.prefilled = min(self.prefilled, length)
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
        return self._forward(token_ids, num_logits, slice(start, start + n), causal_mask(start, n, self.device))

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
        x = self.run_layers(self._embedded(token_ids), 0, layers, start, slice(start, start + n),
                         causal_mask(start, n, self.device))
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
        positions, mask = slice(start, start + n), causal_mask(start, n, self.device)
        states = [self._embedded(token_ids)]
        for index in range(self.num_layers):
            states.append(self.run_layers(states[-1], index, index + 1, start, positions, mask))
        self.tokens += token_ids
        if self._hidden is not None:
            self._hidden[start : start + n] = self.final_normed(states[-1])
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
        lm_head = self.head_for(n, isinstance(positions, slice))
        reused, shallow = self._reusable_shallow(token_ids, positions), self._shallow
        self._shallow = _Shallow()
        if reused:  # the first positions ran the shared layers while drafting: the rest run them now (a chain)
            x = torch.cat(shallow.states)[:reused]
            if reused < n:
                rest = self.run_layers(self._embedded(token_ids[reused:]), 0, shallow.layers, start + reused,
                                    slice(start + reused, start + n), mask[reused:])
                x = torch.cat([x, rest])
        else:
            x = self._embedded(token_ids)  # [n, hidden]
        x = self.run_layers(x, shallow.layers if reused else 0, self.num_layers, start, positions, mask)
        self.tokens += token_ids
        if start == self.prefilled and not reused and self.runs_as_prompt(n, isinstance(positions, slice)):
            self.prefilled = start + n  # a prompt's pass, right after the positions prompt passes wrote
        if self._hidden is not None:  # every position normed, kept; else only where logits are wanted
            self._hidden[start : start + n] = self.final_normed(x)
        if num_logits == 0:
            return torch.empty(0, self.vocab_size, device=self.device)
        normed = self._hidden[start + n - num_logits : start + n] if self._hidden is not None else \
            self.final_normed(x[n - num_logits :])  # [num_logits, hidden]
        return self.logits(lm_head, normed)  # [num_logits, vocab]

    def torch_layers(self, layers: list[Layer], x: torch.Tensor, first: int, end: int, start: int,
                     positions: slice | torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:  # [n, hidden]
        """:meth:`run_layers` in PyTorch, with ``layers``' weights: each layer's norms, products and attention over
        this cache."""
        tables = self._cos[positions], self._sin[positions]  # [n, head_dim] each
        local = None if self._local_cos is None else (self._local_cos[positions], self._local_sin[positions])
        reading = self._keys_read(mask, start, x.shape[0], isinstance(positions, torch.Tensor))
        for index in range(first, end):
            layer = layers[index]
            cos, sin = self.layer_rope(index, tables, local)
            attended = self._attention(layer, rms_norm(x, layer.input_norm, self.eps), self._keys[index],
                                       self._values[index], start, cos, sin, reading, self.scoring(index))
            x = added(x, attended, layer.attn_out_norm, self.eps)
            x = added(x, mlp(layer, x, self.eps, self.architecture.activation), layer.ffn_out_norm, self.eps)
        return x

    def _keys_read(self, mask: torch.Tensor | None, start: int, n: int, tree: bool) -> KeysRead:
        """What each of a pass's n queries after ``start`` reads of the cache: the causal prefix for a chain; for a
        tree (``mask`` [n, start+n]), the cache and its own ancestors, laid out as its branch lays them out as a
        chain."""
        columns, allowed = tree_reading(mask, start, self.device) if tree else (None, None)
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
        return self.embedded(torch.tensor(token_ids, dtype=torch.long, device=self.device))

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

    def _attention(self, layer: Layer, h: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                   cos: torch.Tensor | None, sin: torch.Tensor | None, reading: KeysRead, scoring: native.Scoring
                   ) -> torch.Tensor:  # [n, hidden]
        """A chain's queries attend to the cache as it lies; a tree's each to its own keys in its branch's chain
        order (``reading``), so that every node computes what its branch computes as a chain."""
        n, heads, hd = h.shape[0], self.heads, self.head_dim
        q, k, v = project_qkv(layer, h, cos, sin, heads, self.kv_heads, hd, self.eps)
        keys[:, start : start + n] = k.transpose(0, 1)
        values[:, start : start + n] = v.transpose(0, 1)
        if reading.rows is not None:  # the C kernels' attention, each query alone
            return layer.out(native.attention(q, keys, values, reading.rows, scoring))
        assert scoring == native.Scoring(), "blocked attention scores as llama does only"
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
        if self.local_inv_freq is not None:
            self._local_cos, self._local_sin = self.rope_tables(capacity, local=True)
        self._capacity = capacity
        self.cache_generation += 1

    def rope_tables(self, length: int, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # [length, hd]
        """cos and sin of the rotary angles at positions 0..length-1 (``local``: the local layers')."""
        positions = torch.arange(length, device=self.device, dtype=torch.float32)
        freqs = positions[:, None] * (self.local_inv_freq if local else self.inv_freq)[None]  # [length, hd / 2]
        angles = torch.cat([freqs, freqs], dim=-1)  # [length, head_dim]
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)


@dataclass
class _Shallow:
    """Tokens after the cache that ran through the first ``layers`` layers only, and the states they left."""

    layers: int = 0
    tokens: list[int] = field(default_factory=list)
    states: list[torch.Tensor] = field(default_factory=list)  # [n, hidden] per extend_shallow call
