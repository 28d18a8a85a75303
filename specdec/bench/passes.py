"""What a pass over n positions costs on each runtime, side by side in one run: the seed's Figure 1 as a table, with
each runtime's roofline (its weights' bytes over the bandwidth this machine streams).

    python -m specdec.bench.passes [--model FILE.gguf] [--threads 2] [--context 200] [--repeats 7] [--lean]

The runtimes: llama.cpp over the GGUF as stored, and specdec's fused runtime over the file's matrices as stored
(``FusedRuntime.from_gguf``), with integer products and with float products. Where the fused runtime cannot read
the file directly, or with ``--lean``, the file is converted to a float32 transformers model for the fused runtime
in float16 and int8 weights and the lean runtime in float16 and float32 (the conversion takes minutes and several
times the file's size in memory for a model of billions of weights). Each is fed the
same context; then passes over 1, 2, 3, 4, 5, 8 and 17 positions are timed, runtime after runtime within each
repeat (one untimed pass first: the runtime before may still hold a core while its threads spin down), and the
medians kept. The bandwidth is the probe of ``specdec bench``'s roofline (a float32 sum over 256 MiB or more,
larger than any cache).
"""

from __future__ import annotations

import argparse

import torch

from specdec.backends.base import median_pass_seconds
from specdec.bench.roofline import bandwidth_probe

POSITIONS = (1, 2, 3, 4, 5, 8, 17)


def runtimes(model_name, threads: int, lean: bool = False) -> dict[str, object]:
    from specdec.backends.fused import PRODUCTS, FusedRuntime, gguf_unavailable, unavailable
    from specdec.backends.gguf_file import GGUFFile
    from specdec.backends.lean import LeanRuntime
    from specdec.models import load_gguf, load_model, model_path

    source = model_path(model_name)
    found = {"llama.cpp (GGUF as stored)": load_gguf(source, threads).runtime}
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


def table(found: dict[str, object], medians: dict[str, dict[int, float]], bandwidth: float) -> str:
    lines = [f"bandwidth {bandwidth / 1e9:.1f} GB/s (probe); {torch.get_num_threads()} threads", "",
             "| runtime | weights read per pass | floor | 1 position | x floor | "
             + " | ".join(f"{n}" for n in POSITIONS[1:]) + " |",
             "|---|---:|---:|---:|---:|" + "---:|" * (len(POSITIONS) - 1)]
    for name, runtime in found.items():
        step, floor = medians[name][1], runtime.weight_bytes / bandwidth
        ratios = " | ".join(f"{medians[name][n] / step:.2f}x" for n in POSITIONS[1:])
        lines.append(f"| {name} | {runtime.weight_bytes / 1e6:.0f} MB | {floor * 1e3:.1f} ms | {step * 1e3:.2f} ms | "
                     f"{step / floor:.2f} | {ratios} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default: the default model)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--context", type=int, default=200, help="tokens cached before the timed passes")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--lean", action="store_true", help="also the runtimes of the file's float32 conversion")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    found = runtimes(args.model, torch.get_num_threads(), args.lean)
    context = [(100 + 37 * i) % 40000 for i in range(args.context)]
    bandwidth = bandwidth_probe(max(runtime.weight_bytes for runtime in found.values()))
    for runtime in found.values():
        runtime.extend(context, 0)
    print(table(found, median_pass_seconds(found, POSITIONS, args.repeats), bandwidth))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
