"""Token producers keep one promise: wherever the consumer stops taking tokens, the cache holds
exactly the tokens before the last one taken, and the ids the engine says it holds. Checked by
stopping after every count of tokens, mid-round included (a speculative round yields several
tokens from one pass), on both backends."""

from __future__ import annotations

from itertools import islice

import pytest

from engines import engine_for
from llmcli.config.settings import SamplingParams
from llmcli.engine import producers
from llmcli.engine.producers import Chooser
from llmcli.engine.speculative import Speculation, SpeculativeStats
from llmcli.engine.speculative.drafters import ModelDrafter
from llmcli.engine.speculative.schedule import DraftLength

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=40)
REPEATING = "the cat sat on the mat, and the dog sat on the log; " * 4


def start(loaded, backend: str, speculate: bool):
    engine = engine_for(loaded, frozenset(), backend=backend)
    prompt = loaded.tokenizer(REPEATING)["input_ids"]
    logits = engine.prefill(prompt)
    choose = Chooser(GREEDY, None, engine.device, list(prompt))
    if not speculate:
        return engine, prompt, producers.plain(engine, logits, choose), None
    # The model drafting for itself (its own weights, its own cache): every draft is accepted,
    # so each round yields up to 7 tokens and the consumer's stops fall inside runs.
    speculation = Speculation(
        ModelDrafter(engine_for(loaded, frozenset(), backend=backend), "self"), DraftLength(6)
    )
    speculation.drafter.start(prompt)
    stats = SpeculativeStats("draft")
    produced = producers.speculative(engine, logits, choose, speculation, 40, stats)
    return engine, prompt, produced, stats


@pytest.mark.parametrize("backend", ["native", "transformers"])
@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "speculative"])
def test_the_cache_holds_what_was_taken_wherever_the_consumer_stops(loaded_tiny, backend, speculate) -> None:
    engine, prompt, produced, _ = start(loaded_tiny, backend, speculate)
    reference = list(islice(produced, 30))
    produced.close()
    for taken in (1, 2, 3, 5, 8, 13, 21):
        engine, prompt, produced, stats = start(loaded_tiny, backend, speculate)
        got = list(islice(produced, taken))  # takes exactly `taken`: asks for no more
        produced.close()  # the consumer stops here: after `taken` tokens, whatever the round
        assert got == reference[:taken]  # greedy, the same tokens either way
        assert engine.cached_ids == prompt + got[:-1]
        assert engine.backend.length == len(engine.cached_ids)
        if speculate and taken > 8:
            assert stats.accepted >= taken // 2  # rounds yielded runs of drafts: stops fell inside


def test_the_plain_producer_cropped_after_an_interrupted_step(loaded_tiny) -> None:
    """A decode step cut short (Ctrl-C inside the backend) leaves nothing half-written."""
    engine, prompt, produced, _ = start(loaded_tiny, "native", False)
    first = next(produced)
    decode = engine.backend.decode

    def interrupted(token):
        decode(token)  # the step ran and wrote its keys and values…
        raise KeyboardInterrupt  # …but the call never returned

    engine.backend.decode = interrupted
    with pytest.raises(KeyboardInterrupt):
        next(produced)
    assert engine.cached_ids == [*prompt] and first not in engine.cached_ids[len(prompt) :]
    assert engine.backend.length == len(prompt)


@pytest.fixture(scope="module")
def recurrent(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Qwen3.5 (a gated DeltaNet layer, then attention) on transformers' engine, whose
    recurrent state cannot be cropped back (the native engine's checkpoints: test_qwen35.py)."""
    from llmcli.config.settings import LoadSettings
    from llmcli.models.load import load_model
    from llmcli.models.resolve import resolve_model

    from tiny_models import build_tiny_model

    folder = build_tiny_model(tmp_path_factory.mktemp("models") / "qwen3_5", "qwen3_5")
    settings = LoadSettings(device="cpu", threads=1, engine="transformers")
    return load_model(resolve_model(str(folder)), settings)


def test_rejected_drafts_on_a_cache_that_cannot_go_back_are_run_again(recurrent, loaded_tiny) -> None:
    """Cropping a rejected draft empties the cache instead; the producer runs again what it must
    hold, so the reply is the plain one, token for token."""
    prompt = recurrent.tokenizer(REPEATING)["input_ids"]

    def produced(speculation: Speculation | None) -> tuple[list[int], SpeculativeStats]:
        engine = engine_for(recurrent, frozenset(), backend="transformers")
        logits = engine.prefill(prompt)
        choose = Chooser(GREEDY, None, engine.device, list(prompt))
        stats = SpeculativeStats("draft")
        if speculation is None:
            return list(islice(producers.plain(engine, logits, choose), 30)), stats
        speculation.drafter.start(prompt)
        return list(islice(producers.speculative(engine, logits, choose, speculation, 40, stats), 30)), stats

    # Another model drafts (the tiny Llama or Qwen2, same vocabulary): most drafts are rejected.
    drafter = ModelDrafter(engine_for(loaded_tiny, frozenset()), "other")
    speculative, stats = produced(Speculation(drafter, DraftLength(4)))
    assert speculative == produced(None)[0]
    assert stats.drafted > stats.accepted


def test_a_step_cut_short_on_a_recurrent_state_empties_the_cache(recurrent) -> None:
    """The interrupted step has moved the state by a token nobody kept: the cache holds nothing
    (and says so), and the next reply, prefilled whole, is the one a fresh engine gives."""
    engine = engine_for(recurrent, frozenset(), backend="transformers")
    prompt = recurrent.tokenizer(REPEATING)["input_ids"]
    choose = Chooser(GREEDY, None, engine.device, list(prompt))
    produced = producers.plain(engine, engine.prefill(prompt), choose)
    next(produced)
    step = engine.backend._decode

    def interrupted(*args):
        step(*args)  # the step ran and moved the state…
        raise KeyboardInterrupt  # …but the call never returned

    engine.backend._decode = interrupted
    with pytest.raises(KeyboardInterrupt):
        next(produced)
    engine.backend._decode = step
    assert engine.cached_ids == [] and engine.backend.length == 0
    again = engine.complete(prompt, GREEDY)
    assert again.stats.cached_tokens == 0
    fresh = engine_for(recurrent, frozenset(), backend="transformers")
    assert again.token_ids == fresh.complete(prompt, GREEDY).token_ids
