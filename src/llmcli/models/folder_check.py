"""What a model folder may make a load read: only its own files, and pickles only when asked.

Checked before anything is loaded, for a folder given with -m and for a Hub snapshot alike:

- Every file resolves inside the folder. A file linked elsewhere (a `chat_template.jinja` that
  points at some other file on the machine) would put that file into the prompt, so the load is
  refused, naming it. The Hugging Face cache's own layout is the one exception: a snapshot's
  files are links into the `blobs/` folder of the same repository.
- Every weight file a load would read is safetensors, wherever its name came from: the
  `weight_map` of a `model.safetensors.index.json` may name `.bin` files, which torch unpickles
  (and a pickle can run code). Those are refused unless the user passed --allow-pickle.
"""

from __future__ import annotations

import json
from pathlib import Path

from llmcli.errors import ModelLoadError, UnsafeWeightsError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_INDEX = "pytorch_model.bin.index.json"
MAX_INDEX_BYTES = 64 * 1024 * 1024  # the largest real index is a few MB


def check_model_folder(folder: Path, *, allow_pickle: bool) -> None:
    """Make sure the folder is a loadable model, reads nothing outside itself, and unpickles
    nothing unless the user opted in."""
    if not (folder / "config.json").is_file():
        raise ModelLoadError(
            f"{folder} has no config.json, so it is not a Hugging Face model folder",
            "point -m at the folder that holds config.json, or at a .gguf file",
        )
    check_files_stay_inside(folder)
    weights = weight_files(folder)
    if not weights:
        raise ModelLoadError(f"{folder} holds no weights (*.safetensors)", "is the download complete?")
    pickled = [name for name in weights if not name.endswith(".safetensors")]
    if pickled and not allow_pickle:
        raise UnsafeWeightsError(
            f"{folder} holds pickled weights ({pickled[0]}) that a load would read; a pickle can run code",
            "pass --allow-pickle if you trust where they came from, or use a safetensors copy",
        )


def allowed_roots(folder: Path) -> list[Path]:
    """Where the folder's files may live: in it, and for a Hugging Face cache snapshot
    (`models--org--name/snapshots/REV`), in the same repository's `blobs/`."""
    real = folder.resolve()
    roots = [real]
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        roots.append(real.parent.parent / "blobs")
    return roots


def check_files_stay_inside(folder: Path) -> None:
    """Each file in the folder (and one level of subfolders, where templates are kept) resolves
    inside one of its allowed roots."""
    roots = allowed_roots(folder)
    entries = list(folder.iterdir())
    entries += [inner for entry in entries if entry.is_dir() for inner in entry.iterdir()]
    for entry in entries:
        target = entry.resolve()
        if not any(target.is_relative_to(root) for root in roots):
            raise UnsafeWeightsError(
                f"{entry} links outside the model folder (to {target}); a model reads only its own files",
                "copy the file into the folder if you mean it to be read",
            )


def weight_files(folder: Path) -> list[str]:
    """The weight files a load reads, as transformers picks them: a single safetensors file, or
    the files an index names; pickles only where there is no safetensors at all."""
    if (folder / "model.safetensors").is_file():
        return ["model.safetensors"]
    if (folder / SAFETENSORS_INDEX).is_file():
        return _indexed(folder, SAFETENSORS_INDEX)
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    safetensors = [name for name in names if name.endswith(".safetensors")]
    if safetensors:
        return safetensors
    if (folder / PICKLE_INDEX).is_file():
        return _indexed(folder, PICKLE_INDEX)
    return [name for name in names if name.endswith(PICKLE_SUFFIXES)]


def _indexed(folder: Path, index_name: str) -> list[str]:
    """The files an index's `weight_map` names, each checked to be a file of this folder."""
    index = folder / index_name
    try:
        if index.stat().st_size > MAX_INDEX_BYTES:
            raise ModelLoadError(f"{index} is {index.stat().st_size} bytes: too big for a weight index")
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ModelLoadError(f"{index} is not a weight index ({type(error).__name__}: {error})") from error
    for name in names:
        if not isinstance(name, str) or Path(name).name != name or not (folder / name).is_file():
            raise ModelLoadError(f"{index} names {name!r}, which is not a file of {folder}")
    return names
