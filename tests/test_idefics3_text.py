"""SmolVLM's and Idefics3's vision-language checkpoints (a Llama as the language model, under
`model.text_model.`) on the native engine: their text part read by the lean loader, held to
transformers' whole model on text-only prompts by the dense model's checks (logits within 1e-4
in fp32 after a prefill and at every decode step, greedy tokens equal to its `generate`,
`generate --engine native` replying as transformers' model does without importing it; llmcli's
transformers engine cannot load these checkpoints, AutoModelForCausalLM does not take them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from test_qwen35 import (  # noqa: F401  (collected here, `loaded` on this module's `folder`)
    loaded,
    test_greedy_tokens_equal_transformers_generate,
    test_prefill_and_every_decode_step_match_transformers,
)

from tiny_models import IDEFICS3_FAMILIES, build_tiny_idefics3


@pytest.fixture(scope="module")
def reference(folder: Path):
    """transformers' whole model, vision tower and all."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=sorted(IDEFICS3_FAMILIES))
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_idefics3(tmp_path_factory.mktemp("models") / request.param, request.param)


def test_the_lean_loader_reads_the_language_model_alone(folder: Path, loaded, reference) -> None:  # noqa: F811
    assert loaded.model.architecture == IDEFICS3_FAMILIES[folder.name][1] == type(reference).__name__
    names = [name for name, _ in loaded.model.named_parameters()]
    kept = ("vision", "connector", "text_model")
    assert names and not any(part in name for name in names for part in kept)


def test_generate_on_the_native_engine_imports_no_transformers_and_replies_as_the_whole_model(
    folder: Path, reference
) -> None:
    from transformers import AutoTokenizer

    from cli_helpers import run_reporting_imports

    prompt = "The capital of France"
    args = ["generate", "-m", str(folder), "-t", "0", "-n", "12", "--json", "--raw", prompt]
    result = run_reporting_imports(*args, "--engine", "native")
    assert "exit 0 imported -" in result.stderr, result.stderr
    native = json.loads(result.stdout)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        tokens = reference.generate(input_ids=ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :]
    assert native["completion_tokens"] == len(tokens)
    # llmcli holds back a character whose bytes the last token left unfinished (a U+FFFD here).
    assert native["text"] == tokenizer.decode(tokens, skip_special_tokens=True).rstrip("\ufffd")
