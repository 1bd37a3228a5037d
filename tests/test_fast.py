"""Static shapes equal dynamic ones: transformers' static cache, and the native engine's bucketed
decode step (exactly what a CUDA graph replays, run eagerly here), cropping included."""

from __future__ import annotations

import pytest
import torch

from engines import engine_for
from llmcli.config.settings import SamplingParams
from llmcli.engine.conversation import Conversation, build_messages, prompt_ids
from llmcli.engine.loop import Engine
from llmcli.engine.native.kvcache import MIN_BUCKET
from test_chat_cache import MESSAGES

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)
BACKENDS = ["transformers", "native"]


def engines(loaded, backend: str) -> tuple[Engine, Engine]:
    """(the dynamic path, the static-shape path) of one backend."""
    return engine_for(loaded, backend=backend), engine_for(loaded, backend=backend, fast=True)


def run(engine: Engine, ids: list[int], tokenizer, params: SamplingParams = GREEDY):
    generation = engine.generate(ids, params, tokenizer)
    list(generation)
    return generation


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("raw", [False, True], ids=["chat-template", "raw"])
def test_static_shapes_generate_the_same_tokens(loaded_tiny, backend: str, raw: bool) -> None:
    ids = prompt_ids(loaded_tiny.tokenizer, build_messages("The capital of France is"), raw=raw)
    dynamic, static = engines(loaded_tiny, backend)
    assert static.name == dynamic.name == backend
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
        fresh = run(engine_for(loaded, backend="transformers"), prompt, tokenizer)
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_static_shapes_chat_with_undo_and_retry_equals_the_dynamic_path(loaded_tiny, backend: str) -> None:
    dynamic, static = engines(loaded_tiny, backend)
    assert chat_with_crops(loaded_tiny, static) == chat_with_crops(loaded_tiny, dynamic)


@pytest.mark.parametrize("arch", ["gemma3_text", "gpt_oss"])
def test_a_chat_over_sliding_rings_equals_fresh_prefills_through_undo_and_retry(
    arch: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Sliding layers of window 8 keep rings of 72 slots: the chat's turns wrap them, /undo and
    /retry crop past their slack (the engine runs the conversation again) or within it; every
    turn's first logits equal a fresh prefill's, exact and bucketed alike."""
    from llmcli.config.settings import LoadSettings
    from llmcli.models.load import load_model
    from llmcli.models.resolve import resolve_model

    from tiny_models import build_tiny_model

    folder = build_tiny_model(tmp_path_factory.mktemp("models") / f"tiny-{arch}", arch)
    loaded = load_model(resolve_model(str(folder)), LoadSettings(device="cpu", threads=1))
    dynamic, static = engines(loaded, "native")
    assert dynamic.backend.cache.rings[0] == 8 + 64  # layer 0 slides
    assert chat_with_crops(loaded, static) == chat_with_crops(loaded, dynamic)


def test_static_cache_write_position_is_restored_after_an_interrupt(loaded_tiny) -> None:
    dynamic, static = engines(loaded_tiny, "transformers")
    ids = prompt_ids(loaded_tiny.tokenizer, build_messages("Hello"))
    run(static, ids, loaded_tiny.tokenizer)
    held = len(static.cached_ids)
    layers = static.backend.cache.layers
    # As if Ctrl-C landed mid-forward: one layer advanced its write position, the others did not.
    with torch.inference_mode():
        layers[0].cumulative_length.add_(3)
    static.restore_consistency()
    assert all(int(layer.cumulative_length) == held for layer in layers)
    follow_up = [*static.cached_ids, 7, 8, 9]
    got = run(static, follow_up, loaded_tiny.tokenizer)
    expected = run(dynamic, follow_up, loaded_tiny.tokenizer)
    assert got.result.stats.prefilled_tokens == 3
    assert got.result.token_ids == expected.result.token_ids


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "bucketed"])
def test_native_cache_ignores_what_an_interrupted_pass_wrote(loaded_tiny, fast: bool) -> None:
    reference = engine_for(loaded_tiny, backend="transformers")
    native = engine_for(loaded_tiny, backend="native", fast=fast)
    ids = prompt_ids(loaded_tiny.tokenizer, build_messages("Hello"))
    run(native, ids, loaded_tiny.tokenizer)
    cache = native.backend.cache
    # As if Ctrl-C landed mid-prefill: layer 0 wrote keys for 5 more tokens, the length did not move.
    with torch.inference_mode():
        junk = torch.randn(cache.shape[0], 5, cache.shape[1])
        cache.write(0, junk, junk)
    native.restore_consistency()
    assert cache.length == len(native.cached_ids)
    follow_up = [*native.cached_ids, 7, 8, 9]
    got = run(native, follow_up, loaded_tiny.tokenizer)
    expected = run(reference, follow_up, loaded_tiny.tokenizer)
    assert got.result.stats.prefilled_tokens == 3
    assert got.result.token_ids == expected.result.token_ids
    torch.testing.assert_close(got.prefill_logits, expected.prefill_logits, rtol=0, atol=1e-4)


def test_crossing_a_bucket_mid_reply_and_cropping_back_below_it(loaded_tiny) -> None:
    """A reply that grows the cache past the first bucket (the tensors move, the attention span
    doubles), then a prompt that crops back below it: the same tokens as transformers' path."""
    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    vocab = loaded_tiny.model.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, vocab, (MIN_BUCKET - 20,), generator=generator).tolist()
    bucketed = engine_for(loaded_tiny, frozenset(), backend="native", fast=True)
    reference = engine_for(loaded_tiny, frozenset(), backend="transformers")
    cache = bucketed.backend.cache
    first = run(bucketed, prompt, None, params)
    assert cache.capacity > MIN_BUCKET and cache.length == MIN_BUCKET + 19  # crossed mid-reply
    assert first.result.token_ids == run(reference, prompt, None, params).result.token_ids
    back = [*prompt[:100], 5, 6, 7]
    second = run(bucketed, back, None, params)
    assert second.result.stats.prefilled_tokens == 3  # cropped to 100, below the bucket boundary
    reference.reset()
    assert second.result.token_ids == run(reference, back, None, params).result.token_ids


def test_fast_flag_gives_the_same_text_through_the_cli(tiny_llama) -> None:
    import json

    from cli_helpers import run_cli

    args = ["generate", "-m", str(tiny_llama), "-t", "0", "-n", "24", "--json", "Once upon a time"]
    fast, slow = run_cli(*args, "--fast"), run_cli(*args, "--no-fast")
    assert fast.returncode == 0 and slow.returncode == 0, fast.stderr.decode() + slow.stderr.decode()
    assert json.loads(fast.stdout)["text"] == json.loads(slow.stdout)["text"]
    assert json.loads(fast.stdout)["engine"] == "native"
