"""What a pass over n positions costs on each runtime, side by side in one run: the seed's Figure 1 as a table, with
each runtime's roofline (its weights' bytes over the bandwidth this machine streams).

    python -m specdec.bench.passes [--model FILE.gguf] [--threads 2] [--context 200] [--repeats 7]

The runtimes: llama.cpp over the GGUF as stored, specdec's fused runtime (float16 weights, and int8 with a scale and
offset per 32 inputs) and specdec's torch runtime (float16 through fbgemm, float32 through oneDNN). Each is fed the
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


def runtimes(model_path, threads: int) -> dict[str, object]:
    from specdec.backends.fused import FusedRuntime, unavailable
    from specdec.backends.lean import LeanRuntime
    from specdec.models import default_model_path, load_gguf, load_model

    source = default_model_path() if model_path is None else model_path
    model = load_model(source, dtype="float32", device="cpu", backend="lean").model
    found = {"llama.cpp (GGUF as stored)": load_gguf(source, threads).runtime}
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
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    found = runtimes(args.model, torch.get_num_threads())
    context = [(100 + 37 * i) % 40000 for i in range(args.context)]
    bandwidth = bandwidth_probe(max(runtime.weight_bytes for runtime in found.values()))
    for runtime in found.values():
        runtime.extend(context, 0)
    print(table(found, median_pass_seconds(found, POSITIONS, args.repeats), bandwidth))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
