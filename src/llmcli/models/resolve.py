"""Model spec → a local folder in Hugging Face format.

A spec is one of:
  * a local folder holding config.json, tokenizer files and weights;
  * a `.gguf` file (llama.cpp / ollama), converted once into llmcli's cache (see `gguf_import`);
  * a Hub id `org/name[@revision]`, looked up in the local HF cache first and fetched only when missing.

Only what inference needs is fetched (config, tokenizer, generation config, safetensors weights).
Pickled weights (`*.bin`, `*.pt`) can run code when loaded, so they are refused unless the user opts in.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmcli.errors import ModelLoadError, ModelNotFoundError, NetworkError, UnsafeWeightsError
from llmcli.models.checkpoint import Checkpoint
from llmcli.models.default_model import (
    DEFAULT_ALIAS,
    DEMO_GGUF_NAME,
    default_model_spec,
    demo_gguf_path,
    expand_default_alias,
)
from llmcli.models.folder_check import PICKLE_SUFFIXES
from llmcli.models.gguf_cache import find_imported

# How long the Hub may take to answer one metadata request before we call it unreachable.
HUB_TIMEOUT_S = 3.0

HUB_FILE_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.json",
    "chat_template.jinja",
    "*.safetensors",
    "model.safetensors.index.json",
]
PICKLE_PATTERNS = ["*.bin", "pytorch_model.bin.index.json", "*.pt", "*.pth"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


# What resolving gives: the model's files, each read once when first asked for (checkpoint.py).
ResolvedModel = Checkpoint


def names_of(spec: str | None) -> list[str]:
    """Every name the model `spec` (None: the default) goes by: as given, what it expands to,
    `smollm2` and the file's stem for the default, a .gguf file's stem, a Hub id without its
    revision. A config section may name the model by any of them."""
    expanded = expand_default_alias(spec) or default_model_spec()
    names = [name for name in (spec, expanded) if name]
    if expanded == default_model_spec():
        names.append(DEFAULT_ALIAS)
    if expanded.lower().endswith(".gguf"):
        names.append(Path(expanded).stem)
    repo, _, revision = expanded.partition("@")
    if revision:
        names.append(repo)
    return list(dict.fromkeys(names))


def closest_names(spec: str) -> list[str]:
    """Model names this machine knows that look like `spec`, closest first."""
    import difflib

    from llmcli.models.catalog import model_names

    names = [DEFAULT_ALIAS, *model_names()]
    lowered = {name.lower(): name for name in names}
    close = difflib.get_close_matches(spec.lower(), list(lowered), n=3, cutoff=0.5)
    close += [key for key in lowered if key.startswith(spec.lower()) and key not in close]
    return [lowered[key] for key in close[:3]]


def unknown_model(spec: str) -> ModelNotFoundError:
    """No model by this name: the closest names that do resolve, or where to look."""
    close = closest_names(spec)
    hint = (
        f"did you mean {', '.join(close)}? (`llmcli models list` shows them all)"
        if close
        else ("`llmcli models list` shows the models here; a Hub id looks like org/name")
    )
    return ModelNotFoundError(f"no model named {spec!r} here: not a folder, a .gguf file or a Hub id", hint)


def resolve_model(
    spec: str | None,
    *,
    allow_pickle: bool = False,
    on_convert: Callable[[Path, bool], None] | None = None,
) -> Checkpoint:
    """Find the model's files, fetching or converting them if needed.

    `on_convert` is called before a GGUF file is converted or first read (its second argument:
    read in place, not converted), to tell the user why this run is slow.
    """
    spec = expand_default_alias(spec) or default_model_spec()
    path = Path(spec).expanduser()
    imported = find_imported(spec) if not path.exists() else None
    if imported is not None:
        from llmcli.models.gguf_direct import bring_up_to_date

        bring_up_to_date(imported)
        return Checkpoint(name=spec, path=imported, source="gguf")
    if is_gguf_spec(spec):
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {spec} does not exist")
        from llmcli.models.gguf import converted_folder

        folder = converted_folder(path, on_convert=on_convert)
        return Checkpoint(name=path.stem, path=folder, source="gguf")
    if path.is_dir():
        check_weights(path, allow_pickle=allow_pickle)
        return Checkpoint(name=spec, path=path, source="folder")
    repo_id, _, revision = spec.partition("@")
    if _looks_like_path(spec):
        raise ModelNotFoundError(
            f"model {spec!r} is not a folder, a .gguf file or a Hub id",
            "pass a local model folder, a .gguf file, or a Hub id such as org/name[@revision]",
        )
    if not _HUB_ID.match(repo_id):
        raise unknown_model(spec)
    folder = resolve_hub(repo_id, revision or None, allow_pickle=allow_pickle)
    return Checkpoint(name=spec, path=folder, source="hub")


def is_gguf_spec(spec: str) -> bool:
    """A .gguf file, or any file (a folder or Hub id never is one)."""
    path = Path(spec).expanduser()
    return path.suffix.lower() == ".gguf" or path.is_file()


def _looks_like_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or spec.count("/") > 1


def check_weights(folder: Path, *, allow_pickle: bool) -> None:
    """Make sure the folder is loadable, and safe to load (see `folder_check`)."""
    from llmcli.models.folder_check import check_model_folder

    check_model_folder(folder, allow_pickle=allow_pickle)


def hub_cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def resolve_hub(repo_id: str, revision: str | None, *, allow_pickle: bool) -> Path:
    """The local HF cache first; the network only when the files are not there."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    spec = f"{repo_id}@{revision}" if revision else repo_id
    patterns = HUB_FILE_PATTERNS + (PICKLE_PATTERNS if allow_pickle else [])
    try:
        cached = Path(
            snapshot_download(repo_id, revision=revision, allow_patterns=patterns, local_files_only=True)
        )
        check_weights(cached, allow_pickle=allow_pickle)
        return cached
    except (LocalEntryNotFoundError, ModelLoadError):
        pass  # not cached, or only partly: go to the network.

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        raise NetworkError(
            f"{spec} is not in the local Hugging Face cache ({hub_cache_dir()}) and HF_HUB_OFFLINE is set",
            _offline_hint(
                repo_id, "unset HF_HUB_OFFLINE to download it, or pass a local folder or .gguf file with -m"
            ),
        )
    info = _hub_model_info(repo_id, revision, spec)
    files = [s.rfilename for s in (info.siblings or [])]
    only_pickled = not any(f.endswith(".safetensors") for f in files) and any(
        f.endswith(PICKLE_SUFFIXES) for f in files
    )  # (an index naming .bin files is caught once the files are here, before they load)
    if only_pickled and not allow_pickle:
        raise UnsafeWeightsError(
            f"{spec} on the Hub has only pickled weights, which can run code when loaded",
            "pass --allow-pickle if you trust its author",
        )
    try:
        folder = Path(snapshot_download(repo_id, revision=info.sha, allow_patterns=patterns))
    except Exception as error:  # a dropped connection mid-download, a full disk, ...
        raise NetworkError(
            f"downloading {spec} failed: {error}", "run the command again to resume"
        ) from error
    check_weights(folder, allow_pickle=allow_pickle)
    return folder


def hub_config_file(spec: str) -> Path:
    """A Hub model's config.json alone (for building a model with random weights): cache first."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    repo_id, _, revision = spec.partition("@")
    if not _HUB_ID.match(repo_id):
        raise ModelNotFoundError(f"config {spec!r} is not a file, a folder with config.json, or a Hub id")
    try:
        return Path(hf_hub_download(repo_id, "config.json", revision=revision or None, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    if constants.HF_HUB_OFFLINE:
        raise NetworkError(
            f"{spec}'s config.json is not in the local Hugging Face cache and HF_HUB_OFFLINE is set"
        )
    info = _hub_model_info(repo_id, revision or None, spec)
    return Path(hf_hub_download(repo_id, "config.json", revision=info.sha))


def _hub_model_info(repo_id: str, revision: str | None, spec: str) -> Any:
    """One metadata call, bounded in time even where DNS itself hangs, with Hub errors made readable."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    outcome: dict[str, Any] = {}

    def ask() -> None:
        try:
            outcome["info"] = HfApi().model_info(repo_id, revision=revision, timeout=HUB_TIMEOUT_S)
        except Exception as error:  # handed to the caller's thread below
            outcome["error"] = error

    # A daemon thread, because getaddrinfo ignores every timeout and may block for a minute.
    worker = threading.Thread(target=ask, daemon=True)
    worker.start()
    worker.join(HUB_TIMEOUT_S + 0.5)
    tried = f"{spec} is not in the local Hugging Face cache ({hub_cache_dir()})"
    if worker.is_alive():
        raise NetworkError(
            f"{tried} and {constants.ENDPOINT} did not answer within {HUB_TIMEOUT_S:.0f} s",
            "check your network, or pass a local folder or .gguf file with -m",
        )
    error = outcome.get("error")
    if error is None:
        return outcome["info"]
    if isinstance(error, GatedRepoError):
        raise ModelNotFoundError(
            f"{spec} is a gated model",
            f"accept its terms at {constants.ENDPOINT}/{repo_id} and log in with `hf auth login`",
        )
    if isinstance(error, RevisionNotFoundError):
        raise ModelNotFoundError(f"{repo_id} has no revision {revision!r} on the Hub")
    if isinstance(error, RepositoryNotFoundError) or (
        isinstance(error, HfHubHTTPError) and getattr(error.response, "status_code", None) in (401, 404)
    ):
        raise ModelNotFoundError(
            f"no model named {repo_id} on the Hugging Face Hub",
            "check the spelling; a private model needs `hf auth login`",
        )
    raise NetworkError(
        f"{tried} and {constants.ENDPOINT} could not be reached ({type(error).__name__})",
        _offline_hint(repo_id, "check your network, or pass a local folder or .gguf file with -m"),
    )


def _offline_hint(repo_id: str, otherwise: str) -> str:
    """What runs without the Hub instead: the bundled demo when it is the model asked for (in
    Q4_1), else the models here with a similar name."""
    name = repo_id.rpartition("/")[2].lower()
    if demo_gguf_path() is not None and DEMO_GGUF_NAME.lower().startswith(name + "."):
        return f"-m {DEFAULT_ALIAS} runs the copy of it installed here ({DEMO_GGUF_NAME}), offline"
    close = closest_names(name)
    return f"models here with a similar name: {', '.join(close)}; or {otherwise}" if close else otherwise


def find_local(
    spec: str, on_convert: Callable[[Path, bool], None] | None = None
) -> tuple[Path, str, Path | None]:
    """A model that is here already, never downloaded (a .gguf file is converted once): its
    folder, its source (gguf, folder or hub) and the GGUF file it came from, if any."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path, "folder", None
    if is_gguf_spec(spec) and path.is_file():
        return resolve_model(spec, on_convert=on_convert).path, "gguf", path
    imported = find_imported(spec)
    if imported is not None:
        return imported, "gguf", None
    repo_id, _, revision = spec.partition("@")
    if not _HUB_ID.match(repo_id):
        raise unknown_model(spec)  # never suggest pulling what is not a Hub id
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(repo_id, revision=revision or None, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError) as error:
        raise ModelNotFoundError(
            f"{spec} is not in the local caches", f"`llmcli models pull {spec}` first"
        ) from error
    return folder, "hub", None
