"""Model spec → loaded model, with the user told what is happening. Shared by every front end."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from llmcli.config.settings import LoadSettings, SpeculativeSettings
from llmcli.errors import UsageError
from llmcli.frontends import terminal

if TYPE_CHECKING:
    from llmcli.engine.loop import Engine
    from llmcli.engine.speculative import Speculation
    from llmcli.engine.speculative.drafters import MtpDrafter
    from llmcli.models.load import LoadedModel


def announce_conversion(path: Path, read_in_place: bool) -> None:
    if read_in_place:  # its tokenizer and settings: a few seconds, once
        terminal.note(f"Reading {path.name}'s tokenizer and settings once into llmcli's cache…")
    else:
        terminal.note(f"Converting {path.name} once into llmcli's cache (later loads are fast)…")


def load_with_feedback(
    model_spec: str | None, settings: LoadSettings, lean: bool = False, mtp: bool = False
) -> LoadedModel:
    """`lean`: the caller needs only what the native engine runs (no transformers model: no
    beam search), so a Llama-family folder may load without transformers. `mtp`: with the
    model's MTP head (--speculative mtp), refused in one line before any weight is read where
    the checkpoint has none."""
    from llmcli.models.busy_cores import open_window

    open_window()  # how busy the machine is, measured over the load rather than slept through
    from llmcli.models.cpu_kernels import check_choice
    from llmcli.models.quant import bitsandbytes_only, gguf_refusal
    from llmcli.models.resolve import default_model_spec, expand_default_alias, is_gguf_spec, resolve_model

    check_choice()  # a bad LLMCLI_CPU_KERNELS, before a model is looked for
    model_spec = expand_default_alias(model_spec) or default_model_spec()
    if bitsandbytes_only(settings.quant, settings.engine) and is_gguf_spec(model_spec):
        raise gguf_refusal(settings.quant)  # before a conversion that may take a minute

    # No spinner while resolving: a download or a GGUF conversion shows its own progress bar.
    resolved = resolve_model(model_spec, allow_pickle=settings.allow_pickle, on_convert=announce_conversion)
    if mtp:
        from llmcli.models.build_native import require_mtp_head

        require_mtp_head(resolved, settings, lean)
    with terminal.status(f"Loading {resolved.name}…"):
        from llmcli.models.load import load_model

        loaded = load_model(resolved, settings, lean=lean, mtp=mtp)
    from llmcli.models.fingerprint import checkpoint_fingerprint

    loaded.fingerprint = checkpoint_fingerprint(resolved)
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


def speculation_with_feedback(
    loaded: LoadedModel,
    model_spec: str | None,
    speculative: SpeculativeSettings,
    settings: LoadSettings,
    engine: Engine | None = None,
) -> Speculation | None:
    """What `engine.speculation` should be for these settings; a draft model is loaded now.
    `engine`: the one that will speculate, which the MTP head drafts beside (it reads the
    model's hidden states from that engine's passes)."""
    from llmcli.engine.speculative import Speculation
    from llmcli.engine.speculative.drafters import LookupDrafter, ModelDrafter, check_same_vocabulary
    from llmcli.engine.speculative.schedule import DraftLength

    if speculative.method == "off":
        return None
    length = DraftLength(speculative.draft_tokens)
    if speculative.method == "lookup":
        return Speculation(LookupDrafter(), length)
    if speculative.method == "mtp":
        return Speculation(_mtp_drafter(loaded, engine), length)
    draft_spec, draft_settings = _draft_source(loaded, model_spec, speculative.draft_model or "", settings)
    drafting = load_with_feedback(draft_spec, draft_settings)
    name = "self (int4)" if speculative.draft_model == "self" else drafting.name
    check_same_vocabulary(loaded.tokenizer, drafting.tokenizer, name)
    return Speculation(ModelDrafter(engine_with_feedback(drafting), name), length)


def _mtp_drafter(loaded: LoadedModel, engine: Engine | None) -> MtpDrafter:
    """The MTP head over `engine`'s passes; refused in one line where the model was loaded
    without it (a chat asked for it after a start without --speculative mtp) or runs elsewhere
    than on the native engine."""
    from llmcli.engine.native.backend import NativeBackend
    from llmcli.engine.native.mtp import MtpHead
    from llmcli.engine.speculative.drafters import MtpDrafter

    mtp = getattr(loaded.model, "mtp", None)
    if mtp is None:
        raise UsageError(
            f"{loaded.name} was loaded without its MTP head: --speculative mtp is asked for at the start",
            "start again with --speculative mtp",
        )
    if engine is None or not isinstance(engine.backend, NativeBackend):
        raise UsageError(
            "--speculative mtp drafts on the native engine, and this model runs on "
            f"{engine.name if engine is not None else 'another'}",
            "add --engine native",
        )
    return MtpDrafter(engine, MtpHead(loaded.model, engine.backend.net, engine.context_length))


def _draft_source(
    loaded: LoadedModel, model_spec: str | None, draft_model: str, settings: LoadSettings
) -> tuple[str | None, LoadSettings]:
    """The draft model's spec and load settings: a model named, or the model itself in int4."""
    if draft_model != "self":
        # A separate small model: loaded as it comes (its own quantization, if any).
        return draft_model, dataclasses.replace(settings, quant="auto")
    if loaded.quant.startswith("int4"):
        raise UsageError(
            f"--draft-model self drafts with the model's int4 copy, and the model is already {loaded.quant}",
            "load the model unquantized (--quant none) or in int8, or name a smaller draft model",
        )
    return model_spec, dataclasses.replace(settings, quant="int4", engine="auto")
