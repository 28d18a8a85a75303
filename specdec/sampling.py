"""Sampling settings, and the one transform from logits to the distributions the verifier compares.

Exactness needs draft and target logits to pass through the same transform: every caller that turns logits
into probabilities goes through :func:`logits_to_probs`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from specdec.choices import check_sampling


@dataclass(frozen=True)
class SamplingParams:
    """How logits become a distribution over the next token.

    temperature == 0 means greedy decoding (argmax); top_k == 0 and top_p == 1 mean "no truncation".
    The order is that of transformers: temperature, then top-k, then top-p.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class LogitsAdjustment:
    """OpenAI's logit_bias and presence and frequency penalties, applied to the target's logits at each position
    before anything else: the distribution every emitted token is drawn from is the adjusted one.

    The penalties count the tokens generated before the position (not the prompt's), as vLLM does: a token seen
    c > 0 times loses ``frequency_penalty * c + presence_penalty``.
    """

    bias: dict[int, float] = field(default_factory=dict)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def active(self) -> bool:
        return bool(self.bias) or self.penalises

    @property
    def penalises(self) -> bool:
        """Whether the penalties need the counts of the tokens generated (``apply``'s ``counts``)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @functools.cached_property
    def _bias(self) -> tuple[torch.Tensor, torch.Tensor]:  # ids [m], values [m]: built once
        return torch.tensor(list(self.bias)), torch.tensor(list(self.bias.values()), dtype=torch.float64)

    def apply(self, logits: torch.Tensor, counts: torch.Tensor | None, draft: list[int]) -> torch.Tensor:
        """logits [k+1, vocab] at the position after the tokens generated so far (how often each was: ``counts``
        [vocab], which the caller keeps; None without penalties) and after each prefix of ``draft`` (row j follows
        draft[:j]) -> the adjusted logits (a new tensor)."""
        logits = logits.clone()
        if self.bias:
            ids, values = self._bias
            logits[:, ids.to(logits.device)] += values.to(logits.device, logits.dtype)
        if self.penalises:
            rows = counts.to(logits.dtype).expand(logits.shape[0], -1).clone()  # [k+1, vocab]
            for j, token in enumerate(draft[: logits.shape[0] - 1], start=1):
                rows[j:, token] += 1
            logits -= self.frequency_penalty * rows + self.presence_penalty * (rows > 0).to(logits.dtype)
        return logits


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits [..., vocab] into the sampling distribution [..., vocab] (float32 or wider).

    Greedy settings give a point mass on the argmax, so that greedy decoding is the zero-temperature case of
    the same rejection test.
    """
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    # shifted first, so that the largest logit is 0 however small the temperature (kept 0 where the temperature
    # underflows the dtype: not 0/0): the others then go to -inf at worst, never NaN
    shifted = logits - logits.amax(-1, keepdim=True)
    scaled = torch.where(shifted == 0, shifted, shifted / params.temperature)
    scaled = _mask_top_k(scaled, params.top_k)
    scaled = _mask_top_p(scaled, params.top_p)
    return torch.softmax(scaled, dim=-1)


def _mask_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the top_k largest logits of each row (ties at the threshold are kept); 0 keeps all."""
    if top_k == 0 or top_k >= logits.shape[-1]:
        return logits
    threshold = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [..., 1]
    return logits.masked_fill(logits < threshold, float("-inf"))


def _mask_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p (at least one token)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [..., vocab]
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
    # drop a token when the tokens ranked above it already reach top_p
    drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from a distribution [vocab]."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


# --- what drafters draw with: the same transform, so that draft and target compare ----------------------------


def draft_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
                ) -> tuple[int, torch.Tensor | None]:  # logits [vocab]
    """One draft token from a drafter's logits: the argmax when greedy (a point mass: no distribution kept), else
    a draw from the logits through the same transform the target's go through, with that distribution."""
    if params.greedy:
        return int(logits.argmax()), None
    probs = logits_to_probs(logits, params)  # [vocab]
    return sample(probs, generator), probs


def ranked(logits: torch.Tensor, count: int, exclude: int) -> list[int]:  # logits [vocab]
    """The ``count`` ids a drafter ranks highest, ``exclude`` left out: a draft tree's alternatives."""
    top = torch.topk(logits, min(count + 1, logits.shape[-1])).indices.tolist()
    return [token for token in top if token != exclude][:count]
