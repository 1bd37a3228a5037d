"""gpt-oss's experts as its released checkpoints store them, MXFP4, dequantized as transformers
dequantizes them where it has no kernel (integrations/mxfp4.py): blocks of 32 four-bit floats
(E2M1, two a byte, the low nibble first) sharing one power-of-two scale (E8M0, 2^(s − 127)).
Every such value is exact in bf16 and fp32, so the result is bit-equal to transformers' in either.
llmcli has no MXFP4 kernel: the experts are held dequantized (4-8× their size on disk)."""

from __future__ import annotations

import torch

# The sixteen values of E2M1, by code: the sign in the high bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [rows, G, 16] uint8 and scales [rows, G] uint8 → [rows, G × 32] in `dtype`."""
    values = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    pairs = torch.stack((values[(blocks & 0x0F).long()], values[(blocks >> 4).long()]), dim=-1)
    exponents = scales.to(torch.int32) - 127
    scaled = torch.ldexp(pairs.view(*scales.shape, BLOCK), exponents.unsqueeze(-1))
    return scaled.view(*scales.shape[:-1], -1).to(dtype)


def stacked_experts(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One layer's experts, blocks [E, out, G, 16] and scales [E, out, G], as transformers holds
    gpt-oss's experts: [E, in, out] (in = G × 32), filled an expert at a time (one expert's fp32
    values in passing, not the layer's)."""
    experts, outputs, groups = scales.shape
    stacked = torch.empty((experts, groups * BLOCK, outputs), dtype=dtype, device=blocks.device)
    for expert in range(experts):
        stacked[expert] = dequantize(blocks[expert], scales[expert], dtype).T
    return stacked
