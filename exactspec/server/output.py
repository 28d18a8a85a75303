"""What a request's answers become on the wire: each choice's text as it becomes final (cut at the first stop
string), its finish reason, usage and log-probabilities, the speculation extension, whole (:func:`whole`) or as
server-sent events (:func:`stream`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from exactspec.server.framing import ClientGone
from exactspec.server.protocol import ApiError, Job, Response, TokenLogprob, logprobs_payload, usage
from exactspec.server.scheduler import Finished, Handle, Tokens
from exactspec.server.tools import ToolError
from exactspec.stops import StopText
from exactspec.vocabularies import TokenText

POLL_SECONDS = 0.25  # how often a waiting request checks that its client is still there
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "stop", "abort": "abort"}


def echo_text(job: Job, tokenizer, prompt_ids: list[int]) -> str:
    """The prompt's text, which echo puts before a completion's text."""
    if not job.echo:
        return ""
    return job.prompt if isinstance(job.prompt, str) else tokenizer.decode(prompt_ids)


def usage_of(answers: list[Answer], prompt_tokens: int) -> dict:
    return usage(prompt_tokens, sum(a.completion_tokens for a in answers), sum(a.draft_tokens for a in answers),
                 sum(a.accepted_tokens for a in answers), answers[0].handle.cached_tokens)


async def events_of(answers: list[Answer]) -> AsyncIterator[tuple[Answer, Tokens | Finished]]:
    """Every choice's events, as the scheduler hands them over, until each has finished."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    def deliverer(answer: Answer):
        def deliver(event: Tokens | Finished) -> None:  # on the scheduler's thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (answer, event))
            except RuntimeError:  # the loop has closed: nobody waits for this answer any more
                pass

        return deliver

    for answer in answers:
        answer.handle.listen(deliverer(answer))
    open_ = len(answers)
    while open_:
        answer, event = await queue.get()
        if isinstance(event, Finished):
            open_ -= 1
        yield answer, event


async def collect(answers: list[Answer], request) -> None:
    """Wait for every choice to finish, checking every POLL_SECONDS that the client is still there."""
    events = events_of(answers)
    pending = asyncio.ensure_future(events.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=POLL_SECONDS)
            if not done:
                if await request.is_disconnected():
                    raise ClientGone
                continue
            try:
                answer, event = pending.result()
            except StopAsyncIteration:
                return
            answer.take(event)
            pending = asyncio.ensure_future(events.__anext__())
    finally:
        pending.cancel()


async def whole(answers: list[Answer], response: Response, prompt_tokens: int, echoed: str, request) -> dict:
    """The whole answer once every choice has finished: each choice's text (after the ``echoed`` prompt), finish
    reason, log-probabilities and tool calls, and the usage. A choice that failed answers for the request with its
    error; a client that leaves meanwhile (ClientGone) frees the slots its choices hold."""
    try:
        await collect(answers, request)
    finally:
        for answer in answers:
            answer.handle.cancel()  # frees a slot still held (a client gone)
    failed = next((a for a in answers if a.error), None)
    if failed is not None:
        raise ApiError(failed.error, status=failed.error_status)
    choices = [response.choice(a.index, echoed + a.text, a.finish_reason, a.logprobs(response.chat, len(echoed)),
                               a.tool_calls()) for a in answers]
    return response.whole(choices, usage_of(answers, prompt_tokens))


async def stream(answers: list[Answer], response: Response, prompt_tokens: int, echoed: str
                  ) -> AsyncIterator[bytes]:
    """Server-sent events: a role delta (chat) or the echoed prompt first, the text as it becomes final, each
    choice's finish, usage if asked, then [DONE]. A client that leaves cancels this generator, which cancels the
    requests."""
    try:
        for answer in answers:
            if response.chat:
                yield sse_event(response.chunk(None, first=True, index=answer.index))
            elif echoed:
                yield sse_event(response.chunk(echoed, index=answer.index))
        async for answer, event in events_of(answers):
            piece = answer.take(event)
            if answer.error:
                yield sse_event(ApiError(answer.error, status=answer.error_status).body())
            elif answer.holds_text:  # calls, or what may yet open one: sent whole once the answer ends, with the
                if not isinstance(event, Finished):  # log-probabilities and the speculation extension held with it
                    continue
                calls = answer.tool_calls()
                logprobs = answer.chunk_logprobs(response.chat)
                chunk = response.tool_calls_chunk(calls, answer.index, logprobs) if calls else \
                    response.chunk(answer.text, index=answer.index, logprobs=logprobs)
                yield sse_event(answer.with_speculation(chunk, answer.text))
                answer.finish_reason = "tool_calls" if calls else answer.finish_reason
            elif piece or answer.logprobs_due() or answer.unsent_rounds:
                chunk = response.chunk(piece, index=answer.index, logprobs=answer.chunk_logprobs(response.chat))
                yield sse_event(answer.with_speculation(chunk, piece))
            if isinstance(event, Finished) and not answer.error:  # once per choice: its last event
                yield sse_event(answer.with_speculation(response.chunk(None, answer.finish_reason, index=answer.index),
                                                     "", final=True))
        if answers[0].job.include_usage:
            yield sse_event(response.usage_chunk(usage_of(answers, prompt_tokens)))
        yield b"data: [DONE]\n\n"
    finally:
        for answer in answers:
            answer.handle.cancel()


def _continuation(byte: int) -> bool:
    """Whether a byte of UTF-8 continues a character, not begins one."""
    return 0x80 <= byte < 0xC0


def sse_event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


@dataclass
class Answer:
    """One choice's answer as it arrives: text cut at the first stop string (the scheduler ends the request with the
    token that completes one), its finish reason, usage, and the tokens' log-probabilities.

    The log-probabilities are those of the tokens the text holds, each with its own bytes, so that they join into
    the text: a control token (the ``<|im_end|>`` that ends a chat), which the text leaves out, has no entry; under
    a stop string, the tokens whose bytes begin before the cut have one (the last may run past it, into the stop
    string, where the cut falls inside a token). Streamed, an entry goes out with the text it begins in."""

    job: Job
    handle: Handle
    token_text: TokenText  # the tokenizer, and each token's bytes
    index: int
    sent: int = 0  # characters handed out
    completion_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    finish_reason: str = "length"
    error: str = ""
    error_status: int = 500
    done: bool = False
    token_logprobs: list[TokenLogprob] = field(default_factory=list)
    logprobs_sent: int = 0  # token_logprobs already streamed
    characters_begun: int = 0  # characters whose first byte the tokens with entries so far hold
    stop_text: StopText | None = None
    rounds: int = 0  # target passes that emitted its tokens
    unsent_tokens: list[tuple[str, str]] = field(default_factory=list)  # (text, kind) per token, not yet streamed
    unsent_rounds: list[dict] = field(default_factory=list)  # its rounds not yet streamed
    held: str = ""  # final text held back while the answer may yet be tool calls

    def __post_init__(self) -> None:
        self.stop_text = StopText(self.token_text.tokenizer, self.job.stop)

    @property
    def text(self) -> str:
        return self.stop_text.text

    @property
    def holds_text(self) -> bool:
        """Whether its text is held back: an answer under tools that calls them, or may yet (``auto``'s first
        characters decide)."""
        return self.job.tool_calling is not None and not self.job.tool_calling.in_text(self.text)

    def take(self, event: Tokens | Finished) -> str:
        """Take one event; the text that became final with it (never part of a stop string, never past one), or
        with the text held back before it (:attr:`holds_text`)."""
        piece = self._take(event)
        if self.holds_text:
            self.held += piece
            return ""
        piece, self.held = self.held + piece, ""
        return piece

    def _take(self, event: Tokens | Finished) -> str:
        if self.done:
            return ""
        if isinstance(event, Finished):
            self.done = True
            if event.reason == "error":
                self.error, self.error_status = event.message or "generation failed", event.status
                return ""
            self.finish_reason = FINISH_REASONS.get(event.reason, event.reason)
            rest = self.stop_text.flush()
            if self.job.include_speculation:
                self.unsent_tokens.append((rest, self.unsent_tokens[-1][1] if self.unsent_tokens else "plain"))
            if self.stop_text.stopped:
                self.finish_reason = "stop"
            return self._release(end=True)
        self.completion_tokens += len(event.token_ids)
        self.draft_tokens += event.draft_tokens
        self.accepted_tokens += event.kinds.count("accepted")
        self.rounds += 1
        for token, kind in zip(event.token_ids, event.kinds):
            piece = self.stop_text.push(token)
            if self.job.include_speculation:
                self.unsent_tokens.append((piece, kind))
        if self.job.include_speculation:
            round_ = {"k": event.draft_tokens, "accepted": event.kinds.count("accepted"),
                      "tokens": len(event.token_ids)}
            self.unsent_rounds.append({**round_, "source": event.source} if event.source else round_)
        if event.logprobs is not None:
            self._take_logprobs(event.token_ids, event.logprobs)
        return self._release()

    def _take_logprobs(self, tokens: list[int], logprobs: list[tuple[float, list[tuple[int, float]]]]) -> None:
        """An entry for each token the text holds (none for a control token), where it starts in the text: at the
        character its first byte begins, or continues."""
        pieces, control = self.token_text.pieces, self.token_text.control
        for token, (logprob, top) in zip(tokens, logprobs):
            if token in control:
                continue
            piece = pieces[token]
            continues = bool(piece) and _continuation(piece[0])
            self.token_logprobs.append(TokenLogprob(piece, logprob, [(pieces[i], lp) for i, lp in top],
                                                    self.characters_begun - continues))
            self.characters_begun += sum(not _continuation(byte) for byte in piece)

    def tool_calls(self) -> list[dict] | None:
        """The calls the answer made (None where it answered in text, or asked for no tools); an answer whose calls
        max_tokens cut short is its text."""
        calling = self.job.tool_calling
        if calling is None or self.error:
            return None
        try:
            return calling.calls(self.text)
        except ToolError:
            return None

    def with_speculation(self, chunk: dict, piece: str, final: bool = False) -> dict:
        """The chunk, and, when the request asked for ``stream_options.include_speculation``, how its text came
        under a ``exactspec`` key: each token's piece of ``piece`` and its kind ("accepted", "recovered", "bonus" or
        "plain"; a token whose text a chunk boundary cut appears in both), the rounds since the last chunk (draft
        tokens scored, accepted, tokens emitted, and the source that drafted them where a combined drafter did) and,
        on the last chunk, the request's totals."""
        if not self.job.include_speculation:
            return chunk
        tokens, owed = [], len(piece)
        while self.unsent_tokens and (owed > 0 or not self.unsent_tokens[0][0]):
            text, kind = self.unsent_tokens.pop(0)
            if len(text) > owed:
                self.unsent_tokens.insert(0, (text[owed:], kind))
                text = text[:owed]
            tokens.append({"text": text, "kind": kind})
            owed -= len(text)
        extension = {"tokens": tokens, "rounds": self.unsent_rounds}
        self.unsent_rounds = []
        if final:
            extension["summary"] = {"speculation": self.handle.mode, "completion_tokens": self.completion_tokens,
                                    "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                                    "target_passes": self.rounds}
        return {**chunk, "exactspec": extension}

    def logprobs(self, chat: bool, echoed: int) -> dict | None:
        if self.job.logprobs is None:
            return None
        return logprobs_payload(chat, self._kept(self.token_logprobs), echoed)

    def chunk_logprobs(self, chat: bool) -> dict | None:
        """The entries a stream sends now (:meth:`logprobs_due`), as the chunk's logprobs."""
        if self.job.logprobs is None:
            return None
        entries = self.logprobs_due()
        self.logprobs_sent += len(entries)
        return logprobs_payload(chat, entries)

    def logprobs_due(self) -> list[TokenLogprob]:
        """The entries not yet streamed whose text has been handed out (all that are kept, once the answer ends)."""
        due = self._kept(self.token_logprobs)[self.logprobs_sent:]
        return due if self.done else [entry for entry in due if entry.start < self.sent]

    def _kept(self, entries: list[TokenLogprob]) -> list[TokenLogprob]:
        """Every token, or, when a stop string cut the text, those whose bytes begin before the cut."""
        if not self.stop_text.stopped:
            return entries
        return [entry for entry in entries if entry.start < len(self.text)]

    def _release(self, end: bool = False) -> str:
        """The final text not yet handed out (all of it at the ``end``)."""
        final = self.stop_text.final(end)
        piece, self.sent = self.text[self.sent : final], max(self.sent, final)
        return piece
