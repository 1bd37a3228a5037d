"""User-facing errors: each carries one line for the user and the exit code it maps to.

They are raised anywhere below the CLI and caught exactly once, in `cli.py`, which prints
`llmcli: error: <message>` on stderr and exits with `exit_code`. Nothing else prints errors.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class LlmcliError(Exception):
    """A failure the user can act on. `hint` says what to do about it."""

    exit_code = EXIT_FAILURE

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def one_line(self) -> str:
        text = self.message if not self.hint else f"{self.message} — {self.hint}"
        # One line, whatever a lower layer put in its message.
        return " ".join(text.split())


class UsageError(LlmcliError):
    """Bad flags, values or input: the command could not have worked as given."""

    exit_code = EXIT_USAGE


class ModelNotFoundError(LlmcliError):
    """The model spec names nothing we can find locally or on the Hub."""


class NetworkError(LlmcliError):
    """The Hub was needed and could not be reached in time."""


class UnsafeWeightsError(LlmcliError):
    """Only pickled weights are available and the user did not opt in to them."""


class ModelLoadError(LlmcliError):
    """Files were found but the model or tokenizer could not be built from them."""


class NonFiniteLogits(LlmcliError):
    """The model computed NaN (or +inf) where a token's scores should be: its weights are damaged,
    or its dtype overflowed."""


class ContextOverflowError(LlmcliError):
    """The prompt does not fit in the model's context window."""


class MemoryShortage(LlmcliError):
    """A model does not fit in the memory free now: a server holding other models unloads idle
    ones and tries again (server/fleet.py)."""


class KVMemoryFull(LlmcliError):
    """A server's generations at once hold the KV memory it may use: this one cannot start now."""
