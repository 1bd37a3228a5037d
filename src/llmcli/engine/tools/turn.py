"""One reply that may call tools, made ready: the messages and keywords for the template, the
grammar to generate under, and the reader that takes the calls back out of the reply."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmcli.engine.structured import OutputFormat
from llmcli.engine.tools import ToolRequest
from llmcli.engine.tools.formats import ToolFormat, template_messages, tool_format_of
from llmcli.engine.tools.grammar import call_grammar
from llmcli.engine.tools.reader import ToolCallReader

Message = dict[str, Any]


@dataclass(frozen=True)
class ToolTurn:
    fmt: ToolFormat
    messages: list[Message]  # in the template's shape
    options: dict[str, Any]  # keywords for the template (`tools`)
    output: OutputFormat | None  # the reply's grammar (None: no tools offered)
    calls: bool = False  # a call may be made (not with tool_choice "none")

    def reader(self) -> ToolCallReader | None:
        return ToolCallReader(self.fmt) if self.calls else None


def tool_turn(
    tokenizer: Any,
    messages: list[Message],
    request: ToolRequest | None,
    vocab_size: int,
    eos_token_ids: frozenset[int],
) -> ToolTurn:
    """`messages` may hold earlier calls and their results whether or not tools are offered now.
    The vocabulary size and end ids are the model's, as the constraint sees them."""
    from llmcli.engine.structured.grammar import guidance_tokenizer

    fmt = tool_format_of(tokenizer)
    shaped, options = template_messages(messages, request, fmt)
    if request is None or not request.tools:
        return ToolTurn(fmt, shaped, options, None)
    guidance = guidance_tokenizer(tokenizer, vocab_size, eos_token_ids)
    output = call_grammar(request, fmt, tokenizer, guidance)  # with "none": no call can start
    return ToolTurn(fmt, shaped, options, output, calls=bool(request.callable))
