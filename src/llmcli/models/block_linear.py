"""A linear layer kept as a GGUF file's own blocks, multiplied by llmcli's compiled CPU kernels
(cpu_kernels.py) as llama.cpp multiplies them: each row of the input quantized once to the 8-bit
block format llama.cpp pairs with the weights' type, integer dot products on the blocks as the
file stores them. The weights held are the file's bytes: nothing is dequantized or requantized.
On a GPU the same layer holds its blocks in GPU memory and gguf_cuda.py's Triton kernels
multiply them (BlockKernels: either set of kernels)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.nn.functional as F

from llmcli.models.cpu_kernels import kernel_threads

# From this many rows on, a product dequantizes the matrix (in the model's dtype) and runs torch's
# GEMM: the block products decode each block once per row, a GEMM once per matrix. Measured on
# one thread here: at 16 rows the block products lead (Q4_K 0.81 ms against 0.93), at 64 the GEMM
# (Q4_K 1.41 ms against 3.24; Q8_0 1.43 against 4.25); at 512, 3-4x.
GEMM_ROWS = 32


class BlockKernels(Protocol):
    """What multiplies a layer's blocks: cpu_kernels.CpuKernels on a CPU, gguf_cuda.TritonKernels
    on a GPU. `rows`: the matrix's out_features; `k`: its in_features."""

    @property
    def types(self) -> frozenset[str]: ...

    def matmul(self, x: torch.Tensor, blocks: torch.Tensor, type_name: str, rows: int) -> torch.Tensor: ...

    def dequantized(
        self, blocks: torch.Tensor, type_name: str, rows: int, k: int, dtype: torch.dtype
    ) -> torch.Tensor: ...

    def dequantize(self, blocks: torch.Tensor, type_name: str, rows: int, k: int) -> torch.Tensor: ...


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads set to `threads` inside, as they were after."""
    before = torch.get_num_threads()
    if before == threads:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class BlockLinear(torch.nn.Module):
    def __init__(
        self,
        kernels: BlockKernels,
        blocks: torch.Tensor,
        type_name: str,
        in_features: int,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> None:
        """`blocks`: uint8 [out_features, bytes per row], each row a whole number of blocks."""
        super().__init__()
        self.kernels, self.type_name = kernels, type_name
        self.kind = "blocks"
        self.out_features, self.in_features = blocks.shape[0], in_features
        self.dtype = dtype  # what the rest of the model computes in: the product's result is cast to it
        self.register_buffer("blocks", blocks)
        self.register_buffer("bias", None if bias is None else bias.to(dtype))

    @classmethod
    def of_weight(cls, kernels: BlockKernels, weight: torch.Tensor, bias: torch.Tensor | None) -> BlockLinear:
        """A 16-bit weight [out, in] as the kernels' F16 or BF16 rows: its own bytes, not a copy."""
        type_name = {torch.float16: "F16", torch.bfloat16: "BF16"}[weight.dtype]
        blocks = weight.detach().contiguous().view(torch.uint8)
        return cls(kernels, blocks, type_name, weight.shape[1], bias, weight.dtype)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def label(self) -> str:
        return self.type_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).contiguous()  # fp32, bf16 and fp16 are read and written as they are
        if rows.shape[0] >= GEMM_ROWS:  # a prefill: the matrix read once, multiplied by torch's GEMM
            # bf16 where the model computes in it; fp32 otherwise (torch has no fast fp16 GEMM on a
            # CPU); a GPU's tensor cores take the rows' own dtype
            dtype = torch.bfloat16 if rows.dtype == torch.bfloat16 else torch.float32
            dtype = rows.dtype if rows.is_cuda else dtype
            weight = self.kernels.dequantized(self.blocks, self.type_name, *self.shape, dtype)
            with torch_threads(kernel_threads()):  # torch keeps one thread between the kernels' calls
                out = F.linear(rows.to(weight.dtype), weight).to(x.dtype)
        else:
            out = self.kernels.matmul(rows, self.blocks, self.type_name, self.out_features).to(x.dtype)
        out = out.view(*shape[:-1], self.out_features)
        return out + self.bias if self.bias is not None else out

    def dequantized(self) -> torch.Tensor:
        """The weights the blocks stand for, [out, in] in fp32: the reference in tests."""
        return self.kernels.dequantize(self.blocks, self.type_name, self.out_features, self.in_features)
