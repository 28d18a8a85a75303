"""``exactspec bench-replicas``: what routing by prefix gives replicas on Ray Serve, measured on multi-turn chats.

It takes ShareGPT conversations (``--conversations``, sampled with ``--seed``, whose first ``--turns`` questions fit
``--max-prompt-tokens`` with the answers between them) and plays them as a chat client does: each turn's messages
are the conversation so far, the model's own answers included, sent when the last turn is answered; a few
conversations at a time (``--concurrency``). Each routing (``--routings``: prefix, then ray, Ray's own router) is
deployed in turn on one local Ray instance, ``--replicas`` replicas of ``--threads`` threads each, and the same
conversations are played against it.

For each routing it reports the later turns' prompt reuse, the prompt tokens the replica's prefix cache restored
(``usage.prompt_tokens_details.cached_tokens``) over the reusable ones (the tokens of a turn's prompt that were
the previous turn's prompt and answer: the least of its prompt and the last turn's prompt and completion tokens),
their time to first token (median and p90; the first turns' median beside it), and how many later turns were
answered by the replica that answered the turn before (``X-Exactspec-Instance``). Greedy and exact, every routing
answers alike, which it checks.
"""

from __future__ import annotations

import http.client
import json
import queue
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from exactspec.bench.serve import free_port
from exactspec.bench.stats import percentile
from exactspec.choices import REPLICA_ROUTINGS
from exactspec.errors import UsageError

TEMPLATE_TOKENS = 12  # a turn's chat template around its question and answer, at most (role headers, ends)
REQUEST_TIMEOUT = 600.0


@dataclass(frozen=True)
class Turn:
    conversation: int
    turn: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft: float  # seconds from sending to the first token's text
    seconds: float
    instance: str  # the replica that answered
    text: str


@dataclass(frozen=True)
class Summary:
    routing: str
    turns: int
    cached_tokens: int  # of the later turns' prompts
    reusable_tokens: int
    ttft_later_median: float
    ttft_later_p90: float
    ttft_first_median: float
    same_replica: float  # later turns answered by the replica of the turn before
    seconds: float

    @property
    def reuse(self) -> float:
        return self.cached_tokens / self.reusable_tokens if self.reusable_tokens else 0.0


# --- the conversations -----------------------------------------------------------------------------------------------


def sample_conversations(path: Path, tokenizer, count: int, turns: int, seed: int, max_prompt_tokens: int,
                         max_tokens: int) -> list[list[str]]:
    """``count`` conversations' first ``turns`` questions, sampled with ``seed`` among those whose questions, with
    an answer of ``max_tokens`` after each but the last and the template's tokens, fit ``max_prompt_tokens``."""
    from exactspec import sharegpt

    conversations = sharegpt.conversations(path)
    random.Random(seed).shuffle(conversations)
    chosen = []
    for records in conversations:
        questions = [r.get("value") for r in records[0:2 * turns:2] if r.get("from") == "human"]
        if len(questions) < turns or not all(isinstance(q, str) and q.strip() for q in questions):
            continue
        tokens = sum(len(tokenizer.encode(q)) for q in questions) + turns * (max_tokens + TEMPLATE_TOKENS)
        if tokens <= max_prompt_tokens:
            chosen.append(questions)
            if len(chosen) == count:
                return chosen
    raise UsageError(f"the trace has only {len(chosen)} conversations of {turns} turns under {max_prompt_tokens} "
                     f"tokens; {count} needed")


def ask(port: int, messages: list[dict], max_tokens: int) -> tuple[dict, float, float, str, str]:
    """One streamed chat completion: (usage, time to the first token's text, seconds in all, the replica that
    answered, the answer's text)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT)
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    try:
        connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise UsageError(f"the server answered {response.status}: {response.read()[:300]!r}")
        first, text, usage = None, [], None
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[len(b"data: "):])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece or choice.get("finish_reason"):
                    first = first or time.perf_counter() - started
                text.append(piece or "")
        if usage is None:
            raise UsageError("the server's stream ended without its usage")
        return usage, first, time.perf_counter() - started, response.getheader("X-Exactspec-Instance", ""), \
            "".join(text)
    finally:
        connection.close()


def play(port: int, conversations: list[list[str]], concurrency: int, max_tokens: int) -> list[Turn]:
    """Every conversation, turn after turn, ``concurrency`` of them at a time."""
    waiting: queue.SimpleQueue = queue.SimpleQueue()
    for item in enumerate(conversations):
        waiting.put(item)
    turns: list[Turn] = []
    lock = threading.Lock()

    def client() -> None:
        while True:
            try:
                index, questions = waiting.get_nowait()
            except queue.Empty:
                return
            messages: list[dict] = []
            for number, question in enumerate(questions):
                messages.append({"role": "user", "content": question})
                usage, ttft, seconds, instance, text = ask(port, messages, max_tokens)
                messages.append({"role": "assistant", "content": text})
                details = usage.get("prompt_tokens_details") or {}
                with lock:
                    turns.append(Turn(index, number, usage["prompt_tokens"], usage["completion_tokens"],
                                      details.get("cached_tokens", 0), ttft, seconds, instance, text))

    with ThreadPoolExecutor(concurrency) as clients:
        for future in [clients.submit(client) for _ in range(concurrency)]:
            future.result()
    return sorted(turns, key=lambda t: (t.conversation, t.turn))


def summarise(routing: str, turns: list[Turn], seconds: float) -> Summary:
    """The later turns' cached over reusable prompt tokens, times to first token, and replica changes."""
    previous = {(t.conversation, t.turn + 1): t for t in turns}
    later = [(t, previous[(t.conversation, t.turn)]) for t in turns if (t.conversation, t.turn) in previous]
    reusable = sum(min(t.prompt_tokens, last.prompt_tokens + last.completion_tokens) for t, last in later)
    ttfts = [t.ttft for t, _ in later]
    return Summary(routing=routing, turns=len(turns), cached_tokens=sum(t.cached_tokens for t, _ in later),
                   reusable_tokens=reusable, ttft_later_median=statistics.median(ttfts) if ttfts else float("nan"),
                   ttft_later_p90=percentile(ttfts, 90),
                   ttft_first_median=statistics.median([t.ttft for t in turns if t.turn == 0]),
                   same_replica=sum(t.instance == last.instance for t, last in later) / len(later) if later else 0.0,
                   seconds=seconds)


def table(summaries: list[Summary]) -> str:
    lines = ["| routing | turns | cached / reusable prompt tokens (later turns) | TTFT later turns median (s) | "
             "TTFT later turns p90 (s) | TTFT first turns median (s) | later turns on the last turn's replica | "
             "wall (s) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summaries:
        lines.append(f"| {s.routing} | {s.turns} | {s.cached_tokens} / {s.reusable_tokens} = {s.reuse:.0%} | "
                     f"{s.ttft_later_median:.3f} | {s.ttft_later_p90:.3f} | {s.ttft_first_median:.3f} | "
                     f"{s.same_replica:.0%} | {s.seconds:.0f} |")
    return "\n".join(lines)


# --- the run ---------------------------------------------------------------------------------------------------------


def run_bench_replicas(args) -> int:
    from exactspec.models import load_tokenizer
    from exactspec.sharegpt import default_path

    routings = [r.strip() for r in args.routings.split(",")]
    if not routings or any(r not in REPLICA_ROUTINGS for r in routings):
        raise UsageError(f"routings are {', '.join(REPLICA_ROUTINGS)}, got {args.routings!r}")
    for name in ("replicas", "conversations", "turns", "concurrency", "max_tokens"):
        if getattr(args, name) < 1:
            raise UsageError(f"{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    trace = Path(args.trace) if args.trace else default_path()
    tokenizer, _ = load_tokenizer(args.model)
    conversations = sample_conversations(trace, tokenizer, args.conversations, args.turns, args.seed,
                                         args.max_prompt_tokens, args.max_tokens)
    turns_by_routing = deploy_and_play(args, routings, conversations)
    summaries = [summarise(routing, turns, seconds) for routing, (turns, seconds) in turns_by_routing.items()]
    answers = {routing: [t.text for t in turns] for routing, (turns, _) in turns_by_routing.items()}
    alike = len({json.dumps(texts) for texts in answers.values()}) == 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"trace": str(trace), "seed": args.seed, "replicas": args.replicas, "threads": args.threads or 1,
              "conversations": args.conversations, "turns": args.turns, "concurrency": args.concurrency,
              "max_tokens": args.max_tokens, "max_prompt_tokens": args.max_prompt_tokens, "answers_alike": alike,
              "summaries": [{**asdict(s), "reuse": s.reuse} for s in summaries],
              "played": {routing: [asdict(t) for t in turns] for routing, (turns, _) in turns_by_routing.items()}}
    (out / "bench_replicas.json").write_text(json.dumps(report, indent=2))
    markdown = table(summaries) + f"\n\nEvery routing answered alike: {'yes' if alike else 'NO'}.\n"
    (out / "bench_replicas.md").write_text(markdown)
    print(markdown)
    return 0 if alike else 1


def deploy_and_play(args, routings: list[str], conversations: list[list[str]]
                    ) -> dict[str, tuple[list[Turn], float]]:
    """Each routing deployed in turn on one local Ray instance, the conversations played against it."""
    from ray import serve

    from exactspec.server import BatchSettings
    from exactspec.server.replicas import APP_NAME, proxy_options, serve_app, start_ray
    from exactspec.server.serving import ServerOptions

    options = ServerOptions(model=args.model, dtype=args.dtype, backend=args.backend, threads=args.threads or 1,
                            batch=BatchSettings(max_batch_size=args.concurrency,
                                                max_model_len=args.max_prompt_tokens + args.max_tokens + 8))
    port = free_port()
    start_ray(None, args.replicas, proxy_options("127.0.0.1", port, REQUEST_TIMEOUT))
    played = {}
    try:
        for routing in routings:
            print(f"bench-replicas: deploying {args.replicas} replicas routed by {routing}", file=sys.stderr,
                  flush=True)
            serve.run(serve_app(options, args.replicas, routing=routing), name=APP_NAME, route_prefix="/")
            started = time.perf_counter()
            turns = play(port, conversations, args.concurrency, args.max_tokens)
            played[routing] = (turns, time.perf_counter() - started)
            summary = summarise(routing, *played[routing])
            print(f"bench-replicas: {routing}: cached {summary.reuse:.0%} of reusable prompt tokens, TTFT of later "
                  f"turns median {summary.ttft_later_median:.3f} s, p90 {summary.ttft_later_p90:.3f} s",
                  file=sys.stderr, flush=True)
            serve.delete(APP_NAME)
    finally:
        import ray

        serve.shutdown()
        ray.shutdown()
    return played
