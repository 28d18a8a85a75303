"""Constrained decoding: a grammar (a JSON Schema, any JSON object, a regex, or a Lark or GBNF grammar) over a
model's vocabulary, through llguidance (chosen by measurement: ``python -m exactspec.bench.grammars``,
docs/serving.md).

A :class:`Grammar` is one request's matcher, in the state after the tokens generated so far. Each round it
- puts its forced tokens (what the grammar admits alone from here) in the draft, with no drafter call;
- guides a drafter that drafts token by token (a draft model) along its draft (:class:`DraftGuide`): each token
  chosen among those the grammar allows, and the tokens it forces after one put in the draft too;
- cuts a drafter's draft at its first token the grammar forbids;
- gives the tokens it allows at every scored position (after each prefix of the draft), which mask the target's
  logits before any choice: greedy, the invariant sampler's or the standard rule's. Every token is then an exact
  draw from the constrained distribution, with speculation or without;
- takes in the round's emitted tokens.
"""

from __future__ import annotations

import copy
import functools
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from exactspec.errors import UsageError

if TYPE_CHECKING:
    import torch

    from exactspec.vocabularies import TokenText

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "grammar")  # grammar: Lark or GBNF
# JSON is written on one line, as json.dumps writes it: no free whitespace, which a model could spin out (and
# which would leave less of an answer forced)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(UsageError):
    """A grammar that does not compile, or a schema feature the engine does not support: the compiler's message."""


@dataclass(frozen=True)
class GrammarSpec:
    """What constrains a request: ``kind`` (one of GRAMMAR_KINDS) and its text (a schema as JSON, a regex, a Lark
    or GBNF grammar; nothing for json_object)."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"a grammar is one of {', '.join(GRAMMAR_KINDS)}, not {self.kind!r}")

    @staticmethod
    def json_schema(schema: dict | str) -> GrammarSpec:
        return GrammarSpec("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    def compiled(self) -> str:
        """llguidance's grammar for it; GrammarError where its text is not one."""
        import llguidance

        try:
            if self.kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
            if self.kind == "json_schema":
                schema = json.loads(self.source)
                if not isinstance(schema, dict):
                    raise GrammarError("a JSON Schema is a JSON object")
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
            if self.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.source)
            return llguidance.LLMatcher.grammar_from_lark(lark_of(self.source))
        except GrammarError:
            raise
        except Exception as error:  # whatever the compiler raises, the text it was given is at fault
            raise GrammarError(f"the {self.kind.replace('_', ' ')} does not compile: {_first_line(error)}") from None


def lark_of(grammar: str) -> str:
    """A Lark or GBNF grammar as Lark: Lark as it is, GBNF (llama.cpp's) through llguidance's parser, printed with
    every repetition of a repetition grouped. llguidance prints ``("a"+)+`` as ``"a"++``, which Lark refuses, and
    its parser refuses the operators stacked that llama.cpp reads as groups (``"a"+?`` is ``("a"+)?``)."""
    from llguidance import gbnf_to_lark as gbnf

    if gbnf.is_lark_syntax(grammar):
        return grammar
    rules = _gbnf_parser()().parse(grammar)
    gbnf.resolve(rules)  # names as Lark spells them, and rules of terminals alone made terminals
    for rule in rules.values():
        _group_repeated(rule)
    ordered = sorted(rules.values(), key=lambda rule: rule.order)
    return "%llguidance {}\n\n" + "".join(f"{rule}\n" for rule in ordered)


def _group_repeated(node) -> None:
    """Where a repetition repeats a repetition, the inner one as a group of one (which prints in parentheses)."""
    from llguidance.gbnf_to_lark import RepetitionNode, SequenceNode

    for child in node.children():
        _group_repeated(child)
    if isinstance(node, RepetitionNode) and isinstance(node.node, RepetitionNode):
        node.node = SequenceNode([node.node])


@functools.cache
def _gbnf_parser() -> type:
    """llguidance's GBNF parser, taking postfix operators stacked (each repeats what it follows, as in llama.cpp)."""
    from llguidance.gbnf_to_lark import GrammarParser

    class GbnfParser(GrammarParser):
        def _parse_repetition(self, pos, nodes):
            while True:
                after = super()._parse_repetition(pos, nodes)
                if after.pos == pos.pos:
                    return pos
                pos = self._skip_space(after, allow_newlines=False)

    return GbnfParser


class _Tokens:
    """A tokenizer as llguidance reads one: each token's bytes, the special ones, and encoding bytes."""

    def __init__(self, text: TokenText, eos_token_ids: list[int]) -> None:
        self.eos_token_id = eos_token_ids[0]
        self.bos_token_id = text.bos
        self.tokens = list(text.pieces)
        self.special_token_ids = sorted(text.control)
        self._text = text

    def __call__(self, data: bytes) -> list[int]:
        return self._text.encode(data)[0]


@functools.lru_cache(maxsize=4)
def llg_tokenizer(text: TokenText, eos_token_ids: tuple[int, ...]):
    """llguidance's tokenizer over ``text`` (built once per vocabulary: about a second for 150k tokens); any of
    ``eos_token_ids`` ends a grammar that is complete."""
    import llguidance

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Tokens(text, list(eos_token_ids))),
                                  n_vocab=text.vocab_size, eos_token=list(eos_token_ids))


class Grammar:
    """One request's matcher over a vocabulary of ``vocab_size`` (the logits' width)."""

    def __init__(self, spec: GrammarSpec, tokenizer) -> None:
        import llguidance

        self.spec = spec
        self.vocab_size = tokenizer.vocab_size
        self.matcher = llguidance.LLMatcher(tokenizer, spec.compiled(), log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"the {spec.kind.replace('_', ' ')} does not compile: "
                               f"{_first_line(self.matcher.get_error())}")
        self.forced_tokens = 0  # forced tokens it put in drafts
        self.forcing = True  # whether it drafts its forced tokens (off: plain decoding under the grammar)
        self.seconds = 0.0  # spent in the matcher: masks, forced tokens, checking drafts, taking in tokens

    def allowed(self) -> np.ndarray:  # [vocab] bool
        """The tokens the grammar allows next."""
        started = time.perf_counter()
        allowed = unpacked([self.matcher.compute_bitmask()], self.vocab_size)[0]
        self.seconds += time.perf_counter() - started
        return allowed

    def forced(self, most: int) -> list[int]:
        """Up to ``most`` tokens that follow from here whatever is sampled: the grammar admits only their text."""
        if most <= 0 or not self.forcing:
            return []
        started = time.perf_counter()
        tokens = self.matcher.compute_ff_tokens()[:most]
        self.seconds += time.perf_counter() - started
        self.forced_tokens += len(tokens)
        return tokens

    def admitted(self, tokens: list[int]) -> int:
        """How many of ``tokens``, in turn, the grammar admits from here."""
        if not tokens:
            return 0
        started = time.perf_counter()
        count = self.matcher.validate_tokens(tokens)
        self.seconds += time.perf_counter() - started
        return count

    def forbidden(self, draft: list[int]) -> np.ndarray:  # [len(draft) + 1, vocab] bool
        """The tokens forbidden after each prefix of ``draft``; the state is left as it was. Rows the round can
        never read forbid nothing: those after a token the grammar forbids (it is rejected for sure), and those
        after the grammar completes (its row allows only an end token, which ends the answer)."""
        admitted = self.admitted(draft)
        started = time.perf_counter()
        words = [self.matcher.compute_bitmask()]
        taken = 0
        for token in draft[:admitted]:
            if self.matcher.is_stopped():  # complete: the matcher takes no token more, an end token included
                break
            self._take([token])
            taken += 1
            words.append(self.matcher.compute_bitmask())
        if taken:
            self.matcher.rollback(taken)
        forbidden = np.zeros((len(draft) + 1, self.vocab_size), dtype=bool)
        forbidden[: len(words)] = unpacked(words, self.vocab_size, negated=True)
        self.seconds += time.perf_counter() - started
        return forbidden

    def guide(self, ahead: list[int], room: int) -> DraftGuide:
        """A guide for a drafter along a draft that follows ``ahead`` (the tokens already in it, admitted), of at
        most ``room`` tokens after them; close it (a ``with`` block) to leave the state as it was."""
        return DraftGuide(self, ahead, room)

    def masked(self, logits: torch.Tensor, draft: list[int]) -> torch.Tensor:
        """logits [k+1, vocab] (row j after draft[:j]) with every token the grammar forbids there at -inf."""
        import torch

        forbidden = self.forbidden(draft)[: logits.shape[0], : logits.shape[1]]
        # torch's masked fill (measured 2026-12-05: 117 us for 4 rows of 49,152 on 2 cores, numpy's masked copy 197)
        return logits.masked_fill(torch.from_numpy(forbidden).to(logits.device), float("-inf"))

    def advance(self, tokens: list[int]) -> bool:
        """Take in emitted tokens; False where the grammar refused one (it is then in error)."""
        started = time.perf_counter()
        taken = self.matcher.consume_tokens(tokens)
        self.seconds += time.perf_counter() - started
        return taken

    def _take(self, tokens: list[int]) -> None:
        if not self.matcher.consume_tokens(tokens):
            raise RuntimeError(f"the grammar refused tokens it had admitted: {self.matcher.get_error()}")

    def copy(self) -> Grammar:
        """Another matcher in this one's state, for another sequence (the grammar is not compiled again)."""
        other = copy.copy(self)
        other.matcher = self.matcher.deep_copy()
        other.forced_tokens, other.seconds = 0, 0.0
        return other

    def reset(self) -> None:
        """Back to the start, for another generation under the same grammar."""
        self.matcher.reset()
        self.forced_tokens = 0
        self.seconds = 0.0

    @property
    def accepting(self) -> bool:
        """Whether what was generated is complete under the grammar."""
        return self.matcher.is_accepting()

    @property
    def stopped(self) -> bool:
        """Whether the grammar admits nothing more (but an end token)."""
        return self.matcher.is_stopped()


class DraftGuide:
    """The grammar along a draft being drafted, for a drafter that drafts token by token: the tokens it allows
    next (:meth:`allowed`), and after a token taken in (:meth:`take`) the tokens it forces from there, drafted as
    point masses with no drafter call (a forced token is accepted wherever the token before it is). A drafter
    that drafts under it proposes only tokens the grammar admits: a masked draft model is accepted far more often
    than one that spends its draft on text the grammar forbids. Every token taken is rolled back on
    :meth:`close`: the grammar's state stays the sequence's."""

    def __init__(self, grammar: Grammar, ahead: list[int], room: int) -> None:
        self.grammar = grammar
        self.room = room  # the draft tokens the drafter may still add, forced ones included
        self.taken = 0
        self._take(ahead)

    def allowed(self) -> np.ndarray | None:  # [vocab] bool
        """The tokens the grammar allows next; None where the draft is full or the grammar complete (nothing but
        an end token could follow, which ends the answer)."""
        if self.room <= 0 or self.grammar.stopped:
            return None
        return self.grammar.allowed()

    def take(self, token: int) -> list[int]:
        """Take in the drafter's ``token`` (one :meth:`allowed` allowed), then the tokens the grammar forces after
        it, as many as the draft has room for: those forced tokens, to follow it in the draft."""
        self._take([token])
        self.room -= 1
        forced = self.grammar.forced(self.room) if not self.grammar.stopped else []
        self._take(forced)
        self.room -= len(forced)
        return forced

    def close(self) -> None:
        if self.taken:
            self.grammar.matcher.rollback(self.taken)
            self.taken = 0

    def __enter__(self) -> DraftGuide:
        return self

    def __exit__(self, *_) -> None:
        self.close()

    def _take(self, tokens: list[int]) -> None:
        if tokens:
            started = time.perf_counter()
            self.grammar._take(tokens)
            self.taken += len(tokens)
            self.grammar.seconds += time.perf_counter() - started


def unpacked(bitmasks: list[bytes] | list[np.ndarray], vocab_size: int, negated: bool = False) -> np.ndarray:
    """Token bitmasks, each a row (bit i of its little-endian words: token i allowed; an engine may pad a row), one
    bool per token: [rows, vocab]. ``negated``: True where a token is forbidden."""
    words = np.stack([np.frombuffer(row, dtype=np.uint8) if isinstance(row, bytes) else row.view(np.uint8)
                      for row in bitmasks])
    return np.unpackbits(~words if negated else words, axis=1, bitorder="little")[:, :vocab_size].view(bool)


def grammar_for(spec: GrammarSpec, text: TokenText, eos_token_ids: set[int] | frozenset[int]) -> Grammar:
    """A fresh matcher for ``spec`` over ``text``'s vocabulary, ended by any of ``eos_token_ids``."""
    return Grammar(spec, prepare_grammars(text, eos_token_ids))


def prepare_grammars(text: TokenText, eos_token_ids: set[int] | frozenset[int]):
    """llguidance's tokenizer for ``text``'s vocabulary and these end tokens, built once (what every grammar over
    them compiles against; a server builds it ahead of its first structured request)."""
    return llg_tokenizer(text, tuple(sorted(eos_token_ids)))


def _first_line(error: object) -> str:
    """The compiler's message on one line, shortened."""
    text = " ".join(line.strip() for line in str(error).strip().splitlines() if line.strip())
    return (text[:300] + "...") if len(text) > 300 else text or type(error).__name__
