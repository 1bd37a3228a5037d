"""What only a GPU can show. Skipped without CUDA (CI never has one); run with `pytest -m gpu`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmcli.config.settings import LoadSettings, SamplingParams
from llmcli.models.load import load_model
from llmcli.models.resolve import ResolvedModel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


class Recorder:
    """Collects what a chat shows, for assertions."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.replies: list[str] = []

    def reply_start(self) -> None: ...
    def reply_piece(self, text: str) -> None: ...
    def reply_end(self, result, turn) -> None:
        self.replies.append(turn.reply)

    def info(self, text: str) -> None: ...
    def notice(self, text: str) -> None: ...
    def error(self, text: str) -> None:
        self.errors.append(text)


def test_out_of_memory_in_a_chat_turn_keeps_the_chat(tiny_llama: Path) -> None:
    from llmcli.frontends.chat_session import ChatSession

    loaded = load_model(
        ResolvedModel(name="tiny", path=tiny_llama, source="folder"), LoadSettings(device="cuda")
    )
    view = Recorder()
    session = ChatSession(loaded, SamplingParams(temperature=0.0, max_new_tokens=8), view)
    assert session.turn("Hello there") is not None
    before = (list(session.conversation.messages), list(session.conversation.ids))
    # Leave almost nothing free, then ask for a long prompt: the prefill runs out of memory.
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(int(free * 0.995), dtype=torch.uint8, device="cuda")
    try:
        assert session.turn("word " * 300) is None  # fits the context, not the memory
    finally:
        del hog
        torch.cuda.empty_cache()
    assert view.errors and "out of memory" in view.errors[-1]
    assert (session.conversation.messages, session.conversation.ids) == before
    assert len(session.engine.cached_ids) == session.engine.cache.get_seq_length()
    assert session.turn("Still there?") is not None


def test_graph_captured_decode_equals_the_dynamic_path(tiny_llama: Path) -> None:
    from llmcli.engine.conversation import build_messages, prompt_ids
    from llmcli.engine.loop import Engine

    resolved = ResolvedModel(name="tiny", path=tiny_llama, source="folder")
    loaded = load_model(resolved, LoadSettings(device="cuda"))
    ids = prompt_ids(loaded.tokenizer, build_messages("The capital of France is"))
    params = SamplingParams(temperature=0.0, max_new_tokens=32)
    dynamic = Engine(loaded.model, frozenset(), loaded.context_length)
    fast = Engine(loaded.model, frozenset(), loaded.context_length, compile_decode=True)
    assert fast.warm_up() > 0
    runs = []
    for engine in (dynamic, fast, fast):  # the second fast run replays the captured graph
        engine.reset()
        generation = engine.generate(ids, params, loaded.tokenizer)
        list(generation)
        runs.append(generation)
    assert runs[1].result.token_ids == runs[0].result.token_ids == runs[2].result.token_ids
    torch.testing.assert_close(runs[1].prefill_logits, runs[0].prefill_logits, rtol=2e-2, atol=2e-2)
