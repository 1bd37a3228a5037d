"""Model spec → loaded model, with the user told what is happening. Shared by every front end."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from llmcli.config.settings import LoadSettings
from llmcli.frontends import terminal

if TYPE_CHECKING:
    from llmcli.engine.loop import Engine
    from llmcli.models.load import LoadedModel


def load_with_feedback(model_spec: str | None, settings: LoadSettings) -> LoadedModel:
    from llmcli.models.quant import bitsandbytes_only, gguf_refusal
    from llmcli.models.resolve import default_model_spec, is_gguf_spec, resolve_model

    model_spec = model_spec or default_model_spec()
    if bitsandbytes_only(settings.quant, settings.engine) and is_gguf_spec(model_spec):
        raise gguf_refusal(settings.quant)  # before a conversion that may take a minute

    def announce_conversion(path: Path) -> None:
        terminal.note(f"Converting {path.name} once into llmcli's cache (later loads are fast)…")

    # No spinner while resolving: a download or a GGUF conversion shows its own progress bar.
    resolved = resolve_model(model_spec, allow_pickle=settings.allow_pickle, on_convert=announce_conversion)
    with terminal.status(f"Loading {resolved.name}…"):
        from llmcli.models.load import load_model

        loaded = load_model(resolved, settings)
    for note in loaded.notes:
        terminal.note(note)
    return loaded


def engine_with_feedback(loaded: LoadedModel) -> Engine:
    """The loaded model's engine; a decode step to capture as a CUDA graph is captured now."""
    from llmcli.engine.loop import Engine

    engine = Engine.for_loaded(loaded)
    if engine.backend.captures_graphs:
        with terminal.status("Capturing the decode step as a CUDA graph (once per process)…"):
            seconds = engine.warm_up()
        if seconds > 1:  # worth a line only when it is noticeable
            terminal.note(f"Decode step captured in {seconds:.1f} s.")
    return engine
