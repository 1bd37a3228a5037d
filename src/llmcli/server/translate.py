"""What every protocol adapter shares: reading the body, building the OpenAI request it
becomes (a bad value is a 400 in the adapter's own error class), and reading back the chunks of
the OpenAI stream it translates."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from llmcli.errors import LlmcliError


async def read_json(request: Request, error: type[LlmcliError]) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except ValueError:
        raise error("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise error("the request body is a JSON object")
    return body


def validated(model: type[BaseModel], asked: dict[str, Any], error: type[LlmcliError]) -> Any:
    """The OpenAI request `asked` translates to; its first problem, named, as `error`."""
    try:
        return model.model_validate(asked)
    except ValidationError as problem:
        first = problem.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ())) or "body"
        raise error(f"{where}: {first.get('msg', 'invalid value')}") from None


def chunk_of(event: str | bytes) -> dict[str, Any] | None:
    """One server-sent event of the OpenAI stream as its JSON object (None: nothing to read)."""
    data = (event if isinstance(event, str) else event.decode()).removeprefix("data: ").strip()
    if not data or data == "[DONE]":
        return None
    return json.loads(data)
