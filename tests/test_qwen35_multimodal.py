"""Qwen3.5's vision-language checkpoints (…ForConditionalGeneration: the language model's tensors
under `model.language_model.`, its config config.json's `text_config`, a vision tower beside) on
the native engine where --engine native asks: their text part read by the lean loader, held to
transformers' whole model by the dense model's checks (logits within 1e-4 in fp32 after a prefill
and at every decode step, greedy tokens equal to its `generate`, `generate --engine native`
replying as transformers does without importing it). An image is refused in one line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from test_qwen35 import (  # noqa: F401  (collected here, on this module's fixtures)
    load,
    test_generate_on_the_native_engine_imports_no_transformers_and_replies_as_transformers,
    test_greedy_tokens_equal_transformers_generate,
    test_prefill_and_every_decode_step_match_transformers,
)

from test_serve import Server, served
from tiny_models import MULTIMODAL_FAMILIES, build_tiny_model, vision_language_model


@pytest.fixture(scope="module", params=sorted(MULTIMODAL_FAMILIES))
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / request.param, request.param)


@pytest.fixture(scope="module")
def reference(folder: Path):
    """transformers' whole model, vision tower and all, as the checkpoint names it."""
    return vision_language_model(folder)


@pytest.fixture(scope="module")
def loaded(folder: Path):
    return load(folder, "native")


def test_the_lean_loader_reads_the_language_model_alone(folder: Path, loaded) -> None:
    assert loaded.model.architecture == MULTIMODAL_FAMILIES[folder.name][1]
    names = [name for name, _ in loaded.model.named_parameters()]
    assert names and not any("visual" in name or "language_model" in name for name in names)


@pytest.fixture(scope="module")
def server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from served(folder, tmp_path_factory.mktemp("runtime"), "--engine", "native")


def test_a_bad_image_is_refused_in_one_line_naming_it(server: Server) -> None:
    """The checkpoint reads images (tests/test_vision_engine.py); bytes that are no image are a
    400 naming the part, in each protocol's shape."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}]}
    status, answer = server.raw("POST", "/v1/chat/completions", json.dumps(body).encode())
    message = answer["error"]["message"]
    assert status == 400 and "messages[0].content[1]" in message and "not an image" in message
    assert "\n" not in message
    body = {"model": "tiny", "messages": [{"role": "user", "content": "What is it?", "images": ["AAAA"]}]}
    status, answer = server.raw("POST", "/api/chat", json.dumps(body).encode())
    assert status == 400 and "messages[0].images[0]" in answer["error"]
