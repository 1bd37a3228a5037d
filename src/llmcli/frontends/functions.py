"""`chat --functions FILE.py`: a Python file's functions as tools, run only when the user says so.

The file is read, not run, to describe its tools: its top-level public functions, their type
hints and docstrings become OpenAI tool objects (ast, no import). The file runs the first time
a call is approved (or with --yes), and each approved call runs its function with the call's
arguments; its result, or the exception's text, is what the model reads next.

A reply names what it likes (a server given with --server, or a model that invents a name): only
a function offered, and at run time still the plain function the file itself defines under that
name, ever runs. Whatever else the file's namespace holds (`from os import system`, a private
helper, a class, an alias of an imported callable) is refused, as an unknown tool is.
"""

from __future__ import annotations

import ast
import json
import runpy
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmcli.engine.tools import CHOICES, Tool, ToolCall, ToolRequest
from llmcli.errors import UsageError

if TYPE_CHECKING:
    from llmcli.frontends.mcp_servers import McpServers

SIMPLE_TYPES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}
RESULT_CHARS = 8000  # a result longer than this is cut: the model's context is not a log file


def read_functions(path: str) -> tuple[Tool, ...]:
    """The file's public top-level functions as tools; a function the model could not call
    correctly (a parameter without a type hint that says what to send) is refused by name."""
    where = f"--functions {path}"
    from llmcli.reading import SCHEMA_BYTES, read_text

    source = read_text(path, SCHEMA_BYTES, where)
    try:
        module = ast.parse(source, filename=path)
    except (SyntaxError, RecursionError, MemoryError) as error:
        raise UsageError(f"{where}: not Python ({type(error).__name__}: {error})") from None
    tools = [
        _tool(node, where)
        for node in module.body
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")
    ]
    if not tools:
        raise UsageError(
            f"{where}: no public top-level functions to offer (names starting with _ are private)"
        )
    return tuple(tools)


def _tool(node: ast.FunctionDef, where: str) -> Tool:
    arguments = node.args
    if arguments.vararg or arguments.kwarg or arguments.posonlyargs:
        raise UsageError(f"{where}: {node.name}() takes *args, **kwargs or positional-only parameters")
    properties: dict[str, Any] = {}
    required: list[str] = []
    positional = arguments.args
    defaults = [None] * (len(positional) - len(arguments.defaults)) + list(arguments.defaults)
    pairs = [
        *zip(positional, defaults, strict=True),
        *zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True),
    ]
    doc = ast.get_docstring(node) or ""
    described = _parameter_docs(doc)
    for argument, default in pairs:
        if argument.annotation is None:
            raise UsageError(
                f"{where}: {node.name}({argument.arg}) needs a type hint to be offered as a tool"
            )
        schema = _schema(argument.annotation, f"{where}: {node.name}({argument.arg})")
        if argument.arg in described:
            schema["description"] = described[argument.arg]
        properties[argument.arg] = schema
        if default is None:
            required.append(argument.arg)
    parameters = {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }
    summary = doc.split("\n\n")[0].strip()
    return Tool(node.name, summary, parameters)


def _schema(annotation: ast.expr, where: str) -> dict[str, Any]:
    """A type hint as a JSON schema: str, int, float, bool, list[X], dict, Literal[...],
    X | None and Optional[X]."""
    text = ast.unparse(annotation)
    if text in SIMPLE_TYPES:
        return {"type": SIMPLE_TYPES[text]}
    if text in ("dict", "dict[str, Any]", "dict[str, str]"):
        return {"type": "object"}
    if text == "list":
        return {"type": "array"}
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return {"anyOf": [_schema(annotation.left, where), _schema(annotation.right, where)]}
    if isinstance(annotation, ast.Constant) and annotation.value is None:
        return {"type": "null"}
    if isinstance(annotation, ast.Subscript):
        outer = ast.unparse(annotation.value)
        inner = annotation.slice
        if outer in ("list", "List"):
            return {"type": "array", "items": _schema(inner, where)}
        if outer in ("Optional", "typing.Optional"):
            return {"anyOf": [_schema(inner, where), {"type": "null"}]}
        if outer in ("Literal", "typing.Literal"):
            values = inner.elts if isinstance(inner, ast.Tuple) else [inner]
            if all(isinstance(value, ast.Constant) for value in values):
                return {"enum": [value.value for value in values]}  # type: ignore[attr-defined]
    raise UsageError(
        f"{where}: the type hint {text} has no JSON schema here "
        "(use str, int, float, bool, list, dict or Literal)"
    )


def _parameter_docs(doc: str) -> dict[str, str]:
    """Google-style "Args:" lines (`name: what it is`) as parameter descriptions."""
    described: dict[str, str] = {}
    inside = False
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped in ("Args:", "Arguments:", "Parameters:"):
            inside = True
            continue
        if inside and not stripped:
            break
        if inside and ":" in stripped:
            name, _, text = stripped.partition(":")
            described[name.split("(")[0].strip()] = text.strip()
    return described


@dataclass
class Functions:
    """The offered functions (a file's, and the tools of --mcp servers), and who may run them:
    every call asked about, unless --yes."""

    path: str | None  # None: --mcp alone
    tools: tuple[Tool, ...]  # the file's
    run_all: bool = False  # --yes
    first_choice: str = "auto"  # --tool-choice: the first reply of each exchange; later ones auto
    always: set[str] = field(default_factory=set)  # functions approved with "a", this session
    servers: McpServers | None = None  # --mcp: their tools, as long as each server runs
    _module: dict[str, Any] | None = None

    @property
    def offered(self) -> tuple[Tool, ...]:
        """What the replies may call now: a server gone takes its tools with it."""
        return self.tools + (self.servers.tools if self.servers else ())

    @property
    def failed(self) -> bool:
        """A server that did not start or stopped (said already): a scripted chat exits 1."""
        return self.servers is not None and self.servers.failed

    def request(self, round_: int, last: bool) -> ToolRequest | None:
        """What the `round_`th reply of an exchange may do: the last may call nothing, so that a
        model that keeps calling gets to answer. None once no tool is left to offer."""
        offered = self.offered
        if not offered:
            return None
        choice = "none" if last else self.first_choice if round_ == 0 else "auto"
        if choice not in CHOICES and not self.offers(choice):  # its server is gone
            choice = "auto"
        return ToolRequest(offered, choice)

    def check_choice(self) -> None:
        """--tool-choice naming a tool, once the --mcp servers listed theirs."""
        choice = self.first_choice
        if choice not in CHOICES and not self.offers(choice):
            raise UsageError(f"--tool-choice names {choice!r}, which is not among the tools offered")

    def approved_without_asking(self, call: ToolCall) -> bool:
        return self.run_all or call.name in self.always

    def offers(self, name: str) -> bool:
        """Whether a reply's call names one of the functions sent as tools (and so may be asked
        about at all): anything else in the file, or not in it, is an unknown tool."""
        return any(tool.name == name for tool in self.offered)

    def refusal(self, name: str) -> str:
        """What the model reads about a call to a name it was not offered."""
        offered = ", ".join(tool.name for tool in self.offered)
        return f"error: {name} is not one of the functions offered ({offered}); it was not run"

    def run(self, call: ToolCall) -> str:
        """Run an approved call; its result as the model reads it (an exception's text too)."""
        if not self.offers(call.name):  # checked before the file runs: an unknown name runs nothing
            return self.refusal(call.name)
        if self.servers is not None and self.servers.holds(call.name):
            try:
                arguments = json.loads(call.arguments or "{}")
            except ValueError as error:
                return f"error: the arguments are not JSON ({error}); it was not run"
            if not isinstance(arguments, dict):
                return "error: the arguments are not a JSON object; it was not run"
            return cut(self.servers.call(call, arguments))
        assert self.path is not None  # the file's tools come with its path
        filename = str(Path(self.path).expanduser())
        if self._module is None:
            self._module = runpy.run_path(filename, run_name="llmcli_functions")
        function = self._module.get(call.name)
        if not _defined_here(function, call.name, filename):
            return (
                f"error: {call.name} in {self.path} is no longer the plain function the file "
                "defines (rebound or wrapped when the file ran); it was not run"
            )
        try:
            result = function(**json.loads(call.arguments))
        except Exception as error:  # the model reads what went wrong, and the chat goes on
            return f"error: {type(error).__name__}: {error}"
        return cut(result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str))


def cut(text: str) -> str:
    """A result as the model reads it, whichever runs the call (the file, an --mcp server)."""
    return text if len(text) <= RESULT_CHARS else text[:RESULT_CHARS] + " …(cut)"


def _defined_here(function: Any, name: str, filename: str) -> bool:
    """The file's own top-level `def name`, as it stands once the file ran: the tools were read
    from its source, and a later `name = system` or `name = lambda ...` must not stand in for
    it. A plain function (not a class, builtin or other callable) whose code is the file's."""
    return (
        isinstance(function, types.FunctionType)
        and function.__qualname__ == name
        and function.__code__.co_filename == filename
    )


def describe_call(call: ToolCall) -> str:
    """get_weather(city="Paris", unit="celsius"): a call as a person reads it."""
    try:
        arguments = json.loads(call.arguments)
        shown = ", ".join(
            f"{name}={json.dumps(value, ensure_ascii=False)}" for name, value in arguments.items()
        )
    except (ValueError, AttributeError):
        shown = call.arguments
    return f"{call.name}({shown})"
