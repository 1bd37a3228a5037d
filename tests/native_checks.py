"""Checks a native family's tests share (test_qwen35.py, test_gemma4.py): the engine's logits
against transformers' own model in fp32, whole-text pass by pass, and its greedy tokens against
`generate`; the CLI's native reply against transformers'."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

ATOL = 1e-4


def last_logits(reference: Any, tokens: list[int]) -> torch.Tensor:
    """transformers' logits for the token after `tokens`, the whole text run at once."""
    with torch.inference_mode():
        return reference(torch.tensor([tokens])).logits[0, -1:].float()


def assert_prefill_and_steps_match(backend: Any, reference: Any, tokens: list[int], steps: int = 16) -> float:
    """`tokens` prefilled, then `steps` greedy decode steps, each within ATOL of transformers'
    whole-text pass; the largest difference seen."""
    tokens = list(tokens)
    logits = backend.prefill(tokens)
    worst = (logits - last_logits(reference, tokens)).abs().max().item()
    assert worst < ATOL
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        logits = backend.decode(torch.tensor([tokens[-1]]))
        step = (logits - last_logits(reference, tokens)).abs().max().item()
        assert step < ATOL, len(tokens)
        worst = max(worst, step)
    return worst


def assert_greedy_equals_generate(backend: Any, reference: Any, prompt: list[int], count: int) -> None:
    """`count` greedy tokens of the backend equal to transformers' `generate` (no end of text)."""
    with torch.inference_mode():
        expected = reference.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=count,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    logits, produced = backend.prefill(prompt), []
    for _ in range(len(expected)):
        produced.append(int(logits.argmax()))
        logits = backend.decode(torch.tensor([produced[-1]]))
    assert len(expected) == count
    assert produced == expected


def assert_check_rows_are_decode_steps(
    backend: Any, reference: Any, prompt: list[int], drafted: list[int]
) -> None:
    """Rows scored in one pass (a draft checked), each the logits after its prefix."""
    backend.prefill(prompt)
    rows = backend.score(drafted)
    for row in range(len(drafted)):
        expected = last_logits(reference, prompt + drafted[: row + 1])
        assert (rows[row : row + 1] - expected).abs().max().item() < ATOL, row


def assert_native_cli_replies_as_transformers(folder: Path, *plain: str) -> None:
    """`generate --engine native` imports no transformers and replies as the transformers engine
    does (`plain`: the flags that pick it, none where auto does)."""
    from cli_helpers import run_cli, run_reporting_imports

    args = ["generate", "-m", str(folder), "-t", "0", "-n", "12", "--json", "The capital of France"]
    result = run_reporting_imports(*args, "--engine", "native")
    assert "exit 0 imported -" in result.stderr, result.stderr
    native = json.loads(result.stdout)
    transformers = json.loads(run_cli(*args, *plain).stdout)
    assert (native["engine"], transformers["engine"]) == ("native", "transformers")
    assert native["text"] == transformers["text"]
    assert native["completion_tokens"] == transformers["completion_tokens"]


def load_lean(folder: Path, engine: str) -> Any:
    """The tiny model in fp32 on the CPU, through the lean loader where it can (`engine`: the
    --engine setting)."""
    from llmcli.config.settings import LoadSettings
    from llmcli.models.load import load_model
    from llmcli.models.resolve import resolve_model

    return load_model(
        resolve_model(str(folder)),
        LoadSettings(device="cpu", dtype="fp32", threads=1, engine=engine),
        lean=True,
    )


def transformers_model(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
