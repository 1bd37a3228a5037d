"""The native backend over a paged KV cache (paged_kvcache.py): it tells the cache the token
ids of each pass (their blocks' content keys), starts a prefill with the blocks another sequence
published for the same tokens after the same text (from an empty cache, or one cropped back to a
block's end), and decodes through paged_step.py (attention read from the blocks in place).
Every other pass is NativeBackend's own.

A server's slots take it where the KV layout is paged (paged_slots.py: the default on a GPU; the
CPU keeps its contiguous slots, pool.py, as issue 28 measured why): one store and one PagedSteps
for every slot, and a sequence that runs out of blocks preempted (`preempt`: its keys and values
copied to host memory, its blocks let go) and brought back later (`readmit`) by the scheduler.
"""

from __future__ import annotations

from typing import Any

import torch

from llmcli.engine.native.backend import NativeBackend
from llmcli.engine.native.blocks import BLOCK_SIZE
from llmcli.engine.native.kvcache import SavedCache
from llmcli.engine.native.paged_kvcache import PagedKVCache, PagedStore
from llmcli.engine.native.paged_step import PagedAttention, PagedSteps, decode_sequences
from llmcli.errors import KVMemoryFull


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
        steps: PagedSteps | None = None,
    ) -> None:
        """`graphs`: replay the decode step from a CUDA graph (paged_step.PagedSteps: one for
        every length, the block table read from a fixed buffer). `steps`: the decode steps of
        the store's other sequences, shared (one graph per batch size for all of them)."""
        super().__init__(model, context_length, net=net)
        self.store = store or PagedStore.for_net(self.net, -(-context_length // BLOCK_SIZE))
        self.cache = PagedKVCache(self.store, context_length)  # type: ignore[assignment]
        self.attend = attend
        self.steps = steps or PagedSteps(self.net, self.store, context_length, graphs=graphs, attend=attend)
        self.preempted: SavedCache | None = None  # what `preempt` set aside, until `readmit`

    def prefill(self, ids: list[int], ends_prompt: bool = True) -> torch.Tensor:
        """All or nothing: a pass that ran out of blocks part way (blocks.OutOfBlocks) leaves
        the cache as it was, so the scheduler may run the same pass again once it has room."""
        start = self.cache.length
        try:
            if ids:
                ids = ids[self.cache.share_prefix(ids) :]
            self.cache.expect(ids)
            return super().prefill(ids, ends_prompt)
        except KVMemoryFull:
            self.cache.crop(start)
            raise

    def share_prefix(self, ids: list[int]) -> int:
        """Hold the blocks published for `ids` (all but the last id's) from an empty cache: how
        many of them are held now, as a prefix the prompt need not prefill."""
        self.cache.crop(0)
        return self.cache.share_prefix(ids) if ids else 0

    def release(self) -> None:
        """The sequence's blocks let go (kept for their content where published)."""
        self.cache.release()

    def holds_blocks_alone(self) -> int:
        """Blocks of this sequence no other holds: what preempting it gives back."""
        return sum(self.store.blocks.refs(block) == 1 for block in self.cache.table.blocks)

    def preempt(self) -> None:
        """Let go of every block, its keys and values copied to host memory first (exact: the
        sequence goes on with the same tokens once `readmit`ted)."""
        self.preempted = self.cache.save()
        self.cache.release()

    def readmit(self) -> None:
        """Hold again what `preempt` set aside; blocks.OutOfBlocks (nothing held) where the pool
        has no room for it yet."""
        assert self.preempted is not None
        try:
            self.cache.restore(self.preempted)
        except KVMemoryFull:
            self.cache.release()
            raise
        self.preempted = None

    def score(self, ids: list[int]) -> torch.Tensor:
        self.cache.expect(ids)
        return super().score(ids)

    @torch.inference_mode()
    def decode(self, token: torch.Tensor) -> torch.Tensor:
        ids = token.view(-1).tolist()  # a sync on a GPU: the token's id keys its block
        if self.cache.shifts:  # an image moved text positions: the eager step takes them
            return decode_sequences(self.net, token.view(1), [self.cache], self.attend)  # type: ignore[list-item]
        logits = self.steps.decode(ids, [self.cache])  # type: ignore[list-item]
        # A graph's output is overwritten by its next replay, another sequence's maybe.
        return logits.clone() if self.steps.graphs is not None else logits
