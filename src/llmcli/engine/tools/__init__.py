"""Tool calls: the tools a request offers, the calls a reply makes, and what may be called.

A tool is OpenAI's function tool (a name, a description, a JSON schema for its arguments); the
same objects reach the chat template (transformers' `apply_chat_template(tools=…)` reads that
shape) and build the grammar every call is generated under (grammar.py), so a call always
parses and its arguments always validate. How a family writes a call is formats.py; reading
calls back out of a reply as it streams is reader.py.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from llmcli.errors import UsageError

# OpenAI's rule for function names; it also keeps a name safe inside a grammar and a template.
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CHOICES = ("auto", "none", "required")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON schema for the arguments object

    def openai(self) -> dict[str, Any]:
        """The tool as OpenAI sends it, and as chat templates read it."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text (OpenAI's `function.arguments`)

    def openai(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolRequest:
    """The tools on offer and what the reply may do with them: `choice` is "auto" (text or
    calls), "none" (text only), "required" (calls only) or one tool's name (that call only)."""

    tools: tuple[Tool, ...]
    choice: str = "auto"
    parallel: bool = True  # several calls in one reply, where the family's format can write them

    @property
    def callable(self) -> tuple[Tool, ...]:
        """The tools a call may name."""
        if self.choice == "none":
            return ()
        if self.choice in CHOICES:
            return self.tools
        return tuple(tool for tool in self.tools if tool.name == self.choice)

    @property
    def must_call(self) -> bool:
        return self.choice not in ("auto", "none")


def parse_tools(objects: object, where: str) -> tuple[Tool, ...]:
    """OpenAI tool objects (a JSON array) → tools; anything malformed is one UsageError line
    that names the tool. Each schema is compiled here, so a bad one fails before the model runs."""
    from llmcli.engine.structured import OutputFormat
    from llmcli.engine.structured.grammar import check_format

    if not isinstance(objects, list):
        raise UsageError(f"{where}: tools are a JSON array of tool objects, got {type(objects).__name__}")
    tools: list[Tool] = []
    for position, item in enumerate(objects):
        label = f"{where}: tool {position}"
        function = item.get("function") if isinstance(item, dict) else None
        if (
            not isinstance(item, dict)
            or item.get("type", "function") != "function"
            or not isinstance(function, dict)
        ):
            raise UsageError(f'{label}: a tool is {{"type": "function", "function": {{"name": …}}}}')
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise UsageError(f"{label}: the name must be 1-64 letters, digits, _ or -, got {name!r}")
        label = f"{where}: tool {name!r}"
        if any(tool.name == name for tool in tools):
            raise UsageError(f"{label} is offered twice")
        description = function.get("description") or ""
        if not isinstance(description, str):
            raise UsageError(f"{label}: the description must be text")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise UsageError(f"{label}: parameters must be a JSON schema of type object")
        check_format(OutputFormat(parameters, f"{label} parameters"))
        tools.append(Tool(name, description, parameters))
    if tools:  # as the calls' grammar holds them: what fails there fails here, before any load
        from llmcli.engine.tools.grammar import call_schema

        check_format(OutputFormat(call_schema(tuple(tools), "arguments"), f"{where}: the tools together"))
    return tuple(tools)


def parse_choice(choice: object, tools: tuple[Tool, ...], where: str) -> str:
    """OpenAI's tool_choice ("auto", "none", "required", or {"type": "function", "function":
    {"name": …}}) → "auto", "none", "required" or the tool's name."""
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise UsageError(f'{where}: tool_choice is "auto", "none", "required" or a named function')
        if choice == "required" and not tools:
            raise UsageError(f'{where}: tool_choice "required" needs tools')
        return choice
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise UsageError(f'{where}: a named tool_choice is {{"type": "function", "function": {{"name": …}}}}')
    if all(tool.name != name for tool in tools):
        raise UsageError(f"{where} names {name!r}, which is not among the tools")
    return name


def arguments_object(arguments: object, where: str) -> dict[str, Any]:
    """A call's arguments as a template reads them (a dict), from OpenAI's JSON text."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else None
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise UsageError(f"{where}: function.arguments must be a JSON object (as text)")
    return value
