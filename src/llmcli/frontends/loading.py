"""Model spec → loaded model, with the user told what is happening. Shared by every front end."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from llmcli.frontends import terminal
from llmcli.settings import LoadSettings

if TYPE_CHECKING:
    from llmcli.load import LoadedModel


def load_with_feedback(model_spec: str | None, settings: LoadSettings) -> LoadedModel:
    from llmcli.quant import gguf_refusal
    from llmcli.resolve import default_model_spec, is_gguf_spec, resolve_model

    model_spec = model_spec or default_model_spec()
    if settings.quant != "none" and is_gguf_spec(model_spec):
        raise gguf_refusal(settings.quant)  # before a conversion that may take a minute

    def announce_conversion(path: Path) -> None:
        terminal.note(f"Converting {path.name} once into llmcli's cache (later loads are fast)…")

    # No spinner while resolving: a download or a GGUF conversion shows its own progress bar.
    resolved = resolve_model(model_spec, allow_pickle=settings.allow_pickle, on_convert=announce_conversion)
    with terminal.status(f"Loading {resolved.name}…"):
        from llmcli.load import load_model

        loaded = load_model(resolved, settings)
    for note in loaded.notes:
        terminal.note(note)
    return loaded
