"""Plain decoding through specdec's engine against transformers' ``generate``, side by side.

Both decode greedily the same number of new tokens from the same prompts, on the same model object, in one
process; the order alternates per prompt and repeat so that machine drift cancels. Each run starts from an
empty cache and includes its prefill. The speedup is computed per run and summarised by the median.

    python -m specdec.bench.plain --prompts data/mt_bench_question.jsonl --limit 5 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from specdec.bench.prompts import read_prompts
from specdec.engine import GenerationConfig


def time_specdec(decoder, prompt_ids: list[int], new_tokens: int) -> float:
    """Seconds for specdec's plain path (drafter ``none``) to decode new_tokens tokens, prefill included."""
    decoder.engine.clear_cache()
    result = decoder.engine.generate(prompt_ids, GenerationConfig(max_new_tokens=new_tokens, stop_at_eos=False))
    assert result.stats.new_tokens == new_tokens
    return result.stats.seconds


def time_transformers(model, prompt_ids: list[int], new_tokens: int) -> float:
    """Seconds for transformers' greedy ``generate`` to decode new_tokens tokens, prefill included."""
    input_ids = torch.tensor([prompt_ids], device=model.device)
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        seconds = time.perf_counter() - start
    assert out.shape[1] - input_ids.shape[1] == new_tokens
    return seconds


def compare(decoder, prompts: list[list[int]], new_tokens: int, repeats: int) -> list[tuple[float, float]]:
    """(specdec seconds, transformers seconds) per prompt and repeat, interleaved A B / B A."""
    runs = []
    for i, prompt_ids in enumerate(prompts * repeats):
        timers = [lambda: time_specdec(decoder, prompt_ids, new_tokens),
                  lambda: time_transformers(decoder.target.model, prompt_ids, new_tokens)]
        if i % 2:
            transformers_s, specdec_s = timers[1](), timers[0]()
        else:
            specdec_s, transformers_s = timers[0](), timers[1]()
        runs.append((specdec_s, transformers_s))
    return runs


def main(argv: list[str] | None = None) -> int:
    from specdec.api import SpecDecoder

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="data/mt_bench_question.jsonl")
    parser.add_argument("--limit", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    decoder = SpecDecoder.load(args.model, drafter="none", dtype=args.dtype, device="cpu")
    prompts = [decoder.encode(p.text, p.chat) for p in read_prompts(args.prompts, limit=args.limit)]
    time_specdec(decoder, prompts[0], 4)  # warm-up, both paths
    time_transformers(decoder.target.model, prompts[0], 4)
    runs = compare(decoder, prompts, args.max_new_tokens, args.repeats)

    n = args.max_new_tokens
    print(f"plain greedy decoding, {len(prompts)} prompts x {args.repeats} repeats x {n} new tokens, "
          f"{args.dtype}, {torch.get_num_threads()} threads")
    print("| run | specdec tokens/s | transformers generate tokens/s | speedup |")
    print("|---:|---:|---:|---:|")
    for i, (ours, theirs) in enumerate(runs):
        print(f"| {i} | {n / ours:.2f} | {n / theirs:.2f} | {theirs / ours:.3f} |")
    median = statistics.median(theirs / ours for ours, theirs in runs)
    print(f"median speedup of specdec plain over transformers generate: {median:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
