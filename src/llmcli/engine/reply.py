"""A reply's text as what it is for the reader: thinking, answer, and tool calls.

A reasoning model's pieces are split into thinking and answer (reasoning.py); when the reply
may call tools, the answer's pieces go on through the call reader (tools/reader.py), which
gives text and the parts of each call. Front ends and the server take the same events.
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

    def _read(self, events: list[Any]) -> Iterator[tuple[str, Any]]:
        for event in events:
            if isinstance(event, str):
                self._answer.append(event)
                yield CONTENT, event
            else:
                yield TOOL_CALL, event

    def summary(self, result: GenerationResult) -> tuple[str, str | None, int | None, list[ToolCall]]:
        """(the answer, the thinking or None, its tokens or None, the calls made)."""
        answer, reasoning, tokens = self.thinking.summary(result.text, result.token_ids)
        if self.reader is None:
            return answer, reasoning, tokens, []
        return "".join(self._answer), reasoning, tokens, self.reader.tool_calls()
