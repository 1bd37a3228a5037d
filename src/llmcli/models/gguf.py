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
import hashlib
import importlib.util
import json
import math
import shutil
import struct
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from filelock import FileLock, Timeout

from llmcli.atomic import folder_written_atomically, write_text_atomically
from llmcli.config.paths import cache_dir, gguf_cache_dir
from llmcli.errors import ModelLoadError

if TYPE_CHECKING:
    from llmcli.models.gguf_table import GGUFTable

_DONE_MARKER = ".llmcli-converted"
_NAME_FILE = ".llmcli-name"  # gguf_direct.NAME_FILE too
_KIND_FILE = ".llmcli-weights"  # how the file stored its layers' weights: int4, int8 or float

# GGUF's types by how many bits a weight keeps: 4-bit blocks go to int4 (their blocks of 32, with a
# scale, and a min for Q4_1, are int4 group 32 exactly); 5 to 8 bits to int8; the rest stay float.
_INT4_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K", "IQ4_NL", "IQ4_XS", "Q3_K", "Q2_K"})
_INT8_TYPES = frozenset({"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K"})
GGUF_INT4_GROUP = 32


def fingerprint(gguf_file: Path) -> str:
    """The file's content hash (16 hex digits), from memory when the file has not changed."""
    gguf_file = gguf_file.resolve()
    st = gguf_file.stat()
    identity = f"{gguf_file}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}"
    remembered = fingerprints_dir() / hashlib.sha256(identity.encode()).hexdigest()[:32]
    with contextlib.suppress(OSError):
        known = remembered.read_text().strip()
        if len(known) == 16:
            return known
    with gguf_file.open("rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()[:16]
    with contextlib.suppress(OSError):  # a read-only cache: hash it again next time
        remembered.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(remembered, digest + "\n")
    return digest


def fingerprints_dir() -> Path:
    """File identity and times → content hash, one small file each (beside the conversions, so
    nothing in their folder but conversions and their staging)."""
    return cache_dir() / "gguf-fingerprints"


def conversion_of(gguf_file: Path) -> Path:
    """Where the conversion of `gguf_file` lives (whether it exists yet or not)."""
    return gguf_cache_dir() / f"{gguf_file.stem}-{fingerprint(gguf_file)}"


def leftovers() -> list[Path]:
    """Staging folders of conversions that were killed: hidden folders in the GGUF cache whose
    conversion's lock nobody holds (a running conversion holds its own)."""
    root = gguf_cache_dir()
    found = []
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        if not folder.is_dir() or not folder.name.startswith("."):
            continue
        target_name = folder.name[1:].rsplit("-", 1)[0]  # staging: ".{target}-{random}"
        lock = FileLock(root / f".{target_name}.lock")
        try:
            lock.acquire(timeout=0)
        except Timeout:
            continue  # its conversion is running
        except OSError:
            continue
        lock.release()
        found.append(folder)
    return found


def remove_leftovers(keep: Path | None = None) -> int:
    """Delete what killed conversions left (but `keep`); the bytes freed."""
    freed = 0
    for folder in leftovers():
        if folder != keep:
            freed += folder_size(folder)
            shutil.rmtree(folder, ignore_errors=True)
    return freed


def folder_size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink())


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
        elif not (target / _DONE_MARKER).is_file():
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
            write_text_atomically(target / _NAME_FILE, name + "\n")
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
    _require_gguf()
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

    if not (folder / _DONE_MARKER).is_file():
        return False
    try:
        architectures = json.loads((folder / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return False
    return not set(architectures) & {row.architecture for row in BY_GGUF.values()}


def _is_ready(target: Path, table: GGUFTable) -> bool:
    """Whether `target` holds what this file needs already (read in place, or converted)."""
    from llmcli.models.gguf_direct import is_direct, reads_directly

    return is_direct(target) if reads_directly(table) else (target / _DONE_MARKER).is_file()


def _clear_leftovers(target: Path) -> None:
    """Before writing `target`: what killed writers left, of it (its lock is held here, so its
    staging folders are a killed writer's) and of any other file."""
    for folder in [f for f in target.parent.glob(f".{target.name}-*") if f.is_dir()]:
        shutil.rmtree(folder, ignore_errors=True)
    remove_leftovers()


def _mark_done(folder: Path, gguf_file: Path) -> None:
    """The marker every GGUF folder in the cache has (catalog.py lists them by it): its file."""
    marker = folder / _DONE_MARKER
    if not marker.is_file() or marker.read_text().strip() != str(gguf_file):
        write_text_atomically(marker, f"{gguf_file}\n")


def write_weight_kind(folder: Path, stored: str) -> None:
    (folder / _KIND_FILE).write_text(stored + "\n")


def convert(gguf_file: Path, target: Path, kind: str) -> None:
    """Dequantize through transformers and save as safetensors; atomic, so a crash leaves no half folder."""
    _require_gguf()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmcli.models.load import check_every_tensor_loaded, quiet_libraries

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
        (staging / _KIND_FILE).write_text(kind + "\n")
        save_int4_blocks(gguf_file, staging)
        (staging / _DONE_MARKER).write_text(f"{gguf_file}\n")


def save_int4_blocks(gguf_file: Path, folder: Path) -> None:
    """The file's 4-bit blocks as int4 codes beside the conversion, so int4 loads them exactly
    instead of requantizing the fp16 copy (see gguf_int4.py)."""
    from llmcli.models.gguf_int4 import write_blocks

    write_blocks(gguf_file, folder)


def _require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError(
            "reading .gguf files needs the gguf package", "install it with `pip install 'llmcli[gguf]'`"
        )


def stored_weight_kind(gguf_file: Path) -> str:
    """int4, int8 or float: what most of the file's layer weights (blk.*, 2-D) are stored as,
    then GGUF's name for their type ("int4 Q4_1")."""
    _require_gguf()
    from gguf import GGUFReader

    try:
        tensors = GGUFReader(str(gguf_file)).tensors
    # IndexError: gguf's reader indexing an array the file ends before (a cut in its metadata).
    except (ValueError, KeyError, IndexError, OSError, EOFError, struct.error) as error:
        raise ModelLoadError(
            f"{gguf_file} is not a readable GGUF file: cut short or damaged ({error})",
            "download it again, or check the file with llama.cpp's gguf-dump",
        ) from None
    return kind_of_types(
        (tensor.tensor_type.name, tuple(int(n) for n in tensor.shape))
        for tensor in tensors
        if tensor.name.startswith("blk.") and len(tensor.shape) == 2
    )


def kind_of_types(layer_weights: Iterable[tuple[str, tuple[int, ...]]]) -> str:
    """int4, int8 or float, then GGUF's type name ("int4 Q4_1"): what most of these layer
    weights (type, shape) are stored as."""
    kinds: Counter[str] = Counter()
    types: Counter[str] = Counter()
    for name, shape in layer_weights:
        kind = "int4" if name in _INT4_TYPES else "int8" if name in _INT8_TYPES else "float"
        kinds[kind] += math.prod(shape)
        types[name] += math.prod(shape)
    if not kinds:
        return "float"
    return f"{kinds.most_common(1)[0][0]} {types.most_common(1)[0][0]}"


def weight_kind(folder: Path) -> str | None:
    """What the GGUF file behind a converted folder stored (read once, then remembered beside the
    conversion); None when it cannot be known (the file is gone, or this is no conversion)."""
    stored = _stored(folder)
    return stored.split()[0] if stored else None


def gguf_type(folder: Path) -> str | None:
    """GGUF's name for the type most of a converted folder's layer weights had (Q4_1, Q8_0,
    F16); None when it cannot be known."""
    stored = (_stored(folder) or "").split()
    return stored[1] if len(stored) > 1 else None


def _stored(folder: Path) -> str | None:
    """ "int4 Q4_1": read once from the GGUF file behind a conversion, then remembered beside it
    (an older conversion remembered the kind alone)."""
    remembered = folder / _KIND_FILE
    text = remembered.read_text().strip() if remembered.is_file() else ""
    if len(text.split()) > 1:
        return text
    marker = folder / _DONE_MARKER
    source = Path(marker.read_text().strip()) if marker.is_file() else None
    if source is None or not source.is_file():
        return text or None
    try:
        stored = stored_weight_kind(source)
    except (OSError, ValueError, ImportError, ModelLoadError):
        return text or None
    with contextlib.suppress(OSError):  # a read-only cache: work it out again next time
        write_text_atomically(remembered, stored + "\n")
    return stored


def is_conversion(folder: Path) -> bool:
    """A folder this module converted from a GGUF file."""
    return (folder / _DONE_MARKER).is_file()
