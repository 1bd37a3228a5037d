"""The tools a command line offers: `generate --tools FILE` (OpenAI tool objects in JSON) and
`chat --functions FILE.py` (a Python file's functions); checked before the model loads."""

from __future__ import annotations

import json
from typing import Any, BinaryIO

from llmcli.engine.tools import CHOICES, Tool, ToolCall, ToolRequest
from llmcli.engine.tools.offered import parse_choice, parse_tools
from llmcli.errors import UsageError


def read_tools(path: str, choice: str, stdin: BinaryIO | None) -> ToolRequest:
    """--tools FILE (or - for stdin) and --tool-choice, as a request; one line for what is wrong."""
    from llmcli.reading import SCHEMA_BYTES, decode, parse_json, read_file, read_stream

    where = "--tools" if path == "-" else f"--tools {path}"
    if path == "-":
        if stdin is None or stdin.isatty():
            raise UsageError("--tools - reads the tools from stdin, and stdin is a terminal")
        data = read_stream(stdin, SCHEMA_BYTES, where)
    else:
        data = read_file(path, SCHEMA_BYTES, where)
    objects = parse_json(decode(data, where), where)
    tools = parse_tools(objects, where)
    if not tools:
        raise UsageError(f"{where}: the array holds no tools")
    return ToolRequest(tools, flag_choice(choice, tools))


def flag_choice(choice: str, tools: tuple[Tool, ...]) -> str:
    """--tool-choice (auto, none, required, or a tool's name), checked against the tools."""
    named = choice if choice in CHOICES else {"type": "function", "function": {"name": choice}}
    return parse_choice(named, tools, "--tool-choice")


def call_record(call: ToolCall) -> dict[str, Any]:
    """A call as `generate` reports it: its arguments an object (for jq). Another kind of
    server's arguments that are not JSON stay text, as they came."""
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        arguments = call.arguments
    return {"id": call.id, "name": call.name, "arguments": arguments}
