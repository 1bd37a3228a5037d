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
from typing import Any

from llmcli.errors import UsageError


@dataclass(frozen=True)
class OutputFormat:
    """What a reply must be: a JSON value valid under `schema` (`--format json`: any object),
    or, with `lark`, text under a whole grammar (a reply that may call tools)."""

    schema: dict[str, Any]
    label: str  # how messages name it: "--format json", "--json-schema person.json", …
    lark: str | None = None  # an llguidance Lark grammar, used instead of the schema

    @property
    def schema_text(self) -> str:
        # Keys in the schema's own order: the grammar writes properties in that order.
        return json.dumps(self.schema)


ANY_OBJECT: dict[str, Any] = {"type": "object"}
# Keywords whose values are JSON data, not schemas: a {"$ref": …} inside one is a value to match.
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# Keywords whose values map names of the schema's own choosing (never keywords) to schemas.
NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
STRING_KEYS = {"type": "string"}  # a propertyNames that says what every JSON key is already


def parse_schema(schema: object, where: str) -> dict[str, Any]:
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise UsageError(f"{where}: a JSON schema is an object, got {type(schema).__name__}")
    return without_string_key_rule(schema)


def without_string_key_rule(schema: Any) -> Any:
    """The schema without `propertyNames: {"type": "string"}`, which constrains nothing (every
    JSON key is a string) and which the grammar engine does not implement: zod's records carry
    it (Claude Code's and Codex CLI's tool schemas). Any other propertyNames stays, and the
    grammar engine refuses it in one line. A mapping of names (properties, $defs) keeps every
    name, even one spelt propertyNames; values (const, enum, default) are data, left whole."""
    if isinstance(schema, list):
        return [without_string_key_rule(value) for value in schema]
    if not isinstance(schema, dict):
        return schema
    kept: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "propertyNames" and value == STRING_KEYS:
            continue
        if key in NAMED_SCHEMAS and isinstance(value, dict):
            kept[key] = {name: without_string_key_rule(each) for name, each in value.items()}
        else:
            kept[key] = value if key in DATA_KEYWORDS else without_string_key_rule(value)
    return kept
