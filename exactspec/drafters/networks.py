"""The trained drafters' networks. Each reads frozen pieces of its target (input embedding, LM head) that are not
saved with it, and predicts over a draft vocabulary: the target's most frequent output tokens, a slice of the
target's LM head (``DraftVocab``), which cuts the cost of a drafting step several times over.

- ``DraftLM`` (draft-model): a small causal LM over the target's embeddings: a few llama layers, a final norm and
  the target's LM head.
- ``MTPHeads`` (mtp, Medusa-style): head j maps the target's last hidden state at position t to the distribution
  of the token j+1 positions ahead (t + j + 1): one target pass gives the next token and a draft after it. With
  ``token_input`` (Hydra-style, what ``exactspec train`` makes) the heads also read the embedding of token t+1, the
  token that pass chose, which the engine knows before it drafts; published Medusa heads read the feature alone.
- ``EagleHead`` (eagle, EAGLE-style): one decoder layer over [embedding of token t+1; target feature at t] that
  predicts the target's feature at t+1, read by the target's LM head; drafting feeds its own predictions back.
- ``ExitAdapter`` (early-exit, Kangaroo-style self-speculation): maps the target's residual stream after its first
  ``exit_layer`` layers to what its final norm hands the LM head. The target's shallow layers draft (the lean
  runtime runs them, and keeps their KV cache for the verifying pass); the adapter stands in for the rest.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from exactspec.choices import TRAINED_METHODS
from exactspec.drafters.layers import MLP, DecoderLayer, KVCache, LayerShape, RMSNorm, rope_tables
from exactspec.sampling import draft_token, ranked

METHODS = TRAINED_METHODS  # draft-model, mtp, eagle, early-exit


@dataclass
class DrafterConfig:
    """What a drafter is: its method, sizes, and the target it was trained for (saved as drafter.json)."""

    method: str
    shape: LayerShape
    vocab_size: int  # the target's
    layers: int = 1  # decoder layers (draft-model, eagle); residual MLP blocks (early-exit)
    heads: int = 4  # prediction heads (mtp)
    head_layers: int = 1  # residual blocks per head (mtp)
    draft_vocab: int = 0  # ids the drafter predicts over (0: the whole vocabulary)
    own_lm_head: bool = False  # published Medusa heads carry their own LM head
    token_input: bool = False  # mtp: the heads also read the embedding of the token after the feature
    exit_layer: int = 0  # early-exit: the target's layers that draft
    target: dict = field(default_factory=dict)  # {"name": ..., "fingerprint": ..., "probe": [weights]}
    training: dict = field(default_factory=dict)  # how it was made: command, data slice, seed, tokens, results

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> DrafterConfig:
        data = dict(data)
        data["shape"] = LayerShape(**data["shape"])
        return cls(**data)


class DraftVocab(nn.Module):
    """The ids a drafter predicts over and the target's LM-head rows for them; logits widen to the target's
    vocabulary with -inf (probability 0) elsewhere."""

    def __init__(self, ids: torch.Tensor | None, vocab_size: int) -> None:  # ids [V'] or None (all)
        super().__init__()
        self.vocab_size = vocab_size
        self.register_buffer("ids", ids if ids is not None else torch.arange(vocab_size), persistent=True)
        self.head: torch.Tensor | None = None  # [V', hidden]: set by attach()

    def attach(self, lm_head: torch.Tensor) -> None:  # [vocab, hidden], the target's
        self.head = lm_head.detach()[self.ids].float()
        self.project = lambda hidden: hidden @ self.head.T  # [n, hidden] -> [n, V']

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., V']
        flat = hidden.float().reshape(-1, hidden.shape[-1])
        return self.project(flat).reshape(*hidden.shape[:-1], -1)

    def widen(self, logits: torch.Tensor) -> torch.Tensor:  # [..., V'] -> [..., vocab]
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.ids] = logits
        return full

    def draft_token(self, logits: torch.Tensor, params, generator: torch.Generator | None, position: int
                    ) -> tuple[int, torch.Tensor | None]:  # logits [V']
        """``sampling.draft_token`` over the draft vocabulary: greedy picks among its V' logits directly;
        sampling draws from them widened to the target's vocabulary (q = 0 off the draft vocabulary)."""
        if params.greedy:
            return int(self.ids[logits.argmax()]), None
        return draft_token(self.widen(logits), params, generator, position)

    def ranked(self, logits: torch.Tensor, count: int, exclude: int) -> list[int]:  # logits [V']
        """``sampling.ranked`` over the draft vocabulary, as the target's ids."""
        return [token for token in self.ids[ranked(logits, count + 1, -1)].tolist() if token != exclude][:count]


class TargetParts:
    """The frozen pieces of the target a drafter reads: input embedding and LM head (one matrix when tied), and
    the final norm's weight, which an early exit starts from."""

    def __init__(self, embed: torch.Tensor, lm_head: torch.Tensor, final_norm: torch.Tensor | None = None
                 ) -> None:  # [vocab, hidden] each; [hidden]
        self.embed = embed.detach().float()
        self.lm_head = self.embed if lm_head.data_ptr() == embed.data_ptr() else lm_head.detach().float()
        self.final_norm = None if final_norm is None else final_norm.detach().float()

    @classmethod
    def of(cls, model) -> TargetParts:
        norm = getattr(getattr(model, "model", None), "norm", None)
        return cls(model.get_input_embeddings().weight, model.get_output_embeddings().weight,
                   None if norm is None else norm.weight)


class OnTarget(nn.Module):
    """A drafter network that reads the frozen target's input embedding and drafts over its LM head's rows
    (``self.vocab``, a DraftVocab): ``attach`` points it at a target's parts, as loading does."""

    vocab: DraftVocab

    def attach(self, target: TargetParts) -> None:
        self.embed = target.embed
        self.vocab.attach(target.lm_head)


def _run_layers(layers: nn.ModuleList, shape: LayerShape, x: torch.Tensor, cache: KVCache | None, start: int
                ) -> torch.Tensor:  # [B, T, hidden] at positions start..
    positions = torch.arange(start, start + x.shape[1], device=x.device)
    cos, sin = rope_tables(positions, shape.head_dim, shape.rope_theta)
    for index, layer in enumerate(layers):
        x = layer(x, cos, sin, cache, index, start)
    if cache is not None:
        cache.length = start + x.shape[1]
    return x


class DraftLM(OnTarget):
    def __init__(self, config: DrafterConfig, target: TargetParts, vocab_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DecoderLayer(config.shape) for _ in range(config.layers))
        self.norm = RMSNorm(config.shape.hidden, config.shape.eps)
        self.vocab = DraftVocab(vocab_ids, config.vocab_size)
        self.attach(target)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, start: int = 0
                ) -> torch.Tensor:  # tokens [B, T] -> normed hidden [B, T, hidden]
        x = _run_layers(self.layers, self.config.shape, self.embed[tokens], cache, start)
        return self.norm(x)


class ResBlock(nn.Module):
    """x + SiLU(Wx + b), starting as the identity (W = 0): a head starts by predicting what the target predicts."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MTPHeads(OnTarget):
    def __init__(self, config: DrafterConfig, target: TargetParts, vocab_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = config
        hidden = config.shape.hidden

        def head() -> nn.Sequential:
            blocks = [ResBlock(hidden) for _ in range(config.head_layers)]
            if config.own_lm_head:
                blocks.append(nn.Linear(hidden, config.vocab_size, bias=False))
            return nn.Sequential(*blocks)

        if config.token_input:  # [embedding; feature] -> hidden, starting as the feature alone
            self.fc = nn.Linear(2 * hidden, hidden, bias=True)
            with torch.no_grad():
                self.fc.weight.zero_()
                self.fc.weight[:, hidden:].copy_(torch.eye(hidden))
                self.fc.bias.zero_()
        self.heads = nn.ModuleList(head() for _ in range(config.heads))
        self.vocab = DraftVocab(vocab_ids, config.vocab_size)
        self.attach(target)

    def forward(self, features: torch.Tensor, next_tokens: torch.Tensor | None = None, count: int | None = None
                ) -> torch.Tensor:
        """The first ``count`` heads' (all by default) draft-vocabulary logits: features [..., hidden] and the
        tokens after them [...] -> [count, ..., V']."""
        states = self.head_states(features, next_tokens, count)
        if self.config.own_lm_head:  # the heads' own LM heads gave full-vocabulary logits
            return states[..., self.vocab.ids]
        return self.vocab.logits(states)  # one pass over the target's LM head for all heads

    def head_states(self, features: torch.Tensor, next_tokens: torch.Tensor | None = None,
                    count: int | None = None) -> torch.Tensor:
        """What each head hands the target's LM head: [..., hidden], [...] -> [count, ..., hidden] (heads with an
        LM head of their own: their logits, [count, ..., vocab])."""
        heads = self.heads[:count] if count is not None else self.heads
        x = self._input(features, next_tokens)
        return torch.stack([head(x) for head in heads])

    def _input(self, features: torch.Tensor, next_tokens: torch.Tensor | None) -> torch.Tensor:
        if not self.config.token_input:
            return features.float()
        if next_tokens is None:
            raise ValueError("these mtp heads read the token after each feature: pass next_tokens")
        return self.fc(torch.cat([self.embed[next_tokens], features.float()], dim=-1))


class EagleHead(OnTarget):
    def __init__(self, config: DrafterConfig, target: TargetParts, vocab_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = config
        hidden = config.shape.hidden
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.layers = nn.ModuleList(DecoderLayer(config.shape, input_norm=i > 0) for i in range(config.layers))
        self.vocab = DraftVocab(vocab_ids, config.vocab_size)
        self.attach(target)

    def forward(self, features: torch.Tensor, next_tokens: torch.Tensor, cache: KVCache | None = None,
                start: int = 0) -> torch.Tensor:
        """features [B, T, hidden] at positions start.., and the tokens that follow each [B, T] -> the predicted
        features [B, T, hidden] of the positions after."""
        x = self.fc(torch.cat([self.embed[next_tokens], features.float()], dim=-1))
        return _run_layers(self.layers, self.config.shape, x, cache, start)


class ExitBlock(nn.Module):
    """x + MLP(norm(x)), starting as the identity (the MLP's output projection is zero)."""

    def __init__(self, shape: LayerShape) -> None:
        super().__init__()
        self.norm = RMSNorm(shape.hidden, shape.eps)
        self.mlp = MLP(shape)
        nn.init.zeros_(self.mlp.down_proj.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class ExitAdapter(nn.Module):
    """Residual MLP blocks and a final norm over the target's hidden state after its first ``exit_layer`` layers:
    [..., hidden] -> [..., hidden], normed as the target's LM head reads it. Untrained (blocks the identity, the
    norm the target's own), it is the plain early exit: the target's final norm and LM head on a shallow layer."""

    def __init__(self, config: DrafterConfig, target: TargetParts, vocab_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        if config.exit_layer < 1:
            raise ValueError(f"an early exit needs exit_layer >= 1, got {config.exit_layer}")
        self.config = config
        self.blocks = nn.ModuleList(ExitBlock(config.shape) for _ in range(config.layers))
        self.norm = RMSNorm(config.shape.hidden, config.shape.eps)
        if target.final_norm is not None:
            with torch.no_grad():
                self.norm.weight.copy_(target.final_norm)
        self.vocab = DraftVocab(vocab_ids, config.vocab_size)
        self.attach(target)

    def attach(self, target: TargetParts) -> None:
        self.vocab.attach(target.lm_head)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        x = states.float()
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


NETWORKS = {"draft-model": DraftLM, "mtp": MTPHeads, "eagle": EagleHead, "early-exit": ExitAdapter}


class _Packed(nn.Module):
    """A linear layer through a fast inference kernel (``make_linear``): [..., in] -> [..., out]."""

    def __init__(self, linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)


def prepare_for_drafting(network: nn.Module) -> nn.Module:
    """Make a loaded network fast to draft with, in place: on the CPU its matmuls (the draft-vocabulary head
    included) run with half-precision weights through fbgemm, as the target's decode passes do. Drafting streams
    the weights once per step, so halving their bytes nearly halves a step. The network can no longer be trained
    or saved."""
    from exactspec.backends.linear import has_fbgemm, make_linear

    if network.vocab.ids.device.type != "cpu" or not has_fbgemm():
        return network
    for module in list(network.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                bias = None if child.bias is None else child.bias.detach()
                setattr(module, name, _Packed(make_linear(child.weight.detach(), bias, "float16")))
    network.vocab.project = make_linear(network.vocab.head, None, "float16")
    return network
