"""How each template family writes a tool call, recognised from the template, not the name.

One small data entry per family: the text that opens the calls, what goes between two calls,
what closes them, the key the arguments go under, and the marker in a chat template that says
the family's. gpt-oss's harmony names the tool in the call's header instead
(`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{…}`), its arguments bare.
Templates that know no tools get the generic format: the tools described in a system message, a
call written between <tool_call> tags as Hermes writes it, so every model can call tools.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from llmcli.engine.tools import Tool, ToolRequest, arguments_object
from llmcli.errors import UsageError

Message = dict[str, Any]


@dataclass(frozen=True)
class ToolFormat:
    name: str
    markers: tuple[str, ...]  # any of these in a chat template: the family's (empty: generic)
    opener: str  # before the first call
    between: str | None  # between two calls (None: one call per reply)
    closer: str  # after the last call
    arguments_key: str = "arguments"
    trigger: str = ""  # the start of `opener` that, in free text, begins a call
    in_template: bool = True  # the template renders the tools and the calls itself
    header_end: str = ""  # the tool is named in the header, between `opener` and this (harmony)

    @property
    def at_reply_start(self) -> bool:
        """Calls open with nothing but their JSON: a reply is a call when it starts with "{"."""
        return not self.opener

    def write(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        """Calls as the model writes them (how the generic format shows earlier calls)."""
        if self.header_end:  # one call per message, its arguments bare
            (name, arguments), *_ = calls
            body = json.dumps(arguments, ensure_ascii=False)
            return f"{self.opener}{name}{self.header_end}{body}{self.closer}"
        bodies = [
            json.dumps({"name": name, self.arguments_key: arguments}, ensure_ascii=False)
            for name, arguments in calls
        ]
        return self.opener + (self.between or "").join(bodies) + self.closer


HERMES = ToolFormat(
    "hermes",
    ("<tool_call>",),
    "<tool_call>\n",
    "\n</tool_call>\n<tool_call>\n",
    "\n</tool_call>",
    trigger="<tool_call>",
)
MISTRAL = ToolFormat("mistral", ("[TOOL_CALLS]",), "[TOOL_CALLS] [", ", ", "]", trigger="[TOOL_CALLS]")
# Llama 3.1–3.3: a custom tool's call is the whole reply, {"name": …, "parameters": …}.
LLAMA3 = ToolFormat("llama3", ("<|python_tag|>", '"parameters": '), "", None, "", arguments_key="parameters")
# gpt-oss: a call is a message of its own in the commentary channel, ended by <|call|> (an end of
# sequence); the final channel is the answer (reasoning.py strips its header).
HARMONY_TOOLS = ToolFormat(
    "harmony",
    ("to=functions.",),
    "<|channel|>commentary to=functions.",
    None,
    "",
    trigger="<|channel|>commentary",
    header_end=" <|constrain|>json<|message|>",
)
# The layout most open models were tuned on (Hermes, Qwen): the best guess for a template that
# knows no tools.
GENERIC = ToolFormat(
    "generic",
    (),
    HERMES.opener,
    HERMES.between,
    HERMES.closer,
    trigger=HERMES.trigger,
    in_template=False,
)
TOOL_FORMATS = (HARMONY_TOOLS, HERMES, MISTRAL, LLAMA3)  # the order they are tried in


def tool_format_of(tokenizer: Any) -> ToolFormat:
    """The call format this model's chat template writes; the generic one when it writes none."""
    template = str(getattr(tokenizer, "chat_template", None) or "")
    if "tools" in template:
        for fmt in TOOL_FORMATS:
            if any(marker in template for marker in fmt.markers):
                return fmt
    return GENERIC


def generic_instructions(tools: tuple[Tool, ...]) -> str:
    """The system text that offers tools to a model whose template knows none (worded by
    measurement: scripts/bench_tools.py, the demo model picks the asked-for tool more often
    with this short text than with a longer Hermes-style preamble)."""
    lines = "\n".join(json.dumps(tool.openai()["function"], ensure_ascii=False) for tool in tools)
    return (
        f"You can call these tools:\n{lines}\n"
        'To call one, reply with <tool_call>\n{"name": NAME, "arguments": {…}}\n</tool_call>. '
        "A tool's result comes back in the next message."
    )


def template_messages(
    messages: list[Message], request: ToolRequest | None, fmt: ToolFormat
) -> tuple[list[Message], dict[str, Any]]:
    """OpenAI-shaped messages (assistant `tool_calls` with JSON-text arguments, `tool` results
    with a `tool_call_id`) in the shape the template reads, and the template keywords (`tools`).
    A tool result must answer a call made earlier in the messages."""
    calls: dict[str, str] = {}  # call id → tool name, for the results that answer them
    shaped: list[Message] = []
    for position, message in enumerate(messages):
        where = f"messages[{position}]"
        role = message["role"]
        if role == "assistant" and message.get("tool_calls"):
            named = []
            for call in message["tool_calls"]:
                function = call["function"]
                arguments = arguments_object(function["arguments"], where)
                calls[call["id"]] = function["name"]
                named.append((call["id"], function["name"], arguments))
            shaped.append(_assistant_calls(message.get("content") or "", named, fmt))
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in calls:
                raise UsageError(f"{where}: a tool result's tool_call_id {call_id!r} answers no earlier call")
            shaped.append(_tool_result(call_id, calls[call_id], message["content"], fmt))
        else:
            shaped.append({"role": role, "content": message["content"]})
    options: dict[str, Any] = {}
    offered = request is not None and request.tools and (request.choice != "none" or calls)
    if offered and fmt.in_template:
        options["tools"] = [tool.openai() for tool in request.tools]
    elif offered:
        shaped = _with_system(shaped, generic_instructions(request.tools))
    return (_merge_turns(shaped) if not fmt.in_template else shaped), options


def _assistant_calls(content: str, calls: list[tuple[str, str, dict[str, Any]]], fmt: ToolFormat) -> Message:
    if not fmt.in_template:
        text = fmt.write([(name, arguments) for _, name, arguments in calls])
        return {"role": "assistant", "content": f"{content}{text}"}
    tool_calls = [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        for call_id, name, arguments in calls
    ]
    return {"role": "assistant", "content": content, "tool_calls": tool_calls}


def _tool_result(call_id: str, name: str, content: str, fmt: ToolFormat) -> Message:
    if not fmt.in_template:  # a template without tools knows no tool role: the result is the user's
        return {"role": "user", "content": f"The result of {name}: {content}"}
    return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}


def _with_system(messages: list[Message], text: str) -> list[Message]:
    if messages and messages[0]["role"] == "system":
        first = {"role": "system", "content": f"{messages[0]['content']}\n\n{text}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _merge_turns(messages: list[Message]) -> list[Message]:
    """Consecutive messages of one role as one (several results in a row, for templates that
    insist on alternating roles)."""
    merged: list[Message] = []
    for message in messages:
        if merged and merged[-1]["role"] == message["role"] == "user":
            merged[-1] = {"role": "user", "content": _joined(merged[-1]["content"], message["content"])}
        else:
            merged.append(dict(message))
    return merged


def _joined(first: Any, second: Any) -> Any:
    """Two user messages' contents as one: their texts, or (where either holds images) their
    parts, a blank line between."""
    if isinstance(first, str) and isinstance(second, str):
        return f"{first}\n\n{second}"

    def parts(content: Any) -> list[dict[str, Any]]:
        return content if isinstance(content, list) else [{"type": "text", "text": content or ""}]

    return [*parts(first), {"type": "text", "text": "\n\n"}, *parts(second)]
