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


def parse_schema(schema: object, where: str) -> dict[str, Any]:
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise UsageError(f"{where}: a JSON schema is an object, got {type(schema).__name__}")
    return schema
