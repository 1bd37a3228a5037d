"""GGUF files made for a test from one of llama.cpp's fixtures, with gguf's own writer: the same
metadata and tensors, with some changed, added or left out."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np


def rewrite_gguf(
    source: Path,
    target: Path,
    *,
    architecture: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    add: Mapping[str, np.ndarray] | None = None,
    retype: Mapping[str, tuple[Any, np.ndarray]] | None = None,
    keep: Callable[[str], bool] = lambda name: True,
) -> Path:
    """`source` written again to `target`: its metadata under `architecture` (keys renamed from
    the old one) updated with `metadata` (scalars, keyed by their new names, typed as the file
    typed them, else as the writer does), its tensors
    kept by `keep`, `add`ed ones (fp32) after them, and `retype`d ones (name → (GGML type, raw
    bytes)) stored as that type."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    old = str(reader.fields["general.architecture"].contents())
    new = architecture or old
    writer = gguf.GGUFWriter(str(target), new)
    for name, field in reader.fields.items():
        key = new + name[len(old) :] if name.startswith(old + ".") else name
        if name.startswith("GGUF.") or name == "general.architecture" or key in (metadata or {}):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, field.contents(), kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, field.contents(), kind)
    for key, value in (metadata or {}).items():
        # A key the file has keeps its type (llama.cpp refuses general.file_type as i32, say).
        known = reader.fields.get(key)
        kind = known.types[0] if known is not None else gguf.GGUFValueType.get_type(value)
        writer.add_key_value(key, value, kind)
    for tensor in reader.tensors:
        if not keep(tensor.name):
            continue
        # Block types are given as their bytes, [rows, bytes a row]: the writer works out the shape.
        kind, data = (retype or {}).get(tensor.name, (tensor.tensor_type, np.asarray(tensor.data)))
        writer.add_tensor(tensor.name, data, raw_dtype=kind)
    for name, values in (add or {}).items():
        writer.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
