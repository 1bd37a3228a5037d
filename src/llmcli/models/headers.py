"""A checkpoint's tensors as its files describe them, without reading a weight: a safetensors
file's header (checked against the file), and each tensor's shape and stored element size.
Torch-free, and below everything that reads weights or estimates memory (tensor_file.py,
memory.py, gguf_direct.py), so none of them needs to import the others for it."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


@dataclass(frozen=True)
class TensorHeader:
    shape: list[int]
    itemsize: int  # bytes per element as stored in the file
    # A GGUF file read in place (gguf_direct.py): the tensor's type there, and its bytes.
    gguf_type: str | None = None
    gguf_bytes: int = 0

    @property
    def count(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


def read_safetensors_header(file: Path) -> dict[str, Any]:
    """A safetensors file's header, checked against the file: a file cut short (an interrupted
    download or copy) or not safetensors at all is a ModelLoadError naming it, not a crash."""
    from llmcli.errors import ModelLoadError

    def damaged(why: str) -> ModelLoadError:
        return ModelLoadError(
            f"{file} is damaged ({why})",
            "download it again, or remove the model (`llmcli models rm NAME`)",
        )

    size = file.stat().st_size
    with file.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise damaged(f"{size} bytes, too short for a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if 8 + length > size:
            raise damaged(f"its header says {length} bytes, the file holds {size}")
        try:
            header = json.loads(handle.read(length))
        except ValueError:
            raise damaged("its header is not valid JSON") from None
    if not isinstance(header, dict):
        raise damaged("its header is not a table of tensors")
    ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    if 8 + length + max(ends, default=0) > size:
        raise damaged(f"cut short: {size} bytes of {8 + length + max(ends)}")
    return header
