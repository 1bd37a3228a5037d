"""A tiny stdio MCP server for the `chat --mcp` tests, written with the SDK's own server.

Tools: add, echo, greet, and two that misbehave on purpose (hang: never answers; die: the
process exits mid-call). `--hang-at-start` never answers the handshake; `--exit-at-start` exits
before it (both before the SDK is imported: at once, however busy the machine). Each process
appends its pid to $LLMCLI_TEST_MCP_PIDS (when set), so a test can see that closing the chat left
none running; it writes lines on stderr, which must not reach the chat's.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Literal


def _start() -> None:
    if os.environ.get("LLMCLI_TEST_MCP_PIDS"):
        with open(os.environ["LLMCLI_TEST_MCP_PIDS"], "a") as pids:
            pids.write(f"{os.getpid()}\n")
    print("echo server: started", file=sys.stderr, flush=True)
    if "--exit-at-start" in sys.argv:
        sys.exit(5)
    if "--hang-at-start" in sys.argv:
        threading.Event().wait()


if __name__ == "__main__":
    _start()

from mcp.server.mcpserver import MCPServer  # noqa: E402

server = MCPServer("echo")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def echo(text: str) -> str:
    """Say the text back."""
    print(f"echo server: echoing {text!r}", file=sys.stderr, flush=True)
    return f"echo: {text}"


@server.tool()
def greet(who: Literal["Ada", "Bob"]) -> str:
    """Greet someone (a tiny model fills a choice of names in a few tokens; any text, it may not end)."""
    print(f"echo server: greeting {who}", file=sys.stderr, flush=True)
    return f"hello {who}"


@server.tool()
def hang() -> str:
    """Never answers (saying on stderr that the call arrived: a test waits for it)."""
    print("echo server: hanging", file=sys.stderr, flush=True)
    threading.Event().wait()
    return "never"


@server.tool()
def die() -> str:
    """The server exits mid-call."""
    os._exit(3)


if __name__ == "__main__":
    server.run()
