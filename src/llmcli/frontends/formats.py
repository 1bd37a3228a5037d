"""What the command line and the chat say about structured output: --format / --json-schema
read into an OutputFormat (a schema file or inline JSON, refused in one line before any model
loads), the chat's /format, and why a reply is not a complete JSON value."""

from __future__ import annotations

import json
from typing import Any

from llmcli.config.settings import OutputSettings
from llmcli.engine.structured import ANY_OBJECT, OutputFormat, parse_schema
from llmcli.errors import UsageError

FORMATS = ("json",)


def output_format(output: OutputSettings, where: str = "--json-schema") -> OutputFormat | None:
    """The format asked for by --format / --json-schema (a file or inline JSON), checked: an
    invalid or unsatisfiable schema is refused here, before any model loads."""
    format_name, schema = output.format, output.json_schema
    if format_name is not None and format_name not in (*FORMATS, "off"):
        raise UsageError(
            f"--format must be json or off, got {format_name!r}", "for a schema use --json-schema"
        )
    if schema is not None:
        inline = schema.lstrip().startswith("{")
        chosen = OutputFormat(read_schema(schema, where), f"{where} {'(inline)' if inline else schema}")
    elif format_name == "json":
        chosen = OutputFormat(ANY_OBJECT, "--format json")
    else:
        return None
    from llmcli.engine.structured.grammar import check_format

    check_format(chosen)
    return chosen


def format_command(argument: str, current: OutputFormat | None) -> OutputFormat | None:
    """The chat's /format: json, schema FILE (or inline JSON), off; nothing keeps the current."""
    word, _, rest = argument.strip().partition(" ")
    if not word:
        return current
    if word == "off":
        return None
    if word == "json" and not rest.strip():
        return output_format(OutputSettings(format="json"))
    if word == "schema" and rest.strip():
        return output_format(OutputSettings(json_schema=rest.strip()), where="/format schema")
    raise UsageError("usage: /format json | schema FILE | off")


def unfinished_value(
    output: OutputFormat,
    finish_reason: str,
    tokens: int | None,
    max_new_tokens: int | None,
    limit: str | None = None,
    text: str = "",
) -> str:
    """Why a constrained reply ended before its JSON value was complete, naming the limit as the
    user set it (`limit`: "--max-new-tokens" on the command line; in chat, /set's name), and what
    would help. Through a server that does not say its limit, `max_new_tokens` is None.

    A value cut by a limit is rarely a long value: a small model loops (a number of endless
    digits, the same keys nested again and again) or keeps adding keys an open schema allows.
    Then more tokens only buy more of the same; what helps is a prompt that names the fields, a
    schema that bounds the value, or a bigger model. `text` (the reply so far) shows which."""
    head = f"the reply is not a complete JSON value ({output.label})"
    if finish_reason == "stop":
        return f"{head}: a stop string cut it; give one that the value cannot contain"
    if finish_reason != "length":
        return f"{head}: the server ended it ({finish_reason})"
    if max_new_tokens is None or tokens is None:
        cut = "the token limit cut it"
    elif tokens >= max_new_tokens:
        named = f"{limit} {max_new_tokens}" if limit else f"the token limit (max_new_tokens {max_new_tokens})"
        cut = f"{named} cut it"
    else:
        cut = f"the model's context ended it after {tokens} tokens"
    loop = repeating_tail(text)
    if loop is not None:
        shown = loop if len(loop) <= 24 else loop[:23] + "…"
        why = f"the model was repeating {json.dumps(shown, ensure_ascii=False)} instead of finishing it"
        more = "more tokens would only repeat it"
    else:
        why = "the model had not finished it"
        more = "raise the limit only if the value is that long"
    return f"{head}: {cut}; {why}: {_what_helps(output)}; {more}"


def _what_helps(output: OutputFormat) -> str:
    """The advice for a model that does not finish its value, fitted to what was asked."""
    models = "or a bigger model (e.g. -m Qwen/Qwen2.5-1.5B-Instruct)"
    if output.lark is not None:
        return f"a prompt that says which call to make, {models}"
    if output.schema == ANY_OBJECT:
        return f"a prompt that names the keys, a --json-schema with their types, {models}"
    if _open_object(output.schema):
        return f'"additionalProperties": false in the schema (it lets the model add keys), {models}'
    return f"a more explicit prompt, bounds in the schema (maxLength, maxItems, maximum), {models}"


def _open_object(schema: Any) -> bool:
    """Whether an object of the schema (at its top, or a property's) takes keys it does not name."""
    if not isinstance(schema, dict):
        return False
    if schema.get("type") == "object" and schema.get("additionalProperties", True) is not False:
        return True
    properties = schema.get("properties")
    return isinstance(properties, dict) and any(_open_object(p) for p in properties.values())


def repeating_tail(text: str, shortest: int = 24) -> str | None:
    """The unit the end of `text` repeats (at least three times, over `shortest` characters or
    more), or None: a model in a loop."""
    tail = text[-400:]
    for size in range(1, len(tail) // 3 + 1):
        unit = tail[-size:]
        times = max(3, -(-shortest // size))
        if times * size <= len(tail) and tail.endswith(unit * times):
            return unit
    return None


def read_schema(value: str, where: str = "--json-schema") -> dict[str, Any]:
    """A schema given inline ('{"type": …}') or as a file path."""
    from llmcli.reading import SCHEMA_BYTES, parse_json, read_text

    if value.lstrip().startswith("{"):
        return parse_schema(parse_json(value, f"{where} {_short(value)}"), where)
    text = read_text(value, SCHEMA_BYTES, f"{where} {value}")
    return parse_schema(parse_json(text, f"{where} {value}"), where)


def _short(value: str) -> str:
    value = " ".join(value.split())
    return value if len(value) <= 40 else value[:37] + "…"
