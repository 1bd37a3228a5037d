"""The models on this machine: the standard Hugging Face cache, and llmcli's converted GGUF files.

No store of our own: `models list` reads huggingface_hub's cache scan plus the GGUF conversions in
llmcli's cache; `pull` downloads into the HF cache; `rm` deletes from either. Nothing here imports
torch or transformers: listing and showing models stays fast.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from llmcli.errors import ModelLoadError, ModelNotFoundError
from llmcli.models.checkpoint import Checkpoint
from llmcli.models.engine_verdict import engine_under_auto
from llmcli.models.gguf_cache import find_imported, folder_size, imported_models, recorded_source
from llmcli.models.memory import (
    context_length_of,
    estimate_weight_bytes,
    kv_bytes_per_token,
    native_mode,
)


@dataclass(frozen=True)
class ModelEntry:
    name: str  # what to pass to -m
    revision: str  # commit for the HF cache; "gguf" for a conversion
    source: str  # "hub" or "gguf"
    path: str
    size_bytes: int
    architecture: str | None
    parameters: int | None
    context_length: int | None
    chat_template: bool
    default: bool = False  # what runs with no -m
    # A GGUF file read in place: its path. The model takes the file and llmcli's small folder on
    # disk (size_bytes), and removing it frees the folder alone (cache_bytes): the file is the user's.
    gguf_file: str | None = None
    cache_bytes: int | None = None  # what `models rm` frees; None: size_bytes

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def describe_folder(folder: Path) -> dict[str, Any]:
    """Architecture, parameter count, context length and chat template, from the files alone."""
    return describe(Checkpoint(folder.name, folder, "folder"))


def describe(checkpoint: Checkpoint) -> dict[str, Any]:
    """describe_folder of a checkpoint, from what it has read already."""
    folder = checkpoint.path
    config = _config_of(checkpoint)
    shapes = checkpoint.shapes if folder.is_dir() else {}
    return {
        "architecture": (config.get("architectures") or [config.get("model_type")])[0],
        "parameters": sum(t.count for t in shapes.values()) or None,
        "context_length": context_length_of(config) if config else None,
        "chat_template": has_chat_template_files(folder),
    }


def has_chat_template_files(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    return bool(_read_json(folder / "tokenizer_config.json").get("chat_template"))


def _config_of(checkpoint: Checkpoint) -> dict[str, Any]:
    """config.json, or nothing where it cannot be read (listing and showing say what they can)."""
    try:
        config = checkpoint.config
    except ModelLoadError:
        return {}
    return config if isinstance(config, dict) else {}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def list_models() -> list[ModelEntry]:
    entries = []
    for repo in _hub_repos():
        for revision in sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True):
            folder = Path(revision.snapshot_path)
            entries.append(
                ModelEntry(
                    name=repo.repo_id,
                    revision=revision.commit_hash[:12],
                    source="hub",
                    path=str(folder),
                    size_bytes=revision.size_on_disk,
                    **describe_folder(folder),
                )
            )
    for name, folder in imported_models():
        cache_bytes = folder_size(folder)
        file = _file_read_in_place(folder)
        entries.append(
            ModelEntry(
                name=name,
                revision="gguf",
                source="gguf",
                path=str(folder),
                size_bytes=cache_bytes + (file.stat().st_size if file is not None else 0),
                **describe_folder(folder),
                gguf_file=str(file) if file is not None else None,
                cache_bytes=cache_bytes,
            )
        )
    return _with_the_default(entries)


def _file_read_in_place(folder: Path) -> Path | None:
    """The GGUF file whose weights a folder's model reads, where it is still there: the folder
    itself holds only its config and tokenizer (3.5 MB for the demo's 105 MB file)."""
    file = recorded_source(folder)
    return file if file is not None and file.is_file() else None


def _with_the_default(entries: list[ModelEntry]) -> list[ModelEntry]:
    """The default model marked; listed even before its first use (the demo's GGUF file, not
    converted yet), since it is what runs without -m."""
    from dataclasses import replace

    from llmcli.models.default_model import default_model_spec

    spec = default_model_spec()
    name = Path(spec).stem if spec.endswith(".gguf") else spec
    if any(entry.name == name for entry in entries):
        return [replace(entry, default=entry.name == name) for entry in entries]
    if not spec.endswith(".gguf"):
        return entries  # the Hub default, not downloaded: nothing here to list
    default = ModelEntry(
        name=name,
        revision="gguf file",
        source="gguf",
        path=spec,
        size_bytes=Path(spec).stat().st_size,
        gguf_file=spec,
        cache_bytes=0,
        architecture=None,
        parameters=None,
        context_length=None,
        chat_template=True,
        default=True,
    )
    return [default, *entries]


def _hub_repos() -> list[Any]:
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        cache = scan_cache_dir()
    except CacheNotFound:
        return []
    return sorted((r for r in cache.repos if r.repo_type == "model"), key=lambda r: r.repo_id)


def model_names() -> list[str]:
    """Every name -m accepts from the caches, for shell completion."""
    return sorted({entry.name for entry in list_models()})


def remove_model(name: str) -> int:
    """Delete a model from the HF cache or llmcli's GGUF cache; the bytes freed."""
    folder = find_imported(name)
    if folder is not None:
        size = folder_size(folder)
        shutil.rmtree(folder)
        return size
    repo_id = name.partition("@")[0]
    for repo in _hub_repos():
        if repo.repo_id == repo_id:
            from huggingface_hub import scan_cache_dir

            strategy = scan_cache_dir().delete_revisions(*(r.commit_hash for r in repo.revisions))
            freed = strategy.expected_freed_size
            strategy.execute()
            return freed
    raise ModelNotFoundError(f"no model named {name} in the Hugging Face cache or llmcli's GGUF cache")


def model_summary(checkpoint: Checkpoint, name: str) -> dict[str, Any]:
    """What `models show` prints: the config's shape, template, generation defaults, memory."""
    folder = checkpoint.path
    config = _config_of(checkpoint)
    text = config.get("text_config") or config
    shapes = checkpoint.shapes
    template_file = folder / "chat_template.jinja"
    template = (
        template_file.read_text()
        if template_file.is_file()
        else _read_json(folder / "tokenizer_config.json").get("chat_template")
    )
    return {
        "name": name,
        "path": str(folder),
        "folder_bytes": folder_size(folder),
        **describe(checkpoint),
        "layers": text.get("num_hidden_layers"),
        "hidden_size": text.get("hidden_size"),
        "attention_heads": text.get("num_attention_heads"),
        "kv_heads": text.get("num_key_value_heads") or text.get("num_attention_heads"),
        "vocab_size": text.get("vocab_size"),
        "quantization": (config.get("quantization_config") or {}).get("quant_method"),
        "generation_defaults": checkpoint.stored_generation_config,
        "memory_bytes": {
            "bf16": estimate_weight_bytes(shapes, 2, "none"),
            "int8": estimate_weight_bytes(shapes, 2, _quant_mode(config, folder, shapes, "int8")),
            "int4": estimate_weight_bytes(shapes, 2, _quant_mode(config, folder, shapes, "int4")),
        },
        "kv_bytes_per_token_bf16": kv_bytes_per_token(config, 2),
        "chat_template_text": template,
        "engine": engine_under_auto(config.get("architectures", [None])[0]),
    }


def _quant_mode(config: dict[str, Any], folder: Path, shapes: dict[str, Any], kind: str) -> str:
    """How `--quant KIND` would store this model: llmcli's own formats for what the native engine
    runs (int4 in GGUF's blocks of 32 for a GGUF conversion), bitsandbytes' for the rest."""
    from llmcli.models.families import family_of_config
    from llmcli.models.gguf_cache import is_conversion
    from llmcli.models.quant import GGUF_INT4_GROUP

    if family_of_config(config) is None:
        return kind
    return native_mode(kind, GGUF_INT4_GROUP if is_conversion(folder) else None, shapes)
