"""How much of a long context a draft model should read: a draft model at several context windows (its first tokens
and its last W: ``proposers/draft_model.py``'s ContextWindow), beside plain decoding, on the same prompts.

    python -m exactspec.bench.draft_window --model qwen2.5-coder-1.5b --draft-model qwen2.5-coder-0.5b \\
        --prompts data/spec_bench_question.jsonl --category summarization --limit 4 --windows 256/32,256/256,off

Per prompt the target prefills the prompt once (timed); plain decoding and the draft model at each width then decode
from that cache, in an order rotated per prompt, so that the target's prefill, the same for all, is paid once. Each
run starts from an empty draft cache, and the draft's catch-up on the prompt (its prefill of its view) is timed
apart. The table: acceptance (accepted / drafted), tokens per round, catch-up seconds, tokens/s of the decode
(catch-up included) and of the whole request (the target's prefill added), its speedup over plain decoding's whole
request (median per prompt), and greedy mismatches with plain decoding (exactness: always 0).

``--agreement`` measures instead how often the draft's greedy choice is the target's next plain token, fed the
target's tokens one by one (a first-position acceptance): deterministic, and only the draft's passes to pay per
window, so that many windows and prompts fit where chains' timings would not.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

from exactspec.errors import run_script

PLAIN = "none"


@dataclass
class Measured:
    """One run of one contender on one prompt."""

    category: str
    tokens: list[int]
    catch_up: float  # seconds of the draft's catch-up on the prompt
    decode: float  # seconds of the generation from the prefilled prompt (catch-up not included)
    prefill: float  # seconds of the target's prefill of the prompt
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0

    @property
    def whole(self) -> float:
        return self.prefill + self.catch_up + self.decode


def parse_windows(text: str, head: int) -> list[tuple[int | None, int]]:
    """``128,256/64,off`` -> [(128, head), (256, 64), (None, head)]: each window W, or W/H with a head of H tokens
    (off: the whole context)."""
    from exactspec.errors import UsageError

    windows: list[tuple[int | None, int]] = []
    for part in text.split(","):
        width, slash, first = part.partition("/")
        if part == "off":
            windows.append((None, head))
        elif width.isdigit() and int(width) > 0 and (not slash or first.isdigit()):
            windows.append((int(width), int(first) if slash else head))
        else:
            raise UsageError(f"--windows: each W, W/H (token counts) or off, not {part!r}")
    return windows


def run_one(engine, prompt: list[int], config, prefill_seconds: float, category: str) -> Measured:
    """One contender on a prompt the target holds prefilled: the draft's catch-up timed apart, then the generation."""
    from exactspec.backends.base import declares
    from exactspec.proposers.base import CatchesUp

    engine.proposer.clear_cache()
    started = time.perf_counter()
    if declares(engine.proposer, CatchesUp):
        engine.proposer.catch_up(prompt)
    catch_up = time.perf_counter() - started
    result = engine.generate(prompt, config)
    stats = result.stats
    return Measured(category, result.token_ids, catch_up, stats.seconds, prefill_seconds, stats.draft_tokens,
                    stats.accepted_tokens, stats.rounds)


def measure(engines: dict[str, object], prompts: list[tuple[str, list[int]]], config) -> dict[str, list[Measured]]:
    """Every contender on every prompt, the target's prefill once a prompt, the order rotated per prompt."""
    from exactspec.backends.base import prefill

    names = list(engines)
    runs: dict[str, list[Measured]] = {name: [] for name in names}
    for i, (category, prompt) in enumerate(prompts):
        target = engines[PLAIN].target
        target.rollback(0)
        started = time.perf_counter()
        prefill(target, prompt[:-1])
        seconds = time.perf_counter() - started
        for name in names[i % len(names):] + names[: i % len(names)]:
            runs[name].append(run_one(engines[name], prompt, config, seconds, category))
            print(f"  {category} prompt {i} ({len(prompt)} tokens) {name}: {runs[name][-1].decode:.1f} s",
                  file=sys.stderr, flush=True)
    return runs


def table(runs: dict[str, list[Measured]], category: str | None) -> list[str]:
    """The markdown rows for one category (None: all)."""
    plain = [m for m in runs[PLAIN] if category in (None, m.category)]
    lines = []
    for name, measured in runs.items():
        mine = [m for m in measured if category in (None, m.category)]
        tokens = sum(len(m.tokens) for m in mine)
        drafted, accepted, rounds = (sum(getattr(m, f) for m in mine) for f in ("drafted", "accepted", "rounds"))
        catch_up = sum(m.catch_up for m in mine) / len(mine)
        decode_rate = tokens / sum(m.catch_up + m.decode for m in mine)
        whole_rate = tokens / sum(m.whole for m in mine)
        speedup = statistics.median(p.whole / m.whole * len(m.tokens) / len(p.tokens) for m, p in zip(mine, plain))
        mismatches = sum(m.tokens != p.tokens for m, p in zip(mine, plain))
        acceptance = f"{accepted / drafted:.1%}" if drafted else "—"
        lines.append(f"| {category or 'all'} | {name} | {acceptance} | {tokens / rounds:.2f} | {catch_up:.2f} | "
                     f"{decode_rate:.2f} | {whole_rate:.2f} | {speedup:.2f}x | {mismatches} |")
    return lines


def agreement(draft, prompt: list[int], answer: list[int], width: int | None, head: int) -> float:
    """How often the draft model's greedy choice is the target's next token of ``answer`` (its plain greedy output),
    fed them one by one and reading the context through a window: a first-position acceptance, without the noise
    of a chain's timing and with only the draft's passes to pay."""
    from exactspec.backends.base import sync
    from exactspec.proposers.draft_model import ContextWindow

    window, hits = ContextWindow(width, head), 0
    draft.rollback(0)
    for position, token in enumerate(answer):
        hits += int(sync(draft, window.view(prompt + answer[:position]), num_logits=1)[0].argmax()) == token
    return hits / len(answer)


def agreement_rows(loaded, source, windows, prompts, new_tokens: int) -> list[str]:
    """The markdown rows of --agreement: per category and window, the draft's mean agreement over the prompts."""
    from exactspec.engine import Engine, GenerationConfig
    from exactspec.errors import UsageError
    from exactspec.proposers import NoProposer
    from exactspec.proposers.draft_model import ForeignDraft

    if isinstance(source, ForeignDraft):
        raise UsageError("--agreement reads a draft model of the target's vocabulary")
    plain, found = Engine(loaded.runtime, NoProposer(), loaded.stop_ids), {}
    for category, prompt in prompts:
        plain.clear_cache()
        answer = plain.generate(prompt, GenerationConfig(max_new_tokens=new_tokens)).token_ids
        for width, head in windows:
            found.setdefault((category, width, head), []).append(agreement(source, prompt, answer, width, head))
            print(f"  {category} ({len(prompt)} tokens) W={width} head {head}: {found[category, width, head][-1]:.3f}",
                  file=sys.stderr, flush=True)
    return [f"| {category} | {f'{width} tokens, head {head}' if width else 'whole context'} | "
            f"{statistics.mean(values):.3f} | {len(values)} |" for (category, width, head), values in found.items()]


def main(argv: list[str] | None = None) -> int:
    from exactspec.bench.prompts import prompt_script_parser, read_prompts
    from exactspec.loading import draft_source, encode_prompt, load_target
    from exactspec.proposers import draft_model as draft_models

    parser = prompt_script_parser(__doc__, limit=4)
    parser.add_argument("--category", default=None, help="comma-separated categories, the first --limit of each")
    parser.add_argument("--draft-model", required=True)
    parser.add_argument("--windows", default="128,256,512,1024,off",
                        help="the draft's context windows: each W (its last W tokens and the default head), W/H (a "
                        "head of H), or off")
    parser.add_argument("-k", "--num-draft-tokens", type=int, default=4)
    parser.add_argument("--longest", type=int, default=None, metavar="N",
                        help="of each category's first --limit prompts, only its N longest (where a window cuts)")
    parser.add_argument("--agreement", action="store_true",
                        help="measure the draft's greedy agreement with the target's plain tokens, fed them (no "
                        "chains, no timings)")
    args = parser.parse_args(argv)
    windows = parse_windows(args.windows, draft_models.DRAFT_WINDOW_HEAD)

    loaded = load_target(args.model, threads=args.threads, draft_model=args.draft_model, drafters=("draft-model",))
    source = draft_source("draft-model", loaded.target, loaded.runtime, loaded.draft, loaded.precision)
    prompts = []
    for category in args.category.split(",") if args.category else [None]:
        found = [(p.category, encode_prompt(loaded.target.tokenizer, p.text, None if p.chat else False))
                 for p in read_prompts(args.prompts, category, args.limit)]
        prompts += sorted(found, key=lambda prompt: -len(prompt[1]))[: args.longest] if args.longest else found
    lengths = [len(ids) for _, ids in prompts]
    heading = (f"{len(prompts)} prompts ({min(lengths)}-{max(lengths)} tokens, mean {statistics.mean(lengths):.0f}), "
               f"{args.max_new_tokens} new tokens, greedy, "
               f"{getattr(loaded.runtime, 'threads', None) or args.threads} threads")
    if args.agreement:
        rows = agreement_rows(loaded, source, windows, prompts, args.max_new_tokens)
        print(f"{heading}; the draft's greedy agreement with the target's tokens\n")
        print("| category | the draft reads | agreement | prompts |\n|---|---|---:|---:|\n" + "\n".join(rows))
        return 0
    runs = chains(loaded, source, windows, prompts, args.max_new_tokens, args.num_draft_tokens)
    print(f"{heading}, k = {args.num_draft_tokens}\n")
    print("| category | drafter | acceptance | tokens/round | catch-up s | decode tokens/s | request tokens/s | "
          "speedup | greedy mismatches |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for category in dict.fromkeys([m.category for m in runs[PLAIN]] + [None]):
        print("\n".join(table(runs, category)))
    return 0


def chains(loaded, source, windows, prompts, new_tokens: int, k: int) -> dict[str, list[Measured]]:
    """Plain decoding and the draft model at each window, drafting chains of k on every prompt."""
    from exactspec.engine import Engine, GenerationConfig
    from exactspec.proposers import NoProposer
    from exactspec.proposers import draft_model as draft_models

    engines = {PLAIN: Engine(loaded.runtime, NoProposer(), loaded.stop_ids)}
    for width, head in windows:
        proposer = draft_models.make(loaded.runtime, source, None, window=width, head=head)
        name = f"draft-model W={width}, head {head}" if width else "draft-model, whole context"
        engines[name] = Engine(loaded.runtime, proposer, loaded.stop_ids)
    for engine in list(engines.values())[:2]:  # warm-up: first-call costs (the weights' pages) out of the timings
        engine.generate(prompts[0][1][:64], GenerationConfig(max_new_tokens=8, num_draft_tokens=4))
    return measure(engines, prompts, GenerationConfig(max_new_tokens=new_tokens, num_draft_tokens=k))


if __name__ == "__main__":
    sys.exit(run_script(main))
