"""``python -m specdec.bench.invariance``: is a position's logits row the same alone and inside a pass, and what does
specdec's runtime pay for it?

For each precision of specdec's runtime (and for a GGUF on llama.cpp, with ``--gguf``): rows 0-7 of passes of 2, 5
and 8 positions at three cache offsets, against the same positions scored one at a time; the largest logit
difference (0: bit for bit). With ``--cost``: decode and 5-position passes of the runtime's blocked attention
against PyTorch's fused attention (which is not invariant), interleaved in one process, as ratios. With
``--sampler``: what verifying one round of k = 4 costs under each sampling method, at the model's vocabulary.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from specdec.backends.llama import LlamaRuntime, project_qkv

PASS_SIZES = (2, 5, 8)
OFFSETS = (3, 17, 30)


def largest_difference(model, prompt: list[int]) -> float:
    """The largest |logit| difference between a position scored alone and the same position inside a pass."""
    worst = 0.0
    for n in PASS_SIZES:
        for offset in OFFSETS:
            model.rollback(0)
            model.extend(prompt[:offset], 0)
            alone = torch.cat([model.extend([token], 1) for token in prompt[offset : offset + n]])
            model.rollback(offset)
            together = model.extend(prompt[offset : offset + n], n)
            worst = max(worst, float((alone.float() - together.float()).abs().max()))
    model.rollback(0)
    return worst


class FusedAttentionRuntime(LlamaRuntime):
    """specdec's runtime with PyTorch's fused attention, as it was before it was made invariant: the reference
    ``--cost`` prices the blocked attention against."""

    def _attention(self, layer, h, keys, values, start, cos, sin, bias, tree_keys):
        n, heads, hd = h.shape[0], self.heads, self.head_dim
        q, k, v = project_qkv(layer, h, cos, sin, heads, self.kv_heads, hd)
        keys[:, start : start + n] = k.transpose(0, 1)
        values[:, start : start + n] = v.transpose(0, 1)
        mask = None if n == 1 else torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start)
        attended = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None, :, : start + n],
                                                  values[None, :, : start + n], attn_mask=mask,
                                                  enable_gqa=heads != self.kv_heads)
        return layer.out(attended[0].transpose(0, 1).reshape(n, heads * hd))


def pass_cost(model, precision: str, prompt: list[int], repeats: int = 15) -> dict[str, float]:
    """Median ms of a decode pass and a 5-position pass after 150 cached positions, blocked against fused
    attention, the two interleaved."""
    runtimes = {"blocked": LlamaRuntime(model, precision), "fused": FusedAttentionRuntime(model, precision)}
    times = {(name, n): [] for name in runtimes for n in (1, 5)}
    for runtime in runtimes.values():
        runtime.extend(prompt[:150], 0)
    for repeat in range(repeats):
        for name, runtime in list(runtimes.items())[:: 1 if repeat % 2 else -1]:
            for n in (1, 5):
                started = time.perf_counter()
                runtime.extend(prompt[150 : 150 + n], n)
                times[(name, n)].append(time.perf_counter() - started)
                runtime.rollback(150)
    return {f"{name} {n}": 1000 * statistics.median(values[2:]) for (name, n), values in times.items()}


def verify_cost(vocab_size: int, k: int = 4, repeats: int = 200) -> dict[str, float]:
    """Median ms to verify a k-token draft (a copy: no draft distribution) against k+1 rows of logits at temperature
    0.7, top-p 0.95, under each sampling method, the two interleaved."""
    from specdec.proposers.base import Draft
    from specdec.sampling import SamplingParams
    from specdec.step import make_generator, verify_draft

    logits = torch.randn(k + 1, vocab_size, generator=torch.Generator().manual_seed(0)) * 3
    draft = Draft(tokens=logits[:k].argmax(-1).tolist())
    times: dict[str, list[float]] = {"invariant": [], "standard": []}
    for repeat in range(repeats):
        for method in ("invariant", "standard") if repeat % 2 else ("standard", "invariant"):
            params = SamplingParams(temperature=0.7, top_p=0.95, method=method)
            generator = make_generator(repeat, logits.device)
            started = time.perf_counter()
            verify_draft(draft, logits, params, generator, 100)
            times[method].append(time.perf_counter() - started)
    return {method: 1000 * statistics.median(values[5:]) for method, values in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a transformers directory (default: the default model)")
    parser.add_argument("--gguf", default=None, help="also a GGUF file on llama.cpp")
    parser.add_argument("--precisions", default="float32,float16,bfloat16")
    parser.add_argument("--cost", action="store_true", help="also price the blocked attention against the fused")
    parser.add_argument("--sampler", action="store_true", help="also time a round's verification per sampling method")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    from specdec.models import load_model

    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype="float32").model
    prompt = torch.randint(0, model.config.vocab_size, (160,), generator=torch.Generator().manual_seed(0)).tolist()
    print("| runtime | largest logit difference, alone vs in a pass |\n|---|---:|")
    for precision in args.precisions.split(","):
        print(f"| specdec {precision} | {largest_difference(LlamaRuntime(model, precision), prompt):.3g} |")
    if args.gguf:
        from specdec.backends.llamacpp import LlamaCppLM

        lm = LlamaCppLM.load(args.gguf, threads=args.threads)
        print(f"| llama.cpp {lm.model.weight_type} | {largest_difference(lm, prompt):.3g} |")
    if args.cost:
        print("\n| precision | decode pass, blocked / fused | 5-position pass, blocked / fused |\n|---|---:|---:|")
        for precision in args.precisions.split(","):
            ms = pass_cost(model, precision, prompt)
            print(f"| {precision} | {ms['blocked 1']:.2f} / {ms['fused 1']:.2f} ms = "
                  f"{ms['blocked 1'] / ms['fused 1']:.2f}x | {ms['blocked 5']:.2f} / {ms['fused 5']:.2f} ms = "
                  f"{ms['blocked 5'] / ms['fused 5']:.2f}x |")
    if args.sampler:
        ms = verify_cost(model.config.vocab_size)
        print(f"\nverifying a round of k = 4 (vocabulary {model.config.vocab_size}, temperature 0.7, top-p 0.95): "
              f"invariant {ms['invariant']:.2f} ms, standard {ms['standard']:.2f} ms "
              f"({ms['invariant'] / ms['standard']:.2f}x)")


if __name__ == "__main__":
    main()
