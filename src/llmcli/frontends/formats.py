"""What the command line and the chat say about structured output: --format / --json-schema
read into an OutputFormat (a schema file or inline JSON, refused in one line before any model
loads), the chat's /format, and why a reply is not a complete JSON value."""

from __future__ import annotations

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
) -> str:
    """Why a constrained reply ended before its JSON value was complete, naming the limit as the
    user set it (`limit`: "--max-new-tokens" on the command line; in chat, /set's name). Through
    a server that does not say its limit, `max_new_tokens` is None."""
    if finish_reason == "stop":
        cause = "a stop string cut it"
    elif finish_reason != "length":
        cause = f"the server ended it ({finish_reason})"
    elif max_new_tokens is None or tokens is None:
        cause = "the token limit cut it"
    elif tokens >= max_new_tokens:
        named = f"{limit} {max_new_tokens}" if limit else f"the token limit (max_new_tokens {max_new_tokens})"
        cause = f"{named} cut it"
    else:
        cause = f"the model's context ended it after {tokens} tokens"
    return f"the reply is not a complete JSON value ({output.label}): {cause}; raise the limit and retry"


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
