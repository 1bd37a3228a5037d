"""The static-cache decode path equals the dynamic one, cropping included."""

from __future__ import annotations

import pytest
import torch

from llmcli.config.settings import SamplingParams
from llmcli.engine.conversation import Conversation, build_messages, prompt_ids
from llmcli.engine.loop import Engine
from test_chat_cache import MESSAGES

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)


def engines(loaded) -> tuple[Engine, Engine]:
    dynamic = Engine(loaded.model, loaded.eos_token_ids, loaded.context_length)
    static = Engine(loaded.model, loaded.eos_token_ids, loaded.context_length, static_cache=True)
    return dynamic, static


def run(engine: Engine, ids: list[int], tokenizer, params: SamplingParams = GREEDY):
    generation = engine.generate(ids, params, tokenizer)
    list(generation)
    return generation


@pytest.mark.parametrize("raw", [False, True], ids=["chat-template", "raw"])
def test_static_cache_generates_the_same_tokens(loaded_tiny, raw: bool) -> None:
    ids = prompt_ids(loaded_tiny.tokenizer, build_messages("The capital of France is"), raw=raw)
    dynamic, static = engines(loaded_tiny)
    expected = run(dynamic, ids, loaded_tiny.tokenizer)
    got = run(static, ids, loaded_tiny.tokenizer)
    assert got.result.token_ids == expected.result.token_ids
    torch.testing.assert_close(got.prefill_logits, expected.prefill_logits, rtol=0, atol=1e-4)


def chat_with_crops(loaded, engine: Engine) -> list[list[int]]:
    """Turns that crop the cache in every way a chat does: the turn-to-turn prefix, /undo back two
    turns, /retry of a reply. After each turn the first logits must equal a fresh prefill."""
    tokenizer = loaded.tokenizer
    conversation = Conversation(tokenizer, loaded.context_length, system="Be brief.")
    tokens: list[list[int]] = []

    def turn(message: str) -> None:
        prompt, dropped = conversation.prompt_for(message, GREEDY.max_new_tokens)
        generation = run(engine, prompt, tokenizer)
        result = generation.result
        conversation.commit(message, prompt, dropped, result.text, result.token_ids, result.finish_reason)
        fresh = run(Engine(loaded.model, loaded.eos_token_ids, loaded.context_length), prompt, tokenizer)
        torch.testing.assert_close(generation.prefill_logits, fresh.prefill_logits, rtol=0, atol=1e-4)
        tokens.append(result.token_ids)

    for message in MESSAGES[:4]:
        turn(message)
    conversation.undo()
    conversation.undo()
    turn(MESSAGES[5])
    last = conversation.undo()
    turn(last.user)  # /retry
    turn(MESSAGES[6])
    return tokens


def test_static_cache_chat_with_undo_and_retry_equals_the_dynamic_path(loaded_tiny) -> None:
    dynamic, static = engines(loaded_tiny)
    assert chat_with_crops(loaded_tiny, static) == chat_with_crops(loaded_tiny, dynamic)


def test_static_cache_write_position_is_restored_after_an_interrupt(loaded_tiny) -> None:
    dynamic, static = engines(loaded_tiny)
    ids = prompt_ids(loaded_tiny.tokenizer, build_messages("Hello"))
    run(static, ids, loaded_tiny.tokenizer)
    held = len(static.cached_ids)
    # As if Ctrl-C landed mid-forward: one layer advanced its write position, the others did not.
    with torch.inference_mode():
        static.cache.layers[0].cumulative_length.add_(3)
    static.restore_consistency()
    assert all(int(layer.cumulative_length) == held for layer in static.cache.layers)
    follow_up = [*static.cached_ids, 7, 8, 9]
    got = run(static, follow_up, loaded_tiny.tokenizer)
    expected = run(dynamic, follow_up, loaded_tiny.tokenizer)
    assert got.result.stats.prefilled_tokens == 3
    assert got.result.token_ids == expected.result.token_ids


def test_fast_flag_gives_the_same_text_through_the_cli(tiny_llama) -> None:
    import json

    from cli_helpers import run_cli

    args = ["generate", "-m", str(tiny_llama), "-t", "0", "-n", "24", "--json", "Once upon a time"]
    fast, slow = run_cli(*args, "--fast"), run_cli(*args, "--no-fast")
    assert fast.returncode == 0 and slow.returncode == 0, fast.stderr.decode() + slow.stderr.decode()
    assert json.loads(fast.stdout)["text"] == json.loads(slow.stdout)["text"]
