"""Finding a trained drafter for a target: the directory given, or the one shipped for it in the package."""

from __future__ import annotations

import json
from pathlib import Path

from exactspec.choices import TRAINED_METHODS
from exactspec.errors import UsageError

SHIPPED = Path(__file__).resolve().parent / "shipped"  # shipped/<target>/<method>/drafter.{json,safetensors}


def shipped_directory(method: str, target_model) -> Path | None:
    """The drafter of ``method`` shipped for this target, if any."""
    from exactspec.models import same_weights, weight_probe

    probe = weight_probe(target_model)
    for config in sorted(SHIPPED.glob(f"*/{method}/drafter.json")):
        try:
            if same_weights(json.loads(config.read_text()).get("target", {}).get("probe", []), probe):
                return config.parent
        except (OSError, ValueError, AttributeError, TypeError):
            continue
    return None


def load_trained(method: str, target_model, path: str | Path | None = None):
    """The trained ``method`` network for ``target_model``: from ``path``, else the shipped one for that target."""
    from exactspec.drafters import checkpoint

    directory = Path(path) if path is not None else shipped_directory(method, target_model)
    if directory is None:
        raise UsageError(f"no trained {method} drafter ships for this target: train one (exactspec train --method "
                         f"{method} --target MODEL --out DIR) and pass --drafter-path DIR")
    return checkpoint.load(directory, method, target_model)


def parse_drafter_paths(entries: list[str] | None) -> dict[str, str]:
    """``--drafter-path`` values, each DIR (its drafter.json names the method) or METHOD=DIR -> {method: DIR}."""
    paths: dict[str, str] = {}
    for entry in entries or []:
        method, sep, directory = entry.partition("=")
        if sep and method in TRAINED_METHODS:
            paths[method] = directory
            continue
        config = Path(entry) / "drafter.json"
        try:
            method = json.loads(config.read_text())["method"]
        except (OSError, ValueError, KeyError, TypeError):
            raise UsageError(f"--drafter-path {entry}: no readable {config}; for a published checkpoint write "
                             "METHOD=DIR (eagle=DIR, mtp=DIR)") from None
        paths[method] = entry
    return paths
