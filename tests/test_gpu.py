"""What only a GPU can show. Skipped without CUDA (CI never has one); run with `pytest -m gpu`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmcli.load import load_model
from llmcli.resolve import ResolvedModel
from llmcli.settings import LoadSettings, SamplingParams

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
