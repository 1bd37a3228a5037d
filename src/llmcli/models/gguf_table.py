"""A GGUF file's tensor table and scalar metadata, read in tens of milliseconds.

gguf's own reader builds a numpy record for every element of every array it meets (a 49k-token
vocabulary and its merges: 1.7 s for the demo, measured), and transformers' needs transformers
imported (about 2 s). Loading needs neither the vocabulary nor the merges — the tokenizer is
built once and kept beside the file's other small parts — so this reader steps over string
arrays and reads only what a load needs: the scalars, and where each tensor is and what it is.

What a load could trip on later is checked here, before any tensor is read: a file cut short
(inside its metadata, or with a tensor past its end), a type GGUF does not define, and a table
llama.cpp's own reader refuses (a key or a tensor named twice, more than four dimensions, an
alignment that is not a power of two) or that would be read wrong (a tensor off its alignment,
two tensors over the same bytes: either would be read as weights without a word). Each is one
line naming the file and the tensor, key or type.
"""

from __future__ import annotations

import functools
import itertools
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmcli.errors import ModelLoadError

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")
_DEFAULT_ALIGNMENT = 32  # llama.cpp's, when the file names none
_MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp refuses a tensor of more


@dataclass(frozen=True)
class TableEntry:
    name: str  # GGUF's (blk.0.attn_q.weight)
    type_name: str  # GGUF's (Q4_K)
    shape: tuple[int, ...]  # torch's order: [out, in] for a matrix
    start: int  # byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFTable:  # shared by every reader of the same file in a process (read_table): read only
    path: Path
    metadata: dict[str, Any]  # scalars and strings; arrays of numbers; arrays of strings by count
    tensors: dict[str, TableEntry]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


def read_table(path: Path) -> GGUFTable:
    """The file's table, checked against the file: ModelLoadError naming what is wrong. Read once
    per process while the file stays as it was (its identity and times): a load asks for it from
    several places (the estimate, the codes, the weights), 30 ms each on the demo."""
    try:
        st = path.stat()
    except OSError as error:
        raise ModelLoadError(f"cannot read {path}: {error.strerror}") from None
    return _read_table(path, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))


@functools.lru_cache(maxsize=8)
def _read_table(path: Path, identity: tuple[int, ...]) -> GGUFTable:
    try:
        data = path.read_bytes() if identity[2] < (1 << 20) else None
        with path.open("rb") as handle:
            return _Parser(path, handle, data).table()
    except OSError as error:
        raise ModelLoadError(f"cannot read {path}: {error.strerror}") from None


def read_arrays(path: Path, keys: frozenset[str]) -> dict[str, Any]:
    """The file's metadata with the arrays named by `keys` read whole (the vocabulary, its
    merges and token types: what building the tokenizer needs, once), not cached."""
    try:
        with path.open("rb") as handle:
            return _Parser(path, handle, None, keys).table().metadata
    except OSError as error:
        raise ModelLoadError(f"cannot read {path}: {error.strerror}") from None


def _cut_short(path: Path, where: str) -> ModelLoadError:
    return ModelLoadError(
        f"{path} is not a readable GGUF file: cut short or damaged ({where})",
        "download it again, or check the file with llama.cpp's gguf-dump",
    )


class _Parser:
    """Reads the header through a file handle in large chunks: a vocabulary of tens of thousands
    of strings is stepped over without a system call per string."""

    _CHUNK = 1 << 22

    def __init__(
        self, path: Path, handle: Any, data: bytes | None, whole: frozenset[str] = frozenset()
    ) -> None:
        self.path, self.handle = path, handle
        self.whole = whole  # the keys whose arrays are read, not stepped over
        self.size = path.stat().st_size
        self.buffer = data if data is not None else b""
        self.buffer_start = 0
        self.position = 0

    def _ensure(self, count: int) -> None:
        end = self.position + count
        if end > self.size:
            raise _cut_short(self.path, f"its header runs past its end at byte {self.size}")
        if self.position >= self.buffer_start and end <= self.buffer_start + len(self.buffer):
            return
        self.handle.seek(self.position)
        self.buffer = self.handle.read(max(count, self._CHUNK))
        self.buffer_start = self.position

    def _take(self, count: int) -> bytes:
        self._ensure(count)
        offset = self.position - self.buffer_start
        self.position += count
        return self.buffer[offset : offset + count]

    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack(fmt, self._take(struct.calcsize(fmt)))
        return value

    def _string(self) -> str:
        length = self._unpack("<Q")
        if length > self.size:
            raise _cut_short(self.path, f"a string of {length} bytes at byte {self.position}")
        try:
            return self._take(length).decode("utf-8")
        except UnicodeDecodeError:
            raise _cut_short(self.path, f"a string that is not UTF-8 at byte {self.position}") from None

    def _value(self, kind: int, whole: bool = False) -> Any:
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            element, count = self._unpack("<I"), self._unpack("<Q")
            if element in _SCALARS:
                width = struct.calcsize(_SCALARS[element])
                if count * width > self.size:
                    raise _cut_short(self.path, f"an array of {count} values at byte {self.position}")
                if count > 4096 and not whole:  # scores and token types: a load needs none of them
                    self.position += count * width
                    return count
                return list(struct.unpack(f"<{count}{_SCALARS[element][1]}", self._take(count * width)))
            if element == _STRING and whole:
                if count > self.size:
                    raise _cut_short(self.path, f"an array of {count} strings at byte {self.position}")
                return self._strings(count)
            if element == _STRING:  # stepped over: the tokenizer is read once, elsewhere
                self._skip_strings(count)
                return count
        raise _cut_short(self.path, f"a metadata value of unknown type {kind} at byte {self.position}")

    def _skip_strings(self, count: int) -> None:
        """Past `count` strings, each a length and its bytes: read in the buffer without a call
        per string (a 49k-token vocabulary and its merges: 0.2 s through `_unpack`, measured)."""
        length_at = _LENGTH.unpack_from
        while count:
            self._ensure(8)
            buffer, offset = self.buffer, self.position - self.buffer_start
            last = len(buffer) - 8
            while count and offset <= last:
                offset += 8 + length_at(buffer, offset)[0]
                count -= 1
            self.position = self.buffer_start + offset  # may point past the buffer: read on demand

    def _strings(self, count: int) -> list[str]:
        """`count` strings, read in the buffer without a call per string where each lies whole
        in it (a 49k-token vocabulary and its merges: 0.15 s through `_string`, measured)."""
        length_at = _LENGTH.unpack_from
        strings: list[str] = []
        while len(strings) < count:
            self._ensure(8)
            buffer, offset = self.buffer, self.position - self.buffer_start
            try:
                while len(strings) < count and offset + 8 <= len(buffer):
                    end = offset + 8 + length_at(buffer, offset)[0]
                    if end > len(buffer):
                        break
                    strings.append(buffer[offset + 8 : end].decode("utf-8"))
                    offset = end
            except UnicodeDecodeError:
                raise _cut_short(self.path, f"a string that is not UTF-8 at byte {offset}") from None
            self.position = self.buffer_start + offset
            if len(strings) < count:  # one across the buffer's end: read on its own
                strings.append(self._string())
        return strings

    def table(self) -> GGUFTable:
        if self._take(4) != _MAGIC:
            raise ModelLoadError(
                f"{self.path} is not a GGUF file (it does not start with GGUF's magic bytes)"
            )
        version = self._unpack("<I")
        if version not in _VERSIONS:
            raise ModelLoadError(f"{self.path} is GGUF version {version}; llmcli reads versions 2 and 3")
        tensor_count, value_count = self._unpack("<Q"), self._unpack("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(value_count):
            key = self._string()
            if key in metadata:  # which of the two values would be meant?
                raise _cut_short(self.path, f"its metadata has the key {key} twice")
            metadata[key] = self._value(self._unpack("<I"), key in self.whole)
        raw: dict[str, tuple[tuple[int, ...], int, int]] = {}
        for _ in range(tensor_count):
            name = self._string()
            if name in raw:
                raise _cut_short(self.path, f"it has two tensors named {name}")
            dims = self._unpack("<I")
            if dims > _MAX_DIMS:  # read on, a damaged count walks the whole file 8 bytes at a time
                raise _cut_short(
                    self.path, f"tensor {name} has {dims} dimensions, where GGUF allows {_MAX_DIMS}"
                )
            shape = tuple(reversed([self._unpack("<Q") for _ in range(dims)]))
            raw[name] = (shape, self._unpack("<I"), self._unpack("<Q"))
        alignment = self._alignment(metadata)
        data_start = -(-self.position // alignment) * alignment
        entries = [self._entry(data_start, alignment, name, *fields) for name, fields in raw.items()]
        self._check_apart(entries)
        return GGUFTable(self.path, metadata, {entry.name: entry for entry in entries})

    def _alignment(self, metadata: dict[str, Any]) -> int:
        alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if (
            isinstance(alignment, bool)
            or not isinstance(alignment, int)
            or alignment <= 0
            or alignment & (alignment - 1)
        ):
            raise _cut_short(self.path, f"its general.alignment is {alignment!r}, not a power of two")
        return alignment

    def _check_apart(self, entries: list[TableEntry]) -> None:
        """No two tensors over the same bytes: the second would be read as the first's weights."""
        placed = sorted((entry for entry in entries if entry.nbytes), key=lambda entry: entry.start)
        for before, after in itertools.pairwise(placed):
            if after.start < before.start + before.nbytes:
                raise _cut_short(
                    self.path,
                    f"tensors {before.name} and {after.name} lie over the same bytes from byte {after.start}",
                )

    def _entry(
        self, data_start: int, alignment: int, name: str, shape: tuple[int, ...], kind: int, offset: int
    ) -> TableEntry:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            type_name = GGMLQuantizationType(kind).name
        except ValueError:
            raise ModelLoadError(
                f"{self.path}: tensor {name} is of GGML type {kind}, which llmcli does not know"
            ) from None
        block_weights, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        elements = math.prod(shape)
        if not shape or shape[-1] % block_weights:
            raise _cut_short(
                self.path, f"tensor {name} of shape {list(shape)} is not whole {type_name} blocks"
            )
        nbytes = elements // block_weights * block_bytes
        if offset % alignment:
            raise _cut_short(
                self.path,
                f"tensor {name} starts at byte {offset} of the data, off its alignment of {alignment}",
            )
        start = data_start + offset
        if start + nbytes > self.size:
            raise _cut_short(
                self.path,
                f"tensor {name} ends at byte {start + nbytes}, past the file's end at byte {self.size}",
            )
        return TableEntry(name, type_name, shape, start, nbytes)
