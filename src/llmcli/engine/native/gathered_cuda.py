"""A token's k experts on a GPU, read where they lie: a Triton GEMV over stacked expert weights,
the expert of each program read from a device tensor.

The decode step of a sparse MoE knows its experts only on the device (the router's top-k), and a
CUDA graph cannot read them on the host. `index_select` of the k experts' slices, then a batched
product, copies those weights first: each byte is read twice and written once. Measured on an
H100 with Qwen3-30B-A3B's shapes, the copies were half the step's GPU time (7 of 14 ms). Here
each program looks up its slot's expert and streams that expert's rows once.

Stacked weights come in either layout ([experts, out, in] in Qwen3-MoE and Mixtral, [experts,
in, out] in gpt-oss); the kernel takes strides, and Triton specialises the unit stride, so the
contiguous dimension is the one its loads run along.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


def gathered_matvec(weights: torch.Tensor, chosen: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """weights [experts, N, K] (any strides), chosen [S] expert indices on the device, x [K] (one
    input for every slot) or [S, K] → [S, N], slot s being weights[chosen[s]] @ x[s], in x's dtype."""
    _, n, k = weights.shape
    slots = chosen.shape[0]
    x = x.contiguous()
    x_stride = 0 if x.dim() == 1 else x.stride(0)
    out = torch.empty(slots, n, dtype=x.dtype, device=x.device)
    # Along a contiguous K a program takes few outputs and long rows (as the int8 GEMV does);
    # along a contiguous N, many outputs and short columns.
    block_n, block_k = (4, 512) if weights.stride(2) == 1 else (128, 32)
    grid = (-(-n // block_n), slots)
    _kernel()[grid](
        x,
        weights,
        chosen,
        out,
        n,
        k,
        x_stride,
        weights.stride(0),
        weights.stride(1),
        weights.stride(2),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return out


@functools.cache
def _kernel() -> Any:  # a triton.JITFunction; triton is imported only on CUDA
    import triton
    import triton.language as tl

    @triton.jit
    def gathered_gemv(
        x,
        w,
        chosen,
        out,
        N,
        K,
        x_stride,
        expert_stride,
        n_stride,
        k_stride,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        block = tl.program_id(0)
        slot = tl.program_id(1)
        expert = tl.load(chosen + slot).to(tl.int64)
        channels = block * BLOCK_N + tl.arange(0, BLOCK_N)
        columns = tl.arange(0, BLOCK_K)
        live = channels < N
        base = w + expert * expert_stride
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            k = start + columns
            inside = k < K
            xs = tl.load(x + slot * x_stride + k, mask=inside, other=0.0).to(tl.float32)
            tile = live[:, None] & inside[None, :]
            ws = tl.load(base + channels[:, None] * n_stride + k[None, :] * k_stride, mask=tile, other=0.0)
            acc += ws.to(tl.float32) * xs[None, :]
        total = tl.sum(acc, axis=1)
        tl.store(out + slot * N + channels, total.to(out.dtype.element_ty), mask=live)

    return gathered_gemv
