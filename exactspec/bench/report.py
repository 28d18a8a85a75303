"""From benchmark runs to the report: per configuration and per category, as a table and as JSON."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from exactspec.bench.contenders import Outcome
from exactspec.bench.stats import geomean, ideal_speedup, median, per_prompt_speedups
from exactspec.engine import source_shares

BASELINE = "none"


@dataclass(frozen=True)
class Run:
    config: str  # the contender's name
    prompt_id: str
    category: str
    outcome: Outcome
    seed: int | None = None  # the run's seed: contenders run a prompt's repeat with the same one


def summarise(runs: list[Run], config: str, greedy: bool) -> dict:
    """The report fields for one configuration over the given runs (all categories, or one)."""
    mine = [r for r in runs if r.config == config]
    baseline = [r for r in runs if r.config == BASELINE]
    tokens = sum(len(r.outcome.token_ids) for r in mine)
    seconds = sum(r.outcome.seconds for r in mine)
    fields = {
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "speedup": median(per_prompt_speedups(_per_prompt_rate(mine), _per_prompt_rate(baseline))),
        "speedup_geomean": geomean(per_prompt_speedups(_per_prompt_rate(mine), _per_prompt_rate(baseline))),
        "acceptance_rate": None,
        "mean_accepted_length": None,
        "mean_draft_length": None,
        "mean_draft_nodes": None,
        "ideal_speedup": None,
        "fraction_of_ideal": None,
        "draft_token_cost": None,
        "greedy_mismatches": _mismatches(mine, baseline) if greedy else None,
        "seeded_mismatches": None,
        "runs": len(mine),
    }
    if mine and all(r.outcome.rounds is not None for r in mine):  # exactspec's own: the same seeds mean the same noise
        fields.update(_acceptance_fields(mine, baseline, fields["speedup"]))
        if not greedy and all(r.seed is not None for r in mine):
            fields["seeded_mismatches"] = _mismatches(mine, baseline)
    if mine and all(r.outcome.sources for r in mine):  # a combined drafter (the hybrid)
        fields["sources"] = run_sources(mine)
    return fields


def run_sources(runs: list[Run]) -> dict[str, dict]:
    """Per source of a combined drafter, over the runs: its draft and accepted tokens and their shares
    (``engine.source_shares``)."""
    totals: dict[str, list[int]] = {}
    for r in runs:
        for name, (drafted, accepted) in r.outcome.sources.items():
            counts = totals.setdefault(name, [0, 0])
            counts[0] += drafted
            counts[1] += accepted
    return source_shares(totals)


def _acceptance_fields(mine: list[Run], baseline: list[Run], speedup: float) -> dict:
    rounds = sum(r.outcome.rounds for r in mine)
    drafted = sum(r.outcome.draft_tokens for r in mine)
    accepted = sum(r.outcome.accepted_tokens for r in mine)
    emitted = sum(len(r.outcome.token_ids) for r in mine)
    nodes = sum(r.outcome.draft_nodes or 0 for r in mine)
    fields = {"mean_accepted_length": emitted / rounds if rounds else 0.0,
              "mean_draft_length": drafted / rounds if rounds else 0.0,
              "mean_draft_nodes": nodes / rounds if rounds else 0.0}
    if not drafted:  # nothing drafted (the baseline): no acceptance, and no speculation to idealise
        return fields
    fields["acceptance_rate"] = accepted / drafted
    fields["acceptance_by_position"] = _acceptance_by_position(mine)
    plain_rounds = sum(r.outcome.rounds or 0 for r in baseline)
    if rounds and plain_rounds:
        plain_step = sum(r.outcome.target_seconds for r in baseline) / plain_rounds
        # a draft token's drafting (its catching up included) against plain decoding's step, from the same run
        fields["draft_token_cost"] = sum(r.outcome.draft_seconds for r in mine) / drafted / plain_step
        ideal = ideal_speedup(
            acceptance_rate=fields["acceptance_rate"],
            k=drafted / rounds,
            draft_seconds_per_round=sum(r.outcome.draft_seconds for r in mine) / rounds,
            score_seconds_per_round=sum(r.outcome.target_seconds for r in mine) / rounds,
            plain_seconds_per_token=plain_step,
        )
        fields["ideal_speedup"] = ideal
        fields["fraction_of_ideal"] = speedup / ideal if ideal else None
    return fields


def _acceptance_by_position(runs: list[Run]) -> list[float]:
    """Per draft position, over all runs: accepted / drafted tokens there."""
    width = max(len(r.outcome.drafted_at) for r in runs)
    drafted = [sum(r.outcome.drafted_at[i] for r in runs if i < len(r.outcome.drafted_at)) for i in range(width)]
    accepted = [sum(r.outcome.accepted_at[i] for r in runs if i < len(r.outcome.accepted_at)) for i in range(width)]
    return [a / d if d else 0.0 for a, d in zip(accepted, drafted)]


def _per_prompt_rate(runs: list[Run]) -> dict[str, float]:
    """tokens/s on each prompt, over its repeats."""
    tokens: dict[str, int] = defaultdict(int)
    seconds: dict[str, float] = defaultdict(float)
    for r in runs:
        tokens[r.prompt_id] += len(r.outcome.token_ids)
        seconds[r.prompt_id] += r.outcome.seconds
    return {p: tokens[p] / seconds[p] for p in tokens if seconds[p] > 0}


def _mismatches(mine: list[Run], baseline: list[Run]) -> int:
    """Runs whose tokens differ from the baseline's on the same prompt with the same seed: greedy decoding, and
    seeded sampling with the invariant sampler, must have none."""
    expected = {(r.prompt_id, r.seed): r.outcome.token_ids for r in baseline}
    return sum(1 for r in mine if expected.get((r.prompt_id, r.seed), r.outcome.token_ids) != r.outcome.token_ids)


def build_report(runs: list[Run], contenders: list, settings: dict) -> dict:
    greedy = settings["temperature"] == 0
    categories = sorted({r.category for r in runs})
    configs = []
    for contender in contenders:
        fields = summarise(runs, contender.name, greedy)
        fields["per_category"] = {
            c: summarise([r for r in runs if r.category == c], contender.name, greedy) for c in categories
        }
        configs.append({"drafter": contender.name, "num_draft_tokens": contender.num_draft_tokens,
                        "temperature": settings["temperature"], **fields})
    return {"settings": settings, "configs": configs}


COLUMNS = [
    ("drafter", "config", "{}"),
    ("tokens_per_second", "tokens/s", "{:.2f}"),
    ("speedup", "speedup (median)", "{:.2f}x"),
    ("speedup_geomean", "speedup (geomean)", "{:.2f}x"),
    ("mean_draft_length", "draft tokens/round", "{:.2f}"),
    ("mean_draft_nodes", "scored nodes/round", "{:.2f}"),
    ("acceptance_rate", "acceptance", "{:.1%}"),
    ("mean_accepted_length", "tokens/round", "{:.2f}"),
    ("draft_token_cost", "draft token / step", "{:.2f}"),
    ("ideal_speedup", "ideal speedup", "{:.2f}x"),
    ("fraction_of_ideal", "of ideal", "{:.0%}"),
    ("greedy_mismatches", "greedy mismatches", "{}"),
    ("seeded_mismatches", "seeded mismatches", "{}"),
]


def markdown(report: dict) -> str:
    """The report as Markdown tables: overall, then one per category."""
    configs = report["configs"]
    sections = [("all prompts", [c for c in configs])]
    categories = list(configs[0]["per_category"]) if configs else []
    if len(categories) > 1:
        sections += [(cat, [{"drafter": c["drafter"], **c["per_category"][cat]} for c in configs])
                     for cat in categories]
    lines = []
    by_position = [c for c in configs if c.get("acceptance_by_position")]
    if by_position:
        width = max(len(c["acceptance_by_position"]) for c in by_position)
        lines += ["**acceptance by draft position** (accepted / drafted tokens at each position)", "",
                  "| config | " + " | ".join(str(i + 1) for i in range(width)) + " |",
                  "|---|" + "---:|" * width]
        for c in by_position:
            rates = c["acceptance_by_position"] + [None] * (width - len(c["acceptance_by_position"]))
            lines.append(f"| {c['drafter']} | " + " | ".join("—" if r is None else f"{r:.1%}" for r in rates) + " |")
        lines.append("")
    for title, rows in sections:
        lines += [f"**{title}**", "", "| " + " | ".join(h for _, h, _ in COLUMNS) + " |",
                  "|" + "|".join("---:" if i else "---" for i in range(len(COLUMNS))) + "|"]
        for row in rows:
            cells = [("—" if row.get(key) is None else fmt.format(row[key])) for key, _, fmt in COLUMNS]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += _sources_markdown(configs)
    return "\n".join(lines)


def _sources_markdown(configs: list[dict]) -> list[str]:
    """Lines of a table of where a combined drafter's drafts came from: per configuration that has sources, over all
    prompts and per category, each source's share of the accepted draft tokens (of the draft tokens, in brackets).
    None where no configuration has sources."""
    combined = [c for c in configs if c.get("sources")]
    if not combined:
        return []
    names = list(dict.fromkeys(name for c in combined for name in c["sources"]))
    lines = ["**where the drafts came from** (each source's share of the accepted draft tokens; of the draft tokens "
             "in brackets)", "", "| config | prompts | " + " | ".join(names) + " |", "|---|---|" + "---:|" * len(names)]
    for c in combined:
        rows = [("all", c["sources"])] + [(cat, fields["sources"]) for cat, fields in c["per_category"].items()
                                          if fields.get("sources")]
        for title, sources in rows:
            cells = [_share_cell(sources.get(name)) for name in names]
            lines.append(f"| {c['drafter']} | {title} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def _share_cell(source: dict | None) -> str:
    """One source's accepted share (draft share): "62.0% (40.1%)"; "—" where it has none."""
    if source is None:
        return "—"
    accepted, drafted = source["accepted_share"], source["draft_share"]
    return ("—" if accepted is None else f"{accepted:.1%}") + ("" if drafted is None else f" ({drafted:.1%})")


def print_json(report: dict, out: str | None) -> int:
    """A side-by-side benchmark's report as JSON on standard output, and in ``out`` where given; exit status 0."""
    import json

    text = json.dumps(report, indent=1)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text)
    return 0
