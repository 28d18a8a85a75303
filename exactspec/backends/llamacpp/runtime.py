"""llama.cpp as the target's runtime: the GGUF weights as stored (Q4_1 for the default model), on llama.cpp's
CPU kernels, through llama-cpp-python's low-level API.

- :class:`LlamaCppContext` owns one llama.cpp context over a loaded model: one ``llama_decode`` over any number
  of (token, position, sequence) entries, the logits of the entries asked for read as one block of floats
  (a zero-copy view of llama.cpp's buffer, copied once into a tensor), and ``llama_memory_seq_rm`` to cut a
  sequence's cache back.
- :class:`LlamaCppLM` is the single-sequence :class:`~exactspec.backends.base.CausalLM` (sequence 0).
- :class:`LlamaCppPool` holds many sequences, a ``seq_id`` per slot, extended together in one ``llama_decode``:
  the server's continuous batching on llama.cpp (the :class:`~exactspec.backends.base.Pool` protocol).

Everything llama.cpp would abort the process on (a token outside the vocabulary, a position past the context,
a sequence id past ``n_seq_max``) is checked here first and raised as an error.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from exactspec.backends.base import FeatureSource, Pool, Pooled, PoolFull, Row, Slot
from exactspec.cores import thread_count
from exactspec.errors import UsageError
from exactspec.logs import notice, route_llama_cpp_logs

DEFAULT_CONTEXT = 8192  # positions of the single-sequence cache, when the model was trained for more
BATCH_TOKENS = 512  # entries in one llama_decode; a longer pass (a prefill) is cut into pieces of this size
GGUF_MAGIC = b"GGUF"


def llama_cpp():
    """The llama-cpp-python module, with llama.cpp's log lines sent to Python logging (:mod:`exactspec.logs`)."""
    try:
        import llama_cpp as module
    except ImportError:
        raise UsageError("--backend llama.cpp needs llama-cpp-python (pip install llama-cpp-python==0.3.16)") from None
    route_llama_cpp_logs(module)
    return module


def check_gguf_file(path: Path) -> None:
    """Refuse, in one line, what is not a GGUF file before llama.cpp reads it."""
    if not path.is_file():
        raise UsageError(f"model file not found: {path}")
    with path.open("rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise UsageError(f"not a GGUF file: {path}")


class GGUFModel:
    """A GGUF file's weights loaded by llama.cpp, shared by every context over them.

    Read whole, not memory-mapped: on CPUs with AVX2 or AVX-512, llama.cpp repacks K-quant weights into its own
    interleaved layout in memory of its own, and the mapped file's pages it read them from stay resident beside that
    copy. Mapped, the 1.5B's 1.12 GB GGUF held 1.97 GB resident once loaded; read, 1.35 GB (a first start measures
    llama.cpp for --backend auto, so that was a first start's peak)."""

    def __init__(self, path: str | os.PathLike, vocab_only: bool = False) -> None:
        """``vocab_only``: its vocabulary and metadata only (a tokenizer), no weights."""
        lib = llama_cpp()
        self.path = Path(path)
        check_gguf_file(self.path)
        lib.llama_backend_init()
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        params.vocab_only = vocab_only
        params.use_mmap = False
        self.pointer = lib.llama_model_load_from_file(str(self.path).encode(), params)
        if not self.pointer:
            raise UsageError(f"llama.cpp cannot load {self.path} (truncated, or an architecture it lacks); "
                             "try --backend lean")
        self.vocab = lib.llama_model_get_vocab(self.pointer)
        self.vocab_size = lib.llama_vocab_n_tokens(self.vocab)
        self.hidden_size = lib.llama_model_n_embd(self.pointer)
        self.trained_context = lib.llama_model_n_ctx_train(self.pointer)
        self.weight_bytes = lib.llama_model_size(self.pointer)  # the quantised tensors as stored
        self._lib = lib
        description = ctypes.create_string_buffer(256)
        lib.llama_model_desc(self.pointer, description, len(description))
        self.weight_type = description.value.decode(errors="replace").split(" ")[-1]  # "llama ?B Q4_1" -> Q4_1

    def metadata(self, key: str) -> str | None:
        """A GGUF metadata value as text, or None."""
        buffer = ctypes.create_string_buffer(1 << 16)
        n = self._lib.llama_model_meta_val_str(self.pointer, key.encode(), buffer, len(buffer))
        return buffer.value.decode("utf-8", errors="replace") if n >= 0 else None

    def __del__(self) -> None:
        free = getattr(getattr(self, "_lib", None), "llama_model_free", None)
        if getattr(self, "pointer", None) and callable(free):  # at interpreter exit the library may be gone
            free(self.pointer)
            self.pointer = None


@dataclass(frozen=True)
class Entry:
    """One position of a pass: the token, its position in its sequence, the sequence, and whether its logits
    are wanted."""

    token: int
    position: int
    sequence: int
    logits: bool


class LlamaCppContext:
    """One llama.cpp context over a model: ``n_sequences`` caches of ``positions_per_sequence`` positions each."""

    def __init__(self, model: GGUFModel, positions_per_sequence: int, n_sequences: int = 1,
                 threads: int | None = None) -> None:
        lib = self._lib = llama_cpp()
        self.model = model
        self.n_sequences = n_sequences
        self.positions = positions_per_sequence
        self.threads = thread_count(threads)  # checked and capped before it reaches C
        self.keeps_states = False
        params = lib.llama_context_default_params()
        params.n_ctx = positions_per_sequence * n_sequences  # split evenly among sequences (kv_unified off)
        params.n_batch = params.n_ubatch = BATCH_TOKENS
        params.n_seq_max = n_sequences
        params.n_threads = params.n_threads_batch = self.threads
        params.kv_unified = False
        # flash attention: each row's attention is then computed alone, the same in a pass of any size as in a
        # one-row pass (without it, rows after the first part from their one-row logits by up to 0.5 on the default
        # model); with the quantised weights' kernels, a row's logits do not depend on the pass (docs/exactness.md)
        params.flash_attn = True
        params.no_perf = True
        self.pointer = lib.llama_init_from_model(model.pointer, params)
        if not self.pointer:
            raise UsageError(f"llama.cpp cannot make a context of {params.n_ctx} positions for {model.path}")
        self.memory = lib.llama_get_memory(self.pointer)
        self._batch = lib.llama_batch_init(BATCH_TOKENS, 0, 1)
        self._tokens = np.ctypeslib.as_array(self._batch.token, shape=(BATCH_TOKENS,))
        self._positions = np.ctypeslib.as_array(self._batch.pos, shape=(BATCH_TOKENS,))
        self._n_seq_id = np.ctypeslib.as_array(self._batch.n_seq_id, shape=(BATCH_TOKENS,))
        self._wants_logits = np.ctypeslib.as_array(self._batch.logits, shape=(BATCH_TOKENS,))
        self._seq_ids = [self._batch.seq_id[i] for i in range(BATCH_TOKENS)]

    def decode(self, entries: list[Entry]) -> torch.Tensor:  # [entries wanting logits, vocab]
        """Run the entries through the model (in pieces of BATCH_TOKENS); the logits of those that want them, in
        the entries' order."""
        return self._decode(entries)[0]

    def decode_with_states(self, entries: list[Entry]) -> tuple[torch.Tensor, torch.Tensor]:  # [n, vocab], [n, hidden]
        """Run the entries, all wanting logits, through the model: their logits and their final hidden states,
        normed as the LM head reads them (llama.cpp's embeddings: :meth:`keep_states` first)."""
        if not self.keeps_states or not all(entry.logits for entry in entries):
            raise ValueError("hidden states need keep_states() and every entry an output")
        return self._decode(entries)

    def keep_states(self) -> None:
        """From now on give each output row's final hidden state too. llama.cpp then makes every row an output."""
        self._lib.llama_set_embeddings(self.pointer, True)
        self.keeps_states = True

    def _decode(self, entries: list[Entry]) -> tuple[torch.Tensor, torch.Tensor | None]:
        pieces = [self._decode_piece(entries[i : i + BATCH_TOKENS]) for i in range(0, len(entries), BATCH_TOKENS)]
        if len(pieces) == 1:  # a decode step: the piece's own tensors, no second copy
            return pieces[0]
        if not pieces:
            return torch.empty(0, self.model.vocab_size), torch.empty(0, self.model.hidden_size) if self.keeps_states \
                else None
        logits = torch.cat([piece[0] for piece in pieces])
        return logits, torch.cat([piece[1] for piece in pieces]) if self.keeps_states else None

    def remove(self, sequence: int, start: int) -> None:
        """Forget the sequence's cached positions from ``start`` on."""
        self._lib.llama_memory_seq_rm(self.memory, sequence, start, -1)

    def _check(self, n: int, sequences: list[int]) -> None:
        """Refuse what llama.cpp would abort the process on, read off the filled batch (one vectorised pass)."""
        for name, values, limit, what in (("token id", self._tokens[:n], self.model.vocab_size, "the vocabulary of"),
                                          ("position", self._positions[:n], self.positions, "the context of"),
                                          ("sequence", np.asarray(sequences), self.n_sequences, "the sequences,")):
            if values.min() < 0 or values.max() >= limit:
                bad = values[(values < 0) | (values >= limit)][0]
                raise ValueError(f"{name} {bad} is outside {what} {limit}")

    def _decode_piece(self, entries: list[Entry]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One llama_decode: the outputs' logits [outputs, vocab], and their hidden states where kept."""
        n = len(entries)
        self._tokens[:n] = [e.token for e in entries]
        self._positions[:n] = [e.position for e in entries]
        self._n_seq_id[:n] = 1
        wants = [e.logits for e in entries]
        self._wants_logits[:n] = wants
        sequences = [e.sequence for e in entries]
        self._check(n, sequences)
        for i, sequence in enumerate(sequences):
            self._seq_ids[i][0] = sequence
        self._batch.n_tokens = n
        status = self._lib.llama_decode(self.pointer, self._batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed (status {status})")
        outputs = sum(wants)
        if not outputs:
            return torch.empty(0, self.model.vocab_size), None
        logits = self._outputs(self._lib.llama_get_logits(self.pointer), outputs, self.model.vocab_size)
        states = self._outputs(self._lib.llama_get_embeddings(self.pointer), outputs, self.model.hidden_size
                               ) if self.keeps_states else None
        return logits, states

    @staticmethod
    def _outputs(buffer, rows: int, width: int) -> torch.Tensor:  # [rows, width]
        """llama.cpp's rows x width floats of the outputs, in the entries' order, copied once (the buffer is
        overwritten by the next decode)."""
        return torch.from_numpy(np.ctypeslib.as_array(buffer, shape=(rows, width))).clone()

    def __del__(self) -> None:
        if getattr(self, "pointer", None):
            self._lib.llama_batch_free(self._batch)
            self._lib.llama_free(self.pointer)
            self.pointer = None


class LlamaCppLM(FeatureSource, Pooled):
    """The CausalLM protocol on llama.cpp: one sequence's cache, extended and rolled back."""

    name = "llama.cpp"
    device = torch.device("cpu")
    pass_invariant = False  # its BLAS and kernels decide, per weight type and build: the load probe measures

    @property
    def precision_label(self) -> str:
        return f"{self.model.weight_type} (GGUF, as stored)"

    @property
    def runtime_label(self) -> str:
        return f"llama.cpp ({self.model.weight_type} weights, this build)"

    def remedy(self, path) -> str:
        return ("`--backend fused` runs a llama or qwen2 GGUF from the file exactly, each row computed alone; or "
                f"`exactspec quantize {path}` writes a Q8_0 copy once, and says whether its rows are the same in any "
                "pass")

    def __init__(self, model: GGUFModel, max_length: int | None = None, threads: int | None = None) -> None:
        self.model = model
        self.max_length = max_length or min(model.trained_context or DEFAULT_CONTEXT, DEFAULT_CONTEXT)
        if max_length is None and model.trained_context > self.max_length:
            notice(f"{model.path.name} was trained on {model.trained_context} positions; prompt and answer together "
                   f"get {self.max_length} here")
        self.context = LlamaCppContext(model, self.max_length, 1, threads)
        self.threads = self.context.threads
        self.vocab_size = model.vocab_size
        self.weight_bytes = model.weight_bytes
        self.tokens: list[int] = []
        self._hidden: torch.Tensor | None = None  # [max_length, hidden] once keep_hidden_states() was called

    def pool(self, max_slots: int, max_length: int) -> LlamaCppPool:
        return LlamaCppPool(self.model, max_slots, max_length, self.context.threads)

    @classmethod
    def load(cls, path: str | os.PathLike, max_length: int | None = None, threads: int | None = None
             ) -> LlamaCppLM:
        return cls(GGUFModel(path), max_length, threads)

    def keep_hidden_states(self) -> None:
        """From now on keep every cached position's final hidden state (what eagle and mtp read). llama.cpp gives
        them as its embeddings, only for rows that are outputs: every position of every pass then computes its
        logits too, a cost the lean runtime does not pay. The cache is emptied once, if it held positions
        without their states."""
        if self._hidden is None:
            self.rollback(0)
            self.context.keep_states()
            self._hidden = torch.empty(self.max_length, self.model.hidden_size)

    def extend(self, token_ids: list[int], num_logits: int) -> torch.Tensor:  # [num_logits, vocab]
        start, n = len(self.tokens), len(token_ids)
        if start + n > self.max_length:
            raise ValueError(f"{start + n} positions exceed the context of {self.max_length}")
        keeps_states = self._hidden is not None
        entries = [Entry(token, start + i, 0, keeps_states or i >= n - num_logits) for i, token in enumerate(token_ids)]
        try:
            if keeps_states:
                logits, states = self.context.decode_with_states(entries)
                self._hidden[start : start + n] = states
                logits = logits[n - num_logits :] if num_logits else logits[:0]
            else:
                logits = self.context.decode(entries)
        except Exception:
            self.context.remove(0, start)  # pieces decoded before the failure leave no cells behind
            raise
        self.tokens += token_ids
        return logits

    def rollback(self, length: int) -> None:
        if length < len(self.tokens):
            self.context.remove(0, length)
            del self.tokens[length:]

    def reserve(self, length: int) -> None:
        pass  # the context's cache is allocated whole when it is made


class LlamaCppPool(Pool):
    """KV caches for up to ``max_slots`` sequences (a llama.cpp ``seq_id`` each) of up to ``max_length`` tokens,
    all extended in one ``llama_decode``. A slot's index is its sequence id; rollback is the slot's length (the
    positions past it are removed from llama.cpp's cache before the slot's next pass)."""

    device = torch.device("cpu")

    def __init__(self, model: GGUFModel, max_slots: int, max_length: int, threads: int | None = None) -> None:
        if max_slots < 1:
            raise ValueError(f"need at least one slot, got {max_slots}")
        self.model = model
        self.vocab_size = model.vocab_size
        self.max_slots = max_slots
        self.max_length = min(max_length, model.trained_context or max_length)
        self.context = LlamaCppContext(model, self.max_length, max_slots, threads)
        self.slots: list[Slot] = []  # open slots
        self._free = list(range(max_slots - 1, -1, -1))  # sequence ids not in use; the lowest is taken first
        self._cached: dict[int, int] = {}  # sequence id -> positions llama.cpp holds for it

    def open(self) -> Slot:
        if not self._free:
            raise PoolFull(f"all {self.max_slots} slots are taken")
        slot = Slot(index=self._free.pop())
        self.slots.append(slot)
        self._cached[slot.index] = 0
        return slot

    def close(self, slot: Slot) -> None:
        """Free the slot and forget its sequence's cache."""
        self.slots.remove(slot)
        self.context.remove(slot.index, 0)
        del self._cached[slot.index]
        self._free.append(slot.index)
        self._free.sort(reverse=True)
        slot.index = -1

    def forward(self, rows: list[Row]) -> list[torch.Tensor]:  # per row [num_logits, vocab]
        """Append every row's tokens to its slot in one pass; each row's logits at its last ``num_logits``."""
        entries: list[Entry] = []
        for row in rows:
            n, start = len(row.token_ids), row.slot.length
            if n == 0:
                raise ValueError("a row without tokens")
            if start + n > self.max_length:
                raise ValueError(f"a row would pass the pool's {self.max_length} positions")
            entries += [Entry(token, start + i, row.slot.index, i >= n - row.num_logits)
                        for i, token in enumerate(row.token_ids)]
        for row in rows:  # positions past a slot's length were rejected draft tokens
            if self._cached[row.slot.index] > row.slot.length:
                self.context.remove(row.slot.index, row.slot.length)
        try:
            logits = self.context.decode(entries)
        except Exception:
            for row in rows:  # pieces decoded before the failure leave no cells behind
                self.context.remove(row.slot.index, row.slot.length)
                self._cached[row.slot.index] = row.slot.length
            raise
        for row in rows:
            row.slot.length += len(row.token_ids)
            self._cached[row.slot.index] = row.slot.length
        return list(logits.split([row.num_logits for row in rows]))
