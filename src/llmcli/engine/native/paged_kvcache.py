"""A sequence's KV cache in blocks of one pool shared by a model's sequences, behind the
interface the native engine's contiguous KVCache offers (kvcache.py), so the plans, the
prefix store and the scheduler use either without knowing which.

`PagedStore` is one model's pool: per layer, keys and values [num_blocks, block_size, kv_heads,
d], the layout paged_cpu.py and paged_cuda.py read in place, and the bookkeeping of which
sequence holds which blocks (blocks.BlockPool: full blocks shared by content, kept after their
sequences end, copied before a shared one is written). `PagedKVCache` is one sequence's table
of blocks in it; paged_backend.PagedBackend is the native backend over one.

A decode step reads the blocks in place (paged_step.py: one kernel call per layer for all of
a step's sequences). Every other pass (a prefill, a speculative check) takes the reference
path: the plans' writes scatter keys and values into the blocks, and what they attend over is
each layer's positions gathered into one tensor, scored by attention.py as for the contiguous
cache. That is exact (tests compare greedy tokens with the contiguous cache's in fp32) but costs
a copy per layer and chunk; a prefill kernel that reads the blocks in place is the next step on
a GPU. The graphed decode step is paged_step.PagedSteps (one graph per batch size).

Not held here yet (refused or said): sliding-window layers keep every position (correct, as a
window is masked; a ring would bound their memory), a model with recurrent layers or layers that
keep no keys and values of their own (Qwen3.5, Gemma 4's shared KV) is refused, and the
contiguous cache's own batched step (forward.decode_sequences) takes paged caches row by row:
paged_step.decode_sequences is theirs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from llmcli.engine.native.blocks import BLOCK_SIZE, BlockPool, BlockTable, Copy
from llmcli.engine.native.kvcache import KVCache, SavedCache
from llmcli.engine.native.pool import position_bytes
from llmcli.errors import LlmcliError

# The id of a position whose token the cache was not told (a restored copy, a batched step):
# a block holding one is never shared, nor is any after it in its table (blocks.publish).
UNKNOWN = -1
_VERSIONS = itertools.count(1 << 40)  # apart from kvcache.py's: no graph is replayed on a paged cache


class PagedStore:
    """One model's paged pool: per layer keys and values in `num_blocks` blocks of
    `block_size` positions, and which sequences hold them (`blocks`)."""

    def __init__(
        self,
        shapes: list[tuple[int, int]],
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int = BLOCK_SIZE,
    ) -> None:
        """`shapes`: each layer's (KV heads, head width)."""
        self.blocks = BlockPool(num_blocks, block_size)
        # One block past the pool's, never handed out: what a padded row of a graphed step
        # writes and reads (paged_step.StepInputs), so it touches no sequence's keys.
        self.scratch = num_blocks
        self.shapes, self.dtype, self.device = shapes, dtype, device
        with torch.inference_mode():  # as the contiguous cache's: every pass writes in that mode
            self.keys = [self._empty(*shape) for shape in shapes]
            self.values = [self._empty(*shape) for shape in shapes]

    @classmethod
    def for_net(cls, net: object, num_blocks: int, block_size: int = BLOCK_SIZE) -> PagedStore:
        """A pool for a native model's (forward.Transformer) layers, or a refusal in one line."""
        _, shapes, kept = net._slots()  # type: ignore[attr-defined]
        if getattr(net, "recurrent", False) or not all(kept):
            raise LlmcliError(
                "a paged KV cache holds models whose every layer keeps its own keys and values: "
                "this one has recurrent or shared-KV layers"
            )
        return cls(shapes, num_blocks, net.dtype, net.device, block_size)  # type: ignore[attr-defined]

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    def block_bytes(self) -> int:
        """One block's keys and values over every layer."""
        return self.block_size * sum(position_bytes(*shape, self.dtype) for shape in self.shapes)

    def copy(self, copies: list[Copy]) -> None:
        """Each copy's source block into its destination, in every layer (blocks.extend's)."""
        for copy in copies:
            for store in (*self.keys, *self.values):
                store[copy.destination].copy_(store[copy.source])

    def _empty(self, kv_heads: int, head_dim: int) -> torch.Tensor:
        size = (self.blocks.num_blocks + 1, self.block_size, kv_heads, head_dim)  # + the scratch block
        return torch.zeros(size, dtype=self.dtype, device=self.device)


class _Gathered:
    """`cache.keys[layer]` for the plans that read a layer whole: its positions gathered,
    [kv_heads, positions given room for, d]."""

    def __init__(self, cache: PagedKVCache, stores: list[torch.Tensor]) -> None:
        self.cache, self.stores = cache, stores

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self.cache.gather(self.stores[layer], self.cache.table.length)

    def __len__(self) -> int:
        return len(self.stores)


class PagedKVCache:
    """One sequence's keys and values in a PagedStore's blocks, with kvcache.KVCache's
    interface: `length` (set by the plans once a pass is written: its full blocks are then
    published), ensure, write, write_at, crop, save, restore, copy_prefix, bytes_for."""

    pool = None  # never a slot of pool.SlotPool: batched steps go row by row
    slot = None

    def __init__(self, store: PagedStore, context_length: int) -> None:
        self.store, self.context_length = store, context_length
        layers = len(store.shapes)
        self.shapes = store.shapes
        self.rings: list[int | None] = [None] * layers
        self.kv_layers = [True] * layers
        self.dtype, self.device = store.dtype, store.device
        self.table = BlockTable()
        self.written = 0
        self.shifts: list[tuple[int, int]] = []  # as KVCache.shifts
        self.storage_version = next(_VERSIONS)
        self.keys, self.values = _Gathered(self, store.keys), _Gathered(self, store.values)
        self._length = 0
        self._pending: list[int] = []  # the ids of the positions the next pass writes
        self._blocks = torch.zeros(0, dtype=torch.long, device=store.device)  # the table, on the device

    @property
    def length(self) -> int:
        return self._length

    @length.setter
    def length(self, length: int) -> None:
        """A pass has written up to `length`: room past it is let go, full blocks published."""
        assert length <= self.table.length, "a pass writes only positions it was given room for"
        if length < self.table.length:
            self.store.blocks.crop(self.table, length)
            self._sync_table()
        self._length = length
        self.store.blocks.publish(self.table)

    @property
    def capacity(self) -> int:
        return len(self.table.blocks) * self.store.block_size

    def expect(self, ids: Sequence[int]) -> None:
        """The token ids of the positions the next pass writes, after `length`."""
        self._pending = list(ids)

    def share_prefix(self, ids: Sequence[int]) -> int:
        """Hold the published blocks that hold `ids` next (all but the last id's, which a
        prefill must compute): where the cache ends at a block's end, from empty or cropped
        back to one. Returns how many of `ids` are held now."""
        self._drop_unfilled()
        added = self.store.blocks.share_more(self.table, ids, limit=len(ids) - 1)
        if added:
            self._sync_table()
            self._length += added
        return added

    def ensure(self, positions: int) -> None:
        """Room for `positions` tokens, keeping the first `length`; blocks.OutOfBlocks (a
        KVMemoryFull) where the pool has none left, nothing changed."""
        self.written = max(self.written, positions)
        if positions > self.context_length:
            raise ValueError(f"{positions} positions do not fit a {self.context_length}-token cache")
        self._drop_unfilled()
        more = positions - self.table.length
        if more <= 0:
            return
        ids = self._pending[:more]
        ids += [UNKNOWN] * (more - len(ids))
        copies = self.store.blocks.extend(self.table, ids)
        del self._pending[:more]
        self.store.copy(copies)
        self._sync_table()

    def _drop_unfilled(self) -> None:
        """Let go of room a pass was given and did not fill (it failed, or a batched step ran
        out of blocks for another sequence): the ids it was told may not be the next pass's."""
        if self.table.length > self.length:
            self.store.blocks.crop(self.table, self.length)
            self._sync_table()

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [kv_heads, T, d] at positions length … length + T − 1; return the layer's
        keys and values up to and including them, gathered."""
        end = self.length + k.shape[1]
        positions = torch.arange(self.length, end, device=self.device)
        return self.write_at(layer, k, v, positions, end)

    def write_at(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, position: torch.Tensor, attend: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store T tokens' k, v [kv_heads, T, d] at `position` [T]; return the first `attend`
        positions' keys and values, gathered."""
        size = self.store.block_size
        blocks, offsets = self._blocks[position // size], position % size
        keys, values = self.store.keys[layer], self.store.values[layer]
        keys[blocks, offsets] = k.transpose(0, 1)
        values[blocks, offsets] = v.transpose(0, 1)
        return self.gather(keys, attend), self.gather(values, attend)

    def gather(self, store: torch.Tensor, positions: int) -> torch.Tensor:
        """The first `positions` positions of a layer's blocks, [kv_heads, positions, d]."""
        used = self._blocks[: -(-positions // self.store.block_size)]
        return store[used].flatten(0, 1)[:positions].transpose(0, 1)

    def resumable(self, length: int) -> int:
        return length

    def crop(self, length: int) -> None:
        length = min(length, self.length)
        self.store.blocks.crop(self.table, length)
        self._sync_table()
        self._pending = []
        self._length = length
        self.shifts = [shift for shift in self.shifts if shift[0] <= length]

    def release(self) -> None:
        """The sequence is done: its blocks let go (kept for their content where published)."""
        self.crop(0)

    # Where text positions stop being the cache's indices: as the contiguous cache keeps them.
    rope_shift = KVCache.rope_shift
    shift_from = KVCache.shift_from

    @torch.inference_mode()
    def save(self) -> SavedCache:
        """Host copies of the positions held, as the contiguous cache saves them: the prefix
        store and its disk tier take either."""
        keys = [self.gather(store, self.length).to("cpu", copy=True) for store in self.store.keys]
        values = [self.gather(store, self.length).to("cpu", copy=True) for store in self.store.values]
        return SavedCache(self.length, self.written, keys, values, tuple(self.shifts))

    @torch.inference_mode()
    def restore(self, saved: SavedCache) -> None:
        """Hold exactly what `save` copied, in blocks of this sequence's own (the copy does not
        say its token ids: they are not shared)."""
        self.crop(0)
        self.ensure(saved.length)
        positions = torch.arange(saved.length, device=self.device)
        for layer, (keys, values) in enumerate(zip(saved.keys, saved.values, strict=True)):
            self.write_at(layer, keys.to(self.device), values.to(self.device), positions, 0)
        self._length, self.written = saved.length, saved.written
        self.shifts = list(saved.shifts)

    def copy_prefix(self, source: object, length: int) -> int:
        """Hold the first `length` positions `source` holds: where it is a sequence of the
        same store, its blocks themselves (shared, the partial last one copied at the first
        write); another kind of cache is not read (0: the caller prefills)."""
        if not isinstance(source, PagedKVCache) or source.store is not self.store:
            return 0
        length = min(length, source.length)
        self.crop(0)
        source._drop_unfilled()  # fork publishes the source's full blocks: written ones only
        self.table = self.store.blocks.fork(source.table)
        self.store.blocks.crop(self.table, length)
        self._sync_table()
        self._length = length
        self.shifts = [shift for shift in source.shifts if shift[0] <= length]
        return length

    def bytes_for(self, positions: int) -> int:
        """Bytes the keys and values take once the cache holds `positions` tokens (the blocks
        they fill, as if none were shared)."""
        return -(-positions // self.store.block_size) * self.store.block_bytes()

    def ring_bytes(self) -> int:
        return 0

    def bytes_beside_pool(self) -> int:
        return 0

    def nbytes(self) -> int:
        return len(self.table.blocks) * self.store.block_bytes()

    def _sync_table(self) -> None:
        self._blocks = torch.tensor(self.table.blocks, dtype=torch.long, device=self.device)
