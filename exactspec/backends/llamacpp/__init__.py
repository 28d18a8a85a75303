"""llama.cpp's wing: a GGUF file's weights as stored, on llama.cpp's CPU kernels (``runtime.py``), its tokenizer
read from the file (``tokenizer.py``), and ``exactspec quantize`` (``quantize.py``); and what it is to the loading
layer (``KIND``): ``--backend llama.cpp``, a .gguf file and nothing else, its weights as stored, on the CPU."""

from __future__ import annotations

from pathlib import Path

from exactspec.backends.llamacpp.runtime import GGUFModel, LlamaCppLM, LlamaCppPool, check_gguf_file, llama_cpp
from exactspec.backends.llamacpp.tokenizer import GGUFTokenizer
from exactspec.backends.runtime_kind import RuntimeKind


def _from_file(path: Path, threads: int | None = None, max_length: int | None = None) -> LlamaCppLM:
    return LlamaCppLM.load(path, max_length=max_length, threads=threads)


def _reads(path: Path) -> bool:
    return path.suffix.lower() == ".gguf"


def _tokenizer(runtime: LlamaCppLM) -> GGUFTokenizer:
    return GGUFTokenizer(runtime.model)  # the vocabulary the runtime loaded with its weights


# a draft model beside it runs where --backend auto measures it fastest: llama.cpp too for a GGUF draft
KIND = RuntimeKind(name="llama.cpp", label="llama.cpp", runtime=LlamaCppLM, from_file=_from_file, reads=_reads,
                   tokenizer_of=_tokenizer, weights="the GGUF's weights as stored", measures_drafts=True)

__all__ = ["KIND", "GGUFModel", "GGUFTokenizer", "LlamaCppLM", "LlamaCppPool", "check_gguf_file", "llama_cpp"]
