"""The native backend over a paged KV cache (paged_kvcache.py): it tells the cache the token
ids of each pass (their blocks' content keys), starts a prefill with the blocks another sequence
published for the same tokens after the same text (from an empty cache, or one cropped back to a
block's end), and decodes through paged_step.py (attention read from the blocks in place).
Every other pass is NativeBackend's own.

Not yet chosen by anything: the CPU keeps its contiguous slots (pool.py; issue 28 measured why),
and a GPU server is to take it once the scheduler steps its sequences through
paged_step.PagedSteps (graphed) and preempts on blocks.OutOfBlocks.
"""

from __future__ import annotations

from typing import Any

import torch

from llmcli.engine.native.backend import NativeBackend
from llmcli.engine.native.blocks import BLOCK_SIZE
from llmcli.engine.native.paged_kvcache import PagedKVCache, PagedStore
from llmcli.engine.native.paged_step import PagedAttention, PagedSteps, decode_sequences


class PagedBackend(NativeBackend):
    """The native backend over a paged cache in `store` (a pool made for the model holding one
    context, where None): each pass's token ids told to the cache first, a prefill starting with the
    blocks published for its tokens, and each decode step reading
    the blocks in place (paged_step.py) through `attend` (by default the device's kernel)."""

    def __init__(
        self,
        model: Any,
        context_length: int,
        *,
        store: PagedStore | None = None,
        net: Any = None,
        attend: PagedAttention | None = None,
        graphs: bool = False,
    ) -> None:
        """`graphs`: replay the decode step from a CUDA graph (paged_step.PagedSteps: one for
        every length, the block table read from a fixed buffer)."""
        super().__init__(model, context_length, net=net)
        self.store = store or PagedStore.for_net(self.net, -(-context_length // BLOCK_SIZE))
        self.cache = PagedKVCache(self.store, context_length)  # type: ignore[assignment]
        self.attend = attend
        self.steps = PagedSteps(self.net, self.store, context_length, graphs=graphs, attend=attend)

    def prefill(self, ids: list[int], ends_prompt: bool = True) -> torch.Tensor:
        if ids:
            ids = ids[self.cache.share_prefix(ids) :]
        self.cache.expect(ids)
        return super().prefill(ids, ends_prompt)

    def score(self, ids: list[int]) -> torch.Tensor:
        self.cache.expect(ids)
        return super().score(ids)

    @torch.inference_mode()
    def decode(self, token: torch.Tensor) -> torch.Tensor:
        ids = token.view(-1).tolist()  # a sync on a GPU: the token's id keys its block
        if self.cache.shifts:  # an image moved text positions: the eager step takes them
            return decode_sequences(self.net, token.view(1), [self.cache], self.attend)  # type: ignore[list-item]
        return self.steps.decode(ids, [self.cache])  # type: ignore[list-item]
