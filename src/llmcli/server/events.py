"""What a generation streams, in no protocol's shape: each piece of a choice on its channel (text,
reasoning, a part of a tool call, logprobs), each choice's end with its outcome, or the failure
that cut the reply. Every protocol is an Encoder of these events (openai.py, anthropic.py,
responses.py, ollama.py): none reads another protocol's output back.

A new kind of content (an image, an audio transcript) is a channel here, the place the engine
emits it, and a branch in each encoder's `piece` (and in blocks.py's grouping).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmcli.engine.reasoning import CONTENT, REASONING
from llmcli.engine.reply import TOOL_CALL

if TYPE_CHECKING:
    from llmcli.engine.tools import ToolCall

# The channels: the answer's text, the thinking, a call's parts (CallStart, then CallArguments),
# and the scored tokens (a list of TokenLogprob) of the text that follows or of the prompt.
LOGPROBS, ECHO = "logprobs", "echo"
CHANNELS = (CONTENT, REASONING, TOOL_CALL, LOGPROBS, ECHO)


@dataclass
class Outcome:
    """A choice's end: what it said, why it ended, and what it cost."""

    text: str  # the answer
    finish_reason: str
    stats: Any  # GenerationStats
    sampling: dict[str, Any]
    reasoning: str | None = None  # a reasoning model's thinking; None for a model that does not think
    reasoning_tokens: int | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[Any] | None = None  # asked for: one TokenLogprob per completion token
    prompt_ids: list[int] = field(default_factory=list)  # with echo: the prompt, scored
    prompt_logprobs: list[Any] | None = None
    token_ids: list[int] = field(default_factory=list)
    stop_sequence: str | None = None  # the stop string that ended the reply, if one did

    @property
    def finish(self) -> str:
        """Why it ended, as every protocol maps it: "length", "tool_calls" or "stop"."""
        if self.finish_reason == "length":
            return "length"
        return "tool_calls" if self.tool_calls else "stop"

    @property
    def thinking(self) -> str | None:
        """The thinking a model that thinks did (None for a model that does not)."""
        return self.reasoning if self.reasoning_tokens is not None else None


@dataclass(slots=True)  # not frozen: one is made per token, and a frozen one costs 4× to make
class Piece:
    choice: int
    channel: str  # one of CHANNELS
    value: Any  # text, CallStart | CallArguments, or a list of TokenLogprob


@dataclass(frozen=True, slots=True)
class Ended:
    choice: int
    outcome: Outcome


@dataclass(frozen=True, slots=True)
class Failed:
    """The reply was cut: its generation failed, or the server is shutting down. (A client that
    left gets nothing more: its stream just stops.)"""

    message: str
    code: str | None = None


Event = Piece | Ended | Failed


class Encoder:
    """One protocol's answer: a stream of text (each method gives what to send, "" for nothing)
    or, not streamed, one object. One per request: it holds the stream's state. The defaults
    send nothing; a protocol says what its stream opens and ends with."""

    media_type = "text/event-stream"
    headers: dict[str, str] | None = None  # the streamed response's

    def opening(self) -> str:
        """Before any generation starts."""
        return ""

    def opened(self, choice: int) -> str:
        """As each choice's generation is submitted."""
        return ""

    def piece(self, piece: Piece) -> str:
        raise NotImplementedError

    def ended(self, ended: Ended) -> str:
        return ""

    def closing(self, outcomes: list[Outcome]) -> str:
        """Every choice has ended: the stream's end."""
        raise NotImplementedError

    def failed(self, failed: Failed) -> str:
        raise NotImplementedError

    def whole(self, outcomes: list[Outcome]) -> Any:
        """The answer, not streamed."""
        raise NotImplementedError

    def scores(self, prompts: list[list[int]], scored: list[list[Any]], with_logprobs: bool) -> Any:
        """Prompts scored and nothing generated (max_tokens 0 with echo: OpenAI's completions
        alone can ask it)."""
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class Usage:
    """The tokens of every choice: each prompt once per choice, as OpenAI counts n > 1."""

    prompt: int
    completion: int
    cached: int  # of the prompts', found in a cache
    reasoning: int | None  # of the completions', thinking; None for a model that does not think

    @classmethod
    def of(cls, outcomes: list[Outcome]) -> Usage:
        thought = [outcome.reasoning_tokens for outcome in outcomes if outcome.reasoning_tokens is not None]
        return cls(
            sum(outcome.stats.prompt_tokens for outcome in outcomes),
            sum(outcome.stats.completion_tokens for outcome in outcomes),
            sum(outcome.stats.cached_tokens for outcome in outcomes),
            sum(thought) if thought else None,
        )

    @property
    def counts(self) -> tuple[int, int]:
        """(prompt, completion): what the access log says (metrics.Observed)."""
        return self.prompt, self.completion


def call_input(call: ToolCall) -> Any:
    """A call's arguments as the JSON object they are (Anthropic's `input`, Ollama's `arguments`)."""
    return json.loads(call.arguments or "{}")
