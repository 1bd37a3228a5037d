"""The persistent KV cache across chat turns: exact, and reused."""

from __future__ import annotations

import pytest
import torch

from engines import engine_for
from llmcli.config.settings import SamplingParams
from llmcli.engine.conversation import Conversation, ids_for_text, render
from llmcli.engine.loop import Engine

from tiny_models import TINY_CONTEXT

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)
MESSAGES = [
    "Hello there!",
    "What is the capital of France?",
    "And the capital of Italy? 🇮🇹",
    "Tell me a short story about a lighthouse.",
    "你好，世界。",
    "Thanks. One more: count from one to five.",
    "Why is the sky blue?",
    "Summarize our chat.",
    "What did I ask first?",
    "Goodbye!",
]
# Qwen3-style: earlier assistant turns lose their <think> block when the chat is rendered again.
THINK_DROPPING_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set content = message['content'] -%}"
    "{%- if message['role'] == 'assistant' and not loop.last and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}"
)


def framing_tokens(tokenizer) -> int:
    """Tokens a turn adds besides the message: the template's framing of an empty user message,
    plus three: the previous reply's last sampled token (never fed to the model), and the
    "<|im_end|>\n" the template closes that reply with when it was cut at max_new_tokens."""
    empty_turn = render(tokenizer, [{"role": "user", "content": ""}], add_generation_prompt=True)
    return len(tokenizer(empty_turn, add_special_tokens=False)["input_ids"]) + 3


def chat_turns(loaded, conversation: Conversation, engine: Engine, messages: list[str], params=GREEDY):
    """Run the turns the way ChatSession does, yielding (generation, new message) per turn."""
    for message in messages:
        prompt, dropped = conversation.prompt_for(message, params.max_new_tokens)
        generation = engine.generate(prompt, params, loaded.tokenizer)
        list(generation)
        result = generation.result
        conversation.commit(message, prompt, dropped, result.text, result.token_ids, result.finish_reason)
        yield generation, prompt, message


def new_conversation(loaded, system: str | None = "You are terse.") -> tuple[Conversation, Engine]:
    engine = engine_for(loaded, loaded.eos_token_ids, loaded.context_length)
    return Conversation(loaded.tokenizer, loaded.context_length, system=system), engine


def assert_same_as_fresh_prefill(loaded, generation, prompt: list[int]) -> None:
    fresh = engine_for(loaded, backend="transformers")
    reference = fresh.generate(prompt, GREEDY, loaded.tokenizer)
    list(reference)
    difference = (generation.prefill_logits - reference.prefill_logits).abs().max().item()
    assert difference <= 1e-4
    assert generation.result.token_ids == reference.result.token_ids


def test_cached_turns_equal_a_full_prefill(loaded_tiny) -> None:
    conversation, engine = new_conversation(loaded_tiny)
    turns = list(chat_turns(loaded_tiny, conversation, engine, MESSAGES[:6]))
    for number, (generation, prompt, _) in enumerate(turns):
        assert_same_as_fresh_prefill(loaded_tiny, generation, prompt)
        if number > 0:
            assert generation.result.stats.cached_tokens > 0
    # The chat's ids keep the sampled tokens themselves, not a re-tokenization of their text.
    last_generation = turns[-1][0]
    assert conversation.ids[-len(last_generation.result.token_ids) :] == last_generation.result.token_ids


def assert_each_turn_prefills_only_the_new_message(loaded, template: str, params: SamplingParams) -> int:
    """Runs 10 turns; returns on how many turns (2 to 10) the bound was checked."""
    tokenizer = loaded.tokenizer
    original = tokenizer.chat_template
    if template == "think-dropping":
        tokenizer.chat_template = THINK_DROPPING_TEMPLATE
    checked = 0
    try:
        conversation, engine = new_conversation(loaded)
        previous_reply_is_plain = False
        turns = chat_turns(loaded, conversation, engine, MESSAGES, params)
        for number, (generation, prompt, message) in enumerate(turns, start=1):
            stats = generation.result.stats
            assert stats.prompt_tokens == len(prompt) == stats.prefilled_tokens + stats.cached_tokens
            if number >= 2 and previous_reply_is_plain:
                message_tokens = len(tokenizer(message, add_special_tokens=False)["input_ids"])
                assert stats.prefilled_tokens <= message_tokens + framing_tokens(tokenizer), f"turn {number}"
                checked += 1
            # A special token inside a reply (random weights emit them) is not part of its text, so
            # the template renders that reply differently and the cache is re-cropped there.
            text_ids = [t for t in generation.result.token_ids if t not in loaded.eos_token_ids]
            special_ids = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
            previous_reply_is_plain = not set(text_ids) & special_ids
    finally:
        tokenizer.chat_template = original
    return checked


@pytest.mark.demo
@pytest.mark.parametrize("template", ["chatml", "think-dropping"])
def test_each_turn_prefills_only_the_new_message_on_the_demo_model(loaded_demo, template: str) -> None:
    checked = assert_each_turn_prefills_only_the_new_message(loaded_demo, template, GREEDY)
    assert checked == 9  # a real chat model writes plain replies: every turn from 2 to 10 is checked


@pytest.mark.parametrize("template", ["chatml", "think-dropping"])
def test_each_turn_prefills_only_the_new_message_on_tiny_models(loaded_tiny, template: str) -> None:
    checked = assert_each_turn_prefills_only_the_new_message(loaded_tiny, template, GREEDY)
    assert checked >= 5


def test_a_template_that_rewrites_history_recrops_and_stays_exact(loaded_tiny) -> None:
    """An earlier reply with a <think> block: the template drops it, so the cache is cropped where
    the rewrite starts and re-prefilled from there, not from the start of the chat."""
    tokenizer = loaded_tiny.tokenizer
    original = tokenizer.chat_template
    tokenizer.chat_template = THINK_DROPPING_TEMPLATE
    try:
        conversation, engine = new_conversation(loaded_tiny)
        list(chat_turns(loaded_tiny, conversation, engine, MESSAGES[:2]))
        # The model "thought" before answering: its sampled ids hold the whole block.
        prompt, dropped = conversation.prompt_for(MESSAGES[2], GREEDY.max_new_tokens)
        reply = "<think>\nThe user wants Rome.\n</think>\n\nRome."
        reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        engine.warm(prompt + reply_ids[:-1])  # as if generated: all but the last token ran
        conversation.commit(MESSAGES[2], prompt, dropped, reply, reply_ids, "stop")

        ((generation, next_prompt, message),) = chat_turns(loaded_tiny, conversation, engine, [MESSAGES[3]])
        stats = generation.result.stats
        answer_tokens = len(tokenizer("Rome.", add_special_tokens=False)["input_ids"])
        message_tokens = len(tokenizer(message, add_special_tokens=False)["input_ids"])
        assert "<think>" not in tokenizer.decode(next_prompt)
        assert stats.cached_tokens >= len(prompt)  # everything before the rewritten reply is reused
        assert stats.prefilled_tokens <= answer_tokens + message_tokens + framing_tokens(tokenizer)
        assert_same_as_fresh_prefill(loaded_tiny, generation, next_prompt)
    finally:
        tokenizer.chat_template = original


def test_ids_for_text_keeps_the_longest_matching_prefix(loaded_tiny) -> None:
    tokenizer = loaded_tiny.tokenizer
    held = tokenizer("Hello world, this is a test", add_special_tokens=False)["input_ids"]
    same = ids_for_text(tokenizer, held, "Hello world, this is a test and more")
    assert same[: len(held)] == held
    changed = ids_for_text(tokenizer, held, "Hello world, that was different")
    assert tokenizer.decode(changed) == "Hello world, that was different"
    assert changed[:2] == held[:2]


def test_undo_returns_to_the_earlier_ids(loaded_tiny) -> None:
    conversation, engine = new_conversation(loaded_tiny)
    list(chat_turns(loaded_tiny, conversation, engine, MESSAGES[:2]))
    after_two = list(conversation.ids)
    list(chat_turns(loaded_tiny, conversation, engine, MESSAGES[2:3]))
    conversation.undo()
    # The sampled tokens of the first two turns are kept as they were (plus, for a reply that was
    # cut at max_new_tokens, the end-of-turn framing the template closes it with).
    assert conversation.ids[: len(after_two)] == after_two
    assert len(conversation.ids) - len(after_two) <= 2
    assert len(conversation.messages) == 4


def test_overflow_drops_oldest_exchanges_and_keeps_the_system_prompt(loaded_tiny) -> None:
    tokenizer = loaded_tiny.tokenizer
    conversation = Conversation(tokenizer, 120, system="Keep this system prompt.")
    engine = engine_for(loaded_tiny, loaded_tiny.eos_token_ids, 120)
    dropped_any = 0
    for message in MESSAGES:
        prompt, dropped = conversation.prompt_for(message, 12)
        assert len(prompt) + 12 <= 120
        generation = engine.generate(prompt, GREEDY, tokenizer)
        list(generation)
        result = generation.result
        conversation.commit(message, prompt, dropped, result.text, result.token_ids, result.finish_reason)
        dropped_any += dropped
        assert tokenizer.decode(conversation.ids).startswith("<|im_start|>system\nKeep this system prompt.")
    assert dropped_any > 0
    assert conversation.messages[-2]["content"] == MESSAGES[-1]


def test_a_message_larger_than_the_context_is_refused_and_nothing_is_lost(loaded_tiny) -> None:
    from llmcli.errors import ContextOverflowError

    conversation, engine = new_conversation(loaded_tiny)
    list(chat_turns(loaded_tiny, conversation, engine, MESSAGES[:1]))
    before = (list(conversation.messages), list(conversation.ids))
    with pytest.raises(ContextOverflowError, match=rf"the context holds {TINY_CONTEXT}"):
        conversation.prompt_for("word " * TINY_CONTEXT, 12)
    assert (conversation.messages, conversation.ids) == before


def test_plain_fallback_format_without_a_chat_template(loaded_tiny) -> None:
    tokenizer = loaded_tiny.tokenizer
    original = tokenizer.chat_template
    tokenizer.chat_template = None
    try:
        text = render(tokenizer, [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}])
        assert text == f"{tokenizer.bos_token or ''}S\n\nUser: Hi\nAssistant:"
        conversation, engine = new_conversation(loaded_tiny, system="S")
        assert conversation.stop_strings == ("\nUser:",)
        turns = list(chat_turns(loaded_tiny, conversation, engine, MESSAGES[:3]))
        assert all("\nUser:" not in generation.result.text for generation, _, _ in turns)
        assert turns[-1][0].result.stats.cached_tokens > 0
    finally:
        tokenizer.chat_template = original


def test_interrupted_forward_pass_leaves_the_cache_consistent(loaded_tiny) -> None:
    """Simulate Ctrl-C after some layers appended to the cache and others did not (transformers'
    DynamicCache; the native cache's case is in test_fast)."""
    conversation = Conversation(loaded_tiny.tokenizer, loaded_tiny.context_length, system="You are terse.")
    engine = engine_for(loaded_tiny, backend="transformers")
    list(chat_turns(loaded_tiny, conversation, engine, MESSAGES[:1]))
    held = len(engine.cached_ids)
    with torch.inference_mode():
        layer = engine.backend.cache.layers[0]
        extra = torch.zeros_like(layer.keys[..., :3, :])
        layer.keys = torch.cat([layer.keys, extra], dim=-2)
        layer.values = torch.cat([layer.values, extra], dim=-2)
    engine.restore_consistency()
    assert all(layer.get_seq_length() == held for layer in engine.backend.cache.layers)
    ((generation, prompt, _),) = chat_turns(loaded_tiny, conversation, engine, MESSAGES[1:2])
    assert_same_as_fresh_prefill(loaded_tiny, generation, prompt)
