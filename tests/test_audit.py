"""``specdec audit`` on specdec's own server, a tiny structured model (each token has a likely successor, 3:1):
it passes the server speculating against it not speculating, and against the exact distribution; it rejects a
server whose verifier accepts a draft token with probability min(1, 1.2 p/q); greedy identity; bad input.

Every audit here runs at alpha = 0.001 with fixed seeds (deterministic): a correct server fails with probability
at most 0.1%, and the wrong one, whose first token's distribution is ~0.1 away in total variation, is rejected
with power over 99% at N = 800 (the detectable distance the report gives is ~0.08)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from scipy.stats import chi2
from test_server import start_server
from tiny import save_with_tokenizer, structured_llama

import specdec.verify
from specdec.audit import Sampling, chi2_sf, detectable_tv, exact_outcomes, pooled_bins, two_sample
from specdec.backends import LlamaRuntime
from specdec.cli import main
from specdec.sampling import SamplingParams

N = "800"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoTokenizer

    model = structured_llama(seed=0).double()
    path = save_with_tokenizer(model, tmp_path_factory.mktemp("audit") / "structured")
    return model, AutoTokenizer.from_pretrained(path), path


@pytest.fixture(scope="module")
def servers(model):
    always = start_server(model[:2], drafter="prompt-lookup", speculation="always")
    never = start_server(model[:2], drafter="prompt-lookup", speculation="never")
    yield always, never
    always.shutdown(timeout=5)
    never.shutdown(timeout=5)


@pytest.fixture(scope="module")
def prompt(model) -> str:
    """A walk along the model's likeliest successors, then its first two tokens again: prompt lookup drafts the
    walk's continuation, which the model gives high probability."""
    runtime = LlamaRuntime(model[0])
    walk = [7]
    for _ in range(5):
        runtime.rollback(0)
        walk.append(int(runtime.extend(walk, 1)[0].argmax()))
    return " ".join(f"w{t}" for t in walk + walk[:2])


def audit(*args: str) -> tuple[int, dict]:
    import tempfile
    from pathlib import Path

    out = Path(tempfile.mkdtemp()) / "report.json"
    code = main(["audit", *args, "--no-progress", "--out", str(out)])
    return code, json.loads(out.read_text()) if out.exists() else {}


@pytest.fixture
def wrong_verifier(monkeypatch):
    """Accept a draft token with probability min(1, 1.2 p/q): a subtly inexact server."""
    exact = specdec.verify.acceptance_probs
    monkeypatch.setattr(specdec.verify, "acceptance_probs", lambda *args: (exact(*args) * 1.2).clamp(max=1.0))


def test_speculation_always_against_never_passes(servers, prompt, capsys):
    always, never = servers
    code, report = audit("--a", always.url, "--b", never.url, "--prompt", prompt, "--samples", N, "--tokens", "2")
    assert code == 0, capsys.readouterr().out
    row = report["prompts"][0]
    assert row["bins"] >= 3 and row["detectable_tv"] < 0.15 and report["errors"] == 0


def test_a_wrong_verifier_is_rejected(servers, prompt, wrong_verifier, model, capsys):
    always, never = servers
    code, report = audit("--a", always.url, "--b", never.url, "--prompt", prompt, "--samples", N, "--tokens", "2")
    assert code == 1 and report["rejected"] and "REJECTED" in capsys.readouterr().out
    code, _ = audit("--a", always.url, "--reference", "local", "--reference-model", str(model[2]), "--prompt",
                    prompt, "--samples", N, "--tokens", "2")
    assert code == 1


def test_the_server_passes_against_the_exact_distribution(servers, prompt, model):
    always, _ = servers
    code, report = audit("--a", always.url, "--reference", "local", "--reference-model", str(model[2]), "--prompt",
                         prompt, "--samples", N, "--tokens", "2")
    assert code == 0 and report["mode"].startswith("one-sample")


def test_greedy_identity_at_temperature_0(servers, prompt, model):
    always, never = servers
    code, report = audit("--a", always.url, "--b", never.url, "--prompt", prompt, "--temperature", "0",
                         "--tokens", "3")
    assert code == 0 and report["prompts"][0]["identical"]
    code, report = audit("--a", always.url, "--reference", "local", "--reference-model", str(model[2]),
                         "--prompt", prompt, "--temperature", "0", "--tokens", "3")
    assert code == 0


def test_bad_input_is_one_line_and_exit_2(servers, model, capsys):
    always, never = servers
    other = start_server(model[:2], api_key="sesame")
    try:
        cases = [
            (["--a", "http://127.0.0.1:9", "--b", never.url], "cannot reach"),
            (["--a", always.url], "--b URL) or --reference local"),
            (["--a", always.url, "--b", never.url, "--tokens", "4"], "--tokens"),
            (["--a", always.url, "--b", never.url, "--samples", "5"], "too few for any bin"),
            (["--a", always.url, "--b", other.url, "--prompt", "w3"], "cannot reach"),  # 401: no key
            (["--a", always.url, "--b", never.url, "--model", "other", "--prompt", "w3"], "refuses"),
        ]
        for args, message in cases:
            assert main(["audit", *args, "--no-progress"]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and message in err, err
    finally:
        other.shutdown(timeout=5)


def test_the_statistics():
    for statistic, df in ((3.0, 1), (20.0, 10), (55.5, 40)):
        assert chi2_sf(statistic, df) == pytest.approx(chi2.sf(statistic, df), rel=1e-9)
    totals = {("a",): 50, ("b",): 30, ("c",): 4, ("d",): 3, ("e",): 2}
    assert pooled_bins(totals, 5) == [[("a",)], [("b",)], [("c",), ("d",), ("e",)]]
    assert pooled_bins({("a",): 50, ("b",): 3}, 5) == [[("a",), ("b",)]]
    # more samples detect smaller differences
    assert detectable_tv([0.5, 0.3, 0.2], 4000, 2, 1e-3, True) < detectable_tv([0.5, 0.3, 0.2], 400, 2, 1e-3, True)
    same = two_sample(Counter({("a",): 500, ("b",): 500}), Counter({("a",): 510, ("b",): 490}), 1e-3)
    apart = two_sample(Counter({("a",): 600, ("b",): 400}), Counter({("a",): 400, ("b",): 600}), 1e-3)
    assert same.p_value > 0.5 and apart.p_value < 1e-10


def test_the_exact_reference_sums_to_one(model, prompt):
    exact = exact_outcomes(str(model[2]), prompt, Sampling(tokens=2, params=SamplingParams(temperature=1.0)), min_probability=0.0)
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-9)
    assert torch.tensor(list(exact.values())).max() > 0.3  # the walk's likeliest continuation
