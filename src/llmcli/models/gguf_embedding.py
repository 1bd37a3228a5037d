"""A GGUF file's quantized embedding kept in its blocks, its rows dequantized on demand."""

from __future__ import annotations

import torch


class BlockEmbedding(torch.nn.Module):
    """The embedding as the file stores it (a view of the file: nothing copied), each looked-up
    row dequantized by gguf (20 µs for one row of the demo's Q8_0 table, measured). The dense
    bf16 table it replaces holds 2 bytes a weight: 57 MB of the demo's 98. The native engine
    reads it through `rows` (engine/native/families/base.py's RowLookup)."""

    def __init__(self, blocks: torch.Tensor, type_name: str, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("blocks", blocks)
        self.type_name, self.dtype = type_name, dtype
        self.shape = (blocks.shape[0], dim)

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def rows(self, tokens: torch.Tensor) -> torch.Tensor:
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        picked = self.blocks[tokens.reshape(-1)].numpy()
        values = torch.from_numpy(dequantize(picked, GGMLQuantizationType[self.type_name]))
        return values.to(self.dtype).view(*tokens.shape, self.shape[1])
