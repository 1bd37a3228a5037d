"""Qwen3.5 (a Gated DeltaNet layer, then a gated full-attention one) on the native engine, where
--engine native asks for it: built from the folder without transformers, its logits within 1e-4
of transformers' own model in fp32 after a prefill and at every decode step, greedy tokens equal
to `generate`, and a chat's second turn, from the first turn's cache, equal to the conversation
prefilled fresh. Under auto it still loads through transformers, as before it had a row."""

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


def test_native_asked_builds_it_without_transformers_and_auto_keeps_transformers(
    folder: Path, loaded
) -> None:
    assert getattr(loaded.model, "architecture", None) == "Qwen3_5ForCausalLM"  # the lean loader's
    assert engine_for(loaded, backend="native").name == "native"
    assert engine_for(load(folder, "auto")).name == "transformers"


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
    end of the last (a template dropping the reply's last token) crops further back than a state
    can go: nothing is kept and the whole prompt runs again, to the same logits."""
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

    rewritten = second[:-1] + ids(12, seed=5)
    kept = engine.reuse_prefix(rewritten)
    assert kept == 0 and engine.backend.length == 0
    turn = engine.prefill(rewritten)
    assert (turn - last_logits(reference, rewritten)).abs().max().item() < ATOL


def test_a_pass_cut_short_leaves_a_cache_that_keeps_nothing(loaded) -> None:
    """A decode step that ran but never returned moved the state by a token nobody kept: the
    cache cropped back to what it says it holds keeps nothing, and the next prompt runs whole."""
    engine = engine_for(loaded, frozenset(), backend="native")
    prompt = ids(24, seed=6)
    engine.prefill(prompt)
    with torch.inference_mode():  # the step runs, its length never moved on
        engine.backend.net.decode(torch.tensor([5]), len(prompt), engine.backend.cache)
    engine.restore_consistency()
    assert engine.backend.length == 0 and engine.cached_ids == []


def test_generate_on_the_native_engine_imports_no_transformers_and_replies_as_transformers(
    folder: Path,
) -> None:
    assert_native_cli_replies_as_transformers(folder)  # auto: transformers, as before


def test_a_server_asked_for_several_sequences_at_once_refuses_in_one_line(folder: Path) -> None:
    from cli_helpers import run_cli

    proc = run_cli("serve", "-m", str(folder), "--engine", "native", "--port", "0", "--parallel", "2")
    stderr = proc.stderr.decode()
    assert proc.returncode == 2 and "one sequence at a time" in stderr and "Traceback" not in stderr
    assert stderr.count("\n") == 1


def test_fast_asked_for_a_recurrent_model_is_refused_not_dropped(folder: Path) -> None:
    """--fast asks for a fixed-shape step, which this model's recurrent layers do not have yet:
    said in one line, never run without it as though it were honoured."""
    from cli_helpers import run_cli

    proc = run_cli("generate", "-m", str(folder), "--engine", "native", "--fast", "-n", "2", "Hi")
    stderr = proc.stderr.decode()
    assert proc.returncode == 2 and "--fast" in stderr and "Traceback" not in stderr, stderr
    assert proc.stdout == b""
