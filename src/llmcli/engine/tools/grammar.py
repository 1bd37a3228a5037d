"""The grammar a reply that may call tools is generated under (llguidance's Lark).

Each call is `{"name": <one of the tools>, "arguments": <that tool's schema>}`, written with
the separators json.dumps and chat templates use (", " and ": "), so a call looks like the
calls the model saw in training. With `required` or a named tool the reply is calls from its
first token; with `auto` it is free text until the family's opener (a lazy trigger: the
shortest text that ends with it), then a call held to the grammar to its end, then only the
end of the reply. A special token in an opener is named by its id, as the tokenizer has it.

gpt-oss's harmony (`header_end`): after any analysis, either the final channel's free text, or
one call in the commentary channel, its tool named in the header and its arguments bare.
"""

from __future__ import annotations

import json
from typing import Any

from llmcli.engine.structured import DATA_KEYWORDS, NAMED_SCHEMAS, OutputFormat
from llmcli.engine.structured.grammar import COMPILE_OPTIONS as SEPARATORS  # as --json-schema writes
from llmcli.engine.tools import Tool, ToolRequest
from llmcli.engine.tools.formats import ToolFormat


def call_schema(tools: tuple[Tool, ...], arguments_key: str) -> dict[str, Any]:
    """One call of any of `tools`: its name, then its arguments (the grammar writes properties
    in the schema's order, so a reader sees the name first)."""
    return {
        "x-guidance": SEPARATORS,
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool.name},
                    arguments_key: rooted(tool.parameters, f"/anyOf/{index}/properties/{arguments_key}"),
                },
                "required": ["name", arguments_key],
                "additionalProperties": False,
            }
            for index, tool in enumerate(tools)
        ],
    }


def rooted(schema: Any, pointer: str) -> Any:
    """A tool's parameters placed at `pointer` inside the call schema. Their local references
    ("#", "#/$defs/node") are to their own root; left as they are, they would point at the call
    schema's root instead: a recursive tree's child would have to be a whole call, and a
    reference into the tool's own $defs would point nowhere (a grammar that fails to compile
    once the model is loaded). Each one now says where that root is."""
    if isinstance(schema, list):
        return [rooted(item, pointer) for item in schema]
    if not isinstance(schema, dict):
        return schema
    moved: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            moved[key] = "#" + pointer + value[1:]
        elif key in DATA_KEYWORDS:
            moved[key] = value
        elif key in NAMED_SCHEMAS and isinstance(value, dict):
            moved[key] = {name: rooted(child, pointer) for name, child in value.items()}
        else:
            moved[key] = rooted(value, pointer)
    return moved


def call_grammar(request: ToolRequest, fmt: ToolFormat, tokenizer: Any, guidance: Any) -> OutputFormat:
    """The reply's grammar: with `none`, text that never opens a call (see `_no_call_grammar`).
    `guidance`: llguidance's view of the tokenizer, which says which tokens are special."""
    tools = request.callable
    specials = _special_tokens(tokenizer, guidance)
    if not tools:
        return _no_call_grammar(fmt, specials)
    if fmt.header_end:
        return _harmony_grammar(request, fmt, specials)
    body, per_tool = _call_rule(tools, fmt.arguments_key)
    between = fmt.between if request.parallel and request.choice in ("auto", "required") else None
    repeat = f" ({_literal(between, specials)} call)*" if between is not None else ""
    rules = [f"call: {body}", *per_tool, f"calls: call{repeat} {_literal(fmt.closer, specials)}".rstrip()]
    if request.must_call:
        start = f"start: {_literal(fmt.opener, specials)} calls"
    elif fmt.at_reply_start:  # text is a reply that does not start with "{"
        start = "start: calls | TEXT?"
        rules.append(r"TEXT: /[^{](.|\n)*/")
    else:
        trigger, rest = fmt.trigger, _literal(fmt.opener[len(fmt.trigger) :], specials)
        if trigger in specials:  # free text never holds a special token: it ends the text
            start = f"start: TEXT | TEXT <[{specials[trigger]}]> {rest} calls"
        else:  # the shortest text that ends with the trigger, then the call
            start = f"start: TEXT | text_then_trigger {rest} calls"
            rules.append(f"text_then_trigger[lazy]: TEXT {json.dumps(trigger)}")
        rules.append(r"TEXT: /(.|\n)*/")
    lark = "\n".join(["%llguidance {}", start, *rules, ""])
    names = ", ".join(tool.name for tool in tools)
    return OutputFormat({}, f"tool calls ({names})", lark=lark)


def _call_rule(tools: tuple[Tool, ...], key: str) -> tuple[str, list[str]]:
    """One call of any of `tools`: one JSON schema over them all, or, where a custom tool's
    grammar is among them, one alternative per tool with the tool's name written before its
    arguments (llguidance settles on one lexeme class at a call's first "{", so a JSON schema's
    and a nested grammar's cannot both begin there)."""
    if not any(tool.has_grammar for tool in tools):
        return "%json " + json.dumps(call_schema(tools, key)), []
    rules = []
    for index, tool in enumerate(tools):
        head = json.dumps({"name": tool.name, key: ""})[: -len('""}')]
        rules.append(f"call_{index}: {json.dumps(head)} {_arguments(tool)} " + json.dumps("}"))
    return " | ".join(f"call_{index}" for index in range(len(tools))), rules


def _arguments(tool: Tool) -> str:
    """A call's arguments object: its schema's JSON, or a custom tool's `{"input": "…"}` with the
    input held to the tool's grammar (freeform.py)."""
    if tool.freeform is not None and tool.has_grammar:
        head, tail = json.dumps({"input": ""}).split('""')
        return f"{json.dumps(head + chr(34))} {tool.freeform.input_lark()} {json.dumps(chr(34) + tail)}"
    return "%json " + json.dumps({"x-guidance": SEPARATORS, **tool.parameters})


def _no_call_grammar(fmt: ToolFormat, specials: dict[str, int]) -> OutputFormat:
    """tool_choice "none": a model trained to call tools may still start a call on its own, and
    its call syntax would then come out as text. The text may never hold the family's trigger:
    a special token is outside free text anyway; a plain-text trigger is excluded by a regex
    (llguidance's `&` and `~`); a reply-start format's reply may not open with "{"; harmony's
    answer is the final channel."""
    if fmt.header_end:
        final = _literal("<|channel|>final<|message|>", specials)
        lark = "\n".join([
            "%llguidance {}",
            f"start: analysis? opening? {final} TEXT",
            f"analysis: {_literal('<|channel|>analysis<|message|>', specials)}",
            f"opening: {_literal('<|start|>assistant', specials)}",
            r"TEXT: /(.|\n)*/",
            "",
        ])  # fmt: skip
    elif fmt.at_reply_start:
        lark = "%llguidance {}\nstart: TEXT?\n" + r"TEXT: /\s*[^{\s](.|\n)*/" + "\n"
    elif fmt.trigger in specials:
        lark = "%llguidance {}\nstart: TEXT\n" + r"TEXT: /(.|\n)*/" + "\n"
    else:
        trigger = _regex_literal(fmt.trigger)
        lark = f"%llguidance {{}}\nstart: TEXT\nTEXT: /(.|\\n)*/ & ~/(.|\\n)*{trigger}(.|\\n)*/\n"
    return OutputFormat({}, "text without tool calls (tool_choice none)", lark=lark)


def _regex_literal(text: str) -> str:
    """`text` matched literally inside a Lark /regex/: each sign in a class of its own (`\\<`
    would be a word boundary in Rust's regex)."""
    return "".join(
        char if char.isalnum() else "[" + ("\\" + char if char in "\\]^-[" else char) + "]" for char in text
    )


def _harmony_grammar(request: ToolRequest, fmt: ToolFormat, specials: dict[str, int]) -> OutputFormat:
    """What may follow the analysis channel (the grammar waits while the model thinks: the
    thinking tracker stops advancing it after `<|message|>` and starts again after `<|end|>`)."""
    tools = request.callable
    rules = []
    for index, tool in enumerate(tools):
        header = _literal(fmt.opener + tool.name + fmt.header_end, specials)
        rules.append(f"call_{index}: {header} {_arguments(tool)}")
    calls = " | ".join(f"call_{index}" for index in range(len(tools)))
    final = _literal("<|channel|>final<|message|>", specials)
    answer = calls if request.must_call else f"{final} TEXT | {calls}"
    lark = "\n".join([
        "%llguidance {}",
        "start: analysis? opening? answer",
        f"analysis: {_literal('<|channel|>analysis<|message|>', specials)}",
        f"opening: {_literal('<|start|>assistant', specials)}",
        f"answer: {answer}",
        *rules,
        r"TEXT: /(.|\n)*/",
        "",
    ])  # fmt: skip
    names = ", ".join(tool.name for tool in tools)
    return OutputFormat({}, f"tool calls ({names})", lark=lark)


def _literal(text: str, specials: dict[str, int]) -> str:
    """`text` as a sequence of Lark strings and special tokens (`<[id]>`)."""
    parts: list[str] = []
    rest = text
    while rest:
        found = min(((rest.find(token), token) for token in specials if token in rest), default=None)
        if found is None:
            parts.append(json.dumps(rest))
            break
        index, token = found
        if index:
            parts.append(json.dumps(rest[:index]))
        parts.append(f"<[{specials[token]}]>")
        rest = rest[index + len(token) :]
    return " ".join(parts)


def _special_tokens(tokenizer: Any, guidance: Any) -> dict[str, int]:
    """Added tokens llguidance takes as special: the grammar must name them by id, since text
    never spells them (it counts Qwen's <tool_call> as special, though the tokenizer does not)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return {token.content: id_ for id_, token in decoder.items() if guidance.is_special_token(id_)}
