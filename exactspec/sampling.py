"""Sampling settings, the one transform from logits to the distributions the verifier compares, and the Gumbel noise
of the drafter-invariant sampler.

Exactness needs draft and target logits to pass through the same transform: every caller that turns logits
into probabilities goes through :func:`logits_to_probs` (or :func:`scaled_logits`, its logarithm up to a constant).

Two ways to sample (``SamplingParams.method``):

- ``invariant`` (Daliri, Musco and Suresh, "Coupling without communication and drafter-invariant speculative
  decoding"): the token at absolute position t is argmax(scaled logits + G), with G [vocab] Gumbel noise keyed by
  (seed, t) alone. The Gumbel-max trick makes it an exact draw from the distribution; drafter and target use the
  same noise, a draft token is accepted when it equals the target's own choice, and otherwise the target's choice is
  emitted. So the same seed gives the same tokens with any drafter, any k, any tree, or none.
- ``standard``: the rejection rule min(1, p/q) and its residual (:mod:`exactspec.verify`), with draws from one
  seeded generator per sequence: exact too, but which tokens a seed gives depends on the drafts.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from exactspec.choices import DEFAULT_SAMPLING_METHOD, check_sampling, check_sampling_method


@dataclass(frozen=True)
class SamplingParams:
    """How logits become a distribution over the next token.

    temperature == 0 means greedy decoding (argmax); top_k == 0 and top_p == 1 mean "no truncation".
    The order is that of transformers: temperature, then top-k, then top-p. ``method`` is how draws are made
    (the module's docstring): ``invariant`` or ``standard``; greedy decoding is the same under both.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    method: str = DEFAULT_SAMPLING_METHOD

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p)
        check_sampling_method(self.method)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def invariant(self) -> bool:
        """Whether tokens are Gumbel-max choices under noise keyed by (seed, position): see the module docstring."""
        return self.method == "invariant" and not self.greedy


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

    def apply(self, logits: torch.Tensor, counts: torch.Tensor | None, draft: list[int],
              parents: list[int] | None = None) -> torch.Tensor:
        """logits [n+1, vocab] at the position after the tokens generated so far (how often each was: ``counts``
        [vocab], which the caller keeps; None without penalties) and after each draft node (row j follows draft
        node j-1 and the nodes before it: a chain's draft[:j], a tree's path to it, ``parents``) -> the adjusted
        logits (a new tensor)."""
        logits = logits.clone()
        if self.bias:
            ids, values = self._bias
            logits[:, ids.to(logits.device)] += values.to(logits.device, logits.dtype)
        if self.penalises:
            rows = counts.to(logits.dtype).expand(logits.shape[0], -1).clone()  # [n+1, vocab]
            parents = range(-1, len(draft) - 1) if parents is None else parents  # a chain: each node's is the last
            for node, (token, parent) in enumerate(zip(draft[: logits.shape[0] - 1], parents)):
                rows[node + 1] = rows[parent + 1]  # the row after a node counts what its parent's row does, and it
                rows[node + 1, token] += 1
            logits -= self.frequency_penalty * rows + self.presence_penalty * (rows > 0).to(logits.dtype)
        return logits


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits [..., vocab] into the sampling distribution [..., vocab] (float32 or wider).

    Greedy settings give a point mass on the argmax, so that greedy decoding is the zero-temperature case of
    the same rejection test.
    """
    logits = _widened(logits)
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.softmax(scaled_logits(logits, params), dim=-1)


def _widened(logits: torch.Tensor) -> torch.Tensor:
    """Half-precision logits in float32; others as they are."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def scaled_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [..., vocab] -> the sampling distribution's logarithm [..., vocab], up to a constant per row: divided
    by the temperature, -inf outside top-k and top-p (a sampling temperature: not greedy)."""
    # shifted first, so that the largest logit is 0 however small the temperature (kept 0 where the temperature
    # underflows the dtype: not 0/0): the others then go to -inf at worst, never NaN
    shifted = logits - logits.amax(-1, keepdim=True)
    scaled = torch.where(shifted == 0, shifted, shifted / params.temperature)
    top_k = params.top_k if params.top_k < logits.shape[-1] else 0
    if not top_k and params.top_p >= 1.0:
        return scaled
    rows = scaled.reshape(-1, scaled.shape[-1])
    least = torch.stack([_least_kept(row, top_k, params.top_p) for row in rows]).reshape(*scaled.shape[:-1], 1)
    return scaled.masked_fill(scaled < least, float("-inf"))


TOP_P_FIRST = 64  # the most likely tokens top-p's cut is first looked for among (4x more each time it is not)


def _least_kept(row: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:  # row [vocab] -> a scalar of its dtype
    """The smallest logit that top-k (0: none), then top-p (1: none), keep in ``row``; tokens tied with it are kept
    too. Top-k keeps the k largest. Top-p, over what top-k kept, ranks them by logit and drops a token once those
    ranked above it reach ``top_p`` of the probability (in float64). Its cut is looked for among the row's top k, or
    without top-k its top 64, 256, ... tokens, not by sorting the whole vocabulary: a row's probability is nearly
    always in a few dozen tokens, and a sort of Qwen's 151,936 logits cost more than the model's step."""
    vocab = row.shape[-1]
    values = torch.topk(row, top_k or min(TOP_P_FIRST, vocab)).values  # descending
    if top_p >= 1.0:
        return values[-1]
    candidates = row[row >= values[-1]] if top_k else row  # top-k's ties are kept, and weigh in top-p's sum
    total = torch.exp((candidates - values[0]).double()).sum()
    while True:
        probs = torch.exp((values - values[0]).double()) / total
        kept = int(((torch.cumsum(probs, 0) - probs) < top_p).sum())  # a prefix: the mass above each rank grows
        if kept < len(values) or top_k or len(values) == vocab:
            return values[kept - 1]
        values = torch.topk(row, min(4 * len(values), vocab)).values


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from a distribution [vocab]."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


# --- the invariant sampler: Gumbel-max under noise keyed by (seed, position) -----------------------------------


def gumbel_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:  # [vocab] float64
    """Standard Gumbel noise for the token at absolute ``position`` of a sequence seeded with ``seed``: a function of
    the two alone, the same on every machine and device (Philox keyed by the 128-bit pair, on the CPU)."""
    return _gumbel(_uniforms(seed, position, vocab_size))


def gumbel_noise_at(seed: int, position: int, ids: torch.Tensor) -> torch.Tensor:  # [len(ids)] float64
    """``gumbel_noise(seed, position, vocab)[ids]``, the logarithms taken for those ids alone (the same values)."""
    ids = ids.long().cpu().numpy()
    return _gumbel(_uniforms(seed, position, int(ids.max()) + 1)[ids])


def _uniforms(seed: int, position: int, count: int) -> np.ndarray:  # [count] float64 in [0, 1), 53 bits
    """The first ``count`` uniforms of the stream keyed by (seed, position): token i's noise comes from the i-th."""
    key = (seed % (1 << 64)) | (position << 64)
    return np.random.Generator(np.random.Philox(key=key)).random(count)


def _gumbel(uniforms: np.ndarray) -> torch.Tensor:  # float64, elementwise: a value's bits do not depend on the rest
    return -torch.from_numpy(uniforms).log_().neg_().log_()  # -log(-log u); u = 0 gives -inf: never chosen


def gumbel_choice(scaled: torch.Tensor, seed: int, position: int) -> int:  # scaled [vocab]
    """argmax(scaled + Gumbel noise at ``position``): an exact draw from softmax(scaled), the noise added in float64.
    The noise's logarithms are taken for the tokens that can win alone (``_contenders``): the same choice."""
    scaled = scaled.cpu()
    uniforms = _uniforms(seed, position, scaled.shape[-1])
    ids = _contenders(scaled, uniforms)
    return int(ids[(scaled[ids].double() + _gumbel(uniforms[ids.numpy()])).argmax()])


CONTENDERS_FIRST = 64  # the tokens of largest logit whose noise is always made


def _contenders(scaled: torch.Tensor, uniforms: np.ndarray) -> torch.Tensor:  # ascending ids
    """The tokens that can hold argmax(scaled + G), G = -log(-log u) of each token's uniform: the 64 of largest
    logit, and each other whose uniform could lift it above the best of those. Another's logit is at most the
    64th's, s, so it wins only where its G > best - s, that is u > exp(-exp(-(best - s))). The bound is taken a
    little low (by 1e-9 of the logits' scale in G, 4e-16 in u: far beyond the sums' rounding), so that rounding never
    leaves the winner out. A few tokens pass it where the 64 hold most of the probability; most, where the
    distribution is flat."""
    top = torch.topk(scaled, min(CONTENDERS_FIRST, scaled.shape[-1]))
    floor = float(top.values[-1])
    if floor == float("-inf"):  # fewer tokens left by top-k, top-p or a grammar: the others can never win
        return torch.sort(top.indices).values
    gap = float((top.values.double() + _gumbel(uniforms[top.indices.numpy()])).max()) - floor
    gap -= 1e-9 * (1.0 + abs(floor))
    bound = math.exp(-math.exp(-gap)) - 4e-16 if gap > -700.0 else 0.0  # (exp(700) is near float64's largest)
    others = torch.from_numpy(np.flatnonzero(uniforms > bound))
    return torch.unique(torch.cat([top.indices, others]))  # sorted: a tie goes to the lowest id, as argmax's does


def invariant_choice(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:  # [vocab]
    """The token at ``position`` under the invariant sampler: an exact draw from ``logits_to_probs(logits,
    params)``, by the same transform."""
    return gumbel_choice(scaled_logits(_widened(logits), params), seed, position)


def noise_seed(generator: torch.Generator) -> int:
    """The seed a sequence's invariant noise is keyed by: the seed its generator was seeded with (``make_generator``
    seeds it from the request's seed, or at random)."""
    return generator.initial_seed()


class TargetChoices:
    """The target's own token after each row of ``logits`` [n, vocab]: its argmax when greedy, else its invariant
    choice at ``positions[row]`` (the invariant sampler only), each computed from its row alone when first read:
    a verifier reads the rows only as far as the first draft token that is not the target's choice."""

    def __init__(self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
                 positions: list[int]) -> None:
        self._argmax = logits.argmax(-1).tolist() if params.greedy else None
        self._logits, self._params, self._positions = logits, params, positions
        self._seed = None if params.greedy else noise_seed(generator)
        self._chosen: dict[int, int] = {}

    def __getitem__(self, row: int) -> int:
        if self._argmax is not None:
            return self._argmax[row]
        if row not in self._chosen:
            self._chosen[row] = invariant_choice(self._logits[row], self._params, self._seed, self._positions[row])
        return self._chosen[row]


# --- what drafters draw with: the same transform, so that draft and target compare ----------------------------


def draft_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, position: int
                ) -> tuple[int, torch.Tensor | None]:  # logits [vocab]
    """One draft token from a drafter's logits for absolute ``position``: the argmax when greedy, the invariant
    choice under the same noise the target will use (both point masses: no distribution kept), else a draw from
    the logits through the same transform the target's go through, with that distribution."""
    if params.greedy:
        return int(logits.argmax()), None
    if params.invariant:
        return invariant_choice(logits, params, noise_seed(generator), position), None
    probs = logits_to_probs(logits, params)  # [vocab]
    return sample(probs, generator), probs


def ranked(logits: torch.Tensor, count: int, exclude: int) -> list[int]:  # logits [vocab]
    """The ``count`` ids a drafter ranks highest, ``exclude`` left out: a draft tree's alternatives."""
    top = torch.topk(logits, min(count + 1, logits.shape[-1])).indices.tolist()
    return [token for token in top if token != exclude][:count]
