"""The decode step over a paged KV cache: one token of each of several sequences, its keys and
values written into each sequence's block and its attention read from the blocks in place, one
kernel call per layer for every sequence (paged_cuda on a GPU, paged_cpu's compiled kernel on a
CPU), whatever their lengths: no gathering, no padding to the longest.

A plan as plans.py's are (forward.py runs it): the projections and the MLP take the rows
together, as in plans.SequencesStep; only attention differs. Every row's logits are computed,
and each cache's length moves on by its token (its full blocks then published).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from llmcli.engine.native import paged_cpu, paged_cuda
from llmcli.engine.native.attention import Attention
from llmcli.engine.native.paged_cpu import AttentionRules, PagedKV

if TYPE_CHECKING:
    from llmcli.engine.native.paged_kvcache import PagedKVCache

# q [batch, q_tokens, heads, d], a layer's pool as the batch sees it, the scoring rules → out.
PagedAttention = Callable[[torch.Tensor, PagedKV, AttentionRules], torch.Tensor]


def attention_for(device: torch.device) -> PagedAttention:
    """The kernel that reads blocks in place on `device` (each falls back to gathering for
    what it does not take)."""
    return paged_cuda.paged_attention if device.type == "cuda" else paged_cpu.paged_attention


class PagedRows:
    last_only = False

    def __init__(self, caches: list[PagedKVCache], attend: PagedAttention | None = None) -> None:
        """`caches`: one token each, of one store, given room for it (ensure) already."""
        store = caches[0].store
        assert all(cache.store is store for cache in caches)
        device = store.device
        self.caches, self.store = caches, store
        self.kernel = attend or attention_for(device)
        lengths = [cache.length for cache in caches]
        self.positions = torch.tensor(lengths, device=device)
        shifted = [length + cache.rope_shift for length, cache in zip(lengths, caches, strict=True)]
        self.rope_positions = None if shifted == lengths else torch.tensor(shifted, device=device)
        size = store.block_size
        widest = max(len(cache.table.blocks) for cache in caches)
        tables = [cache.table.blocks + [0] * (widest - len(cache.table.blocks)) for cache in caches]
        self.tables = torch.tensor(tables, dtype=torch.int32, device=device)
        self.lengths = torch.tensor([length + 1 for length in lengths], dtype=torch.int32, device=device)
        self.slots = torch.tensor(
            [cache.table.blocks[length // size] for length, cache in zip(lengths, caches, strict=True)],
            device=device,
        )
        self.offsets = self.positions % size

    def attend(self, attention: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [heads, B, d], k and v [kv_heads, B, d] → [B, heads × d]."""
        keys, values = self.store.keys[attention.layer], self.store.values[attention.layer]
        keys[self.slots, self.offsets] = k.transpose(0, 1)
        values[self.slots, self.offsets] = v.transpose(0, 1)
        rules = AttentionRules(attention.scale, attention.window, attention.softcap, attention.sinks)
        out = self.kernel(
            q.transpose(0, 1).unsqueeze(1), PagedKV(keys, values, self.tables, self.lengths), rules
        )
        return out.reshape(q.shape[1], -1)

    def finish(self) -> None:
        for cache in self.caches:
            cache.length += 1


def decode_sequences(
    net: object, tokens: torch.Tensor, caches: list[PagedKVCache], attend: PagedAttention | None = None
) -> torch.Tensor:
    """One token [B] for each of B sequences, token b after what caches[b] holds: logits [B,
    vocab]; each cache holds its token after. `net`: their model (forward.Transformer). Room is
    made for every token before any is written: blocks.OutOfBlocks leaves the others as they
    were up to the sequence that did not fit (the scheduler preempts and retries)."""
    for cache, token in zip(caches, tokens.tolist(), strict=True):  # a sync on a GPU: no graph yet
        cache.expect([token])
        cache.ensure(cache.length + 1)
    return net.forward(tokens, PagedRows(caches, attend))  # type: ignore[attr-defined]
