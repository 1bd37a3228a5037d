"""GGUF blocks multiplied on a GPU as the file stores them: Triton kernels that decode Q8_0, Q4_0,
Q4_K, Q5_K, Q6_K and IQ4_XS blocks in registers, with no requantized copy of the weights.

A layer is held as BlockLinear holds it on the CPU: uint8 [out_features, bytes per row], each row
a whole number of blocks. Every type is read a tile of 256 values at a time (one K-quant
super-block, or eight 32-value blocks of Q8_0/Q4_0), laid out as [rows, groups, group length]
with one scale (and minimum) per group, as llama.cpp's ggml-common.h defines the blocks. Each
type's decoding is one small `@triton.jit` function of the tile; the dequantizing kernel and the
GEMV are each written once and call it.

Decoded values are bit-equal to gguf's `dequantize` in fp32: every product of a block's scales
and codes is exact in fp32 (an fp16 scale has 11 significant bits, a sub-block scale at most 8,
a code at most 7: 24 bits at most), so the one rounding is the last one, whether or not the GPU
compiler fuses the minimum's subtraction into a fused multiply-add.

A decode step (and a speculative check) has a few rows of activations: the GEMV gives each
program BLOCK_N output channels and all the rows, streams its channels' blocks once and decodes
each in registers once for every row. More rows (prefill) are compute-bound: the weights are
dequantized by the same decoding into the activations' dtype and multiplied by one torch matmul
(the tensor cores on a GPU).
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# Up to this many rows go through the GEMV. Its program decodes each tile once for all rows and
# holds every row's products beside it (rows × BLOCK_N × 256 a step): compiled for an H100, 8 rows
# take 200-240 registers a thread (scripts/gguf_cuda_sass.py), so more rows would cut the programs
# in flight. A decode step is one row; a speculative check is its draft plus one (the schedule
# starts at 3 drafted tokens, speculative/schedule.py, and allows up to 16): those of up to 7
# drafted tokens stay on the GEMV, longer ones dequantize into one tensor-core matmul. Where the
# two cross is for a GPU to measure: scripts/bench_gguf_cuda.py prints both by rows.
GEMV_MAX_ROWS = 8

TILE = 256  # values decoded at a time along a row: one super-block, or 8 blocks of 32
_WARPS = 8  # a program's warps (see _block_n)


@dataclass(frozen=True)
class BlockType:
    """One GGUF block type: `code` selects its decoding in the kernels."""

    code: int
    values: int  # values a block stands for
    nbytes: int  # bytes a block takes


# Bytes and values per block: llama.cpp's ggml-common.h (block_q8_0, block_q4_K, ...).
_TYPES = {
    "Q8_0": BlockType(0, 32, 34),
    "Q4_0": BlockType(1, 32, 18),
    "Q4_K": BlockType(2, 256, 144),
    "Q5_K": BlockType(3, 256, 176),
    "Q6_K": BlockType(4, 256, 210),
    "IQ4_XS": BlockType(5, 256, 136),
}
TYPES: frozenset[str] = frozenset(_TYPES)


def dequantize(blocks: torch.Tensor, type_name: str, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """The values `blocks` [out, bytes per row] stand for, [out, in_features] in `dtype`."""
    kind, blocks = _checked(blocks, type_name, in_features)
    out_features = blocks.shape[0]
    out = torch.empty(out_features, in_features, dtype=dtype, device=blocks.device)
    block_n = _block_n(blocks.device)
    grid = (-(-out_features // block_n), -(-in_features // TILE))
    _kernels()[0][grid](
        blocks,
        out,
        out_features,
        in_features,
        blocks.shape[1],
        TYPE=kind.code,
        BLOCK_N=block_n,
        num_warps=_WARPS,
    )
    return out


def matmul(x: torch.Tensor, blocks: torch.Tensor, type_name: str, in_features: int) -> torch.Tensor:
    """x [M, in_features] @ the blocks' weights [out, in_features].T → [M, out] in x's dtype."""
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"{type_name} product: x is {tuple(x.shape)}, not [rows, {in_features}]")
    if x.shape[0] > GEMV_MAX_ROWS:
        return F.linear(x, dequantize(blocks, type_name, in_features, x.dtype))
    return gemv(x, blocks, type_name, in_features)


def gemv(
    x: torch.Tensor,
    blocks: torch.Tensor,
    type_name: str,
    in_features: int,
    block_n: int | None = None,
    warps: int | None = None,
) -> torch.Tensor:
    """matmul's GEMV, whatever the rows (matmul gives it up to GEMV_MAX_ROWS). `block_n`, `warps`:
    a program's channels and warps, for scripts/bench_gguf_cuda.py to sweep."""
    kind, blocks = _checked(blocks, type_name, in_features)
    rows = x.shape[0]
    x = x.contiguous()
    out_features = blocks.shape[0]
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block_n = block_n or _block_n(blocks.device)
    grid = (-(-out_features // block_n),)
    _kernels()[1][grid](
        x,
        blocks,
        out,
        rows,
        out_features,
        in_features,
        blocks.shape[1],
        TYPE=kind.code,
        BLOCK_M=max(1, 1 << (rows - 1).bit_length()),
        BLOCK_N=block_n,
        num_warps=warps or _WARPS,
    )
    return out


class TritonKernels:
    """These kernels behind the calls BlockLinear makes (block_linear.BlockKernels): a GGUF
    layer held in its blocks on a GPU."""

    level = "triton"
    types = TYPES

    def matmul(self, x: torch.Tensor, blocks: torch.Tensor, type_name: str, rows: int) -> torch.Tensor:
        return matmul(x, blocks, type_name, x.shape[1])

    def dequantized(
        self, blocks: torch.Tensor, type_name: str, rows: int, k: int, dtype: torch.dtype
    ) -> torch.Tensor:
        return dequantize(blocks, type_name, k, dtype)

    def dequantize(self, blocks: torch.Tensor, type_name: str, rows: int, k: int) -> torch.Tensor:
        return dequantize(blocks, type_name, k, torch.float32)


KERNELS = TritonKernels()


def available() -> bool:
    """Whether triton is installed (torch's CUDA wheels bring it on Linux): the kernels' one need."""
    return importlib.util.find_spec("triton") is not None


def _block_n(device: torch.device) -> int:
    """Output channels a program takes: 16 on a GPU (with 8 warps, _WARPS). Compiled for an H100
    on the CPU (scripts/gguf_cuda_sass.py), 16 × 8 issues a third fewer instructions per weight
    byte in the GEMV's loop than 4 × 4 for the K-quants at 1 and 8 rows (Q4_K 16.8 against 25.8),
    with 59-103 registers at one row and the fewest barriers; 32 × 8 issues a little fewer with
    more registers. To be measured on a GPU: scripts/bench_gguf_cuda.py sweeps them. Under
    Triton's interpreter (CPU tensors: the tests) a program costs Python's time, not the memory's:
    32."""
    return 16 if device.type == "cuda" else 32


def _checked(blocks: torch.Tensor, type_name: str, in_features: int) -> tuple[BlockType, torch.Tensor]:
    """The type's layout and `blocks` as the kernels read them (contiguous rows); ValueError for
    a type they do not decode or a tensor that is not whole rows of its blocks."""
    kind = _TYPES.get(type_name)
    if kind is None:
        raise ValueError(f"no GPU kernel reads GGUF type {type_name} (these do: {', '.join(sorted(TYPES))})")
    if blocks.dtype != torch.uint8 or blocks.dim() != 2:
        raise ValueError(
            f"{type_name} blocks must be a 2-D uint8 tensor, not {blocks.dtype} {tuple(blocks.shape)}"
        )
    if in_features <= 0 or in_features % kind.values:
        raise ValueError(
            f"{type_name} rows hold whole blocks of {kind.values} values: {in_features} is not a multiple"
        )
    row_bytes = in_features // kind.values * kind.nbytes
    if blocks.shape[1] != row_bytes:
        raise ValueError(
            f"{type_name} rows of {in_features} values take {row_bytes} bytes, not {blocks.shape[1]}"
        )
    return kind, blocks.contiguous()  # a view of other rows is copied: the kernels step by whole rows


@functools.cache
def _kernels() -> tuple[Any, Any]:  # (dequantize, gemv) triton.JITFunctions; triton imported only here
    from llmcli.models import gguf_cuda_kernels

    return gguf_cuda_kernels.gguf_dequantize, gguf_cuda_kernels.gguf_gemv
