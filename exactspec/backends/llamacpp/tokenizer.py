"""A GGUF file's own vocabulary and chat template, through llama.cpp: the tokenizer of a target that llama.cpp
runs, with no transformers import and no converted copy of the model.

It offers the part of the transformers tokenizer interface that exactspec uses (``encode``, ``decode``,
``apply_chat_template``, ``chat_template``, ``eos_token_id``, ``get_vocab``), and it tokenizes as transformers'
tokenizer of the same GGUF does: special tokens written in the text are parsed, and BOS is added when the file
says so. A long text is tokenized in pieces cut where llama.cpp's own split at special tokens certainly falls
(:class:`SpecialTokenCuts`): the ids are the whole text's, at a cost linear in the text.
"""

from __future__ import annotations

import ctypes
import datetime
import functools
import json
import re
from collections import Counter
from collections.abc import Iterable, Iterator

from exactspec.backends.llamacpp.runtime import GGUFModel, llama_cpp

PIECE_BUFFER = 256  # bytes; llama.cpp returns the negated size needed when a piece is longer
CALL_BYTES = 4096  # a text longer than this is tokenized in pieces of about this size (SpecialTokenCuts)


class GGUFTokenizer:
    def __init__(self, model: GGUFModel) -> None:
        self._lib = llama_cpp()
        self._model = model  # keeps the vocabulary's memory alive
        self._vocab = model.vocab
        self.vocab_size = model.vocab_size
        self.chat_template = model.metadata("tokenizer.chat_template")
        eos = self._lib.llama_vocab_eos(self._vocab)
        bos = self._lib.llama_vocab_bos(self._vocab)
        self.eos_token_id = eos if eos >= 0 else None
        self.bos_token_id = bos if bos >= 0 else None
        self._pieces: dict[tuple[int, bool], bytes] = {}

    def encode(self, text: str, add_special_tokens: bool = True, truncation: bool = False,
               max_length: int | None = None) -> list[int]:
        """The text's ids, special tokens written in it parsed; with ``add_special_tokens``, BOS and EOS where the
        file adds them. With ``truncation`` (transformers' arguments), the first ``max_length`` ids, and the text
        past them is not tokenized: a prompt far over the context costs what the context does."""
        data = text.encode("utf-8", errors="surrogatepass")
        limit = max_length if truncation else None
        if len(data) <= CALL_BYTES:
            return self._tokenize(data, add_special_tokens)[:limit]
        ids = [self.bos_token_id] if add_special_tokens and self._lib.llama_vocab_get_add_bos(self._vocab) else []
        for piece in self._special_cuts.pieces(data, CALL_BYTES):
            ids += self._tokenize(piece, False)
            if limit is not None and len(ids) >= limit:
                return ids[:limit]
        if add_special_tokens and self._lib.llama_vocab_get_add_eos(self._vocab):
            ids.append(self.eos_token_id)
        return ids[:limit]

    def _tokenize(self, data: bytes, add_special: bool) -> list[int]:
        """One llama.cpp call over ``data``, special tokens parsed."""
        capacity = len(data) + 8
        while True:
            ids = (ctypes.c_int32 * capacity)()
            n = self._lib.llama_tokenize(self._vocab, data, len(data), ids, capacity, add_special, True)
            if n >= 0:
                return list(ids[:n])
            capacity = -n

    @functools.cached_property
    def _special_cuts(self) -> SpecialTokenCuts:
        """Where a long text may be cut (read from the vocabulary once: 0.06 s for the default model's)."""
        lib = self._lib
        special = lib.LLAMA_TOKEN_ATTR_CONTROL | lib.LLAMA_TOKEN_ATTR_USER_DEFINED | lib.LLAMA_TOKEN_ATTR_UNKNOWN
        attributes = ((token, lib.llama_vocab_get_attr(self._vocab, token)) for token in range(self.vocab_size))
        return SpecialTokenCuts((lib.llama_vocab_get_text(self._vocab, token),
                                 bool(attribute & lib.LLAMA_TOKEN_ATTR_RSTRIP))
                                for token, attribute in attributes if attribute & special)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return b"".join(self._piece(int(t), not skip_special_tokens) for t in token_ids).decode("utf-8",
                                                                                                 errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = True,
                            tools: list[dict] | None = None, truncation: bool = False, max_length: int | None = None
                            ) -> list[int] | str:
        """The chat messages (and the tools the answer may call) rendered through the GGUF's template (Jinja,
        sandboxed), ready for the answer; ``truncation`` and ``max_length`` as :meth:`encode` takes them."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template")
        text = self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
            bos_token=self._special_text(self.bos_token_id), eos_token=self._special_text(self.eos_token_id))
        return self.encode(text, add_special_tokens=False, truncation=truncation, max_length=max_length) \
            if tokenize else text

    @functools.cached_property
    def _template(self):
        """The chat template, compiled once in a sandboxed Jinja environment with what templates written for
        transformers call: ``raise_exception``, ``strftime_now`` (today's date: Llama 3's templates fall back to
        "26 Jul 2024" without it), ``tojson`` that keeps the keys' order and the characters as they are (Jinja's own
        sorts the keys and escapes ``'`` as ``\\u0027``, so tool definitions read otherwise than under transformers
        and llama.cpp), and the loop controls."""
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(message)

        def tojson(value, ensure_ascii: bool = False, indent: int | None = None, separators=None,
                   sort_keys: bool = False) -> str:
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        environment.globals["raise_exception"] = raise_exception
        environment.globals["strftime_now"] = lambda format: datetime.datetime.now().strftime(format)
        environment.filters["tojson"] = tojson
        return environment.from_string(self.chat_template)

    def get_vocab(self) -> dict[str, int]:
        """Each token's text (as the GGUF stores it) -> its id."""
        return {self._lib.llama_vocab_get_text(self._vocab, i).decode("utf-8", errors="replace"): i
                for i in range(self.vocab_size)}

    def piece(self, token: int) -> bytes:
        """The bytes ``token`` stands for (a control token's text as written)."""
        return self._piece(token, True)

    def is_control(self, token: int) -> bool:
        """Whether ``token`` is a control token (BOS, EOS, a chat template's markers), not text."""
        return bool(self._lib.llama_vocab_is_control(self._vocab, token)) or bool(
            self._lib.llama_vocab_is_eog(self._vocab, token))

    def _special_text(self, token: int | None) -> str:
        return "" if token is None else self._piece(token, True).decode("utf-8", errors="replace")

    def _piece(self, token: int, special: bool) -> bytes:
        key = (token, special)
        piece = self._pieces.get(key)
        if piece is None:
            buffer = ctypes.create_string_buffer(PIECE_BUFFER)
            n = self._lib.llama_token_to_piece(self._vocab, token, buffer, PIECE_BUFFER, 0, special)
            if n < 0:
                buffer = ctypes.create_string_buffer(-n)
                n = self._lib.llama_token_to_piece(self._vocab, token, buffer, -n, 0, special)
            piece = self._pieces[key] = buffer.raw[:n]
        return piece


class SpecialTokenCuts:
    """Where llama.cpp's split of a text at its special tokens certainly falls: a text cut there and tokenized piece
    by piece gives the ids it gives whole, and each call stays short.

    llama.cpp (``tokenizer_st_partition``) takes the special tokens longest first, and matches each leftmost and
    without overlap in the text that no token has taken yet; the text between the matches is tokenized piece by
    piece. Its cost is the square of the matches in one call (it walks its list of pieces from the head at each
    match): 6.9 s for a chat of 16,000 messages, 0.26 s for 2,000 (measured on the default model).

    An occurrence of a special token X is certainly matched where no special token at least as long (those matched
    before it) occurs overlapping it, no other token has X's text, and X's text neither starts nor ends with
    whitespace (which a neighbour's strip could take). Cut at its end, each side splits as the whole text does
    there: no match crosses the cut, and a strip stops at X's bytes; unless X strips the whitespace after it
    (``RSTRIP``), which the right side would keep, so such tokens are not cut after."""

    def __init__(self, tokens: Iterable[tuple[bytes, bool]]) -> None:
        """``tokens``: each special token's text, and whether it strips the whitespace after it (``RSTRIP``)."""
        tokens = list(tokens)
        texts = Counter(text for text, _ in tokens)
        self.longest = max(map(len, texts), default=0)
        self._any = _alternatives(texts, lookahead=True)  # at each position, the longest special text there
        self._cuttable = _alternatives([text for text, strips_right in tokens if texts[text] == 1
                                        and text[:1].strip() and text[-1:].strip() and not strips_right])

    def pieces(self, data: bytes, size: int) -> Iterator[bytes]:
        """``data`` in pieces of at least ``size`` bytes (the last may be shorter), each cut after a special token
        that is certainly matched; the whole where there is none."""
        start = 0
        while len(data) - start > size:
            cut = self._cut(data, start + size)
            if cut is None:
                break
            yield data[start:cut]
            start = cut
        if start < len(data):
            yield data[start:]

    def _cut(self, data: bytes, position: int) -> int | None:
        """The end of the first certainly matched special token that starts at ``position`` or after."""
        if self._cuttable is None:
            return None
        for match in self._cuttable.finditer(data, position):
            if self._alone(data, match.start(), match.end()):
                return match.end()
        return None

    def _alone(self, data: bytes, start: int, end: int) -> bool:
        """Whether no special text as long as ``data[start:end]``, or longer, overlaps it, but itself."""
        length = end - start
        for match in self._any.finditer(data, max(0, start - self.longest + 1), end + self.longest):
            at, text = match.start(), match.group(1)
            if at >= end:
                break
            if at == start and len(text) > length or at != start and len(text) >= length and at + len(text) > start:
                return False
        return True


def _alternatives(texts: Iterable[bytes], lookahead: bool = False) -> re.Pattern | None:
    """A pattern that matches any of ``texts``, the longest where several start at one place (as a zero-width
    lookahead, capturing it, with ``lookahead``: every start is found, overlapping or not); None for no texts."""
    texts = sorted(texts, key=len, reverse=True)
    if not texts:
        return None
    either = b"|".join(re.escape(text) for text in texts)
    return re.compile(b"(?=(" + either + b"))" if lookahead else either)
