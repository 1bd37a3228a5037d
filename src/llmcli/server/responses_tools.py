"""A Responses request's `tools` as the chat tools the model is offered.

`function` tools are offered as they are; a `custom` one (Codex's `apply_patch`, its input held to
a Lark grammar: engine/tools/freeform.py) in Chat Completions' shape, which
engine/tools/offered.py checks. A `namespace` groups functions under a name (Codex CLI
sends its sub-agent and MCP tools so): each is offered by its own name, and a call to it comes
back as a function_call carrying `namespace`, as OpenAI's API answers one. Hosted tools are run
by OpenAI's servers, and a local server has nothing to run them with: refused by name, or, with
`llmcli serve --drop-hosted-tools` (for clients that always send them, as Codex sends
`web_search`), left out, and the server says so once per tool type on its stderr
(hosted_tools.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmcli.errors import LlmcliError
from llmcli.server.hosted_tools import HostedTools

# The tool types OpenAI's servers run themselves.
HOSTED = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "file_search",
        "computer_use",
        "computer_use_preview",
        "code_interpreter",
        "image_generation",
        "mcp",  # a remote MCP server, called by OpenAI's servers
    }
)


class ToolsError(LlmcliError):
    """A tool this server cannot offer: a 400."""


@dataclass
class OfferedTools:
    """The chat tools, and the namespace each namespaced function's calls come back under."""

    chat: list[dict[str, Any]] = field(default_factory=list)
    namespace_of: dict[str, str] = field(default_factory=dict)

    def add(self, tool: dict[str, Any], where: str, namespace: str | None = None) -> None:
        name = tool.get("name")
        if any(offered[offered["type"]]["name"] == name for offered in self.chat):
            raise ToolsError(f"{where}: a second tool named {name!r} (the model calls tools by name)")
        if tool.get("type") == "custom":
            self.chat.append(_custom_tool(tool))
            return
        function = {
            "name": name,
            "description": tool.get("description", ""),
            "parameters": tool.get("parameters"),
        }
        self.chat.append({"type": "function", "function": function})
        if namespace is not None:
            self.namespace_of[name] = namespace


def offered_tools(tools: list[Any] | None, hosted: HostedTools) -> OfferedTools:
    offered = OfferedTools()
    for index, tool in enumerate(tools or []):
        kind = tool.get("type") if isinstance(tool, dict) else tool
        if kind in ("function", "custom"):
            offered.add(tool, f"tools[{index}]")
        elif kind == "namespace":
            _add_namespace(offered, tool, index)
        elif kind in HOSTED:
            hosted.left_out(str(kind), f"tools: {kind} is a hosted tool this local server cannot run")
        else:
            taken = "function, custom and namespace tools are"
            raise ToolsError(f"tools: {kind} tools are not supported here ({taken})")
    return offered


def _add_namespace(offered: OfferedTools, tool: dict[str, Any], index: int) -> None:
    namespace = tool.get("name")
    if not isinstance(namespace, str) or not namespace:
        raise ToolsError(f"tools[{index}]: a namespace tool has a name")
    inner = tool.get("tools")
    if not isinstance(inner, list):
        raise ToolsError(f"tools[{index}]: a namespace tool has a list of tools")
    for position, function in enumerate(inner):
        where = f"tools[{index}].tools[{position}]"
        kind = function.get("type") if isinstance(function, dict) else function
        if kind != "function":
            raise ToolsError(f"{where}: {kind} tools in a namespace are not supported here (functions are)")
        offered.add(function, where, namespace)


def _custom_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A custom tool in Chat Completions' shape, which engine/tools/offered.py checks: its
    format's grammar (`{"type": "grammar", "syntax": …, "definition": …}`) nested as there."""
    form = tool.get("format")
    if isinstance(form, dict) and form.get("type") == "grammar":
        grammar = {"syntax": form.get("syntax"), "definition": form.get("definition")}
        form = {"type": "grammar", "grammar": grammar}
    custom = {"name": tool.get("name"), "description": tool.get("description") or "", "format": form}
    return {"type": "custom", "custom": custom}
