"""What a front end talks to: a model loaded in this process, or a server that runs one.

`generate` and `chat` are written once, over protocols.py. A `Target` starts `Reply`s: iterate
one for its text, interrupt it (Ctrl-C, a reader gone), then read its `Outcome`. A chat keeps its
history in the target's own `ChatHistory` (exact token ids and a KV cache in-process; messages
re-sent whole to a server). What one side cannot do, it says in one line when asked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmcli.config.settings import LoadSettings, RemoteSettings, SamplingSettings, SpeculativeSettings

if TYPE_CHECKING:
    from llmcli.engine.structured import OutputFormat
    from llmcli.engine.tools import ToolCall, ToolRequest
    from llmcli.frontends.protocols import Target


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


def open_target(
    model: str | None,
    load: LoadSettings,
    remote: RemoteSettings,
    speculative: SpeculativeSettings,
    in_process: bool = False,
    lean: bool = True,
) -> Target:
    """A running server that fits (or the one named), else the model loaded here (`lean`: it
    will run on the native engine only, so it may load without transformers)."""
    from llmcli.frontends.remote import find_server

    found = find_server(model, load, remote, in_process, speculative)
    if found is not None:
        return found
    from llmcli.frontends.loading import load_with_feedback
    from llmcli.frontends.local import InProcessTarget

    return InProcessTarget(load_with_feedback(model, load, lean=lean), model, load, speculative)


def json_record(
    target: Target, outcome: Outcome, num_beams: int, output: OutputFormat | None, tools: bool = False
) -> dict[str, Any]:
    """`generate --json`: one record, the same fields in-process or through a server ("server"
    is its URL, null in-process)."""
    record = {
        "text": outcome.text,
        "model": target.name,
        "prompt_tokens": outcome.prompt_tokens,
        "completion_tokens": outcome.completion_tokens,
        "finish_reason": outcome.finish_reason,
        "ttft_s": _rounded(outcome.ttft_s, 6),
        "prefill_tok_s": _rounded(outcome.prefill_tok_s, 3),
        "decode_tok_s": _rounded(outcome.decode_tok_s, 3),
        "server": None,
        **target.facts(),
        "num_beams": num_beams,
        "cached_tokens": outcome.cached_tokens,
        "speculative": outcome.speculative,
        "sampling": outcome.sampling,
        "reasoning": outcome.reasoning,
        "reasoning_tokens": outcome.reasoning_tokens,
    }
    if tools:  # offered: the calls made, [] for none
        from llmcli.frontends.tools import call_record

        record["tool_calls"] = [call_record(call) for call in outcome.tool_calls]
    if output is not None:
        record |= {"format": output.label, "value": json_value(outcome)}
    return record


def json_value(outcome: Outcome) -> Any:
    """The reply's JSON value: null when it was cut before the value was complete (the grammar
    guarantees the rest; a value that somehow does not parse is null, never a crash)."""
    if outcome.value_complete is False:
        return None
    try:
        return json.loads(outcome.text)
    except ValueError:
        return None


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)
