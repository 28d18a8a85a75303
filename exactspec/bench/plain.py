"""Plain decoding through exactspec's engine, at each weight precision, against transformers' ``generate``, side by side

Both decode greedily the same number of new tokens from the same prompts, on the same model object, in one
process; the order alternates per prompt and repeat so that machine drift cancels. Each run starts from an
empty cache and includes its prefill. The speedup is computed per run and summarised by the median.

    python -m exactspec.bench.plain --prompts data/mt_bench_question.jsonl --limit 5 --max-new-tokens 64

``--llamacpp`` adds exactspec's plain decoding on llama.cpp, over the model's GGUF file as stored.

exactspec runs at each precision asked for (``auto``: measured per kind of pass), transformers in float32; the
roofline of each exactspec runtime follows the table.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from exactspec.bench.prompts import prompt_script_parser, read_prompts
from exactspec.cores import set_torch_threads
from exactspec.engine import GenerationConfig
from exactspec.errors import run_script

TRANSFORMERS = "transformers generate"


def time_exactspec(decoder, prompt_ids: list[int], new_tokens: int) -> float:
    """Seconds for exactspec's plain path (drafter ``none``) to decode new_tokens tokens, prefill included."""
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


def compare(decoders: dict[str, object], model, prompts: list[list[int]], new_tokens: int,
            repeats: int) -> list[dict[str, float]]:
    """Seconds per contender (each exactspec decoder, then ``transformers``), per prompt and repeat; the order
    rotates so that none always runs first."""
    timers = {name: (lambda ids, d=decoder: time_exactspec(d, ids, new_tokens)) for name, decoder in decoders.items()}
    timers[TRANSFORMERS] = lambda ids: time_transformers(model, ids, new_tokens)
    names = list(timers)
    runs = []
    for i, prompt_ids in enumerate(prompts * repeats):
        order = names[i % len(names):] + names[: i % len(names)]
        runs.append({name: timers[name](prompt_ids) for name in order})
    return runs


def main(argv: list[str] | None = None) -> int:
    from exactspec.api import SpecDecoder
    from exactspec.backends import precision_of
    from exactspec.bench.roofline import measure_roofline, roofline_markdown
    from exactspec.loading import encode_prompt
    from exactspec.models import load_model

    parser = prompt_script_parser(__doc__, limit=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--precisions", default="float32,auto",
                        help="exactspec's weight precisions to time, comma-separated: float32, float16, bfloat16, auto")
    parser.add_argument("--llamacpp", action="store_true",
                        help="also time exactspec's plain decoding on llama.cpp (the GGUF's weights as stored)")
    args = parser.parse_args(argv)
    args.threads = set_torch_threads(args.threads)

    target = load_model(args.model, dtype="float32", device="cpu")  # transformers runs the float32 model
    decoders = {f"exactspec {p}": SpecDecoder(target, drafter="none", precision=p)
                for p in args.precisions.split(",")}
    if args.llamacpp:
        gguf = load_model(args.model, backend="llama.cpp", threads=args.threads or torch.get_num_threads())
        decoders["exactspec llama.cpp"] = SpecDecoder(gguf, drafter="none")
    prompts = [encode_prompt(target.tokenizer, p.text, p.chat) for p in read_prompts(args.prompts, limit=args.limit)]
    for decoder in decoders.values():  # warm-up, every path
        time_exactspec(decoder, prompts[0], 4)
    time_transformers(target.model, prompts[0], 4)
    runs = compare(decoders, target.model, prompts, args.max_new_tokens, args.repeats)

    n = args.max_new_tokens
    names = list(runs[0])
    print(f"plain greedy decoding, {len(prompts)} prompts x {args.repeats} repeats x {n} new tokens, "
          f"{torch.get_num_threads()} threads; transformers runs the model in float32")
    print("")
    print("| contender | precision | tokens/s (median run) | speedup over transformers generate (median run) |")
    print("|---|---|---:|---:|")
    for name in names:
        precision = precision_of(decoders[name].engine.target) if name in decoders else "float32"
        rate = statistics.median(n / run[name] for run in runs)
        speedup = statistics.median(run[TRANSFORMERS] / run[name] for run in runs)
        print(f"| {name} | {precision} | {rate:.2f} | {speedup:.3f}x |")
    print("")
    for name, decoder in decoders.items():
        backend = decoder.engine.target
        print(roofline_markdown(measure_roofline(backend, prompts[0]), f"{name} ({precision_of(backend)})"))
    return 0


if __name__ == "__main__":
    sys.exit(run_script(main))
