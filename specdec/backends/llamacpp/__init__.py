"""llama.cpp's wing: a GGUF file's weights as stored, on llama.cpp's CPU kernels (``runtime.py``), its tokenizer
read from the file (``tokenizer.py``), and ``specdec quantize`` (``quantize.py``)."""

from specdec.backends.llamacpp.runtime import GGUFModel, LlamaCppLM, LlamaCppPool, check_gguf_file, llama_cpp

__all__ = ["GGUFModel", "LlamaCppLM", "LlamaCppPool", "check_gguf_file", "llama_cpp"]
