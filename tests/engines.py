"""Engines for tests: the backend a loaded model picks by itself (auto: native for the tiny Llama
and Qwen2 models), or one named, with the end-of-sequence ids and context a test wants."""

from __future__ import annotations

import dataclasses

from llmcli.engine.loop import Engine


def engine_for(
    loaded,
    eos_token_ids: frozenset[int] | None = None,
    context_length: int | None = None,
    *,
    backend: str = "auto",
    fast: bool | None = None,
) -> Engine:
    asked = dataclasses.replace(
        loaded,
        engine=backend,
        fast=fast,
        eos_token_ids=loaded.eos_token_ids if eos_token_ids is None else eos_token_ids,
        context_length=context_length or loaded.context_length,
    )
    return Engine.for_loaded(asked)
