"""What every command shares: the one place errors become a message and an exit code."""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Iterator

import typer

from llmcli.errors import EXIT_FAILURE, EXIT_INTERRUPTED, LlmcliError


@contextlib.contextmanager
def handled_errors() -> Iterator[None]:
    """The one place errors become messages and exit codes. No tracebacks, unless LLMCLI_DEBUG is set."""
    from llmcli.frontends import terminal

    try:
        yield
    except LlmcliError as error:
        terminal.error(error.one_line())
        raise typer.Exit(error.exit_code) from None
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except BrokenPipeError:  # the reader of stdout left (`| head -1`): not an error, a reason to stop
        terminal.detach_stdout()
        raise typer.Exit(0) from None
    except typer.Exit:
        raise
    except Exception as error:
        if os.environ.get("LLMCLI_DEBUG"):
            traceback.print_exc()
        terminal.error(_unexpected(error))
        raise typer.Exit(EXIT_FAILURE) from None


def _unexpected(error: Exception) -> str:
    name = type(error).__name__
    if name == "OutOfMemoryError":
        return (
            "out of memory while generating — try a shorter prompt, fewer --max-new-tokens, or --device cpu"
        )
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"unexpected {name}: {first_line} (set LLMCLI_DEBUG=1 for the traceback)"
