"""Constrained decoding: replies that are JSON, or JSON valid under a schema.

At each step the logits of every token the grammar does not allow are set to −inf before any
sampling filter runs, so whatever the sampler picks keeps the text a prefix of a valid value,
and generation ends when the value is complete. The grammar engine is llguidance (the one
llama.cpp uses; chosen by measurement, docs/benchmarks.md): it compiles a JSON schema into a
grammar, refuses invalid and unsatisfiable schemas without a tokenizer (so before the model
loads), and computes each step's mask in tens of microseconds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmcli.errors import UsageError

FORMATS = ("json",)


@dataclass(frozen=True)
class OutputFormat:
    """What a reply must be: a JSON value valid under `schema` (`--format json`: any object)."""

    schema: dict[str, Any]
    label: str  # how messages name it: "--format json", "--json-schema person.json", …

    @property
    def schema_text(self) -> str:
        # Keys in the schema's own order: the grammar writes properties in that order.
        return json.dumps(self.schema)


ANY_OBJECT: dict[str, Any] = {"type": "object"}


def output_format(
    format_name: str | None, schema: str | None, where: str = "--json-schema"
) -> OutputFormat | None:
    """The format asked for by --format / --json-schema (a file or inline JSON), checked: an
    invalid or unsatisfiable schema is refused here, before any model loads."""
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
        return output_format("json", None)
    if word == "schema" and rest.strip():
        return output_format(None, rest.strip(), where="/format schema")
    raise UsageError("usage: /format json | schema FILE | off")


def unfinished_value(
    output: OutputFormat, finish_reason: str, tokens: int, max_new_tokens: int, limit: str | None = None
) -> str:
    """Why a constrained reply ended before its JSON value was complete, naming the limit as the
    user set it (`limit`: "--max-new-tokens" on the command line; in chat, /set's name)."""
    if finish_reason == "stop":
        cause = "a stop string cut it"
    elif tokens >= max_new_tokens:
        named = f"{limit} {max_new_tokens}" if limit else f"the token limit (max_new_tokens {max_new_tokens})"
        cause = f"{named} cut it"
    else:
        cause = f"the model's context ended it after {tokens} tokens"
    return f"the reply is not a complete JSON value ({output.label}): {cause}; raise the limit and retry"


def read_schema(value: str, where: str = "--json-schema") -> dict[str, Any]:
    """A schema given inline ('{"type": …}') or as a file path."""
    text = value
    if not value.lstrip().startswith("{"):
        path = Path(value).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UsageError(f"{where} {value}: no such file", "give a schema file or inline JSON") from None
        except (OSError, UnicodeDecodeError) as error:
            raise UsageError(f"{where} {value}: cannot be read ({error})") from None
    try:
        schema = json.loads(text)
    except ValueError as error:
        raise UsageError(f"{where} {_short(value)}: not valid JSON ({error})") from None
    return parse_schema(schema, where)


def parse_schema(schema: object, where: str) -> dict[str, Any]:
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise UsageError(f"{where}: a JSON schema is an object, got {type(schema).__name__}")
    return schema


def _short(value: str) -> str:
    value = " ".join(value.split())
    return value if len(value) <= 40 else value[:37] + "…"
