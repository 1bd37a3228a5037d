"""A GGUF file's quantized embedding kept in its blocks, its rows dequantized on demand."""

from __future__ import annotations

import torch


class BlockEmbedding(torch.nn.Module):
    """The embedding as the file stores it (a view of the file; a copy in a server, which
    outlives its load: gguf_direct.private_copies), each looked-up row dequantized by gguf
    (20 µs for one row of the demo's Q8_0 table, measured). The dense bf16 table it replaces
    holds 2 bytes a weight: 57 MB of the demo's 98. The native engine reads it through `rows`
    (engine/native/families/base.py's RowLookup)."""

    def __init__(self, blocks: torch.Tensor, type_name: str, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("blocks", blocks)
        self.type_name, self.dtype = type_name, dtype
        self.shape = (blocks.shape[0], dim)

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def rows(self, tokens: torch.Tensor) -> torch.Tensor:
        from llmcli.models.cpu_kernels import kernels

        picked = self.blocks[tokens.reshape(-1)]
        compiled = kernels()
        if compiled is not None and self.type_name in compiled.types:  # bit-equal to gguf's, faster
            values = compiled.dequantize(picked, self.type_name, picked.shape[0], self.shape[1])
        else:
            from gguf.constants import GGMLQuantizationType
            from gguf.quants import dequantize

            values = torch.from_numpy(dequantize(picked.numpy(), GGMLQuantizationType[self.type_name]))
        return values.to(self.dtype).view(*tokens.shape, self.shape[1])


class HeadRows(torch.nn.Module):
    """A tied embedding read from the int8 output head it is tied to: row t of the table is row t
    of the head (codes × the row's scale). A GGUF file keeps one table for both, as llama.cpp
    uses it; holding the head and the table in its blocks besides would be a second copy (28 MB
    of the demo's 98)."""

    def __init__(self, head: torch.nn.Module) -> None:
        super().__init__()
        self._head = (head,)  # a tuple, not a submodule: its buffers are the head's, counted once
        self.dtype = head.scales.dtype
        self.shape = (head.out_features, head.in_features)

    @property
    def device(self) -> torch.device:
        return self._head[0].packed.device

    def rows(self, tokens: torch.Tensor) -> torch.Tensor:
        head = self._head[0]
        flat = tokens.reshape(-1)
        values = head.packed[flat].to(self.dtype) * head.scales[flat, None].to(self.dtype)
        return values.view(*tokens.shape, self.shape[1])


def share_tied_head(model: torch.nn.Module) -> None:
    """Once quantized: a table kept in its blocks and tied to a head that became int8 is read from
    the head instead (HeadRows). A head of int4 codes keeps the table: its packed layout has no
    rows to read. A head kept in the file's blocks (block_linear.py) is the table's own bytes:
    the table reads its rows from the head's copy, so the process holds them once."""
    from llmcli.models.block_linear import BlockLinear

    head = model.get_output_embeddings()
    table = model.get_input_embeddings()
    same_blocks = isinstance(head, BlockLinear) and head.type_name == getattr(table, "type_name", None)
    if isinstance(table, BlockEmbedding) and same_blocks:
        table.blocks = head.blocks
        return
    if isinstance(model.get_input_embeddings(), BlockEmbedding) and getattr(head, "kind", None) == "int8":
        model.model.embed_tokens = HeadRows(head)
