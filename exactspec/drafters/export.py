"""``exactspec export``: a trained drafter written in a published layout that GPU engines load (vLLM, SGLang):
EAGLE-1 for ``eagle`` heads, Medusa-1 for ``mtp`` heads (see :mod:`exactspec.drafters.layouts` for both layouts;
exactspec reads them back with ``--drafter-path``).

The config names the target the drafter was trained for (``base_model_name_or_path``, and exactspec's fingerprint
of its weights under ``exactspec_target``). A drafter that drafts over part of the vocabulary keeps that list in
``draft_vocab.safetensors`` beside the weights: exactspec reads it back, so the round trip drafts the same tokens;
engines that know only the published layout ignore it and draft over the whole vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from exactspec.choices import EXPORT_FORMATS as FORMATS
from exactspec.drafters import checkpoint
from exactspec.drafters.files import DRAFT_VOCAB_FILE
from exactspec.errors import UsageError


def export(source: Path, layout: str, out: Path, target_model) -> list[Path]:
    """Write the exactspec drafter in ``source`` (trained for ``target_model``) to ``out`` in ``layout``; the files
    written."""
    if layout not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)}, got {layout!r}")
    config = checkpoint.read_config(source)
    if config.method != FORMATS[layout]:
        raise UsageError(f"{source} holds a {config.method} drafter; the {layout} layout is for "
                         f"{FORMATS[layout]} drafters")
    network = checkpoint.load(source, config.method, target_model)
    state = {name: t.detach().float().contiguous() if t.is_floating_point() else t.contiguous()
             for name, t in network.state_dict().items()}
    ids = state.pop("vocab.ids")
    out.mkdir(parents=True, exist_ok=True)
    target = {"base_model_name_or_path": config.target.get("name", ""), "exactspec_target": config.target}
    if layout == "eagle":
        written = _write_eagle(config, state, target, out)
    else:
        written = _write_medusa(config, state, target, out)
    if config.draft_vocab:  # a part of the vocabulary: kept beside the layout
        save_file({"ids": ids.contiguous()}, str(out / DRAFT_VOCAB_FILE))
        written.append(out / DRAFT_VOCAB_FILE)
    return written


def _write_eagle(config, state: dict[str, torch.Tensor], target: dict, out: Path) -> list[Path]:
    shape = config.shape
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape.hidden,
             "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
             "intermediate_size": shape.intermediate, "rms_norm_eps": shape.eps, "rope_theta": shape.rope_theta,
             "num_hidden_layers": config.layers, "vocab_size": config.vocab_size, "hidden_act": "silu", "bias": True,
             "torch_dtype": "float32", **target}
    _write_json(out / "config.json", llama)
    save_file(state, str(out / "model.safetensors"))
    return [out / "config.json", out / "model.safetensors"]


def _write_medusa(config, state: dict[str, torch.Tensor], target: dict, out: Path) -> list[Path]:
    if config.token_input:
        raise UsageError("these mtp heads read the token after the feature (exactspec's default), which Medusa-1's "
                         "layout has no place for: train them with --no-token-input to export them")
    _write_json(out / "config.json", {"medusa_num_heads": config.heads, "medusa_num_layers": config.head_layers,
                                      "hidden_size": config.shape.hidden, "vocab_size": config.vocab_size, **target})
    heads = {name.removeprefix("heads."): t for name, t in state.items() if name.startswith("heads.")}
    save_file(heads, str(out / "medusa_lm_head.safetensors"))
    return [out / "config.json", out / "medusa_lm_head.safetensors"]


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")


def run_export(args) -> int:
    from exactspec.drafters.loading import shipped_directory
    from exactspec.models import load_model

    method = FORMATS[args.format]  # argparse took only these
    target = load_model(args.model, dtype="float32", backend="lean").model
    source = Path(args.drafter_path) if args.drafter_path else shipped_directory(method, target)
    if source is None:
        raise UsageError(f"no trained {method} drafter ships for this target: pass --drafter-path DIR")
    if not (source / checkpoint.CONFIG_FILE).is_file():
        raise UsageError(f"{source} is not a drafter exactspec trained (no {checkpoint.CONFIG_FILE})")
    for path in export(source, args.format, Path(args.out), target):
        print(path)
    return 0
