"""The one rule by which a reply's pieces become blocks (Anthropic's content blocks, the Responses
API's output items): a block per run of one kind of content — thinking, text, or one tool call —
opened by its first piece and closed when another kind starts or the reply ends. A call's start
opens a block even right after another call. Pieces with nothing to show (empty text, logprobs)
belong to no block.
"""

from __future__ import annotations

from enum import Enum

from llmcli.engine.reasoning import CONTENT, REASONING
from llmcli.engine.reply import TOOL_CALL
from llmcli.engine.tools.reader import CallStart
from llmcli.server.events import Piece


class Step(Enum):
    SKIP = "skip"  # nothing to show: no block
    SAME = "same"  # more of the block being written
    NEW = "new"  # a block opens (the one before it, if any, closes first)


class Blocks:
    """One choice's blocks as its pieces come: `feed` says where each piece goes, `index` is
    the position of the block being written (-1 before the first)."""

    def __init__(self) -> None:
        self.kind: str | None = None  # the channel of the block being written
        self.index = -1

    def feed(self, piece: Piece) -> Step:
        channel, value = piece.channel, piece.value
        if channel == TOOL_CALL:
            if type(value) is CallStart:
                return self._open(channel)
            return Step.SAME if value.text else Step.SKIP  # a call's arguments, its start sent already
        if channel not in (CONTENT, REASONING) or not value:
            return Step.SKIP
        return Step.SAME if channel == self.kind else self._open(channel)

    @property
    def closes_one(self) -> bool:
        """Whether the block just opened closed another first."""
        return self.index > 0

    def _open(self, channel: str) -> Step:
        self.kind, self.index = channel, self.index + 1
        return Step.NEW
