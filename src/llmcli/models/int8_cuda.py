"""int8 weight-only matmul for CUDA at decode sizes: a Triton GEMV that reads the int8 codes.

torch ships `_weight_int8pack_mm` for CPUs (and MPS) but not for CUDA, and without
torch.compile an int8 weight used as `F.linear(x, w.to(bf16))` is first written out in bf16:
three times the bytes of the bf16 layer it replaced. A decode step has one row of activations
(a few with speculative verification), so this kernel gives each program BLOCK_N output channels,
streams their int8 rows once, and applies the per-channel scale at the end. Larger batches
(prefill) are compute-bound and dequantize into one cuBLAS matmul instead.

Triton compiles the kernel on first use (about a second, cached on disk by Triton); it runs in
warm-up, before any CUDA graph is captured, and the launch is captured like any other kernel.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

# Up to this many rows go through the GEMV: each row re-reads the weights from L2, not memory.
GEMV_MAX_ROWS = 8


def int8_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) @ (codes [N, K] int8 · scales [N]).T → [M, N] in x's dtype."""
    if x.shape[0] > GEMV_MAX_ROWS or not (codes.is_contiguous() and scales.is_contiguous()):
        # Many rows are compute-bound; strided codes or scales are not what the kernel indexes.
        return F.linear(x, codes.to(x.dtype)) * scales.to(x.dtype)
    rows, k = x.shape
    n = codes.shape[0]
    x = x.contiguous()
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = _config(n, k)
    kernel = _kernel()
    grid = (-(-n // block_n), rows)
    kernel[grid](x, codes, scales, out, n, k, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return out


def _config(n: int, k: int) -> tuple[int, int, int]:
    """BLOCK_N, BLOCK_K, warps, chosen by scripts/bench_kernels.py on an H100 (docs/benchmarks.md):
    4 channels × 512 columns per program keeps the most loads in flight for most layer shapes
    (88–98 % of measured bandwidth on 8B's qkv, gate_up and head); long rows (down, K ≥ 8192)
    do better with 8 × 1024 and 8 warps (68 % against 59 %)."""
    if k >= 8192:
        return 8, 1024, 8
    return 4, min(512, max(16, 1 << (k - 1).bit_length())), 4


@functools.cache
def _kernel() -> Any:  # a triton.JITFunction; triton is imported only on CUDA
    import triton
    import triton.language as tl

    @triton.jit
    def int8_gemv(x, w, s, out, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        block = tl.program_id(0)
        row = tl.program_id(1)
        channels = block * BLOCK_N + tl.arange(0, BLOCK_N)
        columns = tl.arange(0, BLOCK_K)
        live = channels < N
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            k = start + columns
            inside = k < K
            xs = tl.load(x + row * K + k, mask=inside, other=0.0).to(tl.float32)
            tile = live[:, None] & inside[None, :]
            ws = tl.load(w + channels[:, None] * K + k[None, :], mask=tile, other=0)
            acc += ws.to(tl.float32) * xs[None, :]
        total = tl.sum(acc, axis=1) * tl.load(s + channels, mask=live, other=0.0).to(tl.float32)
        tl.store(out + row * N + channels, total.to(out.dtype.element_ty), mask=live)

    return int8_gemv
