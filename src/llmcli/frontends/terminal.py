"""The one place that decides "terminal or pipe"; everything else asks here.

Decorations (spinners, colour) go to stderr and only when stderr is a terminal; rich already
honours NO_COLOR and TERM=dumb. Stdout carries the model's text and nothing else.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from functools import cache

from rich.console import Console
from rich.markup import escape

from llmcli.reading import escape_controls


@cache
def stderr_console() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def stderr_is_terminal() -> bool:
    return sys.stderr is not None and sys.stderr.isatty()


def stdin_is_terminal() -> bool:
    return sys.stdin is not None and sys.stdin.isatty()


def stdout_is_terminal() -> bool:
    return sys.stdout is not None and sys.stdout.isatty()


def inert(text: str) -> str:
    """A model's text as a terminal shows it: lines and tabs as they are, every other control
    character written out (ESC → \\x1b), so that no escape sequence in a reply (from a model, or
    a server's stream) sets the window's title, moves the cursor or fakes a line of llmcli's. A
    pipe gets the text as it is: only what reaches a terminal is made inert."""
    return escape_controls(text, keep="\n\t")


def detach_stdout() -> None:
    """After the reader of stdout went away (`| head`): point stdout at /dev/null, so that the
    interpreter's final flush cannot fail with a traceback."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no stdout to point anywhere
        pass
    finally:
        os.close(devnull)


@contextlib.contextmanager
def status(message: str) -> Iterator[None]:
    """A spinner on stderr while slow work runs, only when someone is watching."""
    if not stderr_is_terminal():
        yield
        return
    with stderr_console().status(message, spinner="dots"):
        yield


def note(message: str) -> None:
    """A dim informational line on stderr (terminal or not: it is never part of the output)."""
    stderr_console().print(message, style="dim", markup=False)


class Thinking:
    """A reasoning model's thinking on stderr, dimmed, as it streams (or nothing, when not
    `shown`); `end` closes its line before the answer."""

    def __init__(self, shown: bool) -> None:
        self.shown = shown
        self._open = False

    def write(self, text: str) -> None:
        if self.shown:
            console = stderr_console()
            shown = inert(text) if console.is_terminal else text
            console.print(shown, style="dim", markup=False, highlight=False, end="")
            self._open = True

    def end(self) -> None:
        if self._open:
            stderr_console().print("", markup=False)
            self._open = False


def warning(message: str) -> None:
    """Something the user should know, that stops nothing: `llmcli: warning: …` on stderr."""
    _labelled("warning", "bold yellow", message)


def error(message: str) -> None:
    _labelled("error", "bold red", message)


def _labelled(label: str, style: str, message: str) -> None:
    """`llmcli: LABEL: message` on stderr, the label coloured on a terminal (unless NO_COLOR)."""
    console = stderr_console()
    if console.is_terminal and not os.environ.get("NO_COLOR"):
        console.print(f"[{style}]llmcli: {label}:[/] {escape(message)}", markup=True, highlight=False)
    else:
        sys.stderr.write(f"llmcli: {label}: {message}\n")
        sys.stderr.flush()


@contextlib.contextmanager
def keeping_type_ahead() -> Iterator[None]:
    """For a whole interactive chat, keep what the user types between prompts for the next one,
    Ctrl-D included: while the model loads, while a reply prints, and in the instant between a
    reply's stats line and the next prompt.

    In cooked mode the line discipline echoes keys over the reply and turns Ctrl-D into an
    end-of-file that prompt-toolkit never sees. With line editing and echo off (signals stay on,
    so Ctrl-C still stops the reply) every key stays in the input queue as a byte, and the next
    prompt reads it. prompt-toolkit puts back the mode it found when each prompt ends, so the
    terminal is never in cooked mode until the chat is over; entered per reply, it was, between
    the two, for a few milliseconds. TCSANOW: switching back keeps that queue.
    """
    try:
        import termios

        fd = sys.stdin.fileno()
        saved = termios.tcgetattr(fd)
    except (ImportError, OSError, ValueError, AttributeError):  # not a terminal, or no termios
        yield
        return
    mode = termios.tcgetattr(fd)
    mode[3] &= ~(termios.ICANON | termios.ECHO)
    mode[6][termios.VMIN], mode[6][termios.VTIME] = 1, 0
    termios.tcsetattr(fd, termios.TCSANOW, mode)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)
