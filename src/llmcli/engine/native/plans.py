"""Attention plans: how one pass of the native forward writes its keys and values into the KV
cache and which of them each row attends to. The layer loop (forward.py) is written once; a
plan is what differs between a prefill, a decode step, a graphed step and a speculative check,
and each exists for an exactness or a speed rule, said in its docstring.

A plan gives the pass's `positions` (cache slots, and RoPE unless `rope_positions` differ:
after an image in Qwen's multimodal RoPE, text moves back; an image's own rows take [3, T]
positions over its grid), `attend` (per layer: q, k, v → attention output,
before the output projection), `finish` (the cache's new length, where the plan owns it) and
`last_only` (the logits of the last row only).

A sliding layer whose cache is a ring (kvcache.py) is written and read through the ring in every
plan: a chunk attends to copies of the window before it and then stores its own last positions;
a step writes its slot and attends over the ring with a mask of the positions the slots hold.
"""

from __future__ import annotations

from typing import Protocol

import torch

from llmcli.engine.image_rows import PassImages
from llmcli.engine.native.attention import Attention
from llmcli.engine.native.kvcache import KVCache
from llmcli.engine.native.pool import SlotPool


class Plan(Protocol):
    positions: torch.Tensor
    rope_positions: torch.Tensor | None
    last_only: bool

    def attend(
        self, attention: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...

    def finish(self) -> None: ...


def windowed(mask: torch.Tensor, positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """`mask` (slots along its last dimension, one row per position, or one row) also keeping
    each position's slots within a sliding window: those past `position − window`."""
    if window is None:
        return mask
    slots = torch.arange(mask.shape[-1], device=mask.device)
    inside = slots[None, :] > positions.view(-1, 1) - window  # [rows, slots]
    return mask & inside.view(*mask.shape[:-2], -1, mask.shape[-1]) if mask.dim() > 2 else mask & inside


def ring_step(
    cache: KVCache,
    attention: Attention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    position: torch.Tensor,
    span: int,
) -> torch.Tensor:
    """One token at `position` (a [1] tensor) in a ring layer: stored, then attending over the
    first `span` slots (the whole ring, or fewer while the positions have not reached it)."""
    layer = attention.layer
    cache.write_ring(layer, k, v, position)
    mask = cache.ring_mask(layer, position, position, span).view(1, 1, 1, span)
    return attention.attend(q, cache.keys[layer][:, :span], cache.values[layer][:, :span], mask)


class CausalChunk:
    """A prefill chunk: T tokens after what is cached, each attending to everything before it.
    From an empty cache that is plain causal attention, which has the fastest kernels. Only the
    last row's logits are computed: nothing else is sampled from."""

    last_only = True

    def __init__(
        self, cache: KVCache, count: int, device: torch.device, images: PassImages | None = None
    ) -> None:
        self.cache, self.start = cache, cache.length
        cache.ensure(self.start + count)
        self.positions = torch.arange(self.start, self.start + count, device=device)
        self.rope_positions = _shifted(self.positions, cache)
        # Images in the chunk (image_rows.py): rows the forward replaces, their RoPE positions,
        # and where the model asks, each image's rows attending to each other both ways.
        self.images = images
        self.both_ways: torch.Tensor | None = None
        if images is not None:
            if images.rope_positions is not None:
                self.rope_positions = images.rope_positions
            if images.groups is not None:
                groups = images.groups
                self.both_ways = (groups[:, None] == groups[None, :]) & (groups >= 0)[:, None]
        # Each ring layer's window before the chunk, read once and the chunk written once: a
        # layer reading another's slot (Gemma 4's shared KV) comes after the owner has written
        # the chunk over that window.
        self.before: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def attend(self, attention: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache, layer = self.cache, attention.layer
        both_ways = self.both_ways if attention.sees_images_whole else None
        if cache.rings[layer] is None:
            keys, values = cache.write(layer, k, v)  # up to and including these tokens
            return attention.attend_causal(q, keys, values, both_ways)
        # Read before writing: a chunk longer than the slack overwrites the window before it.
        assert attention.window is not None
        if layer not in self.before:
            self.before[layer] = cache.recent(layer, self.start, attention.window - 1)
            cache.write_ring(layer, k, v, self.positions)
        before_k, before_v = self.before[layer]
        keys, values = torch.cat((before_k, k), dim=1), torch.cat((before_v, v), dim=1)
        return attention.attend_causal(q, keys, values, both_ways)

    def finish(self) -> None:
        end = self.start + self.positions.shape[0]
        self.cache.length = end
        if self.images is not None:
            for index, shift in self.images.shifts:
                self.cache.shift_from(index, shift)


def _shifted(positions: torch.Tensor, cache: KVCache) -> torch.Tensor | None:
    """The RoPE positions of text at these cache positions, where an image moved them
    (KVCache.shifts); None where they are the positions themselves."""
    shift = cache.rope_shift
    return positions + shift if shift else None


class ExactDecode:
    """One token attending over exactly the positions filled: the reference decode step, and
    the one a CPU runs (no graph to replay there). The caller advances the cache's length."""

    last_only = True

    def __init__(self, cache: KVCache, position: int, device: torch.device) -> None:
        self.cache, self.span = cache, position + 1
        self.positions = torch.tensor([position], device=device)
        self.rope_positions = _shifted(self.positions, cache)

    def attend(self, attention: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ring = self.cache.rings[attention.layer]
        if ring is not None:
            return ring_step(self.cache, attention, q, k, v, self.positions, min(self.span, ring))
        keys, values = self.cache.write_at(attention.layer, k, v, self.positions, self.span)
        return attention.attend(q, keys, values, None)

    def finish(self) -> None:
        pass


class SequencesStep:
    """One token of each of several sequences: the projections and the MLP take the rows
    together (one read of the weights for them all). Where the caches share a pool (pool.py),
    attention is one masked call over their slots (`PooledRows`); elsewhere (ring layers, scores
    by hand, caches of their own) each row attends over its own cache as its ExactDecode would.
    Every row's logits are computed, and each cache's length moves on by its token."""

    last_only = False

    def __init__(self, steps: list[ExactDecode]) -> None:
        self.steps = steps
        self.positions = torch.cat([step.positions for step in steps])
        self.rope_positions = None
        if any(step.rope_positions is not None for step in steps):
            at = [step.positions if step.rope_positions is None else step.rope_positions for step in steps]
            self.rope_positions = torch.cat(at)
        self.pooled = PooledRows.of([step.cache for step in steps], self.positions)

    def attend(self, attention: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.pooled is not None and self.pooled.serves(attention):
            return self.pooled.attend(attention, q, k, v)
        return torch.cat([
            step.attend(attention, q[:, row : row + 1], k[:, row : row + 1], v[:, row : row + 1])
            for row, step in enumerate(self.steps)
        ])  # fmt: skip

    def finish(self) -> None:
        for step in self.steps:
            step.cache.length += 1


class BucketStep:
    """One token attending over its whole length bucket, later slots masked: one fixed span
    serves every position in the bucket, so the shapes and addresses stay the same from token
    to token, which a CUDA graph needs. The position is a device tensor (the graph reads it from
    a fixed buffer). The caller advances the cache's length."""

    last_only = True
    rope_positions = None  # the backend does not replay a graph after an image moved positions

    def __init__(self, cache: KVCache, position: torch.Tensor, bucket: int) -> None:
        self.cache, self.positions, self.bucket = cache, position, bucket
        self.mask = (torch.arange(bucket, device=position.device) <= position).view(1, 1, 1, bucket)

    def attend(self, attention: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ring = self.cache.rings[attention.layer]
        if ring is not None:  # the whole ring: one span for every position, as a graph needs
            return ring_step(self.cache, attention, q, k, v, self.positions, ring)
        keys, values = self.cache.write_at(attention.layer, k, v, self.positions, self.bucket)
        return attention.attend(q, keys, values, windowed(self.mask, self.positions, attention.window))

    def finish(self) -> None:
        pass


class PerRowCheck:
    """Speculative decoding's check on a CPU: T tokens after what is cached, row i what the
    decode step would give after the first i + 1 of them. The weights are read once for all rows
    (a matrix product of T rows rounds within ~1e-6 of T products of one in fp32 on this torch;
    the greedy tokens are the same, as the tests check); attention runs per row, as the decode
    step runs it (over exactly the positions seen, or with `buckets` over the bucket with a
    mask), because an attention kernel's result depends on how many keys it is handed."""

    last_only = False

    def __init__(self, cache: KVCache, count: int, buckets: bool, device: torch.device) -> None:
        self.cache, self.start, self.buckets, self.device = cache, cache.length, buckets, device
        cache.ensure(self.start + count)
        self.positions = torch.arange(self.start, self.start + count, device=device)
        self.rope_positions = _shifted(self.positions, cache)

    def attend(self, attention: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache, layer = self.cache, attention.layer
        ring = cache.rings[layer]
        if ring is not None:  # each row written just before it attends, as its decode step would be
            return torch.cat([
                ring_step(
                    cache, attention, q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1],
                    self.positions[i : i + 1], ring if self.buckets else min(self.start + i + 1, ring),
                )
                for i in range(self.positions.shape[0])
            ])  # fmt: skip
        cache.write(layer, k, v)
        keys, values = cache.keys[layer], cache.values[layer]
        rows = []
        for i in range(self.positions.shape[0]):
            seen = self.start + i + 1
            span, mask = seen, None
            if self.buckets:
                span = cache.bucket_for(seen)
                mask = (torch.arange(span, device=self.device) < seen).view(1, 1, 1, span)
                mask = windowed(mask, self.positions[i : i + 1], attention.window)
            rows.append(attention.attend(q[:, i : i + 1], keys[:, :span], values[:, :span], mask))
        return torch.cat(rows)

    def finish(self) -> None:
        self.cache.length = self.start + self.positions.shape[0]


class RowsInOneCall:
    """The check pass with fixed shapes, for a CUDA graph: R tokens at `positions` (a device
    tensor), each attending to the first `span` slots up to its own position, all rows in one
    call per layer (a graph's launches do not depend on R). A row's rounding is not the decode
    step's bit for bit here, as on a GPU the matrix products' are not either. The caller sets
    the cache's length."""

    last_only = False
    rope_positions = None  # as BucketStep's

    def __init__(self, cache: KVCache, positions: torch.Tensor, span: int) -> None:
        self.cache, self.positions, self.span = cache, positions, span
        self.mask = torch.arange(span, device=positions.device)[None, :] <= positions[:, None]

    def attend(self, attention: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache, layer = self.cache, attention.layer
        ring = cache.rings[layer]
        if ring is not None:  # every row written first (the slack keeps the first row's window)
            cache.write_ring(layer, k, v, self.positions)
            mask = cache.ring_mask(layer, self.positions, self.positions[-1:], ring)
            return attention.attend_rows(q, cache.keys[layer], cache.values[layer], mask)
        keys, values = cache.write_at(layer, k, v, self.positions, self.span)
        return attention.attend_rows(q, keys, values, windowed(self.mask, self.positions, attention.window))

    def finish(self) -> None:
        pass


# One masked call over a pool's slots attends over the longest sequence's span for every slot
# between the lowest and the highest: it pays where the positions attended to are at least this
# share of that (measured on the demo, 2 cores: 4 sequences of ~250 tokens 76 µs a layer against
# 124 for four calls; of 100, 250, 400 and 500 tokens, a share of 0.63, 125 against 129).
POOLED_FILL = 0.6


class PooledRows:
    """The attention of a SequencesStep whose caches are slots of one pool: each layer writes
    every row's key and value in one indexed store and attends in one call over the slots from
    the lowest to the highest of the step's, each slot masked to its own positions (up to its
    token, within a sliding window where the layer has one), over the longest of them. A slot
    between them with no row in this step attends to its first position only, and its output
    is dropped. In fp32 a row equals its lone step's within 1e-5 (tests/test_native.py)."""

    def __init__(self, pool: SlotPool, slots: list[int], positions: torch.Tensor) -> None:
        device = positions.device
        self.pool, self.low = pool, min(slots)
        self.span = max(slots) - self.low + 1
        self.slots = torch.tensor(slots, device=device)
        self.positions = positions
        self.seen = int(positions.max()) + 1
        rows = [slot - self.low for slot in slots]
        # Rows in slot order without a gap: the queries are the call's batch as they are.
        self.rows = None if rows == list(range(self.span)) else torch.tensor(rows, device=device)
        newest = torch.zeros(self.span, dtype=torch.long, device=device)
        newest[torch.tensor(rows, device=device)] = positions
        mask = (torch.arange(self.seen, device=device) <= newest.view(-1, 1)).view(self.span, 1, 1, self.seen)
        self.masks = StepMasks(mask, newest)

    @classmethod
    def of(cls, caches: list[KVCache], positions: torch.Tensor) -> PooledRows | None:
        """The pooled attention for these caches' step, or None: they are not in one pool, or
        their lengths are too unlike for one call over the longest to pay (POOLED_FILL)."""
        pool = caches[0].pool
        if pool is None or any(cache.pool is not pool for cache in caches):
            return None
        slots = [cache.slot for cache in caches]
        assert None not in slots
        seen = [cache.length + 1 for cache in caches]
        span = max(slots) - min(slots) + 1  # type: ignore[operator]
        if sum(seen) < POOLED_FILL * span * max(seen):
            return None
        return cls(pool, slots, positions)  # type: ignore[arg-type]

    def serves(self, attention: Attention) -> bool:
        return self.pool.pooled[attention.layer] and not attention.scored

    def attend(self, attention: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [heads, B, d], k and v [kv_heads, B, d] → [B, heads × d]."""
        keys, values = self.pool.keys[attention.layer], self.pool.values[attention.layer]
        assert keys is not None and values is not None
        keys[self.slots, :, self.positions] = k.transpose(0, 1)
        values[self.slots, :, self.positions] = v.transpose(0, 1)
        if self.rows is not None:
            spread = q.new_zeros(q.shape[0], self.span, q.shape[2])
            spread[:, self.rows] = q
            q = spread
        span = slice(self.low, self.low + self.span)
        mask = self.masks.within(attention.window)
        out = attention.attend_batch(q, keys[span, :, : self.seen], values[span, :, : self.seen], mask)
        return out if self.rows is None else out[self.rows]


class StepMasks:
    """A step's attention mask [B, 1, 1, S] (row b's slots up to positions[b]) and, made once
    a pass for each window a layer has, that mask within the window."""

    def __init__(self, mask: torch.Tensor, positions: torch.Tensor) -> None:
        self.mask, self.positions = mask, positions
        self._windowed: dict[int, torch.Tensor] = {}

    def within(self, window: int | None) -> torch.Tensor:
        if window is None:
            return self.mask
        if window not in self._windowed:
            self._windowed[window] = windowed(self.mask, self.positions, window)
        return self._windowed[window]


class PaddedRows:
    """The decode step of several sequences with fixed shapes, for a CUDA graph per (batch
    bucket, length bucket) (batched.py): row b is the token at positions[b] of the pool's slot
    slots[b], both device tensors (a graph reads them from fixed buffers). Each layer writes
    every row's key and value in one indexed store and attends in one call, each row over the
    first `bucket` positions of its own slot (copied out by slot index: a graph cannot take a
    slice that depends on which slots step) masked to its own positions, within a sliding
    window where the layer has one. Rows that only pad the batch to its bucket write a slot
    no sequence holds (SlotPool.scratch_slot) and their logits are dropped. The caller moves
    the caches' lengths on. Every attention layer must live in the pool: rings and recurrent
    states are per cache, at addresses a graph of this step cannot follow (batched.py)."""

    last_only = False
    rope_positions = None  # the batched step is not taken after an image moved positions

    def __init__(self, pool: SlotPool, positions: torch.Tensor, slots: torch.Tensor, bucket: int) -> None:
        self.pool, self.positions, self.slots, self.bucket = pool, positions, slots, bucket
        index = torch.arange(bucket, device=positions.device)
        self.masks = StepMasks((index <= positions.view(-1, 1)).view(-1, 1, 1, bucket), positions)

    def attend(self, attention: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = self.pool.keys[attention.layer], self.pool.values[attention.layer]
        assert keys is not None and values is not None, "a layer the pool does not hold"
        keys[self.slots, :, self.positions] = k.transpose(0, 1)
        values[self.slots, :, self.positions] = v.transpose(0, 1)
        own_keys = keys[:, :, : self.bucket].index_select(0, self.slots)
        own_values = values[:, :, : self.bucket].index_select(0, self.slots)
        return attention.attend_batch(q, own_keys, own_values, self.masks.within(attention.window))

    def finish(self) -> None:
        pass
