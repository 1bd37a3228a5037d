"""The tools a request offers and its tool_choice, checked: anything malformed is one UsageError
line naming the tool at fault, before a model is loaded or run."""

from __future__ import annotations

from llmcli.engine.structured import OutputFormat, without_string_key_rule
from llmcli.engine.structured.grammar import check_format
from llmcli.engine.tools import CHOICES, NAME, Tool
from llmcli.engine.tools.freeform import Freeform
from llmcli.engine.tools.grammar import call_schema
from llmcli.errors import UsageError


def parse_tools(objects: object, where: str, custom: bool = False) -> tuple[Tool, ...]:
    """OpenAI tool objects (a JSON array) → tools; anything malformed is one UsageError line
    that names the tool. Each schema is compiled here, so a bad one fails before the model runs.
    `custom`: custom tools are taken too (where the protocol can answer their calls)."""
    if not isinstance(objects, list):
        raise UsageError(f"{where}: tools are a JSON array of tool objects, got {type(objects).__name__}")
    tools: list[Tool] = []
    for position, item in enumerate(objects):
        label = f"{where}: tool {position}"
        if isinstance(item, dict) and item.get("type") == "custom" and not custom:
            raise UsageError(f"{label}: custom tools are not supported here (function tools are)")
        if isinstance(item, dict) and item.get("type") == "custom":
            tool = custom_tool(item.get("custom"), label)
            if any(other.name == tool.name for other in tools):
                raise UsageError(f"{where}: tool {tool.name!r} is offered twice")
            tools.append(tool)
            continue
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
        parameters = without_string_key_rule(parameters)
        check_format(OutputFormat(parameters, f"{label} parameters"))
        tools.append(Tool(name, description, parameters))
    schema_tools = tuple(tool for tool in tools if not tool.has_grammar)
    if schema_tools:  # as the calls' grammar holds them: what fails there fails here, before any load
        check_format(OutputFormat(call_schema(schema_tools, "arguments"), f"{where}: the tools together"))
    return tuple(tools)


def custom_tool(custom: object, label: str) -> Tool:
    """A custom tool, `{"name": …, "description": …, "format": {"type": "text"} or {"type":
    "grammar", "grammar": {"syntax": "lark" or "regex", "definition": …}}}` (Chat Completions'
    shape): offered as a function of one string, `input`; its grammar compiled here, a grammar
    llguidance cannot read refused with its reason."""
    shape = '{"type": "custom", "custom": {"name": …, "format": …}}'
    name = custom.get("name") if isinstance(custom, dict) else None
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise UsageError(f"{label}: a custom tool is {shape}, its name 1-64 letters, digits, _ or -")
    label = f"{label.rsplit(':', 1)[0]}: tool {name!r}"
    description = custom.get("description") or ""
    form = custom.get("format") or {"type": "text"}
    grammar = form.get("grammar") if isinstance(form, dict) else None
    if not isinstance(description, str):
        raise UsageError(f"{label}: the description must be text")
    if isinstance(form, dict) and form.get("type") == "text":
        freeform = Freeform("text")
    elif (
        isinstance(grammar, dict)
        and form.get("type") == "grammar"
        and grammar.get("syntax") in ("lark", "regex")
        and isinstance(grammar.get("definition"), str)
    ):
        freeform = Freeform(grammar["syntax"], grammar["definition"])
    else:
        raise UsageError(
            f'{label}: a format is {{"type": "text"}} or {{"type": "grammar", "grammar": '
            '{"syntax": "lark" or "regex", "definition": …}}'
        )
    if freeform.syntax == "lark":  # llguidance's own reason for a grammar it cannot read
        check_format(OutputFormat({}, f"{label}: its Lark grammar", lark=freeform.definition))
    if freeform.syntax != "text":
        try:
            lark = f"start: {freeform.input_lark()}\n"
        except UsageError as error:  # what cannot be escaped into a JSON string (freeform.py)
            raise UsageError(f"{label}: {error.message}") from None
        check_format(OutputFormat({}, f"{label}: its {freeform.syntax} grammar, escaped", lark=lark))
    parameters = {
        "type": "object",
        "properties": {"input": {"type": "string"}},
        "required": ["input"],
        "additionalProperties": False,
    }
    return Tool(name, description + freeform.note(), parameters, freeform)


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
