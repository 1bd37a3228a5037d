"""llmcli's cache of GGUF files, as every part of llmcli reads it: where a file's folder lives
(by the file's content fingerprint), the marker files a folder holds, the kind of weights its file
stored (remembered beside it), the imported models by name, and the leftovers of killed writers.
A leaf: torch-free, and none of the modules that write or read the folders (gguf.py,
gguf_direct.py) is imported here, so each of them, and the catalog, can ask it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import math
import shutil
import struct
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from filelock import FileLock, Timeout

from llmcli.atomic import write_text_atomically
from llmcli.config.paths import cache_dir, gguf_cache_dir
from llmcli.errors import ModelLoadError

DONE_MARKER = ".llmcli-converted"  # in every GGUF folder of the cache: the file it stands for
NAME_FILE = ".llmcli-name"  # the name `models import --name` gave
KIND_FILE = ".llmcli-weights"  # how the file stored its layers' weights: int4, int8 or float
SOURCE_FILE = ".llmcli-gguf"  # the GGUF file's path, in a folder read in place (gguf_direct.py)

# GGUF's types by how many bits a weight keeps: 4-bit blocks go to int4 (their blocks of 32, with a
# scale, and a min for Q4_1, are int4 group 32 exactly); 5 to 8 bits to int8; the rest stay float.
_INT4_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K", "IQ4_NL", "IQ4_XS", "Q3_K", "Q2_K"})
_INT8_TYPES = frozenset({"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K"})


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


def imported_models() -> list[tuple[str, Path]]:
    """(name, folder) of every converted GGUF file in llmcli's cache."""
    root = gguf_cache_dir()
    found = []
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        marker = folder / DONE_MARKER
        if marker.is_file():
            name_file = folder / NAME_FILE
            # Unnamed conversions (a .gguf passed to -m) go by the file's stem: "<stem>-<fingerprint>".
            default_name = folder.name.rsplit("-", 1)[0]
            found.append((name_file.read_text().strip() if name_file.is_file() else default_name, folder))
    return found


def find_imported(name: str) -> Path | None:
    return next((folder for found, folder in imported_models() if found == name), None)


def recorded_source(folder: Path) -> Path | None:
    """The GGUF file a directly read folder was written for, as recorded (it may be gone since)."""
    with contextlib.suppress(OSError):
        return Path((folder / SOURCE_FILE).read_text().strip())
    return None


def is_direct(folder: Path) -> bool:
    return (folder / SOURCE_FILE).is_file()


def write_weight_kind(folder: Path, stored: str) -> None:
    (folder / KIND_FILE).write_text(stored + "\n")


def require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError(
            "reading .gguf files needs the gguf package", "install it with `pip install 'llmcli[gguf]'`"
        )


def stored_weight_kind(gguf_file: Path) -> str:
    """int4, int8 or float: what most of the file's layer weights (blk.*, 2-D) are stored as,
    then GGUF's name for their type ("int4 Q4_1")."""
    require_gguf()
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
    stored = stored_kind_of(folder)
    return stored.split()[0] if stored else None


def gguf_type(folder: Path) -> str | None:
    """GGUF's name for the type most of a converted folder's layer weights had (Q4_1, Q8_0,
    F16); None when it cannot be known."""
    stored = (stored_kind_of(folder) or "").split()
    return stored[1] if len(stored) > 1 else None


def stored_kind_of(folder: Path) -> str | None:
    """ "int4 Q4_1": read once from the GGUF file behind a conversion, then remembered beside it
    (an older conversion remembered the kind alone)."""
    remembered = folder / KIND_FILE
    text = remembered.read_text().strip() if remembered.is_file() else ""
    if len(text.split()) > 1:
        return text
    marker = folder / DONE_MARKER
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
    return (folder / DONE_MARKER).is_file()
