"""``exactspec bench-exits``: where self-speculation could pay, exit layer by exit layer (the break-even curve).

For each exit layer L, on the target's own greedy answers to the prompts:

- **acceptance**: how often the early exit's first choice is the target's next token, untrained (the target's
  final norm and LM head on its hidden state after L layers) and, for each adapter given, trained. At temperature 0
  a draft of k tokens keeps the run of agreements that starts at its first position (a drafted token agrees exactly
  when it is the target's token, and then the next shallow state is the target's own), so the mean accepted length
  of a k-token draft is the mean, over the answers' positions, of that run capped at k;
- **cost**, timed in this process, every size interleaved: a plain decode pass; one drafting step (the first L
  layers over one token, an exit adapter (the given one, else one of ``ADAPTER_BLOCKS`` blocks) and the LM head
  over a draft vocabulary of ``DRAFT_VOCAB`` ids); the verifying pass over the pending token and k drafts (the
  first L layers over the last draft only, all deeper layers over k+1 positions: what the shared cache leaves);
- the **predicted speedup** of a k-token chain: (1 + accepted) x decode / (k x drafting step + verifying pass),
  and the first-position acceptance at which a one-token draft breaks even.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from exactspec.backends.base import ShallowRunner, pass_seconds, require
from exactspec.bench.stats import round_speedup
from exactspec.errors import UsageError

DRAFT_VOCAB = 8192  # the draft vocabulary timed (exactspec train's default)
ADAPTER_BLOCKS = 2  # the adapter's blocks timed where no trained adapter is given (the shipped one's)
MAX_K = 4
REPEATS = 7


@dataclass
class ExitLayer:
    layer: int
    untrained: list[float]  # mean accepted length of a k-token draft, k = 1..MAX_K (index 0: k = 1)
    trained: list[float] | None  # the same with the adapter given for this layer
    draft_ms: float  # one drafting step
    verify_ms: list[float]  # the verifying pass after k = 1..MAX_K drafts
    decode_ms: float  # a plain decode pass, timed beside them

    def speedup(self, accepted: list[float]) -> list[float]:  # per k
        return [round_speedup(1 + a, k * self.draft_ms, v, self.decode_ms)
                for k, (a, v) in enumerate(zip(accepted, self.verify_ms), start=1)]

    @property
    def break_even(self) -> float:
        """The first-position acceptance at which a one-token draft costs what it gains (above 1: never)."""
        return (self.draft_ms + self.verify_ms[0]) / self.decode_ms - 1

    def to_dict(self) -> dict:
        return {**asdict(self), "break_even": self.break_even, "untrained_speedup": self.speedup(self.untrained),
                "trained_speedup": self.speedup(self.trained) if self.trained else None}


@dataclass
class ExitReport:
    layers: list[ExitLayer] = field(default_factory=list)
    settings: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"settings": self.settings, "layers": [layer.to_dict() for layer in self.layers]}


def accepted_lengths(agrees: list[list[bool]], max_k: int = MAX_K) -> list[float]:
    """Mean accepted length of a k-token greedy draft, k = 1..max_k, from each answer's per-position agreement
    (agrees[j]: whether the exit's choice after position j is the target's token): at each position, the run of
    agreements that starts there, capped at k."""
    totals, count = [0.0] * max_k, 0
    for row in agrees:
        run = 0
        runs = [0] * len(row)
        for j in range(len(row) - 1, -1, -1):
            run = run + 1 if row[j] else 0
            runs[j] = run
        for r in runs:
            for k in range(max_k):
                totals[k] += min(r, k + 1)
        count += len(runs)
    return [t / count if count else 0.0 for t in totals]


def plain_exit(runtime, states: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n] the exit's choices
    return runtime.exit_logits(states).argmax(-1)


def adapter_exit(adapter, states: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n] target ids
    with torch.inference_mode():
        return adapter.vocab.ids[adapter.vocab.logits(adapter(states.float())).argmax(-1)]


def measure_agreement(runtime, sequences: list[tuple[list[int], list[int]]], layers: list[int],
                      adapters: dict[int, torch.nn.Module]) -> tuple[dict[int, list[float]], dict[int, list[float]]]:
    """Mean accepted lengths per k, for each exit layer's plain exit and each adapter, on (prompt, answer)s."""
    plain: dict[int, list[list[bool]]] = {layer: [] for layer in layers}
    trained: dict[int, list[list[bool]]] = {layer: [] for layer in adapters}
    for prompt, answer in sequences:
        if len(answer) < 2:
            continue
        runtime.rollback(0)
        runtime.extend(prompt[:-1], 0)
        # [layers+1, n, hidden]: position j predicts answer[j]
        states = runtime.layer_states([prompt[-1]] + answer[:-1])
        truth = torch.tensor(answer, device=states.device)
        for layer in layers:
            plain[layer].append((plain_exit(runtime, states[layer]) == truth).tolist())
        for layer, adapter in adapters.items():
            trained[layer].append((adapter_exit(adapter, states[layer]) == truth).tolist())
    return ({layer: accepted_lengths(rows) for layer, rows in plain.items()},
            {layer: accepted_lengths(rows) for layer, rows in trained.items()})


@torch.inference_mode()
def measure_costs(runtime, context: list[int], layers: list[int], adapter_for, repeats: int = REPEATS
                  ) -> tuple[float, dict[int, float], dict[int, list[float]]]:
    """Median milliseconds of a decode pass, of a drafting step at each layer, and of the verifying pass after
    k = 1..MAX_K drafts at each layer; every measurement interleaved with the others, ``repeats`` rounds."""
    runtime.rollback(0)
    runtime.extend(context, 0)
    cached = len(runtime.tokens)
    token = runtime.tokens[-1]  # what pass_seconds appends: the drafts repeat it, so that the pass reuses them
    decode, draft = [], {layer: [] for layer in layers}
    verify = {layer: [[] for _ in range(MAX_K)] for layer in layers}
    for repeat in range(repeats + 1):  # the first round warms up, and is dropped
        keep = repeat > 0
        seconds = pass_seconds(runtime, 1)
        if keep:
            decode.append(seconds)
        for layer in layers:
            adapter = adapter_for(layer)
            started = time.perf_counter()
            adapter.vocab.logits(adapter(runtime.extend_shallow([token], layer)[-1])).argmax()
            seconds = time.perf_counter() - started
            runtime.rollback(cached)
            if keep:
                draft[layer].append(seconds)
            for k in range(1, MAX_K + 1):
                for _ in range(k):
                    runtime.extend_shallow([token], layer)
                seconds = pass_seconds(runtime, k + 1)  # rolls back to the cache, the shallow runs with it
                if keep:
                    verify[layer][k - 1].append(seconds)
    ms = lambda times: 1000 * statistics.median(times)  # noqa: E731
    return ms(decode), {layer: ms(times) for layer, times in draft.items()}, \
        {layer: [ms(times) for times in per_k] for layer, per_k in verify.items()}


def markdown(report: ExitReport) -> str:
    lines = ["| exit layer | plain exit: accepted of 1 | trained: accepted of 1 | draft step ms | verify ms (k=1..4) "
             "| break-even acceptance | best predicted speedup, plain | trained |",
             "|---:|---:|---:|---:|---|---:|---:|---:|"]
    for layer in report.layers:
        plain = layer.speedup(layer.untrained)
        trained = layer.speedup(layer.trained) if layer.trained else None
        best = lambda speedups: f"{max(speedups):.2f}x (k={speedups.index(max(speedups)) + 1})"  # noqa: E731
        lines.append(
            f"| {layer.layer} | {layer.untrained[0]:.3f} | {f'{layer.trained[0]:.3f}' if layer.trained else ''} | "
            f"{layer.draft_ms:.1f} | {' / '.join(f'{v:.1f}' for v in layer.verify_ms)} | {layer.break_even:.2f} | "
            f"{best(plain)} | {best(trained) if trained else ''} |")
    lines.append(f"\nA plain decode pass: {report.layers[0].decode_ms:.1f} ms. Accepted lengths are on the "
                 f"target's greedy answers to {report.settings.get('num_prompts')} prompts "
                 f"({report.settings.get('positions')} positions).")
    return "\n".join(lines)


def run_bench_exits(args) -> int:
    from exactspec.bench.prompts import read_prompts
    from exactspec.drafters import checkpoint
    from exactspec.drafters.layers import LayerShape
    from exactspec.drafters.loading import parse_drafter_paths
    from exactspec.drafters.networks import DrafterConfig, ExitAdapter, TargetParts, prepare_for_drafting
    from exactspec.engine import Engine, GenerationConfig
    from exactspec.loading import encode_prompt, load_target
    from exactspec.proposers import NoProposer

    paths = _exit_paths(args.drafter_path, parse_drafter_paths)
    bench_prompts = read_prompts(args.prompts, category=args.category, limit=args.limit)
    loaded = load_target(args.model, dtype=args.dtype, device=args.device, backend="lean")
    target = loaded.target
    runtime = loaded.runtime
    require(runtime, ShallowRunner, "bench-exits", "exactspec's lean runtime runs llama-family targets' first layers")
    layers = _parse_layers(args.layers, runtime.num_layers)
    adapters, adapter_paths = {}, {}
    for path in paths:
        adapter = prepare_for_drafting(checkpoint.load(path, "early-exit", target.model))
        adapters[adapter.config.exit_layer] = adapter
        adapter_paths[str(adapter.config.exit_layer)] = str(path)
    layers = sorted(set(layers) | set(adapters))
    prompts = [encode_prompt(target.tokenizer, p.text, None if p.chat else False) for p in bench_prompts]
    print(f"exactspec: the target answers {len(prompts)} prompts", file=sys.stderr, flush=True)
    decoder = Engine(runtime, NoProposer(), loaded.stop_ids)
    sequences = [(prompt, decoder.generate(prompt, GenerationConfig(max_new_tokens=args.max_new_tokens)).token_ids)
                 for prompt in prompts]
    plain, trained = measure_agreement(runtime, sequences, layers, adapters)
    print("exactspec: timing the passes", file=sys.stderr, flush=True)
    # an untrained adapter of the trained ones' size costs what they do: it times the layers that have none
    config = DrafterConfig(method="early-exit", shape=LayerShape.of(target.model.config),
                           vocab_size=runtime.vocab_size, layers=ADAPTER_BLOCKS, exit_layer=1)
    fresh = ExitAdapter(config, TargetParts.of(target.model), torch.arange(min(DRAFT_VOCAB, runtime.vocab_size)))
    fresh = prepare_for_drafting(fresh.eval())
    decode, draft, verify = measure_costs(runtime, prompts[0], layers, lambda layer: adapters.get(layer, fresh))
    report = ExitReport(settings={
        "prompts": str(args.prompts), "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "positions": sum(len(answer) for _, answer in sequences), "model": args.model or "default",
        "dtype": runtime.precision_label, "threads": torch.get_num_threads(),
        "adapters": adapter_paths})
    for layer in layers:
        report.layers.append(ExitLayer(layer, plain[layer], trained.get(layer), draft[layer], verify[layer], decode))
    print(markdown(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return 0


def _exit_paths(entries: list[str] | None, parse) -> list[str]:
    """The ``--drafter-path`` entries' directories, each an early-exit adapter (early-exit=DIR or DIR), in order."""
    found = []
    for entry in entries or []:
        method, path = next(iter(parse([entry]).items()))
        if method != "early-exit":
            raise UsageError(f"--drafter-path {entry}: bench-exits takes early-exit adapters, not {method}")
        found.append(path)
    return found


def _parse_layers(text: str | None, num_layers: int) -> list[int]:
    if text is None:
        return list(range(2, num_layers, 2))
    try:
        layers = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"--layers takes comma-separated layer counts, got {text!r}") from None
    if not layers or any(not 1 <= layer < num_layers for layer in layers):
        raise UsageError(f"--layers must be in 1..{num_layers - 1}, got {text!r}")
    return layers
