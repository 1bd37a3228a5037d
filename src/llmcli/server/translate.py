"""What every protocol adapter shares: reading the body and checking it against the protocol's
request model (a bad value is a 400 in the adapter's own error class, naming the field), and
building the OpenAI request it becomes. Its answer is encoded from the server's own events
(events.py), never read back from another protocol's output."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict, ValidationError

from llmcli.errors import LlmcliError


async def read_json(request: Request, error: type[LlmcliError]) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except ValueError:
        raise error("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise error("the request body is a JSON object")
    return body


class Body(BaseModel):
    """A protocol's request body, as its adapter reads it: every field typed (a JSON `true` is a
    boolean, never the text "false"), and a field not declared refused, never ignored."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class Part(BaseModel):
    """A block or item whose kinds carry fields of their own: the fields read here typed, the
    others left for the adapter, which refuses the kinds it does not take."""

    model_config = ConfigDict(strict=True, extra="allow")


async def read_body(request: Request, model: type[BaseModel], error: type[LlmcliError]) -> dict[str, Any]:
    """The request's JSON object, checked against the protocol's `model` before any of it is used."""
    body = await read_json(request, error)
    validated(model, body, error)
    return body


def validated(model: type[BaseModel], asked: dict[str, Any], error: type[LlmcliError]) -> Any:
    """The OpenAI request `asked` translates to; its first problem, named, as `error`."""
    try:
        return model.model_validate(asked)
    except ValidationError as problem:
        first = problem.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ())) or "body"
        if first.get("type") == "extra_forbidden":
            raise error(f"{where} is not supported here") from None
        raise error(f"{where}: {first.get('msg', 'invalid value')}") from None
