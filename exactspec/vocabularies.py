"""Text between two tokenizers: what lets a draft model with another vocabulary draft for a target.

Both published lossless methods (Timor et al., ICML 2025, "Accelerating LLM inference with lossless speculative
decoding algorithms for heterogeneous vocabularies") stand on the same footing here: the target's context is text
(bytes), and the draft model reads that text in its own tokens.

- :class:`TokenText` is one tokenizer seen as bytes: each token's bytes, and the tokens of any bytes (valid UTF-8
  through the tokenizer; other bytes through its byte tokens, where it has them: byte fallback, or a byte-level
  BPE's 256 byte symbols).
- :class:`ContextBridge` keeps a draft model's context in step with the target's: the prompt is translated once
  (its chat framing swapped for the draft's own template), and what follows is aligned by bytes, so that the draft
  tokens whose bytes the target accepted stay cached and only the rest is re-encoded.
- :class:`SharedTokens` maps the tokens both vocabularies hold (by their bytes): token-level intersection.

No step here decides what is emitted: the target's verifier keeps a draft token only where it is the target's own
choice (or passes the standard rule with the draft's q), so every mapping is exact; the bytes only decide how much
is accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# the share of the target's frequent tokens (its first FREQUENT_TOKENS ordinary ids: BPE merges and SentencePiece
# scores rank tokens roughly by frequency) that the draft's vocabulary must hold as bytes for a pair to draft well
FREQUENT_TOKENS = 8192
LOW_OVERLAP = 0.5
SENTINEL = "\x01exactspec\x01"  # the user's message while a chat template's framing is read


class TokenText:
    """A tokenizer (llama.cpp's GGUF one or transformers') as bytes: ``pieces[id]``, the bytes each token stands for
    (control tokens' text as written, e.g. ``<|im_end|>``), and ``encode``, the tokens of any bytes."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits' width (may exceed the tokenizer's vocabulary)
        self.pieces, self.control = _pieces_and_controls(tokenizer, vocab_size)
        self.id_of: dict[bytes, int] = {}  # an ordinary token's bytes -> its (first) id
        for token, piece in enumerate(self.pieces):
            if piece and token not in self.control:
                self.id_of.setdefault(piece, token)
        self.byte_token = {piece[0]: self.id_of[piece] for piece in self.id_of if len(piece) == 1}
        bos = getattr(tokenizer, "bos_token_id", None)
        self.bos = None if bos is None else int(bos)
        self.adds_space_prefix = self.text_of(self._encode_text("a")) == b" a"

    def text_of(self, ids: list[int]) -> bytes:
        return b"".join(self.pieces[t] if 0 <= t < self.vocab_size else b"" for t in ids)

    def encode(self, data: bytes, final: bool = True) -> tuple[list[int], int]:
        """The tokens of ``data`` and how many of its bytes they stand for: up to a byte this tokenizer cannot
        represent (no byte token for it), and, unless ``final``, short of a UTF-8 character cut at the end (the
        bytes that complete it are still to come). Control tokens written in the text are parsed as such."""
        end = len(data) if final else _complete_utf8(data)
        ids: list[int] = []
        consumed = 0
        for run in _runs(data[:end]):
            if isinstance(run, str):
                run_ids = self._encode_continuation(run)
                if self.text_of(run_ids) != run.encode("utf-8"):
                    return ids, consumed  # the tokenizer lost something (an unknown token): stop before it
                ids += run_ids
                consumed += len(run.encode("utf-8"))
            else:
                token = self.byte_token.get(run)
                if token is None:
                    return ids, consumed
                ids.append(token)
                consumed += 1
        return ids, consumed

    def _encode_continuation(self, text: str) -> list[int]:
        """The tokens of ``text`` as it continues other text: a tokenizer that puts a space before the start of
        text (SentencePiece's prefix) gets none it was not given."""
        if not self.adds_space_prefix:
            return self._encode_text(text)
        if text.startswith(" "):
            return self._encode_text(text[1:])
        ids = self._encode_text(text)
        if not ids or not self.pieces[ids[0]].startswith(b" "):
            return ids
        head = self.pieces[ids[0]][1:]
        return ([] if not head else [self.id_of[head]] if head in self.id_of else self._spelled(head)) + ids[1:]

    def _spelled(self, data: bytes) -> list[int]:
        """``data`` one character (else one byte) per token: tokens for bytes no merge of the tokenizer starts."""
        ids = []
        for char in data.decode("utf-8", errors="surrogateescape"):
            piece = char.encode("utf-8", errors="surrogateescape")
            ids += [self.id_of[piece]] if piece in self.id_of else [self.byte_token.get(b, -1) for b in piece]
        return ids  # an id of -1 makes the caller's check fail: nothing unrepresentable is proposed

    def _encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, text: str) -> list[int]:
        """A whole prompt's tokens, with the BOS this tokenizer adds (once, where the text already writes it)."""
        ids = list(self.tokenizer.encode(text, add_special_tokens=True))
        if self.bos is not None and ids[:2] == [self.bos, self.bos]:
            ids = ids[1:]
        return ids


def token_name(piece: bytes) -> str:
    """A token's bytes as a name: its text where they are whole UTF-8, else ``bytes:`` and each byte as ``\\xNN``
    (how OpenAI's completions name a token that holds part of a character), so that no byte is lost to U+FFFD and
    tokens that split characters differently keep distinct names."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in piece)


def _runs(data: bytes) -> list[str | int]:
    """``data`` as runs of valid UTF-8 text and single bytes that are not UTF-8, in order."""
    runs: list[str | int] = []
    text = data.decode("utf-8", errors="surrogateescape")
    start = 0
    for i, char in enumerate(text):
        if "\udc80" <= char <= "\udcff":
            if start < i:
                runs.append(text[start:i])
            runs.append(ord(char) - 0xDC00)
            start = i + 1
    if start < len(text):
        runs.append(text[start:])
    return runs


def _complete_utf8(data: bytes) -> int:
    """The length of ``data`` without a UTF-8 character that its last bytes begin and do not finish."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # a lead byte (or ASCII): does its character fit in what follows it?
            width = 1 if byte < 0x80 else 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else \
                4 if byte >> 3 == 0b11110 else 1
            return len(data) - back if width > back else len(data)
    return len(data)


def control_ids(tokenizer, vocab_size: int) -> frozenset[int]:
    """The ids below ``vocab_size`` of control tokens: BOS, EOS, a chat template's markers (not text). llama.cpp's
    GGUF tokenizer says which are; transformers' names its special tokens."""
    if hasattr(tokenizer, "is_control"):  # llama.cpp's GGUF tokenizer
        return frozenset(t for t in range(min(vocab_size, tokenizer.vocab_size)) if tokenizer.is_control(t))
    special = {int(t) for t in tokenizer.all_special_ids}
    special |= {int(t) for t, added in getattr(tokenizer, "added_tokens_decoder", {}).items() if added.special}
    return frozenset(t for t in special if 0 <= t < vocab_size)


def _pieces_and_controls(tokenizer, vocab_size: int) -> tuple[list[bytes], frozenset[int]]:
    """Each id's bytes, and the ids of control tokens (which end a draft's text)."""
    if hasattr(tokenizer, "piece"):  # llama.cpp's GGUF tokenizer
        pieces = [tokenizer.piece(t) if t < tokenizer.vocab_size else b"" for t in range(vocab_size)]
        return pieces, control_ids(tokenizer, vocab_size)
    return _transformers_pieces(tokenizer, vocab_size)


def _transformers_pieces(tokenizer, vocab_size: int) -> tuple[list[bytes], frozenset[int]]:
    """transformers' tokens as bytes: a byte-level BPE's symbols through GPT-2's byte alphabet, SentencePiece's
    ``▁`` as a space and ``<0xNN>`` as its byte, special tokens as written."""
    special = control_ids(tokenizer, vocab_size)
    names = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
    byte_of = {char: byte for byte, char in _gpt2_byte_alphabet().items()}
    byte_level = "ByteLevel" in repr(getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", ""))
    pieces = []
    for token, name in enumerate(names):
        if name is None:
            pieces.append(b"")
        elif token in special:
            pieces.append(name.encode("utf-8"))
        elif byte_level and all(char in byte_of for char in name):
            pieces.append(bytes(byte_of[char] for char in name))
        elif len(name) == 6 and name.startswith("<0x") and name.endswith(">"):
            pieces.append(bytes([int(name[3:5], 16)]))
        else:
            pieces.append(name.replace("\u2581", " ").encode("utf-8"))
    return pieces + [b""] * (vocab_size - len(pieces)), frozenset(special)


def _gpt2_byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet: each byte's printable stand-in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}


@dataclass(frozen=True)
class ChatFraming:
    """What a chat template writes around one user message: ``before`` it (the system prompt included) and
    ``after`` it (through the generation prompt)."""

    before: str
    after: str

    @classmethod
    def of(cls, tokenizer) -> ChatFraming | None:
        if getattr(tokenizer, "chat_template", None) is None:
            return None
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], add_generation_prompt=True,
                                                 tokenize=False)
        except Exception:  # a template that does not take a lone user message: the prompt is translated as text
            return None
        if not isinstance(text, str) or text.count(SENTINEL) != 1:
            return None
        before, after = text.split(SENTINEL)
        return cls(before, after)


class ContextBridge:
    """Keeps the draft model's context (its own tokens) in step with the target's, by bytes.

    A context's first sight is its prompt: decoded to text, the target template's framing of a chat message swapped
    for the draft's (the draft sees the same conversation in its own template), and encoded once. After it, the
    target's tokens are bytes; the draft tokens cached last time are kept as far as their bytes agree with them, and
    the rest is encoded. ``pending`` is what of the target's text the draft's context does not yet hold (a UTF-8
    character cut in two, or bytes it cannot represent): a draft must begin by writing it.

    A round costs what it adds, not the length so far: a context only grows while one sequence is generated, so the
    target's text and the draft tokens that agree with it are carried from round to round, and a context that does
    not continue the last one starts them again.
    """

    def __init__(self, target: TokenText, draft: TokenText, target_framing: ChatFraming | None = None,
                 draft_framing: ChatFraming | None = None) -> None:
        self.target, self.draft = target, draft
        self.target_framing, self.draft_framing = target_framing, draft_framing
        self._prompt: list[int] = []  # the target's prompt ids
        self._draft_prompt: list[int] = []  # their translation
        self._generated: list[int] = []  # the target's ids past the prompt, seen last round
        self._text = b""  # their bytes
        self._aligned: list[int] = []  # draft tokens past the prompt that stand for the first bytes of _text
        self._aligned_bytes = 0

    def fresh(self) -> ContextBridge:
        """A bridge between the same tokenizers for another sequence (a server's request)."""
        return ContextBridge(self.target, self.draft, self.target_framing, self.draft_framing)

    def draft_context(self, context: list[int], cached: list[int]) -> tuple[list[int], bytes]:
        """The draft's tokens for the target's ``context`` (reusing what of ``cached``, the draft model's cache,
        still agrees), and the target's bytes past them."""
        if not self._prompt or context[: len(self._prompt)] != self._prompt:
            self._prompt = list(context)
            self._draft_prompt = self.draft.prompt_ids(self._prompt_text(context))
            self._generated, self._text, self._aligned, self._aligned_bytes = [], b"", [], 0
        generated = self._generated_text(context[len(self._prompt):])
        n = len(self._draft_prompt)
        ours = cached[n:] if cached[:n] == self._draft_prompt else []
        agrees = ours[: len(self._aligned)] == self._aligned
        kept, end = (list(self._aligned), self._aligned_bytes) if agrees else ([], 0)
        for token in ours[len(kept):]:  # the tokens the draft wrote past them last round, as far as they agree
            piece = self.draft.pieces[token] if 0 <= token < self.draft.vocab_size else b""
            if not piece or generated[end:end + len(piece)] != piece:
                break
            kept.append(token)
            end += len(piece)
        rest, consumed = self.draft.encode(generated[end:], final=False)
        self._aligned, self._aligned_bytes = kept + rest, end + consumed
        return self._draft_prompt + self._aligned, generated[self._aligned_bytes:]

    def _generated_text(self, generated: list[int]) -> bytes:
        """The bytes of the target's ``generated`` ids, extending last round's where they continue them (else
        starting again, and forgetting the draft tokens aligned with the old text)."""
        seen = len(self._generated)
        if generated[:seen] != self._generated:
            self._generated, self._text, self._aligned, self._aligned_bytes = [], b"", [], 0
            seen = 0
        self._text += self.target.text_of(generated[seen:])
        self._generated = generated
        return self._text

    def _prompt_text(self, prompt: list[int]) -> str:
        ids = prompt[1:] if self.target.bos is not None and prompt[:1] == [self.target.bos] else prompt
        text = self.target.text_of(ids).decode("utf-8", errors="replace")
        if self.target.adds_space_prefix and text.startswith(" "):
            text = text[1:]
        bos = "" if self.target.bos is None else self.target.pieces[self.target.bos].decode("utf-8", errors="replace")
        return self._reframed(text.removeprefix(bos), bos)  # a BOS the template wrote is the draft's to write

    def _reframed(self, text: str, bos: str) -> str:
        """``text`` with the target template's framing of a chat message (its start, and its last generation
        prompt) written in the draft's template instead."""
        ours, theirs = self.target_framing, self.draft_framing
        if ours is None or theirs is None:
            return text
        before = ours.before.removeprefix(bos) if bos else ours.before
        cut = text.rfind(ours.after)
        if not text.startswith(before) or cut < len(before):
            return text
        return theirs.before + text[len(before):cut] + theirs.after + text[cut + len(ours.after):]


@dataclass(frozen=True)
class SharedTokens:
    """The tokens both vocabularies hold, by their bytes (token-level intersection): ``draft_ids[i]`` and
    ``target_ids[i]`` stand for the same text."""

    draft_ids: torch.Tensor  # [n] long
    target_ids: torch.Tensor  # [n] long
    target_of: dict[int, int]  # draft id -> target id
    draft_of: dict[int, int]  # target id -> draft id

    @classmethod
    def of(cls, target: TokenText, draft: TokenText) -> SharedTokens:
        pairs = []
        controls = {target.pieces[t]: t for t in target.control if target.pieces[t]}
        for token, piece in enumerate(draft.pieces):
            if not piece:
                continue
            other = controls.get(piece) if token in draft.control else target.id_of.get(piece)
            if other is not None:
                pairs.append((token, other))
        return cls(torch.tensor([d for d, _ in pairs], dtype=torch.long),
                   torch.tensor([t for _, t in pairs], dtype=torch.long),
                   dict(pairs), {t: d for d, t in reversed(pairs)})

    def target_logits(self, logits: torch.Tensor, width: int) -> torch.Tensor:  # [vocab_d] -> [width]
        """The draft's logits over the target's ids: the shared tokens', the rest -inf (probability 0)."""
        full = torch.full((width,), float("-inf"), dtype=logits.dtype, device=logits.device)
        full[self.target_ids.to(logits.device)] = logits[self.draft_ids.to(logits.device)]
        return full


def frequent_overlap(target: TokenText, draft: TokenText) -> float:
    """The share of the target's frequent ordinary tokens (its first FREQUENT_TOKENS) the draft holds as bytes."""
    frequent = [piece for token, piece in enumerate(target.pieces)
                if piece and token not in target.control][:FREQUENT_TOKENS]
    return sum(piece in draft.id_of for piece in frequent) / max(len(frequent), 1)


def same_vocabulary(target_tokenizer, draft_tokenizer) -> bool:
    """Whether both tokenizers map every token's text to the same id (then the draft's ids are the target's)."""
    return target_tokenizer is draft_tokenizer or target_tokenizer.get_vocab() == draft_tokenizer.get_vocab()
