"""The tools a request offers and its tool_choice, checked: anything malformed is one UsageError
line naming the tool at fault, before a model is loaded or run."""

from __future__ import annotations

from llmcli.engine.structured import OutputFormat
from llmcli.engine.structured.grammar import check_format
from llmcli.engine.tools import CHOICES, NAME, Tool
from llmcli.engine.tools.grammar import call_schema
from llmcli.errors import UsageError


def parse_tools(objects: object, where: str) -> tuple[Tool, ...]:
    """OpenAI tool objects (a JSON array) → tools; anything malformed is one UsageError line
    that names the tool. Each schema is compiled here, so a bad one fails before the model runs."""
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
