"""How a chat shows itself: rich on a terminal, plain text or JSON lines in a pipe."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

from rich.console import Console

from llmcli.frontends import terminal

if TYPE_CHECKING:
    from llmcli.frontends.target import Outcome
from llmcli.frontends.chat_session import END_CHAT, LENGTH_CUT, STOP_ROUND, TurnReport


class TerminalView:
    """The interactive REPL: the reply streams as plain text (or live markdown), then one dim line."""

    def __init__(self, console: Console, markdown: bool = False) -> None:
        self.console = console
        self.markdown = markdown
        self._text = ""
        self._live: Any = None
        self._thinking = False  # a thinking line is open above the answer

    def tool_call(self, text: str) -> None:
        if self._text and not self._text.endswith("\n"):
            self.console.file.write("\n")
        self.console.print(f"→ {terminal.inert(text)}", style="cyan", markup=False, highlight=False)

    def approve(self, name: str) -> str | None:
        """Asked on the terminal; Ctrl-C stops this round of calls, Ctrl-D ends the chat (as at
        the chat's own prompt)."""
        from prompt_toolkit import prompt

        while True:
            try:
                answer = prompt(f"Run {name}? [y]es / [n]o / [a]lways this session: ").strip().lower()
            except KeyboardInterrupt:
                return STOP_ROUND
            except EOFError:
                return END_CHAT
            if answer[:1] in ("y", "n", "a"):
                return answer[:1]

    def tool_result(self, text: str) -> None:
        self.console.print(f"  {text}", style="dim", markup=False, highlight=False)

    def reply_start(self) -> None:
        self._text = ""
        self._thinking = False
        if self.markdown:
            from rich.live import Live
            from rich.markdown import Markdown

            self._live = Live(
                Markdown(""), console=self.console, refresh_per_second=8, vertical_overflow="visible"
            )
            self._live.start()

    def reasoning_piece(self, text: str) -> None:
        """Thinking streams dimmed, above the answer (markdown renders the answer alone)."""
        self.console.print(terminal.inert(text), style="dim", markup=False, highlight=False, end="")
        self._thinking = True

    def reply_piece(self, text: str) -> None:
        if self._thinking:
            self.console.print("")  # the thinking's last line ends before the answer
            self._thinking = False
        text = terminal.inert(text)
        self._text += text
        if self._live is not None:
            from rich.markdown import Markdown

            self._live.update(Markdown(self._text))
        else:
            self.console.file.write(text)
            self.console.file.flush()

    def reply_end(self, outcome: Outcome, turn: TurnReport) -> None:
        if self._thinking:
            self.console.print("")
            self._thinking = False
        if self._live is not None:
            self._live.stop()
            self._live = None
        elif self._text and not self._text.endswith("\n"):
            self.console.file.write("\n")
        self.console.print(turn.line(), style="dim", markup=False, highlight=False)

    def info(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False)

    def notice(self, text: str) -> None:
        self.console.print(text, style="yellow", markup=False, highlight=False)

    def error(self, text: str) -> None:
        self.console.print(f"error: {text}", style="bold red", markup=False, highlight=False)


class PlainView:
    """Scripted chat: each reply on stdout, followed by a newline; everything else on stderr."""

    def tool_call(self, text: str) -> None:
        terminal.note(f"→ {terminal.inert(text)}")

    def approve(self, name: str) -> str | None:
        return None  # stdin holds the messages: nobody can be asked (--yes runs every call)

    def tool_result(self, text: str) -> None:
        terminal.note(f"  {text}")

    def reply_start(self) -> None:
        self._thinking = terminal.Thinking(shown=True)

    def reasoning_piece(self, text: str) -> None:
        self._thinking.write(text)  # stderr: stdout carries the replies only

    def reply_piece(self, text: str) -> None:
        self._thinking.end()
        sys.stdout.write(terminal.inert(text) if terminal.stdout_is_terminal() else text)
        sys.stdout.flush()

    def reply_end(self, outcome: Outcome, turn: TurnReport) -> None:
        self._thinking.end()
        sys.stdout.write("\n")
        sys.stdout.flush()
        if outcome.finish_reason == "length":  # said on stderr: stdout carries the replies only
            terminal.note(f"(the reply above was {LENGTH_CUT})")

    def info(self, text: str) -> None:
        terminal.note(text)

    def notice(self, text: str) -> None:
        terminal.note(text)

    def error(self, text: str) -> None:
        terminal.error(text)


class JsonView(PlainView):
    """Scripted chat with --json: one object per reply on stdout (its calls and their results
    in it), nothing else there."""

    def tool_call(self, text: str) -> None:
        pass

    def tool_result(self, text: str) -> None:
        pass

    def reasoning_piece(self, text: str) -> None:
        pass

    def reply_piece(self, text: str) -> None:
        pass

    def reply_end(self, outcome: Outcome, turn: TurnReport) -> None:
        sys.stdout.write(json.dumps(turn.as_dict(), ensure_ascii=False) + "\n")
        sys.stdout.flush()
