"""What the GGUF tests (test_gguf_formats.py, test_architectures.py) share: tiny random files written when first asked
for, llama.cpp's logits of one, and the check that speculation keeps plain decoding's output on a file."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_gguf import write_tiny_gguf


def tiny_files(folder: Path, shape_of: Callable[[str], dict]) -> Callable[[str, str], Path]:
    """The file of an architecture and a tensor type (seed 0, ``shape_of(arch)``'s sizes), written when first asked."""

    @functools.cache
    def file(arch: str, kind: str) -> Path:
        return write_tiny_gguf(folder / f"tiny-{arch}-{kind}.gguf", seed=0, tensor_type=kind, architecture=arch,
                               **shape_of(arch))

    return file


def llama_cpp_logits(path: Path, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab]
    """llama.cpp's logits at every one of ``ids`` on the file, in one pass."""
    pytest.importorskip("llama_cpp")
    from exactspec.backends.llamacpp.runtime import GGUFModel, LlamaCppLM

    runtime = LlamaCppLM(GGUFModel(path), max_length=64, threads=2)
    return torch.as_tensor(np.asarray(runtime.extend(ids, len(ids)))).float()


def check_speculation_identity(path: Path, drafters: tuple[str, ...]) -> None:
    """Greedy and seeded (the invariant sampler) output with each drafter, at k = 4 and auto, is plain decoding's on
    the fused runtime, token for token."""
    from exactspec.api import SpecDecoder

    prompt = "the quick brown fox jumps over the lazy dog " * 4
    outputs = {}
    for drafter in ("none", *drafters):
        decoder = SpecDecoder.load(str(path), drafter=drafter, backend="fused", threads=2)
        for temperature, seed in ((0.0, None), (0.8, 7)):
            for k in (4, "auto"):
                result = decoder.generate(prompt, max_new_tokens=24, num_draft_tokens=k, temperature=temperature,
                                          seed=seed, chat=False)
                outputs.setdefault((temperature, seed), set()).add(tuple(result.token_ids))
    assert all(len(found) == 1 for found in outputs.values()), outputs
