"""Several sequences' KV caches in one tensor per layer, so one attention call serves them all.

A decode step of B sequences reads the weights once for all of them (plans.SequencesStep), but
attention is per sequence: B small attention calls per layer, each over its own cache. On a CPU
those calls are a third of a 4-sequence step of the demo, and most of that is per-call cost
(one call hands 2 threads 3 heads of work). With the caches laid out as [slots, kv_heads,
capacity, head_dim], the step's sequences are one slice of the pool: one masked attention call
per layer over all of them, and one write of their keys and values (measured on the demo, 2
cores, 4 sequences of ~250 tokens: 12.9 ms a step against 15.9).

Each sequence's cache (kvcache.KVCache with a pool) holds views of its slot, so everything else
(prefill, a lone decode step, speculative checks, save and restore) works on it unchanged. The
pool grows in both dimensions as needed, slots as sequences attach and use them, capacity in the
caches' buckets; growing moves the tensors, and every attached cache is given its new views.
The memory is slots × the longest bucket any of them reached; a server bounds it (scheduler.Slots).
A paged pool (blocks of a few dozen tokens, a table per sequence) would hold sequences of unlike
lengths more tightly, but its attention must gather each sequence's blocks first, which on this
CPU costs more than the batching saves (docs/benchmarks.md).

Sliding-window layers keep their rings in each cache (kvcache.py): a ring is the window's size
whatever the text's length, and its layers attend per sequence.
"""

from __future__ import annotations

import itertools
from typing import Protocol

import torch

# Every layout of a pool's tensors gets a version no other had: a graph of the batched step
# (batched.py) recorded their addresses and is captured again once they move.
_STORAGE_VERSIONS = itertools.count(1)


class PooledCache(Protocol):
    """A sequence's cache holding views of its slot (kvcache.KVCache): told when the pool moved."""

    def bind_pool(self) -> None: ...


def position_bytes(kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """One position's keys and values in one layer."""
    return 2 * kv_heads * head_dim * dtype.itemsize


class SlotPool:
    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        pooled: list[bool],
        dtype: torch.dtype,
        device: torch.device,
        shapes: list[tuple[int, int]] | None = None,
    ) -> None:
        """`pooled`: per layer, whether it lives here (a ring layer does not). `shapes`: each
        layer's (KV heads, head width) where they differ between layers."""
        self.shape = (kv_heads, head_dim)
        self.shapes = shapes or [self.shape] * layers
        self.pooled = pooled
        self.dtype, self.device = dtype, device
        self.slots = 0  # allocated
        self.capacity = 0
        self.keys: list[torch.Tensor | None] = [
            self._empty(0, 0, i) if p else None for i, p in enumerate(pooled)
        ]
        self.values: list[torch.Tensor | None] = [
            self._empty(0, 0, i) if p else None for i, p in enumerate(pooled)
        ]
        self.caches: list[PooledCache] = []  # attached, their slot their index
        self.held = 0  # one past the highest slot a cache has asked room for
        self.storage_version = next(_STORAGE_VERSIONS)

    def attach(self, cache: PooledCache) -> int:
        self.caches.append(cache)
        return len(self.caches) - 1

    def ensure(self, slot: int, capacity: int) -> None:
        """Make room for `slot` and `capacity` positions in every slot, keeping what each holds."""
        self.held = max(self.held, slot + 1)
        moved = self._grow(max(self.slots, slot + 1), max(self.capacity, capacity))
        if not moved and slot < len(self.caches):
            # The slot was made before its cache asked (as the scratch slot, below): it holds
            # no views of it yet.
            self.caches[slot].bind_pool()

    def scratch_slot(self) -> int:
        """A slot no sequence's cache holds, with room made: one past the highest that does.
        The padding rows of a fixed-shape batched step write there (plans.PaddedRows). A cache
        that has not asked for room yet may sit at its index, holding no views (`_grow`); once
        it asks, it is bound there and the next scratch slot is made past it."""
        self._grow(max(self.slots, self.held + 1), self.capacity)
        return self.held

    def _grow(self, slots: int, capacity: int) -> bool:
        """Whether the tensors moved to hold `slots` × `capacity`. Every layer's new tensor is
        made before any is swapped in: an out-of-memory error part way leaves the pool as it
        was (the caches' views keep the old tensors alive until they are bound again anyway)."""
        if slots == self.slots and capacity == self.capacity:
            return False
        self.storage_version = next(_STORAGE_VERSIONS)
        grown = [
            [None if old is None else self._empty(slots, capacity, layer) for layer, old in enumerate(store)]
            for store in (self.keys, self.values)
        ]
        for store, news in zip((self.keys, self.values), grown, strict=True):
            for layer, (old, new) in enumerate(zip(store, news, strict=True)):
                if old is not None and new is not None:
                    new[: self.slots, :, : self.capacity] = old
                    store[layer] = new
        self.slots, self.capacity = slots, capacity
        # Only the caches that asked for room: one that has not may be attached at the scratch
        # slot's index, and must not hold views of what padding rows write.
        for cache in self.caches[: self.held]:
            cache.bind_pool()
        return True

    def view(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer], self.values[layer]
        assert keys is not None and values is not None
        return keys[slot], values[slot]

    def bytes_for(self, slots: int, capacity: int) -> int:
        pooled = [shape for shape, pooled in zip(self.shapes, self.pooled, strict=True) if pooled]
        return sum(position_bytes(*shape, self.dtype) for shape in pooled) * slots * capacity

    def nbytes(self) -> int:
        return self.bytes_for(self.slots, self.capacity)

    def _empty(self, slots: int, capacity: int, layer: int) -> torch.Tensor:
        kv_heads, head_dim = self.shapes[layer]
        return torch.zeros(slots, kv_heads, capacity, head_dim, dtype=self.dtype, device=self.device)
