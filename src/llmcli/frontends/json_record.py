"""`generate --json`: one record, the same fields in-process or through a server."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmcli.engine.structured import OutputFormat
    from llmcli.frontends.protocols import Target
    from llmcli.frontends.target import Outcome


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
        "cached_from": outcome.cached_from,
        "image_tokens": outcome.image_tokens,
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
