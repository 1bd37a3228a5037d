"""A GGUF file → the folder in llmcli's cache that stands for it, written once.

Files of the architectures llmcli's own engine runs are read in place (gguf_direct.py): the
folder holds only their small parts (config, tokenizer), a few MB. Files of other architectures
are converted by transformers, which reads GGUF by dequantizing every tensor (15–20 s even for a
135M model), so the result is saved as safetensors and later loads take a fraction of a second.

The cache key is a hash of the file's whole content, so a moved or copied file still hits and a
changed one misses, whatever part of it changed. Hashing costs one read of the file (sha256 runs
at ~2 GB/s here), so the hash is remembered beside the cache under the file's identity and times
(inode, size, mtime and ctime: no write to a file leaves its ctime as it was) and the file is
read again only when one of them changes.

A folder is built under a hidden staging name and renamed into place when done. One that was
killed leaves the staging folder behind: the next write removes such leftovers (those whose
writer no longer holds their lock), as does `llmcli models rm`, and `llmcli models list` shows
the space they hold. Converted weights are stored in fp16: GGUF block scales are fp16, so
dequantized values lose next to nothing there, at half the disk of fp32.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from filelock import FileLock

from llmcli.atomic import folder_written_atomically, write_text_atomically
from llmcli.errors import ModelLoadError
from llmcli.models.gguf_cache import (
    DONE_MARKER,
    KIND_FILE,
    NAME_FILE,
    conversion_of,
    remove_leftovers,
    require_gguf,
    stored_weight_kind,
)

if TYPE_CHECKING:
    from llmcli.models.gguf_table import GGUFTable


def converted_folder(
    gguf_file: Path, *, on_convert: Callable[[Path, bool], None] | None = None, name: str | None = None
) -> Path:
    """The folder in llmcli's cache that stands for `gguf_file`, written now if it does not exist
    yet: the file's small parts where it is read in place (gguf_direct.py), else its converted
    copy. `name` (from `models import --name`) is what -m will accept for it."""
    from llmcli.models.gguf_direct import (
        bring_up_to_date,
        check_metadata,
        check_shapes,
        direct_folder,
        is_direct,
        reads_directly,
        source_of,
    )
    from llmcli.models.gguf_int4 import BLOCKS_FILE  # here: it imports numpy
    from llmcli.models.gguf_table import read_table

    gguf_file = gguf_file.resolve()
    target = conversion_of(gguf_file)
    if is_direct(target) and not name:
        with contextlib.suppress(ModelLoadError):  # named again below, with the lock held
            if source_of(target) == gguf_file:
                bring_up_to_date(target)  # a config an older llmcli wrote: written again
                return target  # the common case: read before, nothing to write
    elif _converted_for_transformers(target) and (target / BLOCKS_FILE).is_file() and not name:
        return target  # converted before (an architecture transformers' path alone runs)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(target.parent / f".{target.name}.lock")
        lock.acquire()
    except OSError as error:
        raise ModelLoadError(
            f"cannot write llmcli's cache {target.parent} to convert {gguf_file.name} ({error.strerror})",
            "point XDG_CACHE_HOME at a writable folder",
        ) from None
    # One converter at a time per file: processes started together wait for the first one's
    # conversion instead of each making (and replacing) their own under each other's feet.
    try:
        table = read_table(gguf_file)  # the whole header: a damaged file is named now, in one line
        check_metadata(table)
        if not _is_ready(target, table):
            _clear_leftovers(target)
        if reads_directly(table):
            check_shapes(table)  # named now, before anything is written for it
            # Read in place: only its small parts are written (an older llmcli's whole converted
            # copy of it, if one is here, is replaced by them).
            if on_convert is not None and not is_direct(target):
                on_convert(gguf_file, True)
            direct_folder(gguf_file, target, table)
            _mark_done(target, gguf_file)
        elif not (target / DONE_MARKER).is_file():
            _check_transformers_reads(table)
            kind = stored_weight_kind(gguf_file)
            if on_convert is not None:
                on_convert(gguf_file, False)
            convert(gguf_file, target, kind)
        elif not (target / BLOCKS_FILE).is_file():  # written even when no tensor is 4-bit
            # A conversion by an older llmcli: add the int4 codes it lacks (a second or two, once).
            with contextlib.suppress(OSError, ValueError, KeyError, ImportError):
                save_int4_blocks(gguf_file, target)
        if name:
            write_text_atomically(target / NAME_FILE, name + "\n")
    finally:
        lock.release()
    return target


# llama.cpp's architecture names that transformers' GGUF tables spell its own way: its loader
# (modeling_gguf_pytorch_utils.load_gguf_checkpoint) renames these before looking them up.
_TRANSFORMERS_NAMES = {
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
    "minimax-m2": "minimax_m2",
}
# Sections of transformers' table beside the architectures, not architectures.
_NOT_ARCHITECTURES = frozenset({"general", "tokenizer"})


def transformers_reads(architecture: str) -> bool:
    """Whether transformers' GGUF loader has a mapping for a file of llama.cpp's `architecture`."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    name = _TRANSFORMERS_NAMES.get(architecture, architecture)
    return name in GGUF_SUPPORTED_ARCHITECTURES and name not in _NOT_ARCHITECTURES


def _check_transformers_reads(table: GGUFTable) -> None:
    """A file of an architecture llmcli does not read in place is converted by transformers:
    one it has no mapping for is refused now, before the conversion starts."""
    require_gguf()
    from llmcli.models.families import BY_GGUF

    if not transformers_reads(table.architecture):
        raise ModelLoadError(
            f"{table.path}: its architecture {table.architecture!r} is one neither llmcli's engine "
            "nor transformers runs",
            f"llmcli reads {', '.join(sorted(BY_GGUF))} GGUF files itself, and the others transformers reads",
        )


def _converted_for_transformers(folder: Path) -> bool:
    """A whole conversion of a file llmcli does not read in place. (An older llmcli converted
    every file: one it now reads in place is read again, and its copy replaced.)"""
    from llmcli.models.families import BY_GGUF

    if not (folder / DONE_MARKER).is_file():
        return False
    try:
        architectures = json.loads((folder / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return False
    return not set(architectures) & {row.architecture for row in BY_GGUF.values()}


def _is_ready(target: Path, table: GGUFTable) -> bool:
    """Whether `target` holds what this file needs already (read in place, or converted)."""
    from llmcli.models.gguf_direct import is_direct, reads_directly

    return is_direct(target) if reads_directly(table) else (target / DONE_MARKER).is_file()


def _clear_leftovers(target: Path) -> None:
    """Before writing `target`: what killed writers left, of it (its lock is held here, so its
    staging folders are a killed writer's) and of any other file."""
    for folder in [f for f in target.parent.glob(f".{target.name}-*") if f.is_dir()]:
        shutil.rmtree(folder, ignore_errors=True)
    remove_leftovers()


def _mark_done(folder: Path, gguf_file: Path) -> None:
    """The marker every GGUF folder in the cache has (catalog.py lists them by it): its file."""
    marker = folder / DONE_MARKER
    if not marker.is_file() or marker.read_text().strip() != str(gguf_file):
        write_text_atomically(marker, f"{gguf_file}\n")


def convert(gguf_file: Path, target: Path, kind: str) -> None:
    """Dequantize through transformers and save as safetensors; atomic, so a crash leaves no half folder."""
    require_gguf()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmcli.models.libraries import check_every_tensor_loaded, quiet_libraries

    quiet_libraries()
    # A target already there has no done marker: an older llmcli's half-written one, replaced.
    with folder_written_atomically(target) as staging:
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
            model, info = AutoModelForCausalLM.from_pretrained(
                gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float16, output_loading_info=True
            )
        except (ValueError, KeyError, IndexError, OSError, RuntimeError, EOFError, struct.error) as error:
            raise ModelLoadError(f"cannot read {gguf_file.name}: {error}") from error
        # transformers fills a tensor the file lacks with random values: never saved as the model.
        check_every_tensor_loaded(gguf_file, info)
        # The weights are plain tensors now; drop the GGUF quantizer that forbids saving them.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / KIND_FILE).write_text(kind + "\n")
        save_int4_blocks(gguf_file, staging)
        (staging / DONE_MARKER).write_text(f"{gguf_file}\n")


def save_int4_blocks(gguf_file: Path, folder: Path) -> None:
    """The file's 4-bit blocks as int4 codes beside the conversion, so int4 loads them exactly
    instead of requantizing the fp16 copy (see gguf_int4.py)."""
    from llmcli.models.gguf_int4 import write_blocks

    write_blocks(gguf_file, folder)
