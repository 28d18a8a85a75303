"""Reading a drafter's tensors: safetensors only, never a pickle; a damaged file is one line for the user."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from exactspec.errors import UsageError

DRAFT_VOCAB_FILE = "draft_vocab.safetensors"  # a partial draft vocabulary, kept beside a published layout


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except Exception as error:  # a damaged or missing file is the user's input, reported in one line
        raise UsageError(f"unreadable drafter weights {path}: {str(error).splitlines()[0] if str(error) else error!r}"
                         ) from None


def read_draft_vocab(directory: Path) -> torch.Tensor | None:
    """The draft vocabulary ``exactspec export`` kept beside a published layout, if any."""
    path = directory / DRAFT_VOCAB_FILE
    return read_weights(path)["ids"] if path.is_file() else None
