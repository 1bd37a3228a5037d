"""configs/ holds the shapes of Qwen3.5's and Qwen3-Next's published language models, which
scripts/bench_families.py --set qwen3.5 measures: each builds in transformers at its published
size, and is a row of the families table the lean loader reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmcli.models.lean_config import LeanConfig

CONFIGS = Path(__file__).parent.parent / "configs"
# Parameters of the language model, in billions (the published totals count a vision tower too).
SIZES = {
    "qwen3.5-0.8b.json": 0.752,
    "qwen3.5-2b.json": 1.882,
    "qwen3.5-9b.json": 8.954,
    "qwen3.5-35b-a3b.json": 34.661,
    "qwen3-next-80b-a3b.json": 79.674,
}


@pytest.mark.parametrize("name", sorted(SIZES))
def test_each_shape_builds_at_its_size_and_is_a_native_row(name: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(CONFIGS / name))
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(SIZES[name], abs=0.001)
    config = LeanConfig(json.loads((CONFIGS / name).read_text()))
    assert config.family is not None and config.family.runtime == "qwen3_5"
    assert config.layer_types == model.config.layer_types
