"""What a front end talks to: a model loaded in this process, or a server that runs one.

`generate` and `chat` are written once, over protocols.py. A `Target` starts `Reply`s: iterate
one for its text, interrupt it (Ctrl-C, a reader gone), then read its `Outcome`. A chat keeps its
history in the target's own `ChatHistory` (exact token ids and a KV cache in-process; messages
re-sent whole to a server). What one side cannot do, it says in one line when asked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmcli.config.settings import SamplingSettings

if TYPE_CHECKING:
    from llmcli.engine.structured import OutputFormat
    from llmcli.engine.tools import ToolCall, ToolRequest


@dataclass
class Outcome:
    """What a reply came to. A figure the target could not know (another kind of server
    reports only usage counts) is None."""

    text: str
    finish_reason: str  # stop, length, interrupted
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prefilled_tokens: int | None = None
    cached_tokens: int | None = None
    cached_from: str | None = None  # where the cached tokens came from: memory, slot, disk (None: none)
    image_tokens: int | None = None  # of prompt_tokens, those the images take (None: not known)
    ttft_s: float | None = None
    prefill_tok_s: float | None = None
    decode_tok_s: float | None = None
    speculative: dict[str, Any] | None = None  # method, drafted, accepted
    sampling: dict[str, Any] | None = None  # the values in force, defaults filled in
    value_complete: bool | None = None  # with a format: whether the JSON value was finished
    token_ids: list[int] = field(default_factory=list)  # in-process only: the exact ids sampled
    reasoning: str | None = None  # a reasoning model's thinking (None: the model does not think)
    reasoning_tokens: int | None = None  # of completion_tokens, the thinking's, end marker included
    raw_text: str | None = None  # in-process: the reply as the chat keeps it, think block included
    tool_calls: list[ToolCall] = field(default_factory=list)  # the calls the reply made

    def stats_summary(self) -> str:
        """The figures of a --stats line."""
        # A figure not known is left out, not shown as 0: a reply through a server that Ctrl-C
        # cut gets no usage or timings, another kind of server reports no timings at all.
        counts = [
            *known("{} prompt tok", self.prompt_tokens),
            *known("{} completion tok", self.completion_tokens),
        ]
        figures = [
            *([", ".join(counts)] if counts else []),
            *known("TTFT {:.3f} s", self.ttft_s),
            *known("prefill {:.1f} tok/s", self.prefill_tok_s),
            *known("decode {:.1f} tok/s", self.decode_tok_s),
        ]
        text = " · ".join(figures)
        spec = self.speculative
        if spec:
            rate = f"{spec['accepted'] / spec['drafted']:.0%}" if spec["drafted"] else "0%"
            text += (
                f" · {spec['method']}: {spec['accepted']}/{spec['drafted']} drafted tokens accepted ({rate})"
            )
        return text


def known(form: str, value: float | None) -> list[str]:
    """A figure for a stats line, or nothing where it is not known."""
    return [] if value is None else [form.format(value)]


@dataclass(frozen=True)
class Ask:
    """One reply asked of a target: what to answer, and how."""

    messages: list[dict[str, Any]]  # system (optional) and user; with `raw`, one user text as-is
    sampling: SamplingSettings
    speculative: str = "off"
    output: OutputFormat | None = None
    raw: bool = False
    num_beams: int = 1
    think_off: bool = False  # a reasoning model answers without thinking
    think_budget: int | None = None  # a reasoning model thinks this many tokens at most
    tools: ToolRequest | None = None  # tools the reply may call
