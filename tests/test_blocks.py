"""The paged pool's bookkeeping (engine/native/blocks.py): blocks shared by content, copied
before a shared one is written, kept after their sequences end and evicted oldest first, and
running out refused before anything changed."""

from __future__ import annotations

import pytest

from llmcli.engine.native import blocks
from llmcli.engine.native.blocks import BlockPool, BlockTable, Copy, OutOfBlocks
from llmcli.errors import KVMemoryFull

SIZE = 4  # positions per block: small, so texts cross many blocks


def _filled(pool: BlockPool, tokens: list[int], seed: bytes = b"") -> BlockTable:
    """A sequence whose prefill of `tokens` is written (published), sharing what it can."""
    table = pool.share_prefix(tokens, seed, limit=len(tokens) - 1)
    assert pool.extend(table, tokens[table.length :]) == []
    pool.publish(table)
    return table


def test_a_table_holds_its_positions_in_blocks_of_the_pool_s_size() -> None:
    pool = BlockPool(10, SIZE)
    table = pool.share_prefix([1, 2, 3])
    assert table.length == 0 and table.blocks == []
    pool.extend(table, [1, 2, 3])
    assert len(table.blocks) == 1 and table.length == 3
    pool.extend(table, [4])  # exactly a block
    assert len(table.blocks) == 1 and len(table.keys) == 1
    pool.extend(table, [5])  # one past it
    assert len(table.blocks) == 2 and len(set(table.blocks)) == 2
    assert pool.available() == 8 and all(pool.refs(block) == 1 for block in table.blocks)


def test_a_text_starting_as_another_shares_its_full_blocks() -> None:
    pool = BlockPool(10, SIZE)
    first = _filled(pool, list(range(10)))  # two full blocks and two positions
    second = pool.share_prefix([*range(10), 99], limit=10)
    assert second.blocks == first.blocks[:2] and second.length == 8
    assert [pool.refs(block) for block in first.blocks] == [2, 2, 1]
    pool.extend(second, [8, 9, 99])  # the partial block is not shared: a block of its own
    assert second.blocks[2] not in first.blocks
    assert second.keys[:2] == first.keys[:2]


def test_the_same_tokens_after_another_prefix_or_seed_are_another_block() -> None:
    pool = BlockPool(10, SIZE)
    _filled(pool, [1, 1, 1, 1, 7, 7, 7, 7, 0])
    other_head = pool.share_prefix([2, 2, 2, 2, 7, 7, 7, 7, 0])
    assert other_head.length == 0  # its second block's tokens match, its key does not
    assert pool.share_prefix([1, 1, 1, 1, 7, 7, 7, 7, 0], seed=b"an image").length == 0


def test_a_prefill_keeps_its_last_token_to_compute_and_unwritten_blocks_are_not_shared() -> None:
    pool = BlockPool(10, SIZE)
    tokens = list(range(8))
    _filled(pool, tokens)
    assert pool.share_prefix(tokens, limit=len(tokens) - 1).length == 4  # not the block with the last
    assert pool.share_prefix(tokens).length == 8
    unwritten = pool.share_prefix([5] * 8)
    pool.extend(unwritten, [5] * 8)  # room given, its pass not done: nothing published
    assert pool.share_prefix([5] * 8).length == 0
    pool.publish(unwritten)
    assert pool.share_prefix([5] * 8).blocks == unwritten.blocks


def test_a_forked_table_copies_the_shared_partial_block_before_writing_it() -> None:
    pool = BlockPool(10, SIZE)
    first = _filled(pool, [1, 2, 3, 4, 5, 6])
    second = pool.fork(first)
    assert second.blocks == first.blocks and second.tokens == first.tokens
    assert pool.refs(first.blocks[1]) == 2
    copies = pool.extend(second, [7])
    assert copies == [Copy(first.blocks[1], second.blocks[1])] and second.blocks[1] != first.blocks[1]
    assert second.blocks[0] == first.blocks[0] and pool.refs(first.blocks[0]) == 2
    assert pool.refs(first.blocks[1]) == 1 and pool.refs(second.blocks[1]) == 1
    assert pool.extend(first, [8]) == []  # its own again: written in place
    assert pool.extend(second, [9, 10]) == []  # the copy is the second's own


def test_a_crop_into_a_published_block_copies_it_at_the_next_write_and_keeps_the_original() -> None:
    pool = BlockPool(10, SIZE)
    tokens = list(range(9))
    table = _filled(pool, tokens)
    published = table.blocks[1]
    pool.crop(table, 6)  # back into the second block (chat /undo)
    assert table.length == 6 and len(table.blocks) == 2 and len(table.keys) == 1
    copies = pool.extend(table, [60, 70])
    assert copies == [Copy(published, table.blocks[1])] and table.blocks[1] != published
    assert pool.kept() == [published]  # its text may come back: kept, not freed
    again = pool.share_prefix(tokens, limit=8)
    assert again.blocks == [table.blocks[0], published]


def test_released_blocks_are_kept_and_a_later_text_takes_them_back() -> None:
    pool = BlockPool(6, SIZE)
    tokens = list(range(10))
    table = _filled(pool, tokens)
    held = list(table.blocks)
    pool.release(table)
    assert table.length == 0 and table.blocks == []
    assert pool.kept() == [held[1], held[0]]  # the partial last block was never entered: freed
    assert pool.available() == 6
    again = pool.share_prefix(tokens, limit=9)
    assert again.blocks == held[:2] and pool.kept() == []
    assert [pool.refs(block) for block in held[:2]] == [1, 1]


def test_a_text_cropped_to_a_block_s_end_takes_back_the_blocks_that_followed() -> None:
    pool = BlockPool(8, SIZE)
    tokens = list(range(13))
    table = _filled(pool, tokens)
    held = list(table.blocks)
    pool.crop(table, 4)
    pool.extend(table, [9] * 5)  # another text after the first block
    pool.publish(table)
    pool.crop(table, 6)
    assert pool.share_more(table, tokens[6:]) == 0  # not at a block's end
    pool.crop(table, 4)
    assert pool.share_more(table, tokens[4:], limit=8) == 8
    assert table.blocks == held[:3] and table.tokens == tokens[:12]


def test_blocks_are_evicted_released_longest_ago_first_each_text_s_end_before_its_head() -> None:
    pool = BlockPool(6, SIZE)
    old = _filled(pool, [1] * 12 + [0])  # three full blocks + one
    old_blocks = list(old.blocks)
    pool.release(old)
    newer = _filled(pool, [2] * 4 + [0])
    newer_blocks = list(newer.blocks)
    pool.release(newer)
    assert pool.kept() == [old_blocks[2], old_blocks[1], old_blocks[0], newer_blocks[0]]
    taker = pool.share_prefix([])
    pool.extend(taker, [3] * 9)  # three blocks: the two free, then the oldest text's end
    assert pool.kept() == [old_blocks[1], old_blocks[0], newer_blocks[0]]
    probe = pool.share_prefix([1] * 12 + [0])
    assert probe.length == 8  # its head still found, its end gone
    pool.release(probe)  # used again: now released after the newer text
    assert pool.kept() == [newer_blocks[0], old_blocks[1], old_blocks[0]]
    pool.extend(taker, [3] * 4)
    assert pool.share_prefix([2] * 4 + [0]).length == 0
    assert pool.share_prefix([1] * 12 + [0]).length == 8


def test_running_out_of_blocks_is_refused_before_anything_changes() -> None:
    pool = BlockPool(3, SIZE)
    first = _filled(pool, list(range(10)))
    second = pool.fork(first)
    with pytest.raises(OutOfBlocks, match="3 blocks of 4 positions are all held: 2 more") as raised:
        pool.extend(second, [1] * 3)  # a copy of the partial block and one more: two, none free
    assert isinstance(raised.value, KVMemoryFull)  # what the server already answers
    assert second.length == 10 and second.blocks == first.blocks
    assert [pool.refs(block) for block in first.blocks] == [2, 2, 2] and pool.available() == 0
    pool.release(first)
    assert pool.extend(second, [1] * 2) == []  # the partial block is its own now: no copy
    with pytest.raises(OutOfBlocks, match="1 more are needed"):
        pool.extend(second, [1])


def test_a_block_written_twice_under_one_key_is_shared_once() -> None:
    """Two sequences that computed the same block before either published it: the first one
    entered is shared; the other stays its sequence's own and is freed with it."""
    pool = BlockPool(6, SIZE)
    first, second = pool.share_prefix([]), pool.share_prefix([])
    pool.extend(first, [4] * 5)
    pool.extend(second, [4] * 5)
    pool.publish(first)
    pool.publish(second)
    assert pool.share_prefix([4] * 5, limit=4).blocks == [first.blocks[0]]
    pool.release(second)
    assert second.blocks == [] and pool.kept() == []


def test_a_pass_that_failed_is_cropped_away_without_leaving_its_blocks_shared() -> None:
    pool = BlockPool(4, SIZE)
    table = pool.share_prefix([])
    pool.extend(table, [7] * 8)
    pool.crop(table, 0)  # its pass raised before the keys and values were written
    assert pool.kept() == [] and pool.available() == 4
    assert pool.share_prefix([7] * 8).length == 0


def test_a_key_found_with_other_tokens_is_not_shared(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys are 128-bit hashes; were two texts ever to collide, the tokens a block was entered
    with still tell them apart."""
    monkeypatch.setattr(blocks, "block_key", lambda previous, tokens: b"one key for all")
    pool = BlockPool(4, SIZE)
    _filled(pool, [1] * 5)
    assert pool.share_prefix([2] * 5).length == 0
    assert pool.share_prefix([1] * 5).length == 4


def test_a_block_with_an_unknown_token_is_not_shared_nor_any_after_it() -> None:
    pool = BlockPool(8, SIZE)
    _filled(pool, [1, 2, 3, 4, 5, -1, 7, 8, 9, 10, 11, 12, 0])
    assert pool.share_prefix([1, 2, 3, 4, 5, -1, 7, 8, 9, 10, 11, 12, 0]).length == 4
    assert pool.kept() == [] and len(pool.cached) == 1


def test_a_pool_without_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="needs blocks"):
        BlockPool(0, SIZE)
