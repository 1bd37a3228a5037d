"""Where llmcli keeps its own files (XDG base directories; no private model store)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$LLMCLI_CACHE_DIR, else $XDG_CACHE_HOME/llmcli, else ~/.cache/llmcli."""
    explicit = os.environ.get("LLMCLI_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "llmcli"


def gguf_cache_dir() -> Path:
    return cache_dir() / "gguf"


def state_dir() -> Path:
    """$XDG_STATE_HOME/llmcli, else ~/.local/state/llmcli: the REPL's input history lives here."""
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base).expanduser() / "llmcli"


def prompt_cache_dir() -> Path:
    """Prompts' computed state kept on disk (engine/disk_prefix.py): one safetensors file each."""
    return cache_dir() / "prompts"
