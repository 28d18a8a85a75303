"""Text as it is produced, token by token, and the token-level view of how each token came.

Each generated token is accepted (a draft token that survived), recovered (drawn from the residual after a
rejection), bonus (drawn after a fully accepted draft) or plain (a round with no draft).
"""

from __future__ import annotations

import html

# kind -> (ANSI colour code, HTML colour, legend)
KIND_STYLES = {
    "accepted": ("32", "#c8e6c9", "accepted draft token"),
    "recovered": ("33", "#ffe0b2", "recovered after a rejection"),
    "bonus": ("36", "#bbdefb", "bonus token after a fully accepted draft"),
    "plain": ("0", "transparent", "plain decoding step"),
}


class Detokenizer:
    """Turns token ids, one at a time, into the piece of text each adds.

    A character split across tokens decodes as U+FFFD until its last byte arrives: the piece is held back and
    given to the token that completes it.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already handed out

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        piece, self.sent = text[self.sent :], len(text)
        return piece

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        piece, self.sent = text[self.sent :], len(text)
        return piece


def ansi(piece: str, kind: str) -> str:
    """One piece of text in its kind's terminal colour."""
    code = KIND_STYLES[kind][0]
    return piece if code == "0" or not piece else f"\x1b[{code}m{piece}\x1b[0m"


def ansi_legend() -> str:
    return "  ".join(ansi(legend, kind) for kind, (_, _, legend) in KIND_STYLES.items())


def html_page(pieces: list[str], kinds: list[str], title: str, summary: str) -> str:
    """A standalone HTML page showing each token coloured by how it came, with its kind on hover."""
    spans = "".join(
        f'<span class="{kind}" title="{kind}">{html.escape(piece)}</span>' for piece, kind in zip(pieces, kinds)
    )
    styles = "\n".join(f"  .{kind} {{ background: {colour}; }}" for kind, (_, colour, _) in KIND_STYLES.items())
    legend = " ".join(f'<span class="{kind}">{html.escape(text)}</span>' for kind, (_, _, text) in
                      KIND_STYLES.items())
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{html.escape(title)}</title>
<style>
  body {{ font-family: system-ui, sans-serif; max-width: 50rem; margin: 2rem auto; line-height: 1.6; }}
  pre {{ white-space: pre-wrap; font-family: ui-monospace, monospace; font-size: 0.95rem; }}
  span {{ border-radius: 3px; }}
{styles}
</style>
</head>
<body>
<h1>{html.escape(title)}</h1>
<p>{legend}</p>
<pre>{spans}</pre>
<p>{html.escape(summary)}</p>
</body>
</html>
"""
