"""A reply's text as what it is for the reader: thinking, answer, and tool calls.

A reasoning model's pieces are split into thinking and answer (reasoning.py); when the reply
may call tools, the answer's pieces go on through the call reader (tools/reader.py), which
gives text and the parts of each call. Front ends and the server take the same events.

A call's parts are held until the call is complete: a call the length limit cuts is no call
(its arguments are no JSON object) and is given back as the text it was, so it must not have
been sent as a call's parts already — every protocol reports it once, as text, with the
finish reason "length".
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from llmcli.engine.reasoning import CONTENT, ThinkingStream

if TYPE_CHECKING:
    from llmcli.engine.loop import GenerationResult
    from llmcli.engine.tools import ToolCall
    from llmcli.engine.tools.reader import ToolCallReader

TOOL_CALL = "tool_call"  # the channel of a call's parts (CallStart, CallArguments)


class ReplyStream:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], reader: ToolCallReader | None = None) -> None:
        self.thinking = ThinkingStream(tokenizer, prompt_ids)
        self.reader = reader
        self._answer: list[str] = []
        self._held: list[Any] = []  # the parts of the call in progress, until it is complete

    def split(self, pieces: Iterable[str]) -> Iterator[tuple[str, Any]]:
        """(channel, piece): reasoning text, answer text, or a part of a call."""
        reader = self.reader
        for channel, piece in self.thinking.split(pieces):
            if channel != CONTENT or reader is None:
                yield channel, piece
            else:
                yield from self._read(reader.feed(piece))
        if reader is not None:
            yield from self._read(reader.finish())
            self._held.clear()  # a call still in progress was cut: finish gave it back as text

    def _read(self, events: list[Any]) -> Iterator[tuple[str, Any]]:
        for event in events:
            if isinstance(event, str):
                yield from self._complete_calls()
                self._answer.append(event)
                yield CONTENT, event
            else:
                self._held.append(event)
        yield from self._complete_calls()

    def _complete_calls(self) -> Iterator[tuple[str, Any]]:
        """The held parts of the calls that are complete now, in order (a cut call's parts stay:
        the reader has given it up)."""
        calls = self.reader.calls if self.reader is not None else []
        while self._held and self._held[0].index < len(calls) and calls[self._held[0].index].done:
            yield TOOL_CALL, self._held.pop(0)

    def summary(self, result: GenerationResult) -> tuple[str, str | None, int | None, list[ToolCall]]:
        """(the answer, the thinking or None, its tokens or None, the calls made)."""
        answer, reasoning, tokens = self.thinking.summary(result.text, result.token_ids)
        if self.reader is None:
            return answer, reasoning, tokens, []
        return "".join(self._answer), reasoning, tokens, self.reader.tool_calls()
