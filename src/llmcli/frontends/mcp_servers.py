"""`chat --mcp "COMMAND ARGS…"`: stdio MCP servers whose tools are offered beside --functions.

The SDK is async and the chat is not. One event loop runs in a background thread for as long
as the chat has servers; each server is a task there that holds its stdio connection open until
the chat closes, and a call is a coroutine submitted to that loop and waited for with a timeout.
Closing stops every server (the SDK closes its stdin, then ends its process group) and the thread.

What fails is one line and the chat goes on: a server that does not start in time or dies at
start is left out; one that dies later has its tools withdrawn, said once; a call that errs or
times out is an error the model reads. A server's own stderr goes to a log file (the terminal
carries llmcli's lines only); its path is in every line about that server.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout  # TimeoutError itself from 3.11
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmcli.engine.tools import Tool, ToolCall
from llmcli.errors import UsageError
from llmcli.frontends.wording import plural

if TYPE_CHECKING:
    from mcp.client.session import ClientSession


CLOSE_GRACE_S = 10.0  # the SDK's own shutdown: stdin closed, 2 s, SIGTERM, 2 s, SIGKILL
MARGIN_S = 5.0  # past a timeout the SDK enforces itself, before the chat stops waiting anyway


@dataclass(frozen=True)
class ServerCommand:
    """A --mcp value: as the user wrote it (for messages) and split into a program's argv."""

    text: str
    argv: tuple[str, ...]


@dataclass(frozen=True)
class McpPlan:
    """The servers a chat starts, and how long each may take: --mcp, --mcp-start-timeout and
    --mcp-timeout."""

    commands: tuple[ServerCommand, ...]
    start_timeout: float
    call_timeout: float


def read_commands(commands: Sequence[str]) -> tuple[ServerCommand, ...]:
    """Each --mcp split as a shell would (no shell runs it), its program found on PATH: what
    is wrong is a usage error, before the model loads. Refused without the SDK, in one line."""
    try:
        import mcp  # noqa: F401
    except ImportError:
        raise UsageError("--mcp needs the MCP SDK: pip install 'llmcli[mcp]'") from None
    read = []
    for text in commands:
        try:
            argv = tuple(shlex.split(text))
        except ValueError as error:
            raise UsageError(f"--mcp {_shown(text)}: {error}") from None
        if not argv:
            raise UsageError("--mcp needs a command line (the server's program and its arguments)")
        if shutil.which(argv[0]) is None:
            raise UsageError(
                f"--mcp {_shown(text)}: no program {argv[0]!r} found (not on PATH, or not executable)"
            )
        read.append(ServerCommand(text, argv))
    return tuple(read)


def log_path(command: ServerCommand, folder: Path) -> Path:
    """Where a server's stderr goes: one file per command line, appended to."""
    words = [Path(word).name for word in command.argv]
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", "-".join(words)).strip("-.")[:80] or "server"
    return folder / f"{slug}.log"


@dataclass
class _Server:
    """One server's connection, living in the loop's thread; the chat reads `tools` and `gone`."""

    command: ServerCommand
    log: Path | None  # None: the log file could not be opened, its stderr is discarded
    tools: tuple[Tool, ...] = ()
    gone: bool = False
    session: ClientSession | None = None
    # Set (from any thread, through the loop) to stop it, starting or started; `finished` once
    # its process is gone: what closing waits for.
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    finished: threading.Event = field(default_factory=threading.Event)

    @property
    def label(self) -> str:
        where = f"its stderr: {self.log}" if self.log else "its stderr is not kept"
        return f"--mcp {_shown(self.command.text)} ({where})"

    async def serve(self, ready: Future[list[Any]], start_timeout: float) -> None:
        """Start the server, list its tools (answered through `ready`), then hold the connection
        until `stop` is set. Runs as a task in the loop's thread."""
        import anyio
        from mcp.client.session import ClientSession
        from mcp.client.stdio import StdioServerParameters, stdio_client

        parameters = StdioServerParameters(
            command=self.command.argv[0],
            args=list(self.command.argv[1:]),
            env=dict(os.environ),  # the user's own command: it sees what it would in their shell
        )
        try:
            # `stop` cancels through anyio, whose shielded shutdown in the SDK then ends the
            # process (an asyncio cancel could cut that shutdown short and leave it running).
            async with anyio.create_task_group() as group:
                group.start_soon(self._cancel_on_stop, group.cancel_scope)
                with open(self.log or os.devnull, "a", encoding="utf-8") as errlog:
                    errlog.write(f"--- llmcli chat started {self.command.text} at {time.ctime()}\n")
                    errlog.flush()
                    async with (
                        stdio_client(parameters, errlog=errlog) as (read, write),
                        ClientSession(read, write) as session,
                    ):
                        with anyio.fail_after(start_timeout):
                            listed = await _list_tools(session)
                        self.session = session
                        ready.set_result(listed)
                        await anyio.sleep_forever()
        except Exception as error:  # told through `ready` at start; later, a call finds it gone
            if not ready.done():
                ready.set_exception(error)
        finally:
            self.session = None
            if not ready.done():
                ready.set_exception(RuntimeError("stopped while it started"))
            self.finished.set()

    async def _cancel_on_stop(self, scope: Any) -> None:
        await self.stop.wait()
        scope.cancel()

    async def call(self, name: str, arguments: dict[str, Any], timeout: float) -> Any:
        session = self.session
        if session is None:
            from mcp.shared.exceptions import MCPError
            from mcp_types import CONNECTION_CLOSED

            raise MCPError(CONNECTION_CLOSED, "Connection closed")
        return await session.call_tool(name, arguments, read_timeout_seconds=timeout)


async def _list_tools(session: ClientSession) -> list[Any]:
    """initialize, then tools/list page by page."""
    from mcp_types import PaginatedRequestParams

    await session.initialize()
    tools: list[Any] = []
    cursor = None
    while True:
        params = PaginatedRequestParams(cursor=cursor) if cursor else None
        page = await session.list_tools(params=params)
        tools += page.tools
        cursor = page.next_cursor
        if not cursor:
            return tools


@dataclass
class McpServers:
    """The chat's MCP servers: started together, their tools offered, calls routed by name."""

    start_timeout: float
    call_timeout: float
    report: Callable[[str], None]  # one line about a server (the view's error line)
    servers: list[_Server] = field(default_factory=list)
    failed: bool = False  # a server that did not start, or died: a scripted chat exits 1
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None

    @classmethod
    def start(
        cls,
        commands: Sequence[ServerCommand],
        start_timeout: float,
        call_timeout: float,
        report: Callable[[str], None],
        taken: Sequence[str] = (),
    ) -> McpServers:
        """Start every server at once; those that start offer their tools (a name already
        offered, by --functions or an earlier server, is refused in one line)."""
        servers = cls(start_timeout, call_timeout, report)
        loop = asyncio.new_event_loop()
        servers._loop = loop
        servers._thread = threading.Thread(target=loop.run_forever, name="llmcli-mcp", daemon=True)
        servers._thread.start()
        try:
            folder = _log_folder(report)
            _keep_sdk_logs(folder)
            readies = [servers._launch(command, folder) for command in commands]
            names = set(taken)
            for server, ready in zip(servers.servers, readies, strict=True):
                servers._admit(server, ready, names)
        except BaseException:  # Ctrl-C while they start: none is left running
            servers.close()
            raise
        return servers

    def _launch(self, command: ServerCommand, folder: Path | None) -> Future[list[Any]]:
        server = _Server(command, log_path(command, folder) if folder else None)
        self.servers.append(server)
        ready: Future[list[Any]] = Future()
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(server.serve(ready, self.start_timeout), self._loop)
        return ready

    def _admit(self, server: _Server, ready: Future[list[Any]], names: set[str]) -> None:
        from llmcli.engine.tools.offered import parse_tools

        try:
            listed = ready.result(self.start_timeout + MARGIN_S)
        except Exception as error:
            if isinstance(_leaf(error), (FutureTimeout, TimeoutError)):
                return self._lost(server, f"did not start in {self.start_timeout:g} s (--mcp-start-timeout)")
            return self._lost(server, f"did not start: {_reason(error)}")
        offered: list[Tool] = []
        clashing = [tool.name for tool in listed if tool.name in names]
        if clashing:
            self._say(
                server, f"{_its_tools(clashing)} not offered: --functions or another --mcp has the name"
            )
        for tool in listed:
            function = {
                "name": tool.name,
                "description": tool.description or "",
                # The parameters it declares, and no others unless it says so (JSON Schema's
                # default allows any: a model held to it may invent arguments the tool never reads).
                "parameters": {"additionalProperties": False, **tool.input_schema},
            }
            if tool.name in names:
                continue
            try:
                offered += parse_tools([{"type": "function", "function": function}], "its tool")
            except UsageError as error:
                self._say(server, f"not offered: {error.message}")
                continue
            names.add(tool.name)
        server.tools = tuple(offered)
        if not listed:
            self._say(server, "offers no tools")

    def _say(self, server: _Server, text: str) -> None:
        self.failed = True
        self.report(f"{server.label}: {text}")

    def _lost(self, server: _Server, why: str) -> None:
        """A server gone: its tools withdrawn, said once, its process stopped."""
        withdrawn = f"; {_its_tools([t.name for t in server.tools])} withdrawn" if server.tools else ""
        server.gone, server.tools = True, ()
        self._say(server, why + withdrawn)
        self._stop(server)

    @property
    def tools(self) -> tuple[Tool, ...]:
        return tuple(tool for server in self.servers for tool in server.tools)

    def holds(self, name: str) -> bool:
        return self._server_of(name) is not None

    def _server_of(self, name: str) -> _Server | None:
        return next((s for s in self.servers if any(t.name == name for t in s.tools)), None)

    def call(self, call: ToolCall, arguments: dict[str, Any]) -> str:
        """An approved call, sent to its server; what the model reads (an error's text too).
        Ctrl-C abandons the call (the server is told) and is raised on."""
        from mcp.shared.exceptions import MCPError
        from mcp_types import CONNECTION_CLOSED, REQUEST_TIMEOUT

        server = self._server_of(call.name)
        assert server is not None and self._loop is not None
        timeout = self.call_timeout
        future = asyncio.run_coroutine_threadsafe(server.call(call.name, arguments, timeout), self._loop)
        try:
            result = future.result(timeout + MARGIN_S)
        except KeyboardInterrupt:
            future.cancel()
            raise
        except (FutureTimeout, TimeoutError):
            future.cancel()
            return self._timed_out(server, call.name)
        except MCPError as error:
            if error.code == REQUEST_TIMEOUT:
                return self._timed_out(server, call.name)
            if error.code == CONNECTION_CLOSED:
                self._lost(server, f"stopped during {call.name}")
                return f"error: the server of {call.name} stopped; it was not run to the end"
            return f"error: {error.error.message}"
        except Exception as error:  # the connection broke in a way the SDK did not name
            self._lost(server, f"failed during {call.name}: {_reason(error)}")
            return f"error: the server of {call.name} failed: {_reason(error)}"
        return result_text(result)

    def _timed_out(self, server: _Server, name: str) -> str:
        self._say(server, f"no answer to {name} in {self.call_timeout:g} s (--mcp-timeout)")
        return f"error: {name} timed out after {self.call_timeout:g} s"

    def _stop(self, server: _Server) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(server.stop.set)

    def close(self) -> None:
        """Stop every server and the loop's thread; waits for the processes to be gone."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        for server in self.servers:
            self._stop(server)
        for server in self.servers:
            server.finished.wait(CLOSE_GRACE_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(CLOSE_GRACE_S)
        if not thread.is_alive():
            loop.close()
        self._loop = self._thread = None

    def __enter__(self) -> McpServers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def result_text(result: Any) -> str:
    """A tools/call result as the model reads it: its text; other content kinds named plainly;
    an error result marked as one (cut to length where --functions' results are: functions.cut)."""
    parts = [_content_text(item) for item in result.content]
    if not parts and result.structured_content is not None:
        import json

        parts = [json.dumps(result.structured_content, ensure_ascii=False)]
    text = "\n".join(parts)
    if result.is_error:
        text = f"error: {text or 'the tool failed'}"
    return text


def _content_text(item: Any) -> str:
    kind = getattr(item, "type", "")
    if kind == "text":
        return str(item.text)
    if kind in ("image", "audio"):
        return f"[{kind} ({item.mime_type}) returned; not shown to the model]"
    if kind == "resource_link":
        return f"[resource link: {item.uri}]"
    if kind == "resource":
        text = getattr(item.resource, "text", None)
        return text if text is not None else f"[binary resource {item.resource.uri}; not shown to the model]"
    return f"[{kind or 'unknown'} content; not shown to the model]"


def _shown(command: str) -> str:
    """A command line in a message, as the user typed it between double quotes."""
    return f'"{command}"'


def _its_tools(names: list[str]) -> str:
    return f"its tool {names[0]} is" if len(names) == 1 else f"its tools {', '.join(names)} are"


def _leaf(error: BaseException) -> BaseException:
    """An ExceptionGroup's first leaf (anyio's task groups wrap what failed); else the error."""
    while getattr(error, "exceptions", None):  # ExceptionGroup is builtin from 3.11 only
        error = error.exceptions[0]  # type: ignore[attr-defined]
    return error


def _reason(error: BaseException) -> str:
    """An exception in one line."""
    from mcp_types import CONNECTION_CLOSED

    error = _leaf(error)
    if getattr(error, "code", None) == CONNECTION_CLOSED:
        return "its connection closed (the server exited)"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def _log_folder(report: Callable[[str], None]) -> Path | None:
    from llmcli.config.paths import state_dir

    folder = state_dir() / "mcp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        report(f"the MCP servers' stderr is not kept: cannot write {folder} ({error.strerror or error})")
        return None
    return folder


def _keep_sdk_logs(folder: Path | None) -> None:
    """The SDK's own warnings (a server that writes other than JSON-RPC on its stdout logs a
    traceback) go to a file beside the servers' logs: the chat's stderr is llmcli's alone."""
    import logging

    logger = logging.getLogger("mcp")
    if logger.handlers:
        return
    try:
        handler: logging.Handler = logging.NullHandler()
        if folder:
            handler = logging.FileHandler(folder / "sdk.log")
    except OSError:
        handler = logging.NullHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False


def count_line(servers: McpServers) -> str:
    """What the chat says once they started: "MCP: 2 tools from 1 server (add, echo)"."""
    running = [s for s in servers.servers if not s.gone]
    names = ", ".join(tool.name for tool in servers.tools)
    return f"MCP: {plural(len(servers.tools), 'tool')} from {plural(len(running), 'server')}" + (
        f" ({names})" if names else ""
    )
