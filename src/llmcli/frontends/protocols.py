"""What a front end talks to (frontends/target.py says how): a Target starts Replies and keeps a
chat's ChatHistory. Only types: nothing imports this module at run time."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from llmcli.config.settings import SamplingSettings

if TYPE_CHECKING:
    from llmcli.engine.structured import OutputFormat
    from llmcli.frontends.target import Ask, Outcome


class Reply(Protocol):
    def __iter__(self) -> Iterator[tuple[str, str]]:
        """The reply's text, piece by piece as it is generated: (channel, text), the channel
        "reasoning" for a reasoning model's thinking, "content" for the answer."""
        ...

    def interrupt(self) -> None:
        """Stop here (Ctrl-C, a reader that left); whatever the target caches stays exact."""
        ...

    def outcome(self) -> Outcome: ...


class ChatHistory(Protocol):
    """A conversation as the target keeps it. A turn is prepare → ask → commit (or abandon)."""

    system: str | None
    messages: list[dict[str, Any]]  # user and assistant, alternating
    pending_tokens: int  # the prepared prompt's length, where the target counts it
    think_off: bool  # a reasoning model answers without thinking
    think_budget: int | None  # a reasoning model thinks this many tokens at most

    @property
    def context_used(self) -> int: ...

    def prepare(self, user_text: str, sampling: SamplingSettings) -> int:
        """Ready the next turn; returns how many oldest exchanges had to go for it to fit."""
        ...

    def ask(self, sampling: SamplingSettings, speculative: str, output: OutputFormat | None) -> Reply:
        """The reply to the prepared message, after the conversation."""
        ...

    def commit(self, outcome: Outcome) -> None:
        """Keep the finished (or interrupted) turn."""
        ...

    def abandon(self, error: Exception) -> str | None:
        """The turn failed: the conversation (and any cache) is as before it. What to say when
        the target knows better than the error's own words (memory it ran out of)."""
        ...

    def set_system(self, text: str | None) -> None: ...

    def undo(self, keep_cache: bool = False) -> tuple[str, str] | None:
        """Drop the last exchange: (user, reply), or None when there is none."""
        ...

    def restore(self, user: str, reply: str) -> None: ...

    def reset(self) -> None: ...

    def replace(
        self, system: str | None, messages: list[dict[str, Any]], room: SamplingSettings, where: str
    ) -> str:
        """A loaded transcript; returns what to add to the "loaded" line ('' for nothing)."""
        ...

    def describe(self) -> str:
        """/show's line about the exchanges, the context and the cache."""
        ...


class Target(Protocol):
    name: str  # the model as the user named it (or the server calls it)
    where: str  # the device, or the server's URL
    dtype_name: str
    context_length: int
    engine_name: str
    caveat: str | None  # what this target cannot do that a chat should hear about, once

    def image_refusal(self) -> str | None:
        """Why this target's model cannot read an image; None where it can (or a server will
        say, when the image reaches it)."""
        ...

    def facts(self) -> dict[str, Any]:
        """What --json reports about the model and how it is loaded."""
        ...

    def summary(self) -> str:
        """The end of a --stats line: memory and engine, or the server."""
        ...

    def reply(self, ask: Ask) -> Reply: ...

    def chat(self, system: str | None) -> ChatHistory: ...

    def shown_sampling(self, sampling: SamplingSettings) -> dict[str, Any]:
        """The sampling values /show and /save give: in force here, or the ones sent."""
        ...

    def speculation(self, method: str) -> object:
        """Ready speculative decoding by `method` (a draft model may load now); UsageError when
        it cannot run here."""
        ...
