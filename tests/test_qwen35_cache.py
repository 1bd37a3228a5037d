"""Qwen3.5's cache across chat turns, conversations and requests: its recurrent state cannot be
cropped, so it is resumed from checkpoints (engine/native/recurrent_cache.py) through the
prefix store. Every reply equals the whole conversation prefilled fresh (and transformers' own
model), and most of each conversation is reused rather than run again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engines import engine_for
from llmcli.config.settings import SamplingParams
from llmcli.engine.conversation import Conversation, prompt_ids
from llmcli.engine.loop import Engine
from llmcli.engine.native.backend import NativeBackend
from llmcli.engine.native.recurrent_cache import MAX_CHECKPOINTS, RecurrentCache
from llmcli.engine.prefix import PrefixStore
from test_chat_cache import MESSAGES, THINK_DROPPING_TEMPLATE, chat_turns
from test_fallback_families import Reference
from test_kept_conversations import conversations, turn

from cli_helpers import run_cli
from test_serve import Server, served
from tiny_models import build_tiny_model

ATOL = 1e-4
REPLY = SamplingParams(temperature=0.0, max_new_tokens=24)
# A system prompt long enough that a turn's new message is under a tenth of the conversation.
SYSTEM = "You are a careful assistant. Answer briefly, and say when you do not know. " * 12


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "qwen3_5", "qwen3_5")


@pytest.fixture(scope="module")
def loaded(folder: Path):
    from llmcli.config.settings import LoadSettings
    from llmcli.models.load import load_model
    from llmcli.models.resolve import resolve_model

    return load_model(resolve_model(str(folder)), LoadSettings(device="cpu", dtype="fp32", threads=1))


@pytest.fixture(scope="module")
def reference(folder: Path) -> Reference:
    return Reference(folder)


def answer(reference: Reference, messages: list[dict[str, str]]) -> str:
    return reference.reply(prompt_ids(reference.tokenizer, messages))[0]


def transformers_logits(reference: Reference, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return reference.model(torch.tensor([ids])).logits[0, -1:].float()


def assert_same_as_fresh(loaded, reference: Reference, generation, prompt: list[int]) -> None:
    """The turn's logits and reply equal a fresh engine's on the whole prompt, and its logits
    transformers' own."""
    fresh = engine_for(loaded, loaded.eos_token_ids)
    alone = fresh.generate(prompt, REPLY, loaded.tokenizer)
    list(alone)
    assert (generation.prefill_logits - alone.prefill_logits).abs().max().item() < ATOL
    assert generation.result.token_ids == alone.result.token_ids
    assert (generation.prefill_logits - transformers_logits(reference, prompt)).abs().max().item() < ATOL


@pytest.mark.parametrize("template", ["chatml", "think-dropping"])
def test_a_chat_of_four_turns_equals_each_conversation_prefilled_and_reuses_most_of_it(
    loaded, reference: Reference, template: str
) -> None:
    """From turn 2 on at least 90 % of each prompt is the cache's: the state after the last
    reply carries on. A template that rewrites the last reply (dropping its thinking) goes back
    to the checkpoint where that reply's prompt ended, and is exact all the same."""
    tokenizer = loaded.tokenizer
    original = tokenizer.chat_template
    if template == "think-dropping":
        tokenizer.chat_template = THINK_DROPPING_TEMPLATE
    try:
        engine = engine_for(loaded, loaded.eos_token_ids)
        assert engine.name == "native"
        conversation = Conversation(tokenizer, loaded.context_length, system=SYSTEM)
        turns = list(chat_turns(loaded, conversation, engine, MESSAGES[:4], REPLY))
    finally:
        tokenizer.chat_template = original
    previous_prompt = 0
    for number, (generation, prompt, _) in enumerate(turns, start=1):
        assert_same_as_fresh(loaded, reference, generation, prompt)
        stats = generation.result.stats
        assert stats.prompt_tokens == stats.cached_tokens + stats.prefilled_tokens
        if number >= 2:
            assert stats.cached_tokens >= previous_prompt - 1, number
            if template == "chatml":
                assert stats.cached_tokens >= 0.9 * stats.prompt_tokens, number
        previous_prompt = stats.prompt_tokens
    assert len(engine.backend.cache.points) <= MAX_CHECKPOINTS


def test_a_chat_through_the_cli_undoes_and_retries_from_its_checkpoints(
    folder: Path, reference: Reference
) -> None:
    """/undo goes back to where the undone turn's prompt began (the end of the reply before it),
    /retry to one token before its prompt's end: each reply is transformers' own, and each
    reuses all that comes before what changed."""
    first, second, third = MESSAGES[1], MESSAGES[2], "And of Spain?"
    script = f"{first}\n{second}\n/undo\n{third}\n/retry\n".encode()
    greedy = ["--device", "cpu", "-t", "0", "-n", "10", "--json"]
    proc = run_cli("chat", "-m", str(folder), *greedy, stdin=script)
    assert proc.returncode == 0, proc.stderr.decode()
    turns = [json.loads(line) for line in proc.stdout.decode().splitlines()]
    expected = reference.chat([first, third])
    assert [turn["reply"] for turn in turns] == [*reference.chat([first, second]), *expected[1:], expected[1]]
    one, two, after_undo, retried = turns
    # The first turn's prompt and reply, then the new message: all but that message reused.
    assert after_undo["cached_tokens"] >= one["prompt_tokens"] + one["completion_tokens"] - 1
    assert retried["cached_tokens"] == retried["prompt_tokens"] - 1
    assert two["cached_tokens"] >= one["prompt_tokens"]
    for each in turns:
        assert each["prompt_tokens"] == each["prefilled_tokens"] + each["cached_tokens"]


@torch.inference_mode()
def test_interleaved_conversations_are_brought_back_from_host_copies(loaded, reference: Reference) -> None:
    """Three conversations in turn on one engine with a store for host copies: from the second
    round each turn reuses its whole conversation (the copy carries the states and their
    checkpoints), and its logits equal an engine's that ran that conversation alone."""
    engine = Engine(NativeBackend(loaded.model, 512), frozenset(), 512)
    engine.prefixes = PrefixStore(1 << 30)
    alone = [Engine(NativeBackend(loaded.model, 512), frozenset(), 512) for _ in range(3)]
    histories = conversations(seed=10)
    for round_number in range(3):
        for n, history in enumerate(histories):
            ids = history + (conversations(seed=100 * round_number + n)[0][:20] if round_number else [])
            reused, rows, reply = turn(engine, ids)
            _, alone_rows, alone_reply = turn(alone[n], ids)
            if round_number:
                assert reused == len(history)
            assert reply == alone_reply
            for row, alone_row in zip(rows, alone_rows, strict=True):
                torch.testing.assert_close(row, alone_row, rtol=0, atol=1e-5)
            torch.testing.assert_close(rows[0][None], transformers_logits(reference, ids), rtol=0, atol=ATOL)
            histories[n] = ids + reply
    assert engine.prefixes.restored == 6
    kept = engine.prefixes.entries[0].saved
    assert kept.nbytes() > sum(t.nbytes for t in [*kept.keys, *kept.values])  # the states count too


@torch.inference_mode()
def test_a_prompt_sharing_a_long_prefix_resumes_at_the_last_interval_checkpoint(
    loaded, reference: Reference
) -> None:
    """Two prompts with one system prompt of 40 tokens, checkpoints every 16: the second resumes
    at 32, the last one inside what they share, and prefills only the rest, exactly."""
    engine = Engine(NativeBackend(loaded.model, 512), frozenset(), 512)
    cache = engine.backend.cache
    assert isinstance(cache, RecurrentCache)
    cache.interval = 16
    first, second, _ = conversations(seed=30)
    turn(engine, first)
    reused, rows, _ = turn(engine, second)
    assert reused == 32
    torch.testing.assert_close(rows[0][None], transformers_logits(reference, second), rtol=0, atol=ATOL)


@pytest.fixture(scope="module")
def server(folder: Path, tmp_path_factory: pytest.TempPathFactory):
    yield from served(folder, tmp_path_factory.mktemp("runtime"))


def test_a_server_brings_a_conversation_back_after_another(server: Server, reference: Reference) -> None:
    """Conversation A, then B, then A's next turn: A's cache was set aside when B cropped it and
    comes back whole, so A's second turn reuses all of its first; every reply transformers' own."""
    client = server.client()

    def ask(messages: list[dict[str, str]]):
        return client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)

    system = {"role": "system", "content": SYSTEM}
    a = [system, {"role": "user", "content": MESSAGES[0]}]
    first = ask(a)
    assert first.choices[0].message.content == answer(reference, a)
    b = [{"role": "user", "content": MESSAGES[3]}]
    assert ask(b).choices[0].message.content == answer(reference, b)
    a += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Why?"},
    ]
    again = ask(a)
    assert again.choices[0].message.content == answer(reference, a)
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


@torch.inference_mode()
def test_another_slots_running_cache_gives_its_checkpoint_rather_than_a_prefill(
    loaded, reference: Reference
) -> None:
    """Two slots over one set of weights (a server's): the second prompt shares 40 tokens with
    the first slot's, which is generating; it copies that slot's keys and values and its states
    at the last checkpoint inside them (32, every 16 here) rather than prefilling them."""
    first_backend = NativeBackend(loaded.model, 512)
    second_backend = NativeBackend(None, 512, net=first_backend.net)
    store = PrefixStore(1 << 30)
    slots = [Engine(backend, frozenset(), 512) for backend in (first_backend, second_backend)]
    for slot in slots:
        assert isinstance(slot.backend.cache, RecurrentCache)
        slot.backend.cache.interval = 16
        slot.prefixes = store
        store.attach(slot)
    first, second, _ = conversations(seed=40)
    turn(slots[0], first)
    store.running(slots[0], True)
    reused, rows, _ = turn(slots[1], second)
    assert reused == 32 and store.restored == 0  # copied from the running slot, not a host copy
    torch.testing.assert_close(rows[0][None], transformers_logits(reference, second), rtol=0, atol=ATOL)


@torch.inference_mode()
def test_a_servers_slices_of_a_prompt_keep_one_token_back_only_at_the_prompts_end(loaded) -> None:
    """A server prefills a long prompt in slices (scheduler.TakingTurns), each a pass of its
    own: only the last keeps a checkpoint one token before its end (where a retry resumes);
    one before each slice's end would cost a pass of one token per slice and serve nothing."""
    from llmcli.engine.scheduler import PREFILL_SLICE, ComputeThread, TakingTurns

    compute = ComputeThread()
    try:
        backend = NativeBackend(loaded.model, 1024)
        prompt = conversations(seed=50)[0] * 6  # longer than two slices
        assert len(prompt) > 2 * PREFILL_SLICE
        with compute.generation():
            logits = TakingTurns(backend, compute).prefill(prompt)
        points = set(backend.cache.points)
        assert len(prompt) - 1 in points and len(prompt) in points
        assert not {PREFILL_SLICE - 1, 2 * PREFILL_SLICE - 1} & points
        fresh = NativeBackend(loaded.model, 1024).prefill(prompt)
        torch.testing.assert_close(logits, fresh, rtol=0, atol=1e-5)
    finally:
        compute.shutdown()
