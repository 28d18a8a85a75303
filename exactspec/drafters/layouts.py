"""Published drafter checkpoints, loaded into exactspec's networks.

- EAGLE (EAGLE-1, SafeAILab): ``config.json`` (llama fields; ``bias`` for fc's bias, true when absent) and
  ``model.safetensors`` with ``fc.weight`` [hidden, 2*hidden] (over [embedding; feature]), ``fc.bias``,
  ``layers.N.*`` in transformers' llama names, layer 0 without ``input_layernorm``, no final norm; an
  ``embed_tokens.weight`` may be there (the target's own is used). Features are the target's post-norm hidden states.
- Medusa (Medusa-1, FasterDecoding): ``config.json`` with ``medusa_num_heads`` and ``medusa_num_layers``, and
  ``medusa_lm_head.safetensors`` with ``{head}.{block}.linear.{weight,bias}`` and, unless the heads share the
  target's LM head (the legacy layout), ``{head}.{medusa_num_layers}.weight`` [vocab, hidden]. Head i predicts the
  token i+2 positions after the feature's, as exactspec's mtp head i+1 does.

Pickled files (``pytorch_model.bin``, ``medusa_lm_head.pt``) are refused: convert them to safetensors first.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from exactspec.drafters.files import read_draft_vocab, read_weights
from exactspec.drafters.layers import LayerShape
from exactspec.drafters.networks import DrafterConfig
from exactspec.errors import UsageError

EAGLE_WEIGHTS = ("model.safetensors",)
MEDUSA_WEIGHTS = ("medusa_lm_head.safetensors", "model.safetensors")
PICKLED = ("pytorch_model.bin", "medusa_lm_head.pt")


def read_published(directory: Path, method: str, target_model
                   ) -> tuple[DrafterConfig, object, dict[str, torch.Tensor]]:
    """A published layout's config, the target, and its weights in exactspec's names (``checkpoint.build`` them)."""
    config = _read_json(directory / "config.json")
    layouts = {"eagle": (EAGLE_WEIGHTS, eagle_config_and_state), "mtp": (MEDUSA_WEIGHTS, medusa_config_and_state)}
    if method in layouts:
        names, read = layouts[method]
        drafter, target, state = read(config, read_weights(_find(directory, names)), target_model)
        return _with_draft_vocab(directory, drafter, target, state)
    raise UsageError(f"{directory} has no {directory.name}/drafter.json; a published draft model is a transformers "
                     "model: pass it with --draft-model")


def _with_draft_vocab(directory: Path, drafter: DrafterConfig, target_model, state: dict[str, torch.Tensor]):
    """The draft vocabulary ``exactspec export`` keeps beside the layout (draft_vocab.safetensors), if there."""
    ids = read_draft_vocab(directory)
    if ids is None:
        return drafter, target_model, state
    if ids.ndim != 1 or not len(ids) or int(ids.min()) < 0 or int(ids.max()) >= drafter.vocab_size:
        raise UsageError(f"{directory}/draft_vocab.safetensors does not hold token ids of this target")
    return replace(drafter, draft_vocab=len(ids)), target_model, {**state, "vocab.ids": ids}


def eagle_config_and_state(config: dict, state: dict[str, torch.Tensor], target_model
                           ) -> tuple[DrafterConfig, object, dict[str, torch.Tensor]]:
    if any(name.startswith("midlayer.") for name in state):
        raise UsageError("this is an EAGLE-3 checkpoint (midlayer.*, features of three target layers); exactspec "
                         "loads EAGLE-1 heads")
    if "fc.weight" not in state:
        raise UsageError("not an EAGLE checkpoint: no fc.weight")
    if any(name.endswith("_proj.bias") for name in state):
        raise UsageError("EAGLE checkpoints with attention biases are not supported")
    shape = _shape(config)
    layers = 1 + max(int(name.split(".")[1]) for name in state if name.startswith("layers."))
    state = {name: t for name, t in state.items() if name != "embed_tokens.weight"}
    if "fc.bias" not in state:  # "bias": false
        state["fc.bias"] = torch.zeros(shape.hidden)
    vocab_size = target_model.get_input_embeddings().weight.shape[0]
    drafter = DrafterConfig(method="eagle", shape=shape, vocab_size=vocab_size, layers=layers,
                            target={"name": config.get("_name_or_path", "published EAGLE")})
    state["vocab.ids"] = torch.arange(drafter.vocab_size)
    return drafter, target_model, state


def medusa_config_and_state(config: dict, state: dict[str, torch.Tensor], target_model
                            ) -> tuple[DrafterConfig, object, dict[str, torch.Tensor]]:
    try:
        heads, blocks = int(config["medusa_num_heads"]), int(config.get("medusa_num_layers", 1))
    except (KeyError, TypeError, ValueError):
        raise UsageError("not a Medusa config: no medusa_num_heads") from None
    own_head = f"0.{blocks}.weight" in state
    hidden = target_model.config.hidden_size
    drafter = DrafterConfig(method="mtp", shape=LayerShape.of(target_model.config),
                            vocab_size=target_model.get_input_embeddings().weight.shape[0], heads=heads,
                            head_layers=blocks, own_lm_head=own_head,
                            target={"name": config.get("base_model_name_or_path", "published Medusa")})
    renamed = {f"heads.{name}": t for name, t in state.items()}
    width = renamed.get("heads.0.0.linear.weight")
    if width is None or width.shape != (hidden, hidden):
        raise UsageError(f"the Medusa heads do not fit the target's hidden size {hidden}")
    renamed["vocab.ids"] = torch.arange(drafter.vocab_size)
    return drafter, target_model, renamed


def _shape(config: dict) -> LayerShape:
    try:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return LayerShape(
            hidden=hidden, heads=heads, kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads), intermediate=int(config["intermediate_size"]),
            eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=float(config.get("rope_theta", 10000.0)))
    except (KeyError, TypeError, ValueError) as error:
        raise UsageError(f"the EAGLE config lacks a llama field: {error}") from None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise UsageError(f"no drafter here: {path.parent} has neither drafter.json nor a readable config.json "
                         f"({error})") from None


def _find(directory: Path, names: tuple[str, ...]) -> Path:
    for name in names:
        if (directory / name).is_file():
            return directory / name
    pickled = [name for name in PICKLED if (directory / name).is_file()]
    if pickled:
        raise UsageError(f"{directory / pickled[0]} is a pickle, which exactspec never loads: convert it to "
                         f"safetensors ({names[0]})")
    raise UsageError(f"no weights in {directory}: expected {' or '.join(names)}")
