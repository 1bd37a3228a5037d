"""GGUF file → a Hugging Face folder in llmcli's cache, converted once.

transformers reads GGUF by dequantizing every tensor (15–20 s even for a 135M model), so the
result is saved as safetensors and later loads take a fraction of a second. The cache key is a
hash of the file's whole content, so a moved or copied file still hits and a changed one misses,
whatever part of it changed. Hashing costs one read of the file (sha256 runs at ~2 GB/s here), so
the hash is remembered beside the cache under the file's identity and times (inode, size, mtime
and ctime: no write to a file leaves its ctime as it was) and the file is read again only when
one of them changes.

A conversion builds its folder under a hidden staging name and renames it into place when done.
One that was killed leaves the staging folder behind: the next conversion removes such leftovers
(those whose converter no longer holds their lock), as does `llmcli models rm`, and
`llmcli models list` shows the space they hold.
Weights are stored in fp16: GGUF block scales are fp16, so dequantized values lose next to
nothing there, at half the disk of fp32.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock, Timeout

from llmcli.atomic import write_text_atomically
from llmcli.config.paths import cache_dir, gguf_cache_dir
from llmcli.errors import ModelLoadError

_DONE_MARKER = ".llmcli-converted"
_NAME_FILE = ".llmcli-name"
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
    gguf_file: Path, *, on_convert: Callable[[Path], None] | None = None, name: str | None = None
) -> Path:
    """The converted copy of `gguf_file`, made now if it does not exist yet. `name` (from
    `models import --name`) is what -m will accept for it."""
    from llmcli.models.gguf_int4 import BLOCKS_FILE  # here: it imports numpy

    gguf_file = gguf_file.resolve()
    target = conversion_of(gguf_file)
    if (target / _DONE_MARKER).is_file() and (target / BLOCKS_FILE).is_file() and not name:
        return target  # the common case: converted before, nothing to write
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
        if not (target / _DONE_MARKER).is_file():
            kind = stored_weight_kind(gguf_file)  # reads the whole header: a damaged file is named now
            if on_convert is not None:
                on_convert(gguf_file)
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


def convert(gguf_file: Path, target: Path, kind: str) -> None:
    """Dequantize through transformers and save as safetensors; atomic, so a crash leaves no half folder."""
    _require_gguf()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmcli.models.load import quiet_libraries

    quiet_libraries()
    target.parent.mkdir(parents=True, exist_ok=True)
    own_leftovers = [f for f in target.parent.glob(f".{target.name}-*") if f.is_dir()]
    for folder in own_leftovers:  # this conversion's lock is held here: these are a killed one's
        shutil.rmtree(folder, ignore_errors=True)
    remove_leftovers()
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
            model = AutoModelForCausalLM.from_pretrained(
                gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float16
            )
        except (ValueError, KeyError, IndexError, OSError, RuntimeError, EOFError, struct.error) as error:
            raise ModelLoadError(f"cannot read {gguf_file.name}: {error}") from error
        # The weights are plain tensors now; drop the GGUF quantizer that forbids saving them.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / _KIND_FILE).write_text(kind + "\n")
        save_int4_blocks(gguf_file, staging)
        (staging / _DONE_MARKER).write_text(f"{gguf_file}\n")
        if target.exists():  # a folder without the done marker: an older llmcli's half-written one
            shutil.rmtree(target, ignore_errors=True)  # (the caller holds the lock: nobody reads it)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


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
    from collections import Counter

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
    kinds: Counter[str] = Counter()
    types: Counter[str] = Counter()
    for tensor in tensors:
        if tensor.name.startswith("blk.") and len(tensor.shape) == 2:
            name = tensor.tensor_type.name
            kind = "int4" if name in _INT4_TYPES else "int8" if name in _INT8_TYPES else "float"
            kinds[kind] += int(tensor.n_elements)
            types[name] += int(tensor.n_elements)
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
