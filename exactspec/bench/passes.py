"""What a pass over n positions costs on each runtime, side by side in one run: the seed's Figure 1 as a table, with
each runtime's roofline (its weights' bytes over the bandwidth this machine streams), this machine's integer
arithmetic peak and the floor the two set together; then each runtime's prompt rate (prefill tokens a second).

    python -m exactspec.bench.passes [--model FILE.gguf] [--threads 2] [--context 200] [--repeats 7] [--lean]
                                   [--prompts 128,512,2048,8192]

The runtimes: llama.cpp over the GGUF as stored, and exactspec's fused runtime over the file's matrices as stored
(``FusedRuntime.from_gguf``), with integer products and with float products. Where the fused runtime cannot read
the file directly, or with ``--lean``, the file is converted to a float32 transformers model for the fused runtime
in float16 and int8 weights and the lean runtime in float16 and float32 (the conversion takes minutes and several
times the file's size in memory for a model of billions of weights). Each is fed the
same context; then passes over 1 to 64 positions are timed, runtime after runtime within each repeat (one untimed
pass first: the runtime before may still hold a core while its threads spin down), and the medians kept. The
bandwidth is the probe of ``exactspec bench``'s roofline (a float32 sum over 256 MiB or more, larger than any cache);
the integer peak, the integer tiles' widest instruction in a loop on every thread at once (``native.integer_peak``).
A pass over n positions can cost no less than the larger of its weights over the bandwidth and its n rows'
multiply-adds over the integer peak: the table's last line, against the same floor for one position. Prompts of each
``--prompts`` length (fresh cache, logits of the last position) are timed runtime after runtime, the best of
``--prompt-repeats``.
"""

from __future__ import annotations

import argparse
import time

import torch

from exactspec.backends import native
from exactspec.backends.base import median_pass_seconds
from exactspec.bench.roofline import bandwidth_probe
from exactspec.cores import set_torch_threads
from exactspec.errors import run_script

POSITIONS = (1, 2, 3, 4, 5, 8, 16, 17, 32, 64)
PROMPTS = (128, 512, 2048, 8192)


def runtimes(model_name, threads: int, lean: bool = False, max_length: int | None = None) -> dict[str, object]:
    from exactspec.backends.fused import PRODUCTS, FusedRuntime, gguf_unavailable, unavailable
    from exactspec.backends.gguf_file import GGUFFile
    from exactspec.backends.lean import LeanRuntime
    from exactspec.backends.llamacpp import LlamaCppLM
    from exactspec.models import load_model, model_path

    source = model_path(model_name)
    found = {"llama.cpp (GGUF as stored)": LlamaCppLM.load(source, max_length, threads)}
    if gguf_unavailable(GGUFFile(source)) is None:
        for products in PRODUCTS:  # the same packed bytes, mapped once
            found[f"fused (as stored, {products} products)"] = FusedRuntime.from_gguf(source, products)
        if not lean:
            return found
    model = load_model(source, dtype="float32", device="cpu", backend="lean").model
    if unavailable(model) is None:
        found["fused (float16)"] = FusedRuntime(model, "float16")
    if unavailable(model, "int8") is None:
        found["fused (int8)"] = FusedRuntime(model, "int8")
    found["lean (float16)"] = LeanRuntime(model, "float16")
    found["lean (float32)"] = LeanRuntime(model, "float32")
    return found


def table(found: dict[str, object], medians: dict[str, dict[int, float]], bandwidth: float, peak=None) -> str:
    lines = [f"bandwidth {bandwidth / 1e9:.1f} GB/s (probe); {torch.get_num_threads()} threads", "",
             "| runtime | weights read per pass | floor | 1 position | x floor | "
             + " | ".join(f"{n}" for n in POSITIONS[1:]) + " |",
             "|---|---:|---:|---:|---:|" + "---:|" * (len(POSITIONS) - 1)]
    for name, runtime in found.items():
        step, floor = medians[name][1], runtime.weight_bytes / bandwidth
        ratios = " | ".join(f"{medians[name][n] / step:.2f}x" for n in POSITIONS[1:])
        lines.append(f"| {name} | {runtime.weight_bytes / 1e6:.0f} MB | {floor * 1e3:.1f} ms | {step * 1e3:.2f} ms | "
                     f"{step / floor:.2f} | {ratios} |")
    from exactspec.backends.fused import FusedRuntime

    fused = next((runtime for runtime in found.values() if isinstance(runtime, FusedRuntime)), None)
    if fused is not None and peak is not None:
        floors = {n: max(fused.weight_bytes / bandwidth, n * fused.multiply_adds / peak.per_second) for n in POSITIONS}
        lines.append(f"| floor: max(weights / bandwidth, n x {fused.multiply_adds / 1e9:.2f} G multiply-adds / "
                     f"integer peak) | {fused.weight_bytes / 1e6:.0f} MB | | {floors[1] * 1e3:.2f} ms | 1.00 | "
                     + " | ".join(f"{floors[n] / floors[1]:.2f}x" for n in POSITIONS[1:]) + " |")
        lines += ["", f"integer peak {peak.per_second / 1e9:.0f} G multiply-adds/s ({peak.instruction}, "
                      f"{peak.threads} threads at once); many rows' products: {native.tiles()}"]
    return "\n".join(lines)


def prompt_seconds(runtime, tokens: list[int]) -> float:
    """Seconds of a prompt's pass over an empty cache (the logits of its last position); the cache left empty."""
    runtime.rollback(0)
    started = time.perf_counter()
    runtime.extend(tokens, 1)
    elapsed = time.perf_counter() - started
    runtime.rollback(0)
    return elapsed


def prompt_table(found: dict[str, object], lengths: list[int], repeats: int, peak=None) -> str:
    """Each runtime's prompt rate at each length (the best of ``repeats``, runtime after runtime), each against the
    first's (llama.cpp's), and where ``peak`` (the integer peak) is given, the fused runtimes' share of it: their
    matrices' multiply-adds a second over it."""
    lengths = [n for n in lengths if all(n < runtime.max_length for runtime in found.values())]
    best = {name: {n: float("inf") for n in lengths} for name in found}
    for n in lengths:
        tokens = [(100 + 37 * i) % 40000 for i in range(n)]
        for _ in range(repeats):
            for name, runtime in found.items():
                best[name][n] = min(best[name][n], prompt_seconds(runtime, tokens))
    baseline = next(iter(found))
    lines = ["| runtime | " + " | ".join(f"{n} tokens" for n in lengths) + " |", "|---|" + "---:|" * len(lengths)]
    from exactspec.backends.fused import FusedRuntime

    for name, runtime in found.items():
        cells = [f"{n / best[name][n]:.0f}/s ({best[baseline][n] / best[name][n]:.2f}x"
                 + (f", {n * runtime.multiply_adds / best[name][n] / peak.per_second:.0%} of the peak)"
                    if peak is not None and isinstance(runtime, FusedRuntime) else ")") for n in lengths]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default: the default model)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--context", type=int, default=200, help="tokens cached before the timed passes")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--lean", action="store_true", help="also the runtimes of the file's float32 conversion")
    parser.add_argument("--prompts", default=",".join(map(str, PROMPTS)),
                        help="prompt lengths to time (comma-separated; up to 8192); empty: none")
    parser.add_argument("--prompt-repeats", type=int, default=2)
    args = parser.parse_args(argv)
    args.threads = set_torch_threads(args.threads)
    lengths = [int(n) for n in args.prompts.split(",") if n.strip()]
    found = runtimes(args.model, torch.get_num_threads(), args.lean, max(lengths + [args.context + 128]) + 1)
    context = [(100 + 37 * i) % 40000 for i in range(args.context)]
    bandwidth = bandwidth_probe(max(runtime.weight_bytes for runtime in found.values()))
    for runtime in found.values():
        runtime.extend(context, 0)
    peak = native.integer_peak(torch.get_num_threads()) if native.unavailable() is None else None
    print(table(found, median_pass_seconds(found, POSITIONS, args.repeats), bandwidth, peak))
    if lengths:
        print("\nprompt rate: prefill tokens a second (against the first runtime; the fused runtime's share of the "
              "integer peak)\n")
        print(prompt_table(found, lengths, args.prompt_repeats, peak))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_script(main))
