"""``exactspec audit``: does an OpenAI-compatible server sample from the distribution it should?

Two-sample mode (``--a URL --b URL``) draws N completions per prompt from each endpoint, with distinct seeds, and
tests whether the two give the same distribution of outcomes: the first T tokens (as the server names them in
``logprobs.tokens``) and whether generation stopped within them (the end token, which the tokens do not list, among
the first T that ``usage`` counts). Each completion asks for ``--lookahead`` tokens more than T, so that a
speculating server drafts over the T tokens audited (asked for exactly T, it would have room to draft only T-1 of
them).
One-sample mode (``--a URL --reference local``) tests the endpoint against the exact distribution that exactspec's
own runtime computes for the model. At temperature 0 both compare greedy output and report the first divergence.

The test is Pearson's chi-square, outcomes pooled into bins expected at least 5 times, one test per prompt,
Bonferroni-corrected over the prompts: a correct server is rejected with probability at most ``--alpha``. A pass is
reported with the smallest total-variation distance the run would have detected with 80% power.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from http.client import HTTPException
from pathlib import Path

from exactspec.errors import UsageError
from exactspec.sampling import SamplingParams

MIN_EXPECTED = 5.0  # a bin's expected count, at least
POWER = 0.8
Outcome = tuple[tuple[str, ...], bool]  # the first T tokens, and whether generation stopped within them


class ServerError(Exception):
    """An endpoint answered with an error (its status and message)."""


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server, reached through bench-serve's HTTP client."""

    url: str
    api_key: str | None = None
    timeout: float = 120.0

    def post(self, path: str, body: dict) -> dict:
        return self._call("POST", path, body)

    def get(self, path: str) -> dict:
        return self._call("GET", path, None)

    def _call(self, method: str, path: str, body: dict | None) -> dict:
        from exactspec.bench.serve import host_port, http_request

        host, port = host_port(self.url)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        status, payload = http_request(host, port, method, path, body, self.timeout, headers)
        if status != 200:
            try:
                message = json.loads(payload)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = payload[:200].decode(errors="replace")
            raise ServerError(f"{self.url} answered {status}: {message}")
        return json.loads(payload)


@dataclass(frozen=True)
class Sampling:
    """What the audit asks each endpoint for: the first T tokens under ``params``, and ``lookahead`` more."""

    tokens: int = 1  # T: the joint of the first T tokens
    lookahead: int = 4  # tokens asked for beyond T, room for a speculating server to draft over the T
    params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=1.0))
    method: str | None = None  # exactspec's "sampling" field (invariant or standard); None: the server's default


@dataclass
class Draws:
    """One endpoint's outcomes for one prompt, and the requests that failed."""

    outcomes: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)  # message -> requests

    @property
    def n(self) -> int:
        return sum(self.outcomes.values())


@dataclass(frozen=True)
class TestResult:
    statistic: float
    df: int
    p_value: float
    bins: int
    detectable_tv: float | None  # the smallest total-variation distance detected with 80% power


def body(model: str, prompt: str, sampling: Sampling, seed: int | None) -> dict:
    params = sampling.params
    request = {"model": model, "prompt": prompt, "max_tokens": sampling.tokens + sampling.lookahead,
               "temperature": params.temperature, "top_p": params.top_p, "logprobs": 0}
    if params.top_k:
        request["top_k"] = params.top_k
    if seed is not None:
        request["seed"] = seed
    if sampling.method is not None:
        request["sampling"] = sampling.method
    return request


def outcome(answer: dict, sampling: Sampling) -> Outcome:
    choice = answer["choices"][0]
    tokens = (choice.get("logprobs") or {}).get("tokens")
    if tokens is None:
        raise ServerError("the answer has no logprobs.tokens: the audit needs the server's logprobs")
    generated = (answer.get("usage") or {}).get("completion_tokens", len(tokens))  # with the end token, unlisted
    stopped = choice.get("finish_reason") == "stop" and generated <= sampling.tokens
    return tuple(tokens[: sampling.tokens]), stopped


def draw(endpoint: Endpoint, model: str, prompt: str, sampling: Sampling, seeds: list[int | None],
         concurrency: int, tick=lambda: None) -> Draws:
    """One completion per seed, ``concurrency`` at a time; failures counted by message, not raised."""
    draws = Draws()

    lock = threading.Lock()

    def one(seed: int | None) -> None:
        try:
            got = outcome(endpoint.post("/v1/completions", body(model, prompt, sampling, seed)), sampling)
            with lock:
                draws.outcomes[got] += 1
        except (ServerError, OSError, HTTPException, KeyError, IndexError, ValueError) as error:
            with lock:
                draws.errors[str(error).splitlines()[0][:200]] += 1
        tick()

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, seeds))
    return draws


# --- statistics ---------------------------------------------------------------------------------------------------


def scipy_stats():
    """``scipy.stats``, imported when first needed: the audit's statistics come from it (the ``audit`` extra)."""
    try:
        import scipy.stats
    except ImportError:
        raise UsageError("exactspec audit needs scipy: pip install 'exactspec[audit]'") from None
    return scipy.stats


def chi2_sf(statistic: float, df: int) -> float:
    """P(X > statistic) for X chi-square with ``df`` degrees of freedom (1 for no degree of freedom: one bin)."""
    return float(scipy_stats().chi2.sf(statistic, df)) if df > 0 else 1.0


def chi2_power(noncentrality: float, df: int, alpha: float) -> float:
    """The probability that the chi-square test at level ``alpha`` rejects when its statistic is non-central
    chi-square with ``df`` degrees of freedom and parameter ``noncentrality`` (at 0, the level itself)."""
    stats = scipy_stats()
    return float(stats.ncx2.sf(stats.chi2.isf(alpha, df), df, noncentrality))  # isf(alpha): ppf(1 - alpha)


def pooled_bins(totals: Counter, threshold: float) -> list[list[Outcome]]:
    """Outcomes grouped into bins whose pooled total reaches ``threshold``: each outcome that does alone, the rest
    together (merged into the smallest kept bin if they still fall short)."""
    ranked = sorted(totals, key=lambda o: (-totals[o], o))
    bins = [[o] for o in ranked if totals[o] >= threshold]
    rest = [o for o in ranked if totals[o] < threshold]
    if rest:
        if sum(totals[o] for o in rest) >= threshold or not bins:
            bins.append(rest)
        else:
            bins[-1] += rest
    return bins


def two_sample(a: Counter, b: Counter, alpha: float) -> TestResult:
    """Pearson's chi-square test of homogeneity of two samples' outcomes."""
    n_a, n_b = sum(a.values()), sum(b.values())
    n = n_a + n_b
    totals = a + b
    # a bin's smaller expected count is its total x min(n_a, n_b) / n
    bins = pooled_bins(totals, MIN_EXPECTED * n / min(n_a, n_b))
    statistic = 0.0
    for group in bins:
        column = sum(totals[o] for o in group)
        for counts, row in ((a, n_a), (b, n_b)):
            expected = row * column / n
            observed = sum(counts[o] for o in group)
            statistic += (observed - expected) ** 2 / expected
    df = len(bins) - 1
    probs = sorted((sum(totals[o] for o in g) / n for g in bins), reverse=True)
    return TestResult(statistic, df, chi2_sf(statistic, df), len(bins),
                      detectable_tv(probs, n_per_sample=min(n_a, n_b), df=df, alpha=alpha, two_sample=True))


def one_sample(observed: Counter, exact: dict[Outcome, float], alpha: float) -> TestResult:
    """Pearson's chi-square goodness of fit of the outcomes to the exact distribution."""
    n = sum(observed.values())
    expected_counts = Counter({o: p * n for o, p in exact.items()})
    for o in observed:
        expected_counts.setdefault(o, 0.0)  # an outcome the model cannot produce
    bins = pooled_bins(expected_counts, MIN_EXPECTED)
    statistic = 0.0
    for group in bins:
        expected = sum(expected_counts[o] for o in group)
        seen = sum(observed[o] for o in group)
        if expected > 0:
            statistic += (seen - expected) ** 2 / expected
        elif seen:
            statistic = math.inf
    df = len(bins) - 1
    probs = sorted((sum(expected_counts[o] for o in g) / n for g in bins), reverse=True)
    return TestResult(statistic, df, chi2_sf(statistic, df) if math.isfinite(statistic) else 0.0, len(bins),
                      detectable_tv(probs, n_per_sample=n, df=df, alpha=alpha, two_sample=False))


def detectable_tv(probs: list[float], n_per_sample: int, df: int, alpha: float, two_sample: bool) -> float | None:
    """The smallest total-variation distance the test detects with 80% power at level ``alpha``, for the most
    detectable kind of change: probability d moved between the two likeliest bins. The chi-square statistic is then
    non-central with parameter lambda = n (d^2/p1 + d^2/p2) (halved for two samples of n each); lambda is the root of
    the exact power function, ``chi2_power(lambda) = 0.8``."""
    if df < 1 or len(probs) < 2:
        return None
    from scipy.optimize import brentq

    high = 1.0
    while chi2_power(high, df, alpha) < POWER:
        high *= 2
    lam = brentq(lambda lam: chi2_power(lam, df, alpha) - POWER, 0.0, high) if alpha < POWER else 0.0
    p1, p2 = probs[0], probs[1]
    per_d2 = n_per_sample * (1 / p1 + 1 / p2) / (2 if two_sample else 1)
    return min(1.0, math.sqrt(lam / per_d2))


# --- the exact reference ------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _reference(model: str | None):
    """exactspec's float32 runtime of ``model``, its tokenizer and its EOS ids (loaded once)."""
    from exactspec.loading import load_target

    loaded = load_target(model, dtype="float32", backend="lean")
    return loaded.runtime, loaded.target.tokenizer, loaded.stop_ids


def exact_outcomes(model: str | None, prompt: str, sampling: Sampling, min_probability: float = 1e-7
                   ) -> dict[Outcome, float]:
    """The exact distribution of outcomes from exactspec's lean runtime of ``model``: every token sequence of up to T
    tokens with probability above ``min_probability`` (the rest, a negligible mass, left out), decoded to text."""
    import torch

    from exactspec.backends import sync
    from exactspec.sampling import logits_to_probs
    from exactspec.vocabularies import TokenText, token_name

    runtime, tokenizer, eos = _reference(model)
    prompt_ids = list(tokenizer.encode(prompt))
    text = TokenText(tokenizer, runtime.vocab_size)
    exact: Counter = Counter()

    def names(sequence: list[int]) -> tuple[str, ...]:  # as exactspec's server names them: no control token's
        return tuple(token_name(text.pieces[t]) for t in sequence if t not in text.control)

    def expand(prefix: list[int], probability: float) -> None:
        probs = logits_to_probs(sync(runtime, prompt_ids + prefix, 1)[0].double(), sampling.params)
        for token in torch.nonzero(probs * probability > min_probability).flatten().tolist():
            p = probability * float(probs[token])
            sequence = prefix + [token]
            if token in eos or len(sequence) == sampling.tokens:
                exact[(names(sequence), token in eos)] += p
            else:
                expand(sequence, p)

    expand([], 1.0)
    return dict(exact)


# --- the command ----------------------------------------------------------------------------------------------------


def served_model(endpoint: Endpoint) -> str:
    try:
        models = endpoint.get("/v1/models")["data"]
    except (ServerError, OSError, HTTPException, KeyError, TypeError, ValueError) as error:
        raise UsageError(f"cannot reach {endpoint.url}: {str(error).splitlines()[0] or type(error).__name__}"
                         ) from None
    if not models:
        raise UsageError(f"{endpoint.url} serves no model")
    return models[0]["id"]


def check_args(args) -> Sampling:
    if not 1 <= args.tokens <= 3:
        raise UsageError(f"--tokens must be 1, 2 or 3, got {args.tokens}")
    if args.samples < 1 or args.concurrency < 1:
        raise UsageError("--samples and --concurrency must be >= 1")
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)  # checks them
    if not params.greedy and args.samples < 2 * MIN_EXPECTED:
        raise UsageError(f"--samples {args.samples} is too few for any bin: a bin needs {MIN_EXPECTED:g} expected "
                         f"outcomes; take at least {2 * MIN_EXPECTED:g} (and hundreds for any power)")
    if not 0 < args.alpha < 1:
        raise UsageError(f"--alpha must be in (0, 1), got {args.alpha}")
    if (args.b is None) == (args.reference is None):
        raise UsageError("give a second endpoint (--b URL) or --reference local")
    if args.reference not in (None, "local"):
        raise UsageError(f"--reference takes local, got {args.reference!r}")
    if args.lookahead < 0:
        raise UsageError(f"--lookahead must be >= 0, got {args.lookahead}")
    return Sampling(tokens=args.tokens, lookahead=args.lookahead, params=params, method=args.sampling)


def prompts_of(args) -> list[str]:
    if args.prompt is not None:
        return [args.prompt]
    from exactspec.bench.prompts import read_prompts

    return [p.text for p in read_prompts(args.prompts, limit=args.limit)]


def run_audit(args) -> int:
    sampling = check_args(args)
    if not sampling.params.greedy:
        scipy_stats()  # missing: one line now, not after the run
    api_key = os.environ.get(args.api_key_env) or None
    a = Endpoint(args.a, api_key)
    b = Endpoint(args.b, api_key) if args.b else None
    served = [served_model(endpoint) for endpoint in [a] + ([b] if b else [])]
    model = args.model or served[0]
    if args.model is None and len(set(served)) > 1:
        raise UsageError(f"{a.url} serves {served[0]!r} but {b.url} serves {served[1]!r}: pass --model")
    prompts = prompts_of(args)
    for endpoint in [a] + ([b] if b else []):  # a server that refuses the parameters: one line, before the run
        try:
            endpoint.post("/v1/completions", body(model, prompts[0], sampling, args.seed))
        except (ServerError, OSError, HTTPException) as error:
            raise UsageError(f"{endpoint.url} refuses the audit's request: {str(error).splitlines()[0]}") from None
    started = time.perf_counter()
    report = audit_greedy(a, b, model, prompts, sampling, args) if sampling.params.greedy else \
        audit_sampled(a, b, model, prompts, sampling, args)
    report["seconds"] = round(time.perf_counter() - started, 1)
    print(markdown(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n")
    return 1 if report["rejected"] else 0


def _progress(total: int, quiet: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="request", file=sys.stderr, disable=quiet)


def audit_sampled(a: Endpoint, b: Endpoint | None, model: str, prompts: list[str], sampling: Sampling, args) -> dict:
    threshold = args.alpha / len(prompts)  # Bonferroni
    rows = []
    bar = _progress(len(prompts) * args.samples * (2 if b else 1), args.no_progress)
    for number, prompt in enumerate(prompts):
        seeds = [args.seed + number * 2 * args.samples + i for i in range(args.samples)]
        got_a = draw(a, model, prompt, sampling, seeds, args.concurrency, bar.update)
        if b is not None:
            got_b = draw(b, model, prompt, sampling, [s + args.samples for s in seeds], args.concurrency, bar.update)
            if not got_a.n or not got_b.n:
                errors = dict(got_a.errors + got_b.errors)
                raise UsageError(f"no completions to compare for prompt {number + 1}: {errors}")
            result = two_sample(got_a.outcomes, got_b.outcomes, threshold)
            errors = got_a.errors + got_b.errors
        else:
            if not got_a.n:
                raise UsageError(f"no completions for prompt {number + 1}: {dict(got_a.errors)}")
            result = one_sample(got_a.outcomes, exact_outcomes(args.model_path, prompt, sampling), threshold)
            errors = got_a.errors
        rows.append({"prompt": prompt[:60], **asdict(result), "rejected": result.p_value < threshold,
                     "errors": dict(errors)})
    bar.close()
    overall = min(1.0, len(prompts) * min(r["p_value"] for r in rows))
    params = sampling.params
    return {"mode": "two-sample" if b else "one-sample (exact reference)", "a": a.url, "b": b.url if b else "local",
            "model": model, "samples": args.samples, "tokens": sampling.tokens, "temperature": params.temperature,
            "sampling": sampling.method, "top_p": params.top_p, "top_k": params.top_k, "alpha": args.alpha,
            "concurrency": args.concurrency,
            "prompts": rows, "p_value": overall, "rejected": overall < args.alpha,
            "errors": sum(sum(r["errors"].values()) for r in rows)}


def audit_greedy(a: Endpoint, b: Endpoint | None, model: str, prompts: list[str], sampling: Sampling, args) -> dict:
    """Temperature 0: each prompt's greedy text from both sides (the exact reference's argmax chain in one-sample
    mode), and where they first differ."""
    rows = []
    for prompt in prompts:
        tokens_a = outcome(a.post("/v1/completions", body(model, prompt, sampling, None)), sampling)[0]
        if b is not None:
            tokens_b = outcome(b.post("/v1/completions", body(model, prompt, sampling, None)), sampling)[0]
        else:
            tokens_b = max(exact_outcomes(args.model_path, prompt, sampling).items(), key=lambda kv: kv[1])[0][0]
        differs = next((i for i, (x, y) in enumerate(zip(tokens_a, tokens_b)) if x != y),
                       None if len(tokens_a) == len(tokens_b) else min(len(tokens_a), len(tokens_b)))
        rows.append({"prompt": prompt[:60], "identical": differs is None, "first_difference": differs,
                     "a": "".join(tokens_a), "b": "".join(tokens_b)})
    rejected = any(not r["identical"] for r in rows)
    return {"mode": "greedy identity", "a": a.url, "b": b.url if b else "local", "model": model,
            "tokens": sampling.tokens, "prompts": rows, "rejected": rejected}


def markdown(report: dict) -> str:
    lines = [f"# exactspec audit: {report['mode']}", "",
             (f"{report['a']} against {report['b']}, model {report['model']}, {len(report['prompts'])} prompts, "
              f"first {report['tokens']} tokens, {report.get('seconds', '?')} s.")]
    if report["mode"] == "greedy identity":
        lines += ["", "| prompt | identical | first difference (token) |", "|---|---|---:|"]
        lines += [f"| {r['prompt']!r} | {'yes' if r['identical'] else 'NO'} | "
                  f"{'' if r['identical'] else r['first_difference']} |" for r in report["prompts"]]
        lines += ["", "**different greedy output**" if report["rejected"] else "**identical greedy output**"]
        return "\n".join(lines)
    lines[-1] += (f" {report['samples']} samples per endpoint and prompt at temperature {report['temperature']} "
                  f"(top-p {report['top_p']}, top-k {report['top_k']}), {report['concurrency']} at a time; "
                  f"{report['errors']} requests failed.")
    lines += ["", "| prompt | chi-square | df | bins | p | detectable TV (80% power) |",
              "|---|---:|---:|---:|---:|---:|"]
    for r in report["prompts"]:
        tv = f"{r['detectable_tv']:.3f}" if r["detectable_tv"] is not None else "—"
        lines.append(f"| {r['prompt']!r} | {r['statistic']:.2f} | {r['df']} | {r['bins']} | {r['p_value']:.4g} | "
                     f"{tv} |")
    verdict = "REJECTED: the distributions differ" if report["rejected"] else "not rejected"
    lines += ["", (f"Overall p (Bonferroni over prompts): {report['p_value']:.4g}; at alpha {report['alpha']}: "
                   f"**{verdict}**. A correct server is rejected with probability at most alpha; a pass means no "
                   "difference as large as the detectable total-variation distance above.")]
    return "\n".join(lines)
