"""Every scale of a GGUF file's quantized blocks, and every value of its 16/32-bit tensors,
checked to be a finite number at load (llama.cpp's --check-tensors idea, made cheap enough to run
every time).

A NaN or Inf scale makes its whole block NaN or Inf, and one such weight spreads to every logit
within a layer: the model would answer with garbage, or with NonFiniteLogits far from the cause.
Here the file, the tensor and the block are named in one line before any weight is used.

Only the scale fields are read (2 or 4 bytes a block), as strided numpy views over the mapped
file: no compiler needed, and the quantized values themselves — small integers, always finite —
are not looked at. A float is NaN or Inf exactly when its exponent bits are all ones, so the
check compares bits, without converting a value.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmcli.errors import ModelLoadError
from llmcli.models.gguf_table import GGUFTable, TableEntry


@dataclass(frozen=True)
class _Kind:
    """One float format, read as an unsigned integer: a value is NaN or Inf exactly when its bits
    less the sign are at least `threshold` (its exponent all ones)."""

    dtype: str
    magnitude: int  # every bit but the sign
    threshold: int


_F16 = _Kind("<u2", 0x7FFF, 0x7C00)
_BF16 = _Kind("<u2", 0x7FFF, 0x7F80)
_F32 = _Kind("<u4", 0x7FFF_FFFF, 0x7F80_0000)
_E8M0 = _Kind("u1", 0xFF, 0xFF)  # MXFP4's shared exponent: 0xFF is its NaN

# GGUF type → (bytes a block, [(byte offset of a scale in the block, its format)]): llama.cpp's
# ggml-common.h. IQ1_M keeps its scale in bits spread over its sub-block scales: not checked.
BLOCK_SCALES: dict[str, tuple[int, tuple[tuple[int, _Kind], ...]]] = {
    "Q4_0": (18, ((0, _F16),)),
    "Q4_1": (20, ((0, _F16), (2, _F16))),
    "Q5_0": (22, ((0, _F16),)),
    "Q5_1": (24, ((0, _F16), (2, _F16))),
    "Q8_0": (34, ((0, _F16),)),
    "Q2_K": (84, ((80, _F16), (82, _F16))),
    "Q3_K": (110, ((108, _F16),)),
    "Q4_K": (144, ((0, _F16), (2, _F16))),
    "Q5_K": (176, ((0, _F16), (2, _F16))),
    "Q6_K": (210, ((208, _F16),)),
    "Q8_K": (292, ((0, _F32),)),
    "IQ2_XXS": (66, ((0, _F16),)),
    "IQ2_XS": (74, ((0, _F16),)),
    "IQ2_S": (82, ((0, _F16),)),
    "IQ3_XXS": (98, ((0, _F16),)),
    "IQ3_S": (110, ((0, _F16),)),
    "IQ1_S": (50, ((0, _F16),)),
    "IQ4_NL": (18, ((0, _F16),)),
    "IQ4_XS": (136, ((0, _F16),)),
    "TQ1_0": (54, ((52, _F16),)),
    "TQ2_0": (66, ((64, _F16),)),
    "MXFP4": (17, ((0, _E8M0),)),
}
# Tensors stored as plain floats: every value is checked.
FLOATS = {"F16": _F16, "BF16": _BF16, "F32": _F32}
_CHUNK = 1 << 22  # values per step through a float tensor: bounded temporaries


def check_finite(table: GGUFTable) -> None:
    """ModelLoadError naming the first tensor (and its block, or value) that holds a NaN or Inf
    scale or value; nothing where every one is finite."""
    if not table.tensors:
        return
    mapped = _mapped(table.path)
    for entry in table.tensors.values():
        found = _first_non_finite(mapped, entry)
        if found is not None:
            where, index = found
            what = "scale" if where == "block" else "value"
            raise ModelLoadError(
                f"{table.path} holds a NaN or Inf {what}: tensor {entry.name}, {where} {index} — the file "
                "is damaged or was written wrong",
                "download it again, or make it again with llama.cpp's llama-quantize",
            )


def _mapped(path: Path) -> np.ndarray:
    """The file's bytes, mapped read-only for the check and unmapped after it. (Mapping its pages
    in one call, MAP_POPULATE, measured no faster than a fault per page as the check walks it.)"""
    return np.memmap(path, dtype=np.uint8, mode="r")


def _first_non_finite(mapped: np.ndarray, entry: TableEntry) -> tuple[str, int] | None:
    """("block", index) or ("value", index) of the first non-finite one in `entry`, or None."""
    if entry.type_name in FLOATS:
        kind = FLOATS[entry.type_name]
        count = entry.nbytes // np.dtype(kind.dtype).itemsize
        index = _first_at_threshold(np.ndarray((count,), kind.dtype, mapped, entry.start), kind)
        return None if index is None else ("value", index)
    layout = BLOCK_SCALES.get(entry.type_name)
    if layout is None:
        return None
    block_bytes, scales = layout
    blocks = entry.nbytes // block_bytes
    found = [
        _first_at_threshold(
            np.ndarray((blocks,), kind.dtype, mapped, entry.start + offset, (block_bytes,)), kind
        )
        for offset, kind in scales
    ]
    first = min((index for index in found if index is not None), default=None)
    return None if first is None else ("block", first)


def _first_at_threshold(values: np.ndarray, kind: _Kind) -> int | None:
    """The index of the first NaN or Inf in `values`, or None: a chunk at a time, so that the
    one temporary stays small whatever the tensor."""
    chunk = np.empty(min(_CHUNK, values.size), values.dtype)
    for begin in range(0, values.size, _CHUNK):
        part = chunk[: min(_CHUNK, values.size - begin)]
        np.bitwise_and(values[begin : begin + part.size], kind.magnitude, out=part)
        if part.max(initial=0) >= kind.threshold:
            return begin + int((part >= kind.threshold).argmax())
    return None
