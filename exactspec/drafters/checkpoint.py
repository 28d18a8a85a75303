"""A trained drafter's files: ``drafter.json`` (what it is, which target it was trained for, how it was made) and
``drafter.safetensors`` (its weights). Nothing is ever unpickled.

Loading checks the target: a drafter trained for one target is refused by another (``weight_probe`` in
``exactspec.models``: a few of the target's weights, kept in ``drafter.json``, that match the same target loaded in
any precision). Published EAGLE and Medusa checkpoints load too (``layouts``); they name no target, so only their
shapes are checked against it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from exactspec.drafters import layouts
from exactspec.drafters.files import read_weights
from exactspec.drafters.networks import METHODS, NETWORKS, DrafterConfig, TargetParts
from exactspec.errors import UsageError

CONFIG_FILE = "drafter.json"
WEIGHTS_FILE = "drafter.safetensors"
FORMAT = "exactspec-drafter"
SAVED_DTYPE = torch.float16  # weights are saved in half precision (the files ship in the repository)


def save(network: torch.nn.Module, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    state = {name: (t.to(SAVED_DTYPE) if t.is_floating_point() else t).contiguous()
             for name, t in network.state_dict().items()}
    save_file(state, str(directory / WEIGHTS_FILE))
    (directory / CONFIG_FILE).write_text(json.dumps({"format": FORMAT, **network.config.to_dict()}, indent=1) + "\n")


def read_config(directory: Path) -> DrafterConfig:
    path = directory / CONFIG_FILE
    try:
        data = json.loads(path.read_text())
        if data.pop("format", None) != FORMAT:
            raise ValueError(f"not a {FORMAT} file")
        config = DrafterConfig.from_dict(data)
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise UsageError(f"unreadable drafter config {path}: {error}") from None
    if config.method not in METHODS:
        raise UsageError(f"{path}: unknown drafter method {config.method!r}")
    return config


def load(directory: str | Path, method: str, target_model) -> torch.nn.Module:
    """The drafter network saved in ``directory`` (exactspec's files or a published layout), attached to the target.

    Refuses a drafter of another method, or one trained for another target."""
    from exactspec.models import same_weights, weight_probe

    directory = Path(directory)
    if not directory.is_dir():
        raise UsageError(f"drafter directory not found: {directory}")
    if not (directory / CONFIG_FILE).is_file():
        return build(*layouts.read_published(directory, method, target_model))
    config = read_config(directory)
    if config.method != method:
        raise UsageError(f"{directory} holds a {config.method} drafter, not {method}")
    if not same_weights(config.target.get("probe", []), weight_probe(target_model)):
        raise UsageError(f"the drafter in {directory} was trained for another target "
                         f"({config.target.get('name', '?')}); train one for this target with exactspec train")
    return build(config, target_model, read_weights(directory / WEIGHTS_FILE))


def build(config: DrafterConfig, target_model, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A network of ``config`` with weights ``state``, over the target's embedding and LM head."""
    check_shape(config, target_model)
    ids = state.get("vocab.ids")
    network = NETWORKS[config.method](config, TargetParts.of(target_model), ids)
    try:
        network.load_state_dict({name: t.float() if t.is_floating_point() else t for name, t in state.items()})
    except RuntimeError as error:
        raise UsageError(f"the drafter's weights do not fit its config: {str(error).splitlines()[0]}") from None
    return network.eval()


def check_shape(config: DrafterConfig, target_model) -> None:
    target = target_model.config
    if config.shape.hidden != target.hidden_size or config.vocab_size != target_model.get_input_embeddings(
    ).weight.shape[0]:
        raise UsageError(f"the drafter (hidden size {config.shape.hidden}, vocabulary {config.vocab_size}) does not "
                         f"fit the target (hidden size {target.hidden_size}, vocabulary {target.vocab_size})")
