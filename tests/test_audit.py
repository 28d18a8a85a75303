"""``exactspec audit`` on exactspec's own server, a tiny structured model (each token has a likely successor, 3:1):
it passes the server speculating against it not speculating, and against the exact distribution; it rejects a
server whose verifier accepts a draft token with probability min(1, 1.2 p/q); greedy identity; bad input.

Every audit here runs at alpha = 0.001 with fixed seeds (deterministic): a correct server fails with probability
at most 0.1%, and the wrong one, whose first token's distribution is ~0.1 away in total variation, is rejected
with power over 99% at N = 800 (the detectable distance the report gives is ~0.08)."""

from __future__ import annotations

import json
import math
import sys
from collections import Counter
from statistics import NormalDist

import numpy as np
import pytest
import torch
from scipy.stats import chi2
from test_server import start_server
from tiny import save_with_tokenizer, structured_llama

import exactspec.verify
from exactspec.audit import Sampling, chi2_power, chi2_sf, detectable_tv, exact_outcomes, pooled_bins, two_sample
from exactspec.backends import LeanRuntime
from exactspec.cli import main
from exactspec.sampling import SamplingParams

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
    runtime = LeanRuntime(model[0])
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
    exact = exactspec.verify.acceptance_probs
    monkeypatch.setattr(exactspec.verify, "acceptance_probs", lambda *args: (exact(*args) * 1.2).clamp(max=1.0))


def test_speculation_always_against_never_passes(servers, prompt, capsys):
    always, never = servers
    code, report = audit("--a", always.url, "--b", never.url, "--prompt", prompt, "--samples", N, "--tokens", "2")
    assert code == 0, capsys.readouterr().out
    row = report["prompts"][0]
    assert row["bins"] >= 3 and row["detectable_tv"] < 0.15 and report["errors"] == 0


def test_a_wrong_verifier_is_rejected(servers, prompt, wrong_verifier, model, capsys):
    always, never = servers
    standard = ("--sampling", "standard")  # the rule the wrong verifier bends
    code, report = audit("--a", always.url, "--b", never.url, "--prompt", prompt, "--samples", N, "--tokens", "2",
                         *standard)
    assert code == 1 and report["rejected"] and "REJECTED" in capsys.readouterr().out
    code, _ = audit("--a", always.url, "--reference", "local", "--reference-model", str(model[2]), "--prompt",
                    prompt, "--samples", N, "--tokens", "2", *standard)
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


def test_without_scipy_the_audit_refuses_in_one_line(servers, prompt, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "scipy", None)  # what a missing package looks like to import
    monkeypatch.setitem(sys.modules, "scipy.stats", None)
    assert main(["audit", "--a", "http://127.0.0.1:9", "--b", "http://127.0.0.1:9", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs scipy: pip install 'exactspec[audit]'" in err, err  # before any request
    always, never = servers  # temperature 0 compares greedy text: no statistics, no scipy
    assert audit("--a", always.url, "--b", never.url, "--prompt", prompt, "--temperature", "0")[0] == 0


def test_the_statistics():
    totals = {("a",): 50, ("b",): 30, ("c",): 4, ("d",): 3, ("e",): 2}
    assert pooled_bins(totals, 5) == [[("a",)], [("b",)], [("c",), ("d",), ("e",)]]
    assert pooled_bins({("a",): 50, ("b",): 3}, 5) == [[("a",), ("b",)]]
    # more samples detect smaller differences
    assert detectable_tv([0.5, 0.3, 0.2], 4000, 2, 1e-3, True) < detectable_tv([0.5, 0.3, 0.2], 400, 2, 1e-3, True)
    same = two_sample(Counter({("a",): 500, ("b",): 500}), Counter({("a",): 510, ("b",): 490}), 1e-3)
    apart = two_sample(Counter({("a",): 600, ("b",): 400}), Counter({("a",): 400, ("b",): 600}), 1e-3)
    assert same.p_value > 0.5 and apart.p_value < 1e-10
    assert detectable_tv([0.5, 0.3, 0.2], 400, 2, 0.9, True) == 0.0  # a level above the power: any change will do


def test_chi2_sf_and_power_against_closed_forms():
    normal = NormalDist()
    for x in (0.0, 0.5, 3.0, 20.0, 117.5):
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-12)  # df 2: the exponential of mean 2
        assert chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-12)  # df 1: a squared normal
    assert chi2_sf(5.0, 0) == 1.0  # one bin: nothing to test
    for df in (1, 2, 4, 11, 40):
        for alpha in (0.05, 1e-3, 1e-6):  # no change: the test rejects at its level (the quantile inverts the sf)
            assert chi2_power(0.0, df, alpha) == pytest.approx(alpha, rel=1e-9)
    for alpha in (0.05, 1e-3):  # df 1: the statistic is (Z + sqrt(lambda))^2, rejected beyond the normal quantile
        c = normal.inv_cdf(1 - alpha / 2)
        for lam in (0.5, 4.0, 17.0, 40.0):
            shift = math.sqrt(lam)
            assert chi2_power(lam, 1, alpha) == pytest.approx(normal.cdf(-c - shift) + normal.cdf(shift - c), rel=1e-9)


def test_the_detectable_tv_has_80_percent_power_by_simulation():
    """The figure the audit reported until it used scipy, recomputed as it computed it: the non-central chi-square
    simulated as a sum of squared normals, the first shifted by sqrt(lambda), here at the lambda that the detectable
    TV stands for (the docstring's lambda = n d^2 (1/p1 + 1/p2), halved for two samples). Its rejection rate is
    binomial around 80%: 5 standard errors either side, over the 6 cases a false alarm with probability < 4e-6."""
    rng = np.random.default_rng(20240601)
    draws = 200_000
    tolerance = 5 * math.sqrt(0.8 * 0.2 / draws)
    cases = [([0.5, 0.3, 0.2], 4000, 2, 1e-3, True), ([0.6, 0.4], 800, 1, 1e-3, True),
             ([0.4, 0.3, 0.1, 0.1, 0.1], 800, 4, 1e-3, False), ([0.7, 0.3], 400, 1, 0.05, False),
             ([0.2] * 5, 1000, 11, 1e-3 / 3, True), ([0.3, 0.3] + [0.01] * 40, 300, 41, 1e-4, False)]
    for probs, n, df, alpha, two in cases:
        tv = detectable_tv(probs, n, df, alpha, two)
        lam = n * tv ** 2 * (1 / probs[0] + 1 / probs[1]) / (2 if two else 1)
        normals = rng.standard_normal((draws, df))
        normals[:, 0] += math.sqrt(lam)
        power = float(((normals ** 2).sum(1) > chi2.isf(alpha, df)).mean())
        assert abs(power - 0.8) < tolerance, (probs, n, df, alpha, two, tv, power)


def test_the_exact_reference_sums_to_one(model, prompt):
    sampling = Sampling(tokens=2, params=SamplingParams(temperature=1.0))
    exact = exact_outcomes(str(model[2]), prompt, sampling, min_probability=0.0)
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-9)
    assert torch.tensor(list(exact.values())).max() > 0.3  # the walk's likeliest continuation
