"""How often greedy output changes with the weights' precision, and whether each change sits at a near-tie.

Two greedy runs on one prompt agree until their first differing token. There both saw the same context, and each
chose the best token of its own logits. If each precision's logits lie within ``LOGIT_TOLERANCE`` of float32's,
the two chosen tokens' float32 logits lie within twice the larger tolerance of each other: the float32 margin
between them at the first divergence is the evidence. A margin above that bound would be a logic error, not
rounding.

Compared, on the same prompts: each precision's plain greedy output against float32's, and each precision's
speculative output (prompt lookup) against its own plain output. ::

    python -m exactspec.bench.agreement --limit 20 --max-new-tokens 64
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass

from exactspec.backends import LeanRuntime, PassPrecisions, sync
from exactspec.cores import set_torch_threads
from exactspec.engine import Engine, GenerationConfig
from exactspec.errors import run_script
from exactspec.proposers import NoProposer, PromptLookupProposer

# The largest logit difference from float32 each precision is held to: float32's own differs between a pass over
# one position and a pass over several (the summation order changes); float16 is what --dtype auto admits;
# bfloat16 is the observed error on the default model, rounded up.
LOGIT_TOLERANCE = {"float32": 1e-3, "float16": 0.1, "bfloat16": 1.5}


@dataclass(frozen=True)
class Divergence:
    """Where two greedy outputs for one prompt first differ, and float32's margin between their two choices."""

    prompt: int  # index of the prompt
    position: int | None  # first differing generated token; None when the outputs are the same
    margin: float | None  # |float32 logit of one choice - of the other|, on the shared context

    @property
    def diverged(self) -> bool:
        return self.position is not None


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def divergence(reference: LeanRuntime, prompt_index: int, prompt: list[int], a: list[int], b: list[int]
               ) -> Divergence:
    i = first_difference(a, b)
    if i is None or i >= min(len(a), len(b)):
        return Divergence(prompt_index, i, None)
    logits = sync(reference, prompt + a[:i], num_logits=1)[0].double()  # [vocab] float32's, on the shared context
    return Divergence(prompt_index, i, float((logits[a[i]] - logits[b[i]]).abs()))


def greedy(engine: Engine, prompt: list[int], new_tokens: int) -> list[int]:
    config = GenerationConfig(max_new_tokens=new_tokens, num_draft_tokens=4, stop_at_eos=False)
    return engine.generate(prompt, config).token_ids


@dataclass(frozen=True)
class Comparison:
    """Two greedy outputs per prompt, compared: where they first differ, and the largest margin rounding allows."""

    name: str
    bound: float  # twice the larger logit tolerance of the precisions behind the two outputs
    divergences: list[Divergence]


def compare_precisions(model, prompts: list[list[int]], precisions: list[PassPrecisions | str],
                       new_tokens: int) -> list[Comparison]:
    """For each precision: its plain output against float32's plain output, and its speculative output (prompt
    lookup, k=4) against its own plain output."""
    reference = LeanRuntime(model, "float32")
    reference_plain = [greedy(Engine(reference, NoProposer()), p, new_tokens) for p in prompts]
    comparisons = []
    for precision in precisions:
        is_reference = str(precision) == "float32"
        runtime = reference if is_reference else LeanRuntime(model, precision)
        plain, speculative = Engine(runtime, NoProposer()), Engine(runtime, PromptLookupProposer())
        against_float32, against_plain = [], []
        for i, (prompt, expected) in enumerate(zip(prompts, reference_plain)):
            ours = expected if is_reference else greedy(plain, prompt, new_tokens)
            against_float32.append(divergence(reference, i, prompt, ours, expected))
            against_plain.append(divergence(reference, i, prompt, greedy(speculative, prompt, new_tokens), ours))
        bound = margin_bound(precision)
        if not is_reference:
            comparisons.append(Comparison(f"{precision} plain vs float32 plain", bound, against_float32))
        comparisons.append(Comparison(f"{precision} prompt-lookup vs {precision} plain", bound, against_plain))
    return comparisons


def margin_bound(precision: PassPrecisions | str) -> float:
    """Twice the larger tolerance of the passes that produced the two outputs compared (float32's among them)."""
    passes = PassPrecisions.uniform(precision) if isinstance(precision, str) else precision
    return 2 * max(LOGIT_TOLERANCE[p] for p in passes.all)


def agreement_markdown(comparisons: list[Comparison]) -> str:
    lines = ["| comparison | prompts that differ | first difference (median token) | largest float32 margin there "
             "| bound |", "|---|---:|---:|---:|---:|"]
    for comparison in comparisons:
        differ = [d for d in comparison.divergences if d.diverged]
        margins = [d.margin for d in differ if d.margin is not None]
        position = f"{statistics.median(d.position for d in differ):.0f}" if differ else "—"
        largest = f"{max(margins):.4f}" if margins else "—"
        lines.append(f"| {comparison.name} | {len(differ)} of {len(comparison.divergences)} | {position} | "
                     f"{largest} | {comparison.bound:g} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from exactspec.backends.lean.precision import auto_precisions
    from exactspec.bench.prompts import prompt_script_parser, read_prompts
    from exactspec.loading import encode_prompt
    from exactspec.models import load_model

    parser = prompt_script_parser(__doc__, limit=20)
    args = parser.parse_args(argv)
    args.threads = set_torch_threads(args.threads)
    target = load_model(args.model, dtype="float32", device="cpu")
    prompts = [encode_prompt(target.tokenizer, p.text, p.chat) for p in read_prompts(args.prompts, limit=args.limit)]
    precisions: list[PassPrecisions | str] = ["float32", "float16", "bfloat16"]
    auto = auto_precisions(target.model)
    if str(auto) not in precisions:
        precisions.append(auto)
    comparisons = compare_precisions(target.model, prompts, precisions, args.max_new_tokens)
    print(f"greedy, {len(prompts)} prompts x {args.max_new_tokens} new tokens; --dtype auto here: {auto}")
    print("")
    print(agreement_markdown(comparisons))
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
