"""Tokenizers unlike the default model's, as GGUF ``tokenizer.*`` fields, for tiny models drafting across vocabularies.

``sentencepiece_fields`` writes a small SentencePiece vocabulary (llama.cpp's ``llama`` tokenizer): ``<unk>``, ``<s>``
and ``</s>`` for specials, 256 byte-fallback tokens (a newline or an accented letter is spelled in bytes), pieces
marked with ``▁`` merged by score, a space prefix, and an ``[INST]`` chat template. The default model's vocabulary
is a byte-level BPE of 49152 tokens with ChatML specials: the two share words, not ids, specials or templates.

``sub_vocabulary`` drops some of the merged pieces and shuffles the ids: a model over it (``write_tiny_gguf``'s
``token_rows``) computes what the full vocabulary's model does on the tokens they share, so it drafts well where
both tokenise the text alike, and its text comes in finer pieces where they do not.
"""

from __future__ import annotations

import gguf
import numpy as np
from tiny_gguf import MetadataField

WORDS = ("the of and to in is it that for on with as was he she you are this be at by not or have from but what "
         "def return print if else for while import class self true false none value list dict list item key name "
         "hello world number prime write function python code test data file line one two three four five").split()
SUBWORDS = ("ing", "ed", "er", "th", "he", "in", "an", "re", "on", "es", "st", "en", "at", "ly", "ion")
CHARS = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)] + \
    [str(d) for d in range(10)] + list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}[INST] "
            "{{ message['content'] }} [/INST]{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6  # llama.cpp's token types


def sentencepiece_pieces() -> list[str]:
    """Every merged piece with all its prefixes (SentencePiece merges pairs, so each step must be a token)."""
    pieces: dict[str, None] = {"\u2581": None}
    pieces.update(dict.fromkeys(CHARS))
    for word in [f"\u2581{w}" for w in WORDS] + list(SUBWORDS):
        for end in range(2, len(word) + 1):
            pieces[word[:end]] = None
    return list(pieces)


def sentencepiece_fields(pieces: list[str] | None = None, order_seed: int | None = None
                         ) -> tuple[tuple[MetadataField, ...], list[str]]:
    """A SentencePiece vocabulary of ``pieces`` (by default all of ``sentencepiece_pieces``) and its tokens' texts
    by id: specials, bytes and pieces, shuffled by ``order_seed`` (None: in that order)."""
    pieces = sentencepiece_pieces() if pieces is None else pieces
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * len(pieces)
    scores = [0.0] * 259 + [float(len(p)) - i * 1e-4 for i, p in enumerate(pieces)]  # longer merges first
    order = np.arange(len(tokens)) if order_seed is None else np.random.default_rng(order_seed).permutation(len(tokens))
    tokens, types, scores = ([xs[i] for i in order] for xs in (tokens, types, scores))
    string, array, uint32 = gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32
    fields = (
        MetadataField("tokenizer.ggml.model", "llama", string, None),
        MetadataField("tokenizer.ggml.tokens", tokens, array, string),
        MetadataField("tokenizer.ggml.scores", scores, array, gguf.GGUFValueType.FLOAT32),
        MetadataField("tokenizer.ggml.token_type", types, array, gguf.GGUFValueType.INT32),
        MetadataField("tokenizer.ggml.bos_token_id", tokens.index("<s>"), uint32, None),
        MetadataField("tokenizer.ggml.eos_token_id", tokens.index("</s>"), uint32, None),
        MetadataField("tokenizer.ggml.unknown_token_id", tokens.index("<unk>"), uint32, None),
        MetadataField("tokenizer.ggml.add_bos_token", True, gguf.GGUFValueType.BOOL, None),
        MetadataField("tokenizer.chat_template", TEMPLATE, string, None),
    )
    return fields, tokens


def sub_vocabulary(tokens: list[str], drop: float, seed: int) -> tuple[tuple[MetadataField, ...], tuple[int, ...]]:
    """The fields of a shuffled SentencePiece vocabulary holding ``tokens``' specials and bytes and all but about
    ``drop`` of its merged pieces (a piece goes with every longer one it begins); and, per new id, its id in
    ``tokens``."""
    rng = np.random.default_rng(seed)
    merged = [t for t in tokens if len(t) > 1 and not t.startswith("<")]
    dropped = {t for t in merged if rng.random() < drop and len(t) > 2}
    kept = [t for t in sentencepiece_pieces() if t in tokens and not any(t.startswith(d) for d in dropped)]
    fields, new_tokens = sentencepiece_fields(kept, order_seed=seed)
    return fields, tuple(tokens.index(t) for t in new_tokens)
