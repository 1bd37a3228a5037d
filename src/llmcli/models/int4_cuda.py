"""int4 weight-only matmul for CUDA at decode and check sizes: a Triton kernel over llmcli's own
packing of the codes, reading them once for all rows.

torch's `_weight_int4pack_mm` (tinygemm) costs more with every row it multiplies: a speculative
check of 16 rows measured 2.4–3.0× a decode step on an H100 (docs/benchmarks.md), where bf16
weights cost 1.1×. A check is memory-bound like a step: this kernel gives each program a block
of output channels and multiplies all rows (up to 16, padded to the tensor cores' smallest
tile) by their codes, unpacked once. One row (a decode step) runs the same program without the
dot. More rows (prefill) are compute-bound: the weights are dequantized into one matmul.

The packing is llmcli's: codes [N, K] in 0…15 as bytes [N, K / 2], an even column in the low
nibble, the next in the high one (tinygemm's CUDA layout is opaque, so no other kernel can read
it). Scales and zero points stay as QuantizedLinear keeps them for tinygemm, [K / group, N, 2],
with w = (q − 8)·scale + zero. LLMCLI_INT4_CUDA=tinygemm keeps torch's kernel and layout
instead (to compare the two on one card).

The loads are laid out for bandwidth: each block of columns lies inside one group, so a
channel's scale and zero point are one load per block, and its bytes are read contiguously and
split by nibble into the even and the odd columns rather than gathered per column. With 16-bit
activations the dot rounds the dequantized weights to tf32 (10 bits, finer than bf16's 8).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.nn.functional as F

from llmcli.errors import UsageError
from llmcli.models.int8_cuda import dot_precision

KERNEL_ENV = "LLMCLI_INT4_CUDA"
KERNELS = ("triton", "tinygemm")
# Up to this many rows read the codes (the largest check pass, backend.GRAPHED_ROWS[-1]).
MAX_ROWS = 16
# (BLOCK_N, BLOCK_K, warps) for one row, (BLOCK_M, BLOCK_N, BLOCK_K, warps) for more, BLOCK_K in
# columns and cut to the group where that is smaller: not tuned on a GPU yet
# (scripts/bench_check_kernels.py measures them).
ONE_ROW_BLOCK = (16, 256, 4)
FEW_ROWS_BLOCK = (16, 32, 128, 4)


def chosen_kernel() -> str:
    """Which kernel int4 layers on CUDA are packed for: LLMCLI_INT4_CUDA, else triton. A name
    that is none is refused in one line."""
    asked = os.environ.get(KERNEL_ENV, "triton").strip().lower() or "triton"
    if asked not in KERNELS:
        raise UsageError(f"{KERNEL_ENV}={asked} is not an int4 kernel: choose {' or '.join(KERNELS)}")
    return asked


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] in 0…15 (K even) → bytes [N, K / 2]: column 2j low, 2j + 1 high."""
    if codes.shape[1] % 2:
        raise ValueError(f"int4 codes pack in pairs: {codes.shape[1]} columns is odd")
    return (codes[:, 0::2] | codes[:, 1::2] << 4).to(torch.uint8)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """pack's inverse: codes [N, K] as int32."""
    low, high = (packed & 15).to(torch.int32), (packed >> 4).to(torch.int32)
    return torch.stack([low, high], dim=-1).view(packed.shape[0], -1)


def dequantize(packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """The weights [N, K] the packed codes stand for, in the scales' dtype."""
    codes = unpack(packed)
    n, k = codes.shape
    scales, zeros = scales_and_zeros.float().transpose(0, 1).unbind(-1)  # [N, K / group] each
    weights = (codes.float().view(n, k // group, group) - 8) * scales[..., None] + zeros[..., None]
    return weights.view(n, k).to(scales_and_zeros.dtype)


def int4_matmul(
    x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int
) -> torch.Tensor:
    """x [M, K] @ W.T → [M, N] in x's dtype, W the weights of `packed` (pack) and
    `scales_and_zeros` [K / group, N, 2]. Shapes the kernel does not tile (more rows than a
    check's, a group of fewer than 32 or not a power of two) take the dequantizing path."""
    rows, k = x.shape
    if rows > MAX_ROWS or not covers(group, k):
        return F.linear(x, dequantize(packed, scales_and_zeros, group).to(x.dtype))
    n = packed.shape[0]
    x = x.contiguous()
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 1:
        block_m, (block_n, block_k, warps) = 1, ONE_ROW_BLOCK
    else:
        block_m, block_n, block_k, warps = FEW_ROWS_BLOCK
    _kernel()[(-(-n // block_n),)](
        x, packed, scales_and_zeros, out, rows, n, k,
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, HALF_K=min(group, block_k) // 2,
        PRECISION=dot_precision(x.dtype), num_warps=warps,
    )  # fmt: skip
    return out


def covers(group: int, k: int) -> bool:
    """Whether the kernel tiles this group: a power of two of at least 32 (each block of columns
    inside one group, and 16 bytes at least for a dot) dividing the row."""
    return group >= 32 and group & (group - 1) == 0 and k % group == 0


@functools.cache
def _kernel() -> Any:  # a triton.JITFunction; triton is imported only where it runs
    import triton
    import triton.language as tl

    @triton.jit
    def int4_rows(
        x, w, sz, out, M, N, K,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HALF_K: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        # A block of HALF_K bytes (2 · HALF_K columns) lies inside one group, so each channel has
        # one scale and zero point per block; the bytes load contiguously and split into the even
        # columns (low nibbles) and the odd ones (high), each met by x's columns of that parity.
        channels = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, BLOCK_M)
        live = channels < N
        real = rows < M  # the rows past M are padding, read as zeros and never stored
        if BLOCK_M == 1:
            partial = tl.zeros((BLOCK_N, HALF_K), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, K // 2, HALF_K):
            pairs = start + tl.arange(0, HALF_K)
            tile = live[:, None] & (pairs < K // 2)[None, :]
            packed = tl.load(w + channels[:, None] * (K // 2) + pairs[None, :], mask=tile, other=0).to(
                tl.int32
            )
            at = sz + ((2 * start // GROUP) * N + channels) * 2  # [K / group, N, 2]
            scale = tl.load(at, mask=live, other=0.0).to(tl.float32)[:, None]
            zero = tl.load(at + 1, mask=live, other=0.0).to(tl.float32)[:, None]
            even = ((packed & 15) - 8).to(tl.float32) * scale + zero  # [BLOCK_N, HALF_K]
            odd = ((packed >> 4) - 8).to(tl.float32) * scale + zero
            inputs = x + rows[:, None] * K + 2 * pairs[None, :]
            reads = real[:, None] & (pairs < K // 2)[None, :]
            x_even = tl.load(inputs, mask=reads, other=0.0).to(tl.float32)  # [BLOCK_M, HALF_K]
            x_odd = tl.load(inputs + 1, mask=reads, other=0.0).to(tl.float32)
            if BLOCK_M == 1:
                partial += even * x_even + odd * x_odd
            else:
                acc = tl.dot(x_even, tl.trans(even), acc, input_precision=PRECISION)
                acc = tl.dot(x_odd, tl.trans(odd), acc, input_precision=PRECISION)
        if BLOCK_M == 1:
            acc = tl.sum(partial, axis=1)[None, :]
        done = real[:, None] & live[None, :]
        tl.store(out + rows[:, None] * N + channels[None, :], acc.to(out.dtype.element_ty), mask=done)

    return int4_rows
