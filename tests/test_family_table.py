"""The families table (models/families.py) and the engine agree: each row runs on an engine
module, each engine module runs some row, a GGUF name finds its row again, and the defaults a
row fills in are transformers' own."""

from __future__ import annotations

from typing import Any

import pytest

from llmcli.engine.native.families import FAMILIES as ENGINE_FAMILIES
from llmcli.models.families import BY_GGUF, FAMILIES, RUNTIMES, Family, by_gguf, family
from llmcli.models.lean_config import DEFAULTS

ROWS = list(FAMILIES.values())


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.architecture)
def test_every_row_runs_on_an_engine_family(row: Family) -> None:
    module = ENGINE_FAMILIES[row.runtime]
    assert callable(module.check_supported) and callable(module.weights)
    assert family(row.architecture) is row


def test_every_engine_family_runs_some_row() -> None:
    assert set(ENGINE_FAMILIES) == set(RUNTIMES) == {row.runtime for row in ROWS}


def test_gguf_names_map_back_to_their_row() -> None:
    for row in ROWS:
        assert all(by_gguf(name) is row for name in row.gguf), row.architecture
        assert not (row.gguf_permuted or row.gguf_required) or row.gguf, row.architecture
    assert sorted(BY_GGUF) == ["gemma4", "llama", "qwen2", "qwen3", "qwen35", "qwen35moe", "qwen3next"]


def test_a_rows_fields_agree() -> None:
    """A row's defaults give the activation it reads; only per-expert experts have a layout; only
    experts may come as MXFP4."""
    for row in ROWS:
        field, value = row.activation
        assert {**DEFAULTS, **row.config_defaults}[field] == value, row.architecture
        assert (row.expert_layout is not None) == (row.experts == "per-expert"), row.architecture
        assert not row.mxfp4_on_cpu or row.experts == "stacked", row.architecture


def _transformers_config(architecture: str) -> Any | None:
    """transformers' configuration for `architecture`, with its class defaults; None where
    transformers has no such causal LM."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    mappings = (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    model_types = [kind for mapping in mappings for kind, name in mapping.items() if name == architecture]
    if not model_types:
        return None
    # A multimodal model type maps to its text model too (qwen3_5), and a vision-language row
    # runs its language model: the text config is the row's.
    config = CONFIG_MAPPING[model_types[0]]().get_text_config()
    # A config whose layers differ (Gemma 4's) reads its global values only where allowed to.
    config.allow_global_per_layer_attribute_access = True
    return config


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.architecture)
def test_config_defaults_are_transformers_own(row: Family) -> None:
    config = _transformers_config(row.architecture)
    if config is None:
        pytest.skip(f"transformers has no {row.architecture}")
    rope = dict(config.rope_parameters or {})
    for key, value in row.config_defaults.items():
        if key == "rope_theta" and not hasattr(config, key):  # transformers 5 keeps it with the RoPE
            assert rope["rope_theta"] == value
        elif key == "sliding_window_pattern" and not hasattr(config, key):  # settled into layer kinds
            kinds = type(config)(num_hidden_layers=2 * value).layer_types
            assert [i for i, kind in enumerate(kinds) if kind == "full_attention"] == [
                value - 1,
                2 * value - 1,
            ]
        else:
            assert getattr(config, key) == value, key
    if row.default_rope is not None:
        assert {key: value for key, value in rope.items() if key != "rope_theta"} == dict(row.default_rope)
