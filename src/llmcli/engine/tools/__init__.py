"""Tool calls: the tools a request offers, the calls a reply makes, and what may be called.

A tool is OpenAI's function tool (a name, a description, a JSON schema for its arguments); the
same objects reach the chat template (transformers' `apply_chat_template(tools=…)` reads that
shape) and build the grammar every call is generated under (grammar.py), so a call always
parses and its arguments always validate. How a family writes a call is formats.py; reading
calls back out of a reply as it streams is reader.py; what a request offers is checked in
offered.py.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmcli.errors import UsageError

if TYPE_CHECKING:
    from llmcli.engine.tools.freeform import Freeform

# OpenAI's rule for function names; it also keeps a name safe inside a grammar and a template.
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CHOICES = ("auto", "none", "required")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON schema for the arguments object
    # A custom tool (freeform.py): offered as a function of one string, `input`, held to this.
    freeform: Freeform | None = None

    @property
    def has_grammar(self) -> bool:
        """A custom tool whose input a grammar holds (its call is not written by a JSON schema)."""
        return self.freeform is not None and self.freeform.syntax != "text"

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
