"""Which blocks of a paged KV pool each sequence holds, and which blocks sequences share.

A paged pool (paged_cpu.PagedKV: [num_blocks, block_size, kv_heads, d] per layer) holds every
sequence's keys and values in fixed-size blocks; a sequence's table lists its blocks in order,
position p in block table[p // block_size] at offset p % block_size. This module is the
bookkeeping alone, pure Python: no tensor is read or written here. What it asks of the caller
(the paged KV cache) is to write the positions it was given room for, and to copy the blocks
it is told to (`Copy`) before writing into the copies.

Blocks are shared by content. A full block's key is a hash chain: the key of the block before
it and this block's token ids (so the same tokens after another prefix are another block, as
their keys and values differ). Once its keys and values are written (`publish`), a full block is
entered under its key, and a new sequence whose text starts with the same tokens takes those
blocks (`share_prefix`) instead of computing them again: a chat's next turn, one system prompt
under many requests. A block is reference-counted; when its last sequence lets go it is kept
(refcount 0, on a least-recently-released list) until a new block is needed and no block is
free, and only then evicted, the one released longest ago first. A sequence releases its blocks
last first, so a prefix outlives the text that followed it.

A block entered under its key never changes: other sequences may read it at any time. A write
into one (a sequence cropped back into it, then given other tokens) first copies it to a block
of the sequence's own (copy-on-write), as does a write into the partial last block of a table
`fork`ed from another. Nothing else ever makes a copy.

When no block can be had, `OutOfBlocks` is raised before anything changed: a scheduler catches
it, preempts a sequence (releases its table) and asks again. Two texts that differ in what
their token ids do not say (an image under the same placeholder ids) must not share blocks:
their tables are given different `seed`s, which start their hash chains. A block holding a
negative id (a position whose token was not told, or an image's marker, which a later image may
reuse) is never shared, nor any block after it in its table.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from llmcli.errors import KVMemoryFull

# Positions a block holds by default: vLLM's choice; small enough that a shared prefix ends
# within 15 tokens of where two texts part, large enough that a table is a few hundred entries.
BLOCK_SIZE = 16


class OutOfBlocks(KVMemoryFull):
    """No block is free and none is kept that could be evicted: preempt a sequence and retry."""


@dataclass(frozen=True)
class Copy:
    """Copy block `source`'s keys and values into block `destination` (every layer), before
    the positions given room for are written."""

    source: int
    destination: int


@dataclass
class BlockTable:
    """One sequence's blocks in order and the token ids at its positions (`len(tokens)` is its
    length). `keys`: the content key of each full block; `published`: how many of its leading
    full blocks were offered for sharing already."""

    seed: bytes = b""
    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    published: int = 0

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass
class _Block:
    refs: int = 0
    key: bytes | None = None  # entered under it in BlockPool.cached (then never written again)
    tokens: tuple[int, ...] = ()  # what it was entered with: a key found is checked against them


def block_key(previous: bytes, tokens: Sequence[int]) -> bytes:
    """The content key of a full block after the block whose key is `previous` (a table's seed
    for the first)."""
    return hashlib.blake2b(previous + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"a block pool needs blocks and positions in them, not {num_blocks}×{block_size}"
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._free = list(range(num_blocks - 1, -1, -1))  # held by nothing, entered under no key
        self.cached: dict[bytes, int] = {}  # key → block, whether held or kept
        self._kept: OrderedDict[int, None] = OrderedDict()  # held by nothing, keyed: oldest release first

    def available(self) -> int:
        """Blocks a sequence could be given now: the free ones and the kept ones."""
        return len(self._free) + len(self._kept)

    def refs(self, block: int) -> int:
        return self._blocks[block].refs

    def kept(self) -> list[int]:
        """Blocks held by no sequence but kept for their content, the next to be evicted first."""
        return list(self._kept)

    def share_prefix(self, tokens: Sequence[int], seed: bytes = b"", limit: int | None = None) -> BlockTable:
        """A table holding the longest run of full blocks entered under the keys `tokens` begin
        with, at most `limit` positions (a prefill must compute at least its last token to have
        its logits: pass len(tokens) − 1). Its length says how much was found; `extend` it with
        the rest."""
        table = BlockTable(seed)
        self.share_more(table, tokens, limit)
        return table

    def share_more(self, table: BlockTable, tokens: Sequence[int], limit: int | None = None) -> int:
        """Add to `table` the entered blocks that hold `tokens` next, at most `limit` of them;
        the count of `tokens` held now. Only where the table ends at a block's end and all its
        blocks' keys were offered (a text cropped back to a block's end, then continued as a
        text before it was): else 0."""
        size = self.block_size
        if table.length % size or table.published != len(table.keys):
            return 0
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        previous = table.keys[-1] if table.keys else table.seed
        added = 0
        while added + size <= limit:
            chunk = tuple(tokens[added : added + size])
            key = block_key(previous, chunk)
            block = self.cached.get(key)
            if block is None or self._blocks[block].tokens != chunk:
                break
            self._hold(block)
            table.blocks.append(block)
            table.tokens.extend(chunk)
            table.keys.append(key)
            previous = key
            added += size
        table.published = len(table.keys)
        return added

    def extend(self, table: BlockTable, tokens: Sequence[int]) -> list[Copy]:
        """Room in `table` for `tokens` after its last position: blocks added as needed, the last
        block copied first where the table may not write into it (shared or published). Returns
        the copies the caller must make before writing. All or nothing: OutOfBlocks leaves the
        table and the pool as they were."""
        if not tokens:
            return []
        size = self.block_size
        end = table.length + len(tokens)
        needed = -(-end // size) - len(table.blocks)
        forks = table.length % size != 0 and not self._writable(table.blocks[-1])
        if needed + forks > self.available():
            raise OutOfBlocks(
                f"the KV pool's {self.num_blocks} blocks of {size} positions are all held: "
                f"{needed + forks} more are needed for {len(tokens)} positions"
            )
        copies = []
        if forks:
            shared = table.blocks[-1]
            table.blocks[-1] = self._take()
            copies.append(Copy(shared, table.blocks[-1]))
            self._let_go(shared)
        table.blocks.extend(self._take() for _ in range(needed))
        table.tokens.extend(tokens)
        for full in range(len(table.keys), end // size):
            previous = table.keys[-1] if table.keys else table.seed
            table.keys.append(block_key(previous, table.tokens[full * size : (full + 1) * size]))
        return copies

    def publish(self, table: BlockTable) -> None:
        """Enter the table's full blocks under their keys, for other sequences to share: call it
        once their keys and values are written (a pass that failed half way publishes nothing,
        and its crop frees what it had). A key another block was entered under first keeps that
        block; this one stays the sequence's own. A negative id (a position whose token is not
        known, an image's marker) stops it there: that block and every later one stay the
        table's own."""
        for index in range(table.published, len(table.keys)):
            key, block = table.keys[index], table.blocks[index]
            start = index * self.block_size
            tokens = tuple(table.tokens[start : start + self.block_size])
            if min(tokens) < 0:
                table.published = index
                return
            if key not in self.cached and self._writable(block):
                self.cached[key] = block
                self._blocks[block].key = key
                self._blocks[block].tokens = tokens
        table.published = len(table.keys)

    def crop(self, table: BlockTable, length: int) -> None:
        """Keep the table's first `length` positions: the blocks past them let go (kept where
        entered under a key, else free)."""
        length = max(0, min(length, table.length))
        held = -(-length // self.block_size)
        self._release(table.blocks[held:])
        del table.blocks[held:], table.tokens[length:]
        del table.keys[length // self.block_size :]
        table.published = min(table.published, len(table.keys))

    def release(self, table: BlockTable) -> None:
        """The sequence has ended: each of its blocks let go."""
        self.crop(table, 0)

    def fork(self, table: BlockTable) -> BlockTable:
        """A second table holding the same blocks (a sequence's text continued two ways), once
        its keys and values are written: its full blocks published, each block held once more;
        the first write into the shared partial block copies it."""
        self.publish(table)
        for block in table.blocks:
            self._hold(block)
        return BlockTable(
            table.seed, list(table.blocks), list(table.tokens), list(table.keys), table.published
        )

    def _writable(self, block: int) -> bool:
        entry = self._blocks[block]
        return entry.refs == 1 and entry.key is None

    def _hold(self, block: int) -> None:
        entry = self._blocks[block]
        if entry.refs == 0:
            del self._kept[block]
        entry.refs += 1

    def _release(self, blocks: list[int]) -> None:
        for block in reversed(blocks):  # last first: the prefix is kept longest
            self._let_go(block)

    def _let_go(self, block: int) -> None:
        entry = self._blocks[block]
        entry.refs -= 1
        if entry.refs > 0:
            return
        if entry.key is not None:
            self._kept[block] = None
        else:
            self._free.append(block)

    def _take(self) -> int:
        """A block for one sequence alone: a free one, else the kept one released longest ago,
        its key forgotten."""
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._kept.popitem(last=False)
            entry = self._blocks[block]
            assert entry.key is not None
            del self.cached[entry.key]
            entry.key, entry.tokens = None, ()
        self._blocks[block].refs = 1
        return block
