"""The verifier: exact rejection sampling of a drafted chain against the target's distributions.

Pure functions over probability tensors: no model, no cache; random numbers come from the generator passed in.

Words used here and everywhere in exactspec:

- *draft tokens*: the k tokens a proposer drafted, with their distributions ``draft_probs`` [k, vocab], or
  ``None`` for a proposer that has no distribution (a copy from the context): a point mass on each token.
- *target_probs* [k+1, vocab]: the target's distribution at each drafted position, plus one after the last.
- *accepted*: draft token x at position i survives with probability min(1, p_i(x) / q_i(x)); the longest
  surviving prefix is kept.
- *recovered*: after the first rejection, at position n, the next token is drawn from the residual
  max(0, p_n - q_n), renormalised.
- *bonus*: when all k survive, one more token is drawn from p_k, the target's distribution after the last one.

Every token emitted this way is a draw from the target's distribution, whatever the draft was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from exactspec.sampling import sample


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one drafted chain: ``accepted`` draft tokens, then one more ``token``."""

    num_draft: int  # k, the number of draft tokens verified
    accepted: int  # length of the accepted prefix, 0..k
    token: int  # recovered token (accepted < k) or bonus token (accepted == k)
    forced: int = 0  # the draft's leading tokens a grammar forced (accepted by construction: not the drafter's)

    @property
    def bonus(self) -> bool:
        return self.accepted == self.num_draft

    @property
    def reached(self) -> int:
        """Draft tokens that were tested: the accepted ones and the first rejected one (none after it)."""
        return min(self.num_draft, self.accepted + 1)

    @property
    def proposed(self) -> tuple[int, int, int]:
        """The drafter's share of the verdict, the forced tokens left out: its draft tokens, those accepted and
        those reached."""
        return (self.num_draft - self.forced, max(self.accepted - self.forced, 0),
                max(self.reached - self.forced, 0))

    @property
    def nodes(self) -> int:
        """The draft positions the target scored: a chain's tokens (as TreeVerdict.nodes)."""
        return self.num_draft

    offered: tuple[int, ...] = ()  # a chain offers no alternatives (as TreeVerdict.offered)
    ranks: tuple[int, ...] = ()

    def emitted(self, draft_tokens: list[int]) -> list[int]:
        """The tokens this round emits: the accepted prefix and the recovered or bonus token."""
        return list(draft_tokens[: self.accepted]) + [self.token]


def acceptance_probs(
    draft_tokens: torch.Tensor,  # [k] long
    draft_probs: torch.Tensor | None,  # [k, vocab] or None (point mass on each draft token)
    target_probs: torch.Tensor,  # [k+1, vocab]
) -> torch.Tensor:  # [k]
    """Probability min(1, p(x)/q(x)) of accepting each draft token x, taken on its own."""
    k = draft_tokens.shape[0]
    p_x = target_probs[:k].gather(-1, draft_tokens[:, None]).squeeze(-1)  # [k]
    if draft_probs is None:
        return p_x.clamp(max=1.0)
    q_x = draft_probs.gather(-1, draft_tokens[:, None]).squeeze(-1)  # [k]
    # q(x) > 0 for a token the drafter drew; guard the division for hand-made inputs
    return torch.where(q_x > 0, (p_x / q_x.clamp(min=torch.finfo(q_x.dtype).tiny)).clamp(max=1.0), 1.0)


def residual_probs(
    target_row: torch.Tensor,  # [vocab] p at the rejected position
    draft_row: torch.Tensor | None,  # [vocab] q at that position, or None for a point mass
    draft_token: int,  # the rejected draft token (defines the point mass)
) -> torch.Tensor:  # [vocab]
    """The residual max(0, p - q), renormalised: the distribution of the recovered token."""
    if draft_row is None:
        residual = target_row.clone()
        residual[draft_token] = (target_row[draft_token] - 1.0).clamp(min=0.0)
    else:
        residual = (target_row - draft_row).clamp(min=0.0)
    total = residual.sum()
    if not total > 0:  # p == q up to rounding: a rejection had probability ~0, and p is the exact answer
        return target_row
    return residual / total


def verify(
    draft_tokens: torch.Tensor,  # [k] long
    draft_probs: torch.Tensor | None,  # [k, vocab] or None
    target_probs: torch.Tensor,  # [k+1, vocab]
    generator: torch.Generator | None,
) -> Verdict:
    """Exact rejection sampling of a chain; the emitted tokens are distributed as the target's samples."""
    k = draft_tokens.shape[0]
    if k == 0:
        return Verdict(num_draft=0, accepted=0, token=sample(target_probs[0], generator))
    accept_p = acceptance_probs(draft_tokens, draft_probs, target_probs)  # [k]
    uniforms = torch.rand(k, generator=generator, dtype=accept_p.dtype, device=accept_p.device)  # [k]
    accepted = _leading_true(uniforms < accept_p)
    if accepted == k:
        return Verdict(num_draft=k, accepted=k, token=sample(target_probs[k], generator))
    draft_row = None if draft_probs is None else draft_probs[accepted]
    residual = residual_probs(target_probs[accepted], draft_row, int(draft_tokens[accepted]))
    return Verdict(num_draft=k, accepted=accepted, token=sample(residual, generator))


def verify_choices(
    draft_tokens: Sequence[int] | torch.Tensor,  # [k]
    target_choice: Sequence[int] | torch.Tensor,  # [k+1]: the target's own token at each position
) -> Verdict:
    """Verification against the target's own choices (its argmax when greedy, its Gumbel-max choice under the
    invariant sampler): keep draft tokens while they equal the target's choice, then emit its choice; the output is
    the target's own continuation, token for token. ``target_choice`` is read only up to the first mismatch."""
    k = len(draft_tokens)
    accepted = next((j for j in range(k) if int(draft_tokens[j]) != int(target_choice[j])), k)
    return Verdict(num_draft=k, accepted=accepted, token=int(target_choice[accepted]))


def _leading_true(mask: torch.Tensor) -> int:
    """Number of leading True values of a 1-d bool tensor."""
    return int(mask.long().cumprod(0).sum().item())


@dataclass(frozen=True)
class TreeVerdict:
    """Outcome of verifying a draft tree: the accepted path (node indexes, root to leaf), then one more ``token``."""

    num_draft: int  # the tree's depth: the draft positions it offers
    path: list[int]  # accepted nodes, each a child of the one before (the first a child of the root)
    token: int  # recovered token (no child of the path's last node accepted) or bonus token (it has no child)
    bonus: bool
    nodes: int = 0  # the tree's nodes: the draft positions the target scored
    offered: tuple[int, ...] = ()  # candidates tried at each node visited (the root, then the path's nodes)
    ranks: tuple[int, ...] = ()  # each accepted node's place among the candidates tried there (1: the first)

    @property
    def accepted(self) -> int:
        return len(self.path)

    @property
    def reached(self) -> int:
        """Depths that were tested: the accepted path's and the one after it, where the tree goes deeper."""
        return min(self.num_draft, self.accepted + 1)

    @property
    def proposed(self) -> tuple[int, int, int]:
        """As Verdict.proposed: a tree is all the drafter's (no grammar constrains a tree)."""
        return self.num_draft, self.accepted, self.reached

    def emitted(self, draft_tokens: list[int]) -> list[int]:
        return [draft_tokens[node] for node in self.path] + [self.token]


def children_of(parents: list[int]) -> dict[int, list[int]]:
    """Each node's children in node order; the root is -1."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    return children


def node_depths(parents: list[int]) -> list[int]:
    """Each node's depth: 1 for a child of the root (parents come before their children)."""
    depth: list[int] = []
    for parent in parents:
        depth.append(1 + (depth[parent] if parent >= 0 else 0))
    return depth


def tree_depth(parents: list[int]) -> int:
    """The longest root-to-leaf path, in nodes."""
    return max(node_depths(parents), default=0)


def candidate_outcomes(
    p: torch.Tensor,  # [vocab]: the target's distribution at the parent
    tokens: list[int],  # [c]: the children's tokens, in the order they are tried
    rows: list[torch.Tensor | None],  # [c]: the distribution each child was drawn from; None: a point mass
) -> tuple[torch.Tensor, torch.Tensor]:  # [c+1], [vocab]
    """SpecInfer's recursive rejection over one node's children, as probabilities: [j] that child j is the first
    accepted, [c] that none is; and the distribution the token is then drawn from.

    Child x is tried against a running p' (at first p): accepted with probability min(1, p'(x)/q(x)); on rejection
    p' becomes the residual max(0, p' - q), renormalised. Each step emits a draw from p' (the one-step argument of
    the chain), so the token that leaves a node is distributed as p, for any number of children, as long as each
    child was drawn independently of its siblings' outcomes (a top-k candidate is a point mass fixed in advance).
    """
    chances, reach = [], p.new_ones(())
    for x, q in zip(tokens, rows):
        accept = acceptance_probs(torch.tensor([x], device=p.device), None if q is None else q[None], p[None])[0]
        chances.append(reach * accept)
        reach = reach * (1 - accept)
        p = residual_probs(p, q, x)
    return torch.stack(chances + [reach]), p


def verify_tree(
    draft_tokens: list[int],  # [m]
    parents: list[int],  # [m]: each node's parent, -1 for a child of the root (the pending position)
    draft_probs: torch.Tensor | None,  # [m, vocab]: the distribution each node was drawn from; None: point masses
    target_probs: torch.Tensor,  # [m+1, vocab]: row 0 after the root, row 1+i after node i
    generator: torch.Generator | None,
) -> TreeVerdict:
    """Exact multi-candidate rejection sampling down a draft tree: at each node, :func:`candidate_outcomes` over its
    children picks the child to descend into, or the recovered token (the bonus token at a leaf)."""

    def choose(node: int, tried: list[int]) -> tuple[int | None, int]:
        rows = [None if draft_probs is None else draft_probs[child] for child in tried]
        chances, residual = candidate_outcomes(target_probs[node + 1], [draft_tokens[c] for c in tried], rows)
        outcome = sample(chances, generator) if tried else 0
        return (outcome, -1) if outcome < len(tried) else (None, sample(residual, generator))

    return _descend(parents, choose)


def verify_tree_choices(
    draft_tokens: list[int],  # [m]
    parents: list[int],  # [m]
    target_choice: Sequence[int],  # [m+1]: the target's own token after the root and after each node (read lazily)
) -> TreeVerdict:
    """Tree verification against the target's own choices (as :func:`verify_choices`): descend into the child that
    is the target's choice while there is one; the output is the target's own continuation."""

    def choose(node: int, tried: list[int]) -> tuple[int | None, int]:
        wanted = target_choice[node + 1]
        return next((i for i, child in enumerate(tried) if draft_tokens[child] == wanted), None), wanted

    return _descend(parents, choose)


def _descend(parents: list[int], choose) -> TreeVerdict:
    """Walk down a draft tree from the root: ``choose(node, its children)`` gives the index of the child accepted
    there, or None and the token that ends the round (recovered; bonus when the node has no child)."""
    children = children_of(parents)
    path: list[int] = []
    offered: list[int] = []
    ranks: list[int] = []
    node = -1
    while True:
        tried = children.get(node, [])
        offered.append(len(tried))
        index, token = choose(node, tried)
        if index is None:
            return TreeVerdict(tree_depth(parents), path, token, bonus=not tried, nodes=len(parents),
                               offered=tuple(offered), ranks=tuple(ranks))
        node = tried[index]
        path.append(node)
        ranks.append(index + 1)
