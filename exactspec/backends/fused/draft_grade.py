"""Draft-grade copies of a draft model for the fused runtime: what a draft needs is good guesses, not its model's bits.

The target verifies every draft token against its own distribution, so a draft model's weights may be anything: only
acceptance and drafting cost move. A draft-grade copy of a draft model's GGUF (:class:`DraftGrade` says what it
keeps) is made once, kept beside the packed copies in exactspec's cache (``packed_file.py``: the same layout, a
checksum per matrix, a version, killed writes' partial files removed), and memory-mapped on later starts:

- a **draft vocabulary**: the LM head cut to the N tokens the draft's tokenizer writes most often (counted on a corpus
  that ships with exactspec: ``draft_vocabulary.py``), each other token's logit -inf (q = 0, which every exact rule
  takes in its stride). On Qwen2.5's 151,936-token head that is most of a small model's bytes;
- **fewer bits**: 4 bits, each matrix stored in more (Q5_0, Q6_K, Q8_0, floats) re-quantised with a float16 scale
  and offset per 32 inputs (the kernels' ``int4``: what Q4_1 is), the head's kept rows too, and those already in 4
  bits (Q4_0, Q4_1, Q4_K) kept as stored; or 3 bits, every matrix re-quantised with an integer scale and min per 32
  inputs under each row's floats (the kernels' ``int3_r``, 0.44 bytes a weight against int4's 0.625);
- the embedding of each draft-vocabulary token (float32, as the runtime embeds it), so that a whole chain of draft
  tokens runs in one C call, each drafted token embedded there.

The user's GGUF is never changed.
"""

from __future__ import annotations

import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from exactspec.backends.family import spec_of_gguf
from exactspec.backends.fused import packed_file
from exactspec.backends.fused.runtime import (
    ChainVocabulary,
    FusedRuntime,
    FusedUnavailable,
    gguf_unavailable,
    weights_of,
)
from exactspec.backends.fused.stored import (
    NARROW,
    StoredMatrix,
    matrix_rows,
    packed_chunks,
    packed_grid,
    packed_q8,
    packed_rows,
)
from exactspec.backends.gguf_file import GGUFFile, Tensor, dequantized
from exactspec.backends.runtime_kind import DraftGrade

KEPT_AS_STORED = ("int4", "int4_k")  # formats of 4 to 4.5 bits a weight: already draft-grade
GROUP = 32  # inputs per scale and offset of the re-quantised matrices
RANGE_SHARES = (1.0, 0.9)  # the starting ranges of a group's levels tried: its whole span, the middle nine tenths
REFITS = 2  # least-squares refits of each range to its levels


@dataclass
class DraftCopy:
    """A draft-grade copy as read: the fused matrices (each layer's four, then the cut head), the draft vocabulary
    (token ids of the head's rows, ascending int32 [N]) and their embeddings (float32 [N, hidden])."""

    matrices: list[StoredMatrix]
    vocabulary: np.ndarray
    embeddings: torch.Tensor
    coverage: float  # the share of the corpus's held-out tokens the vocabulary covers (1.0: the whole vocabulary)


def copy_path(source: Path, grade: DraftGrade) -> Path:
    """Where ``source``'s draft-grade copy is kept: beside the packed copies, keyed by the source file's identity
    and the recipe."""
    packed = packed_file.packed_path(source)
    return packed.with_name(f"{source.stem}-draft-{zlib.crc32(f'{packed.name}|{grade.key()}'.encode()):08x}.sdpack")


def draft_copy(source: GGUFFile, spec, grade: DraftGrade, vocabulary: Callable[[], tuple[np.ndarray, float]]
               ) -> DraftCopy:
    """The draft-grade copy of ``source`` (whose ``spec`` is ``family.spec_of_gguf``'s): read from exactspec's cache,
    else made and kept there (one line while it is made). ``vocabulary()`` chooses the draft vocabulary (ids
    ascending, coverage), asked only when the copy is made."""
    path = copy_path(source.path, grade)
    kept = packed_file.read(path)
    if kept is not None and _complete(kept, spec):
        return _copy_of(kept)
    if kept is not None:
        print(f"exactspec: the draft-grade copy {path.name} is incomplete; making it again", file=sys.stderr)
    started = time.perf_counter()
    print(f"exactspec: making a draft-grade copy of {source.path.name} ({grade.label}), once", file=sys.stderr)
    ids, coverage = vocabulary() if grade.vocabulary else (np.arange(spec.embed.shape[0], dtype=np.int32), 1.0)
    ids = np.unique(np.asarray(ids, dtype=np.int32))
    embeddings = _embeddings(spec, ids)
    matrices = _matrices(source, spec, grade, ids)
    packed_file.write(path, source.path, matrices, arrays={"vocabulary": torch.from_numpy(ids),
                                                            "embeddings": embeddings},
                      notes={"grade": grade.key(), "coverage": coverage})
    print(f"exactspec: draft-grade copy made in {time.perf_counter() - started:.1f} s (kept in {path.parent})",
          file=sys.stderr)
    kept = packed_file.read(path)
    if kept is None:  # the cache could not be written: the copy as made, held in memory
        return DraftCopy(list(_matrices(source, spec, grade, ids)), ids, embeddings, coverage)
    return _copy_of(kept)


def _complete(kept: packed_file.Packed, spec) -> bool:
    return (len(kept.matrices) == 4 * spec.layers + 1 and {"vocabulary", "embeddings"} <= set(kept.arrays)
            and kept.matrices[-1].rows == kept.arrays["vocabulary"].shape[0])


def _copy_of(kept: packed_file.Packed) -> DraftCopy:
    return DraftCopy(kept.matrices, kept.arrays["vocabulary"].numpy(), kept.arrays["embeddings"],
                     float(kept.notes.get("coverage", 1.0)))


def _embeddings(spec, ids: np.ndarray) -> torch.Tensor:  # [N, hidden] float32
    """The vocabulary's embeddings as the runtime embeds them (``LlamaSequence.embedded``: scaled where the model
    scales them), so that a chain drafted in C feeds each token what a pass in Python would."""
    rows = spec.embed[torch.from_numpy(ids.astype(np.int64))].float()
    scale = spec.architecture.embed_scale
    return (rows if scale == 1.0 else rows * torch.tensor(scale, dtype=rows.dtype)).contiguous()


def _matrices(source: GGUFFile, spec, grade: DraftGrade, ids: np.ndarray) -> list[StoredMatrix]:
    """Each fused matrix of the copy: a layer's four (attention's two, then the feed-forward's two, in
    ``grade.feed_forward`` bits), then the head's rows of the vocabulary."""
    matrices = []
    rows = list(matrix_rows(source, spec.layers, spec.heads, spec.kv_heads))
    for index, (_, tensors, orders) in enumerate(rows):
        bits = grade.feed_forward if tensors[0].name.split(".")[-2].startswith("ffn_") else grade.bits
        if index == len(rows) - 1:  # the LM head: its rows of the vocabulary
            orders = [orders[0][ids]]
        matrices.append(_draft_matrix(tensors, orders, bits))
        source.release()
    return matrices


def _draft_matrix(tensors: list[Tensor], orders: list[np.ndarray], bits: int | None) -> StoredMatrix:
    """The tensors' rows in ``orders``: as stored where ``bits`` is None or all are kept as stored; else a part per
    tensor, each kept as stored or re-quantised to ``bits`` (all re-quantised where a part would end inside a block
    of 8 rows). Only 4 bits keeps a stored format (KEPT_AS_STORED): 3 bits re-quantises all."""
    kept = [bits is None or (bits == 4 and NARROW.get(t.type_name) in KEPT_AS_STORED) for t in tensors]
    if all(kept):
        return packed_grid(tensors, orders, narrow=True)
    if any(kept) and all(len(order) % 8 == 0 for order in orders[:-1]):
        parts = [packed_grid([t], [o], narrow=True) if keep else _requantized([t], [o], bits)
                 for t, o, keep in zip(tensors, orders, kept)]
        for part, following in zip(parts, parts[1:]):
            part.rest = following
        return parts[0]
    return _requantized(tensors, orders, bits)


def _requantized(tensors: list[Tensor], orders: list[np.ndarray], bits: int) -> StoredMatrix:
    """The tensors' rows in ``orders`` re-quantised to ``bits`` (4: int4; 3: int3_r) a weight, a chunk of rows at a
    time."""
    if bits == 3:
        return packed_chunks(tensors, orders, "int3_r", lambda chunk, _: three_bits(dequantized(chunk)))
    return packed_chunks(tensors, orders, "int4", lambda chunk, _: four_bits(dequantized(chunk)))


def three_bits(values: np.ndarray) -> torch.Tensor:  # [out, in] float32 -> packed uint8
    """Weights [out, in] as :func:`three_bits_values` puts them on 8 levels, packed as the kernels' int3_r tiles read
    them."""
    return packed_rows(*(torch.from_numpy(part) for part in three_bits_values(values)))


def four_bits(values: np.ndarray) -> torch.Tensor:  # [out, in] float32 -> packed uint8
    """Weights [out, in] on 16 levels per 32 inputs, w = d q + m (q in 0..15; d and m float16), packed as the kernels'
    int4 tiles read them. Each group's d and m: :func:`_fitted` on 16 levels, rounded to float16 (12% less error than
    the range alone on Qwen2.5-0.5B's Q5_0 matrices)."""
    out, inputs = values.shape
    groups = values.reshape(out, inputs // GROUP, GROUP).astype(np.float32)
    q, scale, offset = _fitted(groups, 15, lambda scale, offset: (_half(scale), _half(offset)))
    return packed_q8(torch.from_numpy(q.reshape(out, inputs)), torch.from_numpy(scale), torch.from_numpy(offset),
                     bits=4)


def three_bits_values(values: np.ndarray) -> tuple[np.ndarray, ...]:
    """Weights [out, in] on 8 levels per 32 inputs under integer scales: w = (d sc) q - (dmin mn), q in 0..7, sc and
    mn in 0..255 per 32 inputs, d and dmin float32 per row. Each group's scale and offset as :func:`_fitted` finds
    them (its offset at most 0: mn is a min), then rounded to its row's integer steps and its levels chosen again.
    Returns q [out, in] (uint8), sc and mn [out, in / 32] (uint8), d and dmin [out] (float32)."""
    out, inputs = values.shape
    groups = values.reshape(out, inputs // GROUP, GROUP).astype(np.float32)
    _, scale, offset = _fitted(groups, 7, lambda scale, offset: (scale, np.minimum(offset, 0)))
    mins = -offset
    d, dmin = scale.max(-1) / 255, mins.max(-1) / 255
    sc = np.rint(scale / np.where(d > 0, d, 1)[:, None]).clip(0, 255)
    mn = np.rint(mins / np.where(dmin > 0, dmin, 1)[:, None]).clip(0, 255)
    q = _levels(groups, (d[:, None] * sc).astype(np.float32), (-(dmin[:, None] * mn)).astype(np.float32), 7)
    return q.reshape(out, inputs), sc.astype(np.uint8), mn.astype(np.uint8), d.astype(np.float32), \
        dmin.astype(np.float32)


def _fitted(groups: np.ndarray, levels: int, rounded: Callable) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each group's levels q (0..levels), scale d and offset m, w = d q + m: of two starting ranges (its least to its
    greatest, and the middle nine tenths of that), each refitted to its levels by least squares (REFITS times) and
    made storable (``rounded(d, m)``), the one with the smaller squared error."""
    low, high = groups.min(-1), groups.max(-1)
    best_q = best_scale = best_offset = best_error = None
    for share in RANGE_SHARES:
        scale, offset = (high - low) * share / levels, low + (high - low) * (1 - share) / 2
        for _ in range(REFITS):
            scale, offset = _refitted(groups, _levels(groups, scale, offset, levels), scale, offset)
        scale, offset = rounded(scale, offset)
        q = _levels(groups, scale, offset, levels)
        error = np.square(q * scale[..., None] + offset[..., None] - groups).sum(-1)
        if best_error is None:
            best_q, best_scale, best_offset, best_error = q, scale, offset, error
        else:
            better = error < best_error
            best_q = np.where(better[..., None], q, best_q)
            best_scale, best_offset = np.where(better, scale, best_scale), np.where(better, offset, best_offset)
            best_error = np.minimum(error, best_error)
    return best_q, best_scale, best_offset


def _half(values: np.ndarray) -> np.ndarray:
    """Values as float16 keeps them (the tiles' scales and offsets), in float32."""
    return values.astype(np.float16).astype(np.float32)


def _levels(groups: np.ndarray, scale: np.ndarray, offset: np.ndarray, levels: int) -> np.ndarray:
    """Each weight's nearest level of its group's d q + m, q in 0..levels (0 where d is 0)."""
    safe = np.where(scale > 0, scale, 1.0)[..., None]
    q = np.clip(np.rint((groups - offset[..., None]) / safe), 0, levels)
    return np.where((scale > 0)[..., None], q, 0).astype(np.uint8)


def _refitted(groups: np.ndarray, q: np.ndarray, scale: np.ndarray, offset: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
    """The d and m that fit each group's weights best (least squares) on its levels q; as they were where the levels
    are all one."""
    q = q.astype(np.float32)
    n, sum_q, sum_qq = GROUP, q.sum(-1), np.square(q).sum(-1)
    sum_w, sum_qw = groups.sum(-1), (q * groups).sum(-1)
    det = n * sum_qq - sum_q * sum_q
    fits = det > 0
    fitted = np.where(fits, (n * sum_qw - sum_q * sum_w) / np.where(fits, det, 1), scale)
    return fitted, np.where(fits, (sum_w - fitted * sum_q) / n, offset)


class DraftGradeRuntime(FusedRuntime):
    """The fused runtime over a draft-grade copy (:func:`draft_copy`): every pass as the fused runtime's, its logits
    over the draft vocabulary and -inf elsewhere (q = 0 there)."""

    @classmethod
    def of_file(cls, source: GGUFFile, grade: DraftGrade, vocabulary: Callable[[], tuple[np.ndarray, float]]
                ) -> DraftGradeRuntime:
        """The draft-grade runtime of a GGUF file the fused runtime reads alone (:func:`gguf_unavailable` first);
        ``vocabulary()`` chooses the draft vocabulary where the copy is made."""
        reason = gguf_unavailable(source)
        if reason is not None:
            raise FusedUnavailable(f"the fused runtime cannot read {source.path.name} directly: {reason}")
        spec = spec_of_gguf(source)
        copy = draft_copy(source, spec, grade, vocabulary)
        runtime = cls.__new__(cls)
        runtime._start(weights_of(source, spec, copy.matrices), "stored", "integer")
        runtime.grade, runtime.coverage = grade, copy.coverage
        runtime.draft_vocabulary = copy.vocabulary  # [N] ascending: the token of each head row
        runtime.chain_vocabulary = ChainVocabulary(torch.from_numpy(copy.vocabulary), copy.embeddings)  # chain.c's
        runtime._head_ids = torch.from_numpy(copy.vocabulary.astype(np.int64))
        return runtime

    @property
    def precision_label(self) -> str:
        return (f"draft-grade: {self.grade.label}, {len(self.draft_vocabulary)} of {self.vocab_size} tokens, "
                f"{super().precision_label}")

    def logits(self, head, normed: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        rows = super().logits(head, normed)  # [n, N]: the draft vocabulary's
        full = rows.new_full((rows.shape[0], self.vocab_size), float("-inf"))
        full[:, self._head_ids] = rows
        return full
