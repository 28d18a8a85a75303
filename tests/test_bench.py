"""Benchmark arithmetic on synthetic timings, and a smoke run of ``exactspec bench`` on tiny random models."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import pytest
from test_server import tiny  # noqa: F401
from tiny import perturbed_copy, save_with_tokenizer, tiny_llama

from exactspec.bench.contenders import Outcome
from exactspec.bench.report import Run, build_report, markdown, summarise
from exactspec.bench.stats import (
    expected_tokens_per_round,
    ideal_speedup,
    median,
    needed_acceptance,
    per_prompt_speedups,
)
from exactspec.cli import main


def test_expected_tokens_per_round():
    assert expected_tokens_per_round(0.0, 4) == 1  # every draft rejected: the recovered token only
    assert expected_tokens_per_round(1.0, 4) == 5  # every draft accepted: k + bonus
    # a = 0.5, k = 2: 1 + 0.5 + 0.25
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1.75)
    with pytest.raises(ValueError):
        expected_tokens_per_round(1.5, 2)


def test_ideal_speedup_divides_tokens_per_round_by_round_cost():
    # a = 0.5, k = 2 -> 1.75 tokens per round; a round costs 0.1 s drafting + 0.15 s scoring; a plain step 0.1 s
    assert ideal_speedup(0.5, 2, 0.1, 0.15, 0.1) == pytest.approx(1.75 / 2.5)
    # free drafting and free extra positions: the speedup is the tokens per round
    assert ideal_speedup(0.8, 4, 0.0, 0.1, 0.1) == pytest.approx(expected_tokens_per_round(0.8, 4))


def test_needed_acceptance_is_the_lowest_rate_whose_best_chain_reaches_the_speedup():
    # one draft token at no extra cost: 1 + a tokens per round, so 1.3x needs a = 0.3
    rate, k = needed_acceptance(1.3, {1: 1.0})
    assert rate == pytest.approx(0.3, abs=1e-3) and k == 1
    # a second position that costs 1.5x is worth it only at high acceptance: 1.6x is reached by k = 1 at 0.6,
    # while k = 2 needs 1 + a + a^2 >= 2.4 (a = 0.78)
    assert needed_acceptance(1.6, {1: 1.0, 2: 1.5}) == (pytest.approx(0.6, abs=1e-3), 1)
    # free positions make longer chains the cheaper way: k = 4 reaches 1.3x at a lower rate than k = 1
    rate, k = needed_acceptance(1.3, {1: 1.0, 4: 1.0})
    assert k == 4 and rate < 0.3 and expected_tokens_per_round(rate, 4) == pytest.approx(1.3, abs=1e-3)
    assert needed_acceptance(2.5, {1: 1.0}) is None  # two tokens a round at most


def test_median_and_per_prompt_speedups():
    assert median([3.0, 1.0, 2.0]) == 2.0 and median([1.0, 2.0, 3.0, 10.0]) == 2.5
    speedups = per_prompt_speedups({"a": 20.0, "b": 10.0, "c": 5.0}, {"a": 10.0, "b": 10.0})
    assert sorted(speedups) == [1.0, 2.0]  # "c" has no baseline run


def make_run(config, prompt, tokens, seconds, **counters):
    return Run(config, prompt, "cat", Outcome(token_ids=tokens, seconds=seconds, **counters))


def test_summary_on_synthetic_runs():
    plain = dict(rounds=10, draft_tokens=0, accepted_tokens=0, draft_seconds=0.0, target_seconds=1.0)
    runs = [
        make_run("none", "p1", list(range(10)), 1.0, **plain),
        make_run("none", "p2", list(range(10)), 1.0, **plain),
        # p1: same tokens in half the time (2x); p2: different tokens (a greedy mismatch) at 4x
        make_run("fast", "p1", list(range(10)), 0.5, rounds=4, draft_tokens=12, accepted_tokens=6,
                 draft_seconds=0.1, target_seconds=0.4),
        make_run("fast", "p2", list(range(1, 11)), 0.25, rounds=4, draft_tokens=12, accepted_tokens=6,
                 draft_seconds=0.1, target_seconds=0.4),
    ]
    fields = summarise(runs, "fast", greedy=True)
    assert fields["tokens_per_second"] == pytest.approx(20 / 0.75)
    assert fields["speedup"] == pytest.approx(3.0)  # median of 2x and 4x
    assert fields["acceptance_rate"] == pytest.approx(0.5)
    assert fields["mean_accepted_length"] == pytest.approx(20 / 8)
    # a = 0.5, k = 3 -> 1.875 tokens per round; a round costs (0.2 + 0.8) / 8 s; a plain step 0.1 s
    assert fields["ideal_speedup"] == pytest.approx(1.875 / (0.125 / 0.1))
    assert fields["fraction_of_ideal"] == pytest.approx(3.0 / fields["ideal_speedup"])
    assert fields["greedy_mismatches"] == 1
    baseline = summarise(runs, "none", greedy=True)
    assert baseline["speedup"] == 1.0 and baseline["mean_accepted_length"] == 1.0
    assert baseline["acceptance_rate"] is None and baseline["ideal_speedup"] is None
    reference = summarise(runs + [make_run("hf", "p1", list(range(10)), 0.5)], "hf", greedy=True)
    assert reference["acceptance_rate"] is None and reference["speedup"] == pytest.approx(2.0)


def test_seeded_mismatches_compare_runs_with_the_same_prompt_and_seed():
    plain = dict(rounds=10, draft_tokens=0, accepted_tokens=0, draft_seconds=0.0, target_seconds=1.0)
    spec = dict(rounds=4, draft_tokens=12, accepted_tokens=6, draft_seconds=0.1, target_seconds=0.4)
    runs = [replace(make_run("none", "p1", [1, 2], 1.0, **plain), seed=0),
            replace(make_run("none", "p1", [3, 4], 1.0, **plain), seed=1),  # a second repeat: its own seed
            replace(make_run("fast", "p1", [1, 2], 0.5, **spec), seed=0),
            replace(make_run("fast", "p1", [3, 5], 0.5, **spec), seed=1)]
    fields = summarise(runs, "fast", greedy=False)
    assert fields["seeded_mismatches"] == 1 and fields["greedy_mismatches"] is None
    assert summarise(runs, "none", greedy=False)["seeded_mismatches"] == 0


@dataclass
class Named:
    """What the report reads of a contender."""

    name: str
    num_draft_tokens: int = 4


def test_source_shares_of_a_combined_drafter_overall_and_per_category():
    """A hybrid's runs carry per-source counts: the report sums them over runs, overall and per category, into
    each source's share of the draft tokens and of the accepted ones; a single drafter's runs have none."""
    plain = dict(rounds=10, draft_tokens=0, accepted_tokens=0, draft_seconds=0.0, target_seconds=1.0)
    spec = dict(rounds=4, draft_tokens=10, accepted_tokens=4, draft_seconds=0.1, target_seconds=0.4)
    sources = {"p1": {"prompt-lookup": (8, 4), "retrieval": (2, 0)},
               "p2": {"prompt-lookup": (2, 2), "retrieval": (6, 2), "draft-model": (2, 0)}}
    runs = [replace(make_run("none", p, [1, 2], 1.0, **plain), category=p) for p in sources]
    runs += [replace(make_run("hybrid", p, [1, 2], 0.5, **spec, sources=counts), category=p)
             for p, counts in sources.items()]
    runs += [replace(make_run("prompt-lookup", p, [1, 2], 0.5, **spec), category=p) for p in sources]
    contenders = [Named(name) for name in ("none", "hybrid", "prompt-lookup")]
    report = build_report(runs, contenders, {"temperature": 0.0})
    _, hybrid, single = report["configs"]
    drafted = {name: sum(counts.get(name, (0, 0))[0] for counts in sources.values()) for name in hybrid["sources"]}
    accepted = {name: sum(counts.get(name, (0, 0))[1] for counts in sources.values()) for name in hybrid["sources"]}
    for name, fields in hybrid["sources"].items():
        assert fields["draft_tokens"] == drafted[name] and fields["accepted_tokens"] == accepted[name]
        assert fields["draft_share"] == pytest.approx(drafted[name] / sum(drafted.values()))
        assert fields["accepted_share"] == pytest.approx(accepted[name] / sum(accepted.values()))
    assert set(hybrid["sources"]) == {"prompt-lookup", "retrieval", "draft-model"}
    for fields in [hybrid, *hybrid["per_category"].values()]:
        assert sum(s["accepted_share"] for s in fields["sources"].values()) == pytest.approx(1.0)
        assert sum(s["draft_share"] for s in fields["sources"].values()) == pytest.approx(1.0)
    assert hybrid["per_category"]["p1"]["sources"]["prompt-lookup"]["accepted_share"] == 1.0  # retrieval: none taken
    assert "sources" not in single and all("sources" not in c for c in single["per_category"].values())
    assert "sources" not in report["configs"][0]
    table = markdown(report)
    assert "**where the drafts came from**" in table
    assert "| config | prompts | prompt-lookup | retrieval | draft-model |" in table
    assert "| hybrid | p1 | 100.0% (80.0%) | 0.0% (20.0%) | — |" in table  # p1 drafted 8 + 2, accepted 4 + 0
    assert "| prompt-lookup | all |" not in table


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-models")
    target = tiny_llama(seed=0, init_range=0.5)
    return (save_with_tokenizer(target, root / "target"),
            save_with_tokenizer(perturbed_copy(target, noise=0.03, seed=1), root / "draft"))


def write_prompt_files(folder) -> tuple:
    """A chat prompt file of two categories (copy: text that repeats; other) and a HumanEval-style one."""
    chat, code = folder / "prompts.jsonl", folder / "code.jsonl"
    chat.write_text("\n".join(json.dumps(r) for r in [
        {"question_id": 1, "category": "copy", "turns": ["w5 w9 w12 w9 w12 w40 w5 w9"]},
        {"question_id": 2, "category": "other", "turns": ["w3 w4 w60 w2"]},
        {"question_id": 3, "category": "copy", "turns": ["w7 w7 w8 w7 w7"]},
    ]) + "\n")
    code.write_text("\n".join(json.dumps({"task_id": f"H/{i}", "prompt": text})
                              for i, text in enumerate(["w8 w2 w8 w2 w8", "w1 w2 w3"])) + "\n")
    return chat, code


def assert_source_shares(config: dict, names: set[str]) -> None:
    """A combined drafter's report: its sources, each one's shares of the draft and of the accepted tokens summing to
    1 over the sources, overall and in each category (None where no source drafted, or none was accepted there: the
    hybrid's choices follow measured costs); the categories' counts add up to the overall ones."""
    assert set(config["sources"]) == names, config["drafter"]
    assert sum(s["accepted_tokens"] for s in config["sources"].values()) > 0  # the copies pay on text that repeats
    for fields in [config, *config["per_category"].values()]:
        for tokens, share in (("draft_tokens", "draft_share"), ("accepted_tokens", "accepted_share")):
            total = sum(s[tokens] for s in fields["sources"].values())
            if total:
                assert sum(s[share] for s in fields["sources"].values()) == pytest.approx(1.0)
                assert all(s[share] == pytest.approx(s[tokens] / total) for s in fields["sources"].values())
            else:
                assert all(s[share] is None for s in fields["sources"].values())
    for name, overall in config["sources"].items():
        for tokens in ("draft_tokens", "accepted_tokens"):
            assert overall[tokens] == sum(c["sources"][name][tokens] for c in config["per_category"].values())


def test_bench_smoke_on_tiny_models(tiny_models, tmp_path, capsys):
    chat, code = write_prompt_files(tmp_path)
    out = tmp_path / "report.json"
    target, draft = tiny_models
    status = main(["bench", "--prompts", str(chat), "--prompts", str(code), "--per-category", "1", "--model",
                 str(target), "--draft-model", str(draft),
                 "--drafters", "hybrid,prompt-lookup,draft-model,hf-prompt-lookup,hf-assisted", "--max-new-tokens",
                 "12", "--repeats", "2", "--out", str(out), "--no-progress", "--dtype", "float32"])
    printed = capsys.readouterr().out
    assert status == 0
    report = json.loads(out.read_text())
    assert report["settings"]["prompts"] == [str(chat), str(code)] and report["settings"]["num_prompts"] == 3
    names = [c["drafter"] for c in report["configs"]]
    assert names == ["none", "hybrid", "prompt-lookup", "draft-model", "hf-prompt-lookup", "hf-assisted"]
    for config in report["configs"]:
        assert {"drafter", "num_draft_tokens", "temperature", "tokens_per_second", "speedup", "acceptance_rate",
                "mean_accepted_length", "greedy_mismatches", "per_category"} <= set(config)
        assert set(config["per_category"]) == {"copy", "other", "humaneval"}  # the first of each, from both files
        assert config["runs"] == 6 and config["tokens_per_second"] > 0
        assert config["greedy_mismatches"] == 0  # every configuration is exact at temperature 0
        assert ("sources" in config) == (config["drafter"] == "hybrid")  # only a combined drafter has sources
    assert_source_shares(report["configs"][1], {"prompt-lookup", "retrieval", "draft-model"})
    draft_model = report["configs"][3]
    assert 0 < draft_model["acceptance_rate"] <= 1 and draft_model["ideal_speedup"] > 0
    assert "| draft-model |" in printed and "**copy**" in printed and "**humaneval**" in printed
    assert "**where the drafts came from**" in printed and "| hybrid | humaneval |" in printed
    roofline = report["roofline"]
    assert sorted(map(int, roofline["score_ratios"])) == list(range(1, 17))
    assert roofline["floor_seconds"] > 0 and roofline["step_seconds"] > 0
    assert "**roofline — float32" in printed and "| cost of k+1 positions / one |" in printed
    assert "Per-position acceptance a chain needs at these costs" in printed


def test_bench_by_default_sets_the_hybrid_beside_single_drafters(tiny_models, tmp_path):
    """No --drafters: plain decoding, the hybrid (the default drafter) and prompt lookup. A tiny target is not
    several times the default model's size, so the hybrid drafts from its copies alone."""
    chat, code = write_prompt_files(tmp_path)
    out = tmp_path / "report.json"
    assert main(["bench", "--prompts", f"{chat},{code}", "--category", "copy,humaneval", "--limit", "3",
                 "--model", str(tiny_models[0]), "--max-new-tokens", "12", "--out", str(out), "--no-progress",
                 "--dtype", "float32"]) == 0
    report = json.loads(out.read_text())
    assert [c["drafter"] for c in report["configs"]] == ["none", "hybrid", "prompt-lookup"]
    assert report["settings"]["categories"] == ["copy", "humaneval"] and report["settings"]["num_prompts"] == 3
    assert report["settings"]["draft_found"] is False and report["settings"]["draft_model"] is None
    hybrid = report["configs"][1]
    assert set(hybrid["per_category"]) == {"copy", "humaneval"} and hybrid["greedy_mismatches"] == 0
    assert_source_shares(hybrid, {"prompt-lookup", "retrieval"})


def test_seeded_bench_reports_no_seeded_mismatch(tiny_models, tmp_path, monkeypatch):
    """At temperature 0.7 the invariant sampler gives every drafter the tokens plain sampling gives for each
    prompt's seed: the seeded-mismatch column reads 0, with drafts accepted and rejected. No --draft-model: the
    draft model found for the hybrid (here the tiny draft, standing in for the default model beside a target several
    times its size) drafts for the hybrid and for the draft-model contender alike."""
    from exactspec import loading

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "copy", "turns": ["w5 w9 w12 w9 w12 w40 w5 w9"]})
                       + "\n" + json.dumps({"question_id": 2, "category": "other", "turns": ["w3 w4 w60 w2"]}) + "\n")
    out = tmp_path / "report.json"
    target, draft = tiny_models
    monkeypatch.setattr(loading, "found_draft_model", lambda target_path: draft)
    assert main(["bench", "--prompts", str(prompts), "--model", str(target),
                 "--drafters", "hybrid,prompt-lookup,draft-model,retrieval:auto", "--max-new-tokens", "16",
                 "--repeats", "2", "--temperature", "0.7", "--out", str(out), "--no-progress", "--dtype",
                 "float32"]) == 0
    report = json.loads(out.read_text())
    assert report["settings"]["sampling"] == "invariant"
    assert report["settings"]["draft_found"] is True and report["settings"]["draft_model"] == str(draft)
    for config in report["configs"]:
        assert config["seeded_mismatches"] == 0 and config["greedy_mismatches"] is None, config["drafter"]
    assert set(report["configs"][1]["sources"]) == {"prompt-lookup", "retrieval", "draft-model"}
    draft_model = report["configs"][3]
    assert draft_model["drafter"] == "draft-model" and 0 < draft_model["acceptance_rate"] < 1


def test_the_invariance_bench_finds_every_precision_invariant_and_prices_it(tiny_models, capsys):
    from exactspec.bench.invariance import main as invariance

    invariance(["--model", str(tiny_models[0]), "--precisions", "float32,float16", "--cost", "--sampler"])
    printed = capsys.readouterr().out
    assert "| exactspec float32 | 0 |" in printed and "| exactspec float16 | 0 |" in printed
    assert printed.count("the libraries' kernels |") == 2  # measured, whatever they give on this CPU
    assert printed.count("| row kernels |") == 2
    assert printed.count("x) |") == 16  # 2 precisions x 2 references x 4 sizes
    assert "verifying a round of k = 4 (vocabulary 64" in printed


@pytest.mark.parametrize("args, message", [
    (["--drafters", "none,magic"], "unknown drafter"),
    (["--drafters", "draft-model"], "no trained draft-model drafter ships for this target"),
    (["--drafters", "hf-assisted"], "needs --draft-model"),
    (["--drafters", "eagle", "--drafter-path", "/nonexistent"], "no readable"),
    (["--num-draft-tokens", "many"], "an integer or one of auto, heuristic"),
    (["--drafters", "retrieval:lots"], "an integer or one of auto, heuristic"),
    (["--drafters", "retrieval", "--datastore", "/nonexistent"], "no datastore at"),
    (["--repeats", "0"], "repeats"),
    (["--per-category", "0"], "--per-category must be >= 1"),
    (["--category", "qa,rag"], "of category qa, rag"),
    (["--prompts", "/nonexistent.jsonl"], "prompt file not found"),
])
def test_bench_bad_input(tiny_models, tmp_path, capsys, args, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"turns": ["w5 w6"]}\n')
    code = main(["bench", "--prompts", str(prompts), "--model", str(tiny_models[0]), "--no-progress", *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1


def test_figures_smoke_on_tiny_models(tiny_models, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"turns": ["w5 w9 w12 w9 w12 w40 w5 w9"]}\n{"turns": ["w3 w4 w60 w2"]}\n')
    target, draft = tiny_models
    code = main(["figures", "--out", str(tmp_path / "figs"), "--model", str(target), "--draft-model", str(draft),
                 "--prompts", str(prompts), "--max-new-tokens", "8", "--repeats", "1", "--max-batch", "4"])
    assert code == 0, capsys.readouterr().err
    names = sorted(p.name for p in (tmp_path / "figs").iterdir())
    assert names == ["accept_or_resample.png", "many_drafts_one_weight_streaming.png",
                     "surplus_only_free_at_small_batch.png", "tokens_per_round.png"]
    for name in names:
        assert (tmp_path / "figs" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_first_difference_of_two_outputs():
    from exactspec.bench.agreement import first_difference

    assert first_difference([4, 5, 6], [4, 5, 6]) is None
    assert first_difference([4, 5, 6], [4, 7, 6]) == 1
    assert first_difference([4, 5], [4, 5, 6]) == 2  # one stopped early: they part where it stopped


def test_accepted_lengths_are_the_runs_of_agreement_capped_at_k():
    from exactspec.bench.exits import accepted_lengths

    # runs starting at each position: [2, 1, 0, 1] and [0, 3, 2, 1] -> capped at k = 1: 3/4 + 3/4; k = 2: ...
    rows = [[True, True, False, True], [False, True, True, True]]
    lengths = accepted_lengths(rows, max_k=3)
    assert lengths == pytest.approx([6 / 8, (2 + 1 + 0 + 1 + 0 + 2 + 2 + 1) / 8, (2 + 1 + 0 + 1 + 0 + 3 + 2 + 1) / 8])
    assert accepted_lengths([], max_k=2) == [0.0, 0.0]


def test_bench_exits_on_a_tiny_target(tiny_models, tmp_path, capsys):
    """The plain exit at each layer, and its costs, on a 2-layer target; the break-even arithmetic is the report's
    own numbers. (Trained adapters are measured at their layer: tests/test_train.py trains one.)"""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"turns": ["w5 w9 w12 w9"]}\n{"turns": ["w3 w4 w60"]}\n')
    out = tmp_path / "exits.json"
    assert main(["bench-exits", "--prompts", str(prompts), "--model", str(tiny_models[0]), "--max-new-tokens", "10",
                 "--layers", "1", "--out", str(out), "--dtype", "float32"]) == 0
    report = json.loads(out.read_text())
    (layer,) = report["layers"]
    assert layer["layer"] == 1 and layer["trained"] is None and len(layer["untrained"]) == 4
    assert 0 <= layer["untrained"][0] <= 1 and layer["untrained"] == sorted(layer["untrained"])
    assert layer["draft_ms"] > 0 and len(layer["verify_ms"]) == 4 and layer["decode_ms"] > 0
    assert layer["break_even"] == pytest.approx((layer["draft_ms"] + layer["verify_ms"][0]) / layer["decode_ms"] - 1)
    assert "| 1 |" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--layers", "2"], "--layers must be in 1..1"),
    (["--layers", "one"], "comma-separated layer counts"),
    (["--drafter-path", "/nonexistent"], "no readable"),
])
def test_bench_exits_bad_input(tiny_models, tmp_path, capsys, args, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"turns": ["w5 w6"]}\n')
    code = main(["bench-exits", "--prompts", str(prompts), "--model", str(tiny_models[0]), *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1


def soak_with(rss: list[float]):
    from exactspec.bench.soak import Sample, SoakResult

    return SoakResult(minutes=1, clients=1, samples=[Sample(i, value, i) for i, value in enumerate(rss)])


def test_the_soak_calls_memory_levelled_only_where_its_last_quarter_stops_growing():
    assert soak_with([700, 800, 850, 860, 862, 862, 862, 862, 863]).levelled  # +150 first, +1 last
    assert not soak_with([700, 720, 740, 760, 780, 800, 820, 840, 860]).levelled  # +40 first, +40 last
    assert not soak_with([700, 700, 700, 700, 700, 700, 700, 720, 760]).levelled  # flat, then rising


def test_each_soak_request_kind_gets_the_status_it_must(tiny):  # noqa: F811
    """Against a live server, every kind of request the soak sends is answered with the status it expects."""
    from test_server import start_server

    from exactspec.bench.soak import KINDS, body_for, send

    server = start_server(tiny)
    try:
        statuses = {kind: send(server.port, kind, *body_for(kind, "Say hi.", 4)) for kind in KINDS}
    finally:
        server.shutdown(timeout=5)
    assert statuses == {kind: min(expected) for kind, (_, expected) in KINDS.items()}
