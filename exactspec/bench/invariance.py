"""``python -m exactspec.bench.invariance``: is a position's logits row the same alone and inside a pass, and what does
exactspec's runtime pay for it?

For each precision of exactspec's runtime (and for a GGUF on llama.cpp, with ``--gguf``): rows 0-7 of passes of 2, 5
and 8 positions at three cache offsets, against the same positions scored one at a time; the largest logit
difference (0: bit for bit). With ``--cost``: passes over 1, 5, 17 and 256 positions on the runtime's row kernels
against the libraries' kernels (with blocked attention, and with PyTorch's fused attention, which is invariant on
no CPU), interleaved in one process; each ratio is the row kernels' time over the other's. With
``--sampler``: what verifying one round of k = 4 costs under each sampling method, at the model's vocabulary.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F

from exactspec.backends import native
from exactspec.backends.base import median_pass_seconds
from exactspec.backends.family import project_qkv
from exactspec.backends.lean import LeanRuntime
from exactspec.cores import set_torch_threads
from exactspec.errors import run_script

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


class FusedAttentionRuntime(LeanRuntime):
    """exactspec's runtime with PyTorch's fused attention, as before it was made invariant (a reference price)."""

    def _attention(self, layer, h, keys, values, start, cos, sin, reading, scoring):  # llama's scoring only
        n, heads, hd = h.shape[0], self.heads, self.head_dim
        q, k, v = project_qkv(layer, h, cos, sin, heads, self.kv_heads, hd)
        keys[:, start : start + n] = k.transpose(0, 1)
        values[:, start : start + n] = v.transpose(0, 1)
        mask = None if n == 1 else torch.ones(n, start + n, dtype=torch.bool).tril(diagonal=start)
        attended = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None, :, : start + n],
                                                  values[None, :, : start + n], attn_mask=mask,
                                                  enable_gqa=heads != self.kv_heads)
        return layer.out(attended[0].transpose(0, 1).reshape(n, heads * hd))


@contextlib.contextmanager
def libraries_only():
    """Runtimes built inside compute with the libraries' kernels (oneDNN, fbgemm, PyTorch's batched products in
    blocked attention), as where exactspec's row kernels are not built: what the runtime ran before them."""
    unavailable = native.unavailable
    native.unavailable = lambda: "the libraries' kernels, for comparison"
    try:
        yield
    finally:
        native.unavailable = unavailable


COST_SIZES = (1, 5, 17, 256)  # a decode pass, a round of k = 4, of k = 16, a prompt
COST_CACHED = 150  # positions cached before each timed pass


def pass_cost(model, precision: str, prompt: list[int], repeats: int = 9) -> dict[str, dict[int, float]]:
    """Median ms of passes over COST_SIZES positions after COST_CACHED cached ones, interleaved: the row kernels
    (what the runtime runs), the libraries' kernels with blocked attention (invariant on some CPUs only), and with
    PyTorch's fused attention (invariant on none)."""
    runtimes = {"row kernels": LeanRuntime(model, precision)}
    with libraries_only():
        runtimes["libraries"] = LeanRuntime(model, precision)
        runtimes["libraries, fused attention"] = FusedAttentionRuntime(model, precision)
    for runtime in runtimes.values():
        runtime.extend(prompt[:COST_CACHED], 0)
    seconds = median_pass_seconds(runtimes, COST_SIZES, repeats)
    return {name: {n: 1000 * s for n, s in by_size.items()} for name, by_size in seconds.items()}


def verify_cost(vocab_size: int, k: int = 4, repeats: int = 200) -> dict[str, float]:
    """Median ms to verify a k-token draft (a copy: no draft distribution) against k+1 rows of logits at temperature
    0.7, top-p 0.95, under each sampling method, the two interleaved."""
    from exactspec.proposers.base import Draft
    from exactspec.sampling import SamplingParams
    from exactspec.step import make_generator, verify_draft

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
    parser.add_argument("--cost", action="store_true", help="also price the row kernels against the libraries'")
    parser.add_argument("--sampler", action="store_true", help="also time a round's verification per sampling method")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    from exactspec.models import load_model

    args.threads = set_torch_threads(args.threads)
    model = load_model(args.model, dtype="float32").model
    prompt = torch.randint(0, model.config.vocab_size, (160,), generator=torch.Generator().manual_seed(0)).tolist()
    print("| runtime | largest logit difference, alone vs in a pass |\n|---|---:|")
    for precision in args.precisions.split(","):
        print(f"| exactspec {precision} | {largest_difference(LeanRuntime(model, precision), prompt):.3g} |")
        with libraries_only():
            libraries = LeanRuntime(model, precision)
        print(f"| exactspec {precision}, the libraries' kernels | {largest_difference(libraries, prompt):.3g} |")
    if args.gguf:
        from exactspec.backends.llamacpp import LlamaCppLM

        lm = LlamaCppLM.load(args.gguf, threads=args.threads)
        print(f"| llama.cpp {lm.model.weight_type} | {largest_difference(lm, prompt):.3g} |")
    if args.cost:
        print("\n| precision | kernels | " + " | ".join(f"{n}-position pass" for n in COST_SIZES) + " |")
        print("|---|---|" + "---:|" * len(COST_SIZES))
        for precision in args.precisions.split(","):
            ms = pass_cost(model, precision, prompt)
            for name, by_size in ms.items():
                cells = [f"{by_size[n]:.2f} ms" + ("" if name == "row kernels" else
                                                  f" ({ms['row kernels'][n] / by_size[n]:.2f}x)") for n in COST_SIZES]
                print(f"| {precision} | {name} | " + " | ".join(cells) + " |")
    if args.sampler:
        ms = verify_cost(model.config.vocab_size)
        print(f"\nverifying a round of k = 4 (vocabulary {model.config.vocab_size}, temperature 0.7, top-p 0.95): "
              f"invariant {ms['invariant']:.2f} ms, standard {ms['standard']:.2f} ms "
              f"({ms['invariant'] / ms['standard']:.2f}x)")


if __name__ == "__main__":
    raise SystemExit(run_script(main))
