"""How much of a model's text a draft vocabulary covers, by size: on the shipped corpus's held-out part and on the
benchmarks' text. ::

    python -m exactspec.bench.vocabulary --model qwen2.5-coder-0.5b

For each size the ids ranked first on the corpus's fit part (``exactspec.draft_vocabulary``) are measured on the
corpus's held-out conversations and on each benchmark file's text: every turn of a record and its reference
answers where it has them (MT-bench, Spec-Bench), HumanEval's prompt and canonical solution, as a stand-in for
what the target writes there. The last ``--spare`` records of each category are left out: they stay unseen by
anything tuned here.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from collections.abc import Iterator
from pathlib import Path

from exactspec.draft_vocabulary import TARGET_COVERAGE, CorpusCounts, DraftVocabulary, token_counts
from exactspec.errors import run_script
from exactspec.models import load_tokenizer
from exactspec.vocabularies import control_ids

SIZES = (8192, 16384, 24576, 32768, 49152, 65536)
BENCHMARKS = ("data/mt_bench_question.jsonl", "data/spec_bench_question.jsonl", "data/HumanEval.jsonl.gz")
SPARE = 12  # records kept out at the end of each category


def benchmark_texts(path: Path, spare: int = SPARE) -> list[str]:
    """The text of a benchmark file's records, all but the last ``spare`` of each category."""
    by_category: dict[str, list[list[str]]] = {}
    for record in _records(path):
        category = record.get("category", "humaneval" if "canonical_solution" in record else "default")
        by_category.setdefault(category, []).append(list(_texts(record)))
    kept = [texts for records in by_category.values() for texts in records[: max(len(records) - spare, 0)]]
    return [text for texts in kept for text in texts if text.strip()]


def _records(path: Path) -> Iterator[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as lines:
        yield from (json.loads(line) for line in lines if line.strip())


def _texts(record: dict) -> Iterator[str]:
    if "canonical_solution" in record:  # HumanEval: the function the target completes, written out
        yield record["prompt"] + record["canonical_solution"]
        return
    yield from (turn for turn in record.get("turns", []) if isinstance(turn, str))
    reference = record.get("reference") or []
    for answer in reference if isinstance(reference, list) else [reference]:
        yield from (answer if isinstance(answer, list) else [answer])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file, a transformers directory or a short name "
                                                      "(default: SmolLM2-135M-Instruct)")
    parser.add_argument("--spare", type=int, default=SPARE, help="records left out at each category's end")
    parser.add_argument("--target", type=float, default=TARGET_COVERAGE, help="the coverage a size must reach")
    args = parser.parse_args()
    tokenizer, vocab_size = load_tokenizer(args.model)
    start = time.perf_counter()
    counts = CorpusCounts.of(tokenizer, vocab_size)
    seconds = time.perf_counter() - start
    controls = control_ids(tokenizer, vocab_size)
    print(f"vocabulary {vocab_size:,} ids ({len(controls)} control); corpus {int(counts.fit.sum()):,} fit + "
          f"{int(counts.heldout.sum()):,} held-out tokens, counted in {seconds:.2f} s")
    texts = {name: token_counts(tokenizer, vocab_size, benchmark_texts(Path(name), args.spare))
             for name in BENCHMARKS}
    chosen = DraftVocabulary.choose(counts, controls, target=args.target)
    sizes = sorted({size for size in SIZES if size < vocab_size} | {chosen.size})
    print("size   | corpus held-out | " + " | ".join(f"{Path(name).name.split('.')[0]} ({int(c.sum()):,})"
                                                    for name, c in texts.items()))
    for size in sizes:
        vocabulary = DraftVocabulary.of_size(counts, controls, size)
        shares = [float(c[vocabulary.ids].sum() / max(c.sum(), 1)) for c in texts.values()]
        mark = "  <- chosen" if size == chosen.size else ""
        print(f"{size:6d} | {vocabulary.coverage:.4f}          | " + " | ".join(f"{s:.4f}" for s in shares) + mark)
    print(f"chosen: {chosen.size:,} ids, held-out coverage {chosen.coverage:.4f} (target {args.target})")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_script(main))
