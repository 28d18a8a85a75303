"""A GGUF file's own vocabulary and chat template, through llama.cpp: the tokenizer of a target that llama.cpp
runs, with no transformers import and no converted copy of the model.

It offers the part of the transformers tokenizer interface that exactspec uses (``encode``, ``decode``,
``apply_chat_template``, ``chat_template``, ``eos_token_id``, ``get_vocab``), and it tokenizes as transformers'
tokenizer of the same GGUF does: special tokens written in the text are parsed, and BOS is added when the file
says so.
"""

from __future__ import annotations

import ctypes
import datetime
import functools
import json

from exactspec.backends.llamacpp.runtime import GGUFModel, llama_cpp

PIECE_BUFFER = 256  # bytes; llama.cpp returns the negated size needed when a piece is longer


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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        data = text.encode("utf-8", errors="surrogatepass")
        capacity = len(data) + 8
        while True:
            ids = (ctypes.c_int32 * capacity)()
            n = self._lib.llama_tokenize(self._vocab, data, len(data), ids, capacity, add_special_tokens, True)
            if n >= 0:
                return list(ids[:n])
            capacity = -n

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return b"".join(self._piece(int(t), not skip_special_tokens) for t in token_ids).decode("utf-8",
                                                                                                 errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = True,
                            tools: list[dict] | None = None) -> list[int] | str:
        """The chat messages (and the tools the answer may call) rendered through the GGUF's template (Jinja,
        sandboxed), ready for the answer."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template")
        text = self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
            bos_token=self._special_text(self.bos_token_id), eos_token=self._special_text(self.eos_token_id))
        return self.encode(text, add_special_tokens=False) if tokenize else text

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
