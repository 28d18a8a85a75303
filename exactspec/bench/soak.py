"""exactspec bench-soak: a server at its defaults under mixed traffic for a while, its resident memory sampled.

Clients send, each in a loop, what a server meets in a day: chats and completions, streamed and whole, each prompt
new (an MT-bench question with a random tag), so the prefix cache and the shared suffix index keep learning; streams
the client leaves after a few chunks; bodies that are not JSON, parameters out of range, and bodies past
``--max-body-bytes``. The server's resident memory (VmRSS) is read every few seconds. Memory levels where its last
minutes grow by less than a fraction of what the first minutes grew; the bounded stores (the prefix cache's MiB, the
suffix index's tokens) are why it should. Every answer must be the status its kind expects: a 5xx, or a refusal where
an answer was due, fails the run.
"""

from __future__ import annotations

import http.client
import json
import random
import select
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from exactspec.bench.prompts import read_prompts
from exactspec.bench.serve import ServerProcess, http_request
from exactspec.errors import UsageError

KINDS = {  # kind -> (share of requests, the statuses it must get)
    "chat": (0.45, {200}),
    "completion": (0.15, {200}),
    "stream": (0.15, {200}),
    "left_stream": (0.10, {200}),
    "bad_json": (0.05, {400}),
    "bad_parameter": (0.05, {400}),
    "oversized": (0.05, {413}),
}
CLOSED = -1  # the connection closed before an answer: as a refusal only past --max-body-bytes, where the server may
# close on a body it will not read (a 413 that a client still sending never reads)
BODY_CHUNK = 64 << 10  # bytes of a request's body sent at a time
LEVEL_FRACTION = 0.1  # levelled: the last quarter grew by less than this fraction of the first quarter's growth


@dataclass
class Sample:
    seconds: float
    rss_mib: float
    requests: int


@dataclass
class SoakResult:
    minutes: float
    clients: int
    requests: dict[str, int] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)

    def growth(self, start: float, end: float) -> float:
        """MiB the resident memory grew between two fractions of the run (by the samples nearest them)."""
        picked = [self.samples[min(int(fraction * (len(self.samples) - 1)), len(self.samples) - 1)]
                  for fraction in (start, end)]
        return picked[1].rss_mib - picked[0].rss_mib

    @property
    def levelled(self) -> bool:
        first, last = self.growth(0.0, 0.25), self.growth(0.75, 1.0)
        return last <= max(LEVEL_FRACTION * first, 1.0)


def resident_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise UsageError(f"no resident memory reported for process {pid}")


def body_for(kind: str, prompt: str, max_tokens: int) -> tuple[str, bytes]:
    """The path and body of one request of a kind."""
    if kind == "completion":
        return "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": max_tokens}).encode()
    messages = [{"role": "user", "content": prompt}]
    if kind == "bad_json":
        return "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "unterminated'
    if kind == "bad_parameter":
        return "/v1/chat/completions", json.dumps({"messages": messages, "temperature": -1}).encode()
    if kind == "oversized":
        return "/v1/chat/completions", json.dumps({"messages": messages, "pad": "x" * (2 << 20)}).encode()
    stream = kind in ("stream", "left_stream")
    return "/v1/chat/completions", json.dumps({"messages": messages, "max_tokens": max_tokens, "stream": stream,
                                               "temperature": random.choice([0, 0.7])}).encode()


def send(port: int, kind: str, path: str, body: bytes) -> int:
    """One request; a stream of kind ``left_stream`` is left after its first chunks, its connection closed. The body
    goes in chunks, and an answer that comes before it has all gone ends the sending: a server refusing a body it
    will not read (413) answers and closes, and a client still sending would meet a reset, not the answer."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        connection.putrequest("POST", path)
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", str(len(body)))
        connection.endheaders()
        for start in range(0, len(body), BODY_CHUNK):
            if select.select([connection.sock], [], [], 0)[0]:  # answered already
                break
            connection.send(body[start : start + BODY_CHUNK])
        response = connection.getresponse()
        if kind == "left_stream":
            response.read(64)
        else:
            response.read()
        return response.status
    except (ConnectionResetError, BrokenPipeError):
        return CLOSED
    finally:
        connection.close()


def expected(kind: str, status: int) -> bool:
    """Whether a status is what a request of this kind must get (a closed connection counts as a 413)."""
    statuses = KINDS[kind][1]
    return status in statuses or status == CLOSED and 413 in statuses


def client(port: int, deadline: float, max_tokens: int, questions: list[str], seed: int, result: SoakResult,
           lock: threading.Lock) -> None:
    rng = random.Random(seed)
    kinds, weights = list(KINDS), [share for share, _ in KINDS.values()]
    while time.monotonic() < deadline:
        kind = rng.choices(kinds, weights)[0]
        prompt = f"[{rng.randrange(1 << 30):x}] {rng.choice(questions)}"
        status = send(port, kind, *body_for(kind, prompt, max_tokens))
        with lock:
            result.requests[kind] = result.requests.get(kind, 0) + 1
            if not expected(kind, status):
                result.unexpected.append(f"{kind}: {status}")


def soak(port: int, pid: int, questions: list[str], minutes: float, clients: int, max_tokens: int,
         sample_seconds: float) -> SoakResult:
    result = SoakResult(minutes=minutes, clients=clients)
    lock = threading.Lock()
    started = time.monotonic()
    deadline = started + 60 * minutes
    threads = [threading.Thread(target=client, daemon=True,
                                args=(port, deadline, max_tokens, questions, seed, result, lock))
               for seed in range(clients)]
    for thread in threads:
        thread.start()
    while time.monotonic() < deadline:
        with lock:
            done = sum(result.requests.values())
        result.samples.append(Sample(round(time.monotonic() - started, 1), round(resident_mib(pid), 1), done))
        time.sleep(sample_seconds)
    for thread in threads:
        thread.join()
    result.samples.append(Sample(round(time.monotonic() - started, 1), round(resident_mib(pid), 1),
                                 sum(result.requests.values())))
    return result


def table(result: SoakResult, rows: int = 12) -> str:
    step = max(1, len(result.samples) // rows)
    picked = result.samples[::step] + ([result.samples[-1]] if (len(result.samples) - 1) % step else [])
    lines = ["| minute | resident MiB | requests so far |", "|---:|---:|---:|"]
    lines += [f"| {sample.seconds / 60:.1f} | {sample.rss_mib:.0f} | {sample.requests} |" for sample in picked]
    return "\n".join(lines)


def summary(result: SoakResult) -> str:
    rss = [sample.rss_mib for sample in result.samples]
    first, last = result.growth(0.0, 0.25), result.growth(0.75, 1.0)
    return (f"{result.minutes:g} minutes, {result.clients} clients, {sum(result.requests.values())} requests "
            f"({', '.join(f'{kind} {count}' for kind, count in sorted(result.requests.items()))}); resident memory "
            f"{rss[0]:.0f} -> {rss[-1]:.0f} MiB (peak {max(rss):.0f}, median of the last quarter "
            f"{statistics.median(rss[3 * len(rss) // 4:]):.0f}); first quarter +{first:.0f} MiB, last quarter "
            f"{last:+.0f} MiB: {'levelled' if result.levelled else 'still rising'}; "
            f"{len(result.unexpected)} unexpected statuses")


def run_bench_soak(args) -> int:
    questions = [prompt.text for prompt in read_prompts(args.prompts)]
    server = ServerProcess("auto", args.serve_args.split() if args.serve_args else [])
    try:
        server.wait_ready()
        status, _ = http_request("127.0.0.1", server.port, "GET", "/health", None, timeout=10)
        if status != 200:
            raise UsageError(f"the server answered /health with {status}")
        result = soak(server.port, server.process.pid, questions, args.minutes, args.clients, args.max_tokens,
                      args.sample_seconds)
    finally:
        server.stop()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_soak.json").write_text(json.dumps(asdict(result), indent=1))
    report = f"{summary(result)}\n\n{table(result)}\n"
    (out / "bench_soak.md").write_text(report)
    print(report)
    for line in result.unexpected[:10]:
        print(f"unexpected: {line}")
    return 1 if result.unexpected else 0
