"""``python -m exactspec.bench.learning``: what the server's shared suffix index gains on a workload whose requests
repeat each other, measured side by side in one run.

The workload is one instruction over many inputs (HumanEval's functions: described as JSON, or given type
hints), each asked ``--passes`` times (as retries and re-asks do), sent ``--concurrency`` at a time, greedy.
Two schedulers over the same weights serve it in turns, wave by wave: ``shared`` (retrieval reading the index of
every finished answer) and ``session`` (retrieval reading each request's own text only: a capacity of one token,
so nothing is learned). Both emit the same tokens. It reports, per arm, tokens per second (end to end, and
decoding alone: without the prompts' prefill, which no drafter shortens), accepted draft tokens per drafted one,
mean accepted length, the prompts' tokens restored from the server's prefix cache, and shared over session.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

from exactspec.bench.prompts import read_prompts
from exactspec.bench.report import print_json
from exactspec.errors import run_script
from exactspec.loading import encode_prompt, load_target
from exactspec.sampling import SamplingParams
from exactspec.server import BatchSettings, build_scheduler
from exactspec.server.scheduler import GenerationRequest

TASKS = {  # one instruction over many inputs: a code edit, and an extraction whose answers share their form
    "type-hints": "Add type hints to this Python function. Reply with the whole function only.\n\n{}",
    "extract": "Describe this Python function as JSON with the keys \"name\", \"arguments\" (a list of names), "
               "\"returns\" (a type) and \"summary\" (one sentence). Reply with the JSON only.\n\n{}",
}
ARMS = {"shared": 65536, "session": 1}  # arm -> --datastore-capacity (1: nothing is learned)


def run(args: argparse.Namespace) -> dict:
    loaded = load_target(args.model, threads=args.threads, drafters=("retrieval",))
    tokenizer = loaded.target.tokenizer
    inputs = read_prompts(args.prompts, limit=args.limit)
    prompts = [encode_prompt(tokenizer, TASKS[args.task].format(p.text)) for p in inputs] * args.passes
    schedulers = {}
    for arm, capacity in ARMS.items():
        settings = BatchSettings(drafter="retrieval", speculation=args.speculation, num_draft_tokens=args.k,
                                 max_batch_size=args.concurrency, max_model_len=args.max_model_len,
                                 datastore_capacity=capacity, learn_prompts=args.learn_prompts,
                                 prefix_cache_mib=args.prefix_cache_mib)
        schedulers[arm] = build_scheduler(loaded.runtime, settings, loaded.stop_ids)
        schedulers[arm].start()
    seconds = dict.fromkeys(ARMS, 0.0)
    tokens = dict.fromkeys(ARMS, 0)
    outputs: dict[str, list] = {arm: [] for arm in ARMS}
    for start in range(0, len(prompts), args.concurrency):
        wave = prompts[start:start + args.concurrency]
        for arm in (ARMS if (start // args.concurrency) % 2 == 0 else reversed(list(ARMS))):
            began = time.perf_counter()
            with ThreadPoolExecutor(len(wave)) as pool:
                results = list(pool.map(lambda ids, arm=arm: schedulers[arm].submit(GenerationRequest(
                    ids, max_tokens=args.max_new_tokens, sampling=SamplingParams())).collect()[0], wave))
            seconds[arm] += time.perf_counter() - began
            tokens[arm] += sum(len(r) for r in results)
            outputs[arm] += results
    report = {"task": args.task, "learn_prompts": args.learn_prompts, "inputs": len(inputs), "passes": args.passes,
              "concurrency": args.concurrency, "arms": {}}
    for arm, scheduler in schedulers.items():
        scheduler.shutdown(timeout=5)
        metrics = scheduler.metrics
        report["arms"][arm] = {
            "tokens_per_second": tokens[arm] / seconds[arm],
            # decoding alone: the steps that draft, score and verify, without the prompts' prefill passes
            "decode_tokens_per_second": metrics.generation_tokens / max(metrics.step_seconds, 1e-9),
            "acceptance_rate": metrics.accepted_tokens / max(metrics.draft_tokens, 1),
            "draft_tokens": metrics.draft_tokens, "accepted_tokens": metrics.accepted_tokens,
            "mean_accepted_length": metrics.generation_tokens / max(metrics.request_rounds, 1),
            "prefill_seconds": metrics.prefill_seconds, "step_seconds": metrics.step_seconds,
            "prompt_tokens": metrics.prompt_tokens, "cached_prompt_tokens": metrics.cached_prompt_tokens}
    shared, session = report["arms"]["shared"], report["arms"]["session"]
    report["shared_over_session"] = shared["tokens_per_second"] / session["tokens_per_second"]
    report["decode_shared_over_session"] = shared["decode_tokens_per_second"] / session["decode_tokens_per_second"]
    report["same_tokens"] = outputs["shared"] == outputs["session"]
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exactspec.bench.learning", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompts", required=True, help="HumanEval JSONL (.gz): each function is one input")
    parser.add_argument("--limit", type=int, default=24, help="inputs")
    parser.add_argument("--task", choices=list(TASKS), default="extract")
    parser.add_argument("--passes", type=int, default=1, help="ask every input this many times (retries, re-asks)")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("-k", type=int, default=8, help="the most draft tokens per request per step")
    parser.add_argument("--speculation", default="auto", choices=("auto", "always"))
    parser.add_argument("--learn-prompts", action="store_true", help="the shared index learns prompts too")
    parser.add_argument("--prefix-cache-mib", type=int, default=1024, help="each arm's prefix cache (0: off)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    return print_json(run(args), args.out)


if __name__ == "__main__":
    raise SystemExit(run_script(main))
