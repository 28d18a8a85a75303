"""The ``early-exit`` drafter: self-speculation, Kangaroo-style. The target's own first L layers draft, followed by
a small trained adapter (``ExitAdapter``) and the target's LM head; no second model is stored or kept aligned.

The target caches every context token but the pending one. Drafting runs the pending token, then each draft token
but the last, through the target's first L layers only (``extend_shallow``), writing their keys and values to those
layers' cache; the verifying pass over the pending token and the draft then starts at layer L for them (the lean
runtime reuses what drafting left), so no drafted position is computed twice in the shared layers.
"""

from __future__ import annotations

import torch

from exactspec.backends.base import ShallowRunner
from exactspec.drafters.networks import ExitAdapter, prepare_for_drafting
from exactspec.proposers.base import EMPTY_DRAFT, Draft, Role, draft_of, trained_drafter
from exactspec.sampling import SamplingParams


class EarlyExitProposer:
    name = "early-exit"

    def __init__(self, adapter: ExitAdapter, target) -> None:
        if adapter.config.exit_layer >= target.num_layers:
            raise ValueError(f"the exit after layer {adapter.config.exit_layer} is not inside the target's "
                             f"{target.num_layers} layers")
        self.adapter = prepare_for_drafting(adapter.eval())
        self.target = target
        self.exit_layer = adapter.config.exit_layer

    @torch.inference_mode()
    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
                ) -> Draft:
        if k < 1 or len(self.target.tokens) != len(context) - 1:  # the target must hold all but the pending token
            return EMPTY_DRAFT
        vocab = self.adapter.vocab
        token, tokens, rows = context[-1], [], []
        for i in range(k):
            state = self.target.extend_shallow([token], self.exit_layer)[-1]  # [hidden]
            token, probs = vocab.draft_token(vocab.logits(self.adapter(state)), params, generator, len(context) + i)
            tokens.append(token)
            rows.append(probs)
        return draft_of(tokens, rows)

    def clear_cache(self) -> None:
        pass


NEEDS = ShallowRunner  # of the target's backend: it runs the target's first layers
ROLE = Role(trained=True, needs=NEEDS)  # a trained adapter after the target's first layers
make = trained_drafter(EarlyExitProposer, NEEDS)
