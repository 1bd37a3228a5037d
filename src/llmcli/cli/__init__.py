"""The command line: the Typer app, its sub-commands, and where errors become a line + exit code.
Nothing here imports torch or transformers at module level."""

from llmcli.cli.app import app
from llmcli.cli.entry import main

__all__ = ["app", "main"]
