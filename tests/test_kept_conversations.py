"""A server's one KV cache shared by conversations whose turns interleave: what another request
would crop is set aside in host memory and brought back when its conversation returns
(engine/prefix.py) — exactly, with sliding-window rings too, within a memory budget."""

from __future__ import annotations

import pytest
import torch

from llmcli.engine.loop import Engine
from llmcli.engine.native.backend import NativeBackend
from llmcli.engine.prefix import PrefixStore as KeptConversations
from test_native import CASES, CONTEXT, build, prompt

SHARED = 40  # a system prompt all three conversations start with
OWN = 80  # each conversation's first message
TURN = 20  # each later message
REPLY = 8


def turn(engine: Engine, ids: list[int]) -> tuple[int, list[torch.Tensor], list[int]]:
    """One request as the server runs it: the cache's prefix reused, the rest prefilled, a
    greedy reply. (tokens reused, the logits before each reply token, the reply)"""
    reused = engine.reuse_prefix(ids)
    logits = engine.prefill(ids[reused:])
    rows, reply = [logits[0].float()], []
    for _ in range(REPLY):
        reply.append(int(rows[-1].argmax()))
        rows.append(engine.decode_step(reply[-1])[0].float())
    return reused, rows[:-1], reply


def conversations(seed: int) -> list[list[int]]:
    shared = prompt(SHARED, seed=seed)
    return [shared + prompt(OWN, seed=seed + 1 + n) for n in range(3)]


RING_CASES = ["gemma3-window-8-shorter-than-the-prompt", "gpt-oss-k2-window-8"]


@pytest.mark.parametrize("case", ["llama-gqa2", *RING_CASES])
@torch.inference_mode()
def test_interleaved_conversations_are_brought_back_exactly(case: str) -> None:
    """Three conversations, three rounds of turns in turn on one engine: from the second round
    on each turn reuses its whole conversation so far, and its logits equal those of an engine
    that ran that conversation alone (1e-6) and transformers' on the whole text (1e-4)."""
    model = build(*CASES[case])
    shared = NativeBackend(model, CONTEXT)
    engine = Engine(shared, frozenset(), CONTEXT)
    engine.prefixes = KeptConversations(1 << 30)
    alone = [Engine(NativeBackend(model, CONTEXT), frozenset(), CONTEXT) for _ in range(3)]
    histories = conversations(seed=10)
    for round_number in range(3):
        for n, history in enumerate(histories):
            ids = history + (prompt(TURN, seed=100 * round_number + n) if round_number else [])
            reused, rows, reply = turn(engine, ids)
            _, alone_rows, alone_reply = turn(alone[n], ids)
            if round_number:
                assert reused >= 0.9 * len(history) and reused == len(history)
            assert reply == alone_reply
            for row, alone_row in zip(rows, alone_rows, strict=True):
                torch.testing.assert_close(row, alone_row, rtol=0, atol=1e-6)
            reference = model(torch.tensor([ids + reply])).logits[0].float()
            for i, row in enumerate(rows):
                torch.testing.assert_close(row, reference[len(ids) - 1 + i], rtol=0, atol=1e-4)
            histories[n] = ids + reply
    assert engine.prefixes.restored == 6  # rounds two and three, each conversation brought back
    assert len(engine.prefixes.entries) == 2  # the other two; the third is the cache's own text


@torch.inference_mode()
def test_the_least_recently_used_copy_goes_when_the_budget_is_full() -> None:
    model = build(*CASES["llama-gqa2"])
    engine = Engine(NativeBackend(model, CONTEXT), frozenset(), CONTEXT)
    first, second, third = conversations(seed=20)
    assert len({first[SHARED], second[SHARED], third[SHARED]}) == 3  # they part right after it
    one_copy = NativeBackend(model, CONTEXT)
    one_copy.prefill(first + [0] * REPLY)  # a turn leaves its reply in the cache too
    engine.prefixes = KeptConversations(one_copy.save().nbytes() + 1)  # room for one copy
    for ids in (first, second, third):
        turn(engine, ids)
    assert [entry.ids[: len(second)] for entry in engine.prefixes.entries] == [second]  # first dropped
    assert engine.prefixes.nbytes <= engine.prefixes.budget_bytes
    reused, _, _ = turn(engine, first)
    assert reused == SHARED  # only what the cache (the third) shares with it
    # Setting the third aside made room by dropping the second, now the least recently used.
    assert [entry.ids[: len(third)] for entry in engine.prefixes.entries] == [third]
    reused, _, _ = turn(engine, third + prompt(TURN, seed=21))
    assert reused >= len(third)  # brought back
    assert engine.prefixes.restored == 1


@torch.inference_mode()
def test_a_short_loss_is_not_set_aside_and_transformers_engine_keeps_nothing(loaded_tiny) -> None:
    from engines import engine_for

    model = build(*CASES["llama-gqa2"])
    engine = Engine(NativeBackend(model, CONTEXT), frozenset(), CONTEXT)
    engine.prefixes = KeptConversations(1 << 30)
    ids = prompt(120, seed=30)
    turn(engine, ids)
    turn(engine, ids[:100])  # 28 tokens lost (a retry of a reply): not worth a copy
    assert engine.prefixes.entries == []

    hf = engine_for(loaded_tiny, backend="transformers")
    hf.prefixes = KeptConversations(1 << 30)
    vocab = len(loaded_tiny.tokenizer)
    first, second = ([(7 * i + s) % vocab for i in range(150)] for s in (1, 2))
    turn(hf, first)
    reused, _, _ = turn(hf, second)
    assert reused == 0 and hf.prefixes.entries == []  # transformers' cache is not copied: cropped as before
    reused, _, _ = turn(hf, first)
    assert reused == 0


@pytest.mark.parametrize("case", ["llama-gqa2", *RING_CASES])
@pytest.mark.parametrize("first_goes_on", [20, OWN])
@torch.inference_mode()
def test_a_prefix_copied_from_another_sequence_gives_what_a_prefill_gives(
    case: str, first_goes_on: int
) -> None:
    """Two requests with one system prompt: the second's cache copies the first's prefix (a
    memory copy, scheduler.Slots) and prefills only its own part; its logits equal those of a
    cache that prefilled the shared part itself within 1e-5 (the copied keys and values were
    computed in the first's longer pass, whose matrix products round differently in the last
    bits). A ring the first has wrapped (window 8: a ring of 72 slots, past by 40 + 80 tokens)
    cannot give its prefix: nothing is held, the caller prefills."""
    model = build(*CASES[case])
    first = NativeBackend(model, CONTEXT)
    second = NativeBackend(None, CONTEXT, net=first.net)
    alone = NativeBackend(model, CONTEXT)
    shared, own = prompt(SHARED, seed=50), prompt(OWN, seed=51)
    first.prefill(shared + prompt(first_goes_on, seed=52))  # the first request goes on past it
    held = second.copy_prefix(first, SHARED)
    alone.prefill(shared)  # what the second would run without the copy: the same two passes
    expected = alone.prefill(own)
    rings = [ring for ring in first.cache.rings if ring is not None]
    if rings and SHARED + first_goes_on > min(rings):
        assert held == 0 and second.length == 0
        return
    assert held == SHARED == second.length
    torch.testing.assert_close(second.prefill(own), expected, rtol=0, atol=1e-5)
    token = torch.tensor([int(expected.argmax())])
    torch.testing.assert_close(second.decode(token), alone.decode(token), rtol=0, atol=1e-5)


@torch.inference_mode()
def test_slots_share_one_pool_and_reserve_within_its_limit() -> None:
    """Three slots of one pool holding four 256-position slots' worth: the pool is its slots in
    use × the longest bucket; each generation reserves what its prompt and max_tokens may fill,
    and one whose reservation would take the pool past the limit beside the running ones is
    refused with the reason, taking nothing; once one ends, its slot is the next one's."""
    from llmcli.engine.scheduler import ComputeThread, Slots
    from llmcli.errors import KVMemoryFull

    model = build(*CASES["llama-gqa2"])
    compute = ComputeThread()
    try:
        first = Engine(NativeBackend(model, CONTEXT), frozenset(), CONTEXT)
        slot_bucket = first.backend.cache.bytes_for(1)  # one slot of the smallest bucket: 256
        slots = Slots(first, 3, compute, kv_limit=4 * slot_bucket)
        assert slots.pool is not None
        with compute.generation():
            a = slots.take(prompt(40, seed=1), longest=100)
            b = slots.take(prompt(40, seed=2), longest=100)
            for engine, seed in ((a, 1), (b, 2)):
                engine.prefill(prompt(40, seed=seed))
            assert slots.pool.nbytes() == 2 * slot_bucket  # two slots of 256 positions
            with pytest.raises(KVMemoryFull, match="the KV memory is taken"):
                slots.take(prompt(40, seed=3), longest=300)  # three slots of 512: six
            assert len(slots.free) == 1 and len(slots.reserved) == 2  # it took nothing
            slots.give_back(b)
            c = slots.take(prompt(40, seed=3), longest=300)  # b's slot: two slots of 512, four
            assert c is b
            c.prefill(prompt(300, seed=3))
            assert slots.pool.nbytes() == 4 * slot_bucket
            # a's cache moved with the pool and holds what it held.
            alone = NativeBackend(model, CONTEXT)
            expected = alone.prefill([*prompt(40, seed=1), 5])
            torch.testing.assert_close(a.prefill([5]), expected, rtol=0, atol=1e-5)
    finally:
        compute.shutdown()
