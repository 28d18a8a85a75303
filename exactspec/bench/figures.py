"""``exactspec figures``: the pictures that explain speculative decoding, from measurements taken here and now.

Nothing is typed in: every point is measured on the machine that runs the command, with the model it is given.
"""

from __future__ import annotations

import copy
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

from exactspec.backends import make_backend, sync
from exactspec.backends.base import pass_seconds
from exactspec.backends.linear import PRECISIONS
from exactspec.bench.stats import expected_tokens_per_round
from exactspec.engine import Engine, GenerationConfig
from exactspec.proposers import DraftModelProposer
from exactspec.sampling import SamplingParams, logits_to_probs

POSITIONS = [1, 2, 4, 8, 16, 32]
BATCHES = [1, 2, 4, 8, 16, 32, 64]
DRAFT_LENGTHS = [1, 2, 3, 4, 6, 8]
FIGURES = ("1", "2", "3", "4")  # pass costs, accept or resample, the surplus at batch, tokens per round


def _ticked(value, tick):
    tick()
    return value


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def pass_latency(backend, context: list[int], positions: list[int], repeats: int, tick=lambda: None) -> list[float]:
    """Seconds for one pass of ``backend`` scoring n new positions after ``context``, for each n."""
    sync(backend, context, num_logits=0)
    pass_seconds(backend, 1)  # warm-up
    return [_ticked(statistics.median(pass_seconds(backend, n) for _ in range(repeats)), tick) for n in positions]


def figure_1_runtimes(model, gguf: Path | None, threads: int | None) -> list[tuple[str, object]]:
    """(label, backend) for each runtime figure 1 compares: the torch runtime at each precision, the fused runtime
    where it runs the model here, and llama.cpp over the GGUF as stored where the target came from one and
    llama-cpp-python is installed."""
    from exactspec.backends.fused import FusedRuntime, unavailable

    runtimes = [(f"{precision} weights", lambda precision=precision: make_backend(model, precision))
                for precision in PRECISIONS]
    if unavailable(model) is None:
        runtimes.append(("fused runtime", lambda: FusedRuntime(model)))
    if gguf is not None and importlib.util.find_spec("llama_cpp") is not None:
        from exactspec.backends.llamacpp import LlamaCppLM

        runtimes.append(("llama.cpp, GGUF as stored", lambda: LlamaCppLM.load(gguf, max_length=1024, threads=threads)))
    return runtimes


def batched_cost_ratio(model, k: int, batches: list[int], context_length: int, repeats: int,
                       tick=lambda: None) -> list[float]:
    """Cost of one pass over B sequences x (k+1) new positions, relative to B sequences x 1, for each B."""
    from transformers import DynamicCache

    vocab = model.config.vocab_size
    ratios = []
    for b in batches:
        prefix = torch.randint(3, vocab, (b, context_length), generator=torch.Generator().manual_seed(b))
        costs = []
        for n in (1, k + 1):
            cache = DynamicCache()
            with torch.inference_mode():
                model(input_ids=prefix.to(model.device), cache=cache, logits_to_keep=1)
            new = torch.randint(3, vocab, (b, n), generator=torch.Generator().manual_seed(n)).to(model.device)

            def step(cache=cache, new=new, n=n):
                with torch.inference_mode():
                    model(input_ids=new, cache=cache, logits_to_keep=n)
                cache.crop(-n)

            costs.append(median_seconds(step, repeats))
        ratios.append(_ticked(costs[1] / costs[0], tick))
    return ratios


def tokens_per_round(engine: Engine, prompts: list[list[int]], k: int, new_tokens: int) -> tuple[float, float]:
    """(mean accepted length, acceptance rate) of greedy drafting with k tokens over the prompts."""
    rounds = emitted = drafted = accepted = 0
    for ids in prompts:
        engine.clear_cache()
        stats = engine.generate(ids, GenerationConfig(max_new_tokens=new_tokens, num_draft_tokens=k,
                                                      stop_at_eos=False)).stats
        rounds += stats.rounds
        emitted += stats.new_tokens
        drafted += stats.draft_tokens
        accepted += stats.accepted_tokens
    return emitted / rounds, accepted / max(drafted, 1)


def instructive_position(model, draft_model, context: list[int], params: SamplingParams,
                         steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, q) [vocab] at the position, among the next ``steps`` of the target's greedy continuation of
    ``context``, where the acceptance probability sum(min(p, q)) is nearest 0.5."""
    target = make_backend(model)
    sequence = list(context)
    logits = target.extend(sequence, 1)[0]
    for _ in range(steps - 1):
        sequence.append(int(logits.argmax()))
        logits = target.extend(sequence[-1:], 1)[0]
    with torch.inference_mode():
        target.rollback(0)
        p = logits_to_probs(target.extend(sequence, steps), params).double()  # [steps, vocab]
        q = logits_to_probs(make_backend(draft_model).extend(sequence, steps), params).double()
    q = torch.nn.functional.pad(q, (0, p.shape[-1] - q.shape[-1]))
    best = int((torch.minimum(p, q).sum(-1) - 0.5).abs().argmin())
    return p[best], q[best]


def default_draft(model, layers: int):
    """A draft for the pictures when none is given: the target's first ``layers`` layers, norm and LM head."""
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:layers]
    draft.config.num_hidden_layers = layers
    return draft


def draw_pass_costs(runtimes: list[tuple[str, object]], context: list[int], out: Path, repeats: int,
                    tick=lambda: None) -> Path:
    """Figure 1, many drafts for one weight-streaming: each runtime's pass over n positions after ``context``
    against n single-position passes; ``runtimes`` as (label, a function that builds it), built one at a time."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, make_runtime in runtimes:
        latency = [1000 * s for s in pass_latency(make_runtime(), context, POSITIONS, repeats, tick)]
        line, = ax.plot(POSITIONS, latency, "o-", label=f"one pass scoring n positions, {label}")
        ax.plot(POSITIONS, [latency[0] * n for n in POSITIONS], ":", color=line.get_color(),
                label=f"n single-position passes, {label}")
    ax.set(xscale="log", yscale="log", xlabel="positions scored (n)", ylabel="milliseconds",
           title="Many drafts, one weight-streaming")
    ax.set_xticks(POSITIONS, [str(n) for n in POSITIONS])
    ax.legend(fontsize=8)
    return _save(fig, out / "many_drafts_one_weight_streaming.png")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _progress(points: int):
    from tqdm import tqdm

    return tqdm(total=points, unit="point", file=sys.stderr)


def make_figures(target, draft_model, prompts: list[list[int]], out: Path, repeats: int = 3,
                 new_tokens: int = 48, max_batch: int = 64, k: int = 4, gguf: Path | None = None,
                 threads: int | None = None, which: tuple[str, ...] = FIGURES) -> list[Path]:
    """Measure and draw the figures ``which`` (all four by default) into ``out``; returns the files written.
    Figure 1 adds llama.cpp's line when ``gguf`` (the file the target came from) is given. Figure 3 uses the
    acceptance figure 4 measures."""
    out.mkdir(parents=True, exist_ok=True)
    model = target.model
    written = []
    context = prompts[0]
    batches = [b for b in BATCHES if b <= max_batch]
    runtimes = figure_1_runtimes(model, gguf, threads) if "1" in which else []
    points = (len(runtimes) * len(POSITIONS) + ("2" in which) + len(DRAFT_LENGTHS) * bool({"3", "4"} & set(which))
              + len(batches) * ("3" in which))
    bar = _progress(points)

    if "1" in which:
        written.append(draw_pass_costs(runtimes, context, out, repeats, bar.update))
    if "2" in which:
        written.append(accept_or_resample(target, model, draft_model, context, out, bar.update))
    if {"3", "4"} & set(which):
        written.extend(acceptance_figures(model, draft_model, prompts, out, new_tokens, k, batches, repeats,
                                          which, bar.update))
    bar.close()
    return written


def accept_or_resample(target, model, draft_model, context: list[int], out: Path, tick=lambda: None) -> Path:
    """Figure 2: accept or resample, at the real position (along the target's greedy continuation) whose acceptance
    probability is nearest one half: the position that shows both accepting and resampling."""
    plt = _pyplot()
    p, q = instructive_position(model, draft_model, context, SamplingParams(temperature=1.0), steps=24)
    top = torch.topk(p + q, 12).indices
    overlap = torch.minimum(p, q)
    residual = (p - q).clamp(min=0)
    residual = residual / residual.sum() if residual.sum() > 0 else residual
    tick()
    labels = [repr(target.tokenizer.decode([int(t)]))[1:-1] or "·" for t in top]
    fig, ax = plt.subplots(figsize=(7.2, 4.2))
    x = list(range(len(top)))
    for offset, values, label in [(-0.3, p, "target p"), (-0.1, q, "draft q"),
                                  (0.1, overlap, "min(p, q): accepted mass"),
                                  (0.3, residual, "residual (p − q)+, renormalised")]:
        ax.bar([i + offset for i in x], values[top].tolist(), 0.2, label=label)
    ax.set_xticks(x, labels, rotation=45, ha="right", fontsize=8)
    ax.set(ylabel="probability", title=f"Accept or resample: P(accept) = Σ min(p, q) = {float(overlap.sum()):.2f}")
    ax.legend(fontsize=8)
    return _save(fig, out / "accept_or_resample.png")


def acceptance_figures(model, draft_model, prompts: list[list[int]], out: Path, new_tokens: int, k: int,
                       batches: list[int], repeats: int, which: tuple[str, ...], tick=lambda: None) -> list[Path]:
    """Figure 4, tokens per round against k as measured and as (1 - a^(k+1)) / (1 - a) predicts, and figure 3,
    the batched cost of k + 1 positions and the speedup it implies at the acceptance a measured for figure 4."""
    plt = _pyplot()
    written = []
    target_backend = make_backend(model)
    engine = Engine(target_backend, DraftModelProposer(make_backend(draft_model), target_backend.vocab_size))
    measured = [_ticked(tokens_per_round(engine, prompts, kk, new_tokens), tick) for kk in DRAFT_LENGTHS]
    alpha = measured[0][1]  # acceptance measured at k = 1: no position effects
    if "4" in which:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        ax.plot(DRAFT_LENGTHS, [m[0] for m in measured], "o", label="measured")
        ks = torch.linspace(1, max(DRAFT_LENGTHS), 50).tolist()
        ax.plot(ks, [expected_tokens_per_round(alpha, kk) for kk in ks], "-",
                label=f"(1 − α^(k+1)) / (1 − α), α = {alpha:.2f} (measured at k = 1)")
        ax.set(xlabel="draft length k", ylabel="tokens per target pass", title="Expected tokens per round")
        ax.legend(fontsize=8)
        written.append(_save(fig, out / "tokens_per_round.png"))
    if "3" in which:
        ratios = batched_cost_ratio(model, k, batches, context_length=64, repeats=repeats, tick=tick)
        implied = [expected_tokens_per_round(alpha, k) / r for r in ratios]
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        ax.plot(batches, ratios, "o-", label=f"cost of B×{k + 1} positions / B×1")
        ax.plot(batches, implied, "s-", label=f"implied speedup at α = {alpha:.2f}, k = {k} (free drafting)")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set(xscale="log", xlabel="batch size B", ylabel="ratio", title="The surplus is only free at small batch")
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.legend(fontsize=8)
        written.append(_save(fig, out / "surplus_only_free_at_small_batch.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def figures_asked(only: str) -> tuple[str, ...]:
    """The figures a comma list names (``FIGURES``), in order; a name outside them is the user's error."""
    from exactspec.errors import UsageError

    asked = {name.strip() for name in only.split(",") if name.strip()}
    if not asked or asked - set(FIGURES):
        raise UsageError(f"--only takes figures among {', '.join(FIGURES)} (a comma list), not {only!r}")
    return tuple(name for name in FIGURES if name in asked)


def stored_runtimes(model_name, threads: int | None) -> list[tuple[str, object]] | None:
    """Figure 1's runtimes straight from a GGUF file that the fused runtime reads as stored (llama.cpp, and the
    fused runtime with integer and with float products: ``python -m exactspec.bench.passes``'s), with no conversion
    to a transformers model; None where the model is not such a file."""
    from exactspec.bench.passes import runtimes
    from exactspec.models import model_path
    from exactspec.runtime_choice import fused_reads

    if not fused_reads(model_path(model_name)):
        return None
    found = runtimes(model_name, threads or torch.get_num_threads())
    return [(label, lambda runtime=runtime: runtime) for label, runtime in found.items()]


def run_figures(args) -> int:
    from exactspec.bench.prompts import read_prompts
    from exactspec.errors import UsageError
    from exactspec.loading import encode_prompt, load_target
    from exactspec.models import load_tokenizer

    if args.repeats < 1 or args.max_batch < 1:
        raise UsageError("--repeats and --max-batch must be >= 1")
    which, out = figures_asked(args.only), Path(args.out)

    def prompt_ids(tokenizer) -> list[list[int]]:
        return [encode_prompt(tokenizer, p.text, None if p.chat else False)
                for p in read_prompts(args.prompts, limit=args.limit)]

    stored = stored_runtimes(args.model, args.threads) if which == ("1",) else None
    if stored is not None:  # figure 1 alone, of the file as stored: a model of billions of weights in seconds
        out.mkdir(parents=True, exist_ok=True)
        bar = _progress(len(stored) * len(POSITIONS))
        print(draw_pass_costs(stored, prompt_ids(load_tokenizer(args.model)[0])[0], out, args.repeats, bar.update))
        bar.close()
        return 0
    drafted = bool({"2", "3", "4"} & set(which))
    loaded = load_target(args.model, dtype="float32", device=args.device, backend="torch",
                         draft_model=args.draft_model if drafted else None)
    target = loaded.target
    prompts = prompt_ids(target.tokenizer)
    draft_model = None  # figure 1 alone needs none
    if loaded.draft is not None:
        draft_model = loaded.draft.model
    elif drafted:
        draft_model = default_draft(target.model, layers=max(1, 3 * target.model.config.num_hidden_layers // 4))
    for path in make_figures(target, draft_model, prompts, out, repeats=args.repeats,
                             new_tokens=args.max_new_tokens, max_batch=args.max_batch, gguf=target.gguf,
                             threads=args.threads, which=which):
        print(path)
    return 0


def plot_learning_curves(drafter_dirs: list[Path], path: Path, title: str = "") -> Path:
    """Held-out greedy agreement at draft position 1 against training positions and against CPU-hours, for each
    trained drafter (the curves its ``drafter.json`` keeps), with the bigram table's as a line."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    bigram = None
    for directory in map(Path, drafter_dirs):
        config = json.loads((directory / "drafter.json").read_text())
        curve = config["training"]["curve"]
        bigram = config["training"].get("bigram_heldout_agreement") or bigram
        first = [point["heldout_agreement"][0] for point in curve]
        axes[0].plot([point["tokens"] / 1e6 for point in curve], first, marker="o", label=config["method"])
        axes[1].plot([point["cpu_hours"] for point in curve], first, marker="o", label=config["method"])
    for ax, xlabel in zip(axes, ("training positions seen (millions)", "CPU-hours")):
        if bigram:
            ax.axhline(bigram[0], color="grey", linestyle="--", label="bigram table")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out greedy agreement, draft position 1")
    axes[0].legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
