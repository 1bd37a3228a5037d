"""The decode loop against transformers' own `model.generate`, and its stop conditions."""

from __future__ import annotations

import pytest
import torch

from engines import engine_for
from llmcli.config.settings import SamplingParams
from llmcli.engine.conversation import build_messages, prompt_ids

from tiny_models import TINY_CONTEXT

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=40)


def run(loaded, ids: list[int], params: SamplingParams):
    engine = engine_for(loaded, loaded.eos_token_ids, loaded.context_length)
    generation = engine.generate(ids, params, loaded.tokenizer)
    pieces = list(generation)
    return generation.result, pieces


def reference_greedy(loaded, ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = loaded.model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=sorted(loaded.eos_token_ids),
            pad_token_id=loaded.tokenizer.pad_token_id,
        )
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("raw", [False, True], ids=["chat-template", "raw"])
@pytest.mark.parametrize(
    "prompt", ["The capital of France is", "Emoji 😀 and 你好 in one prompt, then more text to continue:"]
)
def test_greedy_equals_model_generate(loaded_tiny, raw: bool, prompt: str) -> None:
    ids = prompt_ids(loaded_tiny.tokenizer, build_messages(prompt), raw=raw)
    result, _ = run(loaded_tiny, ids, GREEDY)
    expected = reference_greedy(loaded_tiny, ids, GREEDY.max_new_tokens)
    assert result.token_ids == expected
    assert len(expected) > 5  # a comparison of a few tokens would prove little


def test_chat_template_prompt_has_no_double_bos(loaded_tiny) -> None:
    ids = prompt_ids(loaded_tiny.tokenizer, build_messages("hi", system="Be brief."))
    text = loaded_tiny.tokenizer.apply_chat_template(
        build_messages("hi", system="Be brief."), add_generation_prompt=True, tokenize=False
    )
    assert loaded_tiny.tokenizer.decode(ids) == text
    assert text.startswith("<|im_start|>system\nBe brief.")


def test_final_text_equals_decode_of_generated_ids(loaded_tiny) -> None:
    ids = prompt_ids(loaded_tiny.tokenizer, build_messages("Streaming 😀 你好"))
    result, pieces = run(loaded_tiny, ids, SamplingParams(temperature=1.0, seed=3, max_new_tokens=60))
    text_ids = [t for t in result.token_ids if t not in loaded_tiny.eos_token_ids]
    assert "".join(pieces) == result.text
    decoded = loaded_tiny.tokenizer.decode(text_ids, skip_special_tokens=True)
    if result.finish_reason == "length":  # a character the limit cut in its middle is dropped
        decoded = decoded.rstrip("\ufffd")
    assert result.text == decoded


def test_seeded_sampling_is_reproducible(loaded_tiny) -> None:
    ids = prompt_ids(loaded_tiny.tokenizer, build_messages("Once upon a time"))
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, max_new_tokens=30, seed=1234)
    first, _ = run(loaded_tiny, ids, params)
    again, _ = run(loaded_tiny, ids, params)
    assert first.token_ids == again.token_ids
    others = {tuple(run(loaded_tiny, ids, params.with_(seed=seed))[0].token_ids) for seed in (1, 2, 3)}
    assert len(others | {tuple(first.token_ids)}) > 1, "different seeds never changed the sample"


def test_max_new_tokens_ends_with_length(loaded_tiny) -> None:
    ids = prompt_ids(loaded_tiny.tokenizer, build_messages("Count:"))
    eos_free = engine_for(loaded_tiny, frozenset(), loaded_tiny.context_length)
    generation = eos_free.generate(ids, GREEDY.with_(max_new_tokens=7), loaded_tiny.tokenizer)
    list(generation)
    assert generation.result.finish_reason == "length"
    assert len(generation.result.token_ids) == 7


def test_eos_ends_with_stop(loaded_tiny) -> None:
    ids = prompt_ids(loaded_tiny.tokenizer, build_messages("Count:"))
    free, _ = run(loaded_tiny, ids, GREEDY)
    # Declare the 4th generated token an end-of-sequence token: generation must end right there.
    eos = free.token_ids[3]
    engine = engine_for(loaded_tiny, frozenset({eos}), loaded_tiny.context_length)
    generation = engine.generate(ids, GREEDY, loaded_tiny.tokenizer)
    list(generation)
    first_eos = free.token_ids.index(eos)
    assert generation.result.token_ids == free.token_ids[: first_eos + 1]
    assert generation.result.finish_reason == "stop"


def test_stop_string_across_token_boundary(loaded_tiny) -> None:
    tokenizer = loaded_tiny.tokenizer
    ids = prompt_ids(tokenizer, build_messages("Tell me a story"))
    eos_free = engine_for(loaded_tiny, frozenset(), loaded_tiny.context_length)
    free = eos_free.generate(ids, GREEDY, tokenizer)
    list(free)
    token_texts = [tokenizer.decode([t]) for t in free.result.token_ids]
    # The first boundary between two multi-character, printable tokens after the start.
    k = next(
        i
        for i in range(2, len(token_texts) - 1)
        if len(token_texts[i].strip()) >= 1
        and len(token_texts[i + 1].strip()) >= 1
        and "\ufffd" not in token_texts[i] + token_texts[i + 1]
    )
    stop = token_texts[k][-1:] + token_texts[k + 1][:1]
    expected = free.result.text[: free.result.text.find(stop)]

    stopped = engine_for(loaded_tiny, frozenset(), loaded_tiny.context_length).generate(
        ids, GREEDY.with_(stop=(stop,)), tokenizer
    )
    pieces = list(stopped)
    assert stopped.result.finish_reason == "stop"
    assert stopped.result.text == expected
    assert stop not in "".join(pieces)


def test_prompt_longer_than_context_is_refused(loaded_tiny) -> None:
    from llmcli.errors import ContextOverflowError

    engine = engine_for(loaded_tiny, loaded_tiny.eos_token_ids, loaded_tiny.context_length)
    with pytest.raises(ContextOverflowError, match=str(TINY_CONTEXT)):
        engine.generate([5] * (TINY_CONTEXT + 40), GREEDY, loaded_tiny.tokenizer)


def test_reply_is_bounded_by_the_context(loaded_tiny) -> None:
    engine = engine_for(loaded_tiny, frozenset(), loaded_tiny.context_length)
    generation = engine.generate(
        [5] * (TINY_CONTEXT - 6), GREEDY.with_(max_new_tokens=100), loaded_tiny.tokenizer
    )
    list(generation)
    assert len(generation.result.token_ids) == 6
    assert generation.result.finish_reason == "length"


def test_stats_are_measured(loaded_tiny) -> None:
    ids = prompt_ids(loaded_tiny.tokenizer, build_messages("Hello"))
    engine = engine_for(loaded_tiny, frozenset(), loaded_tiny.context_length)
    generation = engine.generate(ids, GREEDY.with_(max_new_tokens=10), loaded_tiny.tokenizer)
    list(generation)
    stats = generation.result.stats
    assert stats.prompt_tokens == len(ids) == stats.prefilled_tokens
    assert stats.completion_tokens == 10
    assert stats.ttft_s > 0
    assert stats.decode_s > 0 and stats.decode_tok_s == pytest.approx(9 / stats.decode_s)
    assert stats.prefill_tok_s == pytest.approx(len(ids) / stats.ttft_s)


def test_a_second_call_reuses_the_cached_prefix(loaded_tiny) -> None:
    engine = engine_for(loaded_tiny, loaded_tiny.eos_token_ids, loaded_tiny.context_length)
    ids = prompt_ids(loaded_tiny.tokenizer, build_messages("Hello there"))
    first = engine.generate(ids, GREEDY, loaded_tiny.tokenizer)
    list(first)
    longer = [*ids, 7, 8, 9]
    second = engine.generate(longer, GREEDY, loaded_tiny.tokenizer)
    list(second)
    assert second.result.stats.prefilled_tokens == 3
    assert second.result.token_ids == reference_greedy(loaded_tiny, longer, GREEDY.max_new_tokens)


def test_a_character_cut_by_the_length_limit_is_dropped_not_shown_as_a_replacement(loaded_tiny) -> None:
    """Random weights write emoji and CJK byte by byte: cut at every length, the text never
    ends in U+FFFD, while the tokens' own decode does at some lengths (so the cut did happen)."""
    from llmcli.config.settings import SamplingParams
    from llmcli.engine.conversation import build_messages, prompt_ids
    from llmcli.engine.loop import Engine

    tokenizer = loaded_tiny.tokenizer
    engine = Engine.for_loaded(loaded_tiny)
    ids = prompt_ids(tokenizer, build_messages("Emoji split across tokens: 😀 🎉 🚀 and 你好，世界"))
    cut_somewhere = False
    for seed in range(6):
        for limit in range(1, 24):
            engine.reset()
            params = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=limit)
            result = engine.complete(ids, params, tokenizer)
            if result.finish_reason != "length":
                break
            assert not result.text.endswith("\ufffd"), (seed, limit)
            cut_somewhere |= tokenizer.decode(result.token_ids).endswith("\ufffd")
    assert cut_somewhere
