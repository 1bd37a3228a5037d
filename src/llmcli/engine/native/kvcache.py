"""The native engine's KV cache: per-layer K and V tensors, preallocated, grown in buckets.

Each layer holds keys and values as [kv_heads, capacity, head_dim]. `length` is how many
positions hold real tokens; cropping is setting it (what lies past it is never attended to and
is overwritten by the next tokens), so chat /undo, template rewrites, overflow and Ctrl-C cost
nothing. Capacity starts at the first bucket and doubles as the text grows, up to the context:
a 128k-context model does not reserve its whole cache before the first message. Buckets are
powers of two (at least MIN_BUCKET), so a decode step attends over the bucket its length falls
in, not over the whole context, and each bucket's step has fixed shapes for a CUDA graph.
Growing moves the tensors, which `storage_version` tells the graphs (they must be captured again).

A layer may hold no keys and values at all (`kv_layers`): a linear-attention layer keeps a
recurrent state instead (recurrent_cache.py), and reserving positions for it would waste memory.

A sliding-window layer (Gemma 2 and 3's local layers, gpt-oss's, Mistral v0.1's) keeps a ring of
its last `window + slack` positions, position p in slot p mod ring: its memory stays flat however
long the text grows.
The slack lets a speculative check write its rows before they are cropped back, and a chat
template rewrite the end of a turn, without losing a position the window still needs. A crop
further back than the rings can restore empties the cache (`length` says what was kept): the
positions it would need are overwritten, and the caller prefills again.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from llmcli.engine.native.pool import SlotPool, position_bytes

MIN_BUCKET = 256
# Every cache's tensors get a version no other cache's ever had: a graph captured on one cache's
# addresses is never replayed on another's (a server's first slot is given a pooled cache).
_STORAGE_VERSIONS = itertools.count(1)
# Positions a ring keeps beyond its window: more than a speculative check writes (17 rows).
RING_SLACK = 64


def ring_size(window: int | None, context_length: int) -> int | None:
    """Slots of a sliding layer's ring, or None where a ring would save nothing. Above a bucket a
    multiple of one, so split attention (attention.py) divides it evenly."""
    if window is None:
        return None
    size = window + RING_SLACK
    if size > MIN_BUCKET:
        size = -(-size // MIN_BUCKET) * MIN_BUCKET
    return size if size < context_length else None


@dataclass
class SavedCache:
    length: int
    written: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    shifts: tuple[tuple[int, int], ...] = ()  # KVCache.shifts

    def nbytes(self) -> int:
        return bytes_of([*self.keys, *self.values])

    def resumable(self, length: int) -> int:
        """The longest prefix, at most `length` tokens, a cache restored from this copy can be
        cropped to: any (keys and values are per position)."""
        return length


def bytes_of(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class KVCache:
    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        context_length: int,
        dtype: torch.dtype,
        device: torch.device,
        windows: list[int | None] | None = None,
        pool: SlotPool | None = None,
        kv_layers: list[bool] | None = None,
        shapes: list[tuple[int, int]] | None = None,
    ) -> None:
        """`pool`: hold the layers without a ring in a slot of this pool (pool.py), beside other
        sequences' caches, rather than in tensors of its own. `kv_layers`: per layer, whether it
        keeps keys and values (all do by default); one that does not (a linear-attention layer,
        a layer reading another's) holds empty tensors. `shapes`: each layer's (KV heads, head
        width) where they differ between layers (Gemma 4's full layers are wider)."""
        self.shape = (kv_heads, head_dim)
        self.shapes = shapes or [self.shape] * layers
        self.windows = windows or [None] * layers
        self.kv_layers = kv_layers or [True] * layers
        self.rings = [ring_size(window, context_length) for window in self.windows]
        # Every position below `written` − ring may be overwritten in a ring: the furthest any
        # pass reached (a crop does not lower it), so what a crop can keep is known.
        self.written = 0
        self.context_length = context_length
        self.dtype = dtype
        self.device = device
        self.keys: list[torch.Tensor] = [self._empty(0, layer) for layer in range(layers)]
        self.values: list[torch.Tensor] = [self._empty(0, layer) for layer in range(layers)]
        self.capacity = 0
        self.length = 0
        # Where text positions stop being the cache's indices: (from index, shift) after each
        # image whose rows span fewer RoPE positions than rows (Qwen's multimodal RoPE; the
        # table in engine/image_rows.py lays them out). The token at index i takes position
        # i + the last shift from at or before i; empty for text alone.
        self.shifts: list[tuple[int, int]] = []
        self.storage_version = next(_STORAGE_VERSIONS)
        self.pool = pool
        self.slot = pool.attach(self) if pool is not None else None

    def bucket_for(self, positions: int) -> int:
        """The attention span for a step that sees `positions` tokens: a power of two ≥ it."""
        return min(self.context_length, max(MIN_BUCKET, 1 << (positions - 1).bit_length()))

    def ensure(self, positions: int) -> None:
        """Make room for `positions` tokens, keeping the first `length`. Every pass asks for
        room up to the last position it writes."""
        self.written = max(self.written, positions)
        if positions <= self.capacity:
            return
        if positions > self.context_length:
            raise ValueError(f"{positions} positions do not fit a {self.context_length}-token cache")
        capacity = self.bucket_for(positions)
        # Before the first tensor moves: an out-of-memory error half way must not leave a graph
        # believing the moved layers are still where they were.
        self.storage_version = next(_STORAGE_VERSIONS)
        for store in (self.keys, self.values):
            for layer, old in enumerate(store):
                ring = self.rings[layer]
                if not self.kv_layers[layer]:
                    continue
                if ring is not None:  # made once, at its full size, and never moved
                    store[layer] = old if old.shape[1] else self._empty(ring, layer)
                    continue
                if self.pool is not None:
                    continue  # the pool's slot, below
                new = self._empty(capacity, layer)
                new[:, : self.length] = old[:, : self.length]
                store[layer] = new  # one layer at a time: the old tensor goes before the next is made
        if self.pool is not None:
            assert self.slot is not None
            self.pool.ensure(self.slot, capacity)  # binds every attached cache to the new tensors
        else:
            self.capacity = capacity

    def bind_pool(self) -> None:
        """Hold views of this cache's slot of the pool (again, after the pool moved). A layer
        the pool does not hold keeps its own: a ring, or nothing (a linear-attention layer)."""
        assert self.pool is not None and self.slot is not None
        self.storage_version = next(_STORAGE_VERSIONS)
        if self.slot >= self.pool.slots:
            return  # no room made for this slot yet
        for layer, ring in enumerate(self.rings):
            if self.pool.pooled[layer]:
                self.keys[layer], self.values[layer] = self.pool.view(layer, self.slot)
            elif ring is not None and self.keys[layer].shape[1] == 0:  # its own, made once at its full size
                self.keys[layer], self.values[layer] = self._empty(ring, layer), self._empty(ring, layer)
        self.capacity = self.pool.capacity

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

    def write_ring(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Store k, v [kv_heads, T, d] of `positions` [T] in a ring layer (only the last ring's
        worth when T is longer: the earlier ones would be overwritten by the later)."""
        ring = self.rings[layer]
        assert ring is not None
        slots = torch.remainder(positions[-ring:], ring)
        self.keys[layer].index_copy_(1, slots, k[:, -ring:])
        self.values[layer].index_copy_(1, slots, v[:, -ring:])

    def recent(self, layer: int, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of a ring layer's keys and values of the `count` positions before `start`
        (fewer at the beginning), oldest first: what a chunk starting there attends to."""
        ring = self.rings[layer]
        assert ring is not None
        positions = torch.arange(max(0, start - count), start, device=self.device)
        slots = torch.remainder(positions, ring)
        return self.keys[layer].index_select(1, slots), self.values[layer].index_select(1, slots)

    def ring_mask(
        self, layer: int, positions: torch.Tensor, newest: torch.Tensor, slots: int
    ) -> torch.Tensor:
        """Which of a ring layer's first `slots` slots each row at `positions` [R] attends to,
        [R, slots], once every position up to `newest` (a [1] tensor) is written: a slot holds
        the latest position of its residue, which must lie in the row's window."""
        ring, window = self.rings[layer], self.windows[layer]
        assert ring is not None and window is not None
        index = torch.arange(slots, device=positions.device)
        held = newest - torch.remainder(newest - index, ring)
        rows = positions.view(-1, 1)
        return (held >= 0) & (held <= rows) & (held > rows - window)

    def resumable(self, length: int) -> int:
        """The longest prefix, at most `length` tokens, a crop can keep: any, as the prefix store
        measures a KV cache (a ring that cannot go back that far says so in the crop)."""
        return length

    def crop(self, length: int) -> None:
        length = min(length, self.length)
        if not self._rings_hold_window_before(length):
            length = 0
        if length == 0:
            self.written = 0
        self.length = length
        if self.shifts:
            self.shifts = [shift for shift in self.shifts if shift[0] <= length]

    @property
    def rope_shift(self) -> int:
        """What the next token's RoPE position adds to its index (`shifts`)."""
        return self.shifts[-1][1] if self.shifts else 0

    def shift_from(self, index: int, shift: int) -> None:
        if shift != self.rope_shift:
            self.shifts.append((index, shift))

    def _rings_hold_window_before(self, length: int) -> bool:
        """Whether every ring still holds the positions a token at `length` attends to: none
        overwritten unless by positions at least a ring later, all of them past `length` − window."""
        return all(
            ring is None or self.written <= ring or self.written - ring <= length - window + 1
            for ring, window in zip(self.rings, self.windows, strict=True)
        )

    def save(self) -> SavedCache:
        """Copies, in host memory, of the positions held: a ring layer's whole ring (its slots
        are positions mod the ring), the other layers' first `length` positions."""
        keys, values = [], []
        for layer, ring in enumerate(self.rings):
            end = self.keys[layer].shape[1] if ring is not None else self.length
            keys.append(self.keys[layer][:, :end].to("cpu", copy=True))
            values.append(self.values[layer][:, :end].to("cpu", copy=True))
        return SavedCache(self.length, self.written, keys, values, tuple(self.shifts))

    @torch.inference_mode()  # the cache's tensors were made in inference mode
    def restore(self, saved: SavedCache) -> None:
        """Hold exactly what `save` copied. Into the tensors there are, grown if need be: a
        captured graph replays on their addresses."""
        self.ensure(saved.length)
        for store, copies in ((self.keys, saved.keys), (self.values, saved.values)):
            for layer, copy in enumerate(copies):
                store[layer][:, : copy.shape[1]].copy_(copy)
        self.length, self.written = saved.length, saved.written
        self.shifts = list(saved.shifts)

    @torch.inference_mode()
    def copy_prefix(self, source: KVCache, length: int) -> int:
        """Hold the first `length` positions `source` holds (another sequence over the same
        weights whose text starts as this one's will): a copy of their keys and values rather
        than a prefill of them. Returns the positions held now: `length`, or 0 where a ring
        of `source` has overwritten one of them (its slots are positions mod the ring)."""
        length = min(length, source.length)
        rings_intact = all(ring is None or source.written <= ring for ring in source.rings)
        if length == 0 or not rings_intact:
            return 0
        self.crop(0)
        self.ensure(length)
        for store, copies in ((self.keys, source.keys), (self.values, source.values)):
            for layer, copy in enumerate(copies):
                if self.kv_layers[layer]:
                    store[layer][:, :length].copy_(copy[:, :length])
        self.length = length
        self.shifts = [shift for shift in source.shifts if shift[0] <= length]
        return length

    def bytes_for(self, positions: int) -> int:
        """Bytes the keys and values take once the cache holds `positions` tokens: the bucket
        they fall in for each layer, a ring layer's whole ring."""
        bucket = self.bucket_for(max(positions, 1))
        return sum(
            self._position_bytes(layer) * (ring or bucket)
            for layer, ring in enumerate(self.rings)
            if self.kv_layers[layer]
        )

    def ring_bytes(self) -> int:
        """Bytes the ring layers take (their size does not depend on the text's length)."""
        return sum(
            self._position_bytes(layer) * ring for layer, ring in enumerate(self.rings) if ring is not None
        )

    def bytes_beside_pool(self) -> int:
        """Bytes a pooled sequence holds in tensors of its own, whatever its length: its rings."""
        return self.ring_bytes()

    def _position_bytes(self, layer: int) -> int:
        return position_bytes(*self.shapes[layer], self.dtype)

    def nbytes(self) -> int:
        """Bytes the keys and values take now (the figure the benchmarks report)."""
        return bytes_of([*self.keys, *self.values])

    def _empty(self, capacity: int, layer: int) -> torch.Tensor:
        kv_heads, head_dim = self.shapes[layer]
        return torch.zeros(kv_heads, capacity, head_dim, dtype=self.dtype, device=self.device)
