"""Qwen3.5 (a Gated DeltaNet layer, then a gated full-attention one) on the native engine:
built from the folder without transformers, its logits within 1e-4 of transformers' own model in
fp32 after a prefill and at every decode step, greedy tokens equal to `generate`, a chat's second
turn, from the first turn's cache, equal to the conversation prefilled fresh, and a crop going
back to the last checkpoint of the recurrent state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines import engine_for
from native_checks import (
    ATOL,
    assert_check_rows_are_decode_steps,
    assert_greedy_equals_generate,
    assert_native_cli_replies_as_transformers,
    assert_prefill_and_steps_match,
    last_logits,
    load_lean,
    transformers_model,
)

from tiny_models import build_tiny_model

VOCAB = 400  # the tiny tokenizer's trained tokens (its specials lie past them)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "qwen3_5", "qwen3_5")


@pytest.fixture(scope="module")
def reference(folder: Path):
    return transformers_model(folder)


def load(folder: Path, engine: str):
    return load_lean(folder, engine)


@pytest.fixture(scope="module")
def loaded(folder: Path):
    return load(folder, "native")


def ids(count: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_auto_builds_it_natively_without_transformers(folder: Path, loaded) -> None:
    assert getattr(loaded.model, "architecture", None) == "Qwen3_5ForCausalLM"  # the lean loader's
    assert engine_for(loaded, backend="native").name == "native"
    assert engine_for(load(folder, "auto")).name == "native"
    assert engine_for(load(folder, "transformers"), backend="transformers").name == "transformers"


def test_prefill_and_every_decode_step_match_transformers(loaded, reference) -> None:
    """A prompt longer than a chunk of the rule (64), then 16 decode steps, each against
    transformers' whole-text pass."""
    from llmcli.engine.native.backend import NativeBackend

    worst = assert_prefill_and_steps_match(NativeBackend(loaded.model, 256), reference, ids(80, seed=1))
    print(f"max |native - transformers| over prefill and 16 steps: {worst:.2e}")


def test_greedy_tokens_equal_transformers_generate(loaded, reference) -> None:
    from llmcli.engine.native.backend import NativeBackend

    assert_greedy_equals_generate(NativeBackend(loaded.model, 256), reference, ids(20, seed=2), 32)


def test_a_speculative_check_gives_each_row_what_its_decode_step_would(loaded, reference) -> None:
    """Rows scored in one pass (a draft checked), each the logits after its prefix."""
    from llmcli.engine.native.backend import NativeBackend

    backend = NativeBackend(loaded.model, 256)
    assert_check_rows_are_decode_steps(backend, reference, ids(30, seed=7), ids(5, seed=8))


def test_a_second_turn_from_the_first_turns_cache_equals_the_conversation_prefilled_fresh(
    loaded, reference
) -> None:
    """Extending what the cache holds keeps it (the state carries on); a turn that rewrites the
    end of the last (a template rewriting its last tokens) goes back to the checkpoint taken
    where the first turn's text ended, and runs only the rest, to the same logits."""
    from llmcli.engine.native.backend import NativeBackend

    engine = engine_for(loaded, frozenset(), backend="native")
    first = ids(40, seed=3)
    assert engine.reuse_prefix(first) == 0
    logits = engine.prefill(first)
    for _ in range(8):
        logits = engine.decode_step(int(logits.argmax()))
    held = list(engine.cached_ids)
    second = held + ids(30, seed=4)
    kept = engine.reuse_prefix(second)
    assert kept == len(held)
    turn = engine.prefill(second[kept:])
    fresh = NativeBackend(loaded.model, 256).prefill(second)
    assert (turn - fresh).abs().max().item() < ATOL
    assert (turn - last_logits(reference, second)).abs().max().item() < ATOL

    rewritten = second[:-3] + ids(12, seed=5)
    kept = engine.reuse_prefix(rewritten)
    assert kept == len(held) and engine.backend.length == len(held)
    turn = engine.prefill(rewritten[kept:])
    assert (turn - last_logits(reference, rewritten)).abs().max().item() < ATOL


@pytest.mark.parametrize(
    ("keep", "kept"),
    [(70, 70), (69, 69), (68, 48), (48, 48), (47, 40), (40, 40), (39, 39), (38, 0)],
    ids=["all", "one-before", "in-the-prompt", "a-turns-end", "in-the-reply", "the-end", "one-before-the-end",
         "in-the-first-prompt"],
)  # fmt: skip
def test_a_crop_goes_back_to_the_last_checkpoint_at_or_before_it(loaded, reference, keep, kept) -> None:
    """Checkpoints are where each prefill started, one token before it ended and where it ended
    (the prompt's 39 and 40, the reply's end 48, the second prompt's 69 and 70): a crop keeps the
    last one at or before what it asks, the prefix store is told that much before it crops, and
    what runs after it is exact."""
    engine = engine_for(loaded, frozenset(), backend="native")
    logits = engine.prefill(ids(40, seed=3))
    for _ in range(8):
        logits = engine.decode_step(int(logits.argmax()))
    engine.prefill(ids(22, seed=4))
    text = list(engine.cached_ids)
    assert engine.backend.resumable(keep) == kept
    engine.crop_to(keep)
    assert engine.cached_ids == text[:kept] and engine.backend.length == kept
    rest = text[kept:] + ids(5, seed=7)
    turn = engine.prefill(rest)
    assert (turn - last_logits(reference, text + ids(5, seed=7))).abs().max().item() < ATOL


def test_a_crop_after_a_check_lands_on_the_tokens_it_accepted(loaded, reference) -> None:
    """A speculative check keeps each row's state: cropping its rejected rows keeps exactly the
    accepted ones (not the prompt's checkpoint before them), and decoding on from there is exact."""
    engine = engine_for(loaded, frozenset(), backend="native")
    prompt = ids(20, seed=8)
    engine.prefill(prompt)
    drafted = ids(5, seed=9)
    engine.score(drafted)
    engine.crop_to(len(prompt) + 2)
    assert engine.backend.length == len(prompt) + 2
    logits = engine.decode_step(7)
    expected = last_logits(reference, [*prompt, *drafted[:2], 7])
    assert (logits - expected).abs().max().item() < ATOL


def test_a_pass_cut_short_goes_back_to_the_checkpoint_before_it(loaded, reference) -> None:
    """A decode step that ran but never returned moved the state by a token nobody kept: the
    cache cropped back to what it says it holds goes back to the prompt's end, a checkpoint,
    and the text held then continues exactly."""
    engine = engine_for(loaded, frozenset(), backend="native")
    prompt = ids(24, seed=6)
    logits = engine.prefill(prompt)
    token = int(logits.argmax())
    engine.decode_step(token)
    with torch.inference_mode():  # the step runs, its length never moved on
        engine.backend.net.decode(torch.tensor([5]), len(prompt) + 1, engine.backend.cache)
    engine.restore_consistency()
    assert engine.backend.length == len(prompt) and engine.cached_ids == prompt
    turn = engine.prefill([token, 9])
    assert (turn - last_logits(reference, [*prompt, token, 9])).abs().max().item() < ATOL


def test_generate_on_the_native_engine_imports_no_transformers_and_replies_as_transformers(
    folder: Path,
) -> None:
    assert_native_cli_replies_as_transformers(folder, "--engine", "transformers")


def test_fast_asked_for_a_recurrent_model_is_refused_not_dropped(folder: Path) -> None:
    """--fast asks for a fixed-shape step, which this model's recurrent layers do not have yet:
    said in one line, never run without it as though it were honoured."""
    from cli_helpers import run_cli

    proc = run_cli("generate", "-m", str(folder), "--engine", "native", "--fast", "-n", "2", "Hi")
    stderr = proc.stderr.decode()
    assert proc.returncode == 2 and "--fast" in stderr and "Traceback" not in stderr, stderr
    assert proc.stdout == b""


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quant_covers_the_deltanet_projections_and_equals_transformers_on_the_same_weights(
    folder: Path, quant: str
) -> None:
    """--quant quantizes the DeltaNet layers' projections as any other linear layer (they are a
    third of a Qwen3.5 layer's weights): none stays a float matrix, built from the folder or
    from transformers' model, and the native engine's logits equal transformers' own on the
    same quantized weights."""
    from llmcli.config.settings import LoadSettings
    from llmcli.models.load import load_model
    from llmcli.models.quantized import QuantizedLinear, QuantizedSlice
    from llmcli.models.resolve import resolve_model

    settings = LoadSettings(device="cpu", dtype="fp32", threads=1, quant=quant)
    lean = load_model(resolve_model(str(folder)), settings, lean=True)
    full = load_model(resolve_model(str(folder)), settings)  # transformers builds it
    prompt = ids(30, seed=11)
    logits = {}
    for name, loaded, backend in [
        ("lean", lean, "native"),
        ("native", full, "native"),
        ("hf", full, "transformers"),
    ]:
        mixer = loaded.model.model.layers[0].linear_attn
        for part in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
            assert isinstance(getattr(mixer, part), QuantizedLinear | QuantizedSlice), (name, part)
        engine = engine_for(loaded, frozenset(), backend=backend)
        assert engine.name == backend
        logits[name] = engine.prefill(prompt)
    torch.testing.assert_close(logits["native"], logits["hf"], rtol=0, atol=ATOL)
    torch.testing.assert_close(logits["lean"], logits["native"], rtol=0, atol=ATOL)


def test_kv_bytes_per_token_counts_only_the_layers_that_keep_keys_and_values(loaded) -> None:
    """What --json, the server's budget for kept conversations and the estimates say a token
    costs is what the cache holds per position: the full-attention layers' keys and values
    (the linear layers' states, a fixed size, counted apart)."""
    from llmcli.engine.native.backend import NativeBackend
    from llmcli.engine.native.recurrent_cache import MAX_CHECKPOINTS

    cache = NativeBackend(loaded.model, 1024).cache
    per_position = (cache.bytes_for(512) - (1 + MAX_CHECKPOINTS) * cache.state_bytes) // 512
    assert loaded.kv_bytes_per_token == per_position
    assert sum(not kept for kept in cache.kv_layers) == 1  # the DeltaNet layer holds none
