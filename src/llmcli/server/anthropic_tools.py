"""The tools of an Anthropic Messages request, as the OpenAI chat request takes them.

A custom tool (a name, a description and an input_schema) becomes a function tool. Anthropic's
server tools (web search, web fetch, code execution, tool search, an MCP toolset) run on
Anthropic's side: a local server cannot run them, so they are refused in one line naming their
type, or, for clients that always send them, left out with a warning (hosted_tools.py: the
rule every protocol shares). Anthropic's
client tools declared by type alone (bash_…, text_editor_…, computer_…, memory_…) send no
schema to constrain a call with: refused, with a pointer to declaring them as custom tools.
"""

from __future__ import annotations

from typing import Any

from llmcli.errors import LlmcliError
from llmcli.server.hosted_tools import HostedTools

# Their type names carry a date (web_search_20250305): a prefix names each family, present and future.
HOSTED_TOOL_PREFIXES = ("web_search_", "web_fetch_", "code_execution_", "tool_search_tool_", "mcp_toolset")


class ToolRefused(LlmcliError):
    """A tool this server cannot offer: a 400 in Anthropic's shape (the route's error class)."""


def hosted_tool_type(tool: Any) -> str | None:
    """The server tool's type when `tool` is one of Anthropic's hosted tools, else None."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    return kind if isinstance(kind, str) and kind.startswith(HOSTED_TOOL_PREFIXES) else None


def screen_hosted_tools(tools: Any, hosted: HostedTools) -> Any:
    """`tools` without Anthropic's hosted tools: each left out (a warning on stderr, once per
    type) where the server drops them; else the first refused in one line naming its type. A client tool
    declared by its type alone is refused either way (it is no hosted tool). Run before the body
    is validated, as these tools' fields (max_uses, allowed_domains, …) are their own."""
    if not isinstance(tools, list):
        return tools  # not a list: the body's validation says so
    kept = []
    for position, tool in enumerate(tools):
        kind = hosted_tool_type(tool)
        if kind is None:
            _check_custom(tool, position)
            kept.append(tool)
        else:
            refusal = f"tools.{position}: {kind} is a server tool that runs on Anthropic's side"
            hosted.left_out(kind, f"{refusal}; this local server cannot run it")
    return kept


def _check_custom(tool: Any, position: int) -> None:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind not in (None, "custom"):
        raise ToolRefused(
            f"tools.{position}: tool type {kind!r} is not supported here: "
            "declare it as a custom tool with a name and an input_schema"
        )


def function_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A custom tool (screened and validated already) as an OpenAI function tool."""
    function = {
        "name": tool["name"],
        "description": tool.get("description", ""),
        "parameters": tool["input_schema"],  # a string-keys propertyNames left out by the tools layer
    }
    return {"type": "function", "function": function}
