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

from typing import Protocol

import torch


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

    def attach(self, cache: PooledCache) -> int:
        self.caches.append(cache)
        return len(self.caches) - 1

    def ensure(self, slot: int, capacity: int) -> None:
        """Make room for `slot` and `capacity` positions in every slot, keeping what each holds."""
        slots, capacity = max(self.slots, slot + 1), max(self.capacity, capacity)
        if slots == self.slots and capacity == self.capacity:
            return
        for store in (self.keys, self.values):
            for layer, old in enumerate(store):
                if old is None:
                    continue
                new = self._empty(slots, capacity, layer)
                new[: self.slots, :, : self.capacity] = old
                store[layer] = new  # one layer at a time: the old tensor goes before the next is made
        self.slots, self.capacity = slots, capacity
        for cache in self.caches:
            cache.bind_pool()

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
