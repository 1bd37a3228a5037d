"""Which backend runs a loaded model: --engine, and what --fast means for each.

auto picks the native engine wherever it can run the model (the Llama family, unquantized, on
one device) and transformers elsewhere. On CUDA the native engine replays its decode step as
CUDA graphs unless --no-fast; transformers compiles only when --fast asks (a 20–45 s wait that
buys nothing over the native path).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmcli.errors import LlmcliError

if TYPE_CHECKING:
    from llmcli.engine.backend import Backend
    from llmcli.models.load import LoadedModel


def runs_natively(loaded: LoadedModel) -> bool:
    """Whether the native engine runs this model (--engine, and what it supports); a clear
    error where it was asked for and cannot."""
    if loaded.engine == "transformers":
        return False
    from llmcli.engine.native.families import NotSupported, check_supported

    try:
        check_supported(loaded.model, loaded.context_length)
    except NotSupported as why:
        if hasattr(loaded.model, "architecture"):
            # Lean-loaded (models/lean_model.py): no transformers code to fall back on. The
            # lean loader takes only what the native engine runs, so this is not reached.
            raise LlmcliError(
                f"the native engine cannot run {loaded.name}: {why}",
                "load it with --engine transformers",
            ) from None
        if loaded.engine == "native":
            raise LlmcliError(
                f"--engine native cannot run {loaded.name}: {why}",
                "use --engine auto or --engine transformers",
            ) from None
        return False
    return True


def backend_for(loaded: LoadedModel) -> Backend:
    cuda = loaded.device.type == "cuda"
    if runs_natively(loaded):
        from llmcli.engine.image_rows import table_of
        from llmcli.engine.native.backend import NativeBackend

        graphs = cuda and loaded.fast is not False
        backend = NativeBackend(
            loaded.model, loaded.context_length, graphs=graphs, static_shapes=bool(loaded.fast)
        )
        backend.net.images = table_of(loaded)
        return backend
    from llmcli.engine.hf import TransformersBackend

    return TransformersBackend(
        loaded.model,
        loaded.context_length,
        static_cache=bool(loaded.fast),
        compile_decode=cuda and loaded.fast is True,
    )
