"""Stop strings: one choice's text as its tokens arrive, and where the first stop string in it begins.

Two readers keep one each, over the same tokens. The scheduler asks which token completes a stop string and ends
the request with that token, as it does at EOS: the tokens generated, metered and counted in usage are the same,
whatever the speculation. The answer asks where to cut its text, and, while streaming, how much of it is final: all
but a tail that may be the start of a stop string.
"""

from __future__ import annotations

from exactspec.view import Detokenizer


class StopText:
    """A choice's text, token by token (a character split across tokens is given to the token that completes it),
    cut at the first occurrence of any of ``stops``."""

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()) -> None:
        self.detokenizer = Detokenizer(tokenizer)
        self.stops = stops
        self.whole = ""  # every piece so far, past a stop string too
        self.cut: int | None = None  # where the first stop string begins, once one has appeared
        self._longest = max(map(len, stops), default=0)

    @property
    def stopped(self) -> bool:
        """Whether a stop string has appeared."""
        return self.cut is not None

    @property
    def text(self) -> str:
        """The text before the first stop string (all of it while none has appeared)."""
        return self.whole if self.cut is None else self.whole[: self.cut]

    def push(self, token_id: int) -> str:
        """Take the next token; the piece of text it adds."""
        return self._add(self.detokenizer.push(token_id))

    def flush(self) -> str:
        """At the end: the text held back for a character that never completed."""
        return self._add(self.detokenizer.flush())

    def final(self, end: bool = False) -> int:
        """How many characters of ``text`` are final: all at the ``end`` or after a stop string, else all but the
        longest tail that is a proper prefix of a stop string."""
        if end or self.cut is not None:
            return len(self.text)
        held = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.whole)), held, -1):
                if self.whole.endswith(stop[:n]):
                    held = n
                    break
        return len(self.whole) - held

    def _add(self, piece: str) -> str:
        start = max(0, len(self.whole) - self._longest + 1)  # a stop string completed now ends in the new piece
        self.whole += piece
        if piece and self.cut is None and self.stops:
            found = [i for i in (self.whole.find(stop, start) for stop in self.stops) if i >= 0]
            if found:
                self.cut = min(found)
        return piece
