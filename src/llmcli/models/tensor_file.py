"""A safetensors file read one tensor at a time with plain reads, into memory torch allocated.

safetensors' own reader maps the whole file: every page a load touches stays resident until the
file is closed at its end, so reading a file through it costs the file's size in peak memory on
top of what is kept (80 MB of the demo's 4-bit blocks, measured). Reading each tensor into its
own buffer keeps the peak to what is kept, and the buffer is aligned as torch aligns any tensor
(the CPU's matrix kernels round differently on unaligned rows).
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any

import torch

from llmcli.models.headers import read_safetensors_header

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def is_stand_in(tensor: torch.Tensor) -> bool:
    """A tensor of its shape and no values (lean_model.Tensors.stand_in: one zero at every
    position), which the quantizer replaces and nothing may ever run on."""
    return tensor.numel() > 1 and not any(tensor.stride())


class TensorFile:
    def __init__(self, path: Path, header: dict[str, Any] | None = None) -> None:
        """`header`: the file's, where read (and checked) already."""
        self.path = path
        if header is None:
            header = read_safetensors_header(path)  # checked against the file's size
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
        self._data_start = 8 + length
        self._entries = {name: entry for name, entry in header.items() if name != "__metadata__"}

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> list[int]:
        return list(self._entries[name]["shape"])

    def get(self, name: str) -> torch.Tensor:
        entry = self._entries[name]
        dtype = DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{self.path}: tensor {name} is of {entry['dtype']}, which llmcli does not read")
        begin, end = entry["data_offsets"]
        shape = entry["shape"]
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{self.path}: tensor {name} takes {end - begin} bytes, not its shape's")
        buffer = torch.empty(end - begin, dtype=torch.uint8)
        with self.path.open("rb") as handle:
            handle.seek(self._data_start + begin)
            if handle.readinto(buffer.numpy()) != end - begin:
                raise ValueError(f"{self.path} ends inside tensor {name}")
        return buffer.view(dtype).view(shape)
