"""The decode step over a paged KV cache: one token of each of several sequences, its keys and
values written into each sequence's block and its attention read from the blocks in place, one
kernel call per layer for every sequence (paged_cuda on a GPU, paged_cpu's compiled kernel on a
CPU), whatever their lengths: no gathering, no padding to the longest.

A plan as plans.py's are (forward.py runs it): the projections and the MLP take the rows
together, as in plans.SequencesStep; only attention differs. The step's inputs (`StepInputs`)
are device tensors: made afresh for an eager step (`decode_sequences`), or copied into fixed
buffers that a CUDA graph replays (`PagedSteps`). As the kernel walks each sequence's own
length, a graph serves every length: one graph per batch size (padded to 1, 2, 4, 8, …), not
one per length bucket as the contiguous cache's graphs are (graphs.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from llmcli.engine.native import paged_cpu, paged_cuda
from llmcli.engine.native.attention import Attention
from llmcli.engine.native.graphs import StepGraphs
from llmcli.engine.native.paged_cpu import AttentionRules, PagedKV

if TYPE_CHECKING:
    from llmcli.engine.native.paged_kvcache import PagedKVCache, PagedStore

# q [batch, q_tokens, heads, d], a layer's pool as the batch sees it, the scoring rules → out.
PagedAttention = Callable[[torch.Tensor, PagedKV, AttentionRules], torch.Tensor]
# Batch sizes a graphed step is padded to (the last: the most sequences one step takes).
GRAPHED_BATCHES = (1, 2, 4, 8, 16, 32)


def attention_for(device: torch.device) -> PagedAttention:
    """The kernel that reads blocks in place on `device` (each falls back to gathering for
    what it does not take)."""
    return paged_cuda.paged_attention if device.type == "cuda" else paged_cpu.paged_attention


@dataclass
class StepInputs:
    """A step's rows on the device: each row's token, position, block table, length after its
    token, and the block and offset its token's keys and values go to. A padded row (past the
    sequences a graphed step holds) writes and reads the store's scratch block, one position."""

    tokens: torch.Tensor
    positions: torch.Tensor
    tables: torch.Tensor
    lengths: torch.Tensor
    slots: torch.Tensor
    offsets: torch.Tensor

    @classmethod
    def of(cls, caches: list[PagedKVCache], tokens: list[int], rows: int, width: int) -> StepInputs:
        """Host tensors for `caches` (given room for their tokens already), padded to `rows`
        rows and tables `width` blocks wide."""
        store = caches[0].store
        size, scratch = store.block_size, store.scratch
        padding = rows - len(caches)
        positions = [cache.length for cache in caches] + [0] * padding
        tables = torch.full((rows, width), scratch, dtype=torch.int32)
        for row, cache in enumerate(caches):
            tables[row, : len(cache.table.blocks)] = torch.tensor(cache.table.blocks, dtype=torch.int32)
        slots = [int(tables[row, position // size]) for row, position in enumerate(positions)]
        return cls(
            torch.tensor(tokens + [0] * padding),
            torch.tensor(positions),
            tables,
            torch.tensor([position + 1 for position in positions], dtype=torch.int32),
            torch.tensor(slots),
            torch.tensor(positions) % size,
        )

    @classmethod
    def empty(cls, rows: int, width: int, device: torch.device) -> StepInputs:
        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        int32 = torch.int32
        return cls(
            zeros(rows),
            zeros(rows),
            zeros(rows, width, dtype=int32),
            zeros(rows, dtype=int32),
            zeros(rows),
            zeros(rows),
        )

    def to(self, device: torch.device) -> StepInputs:
        return StepInputs(*(getattr(self, field.name).to(device) for field in fields(self)))

    def copy_(self, other: StepInputs) -> None:
        """Load `other` (the same shapes, or fewer rows) into these tensors, in place."""
        for field in fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            mine[: theirs.shape[0]].copy_(theirs)

    def first(self, rows: int) -> StepInputs:
        return StepInputs(*(getattr(self, field.name)[:rows] for field in fields(self)))


class PagedRows:
    """The plan of a step over `inputs`' rows in `store`. `caches`: the sequences to move on by
    their token when it is done (none for a graphed step: its caller does, outside the graph);
    `rope_positions`: where an image moved text positions (an eager step only)."""

    last_only = False

    def __init__(
        self,
        store: PagedStore,
        inputs: StepInputs,
        attend: PagedAttention | None = None,
        caches: list[PagedKVCache] | None = None,
        rope_positions: torch.Tensor | None = None,
    ) -> None:
        self.store, self.inputs, self.caches = store, inputs, caches or []
        self.kernel = attend or attention_for(store.device)
        self.positions, self.rope_positions = inputs.positions, rope_positions

    def attend(self, attention: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [heads, B, d], k and v [kv_heads, B, d] → [B, heads × d]."""
        inputs = self.inputs
        keys, values = self.store.keys[attention.layer], self.store.values[attention.layer]
        keys[inputs.slots, inputs.offsets] = k.transpose(0, 1)
        values[inputs.slots, inputs.offsets] = v.transpose(0, 1)
        rules = AttentionRules(attention.scale, attention.window, attention.softcap, attention.sinks)
        kv = PagedKV(keys, values, inputs.tables, inputs.lengths)
        out = self.kernel(q.transpose(0, 1).unsqueeze(1), kv, rules)
        return out.reshape(q.shape[1], -1)

    def finish(self) -> None:
        for cache in self.caches:
            cache.length += 1


def _made_room(caches: list[PagedKVCache], tokens: list[int]) -> None:
    """Each cache given room for its token, told its id. Room is made for every token before any
    is written: blocks.OutOfBlocks leaves the others as they were (their unfilled room is let go
    at their next pass), for the scheduler to preempt a sequence and retry."""
    for cache, token in zip(caches, tokens, strict=True):
        cache.expect([token])
        cache.ensure(cache.length + 1)


def decode_sequences(
    net: Any, tokens: torch.Tensor, caches: list[PagedKVCache], attend: PagedAttention | None = None
) -> torch.Tensor:
    """One token [B] for each of B sequences, token b after what caches[b] holds: logits [B,
    vocab]; each cache holds its token after. `net`: their model (forward.Transformer)."""
    ids = tokens.tolist()  # a sync on a GPU: PagedSteps is the graphed step
    _made_room(caches, ids)
    store = caches[0].store
    assert all(cache.store is store for cache in caches)
    width = max(len(cache.table.blocks) for cache in caches)
    inputs = StepInputs.of(caches, ids, len(caches), width).to(store.device)
    lengths = [cache.length for cache in caches]
    shifted = [length + cache.rope_shift for length, cache in zip(lengths, caches, strict=True)]
    rope = None if shifted == lengths else torch.tensor(shifted, device=store.device)
    return net.forward(inputs.tokens, PagedRows(store, inputs, attend, caches, rope))


class PagedSteps:
    """Decode steps of up to GRAPHED_BATCHES[-1] sequences over one store, their inputs copied
    into fixed buffers and each batch size's step replayed from a CUDA graph (`graphs`; without
    it, the same padded step runs eagerly: how a CPU checks it). The store's tensors never move,
    so a graph is captured once per batch size."""

    def __init__(
        self,
        net: Any,
        store: PagedStore,
        context_length: int,
        *,
        graphs: bool,
        attend: PagedAttention | None = None,
    ) -> None:
        self.net, self.store, self.attend = net, store, attend
        self.width = -(-context_length // store.block_size)
        self.inputs = StepInputs.empty(GRAPHED_BATCHES[-1], self.width, store.device)
        self.graphs = StepGraphs(self._step) if graphs else None

    def decode(self, tokens: list[int], caches: list[PagedKVCache]) -> torch.Tensor:
        """Token b after what caches[b] holds, for each: logits [B, vocab] (a view the next
        step overwrites); each cache holds its token after. No image may have moved their
        positions (rope shifts are an eager step's: decode_sequences)."""
        assert not any(cache.shifts for cache in caches)
        rows = next(size for size in GRAPHED_BATCHES if size >= len(caches))
        _made_room(caches, tokens)
        self.inputs.copy_(StepInputs.of(caches, tokens, rows, self.width))
        logits = self.graphs.replay(rows, 0, 0) if self.graphs is not None else self._step(rows, 0)
        for cache in caches:
            cache.length += 1
        return logits[: len(caches)]

    def _step(self, rows: int, _bucket: int) -> torch.Tensor:
        inputs = self.inputs.first(rows)
        return self.net.forward(inputs.tokens, PagedRows(self.store, inputs, self.attend))
