"""What a draft token costs against a target step, side by side in one run: the target's one-position pass, the draft
model's step as it is, each draft-grade copy's step (its vocabulary alone, and each recipe ``--draft-grade auto``
chooses among: draft_grades.RECIPES) and each copy's chain of k tokens in one call, per token, each with the bytes
its step reads and its floor (those bytes over the bandwidth this machine streams, measured in the same run), as
shares of the target's step. A copy's chain is timed twice: from a cache that lacks only the context's last token,
and as a round after one whose draft was accepted whole, whose cache lacks two (the last draft token and the
target's own: the chain's lead, fed in its first pass).

    python -m exactspec.bench.draft_cost --model qwen2.5-coder-1.5b --draft-model qwen2.5-coder-0.5b
                                        [--threads 2] [--k 4] [--repeats 15] [--context 200]

Each repeat times every runtime once, in turn (one untimed pass first), on the same context; the medians are kept.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from exactspec.backends import DraftGrade, kind
from exactspec.backends.fused import FusedRuntime
from exactspec.bench.roofline import bandwidth_probe
from exactspec.cores import set_torch_threads
from exactspec.draft_grades import RECIPES
from exactspec.errors import run_script
from exactspec.loading import draft_vocabulary
from exactspec.models import gguf_tokenizer, model_path


def step_seconds(runtime, context: list[int], token: int) -> float:
    """One one-position pass after ``context``."""
    runtime.rollback(len(context))
    started = time.perf_counter()
    runtime.extend([token], 1)
    return time.perf_counter() - started


def chain_seconds(runtime, context: list[int], k: int, lead: int = 1) -> float:
    """A chain of k tokens drafted in one call after ``context``, whose last ``lead`` tokens the cache lacks, per
    token."""
    runtime.rollback(len(context) - lead)
    started = time.perf_counter()
    runtime.draft_chain(context[-lead:], k)
    return (time.perf_counter() - started) / k


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exactspec.bench.draft_cost", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="the target (a .gguf file or a short name)")
    parser.add_argument("--draft-model", default="qwen2.5-coder-0.5b", help="the draft model (a .gguf file or name)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--k", type=int, default=4, help="the chain's draft tokens")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--context", type=int, default=200, help="tokens cached before the timed passes")
    args = parser.parse_args(argv)
    set_torch_threads(args.threads)
    threads = torch.get_num_threads()
    draft_path = model_path(args.draft_model)
    made = kind("fused").draft_from_file
    runtimes = {"target": FusedRuntime.from_gguf(model_path(args.model)), "draft, as it is":
                FusedRuntime.from_gguf(draft_path)}
    for grade in (DraftGrade(bits=None), *RECIPES):
        runtimes[f"draft-grade ({grade.label})"] = made(draft_path, grade,
                                                        lambda: draft_vocabulary(gguf_tokenizer(draft_path)))
    context = [(37 * i) % 5000 + 100 for i in range(args.context)]
    for runtime in runtimes.values():
        runtime.extend(context, 1)
    copies = {name: runtime for name, runtime in runtimes.items() if name.startswith("draft-grade")}
    chained = {f"{name}, one call": (runtime, 1) for name, runtime in copies.items()}  # (runtime, lead)
    chained |= {f"{name}, one call after a round accepted whole": (runtime, 2) for name, runtime in copies.items()}
    times: dict[str, list[float]] = {name: [] for name in [*runtimes, *chained]}
    for repeat in range(args.repeats + 1):
        for name, runtime in runtimes.items():
            seconds = step_seconds(runtime, context, 1000 + repeat)
            if repeat:
                times[name].append(seconds)
        for name, (runtime, lead) in chained.items():
            seconds = chain_seconds(runtime, context, args.k, lead)
            if repeat:
                times[name].append(seconds)
    bandwidth = bandwidth_probe(runtimes["target"].weight_bytes)
    step = statistics.median(times["target"])
    print(f"{threads} threads, {bandwidth / 1e9:.1f} GB/s streamed, k = {args.k}; medians of {args.repeats}")
    print("| runtime | bytes a step | ms a token | against the target's step | floor, against the target's |")
    print("|---|---:|---:|---:|---:|")
    target_floor = runtimes["target"].weight_bytes / bandwidth
    for name, seconds in times.items():
        runtime = runtimes.get(name) or chained[name][0]
        floor = runtime.weight_bytes / bandwidth / target_floor
        print(f"| {name} | {runtime.weight_bytes / 1e6:,.1f} MB | {1000 * statistics.median(seconds):.2f} | "
              f"{statistics.median(seconds) / step:.3f}x | {floor:.3f}x |")
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    raise SystemExit(run_script(main))
