"""The process around the app: what `llmcli` does before and after a command runs."""

from __future__ import annotations

import os
import re
import sys
from typing import Any

import typer


def _flags_without_a_type() -> None:
    """Typer's help prints a type after every option, `<bool>` after flags too (`--version
    <bool>`), which reads as if the flag took a value: flags show none."""
    from typer.core import TyperOption

    typed = getattr(TyperOption, "display_type_rich", None)
    if typed is None:  # a typer from before that hook (its help is plain there)
        return

    def display_type_rich(self: TyperOption, ctx: Any) -> str | None:
        return None if self.is_flag else typed(self, ctx)

    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


def main() -> None:
    from llmcli.models.busy_cores import open_window

    open_window()  # a load's count of busy cores measures over the imports instead of a sleep
    _flags_without_a_type()
    if not (sys.stderr and sys.stderr.isatty()):
        # Library progress bars (downloads, GGUF dequantizing) are for people, not logs.
        os.environ.setdefault("TQDM_DISABLE", "1")
    try:
        code = run_command_line(sys.argv[1:])
    except SystemExit as leaving:  # `serve` ended by SIGTERM, among others: still through leave()
        if leaving.code is None or isinstance(leaving.code, int):
            code = leaving.code or 0
        else:  # a message, which the interpreter would have printed
            print(leaving.code, file=sys.stderr)
            code = 1
    try:
        sys.stdout.flush()  # what is still buffered, now: a reader that left is not an error
    except (BrokenPipeError, ValueError, AttributeError):
        from llmcli.frontends import terminal

        terminal.detach_stdout()
    leave(code)


def leave(code: int) -> None:
    """Exit now, without the interpreter's teardown: freeing torch's modules and a loaded model's
    objects one by one took ~1 s after the last token of a one-shot `generate` (the demo, this
    2-core CPU), and the OS frees the memory at once. What exit must still do is done first: the
    atexit handlers (file locks released, temporary folders removed, logs flushed) and a flush of
    stdout and stderr. Where the interpreter offers no way to run its handlers, the ordinary exit."""
    import atexit

    run_handlers = getattr(atexit, "_run_exitfuncs", None)
    if run_handlers is None:  # pragma: no cover - CPython has it
        sys.exit(code)
    run_handlers()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (BrokenPipeError, ValueError, OSError):
            pass  # a reader that left, or a stream already closed: nothing more can reach it
    os._exit(code)


def _stdout_is_devnull() -> bool:
    try:
        out, null = os.fstat(sys.stdout.fileno()), os.stat(os.devnull)
    except (OSError, ValueError, AttributeError):
        return False
    return (out.st_dev, out.st_ino) == (null.st_dev, null.st_ino)


def _not_utf8(args: list[str]) -> str | None:
    """What is wrong with an argument (or LLMCLI_ variable) that is not UTF-8 text, if one is.

    Python hands such bytes over as lone surrogates, which no tokenizer takes. A file name may be
    any bytes, so an argument naming a file that exists passes."""
    named = [(f"argument {number}", arg) for number, arg in enumerate(args, start=1)]
    named += [(name, value) for name, value in os.environ.items() if name.startswith("LLMCLI_")]
    for where, text in named:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            value = text.partition("=")[2] if text.startswith("--") and "=" in text else text
            if os.path.exists(value):
                continue
            byte = os.fsencode(text[error.start])[0]
            return f"{where} is not UTF-8 text (byte 0x{byte:02x} at offset {error.start}): give it as UTF-8"
    return None


def _complete_models_without_case(command: Any) -> None:
    """-m completes the names `models list` shows whatever the case typed (`SMO` → smollm2).
    Typer keeps only the completions that start with the text exactly as typed, so each -m
    option gets its completion function directly, as click calls it."""
    from click.shell_completion import CompletionItem

    from llmcli.cli.app import complete_model

    def complete(context: Any, parameter: Any, incomplete: str) -> list[CompletionItem]:
        return [CompletionItem(name) for name in complete_model(incomplete)]

    for sub in [command, *getattr(command, "commands", {}).values()]:
        for inner in [sub, *getattr(sub, "commands", {}).values()]:
            for parameter in inner.params:
                if "--model" in parameter.opts or parameter.name == "model":
                    parameter._custom_shell_complete = complete


def _did_you_mean(message: str, typed: str, names: list[str]) -> str:
    """`message`, with the names that `typed` looks like: those it begins (--temp, gen), else
    the closest few."""
    import difflib

    close = [name for name in names if name.startswith(typed) and len(typed) >= 2]
    close = close or difflib.get_close_matches(typed, names, n=3, cutoff=0.6)
    return f"{message}: did you mean {' or '.join(close[:3])}?" if close else message


def run_command_line(args: list[str]) -> int:
    """The app, with click's usage errors (a bad value, an unknown option or command, a missing
    sub-command) as one `llmcli: error:` line and exit 2, like every other error, rather than
    click's boxed usage panel."""
    try:  # typer ≥ 0.2x carries its own copy of click; older ones use click itself
        from typer._click import exceptions as click
    except ImportError:  # pragma: no cover - depends on the installed typer
        from click import exceptions as click  # type: ignore[no-redef]

    from llmcli.cli.app import app
    from llmcli.errors import EXIT_INTERRUPTED, EXIT_USAGE
    from llmcli.frontends import terminal

    undecodable = _not_utf8(args)
    if undecodable:
        terminal.error(undecodable)
        return EXIT_USAGE
    command = typer.main.get_command(app)
    _complete_models_without_case(command)
    quiet_before = _stdout_is_devnull()
    try:
        code = command.main(args=args, prog_name="llmcli", standalone_mode=False)
    except click.UsageError as error:
        context = error.ctx
        path = context.command_path if context else "llmcli"
        commands = getattr(context.command, "commands", None) if context else None
        message = error.format_message().rstrip(".")
        if commands and message == "Missing command":
            message = f"{path} needs a command ({', '.join(commands)})"
        elif isinstance(error, click.NoSuchOption) and context is not None:
            offered = [
                name for param in context.command.params for name in (*param.opts, *param.secondary_opts)
            ]
            message = _did_you_mean(f"no such option {error.option_name}", error.option_name, offered)
        elif commands and (unknown := re.fullmatch(r"No such command '(.+?)'(\. Did you mean .*)?", message)):
            message = _did_you_mean(f"no such command {unknown.group(1)!r}", unknown.group(1), list(commands))
        terminal.error(f"{message} — see `{path} --help`")
        return EXIT_USAGE
    except typer.Abort:  # Ctrl-C where click itself was waiting (a confirmation prompt)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # output to a reader that left (`llmcli … | head -1`)
        terminal.detach_stdout()
        return 0
    except SystemExit as leaving:
        # A closed pipe (`llmcli … | head -1`) is answered with exit 1 by click (stdout wrapped
        # in its PacifyFlushWrapper) and by rich (stdout pointed at /dev/null): a reader that
        # left is not an error here, as for generate.
        pacified = type(sys.stdout).__name__ == "PacifyFlushWrapper"
        if leaving.code == 1 and (pacified or (not quiet_before and _stdout_is_devnull())):
            terminal.detach_stdout()
            return 0
        raise leaving
    return code if isinstance(code, int) else 0
