"""Batch generation: the same tokens as one prompt at a time, in input order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engines import engine_for
from llmcli.config.settings import SamplingParams
from llmcli.engine.batch import generate_batch
from llmcli.engine.conversation import build_messages, prompt_ids

from cli_helpers import run_cli

PROMPTS = [
    "Hello",
    "The capital of France is a city with a long history and many museums",
    "你好，世界",
    "Count: 1 2 3",
    "x",
    "Emoji 😀 and a stop string",
]


def one_by_one(loaded, prompts: list[list[int]], params: SamplingParams):
    results = []
    for prompt in prompts:
        generation = engine_for(loaded, loaded.eos_token_ids, loaded.context_length).generate(
            prompt, params, loaded.tokenizer
        )
        list(generation)
        results.append(generation.result)
    return results


def batched(
    loaded, prompts: list[list[int]], params: SamplingParams, static_cache: bool = False, native: bool = False
):
    return generate_batch(
        loaded.model,
        loaded.tokenizer,
        prompts,
        params,
        loaded.eos_token_ids,
        loaded.context_length,
        static_cache=static_cache,
        native=native,
    )


@pytest.mark.parametrize(
    ("static_cache", "native"),
    [(False, False), (True, False), (False, True)],
    ids=["dynamic", "static", "native"],
)
@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_batch_equals_one_by_one_under_greedy(
    loaded_tiny, static_cache: bool, native: bool, penalty: float
) -> None:
    """On the native forward each row runs at its own position over its own cache: rows of six
    lengths, finishing at different steps."""
    prompts = [prompt_ids(loaded_tiny.tokenizer, build_messages(text)) for text in PROMPTS]
    params = SamplingParams(temperature=0.0, max_new_tokens=20, repetition_penalty=penalty)
    expected = one_by_one(loaded_tiny, prompts, params)
    got = batched(loaded_tiny, prompts, params, static_cache, native)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert [r.text for r in got] == [r.text for r in expected]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in expected]


def test_batch_applies_stop_strings_per_row(loaded_tiny) -> None:
    prompts = [prompt_ids(loaded_tiny.tokenizer, build_messages(text)) for text in PROMPTS[:3]]
    free = one_by_one(loaded_tiny, prompts, SamplingParams(temperature=0.0, max_new_tokens=20))
    stop = free[1].text[3:5]
    params = SamplingParams(temperature=0.0, max_new_tokens=20, stop=(stop,))
    for native in (False, True):
        got = batched(loaded_tiny, prompts, params, native=native)
        assert [r.text for r in got] == [r.text for r in one_by_one(loaded_tiny, prompts, params)]
        assert stop not in got[1].text and got[1].finish_reason == "stop"


def test_batch_cli_writes_results_in_input_order(tiny_llama: Path, tmp_path: Path) -> None:
    batch = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"prompt": text}) if i % 2 else text for i, text in enumerate(PROMPTS)]
    batch.write_text("\n".join(lines) + "\n\n")
    args = ["generate", "-m", str(tiny_llama), "-t", "0", "-n", "12", "--json"]
    proc = run_cli(*args, "--batch", str(batch), "--batch-size", "4")
    assert proc.returncode == 0, proc.stderr.decode()
    records = [json.loads(line) for line in proc.stdout.decode().splitlines()]
    assert [r["index"] for r in records] == list(range(len(PROMPTS)))
    # Each record equals that prompt generated alone, as `generate` does it (the chat template,
    # the loop one token at a time): in-process here, one CLI run per prompt costs seconds each.
    from llmcli.config.settings import LoadSettings
    from llmcli.engine.conversation import build_messages, prompt_ids
    from llmcli.models.load import load_model
    from llmcli.models.resolve import resolve_model

    loaded = load_model(resolve_model(str(tiny_llama)), LoadSettings(device="cpu"))
    prompts = [prompt_ids(loaded.tokenizer, build_messages(text)) for text in PROMPTS]
    alone = one_by_one(loaded, prompts, SamplingParams(temperature=0.0, max_new_tokens=12))
    for single, record in zip(alone, records, strict=True):
        assert record["text"] == single.text
        assert record["completion_tokens"] == len(single.token_ids)
    assert "tok/s aggregate" in proc.stderr.decode()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "holds no prompts"),
        (b'{"prompt": 3}\n', 'needs a non-empty "prompt"'),
        (b"{oops\n", "not valid JSON"),
    ],
)
def test_batch_file_errors(tmp_path: Path, content: bytes, message: str) -> None:
    batch = tmp_path / "bad.jsonl"
    batch.write_bytes(content)
    proc = run_cli("generate", "--batch", str(batch))
    assert proc.returncode == 2 and message in proc.stderr.decode()
