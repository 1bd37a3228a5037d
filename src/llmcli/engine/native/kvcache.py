"""The native engine's KV cache: per-layer K and V tensors, preallocated, grown in buckets.

Each layer holds keys and values as [kv_heads, capacity, head_dim]. `length` is how many
positions hold real tokens; cropping is setting it (what lies past it is never attended to and
is overwritten by the next tokens), so chat /undo, template rewrites, overflow and Ctrl-C cost
nothing. Capacity starts at the first bucket and doubles as the text grows, up to the context:
a 128k-context model does not reserve its whole cache before the first message. Buckets are
powers of two (at least MIN_BUCKET), so a decode step attends over the bucket its length falls
in, not over the whole context, and each bucket's step has fixed shapes for a CUDA graph.
Growing moves the tensors, which `storage_version` tells the graphs (they must be captured again).
"""

from __future__ import annotations

import torch

MIN_BUCKET = 256


class KVCache:
    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        context_length: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.shape = (kv_heads, head_dim)
        self.context_length = context_length
        self.dtype = dtype
        self.device = device
        self.keys: list[torch.Tensor] = [self._empty(0) for _ in range(layers)]
        self.values: list[torch.Tensor] = [self._empty(0) for _ in range(layers)]
        self.capacity = 0
        self.length = 0
        self.storage_version = 0

    def bucket_for(self, positions: int) -> int:
        """The attention span for a step that sees `positions` tokens: a power of two ≥ it."""
        return min(self.context_length, max(MIN_BUCKET, 1 << (positions - 1).bit_length()))

    def ensure(self, positions: int) -> None:
        """Make room for `positions` tokens, keeping the first `length`."""
        if positions <= self.capacity:
            return
        if positions > self.context_length:
            raise ValueError(f"{positions} positions do not fit a {self.context_length}-token cache")
        capacity = self.bucket_for(positions)
        # Before the first tensor moves: an out-of-memory error half way must not leave a graph
        # believing the moved layers are still where they were.
        self.storage_version += 1
        for store in (self.keys, self.values):
            for layer, old in enumerate(store):
                new = self._empty(capacity)
                new[:, : self.length] = old[:, : self.length]
                store[layer] = new  # one layer at a time: the old tensor goes before the next is made
        self.capacity = capacity

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [kv_heads, T, d] at positions length … length + T − 1; return the layer's
        keys and values up to and including them. (`length` moves once the whole pass is done.)"""
        end = self.length + k.shape[1]
        keys, values = self.keys[layer], self.values[layer]
        keys[:, self.length : end] = k
        values[:, self.length : end] = v
        return keys[:, :end], values[:, :end]

    def write_at(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, position: torch.Tensor, attend: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store T tokens' k, v [kv_heads, T, d] at `position` (a [T] device tensor, so a graph
        replays it at any position); return the first `attend` slots of keys and values."""
        keys, values = self.keys[layer], self.values[layer]
        keys.index_copy_(1, position, k)
        values.index_copy_(1, position, v)
        return keys[:, :attend], values[:, :attend]

    def crop(self, length: int) -> None:
        self.length = min(length, self.length)

    def _empty(self, capacity: int) -> torch.Tensor:
        return torch.zeros(self.shape[0], capacity, self.shape[1], dtype=self.dtype, device=self.device)
