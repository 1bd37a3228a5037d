"""`llmcli chat`: the interactive REPL on a terminal, line-per-message chat in a pipe."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prompt_toolkit import PromptSession
from prompt_toolkit.completion import CompleteEvent, Completer, Completion
from prompt_toolkit.document import Document
from prompt_toolkit.history import FileHistory, History, InMemoryHistory
from prompt_toolkit.key_binding import KeyBindings, KeyPressEvent
from rich.console import Console

from llmcli.config.paths import state_dir
from llmcli.config.settings import LoadSettings, RemoteSettings, SamplingSettings, SpeculativeSettings
from llmcli.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK
from llmcli.frontends import terminal
from llmcli.frontends.chat_session import COMMANDS, ChatSession, ChatView
from llmcli.frontends.chat_views import JsonView, PlainView, TerminalView
from llmcli.frontends.opening import open_target

if TYPE_CHECKING:
    from llmcli.engine.structured import OutputFormat
    from llmcli.frontends.functions import Functions
    from llmcli.frontends.mcp_servers import McpPlan

PROMPT = ">>> "
CONTINUATION = "... "
BLOCK_QUOTE = '"""'


@dataclass(frozen=True)
class ChatRequest:
    model: str | None
    system: str | None
    markdown: bool
    json: bool
    sampling: SamplingSettings
    load: LoadSettings
    remote: RemoteSettings = field(default_factory=RemoteSettings)
    speculative: SpeculativeSettings = field(default_factory=SpeculativeSettings)
    output: OutputFormat | None = None  # --format / --json-schema: every reply JSON (/format changes it)
    think: str | None = None  # show, hide, off; None: show on a terminal, hide in a pipe
    think_budget: int | None = None
    functions: Functions | None = None  # --functions: read already (not run); with --mcp too
    mcp: McpPlan | None = None  # --mcp: servers started when the chat starts, stopped when it ends


def run(request: ChatRequest) -> int:
    interactive = terminal.stdin_is_terminal()
    console = Console(highlight=False)
    view: ChatView
    if interactive:
        view = TerminalView(console, markdown=request.markdown)
    else:
        view = JsonView() if request.json else PlainView()
    if interactive:  # keys typed ahead, from the load to the end of the chat, reach the prompt
        with terminal.keeping_type_ahead():
            return _run(request, view, interactive, console)
    return _run(request, view, interactive, console)


def _run(request: ChatRequest, view: ChatView, interactive: bool, console: Console) -> int:
    functions, plan = request.functions, request.mcp
    if plan is None or functions is None:
        return _chat(request, view, interactive, console)
    from llmcli.frontends.mcp_servers import McpServers, count_line

    taken = [tool.name for tool in functions.tools]
    # Started before the model loads, stopped when the chat ends, however it ends.
    with McpServers.start(plan.commands, plan.start_timeout, plan.call_timeout, view.error, taken) as servers:
        functions.servers = servers
        if servers.tools:
            view.info(count_line(servers))
        functions.check_choice()  # a --tool-choice naming a server's tool: known only now
        return _chat(request, view, interactive, console)


def _chat(request: ChatRequest, view: ChatView, interactive: bool, console: Console) -> int:
    # A thinking budget runs on the loaded model itself: the OpenAI API has no field for it.
    in_process = request.think_budget is not None
    target = open_target(request.model, request.load, request.remote, request.speculative, in_process)
    session = ChatSession(
        target,
        view,
        sampling=request.sampling,
        system=request.system,
        speculative=request.speculative.method,
        output=request.output,
        think=request.think or ("show" if interactive else "hide"),
        think_budget=request.think_budget,
        functions=request.functions,
    )
    if interactive:
        return run_interactive(session, console)
    from llmcli.reading import PROMPT_BYTES, bounded_lines

    return run_scripted(session, bounded_lines(sys.stdin.buffer, PROMPT_BYTES))


def run_scripted(session: ChatSession, lines: Iterable[bytes | None]) -> int:
    """One user message (or slash command) per line (None: a line over the size limit);
    replies in order. Exit 1 if anything failed."""
    try:
        for number, raw in enumerate(lines, start=1):
            if raw is None:
                session.failed = True
                session.view.error(f"line {number} of stdin is over the size limit for a message; skipped")
                continue
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError:
                session.failed = True
                session.view.error(f"line {number} of stdin is not valid UTF-8; skipped")
                continue
            if not line.strip():
                continue
            if line.lstrip().startswith("/"):
                if not session.command(line.strip()):
                    break
                continue
            report = session.turn(line)
            if report is not None and report.finish_reason == "interrupted":
                return EXIT_INTERRUPTED
    except BrokenPipeError:
        terminal.detach_stdout()
        return EXIT_OK
    return EXIT_FAILURE if session.failed else EXIT_OK


def run_interactive(session: ChatSession, console: Console) -> int:
    # Cursor position requests let prompt-toolkit size menus below the prompt; a terminal that
    # answers late, or a pseudo-terminal that never does, gets a "WARNING: your terminal doesn't
    # support cursor position requests" in the middle of the chat. The REPL needs none.
    os.environ.setdefault("PROMPT_TOOLKIT_NO_CPR", "1")
    prompt = PromptSession(
        history=_history(),
        key_bindings=_key_bindings(),
        completer=SlashCompleter(),
        complete_while_typing=False,
        enable_open_in_editor=False,
    )
    continuation = PromptSession(history=InMemoryHistory(), key_bindings=_key_bindings())
    target = session.target
    console.print(
        f"llmcli chat · {target.name} · {target.where} · {target.dtype_name} · "
        f"context {session.context_length} tokens · /help for commands, Ctrl-D to leave",
        style="dim",
        markup=False,
    )
    while True:
        try:
            text = read_message(prompt, continuation)
        except KeyboardInterrupt:
            continue  # Ctrl-C at the prompt clears the line
        except EOFError:
            return EXIT_OK
        if not text.strip():
            continue
        try:
            if text.lstrip().startswith("/") and "\n" not in text.strip():
                if not session.command(text.strip()):
                    return EXIT_OK
            else:
                session.turn(text)
            if session.ended:  # Ctrl-D at a call's approval
                return EXIT_OK
        except KeyboardInterrupt:
            continue  # landed between two steps of printing: nothing to undo


def _history() -> History:
    """The prompt's history file, or, where it cannot be written (a read-only file system, a
    state folder under a file), the chat's own memory: a chat never fails over its history."""
    try:
        path = state_dir() / "history"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8"):
            pass
    except OSError as error:
        terminal.note(f"History is kept in memory only: {_why(error)}.")
        return InMemoryHistory()
    return KeptFileHistory(str(path))


class KeptFileHistory(FileHistory):
    """A history file that may stop being writable mid-chat: say so once, keep going in memory
    (prompt-toolkit's own FileHistory turns each such Enter into a traceback)."""

    _failed = False

    def load_history_strings(self) -> Iterable[str]:
        """prompt-toolkit reads the file in a background thread once the prompt is up: a file
        gone unreadable by then (replaced, its permissions changed) is a history that starts
        empty, not a prompt whose loader died. Writing to it says what is wrong, once."""
        try:
            return super().load_history_strings()
        except OSError:
            return []

    def store_string(self, string: str) -> None:
        if self._failed:
            return
        try:
            super().store_string(string)
        except OSError as error:
            self._failed = True
            sys.stderr.write(f"llmcli: history is kept in memory only from now: {_why(error)}\n")


def _why(error: OSError) -> str:
    where = error.filename or "the history file"
    return f"cannot write {where} ({error.strerror or error})"


def read_message(prompt: PromptSession[str], continuation: PromptSession[str]) -> str:
    """One message: a line (Esc+Enter inserts newlines), or a block between \"\"\" lines."""
    first = prompt.prompt(PROMPT)
    stripped = first.strip()
    if not stripped.startswith(BLOCK_QUOTE):
        return first
    body = stripped[len(BLOCK_QUOTE) :]
    if body.endswith(BLOCK_QUOTE):
        return body[: -len(BLOCK_QUOTE)].strip("\n")
    lines = [body] if body else []
    while True:
        line = continuation.prompt(CONTINUATION)
        if line.rstrip().endswith(BLOCK_QUOTE):
            lines.append(line.rstrip()[: -len(BLOCK_QUOTE)])
            return "\n".join(lines).strip("\n")
        lines.append(line)


def _key_bindings() -> KeyBindings:
    bindings = KeyBindings()

    @bindings.add("escape", "enter")
    def _newline(event: KeyPressEvent) -> None:
        event.current_buffer.insert_text("\n")

    return bindings


class SlashCompleter(Completer):
    """Tab completes slash commands; nothing else is completed."""

    def get_completions(self, document: Document, complete_event: CompleteEvent) -> Iterator[Completion]:
        text = document.text_before_cursor
        if text.startswith("/") and " " not in text:
            for name in COMMANDS:
                if name.startswith(text):
                    yield Completion(name, start_position=-len(text))
