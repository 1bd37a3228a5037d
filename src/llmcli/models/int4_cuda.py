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
# (BLOCK_N, BLOCK_K, warps) for one row, (BLOCK_M, BLOCK_N, BLOCK_K, warps) for more: not tuned
# on a GPU yet (scripts/bench_kernels.py is where to).
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
    `scales_and_zeros` [K / group, N, 2]."""
    rows, k = x.shape
    if rows > MAX_ROWS:
        return F.linear(x, dequantize(packed, scales_and_zeros, group).to(x.dtype))
    n = packed.shape[0]
    x = x.contiguous()
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 1:
        block_m, (block_n, block_k, warps) = 1, ONE_ROW_BLOCK
    else:
        block_m, block_n, block_k, warps = FEW_ROWS_BLOCK
    _kernel()[(-(-n // block_n),)](
        x, packed, scales_and_zeros, out, rows, n, k, group,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=dot_precision(x.dtype), num_warps=warps,
    )  # fmt: skip
    return out


@functools.cache
def _kernel() -> Any:  # a triton.JITFunction; triton is imported only where it runs
    import triton
    import triton.language as tl

    @triton.jit
    def int4_rows(
        x, w, sz, out, M, N, K, GROUP,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        channels = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        columns = tl.arange(0, BLOCK_K)
        rows = tl.arange(0, BLOCK_M)
        live = channels < N
        real = rows < M  # the rows past M are padding, read as zeros and never stored
        if BLOCK_M == 1:
            partial = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            k = start + columns
            tile = live[:, None] & (k < K)[None, :]
            # Each byte is loaded for both its columns (the same address: one memory read).
            pairs = tl.load(w + channels[:, None] * (K // 2) + k[None, :] // 2, mask=tile, other=0)
            codes = (pairs.to(tl.int32) >> ((k[None, :] % 2) * 4)) & 15
            # [K / group, N, 2]: the scale of (channel, column) and its zero point beside it
            at = sz + ((k[None, :] // GROUP) * N + channels[:, None]) * 2
            scale = tl.load(at, mask=tile, other=0.0).to(tl.float32)
            zero = tl.load(at + 1, mask=tile, other=0.0).to(tl.float32)
            weights = (codes.to(tl.float32) - 8) * scale + zero  # [BLOCK_N, BLOCK_K]
            xs = tl.load(x + rows[:, None] * K + k[None, :], mask=real[:, None] & (k < K)[None, :], other=0.0)
            if BLOCK_M == 1:
                partial += weights * xs.to(tl.float32)
            else:
                acc = tl.dot(xs.to(tl.float32), tl.trans(weights), acc, input_precision=PRECISION)
        if BLOCK_M == 1:
            acc = tl.sum(partial, axis=1)[None, :]
        done = real[:, None] & live[None, :]
        tl.store(out + rows[:, None] * N + channels[None, :], acc.to(out.dtype.element_ty), mask=done)

    return int4_rows
