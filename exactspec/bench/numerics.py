"""How near each runtime's logits are to a float32 reference on the same GGUF file, side by side: exactspec's fused
runtime over the file's blocks as stored (with integer products, each row's inputs quantised to bytes per block of
32, and with float products), and llama.cpp's on the same file.

    python -m exactspec.bench.numerics --model FILE.gguf [--prompts FILE.jsonl] [--limit 4] [--max-new-tokens 64]

The reference is transformers' float32 module of the file's architecture, its weights as gguf-py de-quantises them
(``backends/reference.py``): written apart from exactspec's reader and kernels. For each prompt the reference's greedy
answer is generated; then every runtime scores prompt and answer in one teacher-forced pass, and the table gives the
largest and the mean absolute logit difference from the reference over the answer's positions, and the share of those
positions whose argmax is the reference's. Each runtime's own greedy answer is then compared with the reference's:
the tokens before they first part.
"""

from __future__ import annotations

import statistics

import numpy as np
import torch

from exactspec.backends.reference import reference_module
from exactspec.bench.prompts import prompt_script_parser, read_prompts
from exactspec.cores import set_torch_threads
from exactspec.errors import run_script


def runtime_greedy(runtime, prompt: list[int], steps: int) -> list[int]:
    """``steps`` greedy tokens after ``prompt`` from a runtime, one cached pass a token."""
    runtime.rollback(0)
    logits = runtime.extend(prompt, 1)
    answer = []
    for _ in range(steps):
        answer.append(int(torch.as_tensor(np.asarray(logits))[-1].argmax()))
        logits = runtime.extend(answer[-1:], 1)
    return answer


@torch.no_grad()
def reference_greedy(model, prompt: list[int], steps: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    return out[0, len(prompt):].tolist()


def parted_at(answer: list[int], reference: list[int]) -> int:
    """How many tokens ``answer`` shares with ``reference`` before they first part."""
    return next((i for i, (a, b) in enumerate(zip(answer, reference)) if a != b), min(len(answer), len(reference)))


def main(argv: list[str] | None = None) -> int:
    parser = prompt_script_parser(__doc__.splitlines()[0], limit=4)
    args = parser.parse_args(argv)
    if args.model is None:
        parser.error("--model FILE.gguf is needed (a llama or qwen2 GGUF)")
    args.threads = set_torch_threads(args.threads)
    from exactspec.backends.fused import PRODUCTS, FusedRuntime
    from exactspec.loading import encode_prompt
    from exactspec.models import load_gguf, model_path

    path = model_path(args.model)
    target = load_gguf(path, torch.get_num_threads())
    runtimes = {**{f"fused ({products} products)": FusedRuntime.from_gguf(path, products) for products in PRODUCTS},
                "llama.cpp": target.runtime}
    reference = reference_module(path)

    def score(runtime, ids: list[int]) -> torch.Tensor:
        runtime.rollback(0)
        return torch.as_tensor(np.asarray(runtime.extend(ids, len(ids)))).float()

    rows = {name: {"max": [], "mean": [], "argmax": [], "parted": []} for name in runtimes}
    for prompt in read_prompts(args.prompts, limit=args.limit):
        ids = encode_prompt(target.tokenizer, prompt.text, prompt.chat)
        answer = reference_greedy(reference, ids, args.max_new_tokens)
        with torch.no_grad():
            expected = reference(torch.tensor([ids + answer])).logits[0, len(ids) - 1 : -1].float()
        for name, runtime in runtimes.items():
            got = score(runtime, ids + answer)[len(ids) - 1 : -1]
            difference = (got - expected).abs()
            rows[name]["max"].append(difference.max().item())
            rows[name]["mean"].append(difference.mean().item())
            rows[name]["argmax"].append((got.argmax(-1) == expected.argmax(-1)).float().mean().item())
            rows[name]["parted"].append(parted_at(runtime_greedy(runtime, ids, args.max_new_tokens), answer))
    print(f"{path.name}: {len(rows[next(iter(rows))]['max'])} prompts, {args.max_new_tokens} greedy tokens each, "
          "against transformers' float32 module of the file's weights\n")
    print("| runtime | largest logit difference | mean | argmax agreement | greedy tokens before parting (median) |")
    print("|---|---:|---:|---:|---:|")
    for name, row in rows.items():
        print(f"| {name} | {max(row['max']):.2e} | {statistics.mean(row['mean']):.2e} | "
              f"{statistics.mean(row['argmax']):.1%} | {statistics.median(row['parted']):.0f} of "
              f"{args.max_new_tokens} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_script(main))
