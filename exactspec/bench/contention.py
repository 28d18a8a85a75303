"""Plain decoding on a quiet machine and beside another process that keeps cores busy, side by side in one run.

A shared host or a CPU-limited container runs other work beside exactspec's: a thread team that spins while a member
is descheduled ran 72x slower there. This times plain decoding (drafter ``none``, prefill included) alternately
quiet and with ``--busy`` processes spinning in pure Python (``--busy 1.3``: one on a whole core, one a third of
the time), and reports each one's median and the ratio busy / quiet.

    python -m exactspec.bench.contention --model qwen2.5-coder-1.5b --max-new-tokens 64 --repeats 3
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import time

from exactspec.cores import set_torch_threads
from exactspec.engine import GenerationConfig
from exactspec.errors import run_script

PROMPT = "Write a short story about a lighthouse keeper."
BUSY_LOOP = """
import sys, time
share = float(sys.argv[1])
while True:
    started = time.perf_counter()
    while time.perf_counter() - started < 0.01 * share:
        pass
    if share < 1:
        time.sleep(0.01 * (1 - share))
"""


def busy_processes(cores: float) -> list[subprocess.Popen]:
    """Processes that keep ``cores`` cores' worth busy: one a whole core each, the last its fraction."""
    shares = [1.0] * math.floor(cores) + ([cores % 1] if cores % 1 else [])
    return [subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(share)]) for share in shares]


def timed_decoding(decoder, prompt_ids: list[int], new_tokens: int) -> float:
    decoder.engine.clear_cache()
    started = time.perf_counter()
    decoder.engine.generate(prompt_ids, GenerationConfig(max_new_tokens=new_tokens, stop_at_eos=False))
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a .gguf or transformers directory (default: the default model)")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--busy", type=float, default=1.0, help="cores' worth of other work (default 1)")
    args = parser.parse_args(argv)
    args.threads = set_torch_threads(args.threads)
    from exactspec import SpecDecoder

    decoder = SpecDecoder.load(args.model, drafter="none", backend=args.backend, threads=args.threads)
    prompt_ids = decoder.encode(PROMPT)
    timed_decoding(decoder, prompt_ids, args.max_new_tokens)  # warm: caches, the team's first measures
    seconds: dict[str, list[float]] = {"quiet": [], "busy": []}
    for _ in range(args.repeats):
        for state in ("quiet", "busy"):
            others = busy_processes(args.busy) if state == "busy" else []
            try:
                time.sleep(0.2 if others else 0.0)
                seconds[state].append(timed_decoding(decoder, prompt_ids, args.max_new_tokens))
            finally:
                for other in others:
                    other.kill()
                    other.wait()
    quiet, busy = (statistics.median(seconds[state]) for state in ("quiet", "busy"))
    print(f"| {args.max_new_tokens} tokens, plain decoding | seconds (median of {args.repeats}) |")
    print("|---|---:|")
    print(f"| quiet | {quiet:.3f} |")
    print(f"| beside {args.busy:g} busy cores | {busy:.3f} |")
    print(f"| busy / quiet | {busy / quiet:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_script(main))
